"""Two hosts stood in for by two network namespaces joined by a veth pair (``ip netns``).

Host A is ``10.231.0.1``, host B ``10.231.0.2``: the addresses exist only inside the namespaces
that :func:`two_hosts` creates, and it removes them, and SIGKILLs whatever still runs in them,
whatever happens. Needs root and ``ip netns`` (:func:`why_not` says what is missing). The
namespaces share the machine's file systems (``/dev/shm`` included) and its host name: a test
that wants them to be two hosts for shared memory too gives each its own ``ASYNCCOLL_HOST_ID``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator

ADDR = ("10.231.0.1", "10.231.0.2")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20,
                          check=check)


def why_not() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"acp{os.getpid() % 100000}"
    r = ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[str, str]]:
    """The names of namespaces A and B, linked, for as long as the block runs."""
    tag = f"{os.getpid() % 100000}"
    ns = (f"acolA{tag}", f"acolB{tag}")
    veth = (f"acva{tag}", f"acvb{tag}")
    try:
        for n in ns:
            ip("netns", "add", n)
        ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for n, v, a in zip(ns, veth, ADDR, strict=True):
            ip("link", "set", v, "netns", n)
            ip("-n", n, "addr", "add", f"{a}/24", "dev", v)
            ip("-n", n, "link", "set", v, "up")
            ip("-n", n, "link", "set", "lo", "up")
        yield ns
    finally:
        for n in ns:
            kill_all_in(n)
            ip("netns", "del", n, check=False)
        ip("link", "del", veth[0], check=False)  # gone with its namespace unless moved yet


def pids_in(ns: str) -> list[int]:
    """The processes that run in namespace ``ns``."""
    return [int(p) for p in ip("netns", "pids", ns, check=False).stdout.split()]


def kill_all_in(ns: str) -> list[int]:
    """SIGKILL what still runs in ``ns`` (only the tests start processes there); returns the
    pids signalled."""
    pids = pids_in(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
