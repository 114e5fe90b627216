"""A sparse partial handle takes a restarted rank back (issue 32; docs/groups.md, "Joining").

4 real processes under ``asynccoll run --max-failures 1 --max-restarts 1``, a surviving partial
allreduce of SparseVectors (tests/adversarial/_rejoin_sparse_job.py): solo over the network,
and majority through shared memory (the split allgather; the survivors' and the grown world's
over the network, a restarted process knowing no host layout):
rank r sends ``1000**r`` at index 0 and at its own index ``1 + r``; rank 2 SIGKILLs itself at
call 8, the launcher restarts it, and its new process joins the handle at the members' next
flush boundary (``admit_ready`` / ``join_handle``, the dense handle's protocol). Asserted, from
every rank's sum of every result: each member's calls counted exactly once, the same counts on
every member (index 0, and each rank's own index, which must agree with it); the killed
process's calls at most as many as it made (what it held when it died is lost, and the members'
results said so: ``lost`` named rank 2 until it was back); the joiner's own calls exactly
once, and every member's calls since the join in the joiner's sum; at the end a world of 4 and
nothing reported lost; through shared memory, the segments made at first, none left at the end
(a private segment directory).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("_rejoin_sparse_job.py")
ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _counts(acc: list[float]) -> list[int]:
    """How many contributions of each rank a sum holds: the digit groups of index 0, checked
    against each rank's own index ``1 + r`` (``1000**r`` per contribution)."""
    v = round(acc[0])
    out = [(v // 1000 ** r) % 1000 for r in range(4)]
    assert [round(acc[1 + r]) for r in range(4)] == [c * 1000 ** r for r, c in
                                                      enumerate(out)], acc
    assert not any(acc[5:]), acc  # nothing anywhere else
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("policy", "shm"), [("solo", "0"), ("majority", "1")])
def test_a_sparse_partial_handle_takes_a_restarted_rank_back_with_exact_accounting(
        policy: str, shm: str) -> None:
    with tempfile.TemporaryDirectory(prefix="rejoin-sparse-", dir="/dev/shm") as shm_dir:
        env = dict(os.environ, PYTHONPATH=ROOT, POLICY=policy, SHM=shm,
                   ASYNCCOLL_SHM_DIR=shm_dir, ASYNCCOLL_SHM="1")
        p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "4",
                            "--max-failures", "1", "--max-restarts", "1", str(JOB)],
                           capture_output=True, text=True, timeout=140, env=env, cwd=ROOT)
        left = os.listdir(shm_dir)
    out = p.stdout + p.stderr
    assert left == [], left
    assert p.returncode == 0, out[-4000:]
    assert "rank 2 was killed by SIGKILL; restarting it" in out, out[-3000:]
    rows = {r["rank"]: r for r in (json.loads(line.split("COUNT ", 1)[1])
                                    for line in out.splitlines() if "COUNT {" in line)}
    assert sorted(rows) == [0, 1, 2, 3], out[-3000:]
    assert "took rank(s) [2] back" in out, out[-3000:]
    members = [rows[r] for r in (0, 1, 3)]
    joiner = rows[2]
    assert joiner["restarted"] == 1
    if shm == "1":  # the first world's data through shared memory
        assert all(m["segments"] > 0 for m in members), rows
    else:
        assert all(m["segments"] == 0 for m in members), rows
    seen = _counts(members[0]["acc"])
    for m in members:
        assert _counts(m["acc"]) == seen, rows  # the same counts on every member
        assert seen[m["rank"]] == m["calls"], rows  # each member's calls exactly once
        assert m["seen_lost"] == [2], rows  # its results said rank 2 was lost meanwhile
        assert m["size"] == 4, rows  # rank 2 is back
        assert m["lost"] == [], rows  # and no longer reported lost
    old = seen[2] - joiner["calls"]
    assert 0 <= old <= 8, rows  # the killed process's calls counted at most once each
    mine = _counts(joiner["acc"])
    assert mine[2] == joiner["calls"], rows  # the joiner's own calls exactly once
    assert mine == [joiner["calls"]] * 4, rows  # everyone's calls since the join
