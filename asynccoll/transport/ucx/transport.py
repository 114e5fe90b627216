"""``ucx://host:port``: point-to-point messaging over UCX, through the ``ucxx`` package.

Install with ``pip install 'asynccoll[ucx]'``; ``ucxx`` is imported when a :class:`UcxTransport`
is created, never when this module is merely imported.

Design (the reasons are measured; see ``docs/transports.md``):

* **One UCX context and worker per transport**, owned by it and destroyed by :meth:`close`; no
  process-wide state, so several transports (ranks) can share a process, as tests do.
* **Event-driven progress on the caller's event loop** (UCX "blocking" mode): the worker's
  wake-up file descriptor is registered with the loop; on an event, or after new operations are
  posted, the worker is progressed until it can be re-armed (yielding to the loop every few
  rounds while UCX stays busy), and the finished requests are reaped. Nothing polls or spins;
  an idle transport costs no CPU but a watchdog timer that fires every half second (ucxx
  documents that a wake-up can be missed). ``ucxx``'s own ``thread`` mode was 5-6x slower on
  two cores and its request waits spin on the loop, which is why this module drives the worker
  itself.
* **Wire format**: per pair of ranks one UCX endpoint (the lower rank dials), authenticated by
  the job-secret handshake of :mod:`asynccoll.transport.auth` over the endpoint's stream
  channel, in which each side also chooses the two 64-bit tags its peer sends to it with. A
  frame is a tag message with a 3-byte prefix (header length, flags) and the msgpack header,
  followed, unless the payload is small enough to ride inline in that same message, by the
  payload as a second tag message (tag messages beat active messages here: an active message
  lands in a buffer UCX allocates, one more copy for large payloads). UCX matches messages of
  one sender and tag in order, and every rank keeps one receive of headers posted per peer, so
  frames with one key arrive in order. Payloads land straight in the destination (device
  memory for CuPy destinations); payloads of unknown length get a buffer sized by the header.
* **Shared memory** (opt-in, ``shared_memory=True``): endpoints with error handling never use
  UCX's shared-memory transports, so between ranks on one host frames go over a second
  endpoint, made from the peer's worker address without error handling, while the first one
  keeps watching for peer failure.
* **Failures**: UCX endpoint errors (peer gone, connection reset, cancelled requests) become
  :class:`PeerLostError` for that rank, with the UCX exception chained, and fail every pending
  operation that needs the rank. A peer that fails the handshake, sends a malformed frame or
  exceeds the limits is disconnected with a logged reason. :meth:`UcxTransport.close` says
  goodbye first, so that frames already sent are read and peers learn of an orderly close.

The machinery under it lives beside it: :mod:`.progress` (the event-loop progress engine),
:mod:`.handshake` (authentication and what a connection settles), :mod:`.library` (the lazy
``ucxx`` import and the UCX settings of each context), :mod:`.device` (CuPy memory views).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import struct
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ...buffers import as_bytes, is_cupy
from ...errors import (
    AuthenticationError,
    PeerLostError,
    ProtocolError,
    TransportClosedError,
    TransportError,
)
from .. import auth
from ..base import Transport, lost
from ..frames import Header, Limits, Message, decode_header, encode_header
from ..logbudget import LogBudget
from ..matching import HeldOrder, Slot
from ..registry import parse_address
from .device import DeviceView, byte_view, target
from .handshake import Link, handshake_acceptor, handshake_connector
from .library import context_options, load
from .progress import Progress

__all__ = ["PREFIX", "PROGRESS_MODES", "UcxTransport"]

log = logging.getLogger("asynccoll.transport.ucx")

#: progress modes this transport implements (see the module docstring for why only this one)
PROGRESS_MODES = ("blocking",)

#: what a header message starts with: (header length, flags); then the msgpack header
PREFIX = struct.Struct("<HB")
_INLINE = 1  # flag: the payload follows the header in the same message
_BYE = 2  # flag, no header: the sender is closing; nothing follows
_BYE_ACK = 4  # flag, no header: the answer to _BYE, sent after every frame before it was read
# A header message stays below UCX's rendezvous threshold (ucxx sets 8 KiB) so that it travels
# in one eager message; payloads that fit travel with it and cost one small copy at the receiver.
_EAGER_BYTES = 8192
_CLOSE_S = 0.5  # how long close() lets the endpoint closes progress
_CLOSE_NS = 100_000_000  # how long cancelling in-flight requests may take


class _Peer:
    """One authenticated endpoint and the tags of its two directions."""

    __slots__ = (
        "acked",
        "ep",
        "harr",
        "hbuf",
        "lost",
        "rank",
        "recv_htag",
        "recv_ptag",
        "send_htag",
        "send_ptag",
        "sends",
        "tx",
    )

    def __init__(self, rank: int, ep: Any, tx: Any, recv_base: int, send_base: int,
                 hbytes: int) -> None:
        tag = load().Tag
        self.rank = rank
        self.ep = ep  # authenticated, error-handled: receives, and failure detection
        self.tx = tx  # sends: ``ep``, or a shared-memory endpoint to the same peer
        self.sends: set[_Send] = set()
        self.recv_htag, self.recv_ptag = tag(recv_base), tag(recv_base + 1)
        self.send_htag, self.send_ptag = tag(send_base), tag(send_base + 1)
        self.hbuf = bytearray(hbytes)
        self.harr = load().Array(self.hbuf)
        self.lost: BaseException | None = None
        self.acked = False


class UcxTransport(Transport):
    """One rank's UCX endpoint set.

    ``secret``: the job secret (at least 16 bytes) every connection must prove knowledge of.
    ``progress_mode``: ``"blocking"`` (the default and only mode; see the module docstring).
    ``ucx_options``: UCX configuration for this transport's context, without the ``UCX_``
    prefix (``{"TLS": "tcp,self"}``), over :data:`.library.DEFAULT_OPTIONS`; both override the
    environment variables ``UCX_*``.
    ``shared_memory``: between two ranks on one host that both ask for it, frames travel over a
    second endpoint made from the peer's UCX worker address without endpoint error handling, on
    which UCX picks shared memory (sysv/posix, and cma for large messages) instead of TCP; the
    authenticated, error-handled endpoint stays open to detect a failed peer. Off by default:
    ucxx documents that an error on an endpoint without error handling may terminate the
    process, so a peer dying mid-transfer is a risk the job must accept.
    ``handshake_timeout``: seconds an accepted connection may take to authenticate.

    The transport must be used from one event loop; ``listen`` and ``connect`` bind it to the
    running loop. :meth:`listen` defaults to ``ucx://127.0.0.1:0`` (port 0: a free one); UCX
    listens on every interface and the host given is the one published; it raises
    :class:`TransportError` when UCX cannot listen (the port is taken, say). Connections: the
    lower rank of each pair dials the higher one (as tcp://), retrying until the deadline;
    a process taking a lost rank's place dials every member (:meth:`rejoin`), and a member
    that lost that rank and admits rejoins takes the dial from above too, closing the lost
    process's endpoints.
    """

    scheme = "ucx"
    supports_device: ClassVar[bool] = True

    def __init__(self, rank: int, world_size: int, *, secret: bytes, limits: Limits | None = None,
                 progress_mode: str | None = None, ucx_options: Mapping[str, str] | None = None,
                 shared_memory: bool = False, handshake_timeout: float = 10.0) -> None:
        super().__init__(rank, world_size, limits=limits)
        self._secret = auth.check_secret(secret)
        mode = "blocking" if progress_mode is None else progress_mode
        if mode not in PROGRESS_MODES:
            raise ValueError(f"progress_mode must be one of {PROGRESS_MODES}, got {mode!r}")
        self._options = context_options(ucx_options)
        if handshake_timeout <= 0:
            raise ValueError(f"handshake_timeout must be > 0, got {handshake_timeout}")
        load()
        self.progress_mode = mode
        self.shared_memory = bool(shared_memory)
        self._handshake_timeout = handshake_timeout
        self._hbytes = PREFIX.size + self.limits.max_header_bytes + _EAGER_BYTES
        self._address = ""
        self._context: Any = None
        self._worker: Any = None
        self._listener: Any = None
        self._progress: Progress | None = None
        self._peers: dict[int, _Peer] = {}
        #: ranks lost here that have no peer entry: vacant (:meth:`vacate`) or that this
        #: process's rejoin could not reach; taken in when a process of theirs dials in
        self._unpeered: set[int] = set()
        self._refusals = LogBudget()  # a flood of refused dials must not flood the log
        self._arrived: asyncio.Event | None = None
        self._bye_event = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._dropped: list[Any] = []
        self._order = HeldOrder(self.matcher.complete)
        self._on_send_error = self._send_failed  # bound once, not per send: each _Send holds it
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- setup -------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self._address

    @property
    def ucx_config(self) -> dict[str, str]:
        """The UCX configuration in force for this transport's context (after :meth:`listen`)."""
        if self._context is None:
            raise TransportClosedError("listen() or connect() first")
        return dict(self._context.config)

    def _start(self) -> Progress:
        if self._closed:
            raise TransportClosedError("transport closed")
        if self._progress is None:
            lib = load().lib
            self._loop = asyncio.get_running_loop()
            self._context = lib.UCXContext(self._options)
            self._worker = lib.UCXWorker(self._context)
            self._progress = Progress(self._worker, self._loop)
            self._arrived = asyncio.Event()
        elif asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("a UcxTransport must be used from the loop that started it")
        return self._progress

    async def _listen(self, address: str | None) -> str:
        # UCX listens on every interface of the host; ``host`` is the address published
        address = address or "ucx://127.0.0.1:0"
        host, port = _split(address, "address")
        self._start()
        lib = load().lib
        try:
            self._listener = lib.UCXListener.create(
                self._worker, port, self._on_conn_request, deliver_endpoint=False)
        except Exception as exc:  # ucxx's errors (port in use, no device) are not OSErrors
            raise TransportError(f"cannot listen on {address}: {exc}") from exc
        if host in ("", "0.0.0.0"):
            host = self._listener.ip
        host = f"[{host}]" if ":" in host else host  # an IPv6 literal
        self._address = f"ucx://{host}:{self._listener.port}"
        return self._address

    async def _connect(self, peers: Mapping[int, str], timeout: float) -> None:
        # Ranks above this one are dialled (retrying with backoff until the deadline); ranks
        # below connect to us, and this waits for them.
        self._start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        dials = []
        for rank, addr in peers.items():
            _split(addr, f"peer {rank} address")
            if rank in self._peers:
                continue
            if rank > self.rank:
                dials.append(self._dial(rank, addr, deadline))
        if dials:
            await asyncio.gather(*dials)
        assert self._arrived is not None
        while True:
            missing = [r for r in peers if r != self.rank and r not in self._peers]
            if not missing:
                return
            left = deadline - loop.time()
            if left <= 0:
                raise PeerLostError(missing[0], f"did not connect within {timeout} s "
                                    f"(waiting for ranks {missing})")
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def _dial(self, rank: int, address: str, deadline: float) -> None:
        host, port = _split(address, f"peer {rank} address")
        loop = asyncio.get_running_loop()
        lib = load().lib
        delay = 0.01
        while True:
            ep = None
            try:
                ep = lib.UCXEndpoint.create(self._worker, host, port, True)
                assert self._progress is not None
                link = await handshake_connector(self._progress, ep, self._secret, self.rank,
                                                 rank, self.world_size, self._offer(), deadline,
                                                 self.incarnation)
                self._add_peer(ep, link)
                return
            except AuthenticationError:
                self._drop_ep(ep)
                raise
            except (Exception, asyncio.TimeoutError) as exc:
                if ep is not None:
                    self._drop_ep(ep)
                if self._closed:
                    raise TransportClosedError("transport closed while connecting") from exc
                if loop.time() + delay >= deadline:
                    raise lost(rank, f"could not connect to {address}: {exc!r}", exc) from exc
                log.debug("rank %d: connecting to rank %d at %s: %r; retrying", self.rank, rank,
                          address, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _on_conn_request(self, conn_request: Any) -> None:
        # Called by UCX from inside worker progress: create the endpoint now, talk later.
        if self._closed:
            return
        try:
            ep = self._listener.create_endpoint_from_conn_request(conn_request, True)
        except Exception as exc:  # a connection that failed before it was accepted
            log.warning("rank %d: could not accept a connection: %r", self.rank, exc)
            return
        assert self._loop is not None
        task = self._loop.create_task(self._accept(ep))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, ep: Any) -> None:
        deadline = asyncio.get_running_loop().time() + self._handshake_timeout

        def admit(link: Link) -> None:
            old = self._peers.get(link.peer)
            if old is not None:
                if old.lost is not None and not self.admit_rejoins:
                    raise AuthenticationError(
                        f"rank {link.peer} was lost, and this job does not admit restarted "
                        "ranks (asynccoll run --max-restarts)")
                if not self.may_rejoin(link.peer):
                    raise AuthenticationError(f"rank {link.peer} is already connected")
                self._retire(old)
            elif link.peer in self._unpeered and not self.admit_rejoins:
                raise AuthenticationError(f"rank {link.peer} is vacant, and this job does not "
                                          "admit new ranks")
            unpeered = link.peer in self._unpeered
            self._unpeered.discard(link.peer)
            self._add_peer(ep, link)
            if old is not None or unpeered:  # a new process in a lost (or vacant) rank's place
                self._peer_joined(link.peer)

        try:
            assert self._progress is not None
            await handshake_acceptor(self._progress, ep, self._secret, self.rank,
                                     self.world_size, self._offer(), deadline, admit,
                                     self.may_rejoin, self.incarnation)
        except (Exception, asyncio.TimeoutError) as exc:
            say, quiet = self._refusals.take(asyncio.get_running_loop().time())
            if not self._closed and say:
                more = f" ({quiet} more refused, not logged)" if quiet else ""
                log.warning("rank %d: refused a connection: %s%s", self.rank,
                            exc if isinstance(exc, AuthenticationError) else repr(exc), more)
            if not any(p.ep is ep for p in self._peers.values()):
                self._drop_ep(ep)

    def _vacate(self, rank: int, exc: PeerLostError) -> bool:
        if rank in self._peers:
            return False
        self._unpeered.add(rank)
        self.matcher.fail_peer(rank, exc)
        return True

    def may_rejoin(self, rank: int) -> bool:
        """Whether a new process may take ``rank``'s place here: rejoins are admitted
        (:attr:`admit_rejoins`) and this transport lost ``rank``."""
        p = self._peers.get(rank)
        return self.admit_rejoins and ((p is not None and p.lost is not None)
                                       or (p is None and rank in self._unpeered))

    def _retire(self, p: _Peer) -> None:
        """A lost peer's endpoints, closed for the new process that takes its place (what
        they still had in flight failed when it was lost)."""
        self._fail_sends(p, p.lost or PeerLostError(p.rank, "replaced"))
        if p.tx is not p.ep:
            self._drop_ep(p.tx)
        self._drop_ep(p.ep)
        del self._peers[p.rank]

    async def _rejoin(self, peers: Mapping[int, str], timeout: float) -> list[int]:
        # A process taking a lost rank's place dials every peer, whatever its rank (an
        # acceptor of lower rank admits it because it lost this rank: may_rejoin). A member
        # that has not noticed the loss yet refuses: retried until the deadline. A peer that
        # is itself restarting and of lower rank refuses a dial from above and dials this one
        # (lower dials higher, as always), which ends the dial loop here. As tcp's (tcp.py).
        self._start()
        return await self._dial_every(peers, timeout, self._dial_rejoin)

    async def _dial_rejoin(self, rank: int, address: str, deadline: float) -> bool:
        host, port = _split(address, f"peer {rank} address")
        loop = asyncio.get_running_loop()
        lib = load().lib
        delay = 0.01
        while rank not in self._peers:
            ep = None
            try:
                ep = lib.UCXEndpoint.create(self._worker, host, port, True)
                assert self._progress is not None
                # each try bounded by the handshake time: a process that is exiting may still
                # accept a connection and never answer it
                step = min(deadline, loop.time() + self._handshake_timeout)
                link = await handshake_connector(self._progress, ep, self._secret, self.rank,
                                                 rank, self.world_size, self._offer(), step,
                                                 self.incarnation)
                if rank in self._peers:  # it dialled this rank meanwhile
                    self._drop_ep(ep)
                    return True
                self._add_peer(ep, link)
                if rank in self._unpeered:  # reached at a later try (a new address)
                    self._unpeered.discard(rank)
                    self._peer_joined(rank)
                return True
            except (Exception, asyncio.TimeoutError) as exc:
                if ep is not None:
                    self._drop_ep(ep)
                if self._closed:
                    raise TransportClosedError("transport closed while rejoining") from exc
                if rank in self._peers:
                    return True
                if loop.time() + delay >= deadline:
                    err = lost(rank, f"did not admit this rank within the rejoin timeout "
                                     f"({exc!r})", exc)
                    self.matcher.fail_peer(rank, err)
                    self._unpeered.add(rank)
                    return False
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.5)
        return True

    def _offer(self) -> bytes:
        """Our worker address when we offer a shared-memory endpoint, else nothing."""
        return bytes(self._worker.address.tobytes()) if self.shared_memory else b""

    def _add_peer(self, ep: Any, link: Link) -> None:
        tx = ep
        if self.shared_memory and link.peer_address and link.same_host:
            lib = load().lib
            tx = self._worker.create_endpoint_from_worker_address(
                lib.UCXAddress.create_from_buffer(link.peer_address), False)
        p = _Peer(link.peer, ep, tx, link.recv_base, link.send_base, self._hbytes)
        self._peers[link.peer] = p
        self._peer_incarnation(link.peer, link.incarnation)
        ep.set_close_callback(self._on_ep_error, (link.peer, ep))
        self._post_header_recv(p)
        if self._arrived is not None:
            self._arrived.set()

    def _drop_ep(self, ep: Any) -> None:
        # Closing an endpoint twice, or one that UCX already closed on an error, crashes the
        # process: remember what was closed (which also keeps it alive while it closes).
        if any(e is ep for e in self._dropped):
            return
        self._dropped.append(ep)
        try:
            if ep.alive:
                ep.close()
        except Exception as exc:  # closing a failed endpoint may itself report the failure
            log.debug("closing a UCX endpoint: %r", exc)

    # -- receiving ---------------------------------------------------------------------------
    def _post_header_recv(self, p: _Peer) -> None:
        if p.acked or not p.ep.alive or self._progress is None or self._progress.stopped:
            return
        assert self._progress is not None
        self._progress.watch(p.ep.tag_recv(p.harr, p.recv_htag),
                             functools.partial(self._on_header, p))

    def _on_header(self, p: _Peer, exc: BaseException | None) -> None:
        if exc is not None:
            self._lose(p, "receive failed", exc)
            return
        raw = memoryview(p.hbuf)
        hlen, flags = PREFIX.unpack_from(raw)
        if flags & (_BYE | _BYE_ACK) and not hlen:
            self._on_bye(p, flags)
            return
        start = PREFIX.size + hlen
        try:
            if start > len(raw):
                raise ProtocolError(f"header length {hlen} exceeds the message")
            h = decode_header(raw[PREFIX.size:start], self.world_size, self.limits)
            if h.src != p.rank:
                raise ProtocolError(f"frame claims source rank {h.src}")
            if flags & _INLINE and start + h.length > len(raw):
                raise ProtocolError(f"inline payload of {h.length} bytes exceeds the message")
            slot = self.matcher.begin(h)
        except ProtocolError as err:
            self._disconnect(p, err)
            return
        if flags & _INLINE or not h.length:
            if h.length:
                slot.view[:] = raw[start:start + h.length]
            self._order.done(slot, None)
        else:
            entry = self._order.reserve(slot)
            assert self._progress is not None
            # The Array must outlive the request (UCX writes through it): the callback holds it.
            arr = load().Array(target(slot.view))
            req = p.ep.tag_recv(arr, p.recv_ptag)
            self._progress.watch(req, functools.partial(self._on_payload, p, slot, entry, arr))
        self._post_header_recv(p)

    def _on_bye(self, p: _Peer, flags: int) -> None:
        if flags & _BYE_ACK:
            p.acked = True
            self._bye_event.set()
            return
        # Every frame the peer sent before its goodbye has been read: answer, then forget it.
        self._send_control(p, _BYE_ACK)
        self._lose(p, "peer closed", None)
        self._post_header_recv(p)  # our own goodbye's answer may still come

    def _send_control(self, p: _Peer, flags: int) -> None:
        msg = PREFIX.pack(0, flags)
        arr = load().Array(msg)
        assert self._progress is not None
        self._progress.watch(p.tx.tag_send(arr, p.send_htag), functools.partial(_ignore, arr))

    def _on_payload(self, p: _Peer, slot: Slot, entry: list[Any] | None, _arr: Any,
                    exc: BaseException | None) -> None:
        if exc is None:
            self._order.done(slot, entry)
            return
        if entry is not None:
            self._order.done(slot, entry, lost=True)
        self.matcher.abandon(slot)
        err = self._map(p.rank, "payload receive failed", exc)
        if slot.posted is not None and not slot.posted.fut.done():
            slot.posted.fut.set_exception(err)
        self._lose(p, "payload receive failed", exc)

    def _post_recv(self, src: int, sched: int, execution: int, tag: int,
                   buf: Any) -> asyncio.Future[Message]:
        # ``buf`` may also be a CuPy array: the payload lands in device memory
        if is_cupy(buf):
            view: Any = DeviceView(byte_view(buf, "receive buffer"))
            return self.matcher.post(src, sched, execution, tag, view)
        return super()._post_recv(src, sched, execution, tag, buf)

    # -- sending -----------------------------------------------------------------------------
    def _send_view(self, payload: Any) -> Any:
        if is_cupy(payload):
            return byte_view(payload, "payload")  # sent from device memory
        return as_bytes(payload, "payload")

    def _post_send(self, dst: int, header: Header, payload: Any) -> asyncio.Future[None]:
        # The future resolves once UCX no longer needs ``payload``. Payloads up to about 8 KiB
        # are copied into the header message; larger ones (and device memory) go as a second
        # message straight from ``payload``.
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        p = self._peers.get(dst)
        if p is None or p.lost is not None:
            fut.set_exception(p.lost if p is not None and p.lost is not None
                              else PeerLostError(dst, "not connected"))
            return fut
        device = type(payload) is not memoryview and is_cupy(payload)
        if device:
            # CuPy's kernels run asynchronously: the ones that wrote ``payload`` (a reduction,
            # the snapshot's copies, the caller's own) may still be running when UCX reads it.
            # The first GPU run over ucx read such buffers early (ranks disagreed on a partial
            # handle's signature, a synchronous allreduce failed). Wait for the device first.
            payload.device.synchronize()
        enc = encode_header(header)
        size = PREFIX.size + len(enc)
        inline = not device and size + header.length <= _EAGER_BYTES
        if inline:
            msg = b"".join((PREFIX.pack(len(enc), _INLINE), enc, payload))
        else:
            msg = PREFIX.pack(len(enc), 0) + enc
        arr = load().Array
        assert self._progress is not None
        two = not inline and header.length > 0
        # UCX reads through the Arrays (and their buffers) until the requests complete: a
        # collected Array crashes the process, so the _Send holds them.
        arrs: tuple[Any, ...] = (arr(msg), arr(payload)) if two else (arr(msg),)
        done = _Send(self._on_send_error, p, fut, len(arrs), (msg, payload, arrs))
        p.sends.add(done)
        self._progress.watch(p.tx.tag_send(arrs[0], p.send_htag), done)
        if two:
            self._progress.watch(p.tx.tag_send(arrs[1], p.send_ptag), done)
        return fut

    def _copy_into(self, slot: Slot, payload: Any) -> None:
        if not is_cupy(payload):
            super()._copy_into(slot, payload)
            return
        view = slot.view
        if isinstance(view, DeviceView):
            view.array[...] = payload
        else:
            view[:] = payload.get().data

    # -- failures and closing ----------------------------------------------------------------
    def _map(self, rank: int, reason: str, exc: BaseException) -> BaseException:
        if self._closed:
            return TransportClosedError("transport closed")
        if isinstance(exc, (PeerLostError, TransportClosedError)):
            return exc
        return lost(rank, f"{reason}: {exc}", exc)

    def _send_failed(self, p: _Peer, exc: BaseException) -> BaseException:
        err = self._map(p.rank, "send failed", exc)
        self._lose(p, "send failed", exc)
        return err

    def _on_ep_error(self, rank: int, ep: Any = None) -> None:
        # Called by UCX (inside progress) when the endpoint fails or is closed (``ep``: which;
        # a lost peer's old endpoint may report after a new process took its place).
        p = self._peers.get(rank)
        if p is None or p.lost is not None or (ep is not None and p.ep is not ep):
            self._bye_event.set()
            return
        cause: BaseException = ConnectionError("UCX endpoint closed")
        try:
            p.ep.raise_on_error()
        except Exception as exc:  # the ucxx error that closed the endpoint
            cause = exc
        self._lose(p, "endpoint error", cause)

    def _lose(self, p: _Peer, reason: str, cause: BaseException | None) -> None:
        if self._closed:
            self._bye_event.set()
            return
        if p.lost is not None:
            return
        exc = PeerLostError(p.rank, reason) if cause is None else self._map(p.rank, reason, cause)
        p.lost = exc
        log.info("rank %d: lost rank %d: %s", self.rank, p.rank, exc)
        self._peer_lost(p.rank, exc)
        # Sends on a shared-memory endpoint (no error handling) would never learn of it; fail
        # what is still in flight once the completions UCX already has are reaped.
        assert self._loop is not None
        self._loop.call_soon(self._fail_sends, p, exc)

    def _fail_sends(self, p: _Peer, exc: BaseException) -> None:
        if self._progress is not None:
            self._progress.run()
        sends, p.sends = p.sends, set()
        for snd in sends:
            if not snd.fut.done():
                snd.fut.set_exception(exc)

    def _drop_peer(self, rank: int, exc: BaseException) -> None:
        p = self._peers.get(rank)
        if p is None or p.lost is not None:
            return
        if isinstance(exc, ProtocolError):
            self._disconnect(p, exc)
            return
        log.warning("rank %d: disconnecting rank %d: %s", self.rank, rank, exc)
        self._lose(p, str(exc), exc)
        self._drop_ep(p.ep)

    def _disconnect(self, p: _Peer, err: ProtocolError) -> None:
        """Close the connection of a peer that broke the protocol; log the reason (once: its
        frames already in flight are refused quietly)."""
        if p.lost is None:
            log.warning("rank %d: disconnecting rank %d: %s", self.rank, p.rank, err)
        self._lose(p, "protocol error", err)
        self._drop_ep(p.ep)

    async def _close(self) -> None:
        # Every endpoint, the listener, the worker and the context. Takes a few round trips,
        # at most 0.5 s when peers do not answer.
        exc = TransportClosedError("transport closed")
        for t in list(self._tasks):
            t.cancel()
        self._listener = None
        prog = self._progress
        if prog is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + _CLOSE_S
            # Say goodbye and wait for the answers: UCX keeps a peer's messages in order, so an
            # answer proves that everything sent before it was read, and the peers learn that
            # this rank closed (rather than failed).
            live = [p for p in self._peers.values() if p.lost is None and p.ep.alive]
            for p in live:
                self._send_control(p, _BYE)
            while True:
                waiting = [p for p in live if not p.acked and p.ep.alive]
                if not waiting or loop.time() >= deadline:
                    break
                self._bye_event.clear()
                try:
                    await asyncio.wait_for(self._bye_event.wait(), deadline - loop.time())
                except asyncio.TimeoutError:
                    break
            # What UCX may still read or write stays referenced until its requests are cancelled.
            inflight = list(prog.pending)
            prog.fail_all(exc)
            shm = [p.tx for p in self._peers.values() if p.tx is not p.ep]
            for p in self._peers.values():
                self._drop_ep(p.ep)
            for ep in shm:
                self._drop_ep(ep)
            # Progress the closes for a moment so that peers learn of them now rather than
            # from a keep-alive timeout (endpoints without error handling may never report).
            eps = [e for e in self._dropped if not any(e is t for t in shm)]
            while any(ep.alive for ep in eps) and loop.time() < deadline:
                prog.kick()
                await asyncio.sleep(0.002)
            prog.stop(exc)
            self._worker.cancel_inflight_requests(period=_CLOSE_NS, max_attempts=1)
            inflight.clear()
        self._peers.clear()
        self._dropped = []
        self._progress = None
        self._worker = None
        self._context = None


