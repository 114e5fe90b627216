"""Fused activation: the first data exchange of a partial allreduce activates the partner.

Executed over the in-process transport with the real persistent schedules and executors, for
every initiator set at small P and random ones with link delays at P = 8: every execution
completes on every rank with every rank's data in it, and from one initiator exactly
P/2 - 1 activation messages are sent (P - 1 without fusion).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import numpy as np
import pytest

from asynccoll.collectives.dense import first_partner
from asynccoll.collectives.partial import COUNT, PARTIAL_KERNELS, build_partial_allreduce
from asynccoll.comm.contribution import DenseContribution
from asynccoll.sched import Executor
from asynccoll.testing import inproc_world
from asynccoll.transport.frames import Kind

N = 6
_ids = itertools.count(1)


async def run(P: int, rounds: list[set[int]], algorithm: str = "recursive_doubling",
              delay: float = 0.0, seed: int = 0, n: int = N, op: str = "sum") -> list[int]:
    """Run one execution per entry of ``rounds`` (its initiators); return the activation
    frames sent per execution. Every rank contributes ``rank + 1`` to every execution."""
    sent: list[int] = []
    async with inproc_world(P, delay=delay, seed=seed) as ts:
        for t in ts:
            orig = t.post_frame

            def counting(dst: int, kind: int, sched: int, execution: int, *args: Any,
                         _orig: Any = orig, **kw: Any) -> Any:
                if kind == Kind.ACTIVATION:
                    sent.append(execution)
                return _orig(dst, kind, sched, execution, *args, **kw)

            t.post_frame = counting  # type: ignore[method-assign]
        cs = [DenseContribution(op, algorithm) for _ in range(P)]
        built = [c.build(np.zeros(n), r, P, "solo", None) for r, c in enumerate(cs)]
        sid = next(_ids)
        exs = [Executor(s, t, b, sched_id=sid, persistent=True, kernels=PARTIAL_KERNELS)
               for (s, b), t in zip(built, ts, strict=True)]
        want = np.full(n, P * (P + 1) / 2 if op == "sum" else P)
        for e, starters in enumerate(rounds):
            for r, (c, (_, b)) in enumerate(zip(cs, built, strict=True)):
                b["state"][COUNT] = c.add(np.full(n, r + 1.0), int(b["state"][COUNT]), None,
                                          False)
            futs = [ex.current for ex in exs]
            for r in sorted(starters):
                exs[r].start()
            assert await asyncio.wait_for(asyncio.gather(*futs), 10.0) == [e] * P
            for r, (_, b) in enumerate(built):
                assert np.array_equal(b["data"][:n], want), (P, starters, r)
        for ex in exs:
            ex.close()
    return [sent.count(e) for e in range(len(rounds))]


def test_the_activation_edge_of_the_first_exchange_is_left_out() -> None:
    for P in (2, 4, 8):
        for r in range(P):
            s = build_partial_allreduce(r, P, N, "float64", algorithm="recursive_doubling")
            partner = first_partner(r, P, N, "recursive_doubling")
            assert partner == r ^ 1
            act = [op for op in s.ops if op.msg == "activation" and op.peer != r]
            assert all(op.peer != partner for op in act)
            activated = next(i for i, op in enumerate(s.ops) if op.label == "activated")
            sources = [d for d in s.ops[activated].deps
                       if s.ops[d].kind == "recv" and s.ops[d].msg == "data"]
            assert sources
            assert all(s.ops[d].peer == partner and not s.ops[d].deps for d in sources)
    # no fusion where the first exchange is not along a hypercube edge
    for P, algo in ((6, "recursive_doubling"), (4, "ring")):
        s = build_partial_allreduce(0, P, N, "float64", algorithm=algo)
        activated = next(i for i, op in enumerate(s.ops) if op.label == "activated")
        assert not [d for d in s.ops[activated].deps
                    if s.ops[d].kind == "recv" and s.ops[d].msg == "data"]


@pytest.mark.timeout(120)
async def test_every_initiator_set_activates_everyone() -> None:
    for P in (2, 4):
        subsets = [set(c) for n in range(1, P + 1) for c in itertools.combinations(range(P), n)]
        counts = await run(P, subsets)
        for subset, c in zip(subsets, counts, strict=True):
            if len(subset) == 1:
                assert c == P // 2 - 1, (P, subset, c)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "rabenseifner"])
async def test_random_initiators_with_link_delays(algorithm: str) -> None:
    rng = random.Random(11)
    P = 8
    rounds = [set(rng.sample(range(P), rng.randint(1, P))) for _ in range(10)]
    rounds += [{rng.randrange(P)} for _ in range(4)]
    counts = await run(P, rounds, algorithm, delay=0.001, seed=3)
    assert counts[-4:] == [P // 2 - 1] * 4  # one initiator: P/2 - 1, not P - 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", [4, 8])
async def test_rabenseifner_with_fewer_elements_than_ranks_still_activates_everyone(
        P: int) -> None:
    # "max" keeps the meta vector apart from the data, so the data may have 1..P elements:
    # some blocks are empty, and a rank whose first step receives nothing is not fused
    for n in range(1, P + 2):
        for r in range(P):
            partner = first_partner(r, P, n, "rabenseifner")
            assert (partner is None) == (n < P)
        await run(P, [{0}, {P - 1}, {1, P // 2}], "rabenseifner", n=n, op="max")
