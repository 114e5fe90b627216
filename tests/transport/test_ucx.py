"""ucx:// specifics: lazy import, the handshake, bad frames, which UCX transport carries the data,
no polling, real processes (P=2, P=3), SIGKILL, clean exit, CuPy device memory."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import multiprocessing as mp
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from asynccoll.buffers import dtype_to_wire
from asynccoll.errors import AuthenticationError, PeerLostError, ProtocolError, TransportError
from asynccoll.transport.frames import PROTOCOL_VERSION, Format, Header, Kind, Limits, encode_header

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                                reason="ucxx is not installed (pip install 'asynccoll[ucx]')")

SECRET = b"u" * 32
SCHED = 7


def header(src: int, tag: int, arr: Any, execution: int = 0) -> Header:
    return Header(PROTOCOL_VERSION, int(Kind.DATA), SCHED, execution, tag, src,
                  dtype_to_wire(np.dtype(arr.dtype)), tuple(arr.shape), int(Format.DENSE),
                  int(arr.nbytes))


async def world(n: int, secrets: list[bytes] | None = None, **kw: Any) -> list[Any]:
    from asynccoll.transport.ucx import UcxTransport

    ts = [UcxTransport(r, n, secret=(secrets or [SECRET] * n)[r], **kw) for r in range(n)]
    addrs = {t.rank: await t.listen("ucx://127.0.0.1:0") for t in ts}
    await asyncio.gather(*(t.connect({r: a for r, a in addrs.items() if r != t.rank}, timeout=10)
                           for t in ts))
    return ts


async def close_all(ts: list[Any]) -> None:
    for t in ts:
        await t.close()


async def held(t: Any, n: int, timeout: float = 5.0) -> None:
    """Wait until ``t`` holds ``n`` early frames (the matcher offers no event for it)."""
    for _ in range(int(timeout / 0.01)):
        if t.matcher.held_count >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{t.matcher.held_count} frames held after {timeout} s, expected {n}")


def send_raw(t: Any, dst: int, prefix_and_header: bytes) -> None:
    """Send a header message as it goes on the wire, bypassing the checks of post_send."""
    from asynccoll.transport.ucx.library import load

    p = t._peers[dst]
    keep = load().Array(prefix_and_header)
    t._progress.watch(p.ep.tag_send(keep, p.send_htag), lambda exc, k=keep: None)


# -- import and arguments --------------------------------------------------------------------
def test_module_import_does_not_import_ucxx() -> None:
    code = ("import sys, asynccoll.transport.ucx, asynccoll.transport.registry as r; "
            "r.transport_class('ucx'); assert 'ucxx' not in sys.modules, 'ucxx imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_ucxx_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from asynccoll.transport import ucx
    from asynccoll.transport.ucx import library

    monkeypatch.setattr(library, "_ucxx", None)
    monkeypatch.setitem(sys.modules, "ucxx", None)  # makes ``import ucxx`` fail
    with pytest.raises(ImportError, match=r"asynccoll\[ucx\]"):
        ucx.UcxTransport(0, 1, secret=SECRET)


def test_ucx_settings_go_through_the_context_not_the_environment() -> None:
    code = textwrap.dedent("""
        import asyncio, os
        from asynccoll.transport.ucx import UcxTransport

        async def main():
            t = UcxTransport(0, 1, secret=b"u" * 32, ucx_options={"TLS": "tcp,self"})
            await t.listen("ucx://127.0.0.1:0")
            assert t.ucx_config["TLS"] == "tcp,self", t.ucx_config["TLS"]
            await t.close()
            assert "UCX_WARN_UNUSED_ENV_VARS" not in os.environ

        asyncio.run(main())
    """)
    env = {k: v for k, v in os.environ.items() if k != "UCX_WARN_UNUSED_ENV_VARS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    # ucxx itself exports UCX_MEMTYPE_CACHE, unknown to UCX >= 1.19; the default context
    # option keeps UCX from warning about it
    assert "unused environment variable" not in out.stderr, out.stderr


def test_arguments_are_checked() -> None:
    from asynccoll.transport.ucx import UcxTransport

    assert UcxTransport.supports_device is True
    with pytest.raises(TypeError, match="secret"):
        UcxTransport(0, 2, secret="not bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="secret"):
        UcxTransport(0, 2, secret=b"short")
    with pytest.raises(ValueError, match="progress_mode"):
        UcxTransport(0, 2, secret=SECRET, progress_mode="thread-polling")
    with pytest.raises(TypeError, match="ucx_options"):
        UcxTransport(0, 2, secret=SECRET, ucx_options={"TLS": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="rank"):
        UcxTransport(2, 2, secret=SECRET)


@pytest.mark.timeout(20)
async def test_bad_addresses_are_rejected() -> None:
    from asynccoll.transport.ucx import UcxTransport

    t = UcxTransport(1, 2, secret=SECRET)
    try:
        for bad in ("tcp://127.0.0.1:0", "ucx://127.0.0.1", "ucx://host:port", "127.0.0.1:5"):
            with pytest.raises(ValueError, match=r"ucx://HOST:PORT|scheme"):
                await t.listen(bad)
        with pytest.raises(ValueError, match="ucx://HOST:PORT"):
            await t.connect({0: "ucx://127.0.0.1"}, timeout=1)
        with socket.socket() as taken:
            taken.bind(("0.0.0.0", 0))
            taken.listen()
            with pytest.raises(TransportError, match="cannot listen"):
                await t.listen(f"ucx://127.0.0.1:{taken.getsockname()[1]}")
    finally:
        await t.close()


# -- connections -----------------------------------------------------------------------------
@pytest.mark.timeout(30)
async def test_wrong_secret_is_refused_and_the_acceptor_carries_on(
        caplog: pytest.LogCaptureFixture) -> None:
    from asynccoll.transport.ucx import UcxTransport

    caplog.set_level(logging.WARNING, "asynccoll.transport.ucx")
    bad = UcxTransport(0, 3, secret=b"w" * 32)
    good = [UcxTransport(r, 3, secret=SECRET) for r in (1, 2)]
    ts = [bad, *good]
    try:
        addrs = {t.rank: await t.listen("ucx://127.0.0.1:0") for t in ts}
        with pytest.raises(AuthenticationError, match="secret"):
            await asyncio.wait_for(bad.connect({1: addrs[1]}, timeout=5), 10)
        # rank 1 dropped it with a logged reason and still accepts a peer with the secret
        await asyncio.wait_for(asyncio.gather(good[0].connect({2: addrs[2]}, timeout=5),
                                              good[1].connect({1: addrs[1]}, timeout=5)), 10)
        x = np.arange(10, dtype=np.float32)
        r = good[0].post_recv(2, SCHED, 0, 1, np.empty_like(x))
        await good[1].post_send(1, header(2, 1, x), x)
        assert (await asyncio.wait_for(r, 5)).header.length == x.nbytes
        assert 0 not in good[0]._peers
        assert any("refused a connection" in m for m in caplog.messages), caplog.messages
    finally:
        await close_all(ts)


@pytest.mark.timeout(30)
async def test_connect_retries_until_the_peer_listens_and_gives_up_at_its_deadline() -> None:
    from asynccoll.transport.ucx import UcxTransport

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0, t1 = UcxTransport(0, 2, secret=SECRET), UcxTransport(1, 2, secret=SECRET)
    try:
        start = time.monotonic()
        with pytest.raises(PeerLostError, match="rank 1"):
            await t0.connect({1: f"ucx://127.0.0.1:{port}"}, timeout=1.0)
        assert time.monotonic() - start < 3.0

        async def late_listen() -> None:
            await asyncio.sleep(0.3)
            await t1.listen(f"ucx://127.0.0.1:{port}")

        await asyncio.wait_for(asyncio.gather(
            late_listen(), t0.connect({1: f"ucx://127.0.0.1:{port}"}, timeout=10),
            t1.connect({0: "ucx://127.0.0.1:1"}, timeout=10)), 15)
        assert set(t0._peers) == {1}
        assert set(t1._peers) == {0}
    finally:
        await close_all([t0, t1])


# -- frames ----------------------------------------------------------------------------------
def _wire(h: Header | bytes, flags: int = 0) -> bytes:
    from asynccoll.transport.ucx.transport import PREFIX

    raw = h if isinstance(h, bytes) else encode_header(h)
    return PREFIX.pack(len(raw), flags) + raw


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["forged-source", "not-msgpack", "over-limit", "bad-length"])
async def test_bad_frames_drop_only_that_peer(case: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "asynccoll.transport.ucx")
    ts = await world(3, limits=Limits(max_payload_bytes=4096))
    try:
        x = np.zeros(8, np.uint8)
        pending = ts[0].post_recv(1, SCHED, 0, 9, np.empty(8, np.uint8))
        if case == "forged-source":
            send_raw(ts[1], 0, _wire(header(2, 9, x)))
        elif case == "not-msgpack":
            send_raw(ts[1], 0, _wire(b"\xc1\xc1\xc1"))
        elif case == "over-limit":
            ts[1].post_send(0, header(1, 9, np.zeros(8192, np.uint8)), np.zeros(8192, np.uint8))
        else:
            send_raw(ts[1], 0, _wire(header(1, 9, x), flags=1)[:-2] + b"\x00\xff")
        with pytest.raises(PeerLostError) as info:
            await asyncio.wait_for(pending, 5)
        assert info.value.rank == 1
        assert isinstance(info.value.__cause__, ProtocolError)
        assert any("disconnecting rank 1" in m for m in caplog.messages), caplog.messages
        # the other peer is unaffected
        r = ts[0].post_recv(2, SCHED, 0, 9, np.empty(8, np.uint8))
        await ts[2].post_send(0, header(2, 9, x), x)
        await asyncio.wait_for(r, 5)
    finally:
        await close_all(ts)


@pytest.mark.timeout(30)
async def test_inline_and_streamed_frames_keep_their_order_per_key() -> None:
    ts = await world(2)
    try:
        sizes = [8, 1 << 20, 100, 0, 200_000, 8000, 9000, 3]
        xs = [np.full(s, i, np.uint8) for i, s in enumerate(sizes)]
        for x in xs:
            ts[0].post_send(1, header(0, 4, x), x)
        await held(ts[1], len(xs))
        for x in xs:
            m = await asyncio.wait_for(ts[1].post_recv(0, SCHED, 0, 4), 5)
            assert bytes(m.payload) == x.tobytes()
    finally:
        await close_all(ts)


@pytest.mark.timeout(30)
def test_runs_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed")

    async def body() -> None:
        ts = await world(2)
        try:
            for n in (5, 100_000, 4 << 20):
                x = np.arange(n, dtype=np.uint8)
                r = ts[0].post_recv(1, SCHED, 0, n % 9, None)
                await ts[1].post_send(0, header(1, n % 9, x), x)
                assert bytes((await asyncio.wait_for(r, 5)).payload) == x.tobytes()
        finally:
            await close_all(ts)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(body())


@pytest.mark.timeout(30)
async def test_an_idle_transport_does_not_spin() -> None:
    ts = await world(2)
    try:
        r = ts[0].post_recv(1, SCHED, 0, 1, None)  # a pending receive, as in a real job
        before = resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.sleep(1.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        assert cpu < 0.1, f"idle transports used {cpu:.3f} s of CPU in 1 s"
        x = np.ones(4, np.float64)
        await ts[1].post_send(0, header(1, 1, x), x)
        assert bytes((await asyncio.wait_for(r, 5)).payload) == x.tobytes()
    finally:
        await close_all(ts)


@pytest.mark.timeout(30)
async def test_schedules_run_over_ucx() -> None:
    from asynccoll import Schedule
    from asynccoll.testing import run_schedules

    P = 3
    ts = await world(P)
    try:
        scheds = []
        for rank in range(P):
            s = Schedule(rank, P, "shift", {"x": 1000, "tmp": 1000})
            snd = s.send((rank + 1) % P, "x")
            rcv = s.recv((rank - 1) % P, "tmp")
            s.compute("sum", ["x", "tmp"], "x", deps=[snd, rcv])
            scheds.append(s.commit())
        bufs = [{"x": np.full(1000, r + 1.0), "tmp": np.zeros(1000)} for r in range(P)]
        await run_schedules(ts, scheds, bufs, timeout=10)
        for r in range(P):
            assert bufs[r]["x"][0] == r + 1.0 + (r - 1) % P + 1.0
    finally:
        await close_all(ts)


@pytest.mark.timeout(120)
async def test_shared_memory_mode_passes_the_conformance_suite() -> None:
    from asynccoll.testing import check_transport

    @asynccontextmanager
    async def shm_pair() -> AsyncIterator[tuple[Any, Any]]:
        ts = await world(2, secrets=[os.urandom(32)] * 2, shared_memory=True)
        try:
            assert ts[0]._peers[1].tx is not ts[0]._peers[1].ep
            yield ts[0], ts[1]
        finally:
            await close_all(ts)

    await check_transport(shm_pair, timeout=60)


# -- which UCX transport carries the data ----------------------------------------------------
_PROBE = textwrap.dedent("""
    import asyncio, sys
    import numpy as np
    sys.path.insert(0, {here!r})
    from test_ucx import world, header, close_all
    async def main():
        ts = await world(2, shared_memory={shm!r})
        x = np.ones(1 << 20, np.uint8)
        r = ts[1].post_recv(0, 7, 0, 1, np.empty_like(x))
        await ts[0].post_send(1, header(0, 1, x), x)
        await asyncio.wait_for(r, 10)
        await close_all(ts)
        print("probe-done", flush=True)
    asyncio.run(main())
