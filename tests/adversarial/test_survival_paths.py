"""Survival on every path: sparse partial handles, and handles made while a rank dies.

4 real processes over loopback tcp (started without the launcher, which would stop the job at
the first loss), ``survive=True``:

* a **sparse** partial handle (network and shared memory): rank r contributes ``1000**r`` at
  index 0 (a SparseVector) per call; rank 3 dies after 5 calls; every survivor's results,
  flush included, add up to every survivor's own calls exactly once and the dead rank's at most
  as often as it called, the same counts on every survivor (before: sparse handles refused
  ``survive``, and a loss ended them with ``PeerLostError``);
* a handle **made after a rank died** (its loss already learned): before, creation raised
  ``PeerLostError`` and ended the job; now it goes on among the survivors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import run_killed_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RANK = """
import asyncio, json, os, signal, sys, numpy as np, asynccoll

async def main():
    out, what, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    comm = await asynccoll.connect(timeout=60, collective_timeout=30, survive=True)
    N = 64
    if what == "late":
        if comm.rank == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        while comm.lost is None:  # the loss learned before the handle is made
            await asyncio.sleep(0.01)
    shm = what == "sparse-shm"
    if what.startswith("sparse"):
        like = asynccoll.SparseVector(np.empty(0, np.int32), np.empty(0, np.float64), N)
        h = comm.partial_allreduce(
            asynccoll.Quorum(2) if kind == "quorum" else kind, like, accumulate="sum",
            path=asynccoll.DataPath(algorithm="ssar_split_allgather", shm=shm or None))
        x = asynccoll.SparseVector(np.array([0], np.int32),
                                   np.array([1000.0 ** comm.rank]), N)
    else:
        h = comm.partial_allreduce(asynccoll.Quorum(2) if kind == "quorum" else kind,
                                   np.zeros(N), accumulate="sum")
        x = np.zeros(N)
        x[0] = 1000.0 ** comm.rank
    acc, calls, lost, sizes = 0.0, 0, set(), set()
    async with comm:
        for step in range(20):
            if comm.rank == 3 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep(0.002 * (comm.rank + 1))
            r = await h(x)
            calls += 1
            v = r.value
            acc += float(v.to_dense()[0] if hasattr(v, "to_dense") else v[0])
            lost |= set(r.lost)
            sizes.add(r.world_size)
        f = await h.flush()
        v = f.value
        acc += float(v.to_dense()[0] if hasattr(v, "to_dense") else v[0])
        lost |= set(f.lost)
    with open(f"{out}/rank-{comm.rank}.json", "w") as fh:
        json.dump({"acc": acc, "calls": calls, "lost": sorted(lost | set(f.lost)),
                   "final_size": f.world_size}, fh)

asyncio.run(main())
"""


def _counts(acc: float) -> list[int]:
    """How many contributions of each rank ``acc`` (a sum of 1000**r terms) holds."""
    n, out = round(acc), []
    for _ in range(4):
        n, c = divmod(n, 1000)
        out.append(c)
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("what", "kind"), [("sparse", "solo"), ("sparse", "majority"),
                                            ("sparse-shm", "quorum"), ("late", "solo")])
def test_exact_accounting_on_every_path(tmp_path: Path, what: str, kind: str) -> None:
    out = run_killed_job(tmp_path, RANK, 4, [str(tmp_path), what, kind], "3")
    counts = {r: _counts(rep["acc"]) for r, rep in out.items()}
    first = next(iter(counts.values()))
    for r, rep in out.items():
        assert counts[r] == first, f"survivors disagree: {counts}"
        assert rep["lost"] == [3], rep
        assert rep["final_size"] == 3
        for q in (0, 1, 2):
            assert counts[r][q] == out[q]["calls"], f"rank {q}'s calls counted {counts[r][q]}"
        assert counts[r][3] <= (0 if what == "late" else 5)
