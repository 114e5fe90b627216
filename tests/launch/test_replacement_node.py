"""A replacement node across two hosts: a node's launcher and ranks die, a new launcher started
on its host with the job's rendezvous and secret takes its ranks back, and they rejoin training.

Two network namespaces stand in for two hosts (``_netns.py``; each also has its own
``ASYNCCOLL_HOST_ID``, so that no shared-memory path crosses them: the state reaches the
joiners over the veth link). Node 0 (namespace A: the store, ranks 0-1) and node 1 (namespace
B: ranks 2-3) run the eager-SGD job of ``tests/adversarial/_rejoin_job.py`` under ``asynccoll
run --max-failures 1 --max-restarts 1`` (``--max-failures`` counts a node's own ranks and must
be below its 2; the ranks survive any loss once it is 1, and a whole node lost is node 0's
launcher's to wait for, under ``--max-restarts``). When ranks 2 and 3 reach step ``KILL_AT``
they wait there, and the test SIGKILLs every process of namespace B (the launcher and both
ranks: a host going away). Ranks 0-1 train on; a replacement launcher started in namespace B
with node rank 1, the same ``--rdzv`` and secret, starts ranks 2-3 with ``ASYNCCOLL_RESTART=1``,
whose ``connect()`` dials the members across the link and joins. Asserted: every rank reaches
the last step, every rank's final parameters hash the same (bytes, not a tolerance), both
surviving launchers exit 0 and say what happened, and the job's private segment directory is
empty. About 30-40 s on two loaded cores.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ._netns import ADDR, kill_all_in, pids_in

HERE = Path(__file__).parent
ROOT = str(HERE.parents[1])
JOB = str(HERE.parent / "adversarial" / "_rejoin_job.py")
PORT = 29433
N = 200  # steps: room for the replacement's start and join (8-10 s on 2 loaded cores)
SECRET = "replacement-node-test-secret-0123456789"

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture
def segments() -> Iterator[Path]:
    """The job's private segment directory, on the same tmpfs as ``/dev/shm``."""
    d = Path(tempfile.mkdtemp(prefix="asynccoll-replace-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _launch(ns: str, node: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Node ``node``'s launcher in namespace ``ns``; its output (the ranks' too) in ``log``."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "asynccoll.cli", "run", "-n",
             "2", "--nnodes", "2", "--node-rank", str(node), "--rdzv", f"{ADDR[0]}:{PORT}",
             "--max-failures", "1", "--max-restarts", "1", "--rdzv-timeout", "30",
             "--grace", "1", JOB],
            stdout=f, stderr=subprocess.STDOUT, env={**env, "ASYNCCOLL_HOST_ID": f"host-{ns}"},
            cwd=ROOT)


def _wait(what: str, done: Callable[[], bool], timeout: float,
          alive: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        dead = [p.args for p in alive if p.poll() is not None]
        assert not dead, f"{what}: exited first: {dead}\n" + _tails(logs)
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s\n" + _tails(logs)
        time.sleep(0.05)


def _code(p: subprocess.Popen[bytes], timeout: float, logs: list[Path]) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{p.args[4:]} did not exit within {timeout} s\n" + _tails(logs))


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
                     for log in logs if log.exists())


def _finals(out: str) -> dict[int, tuple[int, str, int]]:
    got = re.findall(r"FINAL rank=(\d) steps=(\d+) digest=(\w+) restarted=(\d)", out)
    return {int(r): (int(s), d, int(k)) for r, s, d, k in got}


@pytest.mark.timeout(90)  # (each wait below shorter: 25 + 5 + 5 + 40 + 10 s at most)
def test_a_replacement_node_takes_its_ranks_back_and_they_rejoin_training(
        namespaces: tuple[str, str], segments: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ASYNCCOLL_JOB_TAG"}
    env.update(PYTHONPATH=ROOT, ASYNCCOLL_SECRET=SECRET, ASYNCCOLL_SHM_DIR=str(segments),
               POLICY="solo", VICTIMS="2,3", N=str(N), KILL_AT="10", STEP_S="0.06",
               MARK_DIR=str(tmp_path))
    logs = [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "replacement.log"]
    a, b = namespaces
    try:
        node1 = _launch(b, 1, env, logs[1])
        node0 = _launch(a, 0, env, logs[0])
        _wait("ranks 2 and 3 at step 10",
              lambda: all((tmp_path / f"at-{r}").exists() for r in (2, 3)), 25,
              [node0, node1], logs)
        # host B goes away: its launcher and both its ranks, at once
        assert node1.pid in kill_all_in(b)
        assert node1.wait(timeout=5) == -9
        _wait("node 1's processes gone", lambda: not pids_in(b), 5, [node0], logs)
        again = _launch(b, 1, env, logs[2])
        codes = (_code(node0, 40, logs), _code(again, 10, logs))
        out0, out1 = logs[0].read_text(), logs[2].read_text()
        assert codes == (0, 0), _tails(logs)
    finally:
        for ns in namespaces:
            kill_all_in(ns)
    finals = {**_finals(out0), **_finals(out1)}
    assert sorted(finals) == [0, 1, 2, 3], _tails(logs)
    assert {r: s for r, (s, _, _) in finals.items()} == dict.fromkeys(range(4), N), finals
    assert len({d for _, d, _ in finals.values()}) == 1, finals  # equal to the bit
    assert [r for r, (_, _, k) in sorted(finals.items()) if k] == [2, 3], finals
    for r in (2, 3):
        assert f"rank {r} joined at step" in out1, _tails(logs)
        assert f"rank {r} restarted as pid" in out1, _tails(logs)
        # ranks 0-1 streamed their stripes across the link (the other joiner, when admitted
        # first, hands its stripe over on host B: through shared memory, or the network)
        got = re.search(rf"rank {r}: joined partial allreduce 'eager-sgd': .*from ranks "
                        r"\[([\d, ]*)\] through shared memory, from \[([\d, ]*)\] over the "
                        r"network;", out1)
        assert got is not None, _tails(logs)
        assert {0, 1} <= {int(x) for x in got[2].split(",") if x.strip()}, got[0]
        assert not {0, 1} & {int(x) for x in got[1].split(",") if x.strip()}, got[0]
    assert "node 1's launcher is gone: this one replaces it and restarts ranks 2-3 " \
           "(restart 1 of at most 1, --max-restarts)" in out1, _tails(logs)
    assert "node 1's launcher is gone, and ranks 2-3 with it; waiting up to 30.0 s for a " \
           "launcher to replace it (--max-restarts)" in out0, _tails(logs)
    assert "node 1 has a new launcher: it restarts ranks 2-3" in out0, _tails(logs)
    assert sorted(os.listdir(segments)) == [], _tails(logs)  # no segment left behind
