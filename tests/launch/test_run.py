"""``asynccoll run`` end to end: prefixes, environment, failure propagation, signals, usage."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import free_low_port as free_port

HERE = Path(__file__).parent
WORKER = str(HERE / "_worker.py")
ROOT = str(HERE.parents[1])

pytestmark = [pytest.mark.multiprocess]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"
    return True


class Job:
    """One ``asynccoll run`` launcher process, and the pids its ranks report."""

    def __init__(self, args: list[str], piddir: Path, env: dict[str, str] | None = None) -> None:
        self.piddir = piddir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asynccoll.cli", "run", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": ROOT, "TEST_PIDDIR": str(piddir), **(env or {})})

    def pids(self) -> dict[int, int]:
        return {int(p.name): int(p.read_text()) for p in self.piddir.iterdir()
                if p.name.isdigit()}

    def wait_for_ranks(self, ranks: int, timeout: float = 20.0) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while len(self.pids()) < ranks:
            assert time.monotonic() < deadline, "ranks did not start"
            assert self.proc.poll() is None, self.proc.communicate()
            time.sleep(0.05)
        return self.pids()

    def finish(self, timeout: float) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"launcher still running after {timeout} s:\n{out}{err}") \
                from None
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        for pid in self.pids().values():  # ranks of ours a failed test may have left behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[list[Job]]:
    jobs: list[Job] = []
    yield jobs
    for j in jobs:
        j.kill()


def start(jobs: list[Job], tmp_path: Path, args: list[str], **env: str) -> Job:
    d = tmp_path / f"pids{len(jobs)}"
    d.mkdir()
    j = Job(args, d, env)
    jobs.append(j)
    return j


@pytest.mark.timeout(60)
def test_output_is_prefixed_and_environment_set(job: list[Job], tmp_path: Path) -> None:
    code, out, err = start(job, tmp_path, ["-n", "3", WORKER, "hello"]).finish(40)
    assert code == 0, err
    for r in range(3):
        assert (f"[{r}] env ASYNCCOLL_RANK={r} ASYNCCOLL_WORLD_SIZE=3 ASYNCCOLL_LOCAL_RANK={r} "
                "ASYNCCOLL_NODE_RANK=0 ASYNCCOLL_TRANSPORT=tcp ASYNCCOLL_STORE_HOSTED=1") in out
        assert f"[{r}] no newline from {r}\n" in out
        assert f"[{r}] to stderr from {r}" in err
        assert f"[{r}] store=127.0.0.1:" in out
        assert f"[{r}] store=127.0.0.1:0 " not in out  # the concrete port, not 0
    assert "secretlen=64" in out
    assert all(line.startswith("[") for line in out.splitlines())


@pytest.mark.timeout(60)
def test_a_failing_rank_stops_the_others_and_sets_the_exit_code(
        job: list[Job], tmp_path: Path) -> None:
    (tmp_path / "shared").mkdir()
    j = start(job, tmp_path, ["-n", "3", "--grace", "2", WORKER, "fail", "1", "7"],
              TEST_SHARED=str(tmp_path / "shared"))
    pids = j.wait_for_ranks(3)
    t0 = time.monotonic()
    code, _, err = j.finish(30)
    assert code == 7
    assert time.monotonic() - t0 < 10  # not the 60 s the others would sleep
    assert "rank 1 exited with code 7; stopping the other ranks" in err
    assert not any(_alive(p) for p in pids.values())


@pytest.mark.timeout(60)
def test_sigint_stops_all_ranks_cleanly(job: list[Job], tmp_path: Path) -> None:
    # --verbose: each rank's own output after Ctrl-C (else one launcher line per rank)
    j = start(job, tmp_path, ["-n", "3", "--verbose", WORKER, "sleep"])
    pids = j.wait_for_ranks(3)
    time.sleep(0.3)  # let the ranks reach their sleep
    j.proc.send_signal(signal.SIGINT)
    code, out, err = j.finish(30)
    assert code == 128 + signal.SIGINT
    for r in range(3):
        assert f"[{r}] interrupted" in out  # each rank got SIGINT and cleaned up itself
    assert "got SIGINT; stopping all ranks" in err
    assert not any(_alive(p) for p in pids.values())


@pytest.mark.timeout(60)
def test_ranks_that_ignore_signals_are_killed_after_the_grace_period(
        job: list[Job], tmp_path: Path) -> None:
    j = start(job, tmp_path, ["-n", "2", "--grace", "0.5", WORKER, "stubborn"])
    pids = j.wait_for_ranks(2)
    time.sleep(0.5)
    t0 = time.monotonic()
    j.proc.send_signal(signal.SIGTERM)
    code, _, _ = j.finish(30)
    assert code == 128 + signal.SIGTERM
    assert 0.4 < time.monotonic() - t0 < 10  # SIGTERM, grace, then SIGKILL
    assert not any(_alive(p) for p in pids.values())


@pytest.mark.timeout(60)
def test_module_mode_and_killed_rank_code(job: list[Job], tmp_path: Path) -> None:
    code, out, err = start(job, tmp_path, ["-n", "1", "-m", "json.tool", "--help"]).finish(30)
    assert code == 0, err
    assert "[0] usage:" in out
    code, _, err = start(job, tmp_path, ["-n", "1", "--no-python", "sh", "-c",
                                         "kill -9 $$"]).finish(30)
    assert code == 128 + 9
    assert "rank 0 exited with code 137" in err


@pytest.mark.timeout(60)
def test_two_launchers_form_one_job_and_share_a_failure(job: list[Job], tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "shared").mkdir()
    secret = {"ASYNCCOLL_SECRET": "a-job-secret-of-enough-length",
              "TEST_SHARED": str(tmp_path / "shared")}
    common = ["-n", "2", "--nnodes", "2", "--rdzv", f"127.0.0.1:{port}"]
    a = start(job, tmp_path, [*common, "--node-rank", "0", WORKER, "hello"], **secret)
    b = start(job, tmp_path, [*common, "--node-rank", "1", WORKER, "hello"], **secret)
    ca, oa, ea = a.finish(40)
    assert ca == 0, oa + ea
    cb, ob, eb = b.finish(40)
    assert cb == 0, ob + eb
    assert "[0] env ASYNCCOLL_RANK=0 ASYNCCOLL_WORLD_SIZE=4 ASYNCCOLL_LOCAL_RANK=0" in oa
    assert "[3] env ASYNCCOLL_RANK=3 ASYNCCOLL_WORLD_SIZE=4 ASYNCCOLL_LOCAL_RANK=1 " \
           "ASYNCCOLL_NODE_RANK=1" in ob
    assert f"[2] store=127.0.0.1:{port} " in ob
    # a rank failing on node 1 stops node 0's ranks, which would otherwise sleep 60 s
    port = free_port()
    common = ["-n", "2", "--nnodes", "2", "--rdzv", f"127.0.0.1:{port}"]
    a = start(job, tmp_path, [*common, "--node-rank", "0", WORKER, "fail", "3", "5"], **secret)
    b = start(job, tmp_path, [*common, "--node-rank", "1", WORKER, "fail", "3", "5"], **secret)
    pa = a.wait_for_ranks(2)
    (ca, _, ea), (cb, _, _) = a.finish(30), b.finish(30)
    assert cb == 5
    assert ca == 5, ea
    assert "another node failed (rank 3 exited with code 5)" in ea
    assert not any(_alive(p) for p in pa.values())


@pytest.mark.timeout(60)
def test_node0_keeps_the_store_until_the_other_nodes_are_done(
        job: list[Job], tmp_path: Path) -> None:
    port = free_port()
    common = ["-n", "2", "--nnodes", "2", "--rdzv", f"127.0.0.1:{port}"]
    secret = {"ASYNCCOLL_SECRET": "a-job-secret-of-enough-length"}
    a = start(job, tmp_path, [*common, "--node-rank", "0", WORKER, "store"], **secret)
    b = start(job, tmp_path, [*common, "--node-rank", "1", WORKER, "store"], **secret)
    ca, oa, ea = a.finish(40)  # node 0's ranks are done long before node 1's use the store
    cb, ob, eb = b.finish(40)
    assert (ca, cb) == (0, 0), oa + ea + ob + eb
    counts = sorted(int(line.rsplit(" ", 1)[1]) for line in (oa + ob).splitlines()
                    if " store ok " in line)
    assert counts == [1, 2, 3, 4]


@pytest.mark.timeout(60)
def test_a_launcher_with_the_wrong_secret_is_refused(job: list[Job], tmp_path: Path) -> None:
    port = free_port()
    common = ["-n", "1", "--nnodes", "2", "--rdzv", f"127.0.0.1:{port}"]
    a = start(job, tmp_path, [*common, "--node-rank", "0", "--rdzv-timeout", "7", WORKER,
                              "sleep"], ASYNCCOLL_SECRET="the-right-secret-0123456789")
    t0 = time.monotonic()
    b = start(job, tmp_path, [*common, "--node-rank", "1", WORKER, "sleep"],
              ASYNCCOLL_SECRET="the-wrong-secret-0123456789")
    code, _, err = b.finish(30)
    assert code == 1
    assert "refused us" in err  # the node with the wrong secret learns it itself, at once
    assert time.monotonic() - t0 < 15  # not its join timeout (300 s)
    assert not b.pids()  # no rank was started
    # a refusal decides nothing for node 0 (a stranger's frame looks the same): it waits for
    # its nodes, says what the store refused, and names both at its join timeout
    code, _, err = a.finish(30)
    assert code == 1
    assert "still waiting for the other nodes; the store refused 1 connection (127.0.0.1 x1)" \
        in err, err
    assert "nodes [1] did not join within 7.0 s; the store refused 1 connection" in err, err
    assert "is the same job secret set on every node?" in err
    assert not a.pids()


@pytest.mark.timeout(60)
def test_sigint_while_waiting_for_other_nodes(job: list[Job], tmp_path: Path) -> None:
    port = free_port()
    a = start(job, tmp_path, ["-n", "1", "--nnodes", "2", "--node-rank", "0", "--rdzv",
                              f"127.0.0.1:{port}", WORKER, "sleep"],
              ASYNCCOLL_SECRET="the-right-secret-0123456789")
    deadline = time.monotonic() + 20
    while True:  # until node 0's store listens, i.e. the launcher waits for node 1
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    a.proc.send_signal(signal.SIGINT)
    code, _, err = a.finish(30)
    assert code == 130
    assert time.monotonic() - t0 < 5
    assert "no rank started" in err


@pytest.mark.parametrize(("args", "message"), [
    (["-n", "0", "x.py"], "nproc must be an int >= 1"),
    (["-n", "2", "--nnodes", "2", "x.py"], "rdzv"),
    (["-n", "2", "--nnodes", "2", "--node-rank", "2", "--rdzv", "h:1", "x.py"],
     "node_rank must be in 0..1"),
    (["-n", "2"], "CMD is missing"),
    (["-n", "2", "--rdzv", "nope", "x.py"], "--rdzv"),
    (["-n", "2", "--nnodes", "2:1", "--rdzv", "h:1", "x.py"], "1 <= MIN <= MAX"),
    (["-n", "2", "--nnodes", "1:x", "x.py"], "must be N or MIN:MAX"),
    (["-n", "2", "--nnodes", "1:2", "x.py"], "rdzv"),
    (["-n", "2", "--nnodes", "1:2", "--node-rank", "2", "--rdzv", "h:1", "x.py"],
     "node_rank must be in 0..1"),
])
def test_usage_errors(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", *args],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": ROOT,
                               "ASYNCCOLL_SECRET": "0123456789abcdef"})
    assert proc.returncode == 2
    assert message in proc.stderr


BLAME = """
import asyncio, os, numpy as np, asynccoll

