"""Two hosts stood in for by two network namespaces joined by a veth pair.

Node 0 (namespace A, 10.231.0.1) hosts the store; node 1 (namespace B, 10.231.0.2) joins it;
2 ranks on each run the exchange of ``_exchange.py`` through ``asynccoll run --nnodes 2``, so
every transport address crosses the veth link. The addresses exist only inside the namespaces
this test creates; it removes them (and whatever runs in them) whatever happens. Needs root and
``ip netns``; skips with the reason otherwise (the fixture ``namespaces``, ``conftest.py``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ._netns import ADDR, kill_all_in

HERE = Path(__file__).parent
ROOT = str(HERE.parents[1])
PORT = 29431

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _launch(ns: str, node: int, transport: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_SECRET": "multi-host-test-secret-42"}
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "asynccoll.cli", "run", "-n", "2",
         "--nnodes", "2", "--node-rank", str(node), "--rdzv", f"{ADDR[0]}:{PORT}",
         "--transport", transport, "--grace", "1", str(HERE / "_exchange.py"), "200000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", [
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                                                 reason="ucxx is not installed")),
])
def test_four_ranks_on_two_namespaces(namespaces: tuple[str, str], transport: str) -> None:
    procs = []
    try:
        procs.append(_launch(namespaces[1], 1, transport))  # the joiner may start first
        time.sleep(0.2)
        procs.append(_launch(namespaces[0], 0, transport))
        results = [p.communicate(timeout=90) for p in procs]
        codes = [p.returncode for p in procs]
        everything = "\n".join(o + e for o, e in results)
        assert codes == [0, 0], everything
        out_b, out_a = results[0][0], results[1][0]
        for r, out, addr in ((0, out_a, ADDR[0]), (1, out_a, ADDR[0]), (2, out_b, ADDR[1]),
                             (3, out_b, ADDR[1])):
            # each rank listened on its own host's address, not on loopback
            assert f"[{r}] rank {r} of 4 ok over {transport} at {transport}://{addr}:" \
                in out, everything
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        for n in namespaces:
            kill_all_in(n)
