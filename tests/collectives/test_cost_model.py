"""Messages per execution of the partial allreduce, held to the cost model of docs/partial.md
("Cost per execution").

The model is computed here from its formulas (hypercube arithmetic), not from the builders'
code. Three counts are held to it:

* the send and receive ops of the committed schedules (``build_partial_allreduce``);
* the frames each rank receives over the in-process transport, counted at the receiving end
  (``InprocTransport.arrive`` wrapped per rank): every frame that crosses between two ranks,
  whatever sent it, keyed by schedule, execution, sender and tag. A received frame is what the
  model counts as one wake-up of its rank;
* the send ops each rank's trace shows posted (``local_world(trace=...)``, read back with
  ``asynccoll.inspect.tracefile.load_dir``), which must equal the frames counted, per rank,
  execution and part.

Frames are sorted by tag into *arrival* (quorum), *activation* and *data* (the allreduce of the
data and the meta vector). Where a single rank activates an execution the count is exact; where
several may (concurrent solo callers, both two-choice initiators, every quorum rank) the
activation is bounded by the model, and the arrivals and the data stay exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asynccoll import Quorum
from asynccoll.collectives.partial import (
    TAG_ACTIVATION,
    TAG_ARRIVAL,
    TAG_DATA,
    build_partial_allreduce,
    initiators,
)
from asynccoll.comm.partial import PartialAllreduce
from asynccoll.inspect.tracefile import load_dir
from asynccoll.testing import local_world, policy_of
from asynccoll.transport.frames import Kind
from asynccoll.transport.inproc import InprocTransport

PS = [2, 3, 4, 5, 8]
PARTS = ("arrival", "activation", "data")
Cost = dict[str, list[int]]  # part -> per-rank count


# -- the model (docs/partial.md, "Cost per execution") -------------------------------------------
def dims(P: int) -> int:
    """d = ceil(log2 P): the activation hypercube has Q = 2**d nodes."""
    return (P - 1).bit_length()


def hosted(r: int, P: int) -> int | None:
    """The missing node r + Q/2 that rank r hosts, or None."""
    half = (1 << dims(P)) >> 1
    return r + half if half and r < half and r + half >= P else None


def nodes(r: int, P: int) -> list[int]:
    v = hosted(r, P)
    return [r] if v is None else [r, v]


def tz(x: int) -> int:
    """Trailing zeros of x > 0: the dimension along which the binomial tree reaches a node."""
    return (x & -x).bit_length() - 1


def fused(P: int) -> bool:
    """Whether the activation is fused with the data: P a power of two (the sizes here take
    recursive doubling, whose first exchange is with ``rank ^ 1``, along dimension 0)."""
    return P >= 2 and P & (P - 1) == 0


def activation_from(u: int, P: int) -> tuple[list[int], list[int]]:
    """Per rank (sent, received) activation messages when u alone initiates: u sends along
    every dimension but an internal or a fused one, a node reached along dimension k forwards
    along the k below it (but the fused one); every node but u, the one u hosts (reached inside
    u) and the ones reached along the fused dimension (by data) receives one."""
    f = 0 if fused(P) else None
    sent, recv = [0] * P, [0] * P
    for r in range(P):
        for x in nodes(r, P):
            if x == u:
                sent[r] += dims(P) - (hosted(u, P) is not None) - (f is not None)
            else:
                k = tz(x ^ u)
                sent[r] += k - (f is not None and f < k)
                recv[r] += x != hosted(u, P) and k != f
    return sent, recv


def activation_all(P: int) -> list[int]:
    """Per rank, every activation send (and receive) of its schedule: d, or 2d - 2 for a rank
    hosting a missing node (the edge between them is internal), or d - 1 when fused."""
    d = dims(P)
    if fused(P):
        return [d - 1] * P
    return [2 * d - 2 if hosted(r, P) is not None else d for r in range(P)]


def data_recursive_doubling(P: int) -> list[int]:
    """Per rank, messages sent (= received) by the recursive-doubling allreduce: log2 P' for
    the P' = 2**floor(log2 P) core ranks, one more for the r = P - P' of them that take a folded
    rank's data and give it the result, one for each folded rank."""
    p2 = 1 << (P.bit_length() - 1)
    lg = p2.bit_length() - 1
    return [lg + 1 if r < P - p2 else lg if r < p2 else 1 for r in range(P)]


