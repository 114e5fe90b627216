"""The activation broadcast reaches every rank for every P and initiator set, each send once."""

from __future__ import annotations

import asyncio
import itertools
import random

import numpy as np
import pytest

from asynccoll.collectives.activation import (
    activation_broadcast,
    build_activation,
    hosted_node,
    hypercube_neighbours,
)
from asynccoll.sched import Executor, Schedule
from asynccoll.testing import inproc_world
from asynccoll.transport.frames import Kind

_ids = itertools.count(1)


def simulate(P: int) -> tuple[np.ndarray, np.ndarray]:
    """Fire the real schedules of all P ranks for all 2**P - 1 initiator sets at once.

    Every op is a bool vector over the initiator sets (bit r of the set's number: rank r
    starts). Returns (activated, per rank and set; activation sends fired, per set).
    """
    n = (1 << P) - 1
    sets = np.arange(1, 1 << P, dtype=np.int64)
    scheds = [activation_broadcast(r, P) for r in range(P)]
    fired = {(r, i): np.zeros(n, bool) for r, s in enumerate(scheds) for i in range(len(s.ops))}
    sends = {}  # (src, dst, tag) -> send op of src
    for r, s in enumerate(scheds):
        for i, op in enumerate(s.ops):
            if op.kind == "send" and op.msg == "activation":
                assert (r, op.peer, op.tag) not in sends  # one send per link and tag
                sends[r, op.peer, op.tag] = i
    changed = True
    while changed:
        changed = False
        for r, s in enumerate(scheds):
            for i, op in enumerate(s.ops):
                if op.msg != "activation" and op.label not in ("internal start", "activated"):
                    continue  # the barrier after it
                if not op.deps and op.kind == "nop":
                    new = ((sets >> r) & 1).astype(bool)  # the internal start
                elif op.kind == "recv":
                    src = sends.get((op.peer, r, op.tag))
                    new = fired[op.peer, src] if src is not None else fired[r, i]
                else:
                    assert op.k == 1  # OR only, so reachability is monotone in the set
                    new = np.logical_or.reduce([fired[r, d] for d in op.deps])
                if not np.array_equal(new, fired[r, i]):
                    fired[r, i] = new
                    changed = True
    act = np.array([fired[r, next(i for i, op in enumerate(s.ops) if op.label == "activated")]
                    for r, s in enumerate(scheds)])
    nsends = sum((fired[r, i].astype(int) for r, s in enumerate(scheds)
                  for i, op in enumerate(s.ops) if op.kind == "send" and op.msg == "activation"),
                 np.zeros(n, int))
    return act, nsends


@pytest.mark.parametrize("P", range(1, 18))
def test_every_initiator_subset_reaches_every_rank(P: int) -> None:
    act, nsends = simulate(P)
    assert act.all()  # every rank activated, for every one of the 2**P - 1 initiator sets
    singles = nsends[[(1 << r) - 1 for r in range(P)]]
    # from one initiator: one binomial tree of the completed hypercube, fewer than 2P messages
    q = 1 << (P - 1).bit_length()
    assert (singles <= q - 1).all()
    assert (singles >= P - 1).all()
    if P & (P - 1) == 0:
        assert (singles == P - 1).all()  # exactly a binomial tree: each rank reached once


def test_hosting_of_missing_nodes() -> None:
    assert [hosted_node(r, 6) for r in range(6)] == [None, None, 6, 7, None, None]
    assert [hosted_node(r, 8) for r in range(8)] == [None] * 8
    assert hosted_node(0, 1) is None
    # a host receives for the node it hosts too: with the "virtual destination" tag bit
    def act_recv_tags(r: int) -> set[int]:
        return {op.tag for op in activation_broadcast(r, 6).ops
                if op.kind == "recv" and op.msg == "activation"}

    assert act_recv_tags(2) == {0, 1, 3}  # from real and virtual nodes, for itself and node 6
    assert act_recv_tags(4) == {0, 2}  # node 4 hosts nothing but hears from node 6
    assert act_recv_tags(0) == {0}


def test_neighbours_and_errors() -> None:
    assert hypercube_neighbours(0, 1) == []
    assert hypercube_neighbours(5, 6) == [4, 1]
    assert hypercube_neighbours(2, 3) == [0]
    with pytest.raises(ValueError, match="rank"):
        hypercube_neighbours(3, 3)
    with pytest.raises(ValueError, match="world_size"):
        hypercube_neighbours(0, 0)
    with pytest.raises(ValueError, match="triggers"):
        build_activation(Schedule(0, 3), [])
    with pytest.raises(ValueError, match="tag"):
        build_activation(Schedule(0, 2), [0], tag=-1)


async def run_activation(P: int, initiators: set[int], executions: int = 2,
                         delay: float = 0.0, seed: int = 0) -> list[int]:
    """Run ``executions`` executions of the activation schedule with the given initiators.

    Returns the number of activation frames sent per execution (all ranks together).
    """
    sent: list[int] = []
    async with inproc_world(P, delay=delay, seed=seed) as ts:
        for t in ts:
            orig = t.post_frame

            def counting(dst, kind, sched, execution, tag, payload, *args,  # type: ignore[no-untyped-def]
                         _orig=orig, **kw):
                if kind == Kind.ACTIVATION:
                    sent.append(execution)
                return _orig(dst, kind, sched, execution, tag, payload, *args, **kw)

            t.post_frame = counting  # type: ignore[method-assign]
        sid = next(_ids)
        exs = [Executor(activation_broadcast(r, P), t, {}, sched_id=sid, persistent=True)
               for r, t in enumerate(ts)]
        for e in range(executions):
            futs = [ex.current for ex in exs]
            for r in sorted(initiators):
                exs[r].start()
            done = await asyncio.wait_for(asyncio.gather(*futs), 5.0)
            assert done == [e] * P
    return [sent.count(e) for e in range(executions)]


def max_sends(P: int) -> int:
    return sum(op.kind == "send" and op.msg == "activation"
               for r in range(P) for op in activation_broadcast(r, P).ops)


@pytest.mark.timeout(60)
async def test_executed_from_every_initiator_subset_small_p() -> None:
    for P in range(1, 7):
        _, expected = simulate(P)
        for n in range(1, P + 1):
            for subset in itertools.combinations(range(P), n):
                counts = await run_activation(P, set(subset))
                # each send fires at most once per execution, however many initiators: at most
                # what the schedules allow (late messages may find the execution finished),
                # exactly that from one initiator (every send fires on activation)
                want = int(expected[sum(1 << r for r in subset) - 1])
                if n == 1:
                    assert counts == [want, want], (P, subset)
                else:
                    assert all(P - 1 <= c <= want for c in counts), (P, subset, counts)


@pytest.mark.timeout(60)
async def test_executed_random_initiators_with_delays() -> None:
    rng = random.Random(7)
    for P in (8, 11, 13, 16, 17):
        for trial in range(3):
            subset = set(rng.sample(range(P), rng.randint(1, P)))
            counts = await run_activation(P, subset, delay=0.002, seed=trial)
            assert all(0 < c <= max_sends(P) for c in counts)
        counts = await run_activation(P, {rng.randrange(P)}, delay=0.002, seed=9)
        assert all(P - 1 <= c < 2 * P for c in counts)
