"""SIGKILL one rank of four in the middle of collectives: every survivor learns of it within
2 s, and its error names the rank that was lost, not a neighbour (DESIGN §10); the 16 MiB
allreduce goes through shared memory (one host), and nothing is left in /dev/shm.

Real processes, real sockets (tcp; ucx where installed), started without the launcher (which
would stop the survivors as soon as one rank dies). Rank 2 writes the time it kills itself;
each survivor reports what it caught and when.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import free_port

ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RANK = """
import asyncio, json, os, signal, sys, time, numpy as np, asynccoll

async def main():
    kind, out = sys.argv[1], sys.argv[2]
    comm = await asynccoll.connect(timeout=60, collective_timeout=60)
    async with comm:
        x = np.ones(4 << 20, np.float32)  # 16 MiB
        await comm.barrier()
        try:
            for step in range(10_000):
                if comm.rank == 2 and step == 3:
                    with open(out + "/killed", "w") as f:
                        f.write(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "sync":
                    await comm.allreduce(x, out=x)
                else:
                    await comm.solo_allreduce(x[:1024])
                if kind != "sync":
                    await asyncio.sleep(0.005)
        except asynccoll.PeerLostError as exc:
            with open(f"{out}/rank-{comm.rank}.json", "w") as f:
                json.dump({"t": time.time(), "rank": exc.rank, "msg": str(exc)}, f)

asyncio.run(main())
"""


def _segments() -> set[str]:
    from asynccoll.comm.shm import SHM_DIR

    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"asynccoll-{os.getuid()}-")}


def _transports() -> list[str]:
    return ["tcp"] + (["ucx"] if importlib.util.find_spec("ucxx") else [])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["sync", "solo"])
@pytest.mark.parametrize("transport", _transports())
def test_every_survivor_learns_which_rank_was_lost_within_2_s(
        tmp_path: Path, transport: str, kind: str) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = free_port()
    before = _segments()
    procs = []
    try:
        for r in range(4):
            env = {**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_RANK": str(r),
                   "ASYNCCOLL_WORLD_SIZE": "4", "ASYNCCOLL_STORE": f"127.0.0.1:{port}",
                   "ASYNCCOLL_TRANSPORT": transport,
                   "ASYNCCOLL_SECRET": "a-test-secret-long-enough"}
            procs.append(subprocess.Popen([sys.executable, str(script), kind, str(tmp_path)],
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        for r, p in enumerate(procs):
            p.wait(timeout=60)
            if r != 2:
                assert p.returncode == 0, p.stdout.read() if p.stdout else ""
        assert procs[2].returncode == -signal.SIGKILL
        killed = float((tmp_path / "killed").read_text())
        for r in (0, 1, 3):
            f = tmp_path / f"rank-{r}.json"
            assert f.exists(), f"rank {r} never caught a PeerLostError"
            got = json.loads(f.read_text())
            assert got["rank"] == 2, (r, got)
            assert got["t"] - killed < 2.0, (r, got["t"] - killed)
        # the 16 MiB allreduce of "sync" runs through shared memory (one host): the segments
        # were unlinked once mapped, so the SIGKILL leaves nothing behind
        assert _segments() - before == set()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
