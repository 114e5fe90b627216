"""A small authenticated TCP key-value store for the rendezvous (like a c10d ``TCPStore``).

:class:`StoreServer` runs on an asyncio loop (hosted by ``asynccoll run`` or by rank 0);
:class:`StoreClient` talks to it. Operations: ``set``, ``get`` (waits for the key), ``wait``,
``add`` (an atomic counter), ``compare_set`` and ``check``. Keys are ``str``, values ``bytes``.

Wire format: every frame is a 4-byte big-endian length and a msgpack array. A connection starts
with a mutual handshake, so that neither side hands anything to a party that does not know the
job secret and the secret itself never crosses the wire::

    server -> ["hello", 1, nonce_s]                       32 random bytes
    client -> ["auth", nonce_c, HMAC(secret, CLIENT | nonce_s | nonce_c)]
    server -> ["ok", HMAC(secret, SERVER | nonce_c | nonce_s)]   or ["denied", reason], close

Then requests ``[id, op, *args]`` and responses ``[id, ok, result_or_reason]``; requests of one
connection may be in flight together (a blocked ``wait`` does not hold up a ``set``).

Guarantees: every operation is atomic with respect to every other (they run on the server's one
loop); a blocked ``wait``/``get`` is bounded by its timeout on both sides; frames, keys, values
and the store's total size are bounded by :class:`StoreLimits`, and a client that exceeds them
or fails the handshake is disconnected with a logged reason while the server carries on.
The store authenticates but does not encrypt: put nothing secret in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import AsyncCollError, AuthenticationError

__all__ = [
    "BlockingStoreClient",
    "StoreClient",
    "StoreError",
    "StoreLimits",
    "StoreServer",
    "StoreTimeoutError",
]

log = logging.getLogger("asynccoll.launch.store")

_VERSION = 1
_LEN = struct.Struct(">I")
_CLIENT_LABEL = b"asynccoll-store-client-v1"
_SERVER_LABEL = b"asynccoll-store-server-v1"
_NONCE = 32
_HANDSHAKE_MAX = 256  # bytes an unauthenticated peer may make us read


class StoreError(AsyncCollError):
    """A store operation failed (connection lost, limit exceeded, bad value for ``add``)."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store operation did not complete in time; ``missing`` lists keys still absent."""

    def __init__(self, message: str, missing: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)


@dataclass(frozen=True)
class StoreLimits:
    """Bounds the server enforces on its clients."""

    max_key_bytes: int = 1024
    max_value_bytes: int = 1 << 20
    max_keys: int = 1 << 16
    max_total_bytes: int = 256 << 20
    max_clients: int = 4096
    max_wait_keys: int = 65536
    max_waits_per_client: int = 1024
    #: a client whose unread responses exceed this is disconnected rather than buffered
    max_write_buffer: int = 64 << 20
    handshake_timeout: float = 10.0


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


def _check_secret(secret: object) -> bytes:
    if not isinstance(secret, bytes | bytearray):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    if len(secret) < 16:
        raise ValueError(f"secret must be at least 16 bytes, got {len(secret)}")
    return bytes(secret)


def _pack(obj: Any) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> Any:
    """Read one frame; raise StoreError on an over-limit or malformed one, EOF as is."""
    (n,) = _LEN.unpack(await reader.readexactly(4))
    if n > limit:
        raise StoreError(f"frame of {n} bytes exceeds the limit of {limit}")
    body = await reader.readexactly(n)
    try:
        return msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise StoreError(f"frame is not valid msgpack: {exc}") from exc


class _Reject(Exception):
    """A client's request breaks the protocol; drop the connection."""