def a1(u: int, P: int) -> int:
    """Activation messages of one execution initiated by u alone: Q - 1, less one if u hosts;
    P/2 - 1 when fused."""
    if fused(P):
        return P // 2 - 1
    return (1 << dims(P)) - 1 - (hosted(u, P) is not None) if P > 1 else 0


def test_model_closed_forms() -> None:
    # the per-rank functions add up to the totals the doc's table states
    for P in range(1, 40):
        d, Q = dims(P), 1 << dims(P)
        for u in range(P):
            sent, recv = activation_from(u, P)
            assert sum(sent) == sum(recv) == a1(u, P) < 2 * P
            assert max(recv) <= 2
        assert sum(activation_all(P)) == (P * (d - 1) if fused(P) else Q * d - 2 * (Q - P))
        p2 = 1 << (P.bit_length() - 1)
        assert sum(data_recursive_doubling(P)) == p2 * (p2.bit_length() - 1) + 2 * (P - p2)
    assert [sum(activation_all(P)) for P in PS] == [0, 6, 4, 18, 16]
    assert [sum(data_recursive_doubling(P)) for P in PS] == [2, 4, 8, 10, 24]


# -- the committed schedules ---------------------------------------------------------------------
def part_of(tag: int) -> str:
    if tag == TAG_ARRIVAL:
        return "arrival"
    if TAG_ACTIVATION <= tag < TAG_DATA:
        return "activation"
    assert tag >= TAG_DATA, f"tag {tag} belongs to no part of a partial allreduce"
    return "data"


@pytest.mark.parametrize("dtype", ["float64", "float16"])
@pytest.mark.parametrize(("kind", "quorum"), [("solo", None), ("majority", None),
                                              ("two_choice", None), ("quorum", 1)])
def test_schedule_ops_match_the_model(kind: str, quorum: int | None, dtype: str) -> None:
    # float16 cannot carry the meta vector: it gets an allreduce of its own
    n_allreduce = 1 if dtype == "float64" else 2
    for P in range(1, 18):
        for r in range(P):
            s = build_partial_allreduce(r, P, 3, dtype, kind=kind, quorum=quorum)
            ops: dict[tuple[str, str], int] = {}
            for op in s.ops:
                if op.kind in ("send", "recv") and op.peer != r:
                    key = (op.kind, part_of(op.tag))
                    ops[key] = ops.get(key, 0) + 1
            for way in ("send", "recv"):
                assert ops.get((way, "arrival"), 0) == (P - 1 if kind == "quorum" else 0)
                assert ops.get((way, "activation"), 0) == activation_all(P)[r], (P, r, way)
                assert ops.get((way, "data"), 0) == \
                    n_allreduce * data_recursive_doubling(P)[r], (P, r, way)


# -- counting what crosses the in-process transport ----------------------------------------------
class Wire:
    """Every frame delivered to a rank of the world: (schedule, execution, src, dst, tag)."""

    def __init__(self, comms: Sequence[Any], monkeypatch: pytest.MonkeyPatch) -> None:
        self.frames: list[tuple[int, int, int, int, int]] = []
        self.P = len(comms)
        for c in comms:
            t = c.transport
            assert isinstance(t, InprocTransport)
            monkeypatch.setattr(t, "arrive", self._tap(t))

    def _tap(self, t: InprocTransport) -> Any:
        arrive = t.arrive

        def counted(header: Any, data: Any) -> Any:
            self.frames.append((header.sched, header.execution, header.src, t.rank, header.tag))
            return arrive(header, data)

        return counted

    def cost(self, sched: int, execution: int, partial: bool = True) -> tuple[Cost, Cost]:
        """(sent, received) per part and rank for one execution of one schedule."""
        sent = {p: [0] * self.P for p in PARTS}
        recv = {p: [0] * self.P for p in PARTS}
        for sid, e, src, dst, tag in self.frames:
            if (sid, e) == (sched, execution):
                part = part_of(tag) if partial else "data"
                sent[part][src] += 1
                recv[part][dst] += 1
        return sent, recv

    def executions(self, sched: int) -> set[int]:
        return {e for sid, e, *_ in self.frames if sid == sched}


