"""The hierarchical partial handle takes a restarted rank back (issue 32; docs/groups.md,
"Joining").

4 real processes on two fake hosts ({0, 1}, {2, 3}) under ``asynccoll run --max-failures 1
--max-restarts 1``, a surviving solo hierarchical handle with sum accumulation
(tests/adversarial/_rejoin_hier_job.py): rank r contributes ``1000**r`` per call; a non-leader
(3) or a leader (2) SIGKILLs itself at call 8; the survivors regroup without it
(:mod:`asynccoll.comm.hier_survival`), the launcher restarts it, and its new process joins at
the members' next flush boundary (``admit_ready`` / ``join_handle``, the flat handles'
protocol): every rank regrows, its host group whole again with its lowest rank the leader, a
new leaders' handle, the rounds numbered on. Asserted, from every rank's sum of every value it
was handed: each member's calls counted exactly once and the same counts on every member; the
killed process's at most as many as it made (what it held is lost, and the members' results
said so: ``lost`` named it until it was back); the joiner's own calls exactly once and every
member's calls since the join in its sum; rounds never numbered back; at the end a world of 4,
nothing reported lost, and the hosts as at the start. And two losses without a restart (3,
then 1 once the survivors regrouped): each regroup settles its own epoch, so the survivors'
calls are still counted exactly once (before, the second regroup subtracted the first epoch's
results again: 43 of rank 0's 60 calls counted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("_rejoin_hier_job.py")
ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _run(kills: str, failures: int, restarts: int) -> tuple[str, dict[int, dict]]:
    env = dict(os.environ, PYTHONPATH=ROOT, KILLS=kills, RESTARTS=str(restarts))
    p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "4",
                        "--max-failures", str(failures), "--max-restarts", str(restarts),
                        str(JOB)],
                       capture_output=True, text=True, timeout=140, env=env, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    rows = {r["rank"]: r for r in (json.loads(line.split("COUNT ", 1)[1])
                                    for line in out.splitlines() if "COUNT {" in line)}
    return out, rows


def _counts(acc: list[float]) -> list[int]:
    """How many contributions of each rank a sum of ``1000**r`` terms holds."""
    assert len(set(acc)) == 1, acc
    v = round(acc[0])
    return [(v // 1000 ** r) % 1000 for r in range(4)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("victim", [3, 2], ids=["non-leader", "leader"])
def test_the_hierarchical_handle_takes_a_restarted_rank_back(victim: int) -> None:
    out, rows = _run(f"{victim}@8", 1, 1)
    assert f"rank {victim} was killed by SIGKILL; restarting it" in out, out[-3000:]
    assert sorted(rows) == [0, 1, 2, 3], out[-3000:]
    assert f"took rank(s) [{victim}] back" in out, out[-3000:]
    members = [rows[r] for r in range(4) if r != victim]
    joiner = rows[victim]
    assert joiner["restarted"] == 1
    seen = _counts(members[0]["acc"])
    for m in members:
        assert _counts(m["acc"]) == seen, rows  # the same counts on every member
        assert seen[m["rank"]] == m["calls"], rows  # each member's calls exactly once
        assert m["seen_lost"] == [victim], rows  # its results said the victim was lost
        assert m["rounds"] == sorted(m["rounds"]), m["rounds"]  # numbered on
        assert (m["size"], m["lost"], m["hosts"]) == (4, [], [[0, 1], [2, 3]]), rows
    old = seen[victim] - joiner["calls"]
    assert 0 <= old <= 8, rows  # the killed process's calls counted at most once each
    mine = _counts(joiner["acc"])
    assert mine == [joiner["calls"]] * 4, rows  # its own calls once, and everyone's since
    # numbered on: the final flush's round the same everywhere, past the members' round before
    # the kill; the joiner's rounds not from 0 again
    assert {r["last"] for r in rows.values()} == {members[0]["last"]}, rows
    assert members[0]["last"] > members[0]["rounds"][9], rows
    assert all(r > members[0]["rounds"][9] for r in joiner["rounds"]), rows
    assert (joiner["size"], joiner["lost"], joiner["hosts"]) == (4, [], [[0, 1], [2, 3]])


@pytest.mark.timeout(150)
def test_two_losses_regroup_twice_with_exact_accounting() -> None:
    out, rows = _run("3@8,1@25", 2, 0)
    assert sorted(rows) == [0, 2], out[-3000:]
    seen = _counts(rows[0]["acc"])
    for m in rows.values():
        assert _counts(m["acc"]) == seen, rows  # the same counts on both survivors
        assert seen[m["rank"]] == m["calls"], rows  # each survivor's calls exactly once
        assert (m["size"], m["lost"], m["hosts"]) == (2, [1, 3], [[0], [2]]), rows
    assert seen[3] <= 8, seen  # the dead: at most what each made
    assert seen[1] <= 25, seen
