"""The single-copy allreduce (asynccoll.comm.cma) under loss and lies: a rank SIGKILLed while
its peers read its memory, and a rank that sends a bad address.

Four real processes over tcp, 16 MiB allreduces (two-shot by size, so single-copy where the
ranks may read each other's memory; the test skips where they may not).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import SECRET, free_port, needs_cma

ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess]

RANK = """
import asyncio, json, os, signal, sys, time, numpy as np, asynccoll
from asynccoll.comm import cma

out, how = sys.argv[1], sys.argv[2]
if os.environ["ASYNCCOLL_RANK"] == "2":
    calls = []
    if how == "kill":  # die inside the third call's reduce, after reading one peer's piece
        reduce, real = cma.CMA_OWN_KERNELS["cma_reduce"], cma._peer

        def counting(o, ins, params, msgs):
            calls.append(1)
            return reduce(o, ins, params, msgs)

        def read_then_die(*args):
            real(*args)
            if len(calls) >= 3:
                with open(out + "/killed", "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        cma._peer = read_then_die
        cma.CMA_OWN_KERNELS["cma_reduce"] = counting
    else:  # "lie": from the third call on, tell the peers an address nobody has mapped
        address = cma.CMA_OWN_KERNELS["cma_address"]

        def lying(o, ins, params, msgs):
            address(o, ins, params, msgs)
            calls.append(1)
            if len(calls) >= 3:
                o[0] = 4096
        cma.CMA_OWN_KERNELS["cma_address"] = lying


async def main():
    comm = await asynccoll.connect(timeout=60, collective_timeout=8)
    async with comm:
        x = np.ones(4 << 20, np.float32)
        got = {"calls": 0}
        try:
            for _ in range(5):
                await comm.allreduce(x, out=x)
                got["calls"] += 1
                got["cma"] = len(comm._dense._cma)
            got.update(t=time.time(), rank=None, kind=None, msg="completed")
        except Exception as exc:
            got.update(t=time.time(), rank=getattr(exc, "rank", None),
                       kind=type(exc).__name__, msg=str(exc))
        with open(f"{out}/rank-{comm.rank}.json", "w") as f:
            json.dump(got, f)

asyncio.run(main())
"""


def _launch(tmp_path: Path, how: str) -> list[subprocess.Popen[str]]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = free_port()
    procs = []
    for r in range(4):
        env = {**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_RANK": str(r),
               "ASYNCCOLL_WORLD_SIZE": "4", "ASYNCCOLL_STORE": f"127.0.0.1:{port}",
               "ASYNCCOLL_TRANSPORT": "tcp", "ASYNCCOLL_SECRET": SECRET}
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path), how],
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=60)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@needs_cma
@pytest.mark.timeout(120)
def test_sigkill_while_peers_read_its_memory_is_reported_within_2_s(tmp_path: Path) -> None:
    procs = _launch(tmp_path, "kill")
    outs = _finish(procs)
    assert procs[2].returncode == -signal.SIGKILL, outs[2]
    killed = float((tmp_path / "killed").read_text())
    for r in (0, 1, 3):
        assert procs[r].returncode == 0, outs[r]
        got = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert got["cma"] == 1, got  # the single-copy path was the one in use
        assert got["calls"] == 2, got  # the first two completed, the third failed
        assert (got["kind"], got["rank"]) == ("PeerLostError", 2), got
        assert got["t"] - killed < 2.0, (r, got["t"] - killed)


@needs_cma
@pytest.mark.timeout(120)
def test_a_bad_address_fails_the_call_clearly_and_nothing_crashes(tmp_path: Path) -> None:
    procs = _launch(tmp_path, "lie")
    outs = _finish(procs)
    for r in range(4):
        assert procs[r].returncode == 0, outs[r]  # every process ends normally
    for r in (0, 1, 3):
        got = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert got["calls"] == 2, got
        assert got["kind"] == "ExecutionError", got
        assert "Bad address" in got["msg"], got
        assert "process" in got["msg"], got
    liar = json.loads((tmp_path / "rank-2.json").read_text())
    assert liar["calls"] == 2, liar
    assert liar["kind"] is not None, liar  # its peers never answered
