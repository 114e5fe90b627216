"""Helpers shared by the multi-process tests: free ports and worlds of spawned ranks.

Importable as ``_helpers`` from every test module: ``tests/`` is on ``sys.path`` (its conftest),
and spawned children inherit the parent's ``sys.path``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import multiprocessing as mp
import os
import queue
import random
import socket
import subprocess
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

#: the job secret the spawned ranks of :func:`async_child` share
SECRET = "multiprocess-test-secret-0123456789"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (from the ephemeral range)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_low_port(span: int = 1) -> int:
    """A port free now, below the ephemeral range, so that no outgoing connection of another
    process takes it before the process under test binds it; with ``span``, the ``span - 1``
    ports after it are free too."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000 - span)
        with contextlib.ExitStack() as stack:
            try:
                for p in range(port, port + span):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", p))
            except OSError:
                continue
            return port


def async_child(rank: int, P: int, main: Callable[..., Awaitable[Any]], *rest: Any) -> None:
    """Spawned-process entry: ``asyncio.run(main(rank, P, *args))`` with :data:`SECRET` set.

    ``rest`` is ``(*args, q)``; the child puts ``(rank, "ok", result)`` or
    ``(rank, "error", traceback)`` on ``q`` (``main`` must be a module-level function).
    """
    *args, q = rest
    try:
        os.environ["ASYNCCOLL_SECRET"] = SECRET
        q.put((rank, "ok", asyncio.run(main(rank, P, *args))))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def spawn_world(target: Callable[..., None], P: int, args: tuple[Any, ...],
                timeout: float = 90.0) -> list[Any]:
    """Run ``target(rank, P, *args, q)`` in P processes of the "spawn" context.

    Returns what each rank reported, by rank; fails the test with the child's traceback, or
    naming the ranks that did not report within ``timeout`` seconds of the last report. The
    children are killed whatever happens.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, P, *args, q), daemon=True) for r in range(P)]
    try:
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        while len(results) < P:
            try:
                rank, status, payload = q.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"ranks {sorted(set(range(P)) - set(results))} did not report "
                            f"within {timeout} s")
            if status != "ok":
                pytest.fail(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
        for p in procs:
            p.join(10)
        return [results[r] for r in range(P)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


async def kill_and_check_pending_fail(t: Any, proc: Any, recvs: list[asyncio.Future[Any]], *,
                                      peer: int, slack: int) -> list[BaseException]:
    """SIGKILL ``proc`` (rank ``peer``) while ``recvs`` stream in; check they settle promptly.

    Every receive still pending must settle within 2 s of the kill, all but ``slack`` of them
    (what the kernel had already buffered may still arrive) with ``PeerLostError`` naming
    ``peer``, and a receive posted afterwards must fail the same way. Returns the errors.
    """
    import signal
    import time

    from asynccoll.errors import PeerLostError

    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    pending = [r for r in recvs if not r.done()]
    _, still = await asyncio.wait(pending, timeout=2.0)
    assert not still, f"{len(still)} receives still pending 2 s after the SIGKILL"
    assert time.monotonic() - killed < 2.0
    failed = [e for r in pending if (e := r.exception()) is not None]
    assert len(failed) > len(pending) - slack
    assert all(isinstance(e, PeerLostError) and e.rank == peer for e in failed), failed[:3]
    with pytest.raises(PeerLostError):
        await t.post_recv(peer, 1 << 20, 0, 10_001, None)
    return failed


def run_exchanging_ranks(target: Callable[..., None], world_size: int,
                         extra: Callable[[int], tuple[Any, ...]], *, timeout: float = 60.0,
                         exit_timeout: float | None = None) -> dict[int, str | None]:
    """Spawn ranks ``target(rank, world_size, addr_q, peer_q, result_q, *extra(rank))``.

    Each rank puts ``(rank, address)`` on ``addr_q``, reads every address from ``peer_q`` and
    puts ``(rank, traceback or None)`` on ``result_q``. Returns rank -> traceback. With
    ``exit_timeout`` the ranks must also exit by themselves, with code 0, within it. The
    children are killed whatever happens.
    """
    import time

    ctx = mp.get_context("spawn")
    addr_q, result_q = ctx.Queue(), ctx.Queue()
    peer_qs = [ctx.Queue() for _ in range(world_size)]
    procs = [ctx.Process(target=target, args=(r, world_size, addr_q, peer_qs[r], result_q,
                                              *extra(r)), daemon=True)
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        addrs = dict(addr_q.get(timeout=timeout) for _ in procs)
        for q in peer_qs:
            q.put(addrs)
        results: dict[int, str | None] = {}
        end = time.monotonic() + timeout
        while len(results) < world_size:
            try:
                rank, tb = result_q.get(timeout=max(end - time.monotonic(), 0.1))
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(results))} "
                                     f"did not report within {timeout} s") from None
            results[rank] = tb
        if exit_timeout is not None:
            for p in procs:
                p.join(exit_timeout)
                assert p.exitcode == 0, f"rank exited with {p.exitcode}"
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def run_killed_job(tmp_path: Path, script: str, P: int, args: list[str], kill: str,
                   timeout: float = 90.0) -> dict[int, Any]:
    """Run ``script`` (source text) as P rank processes over loopback tcp, started without the
    launcher (which would stop the job at the first loss), with ``args`` after the script;
    ``kill`` names the ranks (comma-separated) the script kills itself. Each survivor must exit
    0 and write ``rank-R.json`` into ``tmp_path``; returns those reports by rank."""
    path = tmp_path / "rank.py"
    path.write_text(script)
    root = str(Path(__file__).parents[1])
    port = free_port()
    procs = []
    try:
        for r in range(P):
            env = {**os.environ, "PYTHONPATH": root, "ASYNCCOLL_RANK": str(r),
                   "ASYNCCOLL_WORLD_SIZE": str(P), "ASYNCCOLL_STORE": f"127.0.0.1:{port}",
                   "ASYNCCOLL_TRANSPORT": "tcp", "ASYNCCOLL_SECRET": SECRET}
            procs.append(subprocess.Popen([sys.executable, str(path), *args], env=env,
                                          stderr=subprocess.PIPE))
        errs = [p.communicate(timeout=timeout)[1].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    killed = {int(k) for k in kill.split(",")}
    survivors = [r for r in range(P) if r not in killed]
    for r in survivors:
        assert procs[r].returncode == 0, f"rank {r}:\n{errs[r][-4000:]}"
    return {r: json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in survivors}


@functools.cache
def cma_allowed() -> bool:
    """Whether a process may read and write another one's memory here as the ranks of a job
    do (``process_vm_readv``/``writev`` between processes neither of which descends from the
    other: a child reads and writes its parent, which Yama's ``ptrace_scope`` 1 refuses as
    it refuses siblings). The single-copy allreduce's tests that need it skip where the kernel
    or the container refuses it (the runtime then takes the segments)."""
    import ctypes

    cell = ctypes.c_int64(0x5A5A5A5A)
    code = (
        "import ctypes, os, sys\n"
        "from asynccoll.comm.cma import read_remote, write_remote\n"
        "v = ctypes.c_int64(0)\n"
        "pid, at = int(sys.argv[1]), int(sys.argv[2])\n"
        "read_remote(pid, at, ctypes.addressof(v), 8)\n"
        "v.value += 1\n"
        "write_remote(pid, at, ctypes.addressof(v), 8)\n")
    try:
        subprocess.run([sys.executable, "-c", code, str(os.getpid()), str(ctypes.addressof(cell))],
                       check=True, capture_output=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    except (subprocess.SubprocessError, OSError):
        return False
    return cell.value == 0x5A5A5A5B


#: mark for tests of the single-copy allreduce: ``tests/conftest.py`` skips them where
#: :func:`cma_allowed` says no (asked once, at the first such test: not at import, which every
#: spawned rank of every test does)
needs_cma = pytest.mark.cma


#: the start of a rank script for :func:`run_killed_job` whose rank 2 dies in a shared-memory
#: collective: argv ``token out when``, the job's segment token fixed (so that
#: :func:`shm_left` sees this job's segments only), ``VICTIM`` and ``die()`` (writes the time
#: into ``out/killed``, then SIGKILLs itself)
SHM_VICTIM_PREAMBLE = """
import asyncio, json, os, signal, sys, time, numpy as np, asynccoll
from asynccoll.comm import dense, shm

token, out, when = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dense.new_token = lambda: token
VICTIM = os.environ["ASYNCCOLL_RANK"] == "2"


def die():
    with open(out + "/killed", "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def shm_left(token: int) -> list[str]:
    """This user's segments of the job with segment ``token`` left in the segment directory."""
    from asynccoll.comm.shm import SHM_DIR, job_prefix, job_tag

    prefix = job_prefix(job_tag(token))
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(prefix))