class _Send:
    """Completion of one frame's one or two UCX sends; holds the buffers UCX reads until then.

    ``failed(peer, exc)`` retires the peer after a failed send and returns the error for ``fut``.
    """

    __slots__ = ("failed", "fut", "keep", "left", "peer")

    def __init__(self, failed: Callable[[_Peer, BaseException], BaseException], peer: _Peer,
                 fut: asyncio.Future[None], left: int, keep: tuple[Any, ...]) -> None:
        self.failed = failed
        self.peer = peer
        self.fut = fut
        self.left = left
        self.keep = keep

    def __call__(self, exc: BaseException | None) -> None:
        self.left -= 1
        if self.left <= 0:
            self.peer.sends.discard(self)
        if self.fut.done():
            return
        if exc is not None:
            self.fut.set_exception(self.failed(self.peer, exc))
        elif self.left == 0:
            self.fut.set_result(None)
            self.keep = ()


def _split(address: str, what: str) -> tuple[str, int]:
    """(host, port) of ``ucx://HOST:PORT``; ``ValueError`` naming ``what`` otherwise."""
    scheme, loc = parse_address(address)
    host, sep, port = loc.rpartition(":")
    if scheme != "ucx" or not sep or not host or not port.isdigit():
        raise ValueError(f"{what} must look like ucx://HOST:PORT, got {address!r}")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 literal
        host = host[1:-1]
    return host, int(port)


def _ignore(_keep: Any, _exc: BaseException | None) -> None:
    """Completion of a control message: nothing to do (``_keep`` holds its buffer till now)."""