def expect(P: int, *, activation: tuple[list[int], list[int]] | None = None,
           arrived: Sequence[int] = (), quorum: bool = False,
           n_allreduce: int = 1) -> tuple[Cost, Cost]:
    zero = [0] * P
    act_sent, act_recv = activation or (zero, zero)
    data = [n_allreduce * x for x in data_recursive_doubling(P)]
    arr_sent = [P - 1 if r in arrived else 0 for r in range(P)]
    arr_recv = [len(arrived) - (r in arrived) for r in range(P)]
    if not quorum:
        arr_sent, arr_recv = zero, zero
    return ({"arrival": arr_sent, "activation": list(act_sent), "data": data},
            {"arrival": arr_recv, "activation": list(act_recv), "data": data})


def check_exact(wire: Wire, sched: int, e: int, want: tuple[Cost, Cost]) -> None:
    sent, recv = wire.cost(sched, e)
    assert sent == want[0], f"execution {e}: sent {sent}, the model says {want[0]}"
    assert recv == want[1], f"execution {e}: received {recv}, the model says {want[1]}"


def check_bounded(wire: Wire, sched: int, e: int, starters: Sequence[int],
                  want: tuple[Cost, Cost]) -> int:
    """Arrivals and data exact; activation between one starter's tree and every send firing,
    and at most the starters' trees together. Returns the activation messages counted."""
    P = wire.P
    sent, recv = wire.cost(sched, e)
    for part in ("arrival", "data"):
        assert sent[part] == want[0][part], (e, part, sent)
        assert recv[part] == want[1][part], (e, part, recv)
    n = sum(sent["activation"])
    assert sum(recv["activation"]) == n
    low = min(a1(u, P) for u in starters)
    high = min(sum(activation_all(P)), sum(a1(u, P) for u in starters))
    assert low <= n <= high, f"execution {e}: {n} activation messages, not in [{low}, {high}]"
    full = activation_all(P)
    assert all(s <= m for s, m in zip(sent["activation"], full, strict=True)), sent
    assert all(s <= m for s, m in zip(recv["activation"], full, strict=True)), recv
    return n


def check_trace(directory: Path, wire: Wire, sched: int, executions: Sequence[int],
                partial: bool = True) -> None:
    """The send ops each rank's trace shows posted are the frames the wire counted."""
    traces = load_dir(directory)
    assert sorted(traces) == list(range(wire.P))
    for r, rt in traces.items():
        s = rt.schedule(sched)
        assert s is not None
        recs = {rec["execution"]: rec for rec in rt.executions.get(sched, [])}
        for e in executions:
            got = dict.fromkeys(PARTS, 0)
            for op, row in zip(s.ops, recs[e]["ops"], strict=True):
                if op.kind == "send" and row[0] is not None:
                    got[part_of(op.tag) if partial else "data"] += 1
            sent, _ = wire.cost(sched, e, partial)
            assert got == {p: sent[p][r] for p in PARTS}, (r, e, got)


async def settle() -> None:
    """Let the in-process world run until nothing more happens (no delays: messages are
    delivered when sent)."""
    for _ in range(50):
        await asyncio.sleep(0)


def one(x: float = 1.0) -> np.ndarray:
    return np.full(2, x)


