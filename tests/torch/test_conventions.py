"""torch's conventions over real processes: ``asynccoll run`` exports torch's variables, so an
unchanged ``init_process_group("gloo")`` script runs under it; under torchrun asynccoll's store
takes no port of its own guessing (``MASTER_PORT + 1`` busy does not matter); two DDP hooks on one
communicator get distinct names; ``finish()`` refuses without the optimizer and leaves replicas
equal to the bit with it; DistributedOptimizer refuses a DDP model's parameters, and with
``Quorum(P)`` leaves the replicas equal to the bit."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest
from _helpers import free_low_port

pytest.importorskip("torch")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
RANK = str(pathlib.Path(__file__).with_name("_conventions_rank.py"))
TORCHRUN = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent)) \
    or shutil.which("torchrun")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ASYNCCOLL_", "MASTER_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.timeout(150)
def test_unchanged_init_process_group_script_under_asynccoll_run() -> None:
    p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "3", RANK],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(line.split()[-1] for line in p.stdout.splitlines()
                  if "CONVENTIONS OK" in line) == ["0", "1", "2"], p.stdout + p.stderr


@pytest.mark.timeout(150)
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH")
def test_torchrun_with_master_port_plus_one_busy() -> None:
    """The old store bound MASTER_PORT + 1; here something else holds it, and the job runs."""
    assert TORCHRUN is not None
    port = free_low_port(span=2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 1))
        busy.listen()
        p = subprocess.run([TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                            "--master_port", str(port), RANK],
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("CONVENTIONS OK") == 2, p.stdout + p.stderr
