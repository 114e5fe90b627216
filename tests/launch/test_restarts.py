"""``asynccoll run --max-restarts N``: a failed rank is started again while the others go on,
and a launcher started for a node whose launcher died takes that node's ranks again.

The ranks here (``_restarts_worker.py``) create no communicator: what a restarted process does
to join the job is the runtime's part; these tests check the launcher's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import free_low_port

HERE = Path(__file__).parent
WORKER = str(HERE / "_restarts_worker.py")
ROOT = str(HERE.parents[1])
SECRET = "a-job-secret-of-enough-length"

pytestmark = [pytest.mark.multiprocess]


@pytest.fixture
def launchers() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def _start(procs: list[subprocess.Popen[str]], shared: Path, args: list[str],
           secret: str = SECRET) -> subprocess.Popen[str]:
    shared.mkdir(exist_ok=True)
    p = subprocess.Popen([sys.executable, "-m", "asynccoll.cli", "run", "--grace", "1", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT, "TEST_SHARED": str(shared),
                              "ASYNCCOLL_SECRET": secret})
    procs.append(p)
    return p


def _run(procs: list[subprocess.Popen[str]], tmp_path: Path, args: list[str],
         timeout: float = 30) -> tuple[int, str, str]:
    p = _start(procs, tmp_path / "shared", args)
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def _starts(out: str, rank: int) -> list[tuple[int, str, str]]:
    """(restart, env hash, ASYNCCOLL_MAX_FAILURES) of each start of ``rank``, in order."""
    return [(int(k), h, m) for k, h, m in
            re.findall(rf"^\[{rank}\] start (\d+) env (\w+) max_failures (\S+)$", out, re.M)]


@pytest.mark.timeout(60)
def test_a_killed_rank_restarts_and_the_job_ends_0(
        launchers: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    code, out, err = _run(launchers, tmp_path, ["-n", "3", "--max-restarts", "3",
                                                WORKER, "once", "1"])
    assert code == 0, out + err
    assert "rank 1 was killed by SIGKILL; restarting it (restart 1 of at most 3, " \
           "--max-restarts)" in err
    pid = re.search(r"rank 1 restarted as pid (\d+)", err)
    assert pid is not None, err
    first, again = _starts(out, 1)
    assert first[0] == 0
    assert again[0] == 1
    assert first[1] == again[1]  # the same environment otherwise
    # the others ran on: they saw the victim's restart, and survive losses meanwhile
    for r in (0, 2):
        assert _starts(out, r) == [(0, _starts(out, r)[0][1], "1")]
    assert "stopping" not in err
    assert "failure" not in err


@pytest.mark.timeout(60)
def test_a_rank_failing_after_the_others_finished_is_not_restarted(
        launchers: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    # the others' training finished (they exited 0): a restart would find nobody to take it
    # back, so the launcher neither restarts it nor fails the job
    code, out, err = _run(launchers, tmp_path, ["-n", "3", "--max-restarts", "2",
                                                WORKER, "late", "1"])
    assert code == 0, out + err
    assert "rank 1 exited with code 3 after rank(s) [0, 2] finished; not restarted: the job " \
           "is done without it" in err
    assert [k for k, _, _ in _starts(out, 1)] == [0]
    assert "restarting it" not in err


@pytest.mark.timeout(60)
def test_rank_0_restarts(launchers: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    code, out, err = _run(launchers, tmp_path, ["-n", "2", "--max-restarts", "1",
                                                WORKER, "once", "0"])
    assert code == 0, out + err
    assert "rank 0 was killed by SIGKILL; restarting it (restart 1 of at most 1" in err
    assert [k for k, _, _ in _starts(out, 0)] == [0, 1]


@pytest.mark.timeout(60)
def test_two_ranks_failing_at_once_both_restart(
        launchers: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    code, out, err = _run(launchers, tmp_path, ["-n", "4", "--max-restarts", "2",
                                                WORKER, "once", "1,3", "5"])
    assert code == 0, out + err
    assert "rank 1 was killed by SIGKILL; restarting it" in err
    assert "rank 3 exited with code 5; restarting it" in err
    assert "(restart 2 of at most 2, --max-restarts)" in err
    for r in (1, 3):
        assert [k for k, _, _ in _starts(out, r)] == [0, 1]
        assert f"rank {r} restarted as pid" in err


@pytest.mark.timeout(60)
def test_a_failure_past_the_restarts_stops_the_job(
        launchers: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    t0 = time.monotonic()
    code, out, err = _run(launchers, tmp_path, ["-n", "2", "--max-restarts", "2",
                                                WORKER, "always", "1"])
    assert code == 128 + signal.SIGKILL, out + err
    assert time.monotonic() - t0 < 20  # not the 30 s rank 0 would sleep
    assert "(restart 1 of at most 2" in err
    assert "(restart 2 of at most 2" in err
    assert "restart 3" not in err
    assert [k for k, _, _ in _starts(out, 1)] == [0, 1, 2]
    assert "rank 1 exited with code 137; stopping the other ranks" in err


@pytest.mark.timeout(60)
def test_spent_restarts_leave_the_failure_to_max_failures(
        launchers: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    code, out, err = _run(launchers, tmp_path, ["-n", "3", "--max-restarts", "1",
                                                "--max-failures", "1", WORKER, "always", "2",
                                                "2"])
    # rank 2 dies twice: restarted once, then its second death is failure 1 of at most 1, and
    # ranks 0 and 1 go on to exit 0
    assert "rank 2 was killed by SIGKILL; restarting it (restart 1 of at most 1" in err
    assert "rank 2 was killed by SIGKILL; failure 1 of at most 1 (--max-failures)" in err
    assert code == 0, out + err


def test_bad_max_restarts_is_refused(launchers: list[subprocess.Popen[str]],
                                     tmp_path: Path) -> None:
    code, _, err = _run(launchers, tmp_path, ["-n", "2", "--max-restarts", "-1",
                                              WORKER, "once", ""])
    assert code == 2, err
    assert "max_restarts must be an int >= 0, got -1" in err


def _wait_files(shared: Path, names: list[str], proc: subprocess.Popen[str],
                timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not all((shared / n).exists() for n in names):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{names} not started"
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_a_replacement_launcher_takes_a_lost_nodes_ranks(
        launchers: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    common = ["-n", "2", "--nnodes", "2", "--rdzv", f"127.0.0.1:{free_low_port()}",
              "--max-restarts", "1", "--rdzv-timeout", "20"]
    node0 = _start(launchers, shared, [*common, "--node-rank", "0", WORKER, "node", ""])
    node1 = _start(launchers, shared, [*common, "--node-rank", "1", WORKER, "node", ""])
    _wait_files(shared, [f"started-{r}-0" for r in range(4)], node0)
    # while node 1's launcher lives, a second one is refused
    dup = _start(launchers, shared, [*common, "--node-rank", "1", WORKER, "node", ""])
    _, err = dup.communicate(timeout=20)
    assert dup.returncode == 1, err
    assert "node rank 1 was started twice" in err
    node1.send_signal(signal.SIGKILL)  # the launcher dies; its ranks follow it
    node1.communicate(timeout=10)
    # only the job secret's holder may replace it
    stranger = _start(launchers, shared, [*common, "--node-rank", "1", WORKER, "node", ""],
                      secret="not-the-job-secret-0123456789")
    _, err = stranger.communicate(timeout=20)
    assert stranger.returncode == 1, err
    assert "refused us" in err
    assert not (shared / "started-2-1").exists()
    again = _start(launchers, shared, [*common, "--node-rank", "1", WORKER, "node", ""])
    out, err = again.communicate(timeout=30)
    assert again.returncode == 0, out + err
    assert "node 1's launcher is gone: this one replaces it and restarts ranks 2-3 " \
           "(restart 1 of at most 1, --max-restarts)" in err
    for r in (2, 3):
        assert f"rank {r} restarted as pid" in err
        assert [k for k, _, _ in _starts(out, r)] == [1]  # ASYNCCOLL_RESTART=1
    # node 0 went on meanwhile, and ends 0 once its ranks do
    assert node0.poll() is None
    (shared / "go").touch()
    out0, err0 = node0.communicate(timeout=20)
    assert node0.returncode == 0, out0 + err0
    assert "node 1's launcher is gone, and ranks 2-3 with it; waiting up to 20.0 s for a " \
           "launcher to replace it (--max-restarts)" in err0
    assert "node 1 has a new launcher: it restarts ranks 2-3" in err0


@pytest.mark.timeout(60)
def test_a_lost_node_without_restarts_is_given_up_not_waited_for(
        launchers: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    common = ["-n", "1", "--nnodes", "2", "--rdzv", f"127.0.0.1:{free_low_port()}"]
    node0 = _start(launchers, shared, [*common, "--node-rank", "0", WORKER, "node", ""])
    node1 = _start(launchers, shared, [*common, "--node-rank", "1", WORKER, "node", ""])
    _wait_files(shared, ["started-0-0", "started-1-0"], node0)
    node1.send_signal(signal.SIGKILL)
    node1.communicate(timeout=10)
    again = _start(launchers, shared, [*common, "--node-rank", "1", WORKER, "node", ""])
    _, err = again.communicate(timeout=20)
    assert again.returncode == 1
    assert "node rank 1 lost its launcher, and replacing it would be its restart 1, past " \
           "--max-restarts 0" in err, err
    (shared / "go").touch()
    t0 = time.monotonic()
    out0, err0 = node0.communicate(timeout=20)
    assert node0.returncode == 0, out0 + err0
    assert time.monotonic() - t0 < 10  # not the 300 s of --exit-timeout
    assert "node 1's launcher is gone, and rank 1 with it; it cannot be replaced (0 of at " \
           "most 0 restarts made, --max-restarts): the other nodes go on without it" in err0


@pytest.mark.timeout(60)
def test_node_0_cannot_be_replaced_and_says_why(
        launchers: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    common = ["-n", "1", "--nnodes", "2", "--rdzv", f"127.0.0.1:{free_low_port()}",
              "--max-restarts", "1", "--rdzv-timeout", "30"]
    node0 = _start(launchers, shared, [*common, "--node-rank", "0", WORKER, "node", ""])
    node1 = _start(launchers, shared, [*common, "--node-rank", "1", WORKER, "node", ""])
    _wait_files(shared, ["started-0-0", "started-1-0"], node0)
    node0.send_signal(signal.SIGKILL)  # the store dies with it
    node0.communicate(timeout=10)
    t0 = time.monotonic()
    again = _start(launchers, shared, [*common, "--node-rank", "0", WORKER, "node", ""])
    _, err = again.communicate(timeout=30)
    assert again.returncode == 1, err
    assert time.monotonic() - t0 < 15  # told by node 1, not its 30 s join timeout
    assert "node 1's launcher (pid" in err
    assert "node 0 cannot be replaced (its launcher hosted the job's store" in err
    assert not (shared / "started-0-1").exists()
    node1.send_signal(signal.SIGTERM)
    _, err1 = node1.communicate(timeout=20)
    assert "lost the job's store at 127.0.0.1:" in err1
    assert "node 0 cannot be replaced" in err1
