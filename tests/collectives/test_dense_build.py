"""Dense builders as data: message pairing, tags, pipelining, composition, bad input, selection."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest

from asynccoll.collectives import (
    ALLGATHER_ALGORITHMS,
    ALLREDUCE_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    REDUCE_SCATTER_ALGORITHMS,
    CostModel,
    allgather,
    allreduce,
    barrier,
    broadcast,
    build_allreduce,
    build_barrier,
    build_broadcast,
    build_reduce_scatter,
    choose_allgather,
    choose_allreduce,
    choose_broadcast,
    choose_reduce_scatter,
    next_tag,
    reduce_scatter,
    scratch_buffers,
    scratch_slots,
)
from asynccoll.sched import Executor, Schedule
from asynccoll.testing import inproc_world

Msg = tuple[int, int, int]  # src, dst, tag


def messages(scheds: list[Schedule]) -> tuple[Counter[Msg], Counter[Msg]]:
    """Sends and receives of all ranks, keyed by (src, dst, tag)."""
    sends: Counter[Msg] = Counter()
    recvs: Counter[Msg] = Counter()
    for s in scheds:
        for op in s.ops:
            if op.kind == "send":
                sends[(s.rank, op.peer, op.tag)] += 1
            elif op.kind == "recv":
                recvs[(op.peer, s.rank, op.tag)] += 1
    return sends, recvs


def every_collective(P: int, n: int, seg: int) -> dict[str, list[Schedule]]:
    out = {f"allreduce-{a}": [allreduce(r, P, n, "float64", "sum", a, segment_bytes=seg)
                              for r in range(P)] for a in ALLREDUCE_ALGORITHMS}
    for a in BROADCAST_ALGORITHMS:
        out[f"broadcast-{a}"] = [broadcast(r, P, n, "float64", P // 2, a, segment_bytes=seg)
                                 for r in range(P)]
    for a in ALLGATHER_ALGORITHMS:
        out[f"allgather-{a}"] = [allgather(r, P, n, "float64", a, segment_bytes=seg)
                                 for r in range(P)]
    for a in REDUCE_SCATTER_ALGORITHMS:
        if a == "ring" or P & (P - 1) == 0:
            out[f"reduce_scatter-{a}"] = [
                reduce_scatter(r, P, n, "float64", "sum", a, segment_bytes=seg)
                for r in range(P)]
    out["barrier"] = [barrier(r, P) for r in range(P)]
    return out


@pytest.mark.parametrize("P", range(1, 10))
def test_every_send_meets_one_receive_of_its_size(P: int) -> None:
    for n, seg in itertools.product((0, 1, P + 1, 45), (8, 1 << 20)):
        for name, scheds in every_collective(P, n, seg).items():
            sends, recvs = messages(scheds)
            assert sends == recvs, f"{name} n={n} seg={seg}"
            assert all(c == 1 for c in sends.values()), f"{name}: a tag is reused on a link"
            sizes: dict[Msg, int] = {}
            for s in scheds:
                for op in s.ops:
                    if op.kind in ("send", "recv") and op.buf is not None:
                        key = (s.rank, op.peer, op.tag) if op.kind == "send" else \
                            (op.peer, s.rank, op.tag)
                        assert sizes.setdefault(key, op.buf.count or 0) == op.buf.count, name
                    if op.kind in ("send", "recv") and n > 0 and name != "barrier":
                        assert op.buf is not None, name
                        assert op.buf.count, f"{name}: empty message"
            if n == 0 and name != "barrier":
                assert not sends, f"{name}: count 0 must move nothing"


def test_tags_stay_in_the_reserved_range_and_next_tag_follows() -> None:
    for P, algo in itertools.product((3, 4, 7), ALLREDUCE_ALGORITHMS):
        for r in range(P):
            s = Schedule(r, P)
            build_allreduce(s, 1000, "int32", algorithm=algo, tag_base=50, segment_bytes=400)
            tags = [op.tag for op in s.ops if op.kind in ("send", "recv")]
            assert min(tags) >= 50
            assert max(tags) < next_tag(s)
    for P in range(1, 10):  # every rank must agree, folded ranks included
        for name, scheds in every_collective(P, 3 * P + 1, 8).items():
            assert len({next_tag(s) for s in scheds}) == 1, f"{name} P={P}"
    s = Schedule(0, 4)
    assert next_tag(s) == 0
    build_barrier(s, tag_base=7)
    assert next_tag(s) == 9


def test_ring_reduction_depends_on_its_own_segment_only() -> None:
    P, n = 4, 4 * 10
    s = allreduce(1, P, n, "float64", algorithm="ring", segment_bytes=16)  # 2-element segments
    ops = s.ops
    computes = [i for i, op in enumerate(ops) if op.kind == "compute"]
    assert len(computes) == (P - 1) * 5
    for i in computes:
        op = ops[i]
        recv_deps = [d for d in op.deps if ops[d].kind == "recv"]
        assert len(recv_deps) == 1
        got = ops[recv_deps[0]].buf
        assert got == op.inputs[1]  # the segment this reduction reads is the one received
        assert op.output == op.inputs[0]
        assert op.output is not None
        assert op.output.count == 2


def test_schedules_round_trip_through_dicts() -> None:
    for name, scheds in every_collective(5, 33, 64).items():
        for s in scheds:
            assert Schedule.from_dict(s.to_dict()) == s, name


@pytest.mark.timeout(30)
async def test_collectives_compose_in_one_schedule() -> None:
    """An 'activation' op, then an allreduce, a broadcast and a second allreduce of another
    dtype on other slots: tags and scratch kept apart by next_tag and scratch_prefix."""
    P, n = 5, 13
    scheds = []
    for r in range(P):
        s = Schedule(r, P, name="composite")
        act = s.nop(label="activation")
        # recursive doubling folds rank 4 at P = 5: next_tag must still agree on every rank
        a = build_allreduce(s, n, "int64", "sum", "recursive_doubling", after=[act],
                            segment_bytes=24)
        b = build_broadcast(s, n, "int64", root=3, tag_base=next_tag(s), after=[a])
        build_allreduce(s, 2 * n, "float32", "max", "rabenseifner", slot="grad",
                        scratch_prefix="g_", tag_base=next_tag(s), after=[b])
        scheds.append(s.commit())
    assert scratch_slots(scheds[0]) == {"tmp": n, "g_tmp": 2 * n}
    xs = [np.arange(n, dtype=np.int64) * (r + 1) for r in range(P)]
    gs = [np.full(2 * n, float(r), np.float32) for r in range(P)]
    bufs = [{"data": xs[r].copy(), "grad": gs[r].copy(), **scratch_buffers(scheds[r])}
            for r in range(P)]
    async with inproc_world(P, delay=0.001, seed=3) as ts:
        exs = [Executor(s, t, b, sched_id=1) for s, t, b in zip(scheds, ts, bufs, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.start() for e in exs)), 10)
    for r in range(P):
        np.testing.assert_array_equal(bufs[r]["data"], np.sum(xs, axis=0))
        np.testing.assert_array_equal(bufs[r]["grad"], np.full(2 * n, P - 1.0, np.float32))


def test_slot_and_scratch_conflicts_are_rejected() -> None:
    s = Schedule(0, 3)
    s.declare("data", None)
    build_allreduce(s, 10, "int32")
    with pytest.raises(ValueError, match="slot"):
        build_allreduce(s, 11, "int32")  # data already has 10 elements
    with pytest.raises(ValueError, match="scratch_prefix"):
        build_reduce_scatter(s, 10, "float32", slot="x")  # tmp holds int32
    s2 = Schedule(0, 3)
    s2.declare("tmp", None)
    with pytest.raises(ValueError, match="scratch_prefix"):
        build_allreduce(s2, 10, "int32")


@pytest.mark.parametrize(("call", "arg"), [
    (lambda: allreduce(0, 4, 10, "f4", algorithm="bogus"), "algorithm"),
    (lambda: allreduce(0, 4, 10, "f4", op="mean"), "op"),
    (lambda: reduce_scatter(0, 4, 10, "f4", op="avg"), "op"),
    (lambda: allreduce(0, 0, 10, "f4"), "world_size"),
    (lambda: allreduce(4, 4, 10, "f4"), "rank"),
    (lambda: allreduce(-1, 4, 10, "f4"), "rank"),
    (lambda: allreduce(0, 4, -1, "f4"), "count"),
    (lambda: allreduce(0, 4, 2.5, "f4"), "count"),
    (lambda: allgather(0, 4, -3, "f4"), "count"),
    (lambda: allreduce(0, 4, 10, "object"), "dtype"),
    (lambda: allreduce(0, 4, 10, "datetime64[s]"), "dtype"),
    (lambda: allreduce(0, 4, 10, "not-a-dtype"), "dtype"),
    (lambda: broadcast(0, 4, 10, "f4", root=4), "root"),
    (lambda: barrier(0, 0), "world_size"),
    (lambda: allreduce(0, 4, 10, "f4", tag_base=-1), "tag_base"),
    (lambda: allreduce(0, 4, 10, "f4", segment_bytes=0), "segment_bytes"),
    (lambda: build_allreduce(Schedule(0, 2), 10, "f4", after=[3]), "after"),
    (lambda: choose_allreduce(4, -1), "nbytes"),
    (lambda: allgather(0, 4, 10, "f4", "bogus"), "algorithm"),
    (lambda: broadcast(0, 4, 10, "f4", 0, "bogus"), "algorithm"),
    (lambda: broadcast(0, 4, 10, "f4", True), "root"),
    (lambda: reduce_scatter(0, 4, 10, "f4", "sum", "bogus"), "algorithm"),
    (lambda: reduce_scatter(0, 6, 10, "f4", "sum", "recursive_halving"), "algorithm"),
    (lambda: CostModel(alpha=-1.0), "alpha"),
])
def test_bad_input_names_the_argument(call: Any, arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        call()


def test_selection_by_size_and_world_size() -> None:
    for nbytes in (4, 4096, 1 << 20):
        assert choose_allreduce(2, nbytes) == "recursive_doubling"
    assert choose_allreduce(2, 64 << 20) == "rabenseifner"  # halves each rank's reduction
    for P in (4, 8):
        assert choose_allreduce(P, 4) == "recursive_doubling"
        assert choose_allreduce(P, 4096) == "recursive_doubling"
        assert choose_allreduce(P, 16 << 20) == "rabenseifner"
    for P in (3, 5, 6, 7, 9):
        assert choose_allreduce(P, 4) == "recursive_doubling"
        assert choose_allreduce(P, 16 << 20) == "ring"
    # a network with negligible latency: bandwidth decides from small sizes on
    fast = CostModel(alpha=1e-9)
    assert choose_allreduce(4, 64 << 10, fast) == "rabenseifner"
    assert choose_allreduce(4, 64 << 10) == "recursive_doubling"
    # allgather: Bruck's log2 P steps for small blocks, the copy-free ring for large ones
    assert choose_allgather(8, 4096) == "bruck"
    assert choose_allgather(8, 16 << 20) == "ring"
    assert choose_allgather(2, 4) == "ring"  # one step either way; the ring copies nothing
    # broadcast: the binomial tree for small messages, scatter-allgather for large ones
    assert choose_broadcast(8, 4096) == "binomial"
    assert choose_broadcast(8, 16 << 20) == "scatter_allgather"
    assert choose_broadcast(2, 64 << 20) == "binomial"
    assert choose_reduce_scatter(8, 1 << 20) == "recursive_halving"
    assert choose_reduce_scatter(6, 1 << 20) == "ring"
    # the builder records what it chose
    s = allreduce(0, 6, 16 << 20, "uint8")
    assert s.meta["collectives"][0]["algorithm"] == "ring"


def test_cupy_buffers_if_installed() -> None:
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    P, n = 3, 100
    xs = [cupy.arange(n, dtype=cupy.float32) * (r + 1) for r in range(P)]

    async def go() -> None:
        scheds = [allreduce(r, P, n, "float32", algorithm="ring", segment_bytes=64)
                  for r in range(P)]
        bufs = [{"data": xs[r], **scratch_buffers(scheds[r], like=xs[r])} for r in range(P)]
        async with inproc_world(P) as ts:
            exs = [Executor(s, t, b, sched_id=1) for s, t, b in zip(scheds, ts, bufs,
                                                                   strict=True)]
            await asyncio.wait_for(asyncio.gather(*(e.start() for e in exs)), 20)

    asyncio.run(go())
    for r in range(P):
        np.testing.assert_array_equal(cupy.asnumpy(xs[r]), np.arange(n, dtype=np.float32) * 6)
