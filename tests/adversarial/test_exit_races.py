"""Closing is collective and orderly: a rank that finishes first never turns a slower rank's
last collective, or its orderly exit, into an error (DESIGN §10).

Real processes under ``asynccoll run`` over real sockets (tcp; ucx where installed): the
README's first snippet many times in a row (an exit race showed up one run in ten: 12 runs over
tcp and 5 over ucx in the suite, ``ASYNCCOLL_TEST_REPEAT=N`` for N over each as a stress run),
and a solo loop in which one rank is slower than the others, so the fast ones finish and close
while the slow one's last calls still need them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

README_SNIPPET = """
import asyncio, numpy as np, asynccoll

async def main():
    async with await asynccoll.connect() as comm:
        x = np.full(3, comm.rank + 1.0)
        total = await comm.allreduce(x)
        r = await comm.majority_allreduce(x)
        print(comm.rank, total, r.round, sorted(r.contributors), r.included)

asyncio.run(main())
"""

SLOW_SOLO = """
import asyncio, numpy as np, asynccoll

async def main():
    async with await asynccoll.connect() as comm:
        for step in range({steps}):
            if comm.rank == comm.size - 1:
                await asyncio.sleep(0.05)  # the straggler
            r = await comm.solo_allreduce(np.full(4, 1.0))
        print("done", comm.rank, r.round, flush=True)

asyncio.run(main())
"""


def _run(script: Path, n: int, transport: str,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_TIMEOUT": "30"}
    return subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", str(n),
                           "--transport", transport, str(script)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _transports() -> list[str]:
    return ["tcp"] + (["ucx"] if importlib.util.find_spec("ucxx") else [])


@pytest.mark.timeout(int(os.environ.get("ASYNCCOLL_TEST_REPEAT") or 12) * 60)
@pytest.mark.parametrize("transport", _transports())
def test_the_readme_snippet_many_times_in_a_row(tmp_path: Path, transport: str) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(README_SNIPPET)
    runs = int(os.environ.get("ASYNCCOLL_TEST_REPEAT") or (12 if transport == "tcp" else 5))
    for i in range(runs):
        proc = _run(script, 4, transport)
        assert proc.returncode == 0, f"run {i + 1} of {runs}:\n{proc.stdout}\n{proc.stderr}"
        assert "Error" not in proc.stderr, f"run {i + 1} of {runs}:\n{proc.stderr}"
        assert sorted(line.split()[0] for line in proc.stdout.splitlines()) == \
            ["[0]", "[1]", "[2]", "[3]"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", _transports())
def test_fast_ranks_close_while_a_slow_one_still_calls(tmp_path: Path, transport: str) -> None:
    script = tmp_path / "slow_solo.py"
    script.write_text(SLOW_SOLO.format(steps=5))
    for i in range(5):
        proc = _run(script, 4, transport)
        assert proc.returncode == 0, f"run {i + 1}:\n{proc.stdout}\n{proc.stderr}"
        assert proc.stdout.count("done") == 4, proc.stdout
        assert "Error" not in proc.stderr, proc.stderr
