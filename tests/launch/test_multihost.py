"""Two hosts stood in for by two network namespaces joined by a veth pair.

Node 0 (namespace A, 10.231.0.1) hosts the store; node 1 (namespace B, 10.231.0.2) joins it;
2 ranks on each run the exchange of ``_exchange.py`` through ``asynccoll run --nnodes 2``, so
every transport address crosses the veth link. The addresses exist only inside the namespaces
this test creates; it removes them (and whatever runs in them) whatever happens. Needs root and
``ip netns``; skips with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = str(HERE.parents[1])
ADDR = ("10.231.0.1", "10.231.0.2")
PORT = 29431

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20,
                          check=check)


def _why_not() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"acp{os.getpid() % 100000}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@pytest.fixture(scope="module")
def namespaces() -> Iterator[tuple[str, str]]:
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    ns = (f"acolA{tag}", f"acolB{tag}")
    veth = (f"acva{tag}", f"acvb{tag}")
    try:
        for n in ns:
            _ip("netns", "add", n)
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for n, v, a in zip(ns, veth, ADDR, strict=True):
            _ip("link", "set", v, "netns", n)
            _ip("-n", n, "addr", "add", f"{a}/24", "dev", v)
            _ip("-n", n, "link", "set", v, "up")
            _ip("-n", n, "link", "set", "lo", "up")
        yield ns
    finally:
        for n in ns:
            _kill_all_in(n)
            _ip("netns", "del", n, check=False)
        _ip("link", "del", veth[0], check=False)  # gone with its namespace unless moved yet


def _kill_all_in(ns: str) -> None:
    """SIGKILL what still runs in ``ns``: only this test starts processes there."""
    r = _ip("netns", "pids", ns, check=False)
    for pid in r.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


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
            _kill_all_in(n)
