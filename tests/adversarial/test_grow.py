"""Growing beyond the first world size (``asynccoll run --nnodes 1:2``): a second node's launcher
started while the first node's ranks train adds its ranks to the running job.

Node 0 (ranks 0-1) runs the eager-SGD job of ``_grow_job.py`` alone; node 1's launcher is
started a moment later with the same ``--rdzv`` and secret. Its ranks 2-3 were vacant: they
connect as restarted ranks do, and the members take them in at their next sync events
(``HOLD=4``: every rank trains on until its world has 4 ranks). Asserted: both launchers exit
0 and say what happened, the members' world grows from 2 to 4 (their ``world_size``, which
their partial results give), every rank ends at the same global step with parameters that
hash the same (bytes), and the new ranks' launcher says each joined as a new rank."""

from __future__ import annotations

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

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _launch(node: int, port: int, env: dict[str, str], log: Path,
            job: str = JOB) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "asynccoll.cli", "run", "-n", "2", "--nnodes", "1:2",
             "--node-rank", str(node), "--rdzv", f"127.0.0.1:{port}", "--rdzv-timeout", "30",
             "--grace", "1", job],
            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _finals(out: str) -> dict[int, tuple[int, int, str]]:
    return {int(r): (int(s), int(w), d) for r, s, w, d in
            re.findall(r"FINAL rank=(\d+) step=(\d+) world=(\d+) digest=(\w+)", out)}


def _grow(tmp_path: Path, job: str, **env: str) -> tuple[str, str]:
    """Node 0 alone, then node 1 two seconds later; both launchers' output."""
    port = free_port()
    env = {**os.environ, "ASYNCCOLL_SECRET": "grow-test-secret-0123456789abcdef",
           "HOLD": "4", "ASYNCCOLL_LIVENESS": "10", **env}
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    first = _launch(0, port, env, logs[0], job)
    try:
        time.sleep(2.0)  # node 0's ranks train meanwhile (they hold until the world has 4)
        second = _launch(1, port, env, logs[1], job)
        try:
            codes = [first.wait(timeout=120), second.wait(timeout=90)]
        finally:
            second.kill()
    finally:
        first.kill()
    out0, out1 = (p.read_text(errors="replace") for p in logs)
    assert codes == [0, 0], (out0 + out1)[-4000:]
    return out0, out1


def test_a_second_node_grows_a_running_job(tmp_path: Path) -> None:
    out0, out1 = _grow(tmp_path, JOB, N="60", SYNC_EVERY="5")
    both = out0 + out1
    finals = _finals(both)
    assert sorted(finals) == [0, 1, 2, 3], both[-4000:]
    assert len({d for _, _, d in finals.values()}) == 1, finals  # equal to the bit
    assert len({s for s, _, _ in finals.values()}) == 1, finals  # one global step
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