def make(comms: Sequence[Any], kind: str, quorum: int | None = None,
         dtype: str = "float64") -> list[PartialAllreduce]:
    hs = [c.partial_allreduce(policy_of(kind, quorum), like=np.zeros(2, dtype), name="cost")
          for c in comms]
    for r, h in enumerate(hs):  # what runs is what the builder commits
        assert h.schedule == build_partial_allreduce(r, len(comms), 2, dtype, kind=kind,
                                                     quorum=quorum)
    return hs


async def flush(hs: Sequence[PartialAllreduce]) -> None:
    await asyncio.wait_for(asyncio.gather(*(h.flush() for h in hs)), 10)


# -- one initiator per execution: exact --------------------------------------------------------
async def run_one_initiator(hs: Sequence[PartialAllreduce], kind: str, e: int,
                            x: np.ndarray) -> int:
    """Execution e started by one rank u of S(e); return u. The ranks outside S(e) call first
    and wait (majority, two-choice); the rest of S(e), and for solo every other rank, call once
    e completed and are answered at once, sending nothing."""
    P = len(hs)
    if kind == "solo":
        u, drawn = e % P, [e % P]
    else:
        drawn = sorted(initiators(kind, e, P, hs[0].seed))
        u = drawn[e % len(drawn)]
    waiting = [asyncio.ensure_future(hs[r](x)) for r in range(P)
               if r not in drawn and kind != "solo"]
    await settle()
    assert not any(w.done() for w in waiting)
    res = await asyncio.wait_for(hs[u](x), 10)
    assert (res.round, res.included) == (e, True)
    for w in await asyncio.wait_for(asyncio.gather(*waiting), 10):
        assert (w.round, w.included) == (e, True)
    await settle()
    for r in range(P):
        if r != u and (kind == "solo" or r in drawn):
            late = await asyncio.wait_for(hs[r](x), 10)
            assert (late.round, late.included) == (e, False)
    return u


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["solo", "majority", "two_choice"])
@pytest.mark.parametrize("P", PS)
async def test_one_initiator_costs_exactly_the_model(
        P: int, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    E = 2 * P  # solo: every rank initiates twice; majority, two-choice: as drawn
    async with local_world(P, progress="inline", trace=str(tmp_path)) as comms:
        wire = Wire(comms, monkeypatch)
        hs = make(comms, kind)
        sid = hs[0].sched_id
        for e in range(E):
            u = await run_one_initiator(hs, kind, e, one())
            check_exact(wire, sid, e, expect(P, activation=activation_from(u, P)))
        await flush(hs)
        await settle()
    check_trace(tmp_path, wire, sid, sorted(wire.executions(sid)))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("P", [3, 4])
async def test_meta_outside_the_data_doubles_the_allreduce(
        P: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with local_world(P, progress="inline", trace=str(tmp_path)) as comms:
        wire = Wire(comms, monkeypatch)
        hs = make(comms, "majority", dtype="float16")
        sid = hs[0].sched_id
        for e in range(P):
            u = await run_one_initiator(hs, "majority", e, one().astype(np.float16))
            check_exact(wire, sid, e,
                        expect(P, activation=activation_from(u, P), n_allreduce=2))
        await flush(hs)
        await settle()
    check_trace(tmp_path, wire, sid, range(P))


# -- several possible initiators: arrivals and data exact, activation bounded (quorum: none)
@pytest.mark.timeout(30)
@pytest.mark.parametrize("P", PS)
async def test_quorum_costs_its_arrivals_and_data_only(
        P: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with local_world(P, progress="inline", trace=str(tmp_path)) as comms:
        wire = Wire(comms, monkeypatch)
        sids = []
        for k in sorted({max(1, P // 2), P}):
            hs = [c.partial_allreduce(Quorum(k), like=np.zeros(2), name=f"q{k}")
                  for c in comms]
            sid = hs[0].sched_id
            sids.append(sid)
            for e in range(P):
                arrived = [(e + i) % P for i in range(k)]
                rs = await asyncio.wait_for(asyncio.gather(*(hs[r](one()) for r in arrived)),
                                            10)
                assert all((res.round, res.included) == (e, True) for res in rs)
                await settle()
                for r in range(P):
                    if r not in arrived:
                        assert (await hs[r](one())).included is False
                # every rank counts the arrivals itself: no activation message at all
                check_exact(wire, sid, e, expect(P, arrived=arrived, quorum=True))
            await flush(hs)
        await settle()
    for sid in sids:
        check_trace(tmp_path, wire, sid, sorted(wire.executions(sid)))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("delay", [0.0, 0.002])
@pytest.mark.parametrize("kind", ["solo", "two_choice", "quorum"])
@pytest.mark.parametrize("P", [3, 5, 8])
async def test_concurrent_calls_stay_within_the_bounds(
        P: int, kind: str, delay: float, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # every rank calls at once: any drawn rank (or every rank) may start the execution
    k = max(1, P // 2)
    quorum = k if kind == "quorum" else None
    E = 4
    async with local_world(P, progress="inline", trace=str(tmp_path), delay=delay,
                           seed=P) as comms:
        wire = Wire(comms, monkeypatch)
        hs = make(comms, kind, quorum)
        sid = hs[0].sched_id
        for e in range(E):
            rs = await asyncio.wait_for(asyncio.gather(*(h(one()) for h in hs)), 10)
            assert {res.round for res in rs} == {e}
            await asyncio.sleep(3 * delay)  # stragglers of e (surplus activation) land
            await settle()
            starters = sorted(initiators(kind, e, P, hs[0].seed))
            if kind == "quorum":
                arrivers = [r for r in range(P)
                            if wire.cost(sid, e)[0]["arrival"][r]]
                assert len(arrivers) >= k
                check_exact(wire, sid, e, expect(P, arrived=arrivers, quorum=True))
            else:
                check_bounded(wire, sid, e, starters, expect(P))
        await flush(hs)
        await asyncio.sleep(3 * delay)
        await settle()
    check_trace(tmp_path, wire, sid, range(E))


# -- the synchronous allreduce, for reference ----------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("P", PS)
async def test_sync_allreduce_reference(P: int, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    E = 3
    async with local_world(P, progress="inline", trace=str(tmp_path)) as comms:
        wire = Wire(comms, monkeypatch)
        for _ in range(E):
            await asyncio.wait_for(asyncio.gather(*(c.allreduce(one()) for c in comms)), 10)
        await settle()
    traces = load_dir(tmp_path)
    (sid,) = [sid for sid, rec in traces[0].schedules.items()
              if rec.get("collective") == "allreduce"]
    data = data_recursive_doubling(P)
    assert sorted(wire.executions(sid)) == list(range(E))
    for e in range(E):
        sent, recv = wire.cost(sid, e, partial=False)
        assert sent == recv == {"arrival": [0] * P, "activation": [0] * P, "data": data}
    check_trace(tmp_path, wire, sid, range(E), partial=False)


# -- the counting can fail -----------------------------------------------------------------------
@pytest.mark.timeout(30)
async def test_a_surplus_message_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    P = 4
    async with local_world(P, progress="inline") as comms:
        wire = Wire(comms, monkeypatch)
        hs = make(comms, "majority")
        sid = hs[0].sched_id
        u = await run_one_initiator(hs, "majority", 0, one())
        want = expect(P, activation=activation_from(u, P))
        check_exact(wire, sid, 0, want)
        # one activation message more than the schedule sends (the receiver drops it)
        v = (u + 1) % P
        await comms[u].transport.post_frame(v, int(Kind.ACTIVATION), sid, 0, TAG_ACTIVATION,
                                            b"")
        await settle()
        with pytest.raises(AssertionError, match="execution 0: sent"):
            check_exact(wire, sid, 0, want)
        with pytest.raises(AssertionError, match="activation messages"):
            check_bounded(wire, sid, 0, [u], want)
        await flush(hs)
