"""The simulator's results equal the inproc runtime's for the same arrival order."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from asynccoll.collectives import KERNELS
from asynccoll.collectives.select import (
    ALLGATHER_ALGORITHMS,
    ALLREDUCE_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    REDUCE_SCATTER_ALGORITHMS,
)
from asynccoll.inspect.kinds import build_all
from asynccoll.sim import SimExecutor, SimWorld
from asynccoll.testing import inproc_world, run_schedules

from ._script import FAST, run_runtime, run_sim

KINDS = [("solo", None), ("majority", None), ("two_choice", None), ("quorum", 3),
         ("deadline", 3)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "quorum"), KINDS)
@pytest.mark.parametrize(("P", "script_seed"), [(4, 1), (4, 2), (5, 3)])
async def test_partial_equals_runtime(kind: str, quorum: int | None, P: int,
                                      script_seed: int) -> None:
    order, rt, rt_flush = await run_runtime(P, kind, quorum, calls=3, seed=11,
                                            script_seed=script_seed)
    sim, sim_flush = run_sim(P, kind, quorum, order, seed=11)
    for r in range(P):
        assert sim[r] == rt[r], f"rank {r} (order {order})"
    assert sim_flush == rt_flush


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "quorum"), KINDS)
async def test_accounting_mode_equals_data_mode(kind: str, quorum: int | None) -> None:
    order, _, _ = await run_runtime(4, kind, quorum, calls=3, seed=5, script_seed=7)
    with_data, fl1 = run_sim(4, kind, quorum, order, seed=5)
    counts, fl2 = run_sim(4, kind, quorum, order, seed=5, data=False)

    def strip(rows: list[Any]) -> list[Any]:
        return [row[:-1] for row in rows]

    assert [strip(x) for x in counts] == [strip(x) for x in with_data]
    assert strip(fl2) == strip(fl1)


def _buffers(s: Any, rank: int) -> dict[str, Any]:
    rng = np.random.default_rng(rank)
    out = {}
    for name, spec in s.slots.items():
        n = spec.count if spec.count is not None else 64
        dt = np.dtype(spec.dtype or "float32")
        out[name] = (rng.integers(0, 50, n).astype(dt) if dt.kind in "fiu"
                     else np.zeros(n, dt))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["allreduce", "broadcast", "allgather", "reduce_scatter",
                                  "barrier", "activation"])
@pytest.mark.parametrize("P", [3, 4, 6])
@pytest.mark.parametrize("size", [16, 4096])
async def test_collectives_equal_runtime(kind: str, P: int, size: int) -> None:
    await _compare(kind, P, build_all(kind, P, size))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "algorithm", "P"), [
    (kind, a, P) for kind, names in (("allreduce", ALLREDUCE_ALGORITHMS),
                                     ("broadcast", BROADCAST_ALGORITHMS),
                                     ("allgather", ALLGATHER_ALGORITHMS),
                                     ("reduce_scatter", REDUCE_SCATTER_ALGORITHMS))
    for a in names for P in (3, 4, 8)
    if not (a == "recursive_halving" and P & (P - 1))])  # powers of two only
async def test_every_algorithm_equals_runtime(kind: str, algorithm: str, P: int) -> None:
    # each algorithm by name (the sizes above let the chooser take only some of them), at a
    # size that gives every rank several elements per block
    await _compare(kind, P, build_all(kind, P, 1 << 14, algorithm))


async def _compare(kind: str, P: int, scheds: list[Any]) -> None:
    rt_bufs = [_buffers(s, r) for r, s in enumerate(scheds)]
    sim_bufs = [{k: v.copy() for k, v in b.items()} for b in rt_bufs]
    async with inproc_world(P) as ts:
        await asyncio.wait_for(run_schedules(ts, scheds, rt_bufs, kernels=KERNELS), 20)
    w = SimWorld(P, FAST)
    done: list[int] = []
    exs = [SimExecutor(w, s, sched_id=1, buffers=b, kernels=KERNELS,
                       on_complete=lambda e, r=r: done.append(r))
           for r, (s, b) in enumerate(zip(scheds, sim_bufs, strict=True))]
    for r, ex in enumerate(exs):  # the ranks arrive in a scrambled order
        w.at(((r * 7) % P) * 1e-3, ex.start)
    w.run()
    assert sorted(done) == list(range(P))
    for r in range(P):
        for slot in rt_bufs[r]:
            if slot.endswith("tmp"):
                continue  # scratch
            np.testing.assert_array_equal(sim_bufs[r][slot], rt_bufs[r][slot],
                                          err_msg=f"{kind} rank {r} slot {slot}")
