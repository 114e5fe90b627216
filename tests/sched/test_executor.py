"""The executor: activation, OR / k-of-n dependencies, persistence, errors, binding, traces."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from asynccoll import (
    CollectiveTimeoutError,
    ExecutionError,
    Executor,
    PeerLostError,
    ProtocolError,
    Schedule,
    TransportClosedError,
    register_kernel,
)
from asynccoll.sched import BUILTIN_KERNELS, Payload
from asynccoll.testing import inproc_world, run_schedules
from asynccoll.transport import PROTOCOL_VERSION, Format, Header, Kind
from asynccoll.transport.inproc import InprocTransport

pytestmark = pytest.mark.timeout(20)

#: the built-ins and this module's test kernels (registered below), passed to commit/Executor
KERNELS = BUILTIN_KERNELS.extended()

FIRES: list[tuple[int, Any]] = []


def _record(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
            msgs: Sequence[Any]) -> None:
    FIRES.append((params["rank"], [m.header.src for m in msgs]))


register_kernel(KERNELS, "test_record", _record)


def _hdr(src: int = 1, sched: int = 1, execution: int = 0, tag: int = 0) -> Header:
    return Header(PROTOCOL_VERSION, int(Kind.DATA), sched, execution, tag, src, "", (),
                  int(Format.RAW), 0)


def ring_shift(rank: int, P: int, n: int) -> Schedule:
    s = Schedule(rank, P, "shift", {"x": n, "tmp": n})
    snd = s.send((rank + 1) % P, "x")
    rcv = s.recv((rank - 1) % P, "tmp")
    s.compute("sum", ["x", "tmp"], "x", deps=[snd, rcv])
    return s.commit()


async def test_run_schedules_ring_shift() -> None:
    P = 4
    async with inproc_world(P) as ts:
        bufs = [{"x": np.full(3, r + 1.0), "tmp": np.zeros(3)} for r in range(P)]
        exs = await run_schedules(ts, [ring_shift(r, P, 3) for r in range(P)], bufs)
        for r in range(P):
            assert bufs[r]["x"].tolist() == [r + 1.0 + (r - 1) % P + 1.0] * 3
            assert exs[r].completed == 0
            assert exs[r].test()


async def test_or_activation_with_simultaneous_initiators_fires_once() -> None:
    """Three initiators activate rank 3 at once; its OR op and the forward send fire once."""
    P, executions = 5, 6
    FIRES.clear()
    async with inproc_world(P, delay=0.001, seed=4) as ts:
        inits = []
        for r in range(3):
            s = Schedule(r, P, "initiator")
            s.send(3, None, tag=0, msg="activation")
            inits.append(Executor(s.commit(), ts[r], sched_id=5))
        t = Schedule(3, P, "target")
        recvs = [t.recv(r, None, tag=0, msg="activation") for r in range(3)]
        act = t.compute("test_record", deps=recvs, k=1, recvs=recvs, rank=3)
        fwd = t.send(4, None, tag=1, msg="activation", deps=act)
        t.final = t.nop(deps=[act, fwd])
        target = Executor(t.commit(KERNELS), ts[3], sched_id=5, persistent=True,
                          kernels=KERNELS)
        f = Schedule(4, P, "leaf")
        f.recv(3, None, tag=1, msg="activation")
        leaf = Executor(f.commit(), ts[4], sched_id=5, persistent=True)
        for e in range(executions):
            got_t, got_l = target.current, leaf.current
            # every initiator activates at the same moment; rank 3 never calls start()
            await asyncio.wait_for(asyncio.gather(*(x.start() for x in inits)), 5)
            assert await asyncio.wait_for(got_t, 5) == e
            assert await asyncio.wait_for(got_l, 5) == e
            rec = target.trace.record(e)
            assert rec["activation"] == "external"
        await asyncio.sleep(0.005)  # let the last late activations land
        assert len(FIRES) == executions
        assert all(len(srcs) == 1 for _, srcs in FIRES)  # only the first activation is seen
        assert target.completed == leaf.completed == executions - 1
        # every activation not consumed was either retired unmatched or dropped on arrival
        assert ts[3].matcher.dropped <= 2 * executions
        assert not ts[3].matcher.errors
        assert not ts[4].matcher.errors
        assert ts[4].matcher.held_count == 0
        assert ts[4].matcher.dropped == 0  # the forwarding send fired once per execution
        for x in (*inits, target, leaf):
            x.close()


async def test_k_of_n_fires_after_k_and_ignores_the_rest() -> None:
    async with inproc_world(4) as ts:
        FIRES.clear()
        s = Schedule(0, 4, "quorum")
        recvs = [s.recv(r, None, tag=0) for r in (1, 2, 3)]
        q = s.compute("test_record", deps=recvs, k=2, recvs=recvs, rank=0)
        s.final = q
        ex = Executor(s.commit(KERNELS), ts[0], sched_id=2, kernels=KERNELS)
        done = ex.start()
        sends = []
        for r in (2, 3):
            ss = Schedule(r, 4, "s")
            ss.send(0, None, tag=0)
            sends.append(Executor(ss.commit(), ts[r], sched_id=2))
        for x in sends:
            await x.start()
        assert await asyncio.wait_for(done, 1) == 0
        assert FIRES == [(0, [2, 3])]
        assert ts[0].matcher.posted_count == 0  # the receive from rank 1 was retired


async def test_start_is_idempotent_and_wait_test() -> None:
    async with inproc_world(1) as (t,):
        s = Schedule(0, 1)
        s.nop()
        ex = Executor(s.commit(), t, sched_id=1)
        assert not ex.test()
        f1 = ex.start()
        assert f1.done()
        assert ex.test()
        assert await ex.wait(1) == 0
        assert await ex.start() == 1  # the next execution of a non-persistent schedule
    async with inproc_world(2) as ts:
        FIRES.clear()
        s = Schedule(0, 2)
        src = s.compute("test_record", rank=0)
        rcv = s.recv(1, None)
        ex = Executor(s.commit(KERNELS), ts[0], sched_id=1, kernels=KERNELS)
        f2, f3 = ex.start(), ex.start()  # the same pending execution, started once
        assert f2 is f3
        assert not ex.test()
        assert FIRES == [(0, [])]
        ts[1].post_send(0, _hdr(), b"")
        assert await asyncio.wait_for(ex.wait(), 1) == 0
        assert ex.test()
        assert rcv == 1
        assert src == 0


async def test_wait_timeout_lists_pending_ops(inproc2: list[InprocTransport]) -> None:
    ts = inproc2
    ex = Executor(ring_shift(0, 2, 2), ts[0], {"x": np.zeros(2), "tmp": np.zeros(2)},
                  sched_id=1)
    ex.start()
    with pytest.raises(CollectiveTimeoutError, match="waiting for rank 1") as info:
        await ex.wait(0.01)
    # first the execution as a whole (op id -1), then each pending op
    assert [(r, i) for r, i, _ in info.value.pending] == [(0, -1), (0, 1)]
    assert info.value.pending[0][2] == "execution 0: waiting for rank(s) [1]"
    assert "op 1 recv(peer=1, tag=0, buf=tmp)" in info.value.pending[1][2]
    ex.close()


async def test_close_fails_the_pending_execution_and_retires_receives() -> None:
    async with inproc_world(2) as ts:
        ex = Executor(ring_shift(0, 2, 2), ts[0], {"x": np.zeros(2), "tmp": np.zeros(2)},
                      sched_id=1, persistent=True)
        fut = ex.start()
        ex.close()
        ex.close()
        with pytest.raises(TransportClosedError):
            await fut
        with pytest.raises(TransportClosedError):
            ex.start()
        assert ts[0].matcher.posted_count == 0


async def test_lost_peer_fails_the_execution() -> None:
    async with inproc_world(2) as ts:
        ex = Executor(ring_shift(0, 2, 2), ts[0], {"x": np.zeros(2), "tmp": np.zeros(2)},
                      sched_id=1)
        fut = ex.start()
        await ts[1].close()
        with pytest.raises(PeerLostError, match="rank 1"):
            await asyncio.wait_for(fut, 1)
        with pytest.raises(PeerLostError):
            ex.start()  # the error sticks


def _boom(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
          msgs: Sequence[Any]) -> None:
    raise RuntimeError("kernel exploded")


register_kernel(KERNELS, "test_boom", _boom)


@pytest.mark.parametrize("offload_bytes", [1 << 30, 0])
async def test_kernel_failure_names_the_op(offload_bytes: int) -> None:
    async with inproc_world(1) as (t,):
        s = Schedule(0, 1, "k", {"x": 4})
        s.compute("test_boom", ["x"], "x")
        ex = Executor(s.commit(KERNELS), t, {"x": np.zeros(4)}, sched_id=1,
                      offload_bytes=offload_bytes, kernels=KERNELS)
        with pytest.raises(ExecutionError, match=r"op 0 compute.*kernel exploded") as info:
            await asyncio.wait_for(ex.start(), 5)
        assert isinstance(info.value.__cause__, RuntimeError)


async def test_large_kernels_run_off_the_loop_with_the_same_result() -> None:
    async with inproc_world(1) as (t,):
        s = Schedule(0, 1, "big", {"a": 1000, "b": 1000})
        c1 = s.compute("sum", ["a", "b"], "a")
        s.compute("max", ["a", "b"], "b", deps=c1)
        a, b = np.arange(1000.0), np.full(1000, 10.0)
        ex = Executor(s.commit(), t, {"a": a, "b": b}, sched_id=1, offload_bytes=64)
        await asyncio.wait_for(ex.start(), 5)
        assert a[3] == 13.0
        assert b[0] == 10.0
        assert b[999] == 1009.0


async def test_on_complete_error_fails_the_execution() -> None:
    async with inproc_world(1) as (t,):
        s = Schedule(0, 1)
        s.nop()

        def bad(e: int) -> None:
            raise KeyError("result handler")

        ex = Executor(s.commit(), t, sched_id=1, on_complete=bad)
        with pytest.raises(ExecutionError, match="on_complete of execution 0"):
            await ex.start()


async def test_mismatched_length_across_ranks_is_an_execution_error() -> None:
    async with inproc_world(2) as ts:
        a = Executor(ring_shift(0, 2, 4), ts[0], {"x": np.zeros(4), "tmp": np.zeros(4)},
                     sched_id=1)
        b = Executor(ring_shift(1, 2, 2), ts[1], {"x": np.zeros(2), "tmp": np.zeros(2)},
                     sched_id=1)
        fa, fb = a.start(), b.start()
        with pytest.raises(ExecutionError, match="mismatched shapes or dtypes"):
            await asyncio.wait_for(fa, 1)
        with pytest.raises(ProtocolError, match="overflows the posted receive of 16 bytes"):
            await asyncio.wait_for(fb, 1)


async def test_binding_checks_name_the_slot() -> None:
    async with inproc_world(2) as ts:
        s = ring_shift(0, 2, 4)
        with pytest.raises(ValueError, match="slot 'tmp' is missing"):
            Executor(s, ts[0], {"x": np.zeros(4)}, sched_id=1)
        with pytest.raises(ValueError, match="buffer 'x' has 3 elements"):
            Executor(s, ts[0], {"x": np.zeros(3), "tmp": np.zeros(4)}, sched_id=1)
        with pytest.raises(TypeError, match="buffer 'x' must be a NumPy or CuPy array"):
            Executor(s, ts[0], {"x": [0, 0, 0, 0], "tmp": np.zeros(4)}, sched_id=1)
        with pytest.raises(ValueError, match="'x' must be C-contiguous"):
            Executor(s, ts[0], {"x": np.zeros(8)[::2], "tmp": np.zeros(4)}, sched_id=1)
        with pytest.raises(ValueError, match="rank 1 of 2"):
            Executor(ring_shift(1, 2, 4), ts[0], {"x": np.zeros(4), "tmp": np.zeros(4)},
                     sched_id=1)


def _pack(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
          msgs: Sequence[Any]) -> Payload:
    nz = np.flatnonzero(inputs[0]).astype(np.int32)
    return Payload(nz, "<i4", (nz.size,), int(Format.SPARSE))


def _unpack(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
            msgs: Sequence[Any]) -> None:
    out[...] = 0
    out[np.frombuffer(msgs[0].payload, np.int32)] = 1


register_kernel(KERNELS, "test_pack", _pack)
register_kernel(KERNELS, "test_unpack", _unpack)


async def test_payload_of_runtime_length() -> None:
    async with inproc_world(2) as ts:
        s0 = Schedule(0, 2, "p", {"x": 8})
        c = s0.compute("test_pack", ["x"])
        s0.send(1, None, tag=2, deps=c, payload_from=c)
        s1 = Schedule(1, 2, "p", {"y": 8})
        r = s1.recv(0, None, tag=2)
        s1.compute("test_unpack", [], "y", deps=r, recvs=[r])
        x = np.array([0, 3, 0, 0, 1, 0, 0, 2], np.float32)
        y = np.zeros(8, np.float32)
        exs = await run_schedules(ts, [s0.commit(KERNELS), s1.commit(KERNELS)],
                                  [{"x": x}, {"y": y}], kernels=KERNELS)
        assert y.tolist() == [0, 1, 0, 0, 1, 0, 0, 1]
        assert exs[0].trace.record(0)["ops"][1][3] == 12  # three int32 indices went out


async def test_trace_records_each_op_and_exports_json() -> None:
    async with inproc_world(2, link_delay={(1, 0): 0.01}) as ts:
        bufs = [{"x": np.ones(4, np.float32), "tmp": np.zeros(4, np.float32)} for _ in ts]
        exs = await run_schedules(ts, [ring_shift(r, 2, 4) for r in range(2)], bufs,
                                  executions=3)
        tr = exs[0].trace
        assert tr.executions() == [0, 1, 2]
        doc = json.loads(json.dumps(tr.to_dict()))
        assert doc["columns"] == ["posted", "fired", "completed", "bytes"]
        rec = doc["executions"][2]
        assert rec["execution"] == 2
        assert rec["activation"] == "internal"
        assert rec["armed"] <= rec["started"] <= rec["completed"]
        (s_post, _, s_done, s_bytes), (r_post, _, r_done, r_bytes), comp, final = \
            rec["ops"]
        assert s_bytes == r_bytes == 16
        assert comp[3] == 16
        assert final[3] == 0
        assert s_post <= s_done
        assert r_post <= r_done
        assert r_done - r_post >= 0.009  # the receive waited on the slow link
        assert comp[1] >= r_done
        assert final[2] >= comp[2]


async def test_trace_ring_keeps_the_last_executions_and_sink_gets_each() -> None:
    got: list[int] = []
    async with inproc_world(1) as (t,):
        s = Schedule(0, 1)
        s.nop()
        ex = Executor(s.commit(), t, sched_id=1, trace_capacity=2,
                      trace_sink=lambda rec: got.append(rec["execution"]))
        for _ in range(5):
            await ex.start()
        assert ex.trace.executions() == [3, 4]
        assert got == [0, 1, 2, 3, 4]
        with pytest.raises(KeyError, match="execution 1"):
            ex.trace.record(1)


async def test_trace_of_the_running_execution_is_live() -> None:
    async with inproc_world(2) as ts:
        ex = Executor(ring_shift(0, 2, 2), ts[0], {"x": np.zeros(2), "tmp": np.zeros(2)},
                      sched_id=1)
        ex.start()
        rec = ex.trace.record(0)
        (_, s_fired, s_done, s_bytes), (_, r_fired, r_done, _), comp, _ = rec["ops"]
        assert s_fired is not None
        assert s_done is not None
        assert s_bytes == 16
        assert r_fired is not None  # posted
        assert r_done is None  # still waiting for rank 1
        assert comp == [None, None, None, 0]
        ex.close()  # what was recorded stays in the ring
        assert ex.trace.record(0)["ops"][0][3] == 16
        assert ex.trace.record(0)["ops"][1][2] is None


async def test_current_after_failure_or_close_does_not_rearm() -> None:
    async with inproc_world(2) as ts:
        ex = Executor(ring_shift(0, 2, 2), ts[0], {"x": np.zeros(2), "tmp": np.zeros(2)},
                      sched_id=1, persistent=True)
        fut = ex.start()
        await ts[1].close()
        with pytest.raises(PeerLostError):
            await asyncio.wait_for(fut, 1)
        assert ex.current is fut  # the failed execution, not a fresh one
        assert ex.pending() == []
        assert ts[0].matcher.posted_count == 0
        ex.close()
        assert ex.current is fut
    async with inproc_world(1) as (t,):
        s = Schedule(0, 1)
        s.nop()
        never = Executor(s.commit(), t, sched_id=1)
        never.close()
        with pytest.raises(TransportClosedError):
            await never.current


async def test_pending_is_empty_once_complete() -> None:
    async with inproc_world(3) as ts:
        s = Schedule(0, 3, "or")
        r1 = s.recv(1, None, msg="activation")
        r2 = s.recv(2, None, msg="activation")
        s.final = s.nop(deps=[r1, r2], k=1)
        ex = Executor(s.commit(), ts[0], sched_id=1)
        fut = ex.start()
        assert [i for _, i, _ in ex.pending()] == [-1, 0, 1]
        ts[1].post_send(0, _hdr(src=1), b"")
        assert await asyncio.wait_for(fut, 1) == 0
        assert ex.pending() == []  # the receive from rank 2 was retired, not pending
        assert ts[0].matcher.posted_count == 0


@pytest.mark.timeout(10)
async def test_activate_fires_the_receive_of_a_forced_activation() -> None:
    """``Executor.activate`` delivers an activation message to this rank itself: the schedule's
    receive on that tag from itself fires, for the execution named, and nothing else."""
    async with inproc_world(2) as (t0, _t1):
        s = Schedule(0, 2, "forced", {})
        forced = s.recv(0, None, 5, msg="activation")
        s.nop(deps=[forced])
        s.commit()
        ex = Executor(s, t0, {}, sched_id=9, persistent=True)
        fut = ex.current
        await asyncio.sleep(0.01)
        assert not fut.done()
        ex.activate(1, 5)  # a later execution's activation is held, not taken by this one
        await asyncio.sleep(0.01)
        assert not fut.done()
        ex.activate(0, 5)
        assert await asyncio.wait_for(fut, 1) == 0
        await asyncio.sleep(0.01)
        assert ex.execution == 2  # the held activation completed execution 1 once it was armed
        ex.close()
