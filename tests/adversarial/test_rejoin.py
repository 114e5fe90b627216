"""A killed rank comes back: ``asynccoll run --max-restarts`` restarts it and it joins.

Eager-SGD on 4 real processes under the launcher: a rank SIGKILLs itself at step 10 of 60; the
launcher restarts it (``ASYNCCOLL_RESTART=1``), its ``connect()`` dials the members, its first
step is taken back at the members' next sync event (it receives the parameters, the momentum
and the global step, striped over the members, and every rank checks a digest of them), and
then it trains with the others. Asserted: the launcher exits 0 and says it restarted the rank;
every rank reaches step 60; the restarted rank says it joined; every rank's final parameters
hash the same (bytes, not a tolerance). For solo, majority and quorum, and with rank 0 (the
lowest member, which coordinates the recovery) as the victim.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("_rejoin_job.py")
ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _run(policy: str, victims: str, restarts: int) -> tuple[int, str]:
    env = dict(os.environ, POLICY=policy, VICTIMS=victims, N="60", KILL_AT="10",
               STEP_S="0.06", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "4",
                        "--max-restarts", str(restarts), str(JOB)],
                       capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.timeout(170)
@pytest.mark.parametrize(("policy", "victim"), [("solo", 2), ("majority", 2), ("quorum", 2),
                                                ("solo", 0)])
def test_a_killed_rank_is_restarted_joins_and_ends_equal(policy: str, victim: int) -> None:
    code, out = _run(policy, str(victim), 1)
    assert code == 0, out[-4000:]
    assert f"rank {victim} was killed by SIGKILL; restarting it" in out, out[-3000:]
    finals = re.findall(r"FINAL rank=(\d) steps=(\d+) digest=(\w+) restarted=(\d)", out)
    assert sorted(int(r) for r, *_ in finals) == [0, 1, 2, 3], out[-3000:]
    assert all(int(s) == 60 for _, s, _, _ in finals), finals
    assert len({d for _, _, d, _ in finals}) == 1, finals  # equal to the bit
    assert [int(r) for r, _, _, k in finals if k == "1"] == [victim], finals
    assert f"rank {victim} joined at step" in out, out[-3000:]
    assert "took rank(s) [" in out  # the members say they took it back
