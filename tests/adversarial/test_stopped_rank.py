"""A rank that stops (SIGSTOP) without dying: under the default settings nobody waits forever.

The survivors' collectives raise CollectiveTimeoutError after the default collective timeout
(``ASYNCCOLL_TIMEOUT``; shortened here so the test runs in seconds, the code path is the default
one: no timeout is passed anywhere), they exit, and the launcher stops the stopped rank too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asynccoll import ConfigError
from asynccoll.launch.connect import DEFAULT_COLLECTIVE_TIMEOUT, collective_timeout_from

pytestmark = pytest.mark.alone  # timing-sensitive: runs after the parallel part (Makefile)

ROOT = str(Path(__file__).parents[2])

STOPPER = """
import asyncio, os, signal, numpy as np, asynccoll

async def main():
    async with await asynccoll.connect() as comm:
        await comm.barrier()
        if comm.rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        await comm.allreduce(np.ones(4))
        print("allreduce returned", flush=True)

asyncio.run(main())
"""


def test_the_default_timeout_and_its_variable() -> None:
    assert collective_timeout_from({}, None) == DEFAULT_COLLECTIVE_TIMEOUT == 300.0
    assert collective_timeout_from({"ASYNCCOLL_TIMEOUT": "12.5"}, None) == 12.5
    assert collective_timeout_from({"ASYNCCOLL_TIMEOUT": "none"}, None) is None
    assert collective_timeout_from({"ASYNCCOLL_TIMEOUT": "12.5"}, 3.0) == 3.0
    assert collective_timeout_from({}, float("inf")) is None
    for bad in ("soon", "0", "-1"):
        with pytest.raises(ConfigError, match="ASYNCCOLL_TIMEOUT"):
            collective_timeout_from({"ASYNCCOLL_TIMEOUT": bad}, None)
    with pytest.raises(ValueError, match="collective_timeout"):
        collective_timeout_from({}, -2.0)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_stopped_rank_times_the_others_out_under_default_settings(tmp_path: Path) -> None:
    script = tmp_path / "stopper.py"
    script.write_text(STOPPER)
    env = {**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_TIMEOUT": "3"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "3", "--grace",
                           "1", str(script)], env=env, capture_output=True, text=True,
                          timeout=50)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert "allreduce returned" not in proc.stdout
    assert "CollectiveTimeoutError" in proc.stderr, proc.stderr
    assert took < 20, f"took {took:.1f} s for a 3 s timeout"
