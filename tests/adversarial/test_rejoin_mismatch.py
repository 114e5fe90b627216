"""After a join every rank compares a digest of the state: replicas equal to the bit, checked,
not assumed (asynccoll/comm/joining.py). The members compare theirs while they go on stepping
(``admit_sent``: the digests' allgather settled at their next sync event), so a mismatch must
still raise ``StateMismatchError`` on every rank: here rank 1's digest is made wrong, and the
joiner (in its joining step) and the three members (at their next sync event) all raise it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("_rejoin_mismatch_job.py")
ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.timeout(170)
def test_a_state_mismatch_after_a_join_raises_on_every_rank() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "4",
                        "--max-restarts", "1", str(JOB)],
                       capture_output=True, text=True, timeout=160, env=env, cwd=ROOT)
    out = p.stdout + p.stderr
    got = {(int(r), int(k)): int(s) for r, k, s in
           re.findall(r"MISMATCH rank=(\d) restarted=(\d) syncs=(\d+)", out)}
    assert "NO-MISMATCH" not in out, out[-3000:]
    assert sorted(got) == [(0, 0), (1, 0), (2, 1), (3, 0)], out[-3000:]
    assert "differ from rank 0's" in out, out[-3000:]
    # the members raised at one point: the same sync event (their counts of events agree)
    assert len({got[(r, 0)] for r in (0, 1, 3)}) == 1, got
    assert p.returncode == 0, out[-3000:]
