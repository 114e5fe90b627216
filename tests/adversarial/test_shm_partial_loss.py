"""A rank SIGKILLed during a partial allreduce whose data phase goes through shared memory:
the others get PeerLostError within 2 s, and nothing is left in /dev/shm (the lost rank's
segments are unlinked by name by the survivors, who unlink their own as well).

Two moments: while it maps its peers' segments in the first execution (its own segments
created and announced, never unlinked by it), and between calls once every segment has been
unlinked; and the first again with a survivor that maps its peers' segments late. Real
processes over tcp; the job's segment token is fixed by the test so that the check for
leftovers looks at this job's segments only.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _helpers import SECRET, SHM_VICTIM_PREAMBLE, free_port, shm_left

from asynccoll.comm.shm import SHM_DIR

ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess]

RANK = SHM_VICTIM_PREAMBLE + """

if VICTIM and when in ("attach", "unlinked"):
    attach = shm.PartialSegments.attach

    def attach_then_die(self):
        attach(self)
        die()

    shm.PartialSegments.attach = attach_then_die
elif os.environ["ASYNCCOLL_RANK"] == "1" and when == "unlinked":
    attach = shm.PartialSegments.attach

    def attach_late(self):  # the loop blocked too: the loss is read after the kernel ran
        time.sleep(0.8)
        return attach(self)

    shm.PartialSegments.attach = attach_late


async def main():
    comm = await asynccoll.connect(timeout=60, collective_timeout=30)
    async with comm:
        x = np.ones(1 << 18, np.float32)
        h = comm.partial_allreduce(asynccoll.Solo(), like=x, name="victim",
                                   path=asynccoll.DataPath(shm=True))
        got = {"rank": None, "msg": "every call completed"}
        try:
            for i in range(40):
                if VICTIM and when == "later" and i == 5:
                    die()
                await h(x)
        except asynccoll.PeerLostError as exc:
            got = {"rank": exc.rank, "msg": str(exc)}
        got["t"] = time.time()
        prefix = shm.job_prefix(shm.job_tag(token))
        got["left"] = sorted(f for f in os.listdir(shm.SHM_DIR) if f.startswith(prefix))
        with open(f"{out}/rank-{comm.rank}.json", "w") as f:
            json.dump(got, f)

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["attach", "later", "unlinked"])
def test_sigkill_during_a_shared_memory_partial_allreduce(tmp_path: Path, when: str) -> None:
    """``unlinked``: rank 1 maps its peers' segments after the others saw the loss and
    unlinked theirs (their execution failed); it still reports the loss, not the missing
    segment (seen once in CI: FileNotFoundError, an ExecutionError no survival goes on from)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    token, port = secrets.randbits(62), free_port()
    procs = []
    try:
        for r in range(4):
            env = {**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_RANK": str(r),
                   "ASYNCCOLL_WORLD_SIZE": "4", "ASYNCCOLL_STORE": f"127.0.0.1:{port}",
                   "ASYNCCOLL_TRANSPORT": "tcp", "ASYNCCOLL_SECRET": SECRET}
            procs.append(subprocess.Popen([sys.executable, str(script), str(token),
                                           str(tmp_path), when], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        for r, p in enumerate(procs):
            out, _ = p.communicate(timeout=90)
            if r != 2:
                assert p.returncode == 0, out
        assert procs[2].returncode == -signal.SIGKILL
        killed = float((tmp_path / "killed").read_text())
        for r in (0, 1, 3):
            got = json.loads((tmp_path / f"rank-{r}.json").read_text())
            assert got["rank"] == 2, (r, got)
            assert got["t"] - killed < 2.0, (r, got["t"] - killed)
        # already when the survivors were told: their own segments and the lost rank's are
        # unlinked (the lost rank's by name; it could not)
        for r in (0, 1, 3):
            got = json.loads((tmp_path / f"rank-{r}.json").read_text())
            mine = [f for f in got["left"] if f.rsplit("-", 1)[1].split(".")[0] in
                    (str(r), "2")]
            assert mine == [], (r, got["left"])
        assert not shm_left(token), "left in /dev/shm after a SIGKILL"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for name in shm_left(token):  # do not leave the machine dirtier than the test found it
            os.unlink(os.path.join(SHM_DIR, name))


# -- survive=True: the survivors go on over the network ---------------------------------------

SURVIVE = """
import asyncio, json, os, signal, sys, numpy as np, asynccoll
from asynccoll.comm import dense

out, token, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dense.new_token = lambda: token

async def main():
    comm = await asynccoll.connect(timeout=60, collective_timeout=30, survive=True)
    async with comm:
        x = np.full(4, 1000.0 ** comm.rank)
        h = comm.partial_allreduce(asynccoll.Quorum(2) if kind == "quorum" else kind, like=x,
                                   accumulate="sum", path=asynccoll.DataPath(shm=True))
        through = h._segments is not None
        acc, calls, lost = np.zeros(4), 0, set()
        for step in range(24):
            if comm.rank == 3 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep(0.002 * (comm.rank + 1))
            r = await h(x)
            calls += 1
            acc += r.value
            lost |= set(r.lost)
        f = await h.flush()
        acc += f.value
        res = {"acc": acc.tolist(), "calls": calls, "lost": sorted(lost | set(f.lost)),
               "through": through, "after": h._segments is not None}
    with open(f"{out}/rank-{comm.rank}.json", "w") as fh:
        json.dump(res, fh)

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["solo", "quorum"])
def test_a_surviving_handle_goes_on_over_the_network(tmp_path: Path, kind: str) -> None:
    from _helpers import run_killed_job

    token = secrets.randbits(62)
    try:
        got = run_killed_job(tmp_path, SURVIVE, 4, [str(tmp_path), str(token), kind], "3")
        counts = None
        for r, o in got.items():
            assert o["through"], o  # through shared memory at first,
            assert not o["after"], o  # over the network after the loss
            acc = np.array(o["acc"])
            total = int(acc[0])
            n = [(total // 1000 ** q) % 1000 for q in range(4)]
            for q in got:
                assert n[q] == got[q]["calls"], (r, q, n)  # every survivor's, exactly once
            assert n[3] <= 5, n
            counts = counts or n
            assert n == counts, "the survivors disagree on what was counted"
            assert o["lost"] == [3], o
        assert not shm_left(token)
    finally:
        for name in shm_left(token):
            os.unlink(os.path.join(SHM_DIR, name))
