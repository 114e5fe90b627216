"""The rendezvous store: every operation, authentication, limits, timeouts, atomicity."""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct

import msgpack
import pytest

from asynccoll import AsyncCollError, AuthenticationError
from asynccoll.launch.store import (
    _CLIENT_LABEL,
    BlockingStoreClient,
    StoreClient,
    StoreError,
    StoreLimits,
    StoreServer,
    StoreTimeoutError,
    _mac,
    _pack,
)

SECRET = b"s" * 32
pytestmark = pytest.mark.timeout(20)


async def _server(**limits: object) -> StoreServer:
    return await StoreServer("127.0.0.1", 0, SECRET,
                             limits=StoreLimits(**limits)).start()  # type: ignore[arg-type]


async def _client(server: StoreServer, secret: bytes = SECRET, timeout: float = 5.0
                  ) -> StoreClient:
    return await StoreClient.connect("127.0.0.1", server.port, secret, timeout=timeout)


async def test_set_get_check_compare_set() -> None:
    async with await _server() as server, await _client(server) as c:
        assert not await c.check(["a"])
        await c.set("a", b"1")
        assert await c.get("a") == b"1"
        assert await c.check(["a"])
        await c.set("a", b"2")
        assert await c.get("a") == b"2"
        # compare_set: absent -> first writer wins, others learn its value
        assert await c.compare_set("k", None, b"first") == b"first"
        assert await c.compare_set("k", None, b"second") == b"first"
        assert await c.compare_set("k", b"wrong", b"third") == b"first"
        assert await c.compare_set("k", b"first", b"fourth") == b"fourth"
        assert await c.get("k") == b"fourth"


async def test_get_waits_for_key_set_by_another_client() -> None:
    async with await _server() as server, await _client(server) as a, \
            await _client(server) as b:
        getter = asyncio.create_task(a.get("late", timeout=5.0))
        waiter = asyncio.create_task(a.wait(["late", "later"], timeout=5.0))
        await asyncio.sleep(0.05)
        assert not getter.done()
        await b.set("late", b"v")
        assert await asyncio.wait_for(getter, 2.0) == b"v"
        assert not waiter.done()
        await b.set("later", b"w")
        await asyncio.wait_for(waiter, 2.0)


async def test_a_lease_lives_as_long_as_its_connection() -> None:
    async with await _server() as server, await _client(server) as watcher:
        holder = await _client(server)
        assert await holder.lease("node/1", b"first") == b"first"
        other = await _client(server)
        assert await other.lease("node/1", b"second") == b"first"  # held: the holder's value
        gone = asyncio.create_task(watcher.wait_gone("node/1", timeout=5.0))
        await asyncio.sleep(0.05)
        assert not gone.done()
        with pytest.raises(StoreTimeoutError) as info:
            await watcher.wait_gone("node/1", timeout=0.1)
        assert info.value.missing == ["node/1"]
        await holder.close()  # the holder dies: the key goes with it
        await asyncio.wait_for(gone, 2.0)
        assert not await watcher.check(["node/1"])
        assert await other.lease("node/1", b"second") == b"second"  # the next one takes it
        await watcher.wait_gone("absent", timeout=0.1)  # an absent key: at once
        await other.close()
        assert not await watcher.check(["node/1"])


async def test_wait_does_not_block_other_requests_of_the_same_client() -> None:
    async with await _server() as server, await _client(server) as c:
        waiter = asyncio.create_task(c.wait(["x"], timeout=5.0))
        await asyncio.sleep(0.02)
        await asyncio.wait_for(c.set("x", b"1"), 2.0)  # would deadlock if serialised
        await asyncio.wait_for(waiter, 2.0)


async def test_add_is_an_atomic_counter() -> None:
    async with await _server() as server:
        clients = [await _client(server) for _ in range(8)]
        try:
            results = await asyncio.gather(*(c.add("n", 1) for c in clients for _ in range(50)))
            assert sorted(results) == list(range(1, 401))  # each increment seen exactly once
            assert await clients[0].get("n") == b"400"
            assert await clients[0].add("n", -400) == 0
        finally:
            for c in clients:
                await c.close()


