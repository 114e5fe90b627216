"""``asynccoll run --max-failures N``: up to N ranks may die and the job goes on.

Rank 1 of 3 SIGKILLs itself in the middle of allreduces. With ``--max-failures 1`` the launcher
says which rank died and how and leaves the others running; they catch ``PeerLostError``, shrink
to the survivors, finish their work and exit 0, and so does the launcher. Without it (or with a
second failure past N), the first failure stops every rank as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = """
import asyncio, os, signal, sys, numpy as np, asynccoll

async def main():
    kill = [int(k) for k in sys.argv[1].split(",")]
    comm = await asynccoll.connect(collective_timeout=30)
    print("survive", comm.survive, flush=True)
    async with comm:
        x = np.ones(8)
        try:
            for step in range(10_000):
                if comm.rank in kill and step == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                await comm.allreduce(x)
        except asynccoll.PeerLostError:
            # a victim whose step-2 allreduce fails on the other victim's loss before it
            # reaches its own kill still dies as planned (two losses, not one)
            if comm.rank in kill:
                os.kill(os.getpid(), signal.SIGKILL)
        g = await comm.shrink()
        s = await g.allreduce(np.ones(2))
        print("survivors", g.size, "sum", s[0], flush=True)
        await g.close()

asyncio.run(main())
"""


def _run(tmp_path: Path, args: list[str], kill: str) -> tuple[int, str, str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", *args, str(script), kill],
                       capture_output=True, text=True, timeout=90,
                       env={**os.environ, "PYTHONPATH": ROOT})
    return p.returncode, p.stdout, p.stderr


@pytest.mark.timeout(120)
def test_the_job_goes_on_after_a_failure_it_allows(tmp_path: Path) -> None:
    code, out, err = _run(tmp_path, ["-n", "3", "--max-failures", "1"], "1")
    assert code == 0, err
    assert "rank 1 was killed by SIGKILL; failure 1 of at most 1" in err
    assert out.count("survive True") == 3
    assert out.count("survivors 2 sum 2.0") == 2, out


@pytest.mark.timeout(120)
def test_a_failure_past_the_limit_stops_the_job(tmp_path: Path) -> None:
    code, _out, err = _run(tmp_path, ["-n", "4", "--max-failures", "1"], "1,2")
    assert code == 137, (code, err)
    assert "failure 1 of at most 1" in err
    assert "stopping the other ranks" in err


@pytest.mark.timeout(120)
def test_without_it_the_first_failure_stops_the_job(tmp_path: Path) -> None:
    code, out, err = _run(tmp_path, ["-n", "3"], "1")
    assert code == 137, (code, err)
    assert "survive False" in out
    assert "rank 1 was killed by SIGKILL" in err
    assert "stopping the other ranks" in err


def test_bad_limits_are_refused(tmp_path: Path) -> None:
    code, _, err = _run(tmp_path, ["-n", "2", "--max-failures", "2"], "0")
    assert code == 2
    assert "max_failures" in err
