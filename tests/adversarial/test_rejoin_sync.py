"""ODSGD and TopKSGD go on without a lost rank and take a restarted one back (issue 32).

4 real processes under ``asynccoll run``; rank VICTIM SIGKILLs itself at step 10 of 60
(tests/adversarial/_rejoin_sync_job.py). Under ``--max-failures 1 --max-restarts 1`` the
survivors settle the round under way and redo it over themselves, the launcher restarts the
rank, the members take it back at a step boundary (the state striped to it, a digest checked
on every rank), and every rank reaches step 60 with the replicated state (the global weights
and the momentum) equal to the bit. ODSGD with rank 2 and with rank 0 (the lowest member,
which coordinates the recovery and the admission) as the victim (then rank 3 lost in the world
rank 0 joined: the three go on to step 60), TopKSGD with rank 2 (which first stops sending to
rank 0, then dies). And the loss alone (``--max-failures 1``, no
restart) where the victim stops sending to rank 0 before it dies: ranks 1 and 3 complete the
round that rank 0 cannot, so the recovery settles it (rank 1's result to rank 0, not a redo),
and the three survivors reach step 60 equal.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("_rejoin_sync_job.py")
ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _run(opt: str, victim: int, restarts: int, **extra: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCCOLL_", "MASTER_"))}
    env.update(OPT=opt, VICTIM=str(victim), N="60", KILL_AT="10", PYTHONPATH=ROOT,
               ASYNCCOLL_TIMEOUT="60", **extra)
    cmd = [sys.executable, "-m", "asynccoll.cli", "run", "-n", "4", "--max-failures", "1"]
    if restarts:
        cmd += ["--max-restarts", str(restarts)]
    p = subprocess.run([*cmd, str(JOB)], capture_output=True, text=True, timeout=100, env=env,
                       cwd=ROOT)
    return p.returncode, p.stdout + p.stderr


def _finals(out: str) -> dict[int, tuple[int, str, int, int]]:
    got = re.findall(r"FINAL rank=(\d) steps=(\d+) digest=(\w+) restarted=(\d) world=(\d)", out)
    return {int(r): (int(s), d, int(k), int(w)) for r, s, d, k, w in got}


@pytest.mark.timeout(110)
@pytest.mark.parametrize(("opt", "victim", "extra"), [
    ("odsgd", 2, {}),
    ("odsgd", 0, {"THEN": "3"}),  # then rank 3 lost at step 50: a loss in the grown world
    ("topk", 2, {"DROP_TO": "0"}),  # first it sends nothing to rank 0, then it dies
])
def test_a_killed_rank_is_restarted_joins_and_ends_equal(opt: str, victim: int,
                                                         extra: dict[str, str]) -> None:
    # the members wait at step 40 until the restart connected (a slow start under load)
    code, out = _run(opt, victim, 1, HOLD_AT="40", **extra)
    assert code == 0, out[-4000:]
    assert f"rank {victim} was killed by SIGKILL; restarting it" in out, out[-3000:]
    finals = _finals(out)
    then = int(extra.get("THEN", -1))
    ranks = [r for r in range(4) if r != then]
    assert sorted(finals) == ranks, out[-3000:]
    assert all(s == 60 and w == len(ranks) for s, _, _, w in finals.values()), finals
    assert len({d for _, d, _, _ in finals.values()}) == 1, finals  # equal to the bit
    assert [r for r, (_, _, k, _) in finals.items() if k] == [victim], finals
    assert f"rank {victim} joined at step" in out, out[-3000:]
    assert "took rank(s) [" in out  # the members say they took it back
    assert "goes on over ranks" in out  # and that they went on without it first
    if then >= 0:
        assert f"rank {then} was killed by SIGKILL; failure 1 of at most 1" in out
        assert f"goes on over ranks {ranks}" in out, out[-3000:]
    assert "did not close within" not in out


@pytest.mark.timeout(110)
def test_the_survivors_of_a_loss_finish_equal() -> None:
    code, out = _run("odsgd", 2, 0, DROP_TO="0")
    assert code == 0, out[-4000:]
    assert "rank 0: ODSGD settled round" in out, out[-3000:]
    assert "rank 2 was killed by SIGKILL; failure 1 of at most 1" in out, out[-3000:]
    finals = _finals(out)
    assert sorted(finals) == [0, 1, 3], out[-3000:]
    assert all(s == 60 and w == 3 for s, _, _, w in finals.values()), finals
    assert len({d for _, d, _, _ in finals.values()}) == 1, finals
    assert "did not close within" not in out
