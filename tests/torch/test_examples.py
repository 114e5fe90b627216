"""The PyTorch examples run end to end (small sizes) under ``asynccoll run`` and torchrun, and
``asynccoll run`` sets ``OMP_NUM_THREADS=1`` when it is unset, saying so once."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from _helpers import free_low_port

pytest.importorskip("torch")
pytest.importorskip("sklearn")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--steps", "6", "--step-ms", "5", "--eval-every", "3"]
TORCHRUN = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent)) \
    or shutil.which("torchrun")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _asynccoll_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "2", *args],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("script", "opts"), [("torch_ddp.py", ["--policy", "majority"]),
                                              ("torch_adam.py", ["--policy", "majority"])])
def test_example_under_asynccoll_run(script: str, opts: list[str]) -> None:
    p = _asynccoll_run(f"examples/{script}", *opts, *SMALL)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "final test accuracy" in p.stdout, p.stdout


@pytest.mark.timeout(120)
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH")
@pytest.mark.parametrize(("script", "opts"), [("torch_ddp.py", ["--policy", "solo"]),
                                              ("torch_adam.py", ["--algorithm", "odsgd"])])
def test_example_under_torchrun(script: str, opts: list[str]) -> None:
    assert TORCHRUN is not None
    # torchrun's own store on a port below the ephemeral range, and asynccoll's on the next
    # one (MASTER_PORT + 1): left to torchrun, both fell in the ephemeral range, where an
    # outgoing connection of another process took the second once (a CI failure)
    port = free_low_port(span=2)
    p = subprocess.run([TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                        "--master_port", str(port), f"examples/{script}", *opts, *SMALL],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "final test accuracy" in p.stdout, p.stdout


@pytest.mark.timeout(60)
def test_asynccoll_run_sets_omp_num_threads_once(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "omp.py"
    script.write_text("import os\nprint('OMP', os.environ.get('OMP_NUM_THREADS'))\n")
    p = _asynccoll_run(str(script))
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("OMP 1") == 2, p.stdout
    assert p.stderr.count("OMP_NUM_THREADS is unset") == 1, p.stderr
    env = {**_env(), "OMP_NUM_THREADS": "3"}
    p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "2", str(script)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=50)
    assert p.stdout.count("OMP 3") == 2, p.stdout
    assert "OMP_NUM_THREADS" not in p.stderr
