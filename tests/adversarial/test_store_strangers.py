"""Strangers at the store's port decide nothing: a bad handshake frame closes that connection
only, floods cost bounded log lines and never make ``accept`` fail, and genuine clients are
served meanwhile (DESIGN §11). Over real processes on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import secrets
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from _helpers import free_low_port

from asynccoll.launch.nodes import ORPHAN_KEY, tell_new_store
from asynccoll.launch.store import StoreClient, StoreServer

ROOT = str(Path(__file__).parents[2])
WORKER = str(Path(__file__).parents[1] / "launch" / "_worker.py")
SECRET = b"the-store-flood-test-secret-0123"

pytestmark = [pytest.mark.multiprocess]

STORE = """
import asyncio, logging, sys
from asynccoll.launch.store import StoreServer

async def main():
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    async with StoreServer("127.0.0.1", 0, sys.argv[1].encode()) as server:
        print(server.port, server.client_limit, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        print("refused", sum(server.refusals.values()), flush=True)

asyncio.run(main())
"""


def _frame(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


async def _stranger(port: int, how: str) -> asyncio.StreamWriter | None:
    """One stranger's connection: ``silent`` holds it open, ``auth`` sends a handshake with a
    random MAC, ``junk`` sends bytes that are no frame."""
    try:
        _r, w = await asyncio.open_connection("127.0.0.1", port)
        if how == "auth":
            w.write(_frame(["auth", secrets.token_bytes(32), secrets.token_bytes(32)]))
        elif how == "junk":
            w.write(b"\xff" * 64)
        return w
    except OSError:
        return None


def _wait_listening(port: int, proc: subprocess.Popen[str], seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the store did not listen"
        time.sleep(0.05)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    ps: list[subprocess.Popen[str]] = []
    yield ps
    for p in ps:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


def _launcher(node: int, port: int, piddir: Path) -> subprocess.Popen[str]:
    piddir.mkdir()
    return subprocess.Popen(
        [sys.executable, "-m", "asynccoll.cli", "run", "-n", "1", "--nnodes", "2",
         "--node-rank", str(node), "--rdzv", f"127.0.0.1:{port}", "--rdzv-timeout", "30",
         WORKER, "hello"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": ROOT, "TEST_PIDDIR": str(piddir),
             "ASYNCCOLL_SECRET": SECRET.decode()})


@pytest.mark.timeout(60)
def test_a_strangers_bad_frame_during_a_two_node_join(
        procs: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    port = free_low_port()
    a = _launcher(0, port, tmp_path / "a")
    procs.append(a)
    _wait_listening(port, a)

    async def stranger() -> list[object]:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        (n,) = struct.unpack(">I", await r.readexactly(4))
        hello = msgpack.unpackb(await r.readexactly(n))
        w.write(_frame(["auth", secrets.token_bytes(32), secrets.token_bytes(32)]))
        (n,) = struct.unpack(">I", await r.readexactly(4))
        reply = msgpack.unpackb(await r.readexactly(n))
        w.close()
        return [hello[0], reply[0]]

    assert asyncio.run(asyncio.wait_for(stranger(), 10)) == ["hello", "denied"]
    time.sleep(0.5)  # the old store would have told node 0 by now that a node is refused
    b = _launcher(1, port, tmp_path / "b")
    procs.append(b)
    out_b, err_b = b.communicate(timeout=40)
    out_a, err_a = a.communicate(timeout=40)
    assert (a.returncode, b.returncode) == (0, 0), err_a + err_b
    assert "[0] env ASYNCCOLL_RANK=0" in out_a
    assert "[1] env ASYNCCOLL_RANK=1" in out_b


@pytest.mark.timeout(90)
def test_floods_at_nofile_1024_are_refused_quietly_and_genuine_clients_served(
        procs: list[subprocess.Popen[str]]) -> None:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    store = subprocess.Popen([sys.executable, "-c", STORE, SECRET.decode()], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, preexec_fn=limit, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": ROOT})
    procs.append(store)
    assert store.stdout is not None
    assert store.stdin is not None
    port, cap = (int(x) for x in store.stdout.readline().split())
    assert 16 <= cap < 1024 - 100, cap

    async def genuine() -> float:
        t0 = time.perf_counter()
        c = await StoreClient.connect("127.0.0.1", port, SECRET, timeout=10)
        await c.set("k", b"v")
        assert await c.get("k") == b"v"
        took = time.perf_counter() - t0
        await c.close()
        return took

    async def flood() -> list[float]:
        held: list[asyncio.StreamWriter] = []
        times = []
        try:
            for how in ("silent", "auth", "junk"):
                for _ in range(4):  # 2,000 connections in bursts of 500, each burst held
                    ws = await asyncio.gather(*(_stranger(port, how) for _ in range(500)))
                    held += [w for w in ws if w is not None]
                await asyncio.sleep(0.3)  # the backlog drained; strangers still hold sockets
                times += [await genuine() for _ in range(5)]
        finally:
            for w in held:
                w.close()
        return times

    t0 = time.monotonic()
    times = asyncio.run(asyncio.wait_for(flood(), 60))
    took = time.monotonic() - t0
    out, err = store.communicate(input="", timeout=20)
    refused = int(out.split()[-1])
    lines = [ln for ln in err.splitlines() if ln.startswith("asynccoll.launch.store")]
    print(f"genuine client: median {statistics.median(times) * 1e3:.1f} ms, max "
          f"{max(times) * 1e3:.1f} ms; {refused} refused, {len(lines)} log lines in {took:.1f} s")
    assert store.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "Too many open files" not in err, err[-3000:]
    assert refused >= 3000
    windows = int(took // 10) + 2
    assert len(lines) <= 10 * windows, f"{len(lines)} log lines in {took:.1f} s"
    assert max(times) < 0.1, [f"{t * 1e3:.1f} ms" for t in times]


def _orphan(port: int, secret: bytes = SECRET) -> Any:
    """What :func:`tell_new_store` reads of node 1's launcher configuration."""
    return types.SimpleNamespace(rdzv=("127.0.0.1", port), secret=secret, nnodes=2,
                                 node_rank=1, nproc=1)


@pytest.mark.timeout(30)
async def test_an_orphaned_node_tells_the_new_store_after_a_reset_dial() -> None:
    """Node 0's launcher died; its address first resets connections (a dying listener), then a
    new node 0's store comes up there. The orphaned launcher keeps dialling and tells it, where
    it used to give up at the first reset and leave the new node 0 to its join timeout."""
    resets = 0
    twice = asyncio.Event()

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal resets
        resets += 1
        if resets == 2:
            twice.set()
        writer.transport.abort()

    dying = await asyncio.start_server(reset, "127.0.0.1", 0)
    port = dying.sockets[0].getsockname()[1]
    telling = asyncio.create_task(tell_new_store(_orphan(port)))
    await asyncio.wait_for(twice.wait(), 10.0)
    assert not telling.done(), "gave up at a reset connection"
    dying.close()
    await dying.wait_closed()
    server = await StoreServer("127.0.0.1", port, SECRET).start()
    try:
        await asyncio.wait_for(telling, 10.0)
        async with await StoreClient.connect("127.0.0.1", port, SECRET, timeout=5.0) as c:
            said = await c.get(ORPHAN_KEY, timeout=1.0)
        assert b"node 1's launcher" in said
        assert b"still runs" in said
    finally:
        telling.cancel()
        await server.close()


@pytest.mark.timeout(30)
async def test_an_orphaned_node_gives_up_on_a_store_of_another_secret() -> None:
    server = await StoreServer("127.0.0.1", 0, b"another-job-secret-0123456789abcd").start()
    try:
        await asyncio.wait_for(tell_new_store(_orphan(server.port)), 10.0)
    finally:
        await server.close()