async def test_add_on_a_non_integer_fails_cleanly() -> None:
    async with await _server() as server, await _client(server) as c:
        await c.set("s", b"abc")
        with pytest.raises(StoreError, match="integer"):
            await c.add("s", 1)
        assert await c.get("s") == b"abc"  # the connection survives a refused request
        with pytest.raises(TypeError, match="amount"):
            await c.add("s", 1.5)  # type: ignore[arg-type]


async def test_wait_timeout_names_missing_keys() -> None:
    async with await _server() as server, await _client(server) as c:
        await c.set("here", b"1")
        with pytest.raises(StoreTimeoutError) as info:
            await c.wait(["here", "absent1", "absent2"], timeout=0.2)
        assert info.value.missing == ["absent1", "absent2"]
        assert isinstance(info.value, AsyncCollError)
        assert isinstance(info.value, TimeoutError)
        with pytest.raises(StoreTimeoutError, match="absent"):
            await c.get("absent1", timeout=0.1)


async def test_wrong_secret_is_refused_and_server_carries_on(
        caplog: pytest.LogCaptureFixture) -> None:
    async with await _server() as server:
        with pytest.raises(AuthenticationError, match="refused"):
            await _client(server, secret=b"x" * 32)
        assert any("wrong secret" in r.getMessage() for r in caplog.records)
        async with await _client(server) as good:
            await good.set("ok", b"1")
            assert await good.get("ok") == b"1"


