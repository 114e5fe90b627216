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
    hypercube_neighbours,
)
from asynccoll.sched import Executor, Schedule
from asynccoll.testing import inproc_world
from asynccoll.transport.base import Kind

_ids = itertools.count(1)


def send_peers(P: int) -> list[list[int]]:
    """Each rank's activation send peers, read from the built schedules themselves."""
    out = []
    for r in range(P):
        s = activation_broadcast(r, P)
        out.append([op.peer for op in s.ops if op.kind == "send" and op.msg == "activation"])
    return out


@pytest.mark.parametrize("P", range(1, 18))
def test_every_initiator_subset_reaches_every_rank(P: int) -> None:
    # Flood the send graph of the real schedules from all 2**P - 1 initiator sets at once,
    # as bitmasks (vectorised), and require that every set activates all ranks.
    peers = send_peers(P)
    nb = np.array([sum(1 << q for q in ps) for ps in peers], dtype=np.int64)
    reach = np.arange(1, 1 << P, dtype=np.int64)
    for _ in range(P):
        new = reach.copy()
        for r in range(P):
            new |= np.where((reach >> r) & 1, nb[r], 0)
        if np.array_equal(new, reach):
            break
        reach = new
    assert (reach == (1 << P) - 1).all()


@pytest.mark.parametrize("P", [3, 5, 6, 7, 12, 17])
def test_graph_is_symmetric_and_log_depth(P: int) -> None:
    peers = send_peers(P)
    for r, ps in enumerate(peers):
        for q in ps:
            assert r in peers[q]  # whoever can activate me, I can activate
    # from any single initiator the flood needs at most ceil(log2 P) + 1 hops
    for root in range(P):
        seen, frontier, hops = {root}, {root}, 0
        while len(seen) < P:
            frontier = {q for r in frontier for q in peers[r]} - seen
            seen |= frontier
            hops += 1
        assert hops <= (P - 1).bit_length() + 1


def test_neighbours_and_errors() -> None:
    assert hypercube_neighbours(0, 1) == []
    assert hypercube_neighbours(5, 6) == [4, 1]
    assert hypercube_neighbours(2, 3) == [0]
    with pytest.raises(ValueError, match="rank"):
        hypercube_neighbours(3, 3)
    with pytest.raises(ValueError, match="world_size"):
        hypercube_neighbours(0, 0)
    s = Schedule(0, 1)
    with pytest.raises(ValueError, match="triggers"):
        build_activation(s, [])
    with pytest.raises(ValueError, match="tag"):
        build_activation(Schedule(0, 2), [], tag=-1)


async def run_activation(P: int, initiators: set[int], executions: int = 2,
                         delay: float = 0.0, seed: int = 0) -> list[int]:
    """Run ``executions`` executions of the activation schedule with the given initiators.

    Returns the number of activation frames sent per execution (all ranks together).
    """
    sent: list[int] = []
    async with inproc_world(P, delay=delay, seed=seed) as ts:
        for t in ts:
            orig = t.post_send

            def counting(dst, header, payload, _orig=orig):  # type: ignore[no-untyped-def]
                if header.kind == Kind.ACTIVATION:
                    sent.append(header.execution)
                return _orig(dst, header, payload)

            t.post_send = counting  # type: ignore[method-assign]
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


@pytest.mark.timeout(60)
async def test_executed_from_every_initiator_subset_small_p() -> None:
    for P in range(1, 7):
        edges = sum(len(hypercube_neighbours(r, P)) for r in range(P))
        for n in range(1, P + 1):
            for subset in itertools.combinations(range(P), n):
                counts = await run_activation(P, set(subset))
                # each rank's sends fire once per execution, however many initiators
                assert counts == [edges, edges], (P, subset)


@pytest.mark.timeout(60)
async def test_executed_random_initiators_with_delays() -> None:
    rng = random.Random(7)
    for P in (8, 11, 13, 16, 17):
        edges = sum(len(hypercube_neighbours(r, P)) for r in range(P))
        for trial in range(3):
            subset = set(rng.sample(range(P), rng.randint(1, P)))
            counts = await run_activation(P, subset, delay=0.002, seed=trial)
            assert counts == [edges, edges]
