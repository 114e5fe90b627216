"""A program that ends without closing its communicator exits cleanly.

Its progress thread used to be left running uvloop while the interpreter tore down the modules
that loop uses: 4 of 10 three-rank jobs had a rank die of SIGSEGV at exit. The progress engine
now stops its thread at interpreter exit (``asynccoll.comm.progress``, module doc).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import free_port

ROOT = str(Path(__file__).parents[2])

RANK = '''
import asyncio
import numpy as np
import asynccoll


async def main():
    comm = await asynccoll.connect(timeout=60, collective_timeout=20)  # never closed
    x = np.ones(1 << 12, np.float32)
    a = comm.partial_allreduce("solo", like=x, name="A")
    comm.partial_allreduce("majority", like=x, name="B")  # never called
    if comm.rank == 0:
        await a(x)  # an execution the others answer from their progress threads
    await comm.allreduce(x, out=x)
    await comm.barrier()


asyncio.run(main())
print("ended", flush=True)
'''


@pytest.mark.timeout(120)
def test_ending_without_close_exits_cleanly(tmp_path: Path) -> None:
    for job in range(5):  # the crash came in about 4 jobs of 10
        got = _run_job(tmp_path, "rank.py", RANK)
        for r, (rc, out, err) in enumerate(got):
            assert rc == 0, (job, r, rc, err)
            assert out.strip().endswith("ended"), (job, r, out)


SERVE = '''
import asyncio, sys, time
import numpy as np
import asynccoll


async def main():
    comm = await asynccoll.connect(timeout=60, collective_timeout=20)  # never closed
    x = np.ones(1 << 10, np.float32)
    h = comm.partial_allreduce("solo", like=x, name="A")
    if comm.rank == 0:
        if sys.argv[1] == "crash":
            raise RuntimeError("rank 0 crashed")
        return  # ends at once: its exit must keep serving the others' executions
    await asyncio.sleep(1.0)  # rank 0 has reached its exit by now
    t = time.monotonic()
    try:
        for _ in range(5):
            r = await h(x)
        print("calls", r.round, flush=True)
    except asynccoll.PeerLostError as exc:
        print("lost", exc.rank, round(time.monotonic() - t, 3), flush=True)


asyncio.run(main())
'''


def _run_job(tmp_path: Path, name: str, text: str, *args: str) -> list[tuple[int, str, str]]:
    """Run ``text`` as a job of 3 rank processes over tcp; per rank (exit code, stdout, the
    end of stderr)."""
    script = tmp_path / name
    script.write_text(text)
    P = 3
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, str(script), *args],
        env={**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_RANK": str(r),
             "ASYNCCOLL_WORLD_SIZE": str(P), "ASYNCCOLL_STORE": f"127.0.0.1:{port}",
             "ASYNCCOLL_TRANSPORT": "tcp", "ASYNCCOLL_SECRET": "exit-without-close-secret"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(P)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out.decode(), err.decode(errors="replace")[-800:])
            for p, (out, err) in zip(procs, outs, strict=True)]


def _serve_job(tmp_path: Path, mode: str) -> list[tuple[int, str, str]]:
    return _run_job(tmp_path, "serve.py", SERVE, mode)


@pytest.mark.timeout(120)
def test_a_rank_that_ends_first_without_close_serves_the_others_until_they_close(
        tmp_path: Path) -> None:
    """Ending without close closes at exit, as close() does: the rank that ends first keeps
    answering the others' partial executions until they have closed (it was a lost rank to
    them: their calls failed with PeerLostError)."""
    got = _serve_job(tmp_path, "normal")
    for r, (rc, out, err) in enumerate(got):
        assert rc == 0, (r, rc, err)
        if r:
            assert out.startswith("calls"), (r, out, err)


@pytest.mark.timeout(120)
def test_a_rank_that_crashes_is_still_lost_at_once(tmp_path: Path) -> None:
    """An uncaught exception is no orderly end: the crashed rank does not wait for goodbyes,
    and the others learn of the loss at once."""
    got = _serve_job(tmp_path, "crash")
    assert got[0][0] == 1, got[0]
    assert "rank 0 crashed" in got[0][2], got[0]
    for r in (1, 2):
        rc, out, err = got[r]
        assert rc == 0, (r, rc, err)
        what, lost, secs = out.split()
        assert (what, lost) == ("lost", "0"), (r, out)
        assert float(secs) < 2.0, (r, out)
