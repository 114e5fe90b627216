"""A rank SIGKILLed during sparse allreduces that go through shared memory: the others get
PeerLostError within 2 s, and nothing is left in /dev/shm.

Two moments: while it maps its peers' segments at the first call (its own segment created, not
yet unlinked by it), and in the middle of later calls (every segment unlinked since the setup;
the survivors wait for it in a wake-up round); a sparse partial handle (solo) whose data
phase goes through shared memory, between its calls; a persistent sparse allreduce handle
between its calls, and before its first (its segment made and never unlinked by it). Real
processes over tcp; the job's segment token is fixed by the test so that the check for
leftovers looks at this job's segments only.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
from _helpers import SHM_VICTIM_PREAMBLE, run_killed_job, shm_left

from asynccoll.comm.shm import SHM_DIR

pytestmark = [pytest.mark.multiprocess]

RANK = SHM_VICTIM_PREAMBLE + """

if VICTIM and when == "attach":
    attach = shm.Segment.attach.__func__

    def attach_then_die(cls, path, nbytes, *more):
        seg = attach(cls, path, nbytes, *more)
        die()

    shm.Segment.attach = classmethod(attach_then_die)


async def main():
    comm = await asynccoll.connect(timeout=60, collective_timeout=30)
    async with comm:
        n = 1 << 16
        rng = np.random.default_rng(comm.rank)
        idx = np.sort(rng.choice(n, 600, replace=False)).astype(np.int32)
        x = asynccoll.SparseVector(idx, rng.standard_normal(600).astype(np.float32), n)
        got = {"rank": None, "msg": "every call completed"}
        h = None
        if when == "partial":  # a sparse partial handle: its data phase through shared memory
            h = comm.partial_allreduce(asynccoll.Solo(), like=x,
                                       path=asynccoll.DataPath(algorithm="ssar_split_allgather"))
            assert h._segments is not None
        elif when.startswith("handle"):  # a persistent sparse allreduce handle: the same
            h = comm.sparse_allreduce_handle(n, algorithm="ssar_split_allgather", name="g")
            assert h.shm
        try:
            for i in range(40):
                if VICTIM and (when in ("later", "partial", "handle") and i == 5
                               or when == "handle-first" and i == 0):
                    # (handle-first: its segment made, never mapped by the others nor
                    # unlinked by it: the survivors unlink it)
                    await asyncio.sleep(0.05)  # the others are in the call's first round
                    die()
                if h is None:
                    await comm.sparse_allreduce(x, algorithm="ssar_split_allgather")
                else:
                    await h(x)
        except asynccoll.PeerLostError as exc:
            got = {"rank": exc.rank, "msg": str(exc)}
        got["t"] = time.time()
        prefix = shm.job_prefix(shm.job_tag(token))
        got["left"] = sorted(f for f in os.listdir(shm.SHM_DIR) if f.startswith(prefix))
        with open(f"{out}/rank-{comm.rank}.json", "w") as f:
            json.dump(got, f)
        # stay a moment: a survivor that closed at once could be the loss a slower survivor
        # (not yet scheduled on these 2 cores) sees first
        await asyncio.sleep(1.0)

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["attach", "later", "partial", "handle", "handle-first"])
def test_sigkill_during_a_shared_memory_sparse_allreduce(tmp_path: Path, when: str) -> None:
    token = secrets.randbits(62)
    try:
        got = run_killed_job(tmp_path, RANK, 4, [str(token), str(tmp_path), when], kill="2")
        killed = float((tmp_path / "killed").read_text())
        for r, g in got.items():
            assert g["rank"] == 2, (r, g)
            assert g["t"] - killed < 2.0, (r, g["t"] - killed)
        assert not shm_left(token), "left in /dev/shm after a SIGKILL"
    finally:
        for name in shm_left(token):  # do not leave the machine dirtier than the test found it
            os.unlink(os.path.join(SHM_DIR, name))
