"""A killed rank comes back: ``asynccoll run --max-restarts`` restarts it and it joins.

Eager-SGD on 4 real processes under the launcher: a rank SIGKILLs itself at step 10 of 60; the
launcher restarts it (``ASYNCCOLL_RESTART=1``), its ``connect()`` dials the members, its first
step is taken back at the members' next sync event (it receives the parameters, the momentum
and the global step, striped over the members, and every rank checks a digest of them), and
then it trains with the others. Asserted: the launcher exits 0 and says it restarted the rank;
every rank reaches step 60; the restarted rank says it joined; every rank's final parameters
hash the same (bytes, not a tolerance). For solo, majority and quorum, and with rank 0 (the
lowest member, which coordinates the recovery) as the victim; two ranks killed and both
restarted; a restarted rank killed again while it joins (before and after the members took it
back); and exact accounting through a join in a bare partial handle (rank r contributes
1000**r: every member's calls counted exactly once, the restarted rank's new calls exactly once
and its old process's at most as many as it made). And the torch ``DistributedOptimizer``
around Adam, and DDP with ``partial_hook`` around Adam (ranks 0, 1 and 2 killed at steps 30,
60 and 90, two buckets): parameters and Adam's state equal to the bit on every rank at the
end. Losses that overlap an admission (a restarted rank that learns of a loss before it is
taken back, then a loss in the world it joined), and churn: a random rank killed every few
seconds, ten times. And a rank killed inside a sync event's parameter allreduce: the survivors
go on (another event follows), it comes back and joins; the same for the torch
``DistributedOptimizer``, a rank killed inside the event that takes another's restart back.
And a restart that the members end the job without taking back: it fails at once, the
launcher says why and counts no failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("_rejoin_job.py")
ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _run(policy: str, victims: str, restarts: int, job: Path = JOB,
         **extra: str) -> tuple[int, str]:
    env = dict(os.environ, POLICY=policy, VICTIMS=victims, N="60", KILL_AT="10",
               STEP_S="0.06", PYTHONPATH=ROOT)
    env.update(extra)
    p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "4",
                        "--max-restarts", str(restarts), str(job)],
                       capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    return p.returncode, p.stdout + p.stderr


def _finals(out: str) -> list[tuple[int, int, str, int]]:
    got = re.findall(r"FINAL rank=(\d) steps=(\d+) digest=(\w+) restarted=(\d)", out)
    return [(int(r), int(s), d, int(k)) for r, s, d, k in got]


def _all_equal_at(out: str, n: int = 60) -> list[tuple[int, int, str, int]]:
    finals = _finals(out)
    assert sorted(r for r, *_ in finals) == [0, 1, 2, 3], out[-3000:]
    assert all(s == n for _, s, _, _ in finals), finals
    assert len({d for _, _, d, _ in finals}) == 1, finals  # equal to the bit
    return finals


@pytest.mark.timeout(170)
@pytest.mark.parametrize(("policy", "victim"), [("solo", 2), ("majority", 2), ("quorum", 2),
                                                ("solo", 0)])
def test_a_killed_rank_is_restarted_joins_and_ends_equal(policy: str, victim: int) -> None:
    code, out = _run(policy, str(victim), 1)
    assert code == 0, out[-4000:]
    assert f"rank {victim} was killed by SIGKILL; restarting it" in out, out[-3000:]
    finals = _all_equal_at(out)
    assert [r for r, _, _, k in finals if k == 1] == [victim], finals
    assert f"rank {victim} joined at step" in out, out[-3000:]
    assert "took rank(s) [" in out  # the members say they took it back
    # and the launcher, in one line: left, restarted, joined (asynccoll/launch/joined.py)
    assert re.search(rf"asynccoll run: rank {victim} joined the job \(restart 1\): taken back "
                     rf"by ranks \[[\d, ]+\] into '[^']+' from execution \d+", out), out[-3000:]
    assert "did not close within" not in out  # the restarted rank closes with the others


@pytest.mark.timeout(170)
@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed")
@pytest.mark.parametrize("victims", ["2", "0,3"])
def test_over_ucx_killed_ranks_are_restarted_and_join(victims: str) -> None:
    # the same over ucx: the restarted process dials every member, a lower-ranked member takes
    # the dial from above because it lost that rank (two at once: the two restarts also dial
    # each other, the lower one's dial wins)
    code, out = _run("solo", victims, len(victims.split(",")), ASYNCCOLL_TRANSPORT="ucx")
    assert code == 0, out[-4000:]
    finals = _all_equal_at(out)
    want = sorted(int(v) for v in victims.split(","))
    assert sorted(r for r, _, _, k in finals if k == 1) == want, finals
    for v in want:
        assert f"rank {v} joined at step" in out, out[-3000:]


@pytest.mark.timeout(170)
def test_a_rank_lost_inside_a_sync_events_allreduce_ends_nobody_and_comes_back() -> None:
    code, out = _run("solo", "1", 1, KILL_IN_SYNC="1", SYNC_EVERY="5")
    assert code == 0, out[-4000:]
    assert "rank 1 dies in its sync event's allreduce" in out, out[-4000:]
    said = re.findall(r"rank (\d): rank 1 lost during EagerSGD's sync event \(its parameters' "
                      r"allreduce\): the survivors go on, another event follows", out)
    assert said, out[-4000:]
    assert set(said) <= {"0", "2", "3"}, out[-4000:]
    assert "rank 1 joined at step" in out, out[-4000:]
    _all_equal_at(out)


@pytest.mark.timeout(170)
def test_a_restart_the_members_end_without_taking_back_fails_at_once_and_fails_no_job() -> None:
    job = Path(__file__).with_name("_rejoin_late_job.py")
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "4",
                        "--max-failures", "0", "--max-restarts", "1", str(job)],
                       capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]  # no failure counted (--max-failures 0)
    assert sorted(re.findall(r"MEMBER (\d) ends with rank 2's restart waiting", out)) == \
        ["0", "1", "3"], out[-4000:]
    gave_up = re.findall(r"LATE gave up after ([\d.]+) s: peer rank \d lost: ranks \[0, 1, 3\] "
                         r"closed before taking it back: the job ended", out)
    assert len(gave_up) == 1, out[-4000:]
    assert float(gave_up[0]) < 20, out[-4000:]  # not its 60 s timeout, nor 30 s of close
    assert "asynccoll run: rank 2 (restart 1) was not taken back: ranks [0, 1, 3] closed before " \
           "taking it back: the job ended (partial allreduce 'late')" in out, out[-4000:]
    assert "asynccoll run: rank 2 exited with code 1: the job ended before its restart was " \
           "taken back; not counted as a failure" in out, out[-4000:]


@pytest.mark.timeout(170)
def test_two_ranks_killed_are_both_restarted_and_join() -> None:
    code, out = _run("solo", "1,2", 2)
    assert code == 0, out[-4000:]
    finals = _all_equal_at(out)
    assert sorted(r for r, _, _, k in finals if k == 1) == [1, 2], finals
    assert "did not close within" not in out


@pytest.mark.alone  # the kill lands 0.05 s / 0.3 s after connect(): timing
@pytest.mark.timeout(170)
@pytest.mark.parametrize("after", ["0.05", "0.3"])
def test_a_rank_killed_again_while_it_joins_comes_back_once_more(after: str) -> None:
    # 0.05 s after its connect(): it said it is ready, the members have not taken it back;
    # 0.3 s: usually taken back, the state on its way or in (both are covered over runs)
    # (150 steps: room for two restarts, a few seconds each on a loaded 2-core machine)
    code, out = _run("solo", "2", 2, KILL_JOINING=after, N="150")
    assert code == 0, out[-4000:]
    assert "restarting it (restart 2 of at most 2" in out, out[-3000:]
    finals = _all_equal_at(out, 150)
    assert [(r, k) for r, _, _, k in finals if k] == [(2, 2)], finals


@pytest.mark.timeout(170)
def test_exact_accounting_through_a_join() -> None:
    code, out = _run("solo", "2", 1, job=JOB.with_name("_rejoin_count_job.py"))
    assert code == 0, out[-4000:]
    rows = {r["rank"]: r for r in (json.loads(line.split("COUNT ", 1)[1])
                                    for line in out.splitlines() if "COUNT {" in line)}
    assert sorted(rows) == [0, 1, 2, 3], out[-3000:]

    def counts(acc: list[float]) -> list[int]:  # digit groups: contributions of each rank
        v = round(acc[0])
        return [(v // 1000 ** r) % 1000 for r in range(4)]

    members = [rows[r] for r in (0, 1, 3)]
    joiner = rows[2]
    assert joiner["restarted"] == 1
    seen = counts(members[0]["acc"])
    for m in members:
        assert counts(m["acc"]) == seen, rows  # the same counts on every member
        assert seen[m["rank"]] == m["calls"], rows  # each member's calls exactly once
        assert m["size"] == 4, rows  # rank 2 is back
        assert m["lost"] == [], rows  # and not reported lost
    old = seen[2] - joiner["calls"]
    assert 0 <= old <= 8, rows  # the killed process's calls counted at most once each
    mine = counts(joiner["acc"])
    assert mine[2] == joiner["calls"], rows  # the joiner's own calls exactly once
    assert mine == [joiner["calls"]] * 4, rows  # everyone's calls since the join


@pytest.mark.timeout(200)
def test_exact_accounting_under_churn() -> None:
    # bench/churn_account.py's job, short: a kill chance every 20 calls among ranks 1-3 over
    # 170 calls (about 4 kills), each restarted and joined; rank 0's sum is the whole account
    sys.path.insert(0, str(Path(ROOT) / "bench"))
    import churn_account  # the bench's run and account (bench/ is not a package)

    rec = churn_account.run_once(calls=170, every=20, timeout=180)
    assert rec["code"] == 0, rec.get("tail")
    assert rec["kills"] >= 3, rec
    assert rec["joins"] == rec["kills"], rec  # every killed process came back and joined
    ranks = rec["ranks"]
    assert sum(x["deaths"] for x in ranks) == rec["kills"], rec
    assert ranks[0]["deaths"] == 0
    assert ranks[0]["counted"] == ranks[0]["made"], rec  # rank 0's calls exactly once
    for x in ranks[1:]:
        # the last process's calls every one, a dead process's at most once each
        assert x["final_calls"] <= x["counted"] <= x["made"], rec
    assert all(x["own_exact"] for x in ranks), rec  # each counts its own calls exactly once
    assert all(x["size"] == 4 and x["reported_lost"] == [] for x in ranks), rec
    assert rec["exact"], rec


@pytest.mark.timeout(200)
def test_torch_distributed_optimizer_around_adam_takes_a_restarted_rank_back() -> None:
    # One script for first starts and restarts: the constructor's broadcast does nothing on
    # the joiner, the loop runs on step_count. 200 steps: the restarted process imports torch
    # before it can join (seconds). DDP with partial_hook: the churn test below. 300 steps:
    # under the suite's load the restart once took 6.9 s from connect() to joined, and 200
    # steps were over by then (joined at the members' finish, equal, but not while training).
    pytest.importorskip("torch")
    code, out = _run("solo", "2", 1, job=JOB.with_name("_rejoin_torch_job.py"), N="300")
    assert code == 0, out[-4000:]
    finals = _all_equal_at(out, 300)  # the digest covers Adam's state too
    assert [r for r, _, _, k in finals if k == 1] == [2], finals
    joined = re.search(r"rank 2 joined at step (\d+) \(from execution (\d+)\)", out)
    assert joined is not None, out[-3000:]
    assert int(joined.group(1)) < 300, out[-3000:]  # taken back while the others train
    # the event was planned: held in the members' step's own execution, the one right
    # before the joiner's first (an event after a step flushes one to three more first)
    first = int(joined.group(2))
    at = {int(r) for r, e in re.findall(r"EVENT rank=(\d) round=(\d+)", out)
          if int(e) == first - 1}
    assert at, out[-3000:]
    assert at <= {0, 1, 3}, at


@pytest.mark.timeout(200)
def test_the_distributed_optimizer_survives_a_rank_lost_inside_the_event_that_admits() -> None:
    # rank 2 killed at step 10 and restarted; rank 3 killed as it enters the sync event's
    # allreduce that takes rank 2 back: the others go on, take both back, end equal
    pytest.importorskip("torch")
    code, out = _run("solo", "2", 2, job=JOB.with_name("_rejoin_torch_job.py"), N="200",
                     KILL_IN_SYNC="3")
    assert code == 0, out[-4000:]
    assert "rank 3 dies in its sync event's allreduce" in out, out[-4000:]
    said = re.findall(r"rank (\d): rank 3 lost during DistributedOptimizer's sync event \(its "
                      r"parameters' allreduce\)", out)
    assert said, out[-4000:]
    assert set(said) <= {"0", "1"}, out[-4000:]
    finals = _all_equal_at(out, 200)
    assert sorted(r for r, _, _, k in finals if k == 1) == [2, 3], finals


@pytest.mark.timeout(200)
@pytest.mark.xdist_group("churn")  # not beside the other churn test: restarts take seconds
def test_the_ddp_hook_takes_restarted_ranks_back_under_churn() -> None:
    # DDP with partial_hook (majority) around Adam, two buckets (both handles grown), one
    # script for first starts and restarts (a one-rank Gloo group per process, the broadcasts
    # no-ops on a joiner, the loop on state.step_count). Three kills at global steps 30, 60
    # and 90 of 250, of ranks 0 (the lowest member), 1 and 2 (restarts overlap: a rank dies
    # while another joins): each is taken back while the others train and every rank ends
    # equal to the bit, Adam's state included. A kill that lands in a sync event's synchronous
    # part (the parameters' allreduce, an admission) is survived too: the survivors hold
    # another event (hook_events.py).
    pytest.importorskip("torch")
    code, out = _run("majority", "-1", 3, job=JOB.with_name("_rejoin_ddp_job.py"), N="250",
                     CHURN="30", KILLS="3")
    assert code == 0, out[-4000:]
    assert out.count("was killed by SIGKILL; restarting it") == 3, out[-4000:]
    finals = _all_equal_at(out, 250)
    assert sorted(r for r, _, _, k in finals if k == 1) == [0, 1, 2], finals
    assert sorted(set(re.findall(r"rank (\d) joined the job", out))) == ["0", "1", "2"], \
        out[-4000:]
    joined = [int(s) for s in re.findall(r"rank \d joined at step (\d+)", out)]
    assert len(joined) == 3, out[-3000:]
    assert max(joined) < 250, joined  # taken back while the others train
    assert re.findall(r"buckets=(\d+)", out) == ["2"] * 4, out[-3000:]


@pytest.mark.timeout(170)
def test_a_loss_learned_before_the_admission_and_one_after_it() -> None:
    # Rank 2 restarts; rank 3 dies once rank 2's new process connected, which learns that loss
    # before it says it is ready; then rank 1 dies once rank 2 is back. The restarted rank
    # must not recover its handle from the first loss itself (nobody else agrees on that
    # membership): it waited on that recovery after the second loss, and so did the others
    # on it, until the timeout.
    code, out = _run("solo", "2", 3, OVERLAP="1", N="150", ASYNCCOLL_TIMEOUT="60")
    assert code == 0, out[-4000:]
    learned = out.index("rank 2 learned [3] lost before it joined")
    assert learned < out.index("[2] rank 2: joined partial allreduce"), out[-4000:]
    assert "restart 3 of at most 3" in out, out[-3000:]
    finals = _all_equal_at(out, 150)
    assert sorted(r for r, _, _, k in finals if k == 1) == [1, 2, 3], finals
    assert "did not agree" not in out
    assert "lost during the agreement" not in out


@pytest.mark.timeout(170)
@pytest.mark.xdist_group("churn")  # not beside the DDP churn test: restarts take seconds
def test_churn_a_random_rank_killed_and_restarted_ten_times(tmp_path: Path) -> None:
    # every 80 steps a rank drawn from the step number kills itself (once per step number,
    # never the last member); each comes back and joins, often while another is lost or
    # joining; 200 steps after the last kill for its restart to join. About 50 s on two
    # loaded cores.
    code, out = _run("solo", "9", 20, CHURN="10", CHURN_EVERY="80", N="1000",
                     STEP_S="0.02", CHURN_DIR=str(tmp_path), ASYNCCOLL_TIMEOUT="60")
    assert code == 0, out[-4000:]
    kills = out.count("CHURN kill")
    assert kills >= 8, out[-4000:]
    assert out.count("was killed by SIGKILL; restarting it") == kills, out[-4000:]
    # every process restarted after a kill joined (one whose join failed was restarted too)
    restarts = out.count("; restarting it (restart")
    assert kills <= len(re.findall(r"rank \d joined at step", out)) <= restarts, out[-4000:]
    _all_equal_at(out, 1000)  # and every rank's parameters equal to the bit
    assert "did not close within" not in out
