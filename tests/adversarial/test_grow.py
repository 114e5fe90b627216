"""Growing beyond the first world size (``asynccoll run --nnodes 1:2``): a second node's launcher
started while the first node's ranks train adds its ranks to the running job.

Node 0 (ranks 0-1) runs the eager-SGD job of ``_grow_job.py`` alone; node 1's launcher is
started a moment later with the same ``--rdzv`` and secret. Its ranks 2-3 were vacant: they
connect as restarted ranks do, and the members take them in at their next sync events
(``HOLD=4``: every rank trains on until its world has 4 ranks). Asserted: both launchers exit
0 and say what happened, the members' world grows from 2 to 4 (their ``world_size``, which
their partial results give), every rank ends past the last global step with parameters that
hash the same (bytes), and the new ranks' launcher says each joined as a new rank. Also: the
torch optimizer around Adam, exact accounting in a bare handle that grows, a new rank killed
while it is taken in (and restarted), a launcher that disagrees on the job's shape."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asynccoll.launch.env import free_port

HERE = Path(__file__).parent
ROOT = str(HERE.parents[1])
JOB = str(HERE / "_grow_job.py")
TORCH_JOB = str(HERE / "_rejoin_torch_job.py")
COUNT_JOB = str(HERE / "_rejoin_count_job.py")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(150)]


def _launch(node: int, port: int, env: dict[str, str], log: Path, job: str = JOB,
            extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "asynccoll.cli", "run", "-n", "2", "--nnodes", "1:2",
             "--node-rank", str(node), "--rdzv", f"127.0.0.1:{port}", "--rdzv-timeout", "30",
             "--grace", "1", *extra, job],
            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _finals(out: str) -> dict[int, tuple[int, int, str]]:
    return {int(r): (int(s), int(w), d) for r, s, w, d in
            re.findall(r"FINAL rank=(\d+) step=(\d+) world=(\d+) digest=(\w+)", out)}


def _grow(tmp_path: Path, job: str, extra: tuple[str, ...] = (), **env: str) -> tuple[str, str]:
    """Node 0 alone, then node 1 two seconds later (both with ``extra`` options); both
    launchers' output."""
    port = free_port()
    env = {**os.environ, "ASYNCCOLL_SECRET": "grow-test-secret-0123456789abcdef",
           "HOLD": "4", "ASYNCCOLL_LIVENESS": "10", **env}
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    first = _launch(0, port, env, logs[0], job, extra)
    try:
        time.sleep(2.0)  # node 0's ranks train meanwhile (they hold until the world has 4)
        second = _launch(1, port, env, logs[1], job, extra)
        try:  # (within the test's timeout: a hang fails with both launchers' output)
            deadline = time.monotonic() + 110
            codes: list[int | None] = []
            for p in (first, second):
                try:
                    codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    codes.append(None)
        finally:
            second.kill()
    finally:
        first.kill()
    out0, out1 = (p.read_text(errors="replace") for p in logs)
    assert codes == [0, 0], (out0[-3000:], out1[-3000:])
    return out0, out1