async def main():
    async with await asynccoll.connect(collective_timeout=20) as comm:
        await comm.barrier()
        if comm.rank == 2:
            await asyncio.sleep(0.2)
            raise ValueError("boom on rank 2")
        for _ in range(10_000):
            await comm.allreduce(np.ones(4))
            await asyncio.sleep(0.001)

asyncio.run(main())
"""


@pytest.mark.timeout(90)
def test_the_rank_that_failed_first_is_blamed_and_its_traceback_printed_first(
        job: list[Job], tmp_path: Path) -> None:
    """Rank 2 raises; the others then lose it and fail too, some of them before rank 2 exits.
    The launcher blames rank 2, prints its traceback before the followers' one-line reports,
    and exits with its code."""
    script = tmp_path / "blame.py"
    script.write_text(BLAME)
    code, _, err = start(job, tmp_path, ["-n", "4", "--grace", "5", str(script)]).finish(60)
    assert code == 1, err
    assert "rank 2 exited with code 1; stopping the other ranks" in err
    assert "[2] ValueError: boom on rank 2" in err
    tb = err.index("[2] Traceback")
    followers = [line for line in err.splitlines() if "failed after it" in line]
    assert all(err.index(line) > tb for line in followers)
    assert all("rank 2" not in line.split("failed after it")[0] for line in followers)
    assert err.count("Traceback") == 1, err  # the followers' tracebacks are not printed