async def test_client_detects_a_store_that_does_not_know_the_secret() -> None:
    # a fake store that answers the handshake with a made-up proof
    async def fake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = msgpack.packb(["hello", 1, b"n" * 32])
        writer.write(struct.pack(">I", len(body)) + body)
        (n,) = struct.unpack(">I", await reader.readexactly(4))
        await reader.readexactly(n)
        body = msgpack.packb(["ok", b"m" * 32])
        writer.write(struct.pack(">I", len(body)) + body)
        await writer.drain()
        await reader.read()

    srv = await asyncio.start_server(fake, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        with pytest.raises(AuthenticationError, match="does not know"):
            await StoreClient.connect("127.0.0.1", port, SECRET, timeout=3.0)
    finally:
        srv.close()
        await srv.wait_closed()


async def test_unauthenticated_requests_are_refused() -> None:
    async with await _server() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        (n,) = struct.unpack(">I", await reader.readexactly(4))
        assert msgpack.unpackb(await reader.readexactly(n))[0] == "hello"
        body = msgpack.packb([0, "set", "k", b"v"])  # a request instead of the handshake
        writer.write(struct.pack(">I", len(body)) + body)
        rest = await asyncio.wait_for(reader.read(), 3.0)  # the server closes on us
        assert b"denied" in rest
        writer.close()
        async with await _client(server) as c:
            assert not await c.check(["k"])


async def _authenticated_raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that passed the handshake, for sending hand-made requests."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    (n,) = struct.unpack(">I", await reader.readexactly(4))
    nonce_s = msgpack.unpackb(await reader.readexactly(n))[2]
    nonce_c = bytes(32)
    writer.write(_pack(["auth", nonce_c, _mac(SECRET, _CLIENT_LABEL, nonce_s, nonce_c)]))
    (n,) = struct.unpack(">I", await reader.readexactly(4))
    assert msgpack.unpackb(await reader.readexactly(n))[0] == "ok"
    return reader, writer


async def test_malformed_requests_drop_only_their_connection(
        caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(1234)
    bad: list[bytes] = [
        _pack("not a list"), _pack([1]), _pack(["id", "set"]), _pack([1, "nope"]),
        _pack([1, "set", 5, b"v"]), _pack([1, "set", "k", "str"]), _pack([1, "add", "k", 1.5]),
        _pack([1, "wait", 5, 1.0]), _pack([1, "get", "k"]), _pack([1, "compare_set", "k", 3, b""]),
        struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1", struct.pack(">I", 1 << 31),
    ]
    bad += [struct.pack(">I", n) + rng.randbytes(n) for n in (rng.randrange(1, 200)
                                                               for _ in range(40))]
    async with await _server(max_waits_per_client=4) as server, await _client(server) as good:
        for frame in bad:
            reader, writer = await _authenticated_raw(server.port)
            writer.write(frame)
            # dropped (EOF), or for random bytes that happen to parse, simply not answered
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reader.read(), 0.5)
            writer.close()
            await good.set("alive", b"1")  # the server and other clients carry on
        reader, writer = await _authenticated_raw(server.port)
        writer.write(b"".join(_pack([i, "wait", ["never"], 10.0]) for i in range(5)))
        assert await asyncio.wait_for(reader.read(), 3.0) == b""  # 5th blocked wait: dropped
        writer.close()
        assert await good.get("alive") == b"1"
    assert any("dropping client" in r.getMessage() for r in caplog.records)


async def test_oversized_handshake_and_values_are_rejected() -> None:
    async with await _server(max_value_bytes=1024) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(struct.pack(">I", 1 << 30))  # claims a 1 GiB handshake frame
        assert await asyncio.wait_for(reader.read(), 3.0) is not None  # closed, not stuck
        writer.close()
        async with await _client(server) as c:
            with pytest.raises(StoreError, match="exceeds"):
                await c.set("big", b"x" * 2048)
            await c.set("small", b"x" * 1024)
            assert await c.get("small") == b"x" * 1024


async def test_silent_client_is_dropped_after_handshake_timeout() -> None:
    async with await _server(handshake_timeout=0.2) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        data = await asyncio.wait_for(reader.read(), 3.0)  # hello, then EOF after 0.2 s
        assert data.startswith(b"\x00")
        writer.close()


async def test_connect_retries_until_the_server_starts() -> None:
    probe = await _server()
    port = probe.port
    await probe.close()
    connecting = asyncio.create_task(
        StoreClient.connect("127.0.0.1", port, SECRET, timeout=5.0))
    await asyncio.sleep(0.2)
    server = await StoreServer("127.0.0.1", port, SECRET).start()
    try:
        c = await asyncio.wait_for(connecting, 5.0)
        await c.set("a", b"b")
        await c.close()
    finally:
        await server.close()


async def test_connect_times_out_when_nothing_listens() -> None:
    probe = await _server()
    port = probe.port
    await probe.close()
    with pytest.raises(StoreTimeoutError, match="could not reach"):
        await StoreClient.connect("127.0.0.1", port, SECRET, timeout=0.3)


async def test_pending_operations_fail_when_the_server_goes_away() -> None:
    server = await _server()
    c = await _client(server)
    waiter = asyncio.create_task(c.wait(["never"], timeout=10.0))
    await asyncio.sleep(0.05)
    await server.close()
    with pytest.raises(StoreError, match="lost the connection"):
        await asyncio.wait_for(waiter, 3.0)
    with pytest.raises(StoreError):
        await c.set("a", b"b")
    await c.close()


async def test_bad_arguments_name_the_parameter() -> None:
    with pytest.raises(ValueError, match="secret"):
        StoreServer("127.0.0.1", 0, b"short")
    with pytest.raises(TypeError, match="secret"):
        StoreServer("127.0.0.1", 0, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port"):
        StoreServer("127.0.0.1", 70000, SECRET)
    async with await _server() as server, await _client(server) as c:
        with pytest.raises(TypeError, match="key"):
            await c.set(1, b"v")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="value"):
            await c.set("k", "v")  # type: ignore[arg-type]


def test_blocking_client() -> None:
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(_server())
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        with BlockingStoreClient("127.0.0.1", server.port, SECRET, timeout=5.0) as c:
            c.set("a", b"1")
            assert c.get("a") == b"1"
            assert c.add("n", 5) == 5
            assert c.compare_set("a", b"1", b"2") == b"2"
            assert c.check(["a", "n"])
            c.wait(["a"], timeout=1.0)
            with pytest.raises(StoreTimeoutError):
                c.wait(["zz"], timeout=0.1)
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(5.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)
        loop.close()