""")


def _tag_lanes(output: str) -> set[str]:
    """The transports UCX chose for tagged messages between local workers (UCX_PROTO_INFO)."""
    lanes: set[str] = set()
    in_table = False
    for line in output.splitlines():
        if "|" not in line:
            continue
        if "intra-node" in line:
            in_table = "tagged message by ucp_tag_send* from host memory" in line
            continue
        cells = [c.strip() for c in line.split("|")]
        if in_table and len(cells) >= 4 and cells[-2] and not cells[-2].startswith("-"):
            lanes.add(cells[-2])
    return lanes


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("shm", "expect"), [(False, {"tcp"}), (True, {"sysv", "cma"})])
def test_which_ucx_transport_carries_the_frames(shm: bool, expect: set[str]) -> None:
    """By default UCX picks TCP on loopback (error-handled endpoints cannot use shared memory);
    with ``shared_memory=True`` frames between local ranks go over sysv shared memory (eager)
    and cma (rendezvous). UCX_PROTO_INFO prints what UCX chose."""
    env = dict(os.environ, UCX_PROTO_INFO="y", UCX_WARN_UNUSED_ENV_VARS="n")
    env.pop("UCX_TLS", None)
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _PROBE.format(here=here, shm=shm)], env=env,
                         capture_output=True, text=True, timeout=60)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "probe-done" in text, text[-3000:]
    lanes = _tag_lanes(text)
    assert lanes, text[-3000:]
    if shm:  # the error-handled endpoint's tables (tcp) are printed too
        lanes = {lane for lane in lanes if not lane.startswith("tcp")}
    assert {lane.split("/")[0] for lane in lanes} == expect, lanes


# -- real processes --------------------------------------------------------------------------
def _rank_main(rank: int, world_size: int, addr_q: Any, peer_q: Any, result_q: Any,
               shm: bool) -> None:
    try:
        asyncio.run(_exchange(rank, world_size, shm, addr_q, peer_q))
        result_q.put((rank, None))
    except BaseException:
        result_q.put((rank, traceback.format_exc()))


def _pattern(src: int, dst: int, size: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(1000 * src + dst + size).integers(0, 255, size, np.uint8)


async def _exchange(rank: int, world_size: int, shm: bool, addr_q: Any, peer_q: Any) -> None:
    from asynccoll.transport.ucx import UcxTransport

    t = UcxTransport(rank, world_size, secret=SECRET, shared_memory=shm)
    addr_q.put((rank, await t.listen("ucx://127.0.0.1:0")))
    addrs = await asyncio.get_running_loop().run_in_executor(None, peer_q.get, True, 30)
    await t.connect({r: a for r, a in addrs.items() if r != rank}, timeout=20)
    assert all((p.tx is not p.ep) == shm for p in t._peers.values())
    others = [r for r in range(world_size) if r != rank]
    sizes = [0, 8, 9000, 1 << 20, 16 << 20]
    recvs = {(p, s): t.post_recv(p, SCHED, 0, i, np.empty(s, np.uint8) if i % 2 else None)
             for p in others for i, s in enumerate(sizes)}
    sends = [t.post_send(p, header(rank, i, _pattern(rank, p, s)), _pattern(rank, p, s))
             for p in others for i, s in enumerate(sizes)]
    await asyncio.wait_for(asyncio.gather(*sends), 30)
    for (p, s), fut in recvs.items():
        m = await asyncio.wait_for(fut, 30)
        assert bytes(m.payload) == _pattern(p, rank, s).tobytes(), (p, s)
    # everyone received everything before anyone closes
    z = np.zeros(1, np.uint8)
    done = [t.post_recv(p, SCHED, 1, 0, None) for p in others]
    await asyncio.gather(*(t.post_send(p, header(rank, 0, z, 1), z) for p in others))
    await asyncio.wait_for(asyncio.gather(*done), 30)
    await t.close()


def _run_ranks(world_size: int, shm: bool, timeout: float = 60.0) -> dict[int, str | None]:
    from _helpers import run_exchanging_ranks  # not at import: children import this module

    # exit_timeout: the ranks exit by themselves too, so no hang in UCX teardown
    return run_exchanging_ranks(_rank_main, world_size, lambda r: (shm,), timeout=timeout,
                                exit_timeout=20)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world_size", "shm"), [(2, False), (3, False), (3, True)])
def test_processes_exchange_over_ucx(world_size: int, shm: bool) -> None:
    results = _run_ranks(world_size, shm)
    failed = {r: tb for r, tb in results.items() if tb}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())


def _streamer(target: str, started: Any, close: bool, shm: bool = False) -> None:
    from asynccoll.transport.ucx import UcxTransport

    async def body() -> None:
        t = UcxTransport(0, 2, secret=SECRET, shared_memory=shm)
        await t.connect({1: target}, timeout=20)
        x = np.ones(8 << 20, np.uint8)
        started.set()
        if not close:  # exits with the transport open: teardown must not hang
            await t.post_send(1, header(0, 0, x), x)
            return
        tag = 0
        while True:
            await t.post_send(1, header(0, tag, x), x)
            tag += 1

    asyncio.run(body())


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
# Default mode only: with shared_memory=True, UCX may abort the surviving process when the peer
# dies (an endpoint without error handling), which would take pytest down with it; documented in
# docs/transports.md.
@pytest.mark.parametrize("shm", [False])
async def test_sigkill_mid_transfer_fails_pending_receives_promptly(shm: bool) -> None:
    from asynccoll.transport.ucx import UcxTransport

    ctx = mp.get_context("spawn")
    t = UcxTransport(1, 2, secret=SECRET, shared_memory=shm)
    addr = await t.listen("ucx://127.0.0.1:0")
    started = ctx.Event()
    proc = ctx.Process(target=_streamer, args=(addr, started, True, shm), daemon=True)
    try:
        proc.start()
        await t.connect({0: "ucx://127.0.0.1:1"}, timeout=30)
        recvs = [t.post_recv(0, SCHED, 0, tag, np.empty(8 << 20, np.uint8))
                 for tag in range(10_000)]
        await asyncio.wait_for(recvs[2], 20)  # data is streaming
        from _helpers import kill_and_check_pending_fail  # not at import: children import us

        failed = await kill_and_check_pending_fail(t, proc, recvs, peer=0, slack=3)
        assert failed[0].__cause__ is not None  # the UCX error
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        await t.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
async def test_a_process_that_never_closes_its_transport_still_exits() -> None:
    from asynccoll.transport.ucx import UcxTransport

    ctx = mp.get_context("spawn")
    t = UcxTransport(1, 2, secret=SECRET)
    addr = await t.listen("ucx://127.0.0.1:0")
    started = ctx.Event()
    proc = ctx.Process(target=_streamer, args=(addr, started, False), daemon=True)
    try:
        proc.start()
        await t.connect({0: "ucx://127.0.0.1:1"}, timeout=30)
        m = await asyncio.wait_for(t.post_recv(0, SCHED, 0, 0, None), 20)
        assert len(m.payload) == 8 << 20
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, proc.join, 20)
        assert proc.exitcode == 0, f"exit code {proc.exitcode} (None: hung at exit)"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        await t.close()


# -- CuPy ------------------------------------------------------------------------------------
def _cupy_with_a_device() -> Any:
    """CuPy, or skip the test where it or a CUDA device is missing."""
    cp = pytest.importorskip("cupy", reason="cupy is not installed")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cp.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device")
    return cp


@pytest.mark.timeout(60)
async def test_a_cupy_payload_is_sent_after_the_kernels_that_write_it() -> None:
    # CuPy's kernels are asynchronous: an array written by a kernel still queued (here behind a
    # long matrix product) must not be read by UCX before the kernel ran. The first GPU run
    # over ucx sent such buffers early.
    cp = _cupy_with_a_device()
    ts = await world(2)
    try:
        big = cp.ones((8192, 8192), dtype=cp.float32)
        n = 4 << 20
        for trial in range(3):
            x = cp.zeros(n, dtype=cp.float32)
            y = cp.full(n, -1.0, dtype=cp.float32)
            cp.cuda.Device().synchronize()
            big @ big  # tens of milliseconds of work queued ahead of the write
            x += 7.0
            r = ts[1].post_recv(0, SCHED, trial, 3, y)
            await ts[0].post_send(1, header(0, 3, x, execution=trial), x)
            await asyncio.wait_for(r, 10)
            assert bool((y == 7.0).all()), (trial, float(y.min()), float(y.max()))
    finally:
        await close_all(ts)


@pytest.mark.timeout(60)
async def test_cupy_arrays_travel_as_device_memory() -> None:
    cp = _cupy_with_a_device()
    ts = await world(2)
    try:
        for n in (3, 5000, 1 << 20):
            x = cp.arange(n, dtype=cp.float32)
            y = cp.zeros(n, dtype=cp.float32)
            r = ts[1].post_recv(0, SCHED, 0, n % 7, y)
            await ts[0].post_send(1, header(0, n % 7, x), x)
            await asyncio.wait_for(r, 10)
            assert bool((x == y).all())
            # early (held in host memory), then a device receive
            z = cp.zeros(n, dtype=cp.float32)
            await ts[0].post_send(1, header(0, 100, x, execution=1), x)
            await held(ts[1], 1)
            await asyncio.wait_for(ts[1].post_recv(0, SCHED, 1, 100, z), 10)
            assert bool((x == z).all())
            # host sender, device receiver
            h = np.arange(n, dtype=np.float32)
            w = cp.zeros(n, dtype=cp.float32)
            r = ts[1].post_recv(0, SCHED, 2, 1, w)
            await ts[0].post_send(1, header(0, 1, h, execution=2), h)
            await asyncio.wait_for(r, 10)
            assert bool((cp.asarray(h) == w).all())
    finally:
        await close_all(ts)


@pytest.mark.timeout(30)
async def test_one_memory_budget_drops_the_peer_past_its_share(
        caplog: pytest.LogCaptureFixture) -> None:
    """Held messages and header-only claims (a header whose payload never comes) count against
    one budget; when a peer within its share needs room, the one past its share is dropped and
    what it made the rank hold is released at once."""
    caplog.set_level(logging.WARNING, "asynccoll.transport.ucx")
    mib = 1 << 20
    ts = await world(3, limits=Limits(max_held_bytes=64 * mib))  # 32 MiB a peer
    try:
        m = ts[0].matcher
        big = np.zeros(24 * mib, np.uint8)
        await ts[1].post_send(0, header(1, 1, big, execution=5), big)  # held
        send_raw(ts[1], 0, _wire(header(1, 2, np.zeros(16 * mib, np.uint8), execution=5)))
        for _ in range(500):  # the claim's header arrived: 40 MiB charged, past its share
            if m.charged(1) == 40 * mib:
                break
            await asyncio.sleep(0.01)
        assert m.charged(1) == 40 * mib
        pending = ts[0].post_recv(1, SCHED, 0, 9)
        other = np.ones(30 * mib, np.uint8)
        await ts[2].post_send(0, header(2, 1, other, execution=5), other)  # within its share
        with pytest.raises(PeerLostError) as info:
            await asyncio.wait_for(pending, 5)
        assert info.value.rank == 1
        assert any("disconnecting rank 1: rank 1 holds 41943040 bytes here, past its share "
                   "of 33554432" in msg for msg in caplog.messages), caplog.messages
        # rank 2's send completes at its side when UCX has taken the data, which can be before
        # rank 0 holds the whole message (always so on a 16-core machine with UCX 1.21): wait
        for _ in range(500):
            if m.held_count == 1:
                break
            await asyncio.sleep(0.01)
        assert (m.charged(1), m.charged(2), m.held_count) == (0, 30 * mib, 1)
        got = await asyncio.wait_for(ts[0].post_recv(2, SCHED, 5, 1), 5)
        assert bytes(got.payload[:4]) == b"\x01" * 4
        assert m.charged_bytes == 0
    finally:
        await close_all(ts)
