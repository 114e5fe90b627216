"""The authenticating handshake of ``ucx://``, over a UCX endpoint's stream channel.

It is :mod:`asynccoll.transport.auth`'s handshake (both sides prove knowledge of the job secret)
followed by what the two ends settle for the connection (:class:`Link`): the tag bases each side
sends with, the shared-memory offers and the hosts' identities.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import socket
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

from ...errors import AuthenticationError
from .. import auth
from .library import load
from .progress import Progress

__all__ = ["Link", "handshake_acceptor", "handshake_connector", "host_id", "stream_io",
           "tag_base"]

# after the proofs: the tag base the peer sends to us with, the length of the sender's UCX
# worker address (0: no shared-memory endpoint offered) and the sender's host identity
_TAIL = struct.Struct("<QH16s")


@functools.cache
def host_id() -> bytes:
    """16 bytes that differ between hosts (name and boot), equal for ranks on one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read()
    except OSError:
        boot = b""
    return hashlib.blake2b(socket.gethostname().encode() + boot, digest_size=16).digest()


def tag_base() -> int:
    """A random even 64-bit tag: frames to us use it for headers and it + 1 for payloads."""
    return int.from_bytes(os.urandom(8), "little") & ~1


async def stream_io(progress: Progress, op: Callable[[Any], Any], buf: bytes | bytearray,
                    deadline: float) -> None:
    """Run one UCX stream operation on ``buf``; wait for it until ``deadline`` (loop time).

    Raises ``TimeoutError`` or the ucxx error.
    """
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    arr = load().Array(buf)
    req = op(arr)

    def done(exc: BaseException | None) -> None:
        del keep[:]  # UCX reads or writes ``buf`` until here
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    keep = [arr, buf]
    progress.watch(req, done)
    await asyncio.wait_for(fut, max(deadline - asyncio.get_running_loop().time(), 0.001))


class Link(NamedTuple):
    """What the handshake settled for one connection."""

    peer: int  #: the authenticated peer rank
    recv_base: int  #: tag base of frames the peer sends to us
    send_base: int  #: tag base of frames we send to the peer
    peer_address: bytes  #: the peer's worker address (b"": no shared-memory offer)
    same_host: bool
    incarnation: int = 0  #: which process of its rank the peer is (0: the first)


async def handshake_connector(progress: Progress, ep: Any, secret: bytes, rank: int, peer: int,
                              world_size: int, offer: bytes, deadline: float,
                              incarnation: int = 0) -> Link:
    """The dialling side of :mod:`asynccoll.transport.auth`'s handshake (``incarnation``:
    this process's), plus the tag bases and the shared-memory offers. Raises
    :class:`AuthenticationError`, ``TimeoutError`` or the ucxx error."""
    nonce_c = auth.new_nonce()
    await stream_io(progress, ep.stream_send,
                    auth.make_hello(rank, world_size, peer, nonce_c, incarnation), deadline)
    raw = bytearray(auth.CHALLENGE_SIZE)
    await stream_io(progress, ep.stream_recv, raw, deadline)
    ch = auth.parse_challenge(bytes(raw))
    if ch.rank != peer or ch.world_size != world_size:
        raise AuthenticationError(f"expected rank {peer} of {world_size}, reached rank "
                                  f"{ch.rank} of {ch.world_size}")
    incs = (incarnation, ch.incarnation)
    auth.verify(auth.acceptor_mac(secret, rank, peer, world_size, nonce_c, ch.nonce, incs),
                ch.mac, f"rank {peer}")
    recv_base = tag_base()
    proof = auth.connector_mac(secret, rank, peer, world_size, nonce_c, ch.nonce, incs)
    await stream_io(progress, ep.stream_send,
                    proof + _TAIL.pack(recv_base, len(offer), host_id()) + offer, deadline)
    ack = bytearray(auth.ACCEPT_SIZE + _TAIL.size)
    await stream_io(progress, ep.stream_recv, ack, deadline)
    if bytes(ack[:auth.ACCEPT_SIZE]) != auth.ACCEPT:
        raise AuthenticationError(f"rank {peer} rejected our proof of the job secret")
    send_base, n, host = _TAIL.unpack_from(ack, auth.ACCEPT_SIZE)
    peer_addr = bytearray(n)
    if n:
        await stream_io(progress, ep.stream_recv, peer_addr, deadline)
    return Link(peer, recv_base, send_base, bytes(peer_addr), host == host_id(),
                ch.incarnation)


async def handshake_acceptor(progress: Progress, ep: Any, secret: bytes, rank: int,
                             world_size: int, offer: bytes, deadline: float,
                             admit: Callable[[Link], None],
                             rejoin: Callable[[int], bool] = lambda _r: False,
                             incarnation: int = 0) -> Link:
    """The accepting side: authenticate a connector of a lower rank (or of a higher one for
    which ``rejoin(rank)`` says a new process may take its place: a restarted rank dials
    every member), call ``admit(link)`` (which raises :class:`AuthenticationError` to refuse,
    say a duplicate), then accept. ``admit`` runs before the acceptance leaves, so no frame
    can arrive before it. Raises :class:`AuthenticationError`, ``TimeoutError`` or the ucxx
    error."""
    raw = bytearray(auth.HELLO_SIZE)
    await stream_io(progress, ep.stream_recv, raw, deadline)
    hello = auth.parse_hello(bytes(raw))
    who = f"rank {hello.rank}"
    if hello.world_size != world_size or hello.wanted != rank:
        raise AuthenticationError(f"{who} wants rank {hello.wanted} of {hello.world_size}, "
                                  f"this is rank {rank} of {world_size}")
    if not (0 <= hello.rank < rank or (rank < hello.rank < world_size and rejoin(hello.rank))):
        raise AuthenticationError(f"{who} may not connect to rank {rank} (lower ranks dial, "
                                  "and a higher one only in a lost rank's place)")
    nonce_a = auth.new_nonce()
    incs = (hello.incarnation, incarnation)
    mac = auth.acceptor_mac(secret, hello.rank, rank, world_size, hello.nonce, nonce_a, incs)
    await stream_io(progress, ep.stream_send,
                    auth.make_challenge(rank, world_size, nonce_a, mac, incarnation), deadline)
    proof = bytearray(auth.PROOF_SIZE + _TAIL.size)
    await stream_io(progress, ep.stream_recv, proof, deadline)
    expected = auth.connector_mac(secret, hello.rank, rank, world_size, hello.nonce, nonce_a,
                                  incs)
    try:
        auth.verify(expected, memoryview(proof)[:auth.PROOF_SIZE], who)
    except AuthenticationError:
        await stream_io(progress, ep.stream_send, b"\x00" * (auth.ACCEPT_SIZE + _TAIL.size),
                        deadline)
        raise
    send_base, n, host = _TAIL.unpack_from(proof, auth.PROOF_SIZE)
    peer_addr = bytearray(n)
    if n:
        await stream_io(progress, ep.stream_recv, peer_addr, deadline)
    recv_base = tag_base()
    link = Link(hello.rank, recv_base, send_base, bytes(peer_addr), host == host_id(),
                hello.incarnation)
    admit(link)
    await stream_io(progress, ep.stream_send,
                    auth.ACCEPT + _TAIL.pack(recv_base, len(offer), host_id()) + offer, deadline)
    return link
