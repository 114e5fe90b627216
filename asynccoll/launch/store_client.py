"""The clients of the rendezvous store: :class:`StoreClient` (asyncio) and its blocking twin.

Re-exported by :mod:`asynccoll.launch.store`; the protocol is described there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import AuthenticationError, StoreError, StoreTimeoutError
from ._store_wire import (
    _CLIENT_LABEL,
    _HANDSHAKE_MAX,
    _NONCE,
    _SERVER_LABEL,
    _VERSION,
    _check_secret,
    _mac,
    _pack,
    _read_frame,
)

__all__ = ["BlockingStoreClient", "StoreClient"]


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

    async def lease(self, key: str, value: bytes, *, timeout: float | None = None) -> bytes:
        """Set ``key`` to ``value`` iff it is absent, for as long as this connection lives: the
        server deletes it when the connection closes (the process died, or :meth:`close`).

        Returns the value ``key`` holds afterwards (``value`` when this client took it: make
        ``value`` unique to tell). Write a leased key only with ``lease``.
        """
        result: bytes = await self._call("lease", _k(key), _v(value), timeout=timeout)
        return result

    async def wait_gone(self, key: str, timeout: float | None = None) -> None:
        """Return once ``key`` is absent (at once if it is): a lease's holder is gone."""
        t = self.timeout if timeout is None else timeout
        await self._call("wait_gone", _k(key), t, timeout=t, keys=[key])

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
