"""``asynccoll inspect pending DIR --pid PID`` against a live, hung job of two processes.

``asynccoll run -n 2`` starts two ranks that trace into DIR; rank 0 waits in an allreduce that
rank 1 never joins. The SIGUSR1 handler rank 0's Communicator installed dumps its pending ops
into its trace file (and its stderr) without stopping it, and the explanation names rank 1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from asynccoll.inspect.tracefile import load_dir

ROOT = str(Path(__file__).resolve().parents[2])

#: a rank: rank 0 calls an allreduce, rank 1 never does; both wait to be killed
SCRIPT = textwrap.dedent("""
    import asyncio, os, sys
    from pathlib import Path

    import numpy as np

    import asynccoll

    async def main() -> None:
        comm = await asynccoll.connect()
        out = Path(os.environ["TEST_OUT"])
        (out / f"pid-{comm.rank}").write_text(str(os.getpid()))
        if comm.rank == 0:
            await comm.allreduce(np.ones(4, np.float32), timeout=120)
        await asyncio.sleep(120)

    asyncio.run(main())
""")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not reaped, does not). Linux."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(what: str, ok: Callable[[], bool], launcher: subprocess.Popen[bytes],
              log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert launcher.poll() is None, f"the job ended before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()}"
        time.sleep(0.05)


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc; SIGUSR1")
@pytest.mark.timeout(120)
def test_pending_pid_dumps_a_live_rank_of_a_real_job(tmp_path: Path) -> None:
    trace, out = tmp_path / "trace", tmp_path / "out"
    out.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    log = open(tmp_path / "job.log", "wb")  # closed in the finally
    launcher = subprocess.Popen(
        [sys.executable, "-m", "asynccoll.cli", "run", "-n", "2", str(script)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_TRACE": str(trace),
             "TEST_OUT": str(out)})
    try:
        def started() -> bool:
            if not all((out / f"pid-{r}").exists() for r in range(2)):
                return False
            # rank 0's allreduce exists once its schedule is in its trace file
            return '"type":"schedule"' in (trace / "rank-0.jsonl").read_text()

        _wait_for("rank 0 to enter its allreduce", started, launcher, tmp_path / "job.log")
        pids = {r: int((out / f"pid-{r}").read_text()) for r in range(2)}
        cli = subprocess.run(
            [sys.executable, "-m", "asynccoll.cli", "inspect", "pending", str(trace),
             "--pid", str(pids[0]), "--wait", "20"],
            capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
        assert cli.returncode == 0, cli.stderr
        assert "waiting on rank(s) [1]" in cli.stdout, cli.stdout
        assert "rank 1 left no trace of execution 0" in cli.stdout, cli.stdout
        time.sleep(0.3)  # a signal that killed it would have done so by now
        assert _alive(pids[0]), "SIGUSR1 stopped the rank it inspected"
        assert launcher.poll() is None
        (snap,) = [p for ps in load_dir(trace)[0].pending.values() for p in ps]
        assert snap["reason"] == "dump"
        assert any("(waiting for rank 1)" in d for _, _, d in snap["pending"]), snap
        # the stderr dump names the pending ops too (the launcher prefixes rank 0's lines)
        _wait_for("the dump on rank 0's stderr",
                  lambda: b"(waiting for rank 1)" in (tmp_path / "job.log").read_bytes(),
                  launcher, tmp_path / "job.log", 10)
        text = (tmp_path / "job.log").read_text()
        assert "allreduce" in text, text
        assert ": pending" in text, text
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(launcher.pid, signal.SIGKILL)
        for f in out.glob("pid-*"):  # each rank leads a process group of its own
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                os.killpg(int(f.read_text()), signal.SIGKILL)
        launcher.wait(10)
        log.close()
