"""What the launcher and a lone rank say: Ctrl-C prints one line per rank unless --verbose; a
rank started without a launcher says once that it runs as a world of one; more ranks than cores
get a one-line notice. Over real processes."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
WAITER = """
import time, asynccoll
with asynccoll.init() as comm:
    print("ready", comm.rank, flush=True)
    while True:
        time.sleep(0.05)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCCOLL_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                         "SLURM_NTASKS")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _interrupted(tmp_path: pathlib.Path, *flags: str) -> tuple[str, str]:
    script = tmp_path / "wait.py"
    script.write_text(WAITER)
    p = subprocess.Popen([sys.executable, "-m", "asynccoll.cli", "run", "-n", "3", *flags,
                          str(script)], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    ready, out = 0, []
    deadline = time.monotonic() + 90
    while ready < 3 and time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        out.append(line)
        ready += "ready" in line
    assert ready == 3, "".join(out)
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGINT, err
    return "".join(out) + rest, err


@pytest.mark.timeout(150)
def test_ctrl_c_prints_one_line_per_rank(tmp_path: pathlib.Path) -> None:
    _, err = _interrupted(tmp_path)
    lines = [ln for ln in err.splitlines() if "OMP_NUM_THREADS" not in ln and "cores" not in ln]
    assert "Traceback" not in err, err
    assert sum("got SIGINT" in ln for ln in lines) == 1, err
    for r in range(3):
        assert sum(ln.startswith(f"asynccoll run: rank {r} ") for ln in lines) == 1, err
    assert len(lines) == 4, err


@pytest.mark.timeout(150)
def test_ctrl_c_verbose_passes_the_ranks_output_on(tmp_path: pathlib.Path) -> None:
    _, err = _interrupted(tmp_path, "--verbose")
    assert "KeyboardInterrupt" in err, err


@pytest.mark.timeout(60)
def test_a_rank_without_a_launcher_says_once_it_runs_alone(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "alone.py"
    script.write_text("import asynccoll\nfor _ in range(2):\n    with asynccoll.init() as c:\n"
                      "        print(c.rank, c.size)\n")
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0", "1", "0", "1"]
    assert p.stderr.count("world of one") == 1, p.stderr


@pytest.mark.timeout(60)
def test_more_ranks_than_cores_get_one_notice(tmp_path: pathlib.Path) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", str(cores + 1),
                        str(script)], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=50)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count(f"{cores + 1} ranks on {cores} cores") == 1, p.stderr
    p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "1", str(script)],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=50)
    assert "cores" not in p.stderr, p.stderr
