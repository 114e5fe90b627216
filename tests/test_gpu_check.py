"""``make gpu-check`` (bench/gpu_check.sh): valid shell, selects every CUDA / CuPy test and the
CUDA-tensor DDP-hook run, and on a machine without a GPU installs nothing and says so."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


@pytest.mark.timeout(120)
def test_it_selects_every_cuda_and_cupy_test() -> None:
    pytest.importorskip("torch")
    r = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True,
                       timeout=110, env={**os.environ, "PYTHON": sys.executable}, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    for test in ("test_cuda_hook.py::test_partial_hook_on_cuda_tensors",
                 "test_tensors.py::test_cuda_tensors_go_through_dlpack",
                 "test_dense_build.py::test_cupy_buffers_if_installed",
                 "test_sparse_sched.py::test_cupy_input_gives_cupy_result",
                 "test_ucx.py::test_cupy_arrays_travel_as_device_memory"):
        assert test in r.stdout, r.stdout


@pytest.mark.timeout(60)
def test_without_a_gpu_it_installs_nothing(tmp_path: Path) -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi: the check would run for real")
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=50,
                       env={**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)},
                       check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no NVIDIA GPU here" in r.stdout
    assert "installing" not in r.stdout
    assert (tmp_path / "gpu-check.log").exists()