@pytest.mark.parametrize("transport", ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"))])
def test_a_second_node_grows_a_running_job(tmp_path: Path, transport: str) -> None:
    out0, out1 = _grow(tmp_path, JOB, ("--transport", transport), N="60", SYNC_EVERY="5")
    both = out0 + out1
    finals = _finals(both)
    assert sorted(finals) == [0, 1, 2, 3], both[-4000:]
    assert len({d for _, _, d in finals.values()}) == 1, finals  # equal to the bit
    # solo: each rank steps at its own pace, so global steps may differ by a step or two
    assert all(s >= 60 for s, _, _ in finals.values()), finals
    assert {w for _, w, _ in finals.values()} == {4}, finals
    assert re.search(r"GREW rank=0 step=\d+ world=[34]", out0), out0[-3000:]
    assert "node 1 joined the running job" in out0, out0[-3000:]
    # one admission each, or both at once when both were ready at the same sync event
    assert re.search(r"took rank\(s\) \[(2|2, 3)\] in \(new to the job\)", out0), out0[-3000:]
    assert "node 1 joins the running job" in out1, out1[-3000:]
    for r in (2, 3):
        assert re.search(rf"rank {r} joined the job \(a new rank\): taken in by ranks \[0, 1",
                         out1), out1[-3000:]


def test_a_torch_distributed_optimizer_around_adam_grows(tmp_path: Path) -> None:
    """The same with the torch ``DistributedOptimizer`` around Adam (its state moves too)."""
    pytest.importorskip("torch")
    out0, out1 = _grow(tmp_path, TORCH_JOB, N="40", VICTIMS="99", STEP_S="0.02")
    both = out0 + out1
    finals = {int(r): (int(s), d) for r, s, d in
              re.findall(r"FINAL rank=(\d+) steps=(\d+) digest=(\w+)", both)}
    assert sorted(finals) == [0, 1, 2, 3], both[-4000:]
    assert len({d for _, d in finals.values()}) == 1, finals  # parameters and Adam equal
    assert all(s >= 40 for s, _ in finals.values()), finals  # (solo: each rank its own pace)
    assert sorted(re.findall(r"WORLD rank=\d+ size=(\d+)", both)) == ["4"] * 4, both[-3000:]
    assert "in (new to the job)" in out0, out0[-3000:]


def test_a_new_rank_killed_while_it_is_taken_in_is_restarted_and_joins(tmp_path: Path) -> None:
    """Rank 2's first process SIGKILLs itself while the members take it in (their header came,
    their state is on its way); node 1's launcher restarts it (``--max-restarts 1``) and the
    restart joins: the job still ends with 4 equal ranks, both launchers exit 0."""
    out0, out1 = _grow(tmp_path, JOB, ("--max-restarts", "1"), N="60", SYNC_EVERY="5",
                       KILL_JOINING="1")
    both = out0 + out1
    assert "rank 2 dies as it would receive the state" in out1, out1[-3000:]
    assert "rank 2 was killed by SIGKILL; restarting it" in out1, out1[-3000:]
    assert re.search(r"rank 2 joined the job \(restart 1\)", out1), out1[-3000:]
    finals = _finals(both)
    assert sorted(finals) == [0, 1, 2, 3], both[-4000:]
    assert len({d for _, _, d in finals.values()}) == 1, finals
    assert {w for _, w, _ in finals.values()} == {4}, finals


def test_a_new_rank_lost_after_one_member_took_it_in_is_restarted_and_joins(
        tmp_path: Path) -> None:
    """The admission splits (``SPLIT_JOIN``): rank 2's first process dies once rank 0's
    stripe went out and before rank 1's did, so rank 0 took it in while rank 1 lost it
    taking it in. Both still compare their digests (rank 0 waits for rank 1's: before the
    fix every member waited there forever); the restart joins and all four end equal."""
    out0, out1 = _grow(tmp_path, JOB, ("--max-restarts", "1"), N="60", SYNC_EVERY="5",
                       KILL_JOINING="1", SPLIT_JOIN="1")
    assert re.search(r"\[0\] rank 0: partial allreduce 'eager-sgd' took rank\(s\) \[2", out0), \
        out0[-3000:]
    assert re.search(r"\[1\] rank 1: rank\(s\) \[2\] lost while joining", out0), out0[-3000:]
    assert "rank 2 was killed by SIGKILL; restarting it" in out1, out1[-3000:]
    assert re.search(r"rank 2 joined the job \(restart 1\)", out1), out1[-3000:]
    finals = _finals(out0 + out1)
    assert sorted(finals) == [0, 1, 2, 3], (out0 + out1)[-4000:]
    assert len({d for _, _, d in finals.values()}) == 1, finals
    assert {w for _, w, _ in finals.values()} == {4}, finals


def test_exact_accounting_in_a_partial_handle_that_grows(tmp_path: Path) -> None:
    """A bare solo partial allreduce (sum accumulation) where rank r contributes 1000**r per
    call, grown from 2 to 4 ranks through the generic calls (``admit_ready`` on the members
    after a flush, ``join_handle`` on the new ranks): rank 0's results add up to every rank's
    calls exactly (each contribution counted once), and the last result spans 4 ranks
    (``PartialResult.world_size``) with nobody lost."""
    out0, out1 = _grow(tmp_path, COUNT_JOB, CALLS="40", VICTIM="-1")
    both = out0 + out1
    counts = {c["rank"]: c for c in (json.loads(line.split("COUNT ", 1)[1])
                                     for line in both.splitlines() if "COUNT " in line)}
    assert sorted(counts) == [0, 1, 2, 3], both[-4000:]

    def groups(acc: list[float]) -> list[int]:  # digit groups: the calls of each rank counted
        v = round(acc[0])
        return [(v // 1000 ** r) % 1000 for r in range(4)]

    seen = groups(counts[0]["acc"])
    assert seen == [counts[r]["calls"] for r in range(4)], counts  # every call exactly once
    assert groups(counts[1]["acc"]) == seen, counts  # the same on both members
    for r in (2, 3):  # a new rank: its own calls exactly once (the others' since it joined)
        assert groups(counts[r]["acc"])[r] == counts[r]["calls"] > 0, counts
    assert all(c["size"] == 4 and c["lost"] == [] for c in counts.values()), counts


def test_a_node_that_disagrees_on_the_shape_is_refused(tmp_path: Path) -> None:
    """A launcher started with ``--nnodes 2`` against a job of ``--nnodes 1:2`` is refused at
    its check-in, naming both; the job goes on and ends well."""
    port = free_port()
    # node 0 trains for about 8 s (400 steps of 0.02 s): still running when the refused
    # launcher checks in, which takes seconds on a loaded machine (with 30 steps it once
    # found node 0 gone: refused connections until its --rdzv-timeout)
    env = {**os.environ, "ASYNCCOLL_SECRET": "grow-test-secret-0123456789abcdef", "N": "400",
           "HOLD": "0"}
    log0 = tmp_path / "node0.log"
    first = _launch(0, port, env, log0)
    try:
        time.sleep(1.0)
        wrong = subprocess.run(
            [sys.executable, "-m", "asynccoll.cli", "run", "-n", "2", "--nnodes", "2",
             "--node-rank", "1", "--rdzv", f"127.0.0.1:{port}", "--rdzv-timeout", "10", JOB],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
        assert wrong.returncode == 1, wrong.stderr
        assert "this node runs --nnodes 2 with -n 2, but the first node to join said " \
               "b'1:2x2'" in wrong.stderr, wrong.stderr
        assert first.wait(timeout=60) == 0, log0.read_text(errors="replace")[-3000:]
    finally:
        first.kill()


def test_a_first_world_rank_lost_after_the_job_grew_is_restarted_and_taken_back(
        tmp_path: Path) -> None:
    """The job grows from 2 to 4 ranks; then rank 1 (of the first world) SIGKILLs itself,
    node 0's launcher restarts it (``--max-restarts 1``), and its restart dials the new ranks
    too: ranks 0, 2 and 3 take it back, and all four end equal to the bit."""
    rejoin_job = str(HERE / "_rejoin_job.py")
    out0, out1 = _grow(tmp_path, rejoin_job, ("--max-restarts", "1"), N="60", KILL_AT="20",
                       VICTIMS="1", STEP_S="0.02")
    both = out0 + out1
    assert "rank 1 was killed by SIGKILL; restarting it" in out0, out0[-3000:]
    assert re.search(r"rank 1 joined the job \(restart 1\): taken back by ranks \[0, 2, 3\]",
                     out0), out0[-3000:]
    finals = {int(r): d for r, d in re.findall(r"FINAL rank=(\d+) steps=\d+ digest=(\w+)", both)}
    assert sorted(finals) == [0, 1, 2, 3], both[-4000:]
    assert len(set(finals.values())) == 1, finals


def test_ddp_with_the_partial_hook_grows(tmp_path: Path) -> None:
    """DDP with ``partial_hook`` around Adam: its bucket handles take the new ranks in; every
    rank ends with parameters and Adam's state equal to the bit."""
    pytest.importorskip("torch")
    out0, out1 = _grow(tmp_path, str(HERE / "_rejoin_ddp_job.py"), N="30", VICTIMS="99",
                       STEP_S="0.02")
    both = out0 + out1
    finals = {int(r): d for r, d in re.findall(r"FINAL rank=(\d+) steps=\d+ digest=(\w+)", both)}
    assert sorted(finals) == [0, 1, 2, 3], both[-4000:]
    assert len(set(finals.values())) == 1, finals
    assert "in (new to the job)" in out0, out0[-3000:]


def test_a_hierarchical_handle_grows_by_a_host_with_exact_accounting(tmp_path: Path) -> None:
    """The hierarchical partial allreduce (two fake hosts, {0, 1} and {2, 3}): the first
    world is one host, the second node's ranks make a second one; the handle regrows over
    both (its leaders' handle then spans two hosts), numbers its ranks as the job does, and
    every call of every rank is counted exactly once; nobody is reported lost."""
    out0, out1 = _grow(tmp_path, str(HERE / "_rejoin_hier_job.py"), KILLS="9@9999",
                       RESTARTS="2")
    both = out0 + out1
    rows = {c["rank"]: c for c in (json.loads(line.split("COUNT ", 1)[1])
                                   for line in both.splitlines() if "COUNT {" in line)}
    assert sorted(rows) == [0, 1, 2, 3], both[-4000:]

    def groups(acc: list[float]) -> list[int]:
        v = round(acc[0])
        return [(v // 1000 ** r) % 1000 for r in range(4)]

    seen = groups(rows[0]["acc"])
    assert seen == [rows[r]["calls"] for r in range(4)], rows  # every call exactly once
    assert groups(rows[1]["acc"]) == seen, rows
    for c in rows.values():
        assert (c["size"], c["lost"], c["hosts"]) == (4, [], [[0, 1], [2, 3]]), c
    assert "goes on with 2 hosts, 4 ranks (lost [])" in out0, out0[-3000:]


def test_a_sparse_partial_handle_grows_with_exact_accounting(tmp_path: Path) -> None:
    """A solo partial allreduce of SparseVectors (the flat handle's class, sparse data): rank r
    sends ``1000**r`` at index 0 and at its own index ``1 + r``; grown from 2 to 4 ranks,
    every call of every rank is counted exactly once at every index."""
    shm = tmp_path / "shm"
    shm.mkdir()
    out0, out1 = _grow(tmp_path, str(HERE / "_rejoin_sparse_job.py"), WANT="4",
                       ASYNCCOLL_SHM_DIR=str(shm))
    both = out0 + out1
    rows = {c["rank"]: c for c in (json.loads(line.split("COUNT ", 1)[1])
                                   for line in both.splitlines() if "COUNT {" in line)}
    assert sorted(rows) == [0, 1, 2, 3], both[-4000:]
    for m in (rows[0], rows[1]):
        acc = m["acc"]
        assert [round(acc[1 + r]) for r in range(4)] == [rows[r]["calls"] * 1000 ** r
                                                       for r in range(4)], rows
        assert round(acc[0]) == sum(rows[r]["calls"] * 1000 ** r for r in range(4)), rows
        assert not any(acc[5:]), acc
    assert all(c["size"] == 4 and c["lost"] == [] for c in rows.values()), rows
