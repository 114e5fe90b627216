"""A partial handle whose shared-memory segments cannot be had goes over the network on every
rank alike (comm/route): never fatal, one warning naming why, the sums exact.

Real processes over loopback tcp on one host, for dense and sparse handles:

* **a name taken by another user**: before rank 1 makes its segments, a file owned by another
  uid sits at the name of one of them (as if another local user had created it). Before, every
  rank's handle creation raised ``FileExistsError`` and the job ended;
* **a nearly full tmpfs**: a private tmpfs of 16 MiB with 13 MiB taken (a mount; root only):
  the first rank's segments fit, a later rank's do not (ENOSPC). Before, creation crashed on
  that rank (the check read the tmpfs's total size, large enough, not its free space).

Every rank ends with exact sums, its handle on the network, and nothing left in the directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import SECRET, free_port

pytestmark = [pytest.mark.multiprocess]

RANK = """
import asyncio, json, os, sys, numpy as np
import asynccoll
from asynccoll.comm import shm as shm_mod

out, how, sparse = sys.argv[1], sys.argv[2], sys.argv[3] == "sparse"
rank = int(os.environ["ASYNCCOLL_RANK"])
if how == "taken" and rank == 1:
    real = shm_mod.Segment.create.__func__

    def taken(cls, path, nbytes):
        # another user's file at this name, before this rank makes it
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.close(fd)
        os.chown(path, 65534, 65534)
        return real(cls, path, nbytes)
    shm_mod.Segment.create = classmethod(taken)

async def main():
    comm = await asynccoll.connect(timeout=30)
    N = 1 << 18  # 1 MiB of float32
    if sparse:
        like = asynccoll.SparseVector(np.empty(0, np.int32), np.empty(0, np.float32), N)
        h = comm.partial_allreduce(asynccoll.Quorum(comm.size), like, accumulate="sum",
                                   path=asynccoll.DataPath(algorithm="ssar_split_allgather"))
    else:
        h = comm.partial_allreduce(asynccoll.Quorum(comm.size), np.zeros(N, np.float32),
                                   accumulate="sum")
    total = np.zeros(N)
    async with comm:
        for step in range(5):
            x = np.zeros(N, np.float32)
            x[(comm.rank * 7 + step) % N] = comm.rank + 1
            x[5] = 1.0
            res = await h(x)
            v = res.value
            total += v.to_dense() if hasattr(v, "to_dense") else v
        f = await h.flush()
        v = f.value
        total += v.to_dense() if hasattr(v, "to_dense") else v
        shm = h._segments is not None
    with open(f"{out}/rank-{comm.rank}.json", "w") as fh:
        json.dump({"total5": total[5], "sum": total.sum(), "shm": shm}, fh)

asyncio.run(main())
"""


def _job(tmp_path: Path, how: str, sparse: bool, shm_dir: str, P: int = 3) -> dict[int, dict]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = free_port()
    procs = []
    try:
        for r in range(P):
            env = {**os.environ, "ASYNCCOLL_RANK": str(r), "ASYNCCOLL_WORLD_SIZE": str(P),
                   "ASYNCCOLL_STORE": f"127.0.0.1:{port}", "ASYNCCOLL_TRANSPORT": "tcp",
                   "ASYNCCOLL_SECRET": SECRET, "ASYNCCOLL_SHM_DIR": shm_dir}
            procs.append(subprocess.Popen(
                [sys.executable, str(script), str(tmp_path), how,
                 "sparse" if sparse else "dense"], env=env, stderr=subprocess.PIPE))
        errs = [p.communicate(timeout=90)[1].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    assert not bad, "\n".join(f"rank {r}:\n{errs[r][-3000:]}" for r in bad)
    warned = [e for e in errs if "could not make their shared-memory segments" in e]
    assert warned, "no rank said why its handle left shared memory"
    return {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(P)}


def _check(got: dict[int, dict], P: int = 3) -> None:
    for r, rep in got.items():
        assert not rep["shm"], f"rank {r} kept shared memory"
        assert rep["total5"] == 5 * P  # every rank's 5 contributions at index 5, once each
        assert rep["sum"] == 5 * P + sum(5 * (q + 1) for q in range(P))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_name_taken_by_another_user_is_not_fatal(tmp_path: Path, sparse: bool) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    d = tmp_path / "segments"
    d.mkdir()
    _check(_job(tmp_path, "taken", sparse, str(d)))
    left = [p.name for p in d.iterdir() if p.stat().st_uid == os.geteuid()]
    assert left == [], left


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_nearly_full_tmpfs_is_not_fatal(tmp_path: Path, sparse: bool) -> None:
    d = tmp_path / "tmpfs"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(d)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a private tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        (d / "someone-else").write_bytes(b"\0" * (13 << 20))
        _check(_job(tmp_path, "full", sparse, str(d)))
        assert sorted(p.name for p in d.iterdir()) == ["someone-else"]
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
