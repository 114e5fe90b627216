"""Ranks that call the same collective with different definitions (op, root, a sparse
algorithm) get an ExecutionError on every rank at its first use, never silently different
results.

Real processes over tcp; the check runs once per cached collective (later calls cost nothing).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _helpers import async_child, free_port, spawn_world

import asynccoll

pytestmark = [pytest.mark.multiprocess]


async def diverge(rank: int, P: int, port: int, what: str) -> dict[str, Any]:
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   timeout=60, collective_timeout=20)
    async with comm:
        x = np.arange(4, dtype=np.float64) + rank
        ok = await comm.allreduce(x)  # the same definition everywhere: fine
        assert np.array_equal(ok, np.arange(4) * P + P * (P - 1) / 2)
        try:
            if what == "op":
                # the first use of each definition on every rank (ids follow first use)
                await comm.allreduce(x, op="min" if rank == 0 else "max")
            elif what == "root":
                await comm.broadcast(x, root=0 if rank == 0 else 1)
            else:
                await comm.sparse_allreduce(x, algorithm="ssar_recursive_double" if rank == 0
                                            else "ssar_split_allgather")
        except asynccoll.ExecutionError as exc:
            error = str(exc)
        else:
            error = ""
        # the communicator keeps working after it
        again = await comm.allreduce(x)
        assert np.array_equal(again, ok)
    return {"error": error}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["op", "root", "sparse"])
def test_a_mismatched_definition_raises_on_every_rank(what: str) -> None:
    out = spawn_world(async_child, 3, (diverge, free_port(), what), 90)
    for r, o in enumerate(out):
        assert "disagree" in o["error"], (r, o)
        assert {"op": "op=", "root": "root=", "sparse": "algorithm="}[what] in o["error"]