class StoreServer:
    """The store. ``await start()`` binds; ``port`` then holds the bound port; ``close()`` stops.

    ``host`` ``""`` or ``"0.0.0.0"`` binds every interface; prefer the one address peers use.
    Costs: one task per connection and one per blocked ``wait``; memory bounded by ``limits``.
    """

    def __init__(self, host: str, port: int, secret: bytes, *,
                 limits: StoreLimits | None = None) -> None:
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        self.host = host
        self.port = port
        self._secret = _check_secret(secret)
        self.limits = limits or StoreLimits()
        self._data: dict[str, bytes] = {}
        self._bytes = 0
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        """``host:port`` as bound."""
        return f"{self.host}:{self.port}"

    async def start(self) -> StoreServer:
        """Bind and start serving; raise ``OSError`` if the address is taken."""
        self._server = await asyncio.start_server(self._serve, self.host or None, self.port,
                                                  reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        """Stop accepting, drop every connection and fail blocked waits."""
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> StoreServer:
        return self if self._server is not None else await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- connections ---------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer = writer.get_extra_info("peername")
        if len(self._conns) >= self.limits.max_clients:
            log.warning("store: refusing %s: %d clients already", peer, len(self._conns))
            writer.close()
            return
        self._conns.add(task)
        waits: set[asyncio.Task[None]] = set()
        try:
            if not await self._handshake(reader, writer, peer):
                return
            frame_limit = self.limits.max_key_bytes + self.limits.max_value_bytes * 2 + 1024
            while True:
                req = await _read_frame(reader, frame_limit)
                self._dispatch(req, writer, waits)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        except asyncio.CancelledError:
            # close() cancels us; ending normally keeps asyncio's stream callback from logging
            # the cancellation as an error. Nothing awaits this task but close().
            pass
        except (StoreError, _Reject) as exc:
            log.warning("store: dropping client %s: %s", peer, exc)
        finally:
            for w in waits:
                w.cancel()
            self._conns.discard(task)
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         peer: object) -> bool:
        nonce_s = secrets.token_bytes(_NONCE)
        writer.write(_pack(["hello", _VERSION, nonce_s]))
        try:
            msg = await asyncio.wait_for(_read_frame(reader, _HANDSHAKE_MAX),
                                         self.limits.handshake_timeout)
        except TimeoutError:
            log.warning("store: client %s sent no handshake in %.0f s", peer,
                        self.limits.handshake_timeout)
            return False
        ok = (isinstance(msg, list) and len(msg) == 3 and msg[0] == "auth"
              and isinstance(msg[1], bytes) and len(msg[1]) == _NONCE
              and isinstance(msg[2], bytes))
        if ok and hmac.compare_digest(msg[2], _mac(self._secret, _CLIENT_LABEL, nonce_s, msg[1])):
            writer.write(_pack(["ok", _mac(self._secret, _SERVER_LABEL, msg[1], nonce_s)]))
            return True
        reason = "wrong secret" if ok else "malformed handshake"
        log.warning("store: refusing client %s: %s", peer, reason)
        writer.write(_pack(["denied", reason]))
        return False

    def _reply(self, writer: asyncio.StreamWriter, rid: int, ok: bool, result: Any) -> None:
        if writer.is_closing():
            return
        writer.write(_pack([rid, ok, result]))
        if writer.transport.get_write_buffer_size() > self.limits.max_write_buffer:
            log.warning("store: dropping a client that does not read its responses")
            writer.transport.abort()

    # -- operations ----------------------------------------------------------------------------
    def _dispatch(self, req: Any, writer: asyncio.StreamWriter,
                  waits: set[asyncio.Task[None]]) -> None:
        if not isinstance(req, list) or len(req) < 2 or type(req[0]) is not int \
                or not isinstance(req[1], str):
            raise _Reject("request must be [id, op, *args]")
        rid, op, args = req[0], req[1], req[2:]
        try:
            if op in ("wait", "get"):
                keys = [self._key(k) for k in (args[0] if op == "wait" else args[:1])]
                if len(keys) > self.limits.max_wait_keys:
                    raise _Reject(f"wait on {len(keys)} keys exceeds {self.limits.max_wait_keys}")
                if len(waits) >= self.limits.max_waits_per_client:
                    raise _Reject(f"more than {self.limits.max_waits_per_client} blocked waits")
                timeout = float(args[1])
                t = asyncio.create_task(self._wait(rid, op, keys, timeout, writer))
                waits.add(t)
                t.add_done_callback(waits.discard)
                return
            result = self._apply(op, args)
        except (IndexError, TypeError, ValueError) as exc:
            raise _Reject(f"bad arguments to {op!r}: {exc}") from exc
        except StoreError as exc:
            self._reply(writer, rid, False, str(exc))
            return
        self._reply(writer, rid, True, result)

    def _key(self, key: object) -> str:
        if not isinstance(key, str):
            raise _Reject(f"key must be a str, got {type(key).__name__}")
        if len(key.encode()) > self.limits.max_key_bytes:
            raise _Reject(f"key of {len(key.encode())} bytes exceeds {self.limits.max_key_bytes}")
        return key

    def _apply(self, op: str, args: list[Any]) -> Any:
        if op == "set":
            self._put(self._key(args[0]), self._value(args[1]))
            return None
        if op == "add":
            key, amount = self._key(args[0]), args[1]
            if type(amount) is not int:
                raise _Reject("add amount must be an int")
            old = self._data.get(key, b"0")
            try:
                value = int(old) + amount
            except ValueError:
                raise StoreError(f"key {key!r} does not hold an integer") from None
            self._put(key, str(value).encode())
            return value
        if op == "compare_set":
            key, expected, desired = self._key(args[0]), args[1], self._value(args[2])
            if expected is not None and not isinstance(expected, bytes):
                raise _Reject("compare_set expected must be bytes or nil")
            current = self._data.get(key)
            if current == expected:
                self._put(key, desired)
                return desired
            return current
        if op == "check":
            return all(self._key(k) in self._data for k in args[0])
        raise _Reject(f"unknown operation {op!r}")

    def _value(self, value: object) -> bytes:
        if not isinstance(value, bytes):
            raise _Reject(f"value must be bytes, got {type(value).__name__}")
        if len(value) > self.limits.max_value_bytes:
            raise StoreError(f"value of {len(value)} bytes exceeds {self.limits.max_value_bytes}")
        return value

    def _put(self, key: str, value: bytes) -> None:
        old = self._data.get(key)
        if old is None and len(self._data) >= self.limits.max_keys:
            raise StoreError(f"the store holds {len(self._data)} keys, the limit")
        grow = len(value) - len(old) if old is not None else len(value) + len(key)
        if self._bytes + grow > self.limits.max_total_bytes:
            raise StoreError(f"the store would exceed {self.limits.max_total_bytes} bytes")
        self._data[key] = value
        self._bytes += grow
        for fut in self._waiters.pop(key, ()):
            if not fut.done():
                fut.set_result(None)

    async def _wait(self, rid: int, op: str, keys: list[str], timeout: float,
                    writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        for key in keys:
            while key not in self._data:
                left = deadline - loop.time()
                if left <= 0:
                    missing = [k for k in keys if k not in self._data]
                    self._reply(writer, rid, False, ["timeout", missing])
                    return
                fut = loop.create_future()
                self._waiters.setdefault(key, []).append(fut)
                try:
                    await asyncio.wait_for(fut, left)
                except TimeoutError:
                    pass
                finally:
                    lst = self._waiters.get(key)
                    if lst is not None and fut in lst:
                        lst.remove(fut)
                        if not lst:
                            del self._waiters[key]
        self._reply(writer, rid, True, self._data[keys[0]] if op == "get" else None)


class StoreClient:
    """An authenticated connection to a :class:`StoreServer`.

    Create with ``await StoreClient.connect(host, port, secret)``. Every operation takes a
    ``timeout`` (default: the client's ``timeout``) and raises :class:`StoreTimeoutError` past
    it, :class:`StoreError` when the connection is lost or the server refuses the request.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 timeout: float, address: str) -> None:
        self._reader = reader
        self._writer = writer
        self.timeout = timeout
        self.address = address
        self._next = 0
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._closed: BaseException | None = None
        self._task = asyncio.create_task(self._read_loop())

    @classmethod
    async def connect(cls, host: str, port: int, secret: bytes, *, timeout: float = 60.0,
                      connect_timeout: float | None = None) -> StoreClient:
        """Connect and authenticate, retrying refused connections with backoff.

        Retries until ``connect_timeout`` (default ``timeout``) while nothing listens yet (the
        store may start after its clients). Raises :class:`AuthenticationError` at once if
        either side does not know the secret, :class:`StoreTimeoutError` when the deadline
        passes.
        """
        secret = _check_secret(secret)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout if connect_timeout is None else connect_timeout)
        delay = 0.01
        address = f"{host}:{port}"
        while True:
            left = deadline - loop.time()
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), max(left, 0.001))
                break
            except (OSError, TimeoutError) as exc:
                left = deadline - loop.time()
                if left <= 0:
                    raise StoreTimeoutError(
                        f"could not reach the store at {address}: {exc}") from exc
                await asyncio.sleep(min(delay, left))
                delay = min(delay * 2, 0.5)
        try:
            await asyncio.wait_for(cls._handshake(reader, writer, secret, address),
                                   max(deadline - loop.time(), 1.0))
        except TimeoutError as exc:
            writer.close()
            raise StoreTimeoutError(f"the store at {address} did not complete the handshake") \
                from exc
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, timeout=timeout, address=address)

    @staticmethod
    async def _handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         secret: bytes, address: str) -> None:
        try:
            hello = await _read_frame(reader, _HANDSHAKE_MAX)
            if not (isinstance(hello, list) and len(hello) == 3 and hello[0] == "hello"
                    and hello[1] == _VERSION and isinstance(hello[2], bytes)):
                raise StoreError(f"{address} is not an asynccoll store (version {_VERSION})")
            nonce_c = secrets.token_bytes(_NONCE)
            writer.write(_pack(["auth", nonce_c, _mac(secret, _CLIENT_LABEL, hello[2], nonce_c)]))
            reply = await _read_frame(reader, _HANDSHAKE_MAX)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise StoreError(f"the store at {address} closed the connection") from exc
        if isinstance(reply, list) and reply[:1] == ["denied"]:
            raise AuthenticationError(
                f"the store at {address} refused us: {reply[1] if len(reply) > 1 else '?'} "
                "(is the same job secret set on every node?)")
        if not (isinstance(reply, list) and len(reply) == 2 and reply[0] == "ok"
                and isinstance(reply[1], bytes) and hmac.compare_digest(
                    reply[1], _mac(secret, _SERVER_LABEL, nonce_c, hello[2]))):
            raise AuthenticationError(f"the store at {address} does not know the job secret")

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await _read_frame(self._reader, 1 << 30)
                if not (isinstance(msg, list) and len(msg) == 3 and type(msg[0]) is int):
                    raise StoreError("malformed response from the store")
                fut = self._pending.pop(msg[0], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except asyncio.CancelledError:
            self._fail(StoreError("store client closed"))
            raise
        except (asyncio.IncompleteReadError, ConnectionError, StoreError) as exc:
            err = StoreError(f"lost the connection to the store at {self.address}")
            err.__cause__ = exc
            self._fail(err)

    def _fail(self, exc: BaseException) -> None:
        self._closed = exc
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()

    async def _call(self, op: str, *args: Any, timeout: float | None = None,
                    keys: Sequence[str] = ()) -> Any:
        if self._closed is not None:
            raise StoreError(f"store client unusable: {self._closed}") from self._closed
        timeout = self.timeout if timeout is None else timeout
        rid = self._next
        self._next += 1
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self._writer.write(_pack([rid, op, *args]))
        try:
            # the server enforces the timeout of waits itself; allow it a moment to say so
            _, ok, result = await asyncio.wait_for(fut, timeout + 5.0)
        except TimeoutError:
            self._pending.pop(rid, None)
            raise StoreTimeoutError(f"store {op} timed out after {timeout} s", keys) from None
        if ok:
            return result
        if isinstance(result, list) and result[:1] == ["timeout"]:
            missing = list(result[1])
            raise StoreTimeoutError(
                f"store {op} timed out after {timeout} s waiting for {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}", missing)
        raise StoreError(f"store {op} failed: {result}")

    # -- the operations ------------------------------------------------------------------------
    async def set(self, key: str, value: bytes, *, timeout: float | None = None) -> None:
        """Store ``value`` under ``key`` (replacing it), waking waiters of ``key``."""
        await self._call("set", _k(key), _v(value), timeout=timeout)

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set."""
        t = self.timeout if timeout is None else timeout
        result: bytes = await self._call("get", _k(key), t, timeout=t, keys=[key])
        return result

    async def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Return once every key in ``keys`` is set; :class:`StoreTimeoutError` names the rest."""
        ks = [_k(k) for k in keys]
        t = self.timeout if timeout is None else timeout
        await self._call("wait", ks, t, timeout=t, keys=ks)

    async def add(self, key: str, amount: int = 1, *, timeout: float | None = None) -> int:
        """Atomically add ``amount`` to the integer under ``key`` (absent: 0); return the sum.

        The value is stored as ASCII decimal, so ``get`` returns e.g. ``b"3"``.
        """
        if type(amount) is not int:
            raise TypeError(f"amount must be an int, got {type(amount).__name__}")
        result: int = await self._call("add", _k(key), amount, timeout=timeout)
        return result

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes, *,
                          timeout: float | None = None) -> bytes | None:
        """Set ``key`` to ``desired`` iff it now holds ``expected`` (``None``: is absent).

        Returns the value ``key`` holds afterwards (``desired`` when the swap happened), so
        ``compare_set(k, None, mine)`` lets the first writer win and tells everyone its value.
        """
        if expected is not None:
            _v(expected)
        result: bytes | None = await self._call("compare_set", _k(key), expected, _v(desired),
                                                timeout=timeout)
        return result

    async def check(self, keys: Iterable[str], *, timeout: float | None = None) -> bool:
        """Whether every key in ``keys`` is set, without waiting."""
        result: bool = await self._call("check", [_k(k) for k in keys], timeout=timeout)
        return result

    async def close(self) -> None:
        """Close the connection; pending operations fail with :class:`StoreError`."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    async def __aenter__(self) -> StoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _k(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    return key


def _v(value: object) -> bytes:
    if not isinstance(value, bytes | bytearray):
        raise TypeError(f"value must be bytes, got {type(value).__name__}")
    return bytes(value)


class BlockingStoreClient:
    """:class:`StoreClient` for code without an event loop; runs a private loop per client.

    Not for use from inside a running event loop (``RuntimeError`` then).
    """

    def __init__(self, host: str, port: int, secret: bytes, *, timeout: float = 60.0) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._client = self._loop.run_until_complete(
                StoreClient.connect(host, port, secret, timeout=timeout))
        except BaseException:
            self._loop.close()
            raise

    def set(self, key: str, value: bytes) -> None:
        self._loop.run_until_complete(self._client.set(key, value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._loop.run_until_complete(self._client.get(key, timeout=timeout))

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        self._loop.run_until_complete(self._client.wait(keys, timeout))

    def add(self, key: str, amount: int = 1) -> int:
        return self._loop.run_until_complete(self._client.add(key, amount))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes | None:
        return self._loop.run_until_complete(self._client.compare_set(key, expected, desired))

    def check(self, keys: Iterable[str]) -> bool:
        return self._loop.run_until_complete(self._client.check(keys))

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def __enter__(self) -> BlockingStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
