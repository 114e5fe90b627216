"""A small authenticated TCP key-value store for the rendezvous (like a c10d ``TCPStore``).

:class:`StoreServer` runs on an asyncio loop (hosted by ``asynccoll run`` or by rank 0);
:class:`StoreClient` (in :mod:`.store_client`, re-exported here) talks to it. Operations:
``set``, ``get`` (waits for the key), ``wait``, ``add`` (an atomic counter), ``compare_set``,
``check``, ``lease`` (a key that lives as long as the connection that set it) and ``wait_gone``
(waits for a key to be deleted). Keys are ``str``, values ``bytes``.

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

**Strangers decide nothing.** Anyone who can reach the port can open connections and send
frames; the server cannot tell a stranger from a node with the wrong secret, so a refusal only
closes that one connection and is counted (:attr:`StoreServer.refusals`, by address); the node
with the wrong secret learns it from the ``denied`` answer and fails at once
(:class:`~asynccoll.AuthenticationError`), while whoever waits for genuine nodes keeps waiting.
Refusals are logged at most 10 lines per 10 s (then one line saying how many were held back),
like the transports'. At :meth:`StoreServer.start` the process's soft ``RLIMIT_NOFILE`` is raised
to the hard limit (as servers do) and :attr:`StoreServer.client_limit` is kept below the
descriptors that remain, so that a flood never makes ``accept`` fail (``EMFILE``, which would
stop the server accepting for a second). At the limit a new connection takes the place of the
oldest one still in its handshake (a genuine client authenticates in a millisecond; a stranger
that holds a connection open is the one closed), or is closed at once when every connection is
authenticated; connections in their handshake are bounded on their own too
(:attr:`StoreLimits.max_handshakes`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

from ..errors import StoreError, StoreTimeoutError
from ..transport.logbudget import LogBudget
from ._store_wire import _CLIENT_LABEL as _CLIENT_LABEL
from ._store_wire import (
    _HANDSHAKE_MAX,
    _NONCE,
    _SERVER_LABEL,
    _VERSION,
    _check_secret,
    _pack,
    _read_frame,
)
from ._store_wire import _mac as _mac
from .store_client import BlockingStoreClient, StoreClient

__all__ = [
    "BlockingStoreClient",
    "StoreClient",
    "StoreError",
    "StoreLimits",
    "StoreServer",
    "StoreTimeoutError",
]

log = logging.getLogger("asynccoll.launch.store")

@dataclass(frozen=True)
class StoreLimits:
    """Bounds the server enforces on its clients."""

    max_key_bytes: int = 1024
    max_value_bytes: int = 1 << 20
    max_keys: int = 1 << 16
    max_total_bytes: int = 256 << 20
    #: connections at once (authenticated or not); :meth:`StoreServer.start` lowers it to fit
    #: the descriptors that remain (:attr:`StoreServer.client_limit`)
    max_clients: int = 4096
    #: connections in their handshake at once; past it the oldest is closed
    max_handshakes: int = 256
    #: descriptors left free for the rest of the process (a launcher's pipes to its ranks) and
    #: for the connections one ``accept`` round takes before the server sees them (up to 100)
    spare_descriptors: int = 256
    max_wait_keys: int = 65536
    max_waits_per_client: int = 1024
    #: a client whose unread responses exceed this is disconnected rather than buffered
    max_write_buffer: int = 64 << 20
    handshake_timeout: float = 10.0


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
        # waiters for a key's deletion, and which connection holds each leased key
        self._gone: dict[str, list[asyncio.Future[None]]] = {}
        self._lease_holder: dict[str, asyncio.Task[None]] = {}
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        # connections in their handshake, oldest first (the first to go when the store is full)
        self._handshaking: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        #: connections at once; set by :meth:`start` (see the module doc)
        self.client_limit = self.limits.max_clients
        #: connections refused (failed or unfinished handshakes, no room), by remote address
        self.refusals: dict[str, int] = {}
        self._log_budget = LogBudget()

    @property
    def address(self) -> str:
        """``host:port`` as bound."""
        return f"{self.host}:{self.port}"

    async def start(self) -> StoreServer:
        """Bind and start serving; raise ``OSError`` if the address is taken.

        Raises the soft ``RLIMIT_NOFILE`` to the hard limit and sets :attr:`client_limit`.
        """
        self.client_limit = client_limit(self.limits)
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
        if len(self._conns) >= self.client_limit or \
                len(self._handshaking) >= self.limits.max_handshakes:
            if not self._handshaking:  # every connection is a genuine client's: no room
                self._refuse(peer, f"{len(self._conns)} clients already (the limit)")
                writer.transport.abort()
                return
            old = self._handshaking.pop(next(iter(self._handshaking)))
            old.transport.abort()
            self._refuse(old.get_extra_info("peername"), "closed to make room: still in its "
                         "handshake when the store was full")
        self._conns.add(task)
        self._handshaking[task] = writer
        waits: set[asyncio.Task[None]] = set()
        try:
            authed = await self._handshake(reader, writer, peer)
            self._handshaking.pop(task, None)
            if not authed:
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
            self._release(task)
            self._conns.discard(task)
            self._handshaking.pop(task, None)
            writer.close()

    def _refuse(self, peer: object, reason: str) -> None:
        """Count a refused connection by its address; log it within the log budget."""
        host = peer[0] if isinstance(peer, tuple) and peer else str(peer)
        if host in self.refusals or len(self.refusals) < 64:
            self.refusals[host] = self.refusals.get(host, 0) + 1
        else:
            self.refusals["(other addresses)"] = self.refusals.get("(other addresses)", 0) + 1
        say, quiet = self._log_budget.take(asyncio.get_running_loop().time())
        if say:
            more = f" ({quiet} more refused, not logged)" if quiet else ""
            log.warning("store: refusing %s: %s%s", peer, reason, more)

    def refusal_summary(self) -> str:
        """``"3 connections (127.0.0.1 x3)"``: the refusals so far, for a waiting launcher."""
        total = sum(self.refusals.values())
        where = ", ".join(f"{h} x{n}" for h, n in sorted(self.refusals.items(),
                                                          key=lambda kv: -kv[1])[:8])
        more = ", ..." if len(self.refusals) > 8 else ""
        return f"{total} connection{'s' if total != 1 else ''} ({where}{more})"

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         peer: object) -> bool:
        nonce_s = secrets.token_bytes(_NONCE)
        writer.write(_pack(["hello", _VERSION, nonce_s]))
        try:
            msg = await asyncio.wait_for(_read_frame(reader, _HANDSHAKE_MAX),
                                         self.limits.handshake_timeout)
        except TimeoutError:
            self._refuse(peer, f"no handshake in {self.limits.handshake_timeout:.0f} s")
            return False
        except StoreError as exc:  # an over-long or malformed frame
            self._refuse(peer, f"malformed handshake: {exc}")
            return False
        ok = (isinstance(msg, list) and len(msg) == 3 and msg[0] == "auth"
              and isinstance(msg[1], bytes) and len(msg[1]) == _NONCE
              and isinstance(msg[2], bytes))
        if ok and hmac.compare_digest(msg[2], _mac(self._secret, _CLIENT_LABEL, nonce_s, msg[1])):
            writer.write(_pack(["ok", _mac(self._secret, _SERVER_LABEL, msg[1], nonce_s)]))
            return True
        # A stranger's random MAC and a node with the wrong secret look the same: the refusal
        # closes this connection and is counted, nothing more (the module doc).
        reason = "wrong secret" if ok else "malformed handshake"
        self._refuse(peer, reason)
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
            if op in ("wait", "get", "wait_gone"):
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
        if op == "lease":
            key, desired = self._key(args[0]), self._value(args[1])
            current = self._data.get(key)
            if current is not None:
                return current
            self._put(key, desired)
            task = asyncio.current_task()
            assert task is not None  # _apply runs in the connection's task
            self._lease_holder[key] = task
            return desired
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

    def _release(self, conn: asyncio.Task[None]) -> None:
        """Delete the keys that connection ``conn`` leased (it closed), waking their
        ``wait_gone`` waiters."""
        for key in [k for k, holder in self._lease_holder.items() if holder is conn]:
            del self._lease_holder[key]
            value = self._data.pop(key, None)
            if value is not None:
                self._bytes -= len(value) + len(key)
            for fut in self._gone.pop(key, ()):
                if not fut.done():
                    fut.set_result(None)

    async def _wait(self, rid: int, op: str, keys: list[str], timeout: float,
                    writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        gone = op == "wait_gone"
        waiters = self._gone if gone else self._waiters
        for key in keys:
            while (key in self._data) is gone:
                left = deadline - loop.time()
                if left <= 0:
                    missing = [k for k in keys if (k in self._data) is gone]
                    self._reply(writer, rid, False, ["timeout", missing])
                    return
                fut = loop.create_future()
                waiters.setdefault(key, []).append(fut)
                try:
                    await asyncio.wait_for(fut, left)
                except TimeoutError:
                    pass
                finally:
                    lst = waiters.get(key)
                    if lst is not None and fut in lst:
                        lst.remove(fut)
                        if not lst:
                            del waiters[key]
        self._reply(writer, rid, True, self._data[keys[0]] if op == "get" else None)


def client_limit(limits: StoreLimits) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (as servers do) and return how many
    connections fit in the descriptors that remain: ``limits.max_clients`` at most, leaving
    ``limits.spare_descriptors`` free, and at least 16."""
    try:
        import resource
    except ImportError:  # not a Unix: no descriptor limit to raise
        return limits.max_clients
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # a hard limit the kernel refuses as soft
            log.debug("store: cannot raise RLIMIT_NOFILE to %s: %s", hard, exc)
    if soft == resource.RLIM_INFINITY:
        return limits.max_clients
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 64
    return max(16, min(limits.max_clients, soft - in_use - limits.spare_descriptors))
