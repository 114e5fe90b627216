"""Liveness: a stopped rank is let go, a busy one is not (DESIGN §10).

A rank that answers no liveness probe for ``ASYNCCOLL_LIVENESS`` seconds is lost for every
member, as if its connection broke; under ``asynccoll run`` the survivors go on
(``--max-failures``) or fail naming it, and the launcher kills the stopped process and names it.
A rank whose main thread computes with the GIL released, or sleeps, is not lost: its progress
thread answers. Real processes under ``asynccoll run`` on loopback tcp.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.alone]

SCRIPT = """
import asyncio, os, signal, sys, time, numpy as np, asynccoll

async def main(mode):
    comm = await asynccoll.connect()
    async with comm:
        await comm.barrier()
        x = np.full(4, 1.0)
        if mode == "stop":
            h = comm.partial_allreduce(asynccoll.Solo(), like=x, accumulate="sum")
            for step in range(12):
                if comm.rank == 1 and step == 3:
                    print("stopping", flush=True)
                    os.kill(os.getpid(), signal.SIGSTOP)
                await asyncio.sleep(0.05)
                await h(x)
            f = await h.flush()
            print("finished, lost", list(f.lost), flush=True)
        elif mode == "sync":
            if comm.rank == 1:
                print("stopping", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            await comm.allreduce(x)
            print("allreduce returned", flush=True)
        else:  # busy: rank 1 computes with the GIL released, rank 2 sleeps, 20 s each
            cpu, t0 = time.process_time(), time.monotonic()
            if comm.rank == 1:
                a = np.random.default_rng(0).random((400, 400))
                while time.monotonic() - t0 < 20:
                    a = np.tanh(a @ a)
            elif comm.rank == 2:
                time.sleep(20)
            s = await comm.allreduce(x)
            took = time.monotonic() - t0
            print(f"sum {s[0]:g} cpu {100 * (time.process_time() - cpu) / took:.2f}% of a "
                  f"core over {took:.1f} s", flush=True)

asyncio.run(main(sys.argv[1]))
"""


def _run(tmp_path: Path, args: list[str], mode: str, timeout: float,
         **env: str) -> tuple[int, str, str, float]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", *args, str(script), mode],
                       capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": ROOT, **env})
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_stopped_rank_is_let_go_under_max_failures(tmp_path: Path) -> None:
    code, out, err, took = _run(tmp_path, ["-n", "4", "--max-failures", "1"], "stop", 80,
                                ASYNCCOLL_LIVENESS="5")
    assert code == 0, out + err
    for r in (0, 2, 3):
        assert f"[{r}] finished, lost [1]" in out, out + err
    assert "[1] finished" not in out
    assert re.search(r"rank 1 answered no liveness probe \(rank \d saw it: .*answered no "
                     r"liveness probe for 5\.\d s", err), err
    assert "rank 1 was killed by SIGKILL; failure 1 of at most 1" in err, err
    print(f"the job took {took:.1f} s with a 5 s liveness")
    assert took < 45, f"{took:.1f} s"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stopped_rank_ends_the_job_under_default_settings(tmp_path: Path) -> None:
    script_env = {k: v for k, v in os.environ.items() if k != "ASYNCCOLL_LIVENESS"}
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    p = subprocess.Popen([sys.executable, "-m", "asynccoll.cli", "run", "-n", "3",
                          str(script), "sync"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**script_env, "PYTHONPATH": ROOT})
    assert p.stdout is not None
    for line in p.stdout:
        if "stopping" in line:
            break
    stopped = time.monotonic()
    out, err = p.communicate(timeout=100)
    took = time.monotonic() - stopped
    assert p.returncode != 0
    assert "allreduce returned" not in out
    assert "rank 1 answered no liveness probe" in err, err
    assert "rank 1 exited with code 137" in err, err
    print(f"the job ended {took:.1f} s after rank 1 stopped (default liveness)")
    assert took < 30 + 10, f"the job ended {took:.1f} s after rank 1 stopped"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_long_compute_or_sleep_is_not_a_loss(tmp_path: Path) -> None:
    code, out, err, _ = _run(tmp_path, ["-n", "4"], "busy", 100, ASYNCCOLL_LIVENESS="5")
    assert code == 0, out + err
    assert "liveness" not in err, err
    assert out.count("sum 4 ") == 4, out + err
    idle = [float(m) for m in re.findall(r"\[[03]\] sum 4 cpu ([\d.]+)%", out)]
    print("idle ranks' CPU while waiting 20 s:", idle)
    assert len(idle) == 2
    assert max(idle) < 1.0, out


def test_the_liveness_setting() -> None:
    from asynccoll import ConfigError
    from asynccoll.launch.connect import DEFAULT_LIVENESS, liveness_from

    assert liveness_from({}) == DEFAULT_LIVENESS == 30.0
    assert liveness_from({"ASYNCCOLL_LIVENESS": "5"}) == 5.0
    assert liveness_from({"ASYNCCOLL_LIVENESS": "none"}) is None
    for bad in ("soon", "0", "-1"):
        with pytest.raises(ConfigError, match="ASYNCCOLL_LIVENESS"):
            liveness_from({"ASYNCCOLL_LIVENESS": bad})
