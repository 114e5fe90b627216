"""Replicas equal to the bit (issue: "the docs say equal, the tests compared float64 to 1e-9"):
every training class and torch wrapper that documents equal replicas, after ``finish()``, in
float32 and float64, at P = 3, 4 and 5, through the network and through shared memory, over real
processes under ``asynccoll run``; the ranks compare raw bytes (tests/train/_replica_rank.py)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
RANK = str(pathlib.Path(__file__).with_name("_replica_rank.py"))


def _run(P: int, shm: bool, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCCOLL_", "MASTER_"))}
    env.update(PYTHONPATH=str(ROOT), ASYNCCOLL_SHM="1" if shm else "0")
    return subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", str(P), RANK,
                           *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)


def _check(p: subprocess.CompletedProcess[str], P: int) -> None:
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    differ = sorted({ln.split("REPLICAS DIFFER ", 1)[1] for ln in p.stdout.splitlines()
                     if "REPLICAS DIFFER" in ln})
    assert not differ, differ
    assert p.stdout.count("REPLICAS OK") == P, p.stdout[-4000:]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("P", [3, 4, 5])
@pytest.mark.parametrize("shm", [False, True], ids=["network", "shm"])
def test_training_classes_end_with_equal_bytes(P: int, shm: bool) -> None:
    _check(_run(P, shm), P)


@pytest.mark.timeout(420)
# not P = 5 (44 s on CI): P = 3 is the uneven case, and the classes' test above runs P = 5
@pytest.mark.parametrize("P", [3, 4])
def test_torch_wrappers_end_with_equal_bytes(P: int) -> None:
    pytest.importorskip("torch")
    _check(_run(P, True, "--torch"), P)
