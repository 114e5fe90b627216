"""The connection handshake: mutual proof of knowledge of the job secret, sans I/O.

Both sides prove that they hold the job's shared secret without sending it: each contributes a
fresh random nonce and answers with an HMAC-SHA256, keyed by the secret, over a transcript that
binds both nonces, both ranks, the world size and the answering side's role (so that one side's
proof can never be replayed as the other's, nor on another connection). Proofs are compared in
constant time. The messages have fixed sizes, so a reader always knows how much to read next::

    connector -> acceptor   HELLO      magic, version, rank, world size, wanted rank,
                                       incarnation, nonce_c
    acceptor  -> connector  CHALLENGE  magic, version, rank, world size, incarnation, nonce_s,
                                       MAC_acceptor
    connector -> acceptor   PROOF      MAC_connector
    acceptor  -> connector  ACCEPT     one byte

Each side's **incarnation** is which process of its rank it is: 0 for a rank's first process,
``k`` for its k-th restart (``ASYNCCOLL_RESTART``). A peer remembers it per connection, so that
a loss notice about a rank's earlier process is told from one about the process it talks to now
(:mod:`asynccoll.comm.membership`). Both incarnations are in the transcript the proofs cover.

This module only builds and checks the messages; the transport moves them and bounds the time
the whole exchange may take. Every check failure raises :class:`AuthenticationError` with the
reason (never with secret material in it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import NamedTuple

from ..errors import AuthenticationError

__all__ = [
    "ACCEPT",
    "ACCEPT_SIZE",
    "CHALLENGE_SIZE",
    "HELLO_SIZE",
    "MAGIC",
    "NONCE_BYTES",
    "PROOF_SIZE",
    "Challenge",
    "Hello",
    "check_secret",
    "connector_mac",
    "acceptor_mac",
    "make_challenge",
    "make_hello",
    "new_nonce",
    "parse_challenge",
    "parse_hello",
    "verify",
]

MAGIC = b"ACOLTCP\x00"
HANDSHAKE_VERSION = 2
NONCE_BYTES = 32
MAC_BYTES = 32
MIN_SECRET_BYTES = 16

#: magic, version, rank, world size, wanted rank, incarnation, nonce
_HELLO = struct.Struct("<8sHIIII32s")
#: magic, version, rank, world size, incarnation, nonce, mac
_CHALLENGE = struct.Struct("<8sHIII32s32s")

HELLO_SIZE = _HELLO.size
CHALLENGE_SIZE = _CHALLENGE.size
PROOF_SIZE = MAC_BYTES
ACCEPT = b"\x01"
ACCEPT_SIZE = len(ACCEPT)


class Hello(NamedTuple):
    """The connector's opening message."""

    rank: int
    world_size: int
    wanted: int  # the rank the connector believes it is talking to
    nonce: bytes
    incarnation: int = 0  # which process of its rank the connector is (0: the first)


class Challenge(NamedTuple):
    """The acceptor's answer: its identity, its nonce and its proof."""

    rank: int
    world_size: int
    nonce: bytes
    mac: bytes
    incarnation: int = 0  # which process of its rank the acceptor is (0: the first)


def check_secret(secret: object) -> bytes:
    """Return ``secret`` as bytes; ``TypeError``/``ValueError`` naming it when unusable."""
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return bytes(secret)


def new_nonce() -> bytes:
    """A fresh random nonce (from the operating system's generator)."""
    return os.urandom(NONCE_BYTES)


def make_hello(rank: int, world_size: int, wanted: int, nonce: bytes,
               incarnation: int = 0) -> bytes:
    return _HELLO.pack(MAGIC, HANDSHAKE_VERSION, rank, world_size, wanted, incarnation, nonce)


def parse_hello(raw: bytes | memoryview) -> Hello:
    """Decode a HELLO; raise :class:`AuthenticationError` if it is not one."""
    magic, version, rank, world, wanted, incarnation, nonce = _HELLO.unpack(raw)
    if magic != MAGIC:
        raise AuthenticationError("connection did not start with the asynccoll handshake")
    if version != HANDSHAKE_VERSION:
        raise AuthenticationError(f"handshake version {version} (speaks {HANDSHAKE_VERSION})")
    return Hello(rank, world, wanted, nonce, incarnation)


def make_challenge(rank: int, world_size: int, nonce: bytes, mac: bytes,
                   incarnation: int = 0) -> bytes:
    return _CHALLENGE.pack(MAGIC, HANDSHAKE_VERSION, rank, world_size, incarnation, nonce, mac)


def parse_challenge(raw: bytes | memoryview) -> Challenge:
    """Decode a CHALLENGE; raise :class:`AuthenticationError` if it is not one."""
    magic, version, rank, world, incarnation, nonce, mac = _CHALLENGE.unpack(raw)
    if magic != MAGIC:
        raise AuthenticationError("peer did not answer with the asynccoll handshake")
    if version != HANDSHAKE_VERSION:
        raise AuthenticationError(f"handshake version {version} (speaks {HANDSHAKE_VERSION})")
    return Challenge(rank, world, nonce, mac, incarnation)


def _transcript(role: bytes, connector: int, acceptor: int, world_size: int, nonce_c: bytes,
                nonce_a: bytes, incarnations: tuple[int, int]) -> bytes:
    return b"|".join((MAGIC, role, struct.pack("<IIIII", connector, acceptor, world_size,
                                               *incarnations), nonce_c, nonce_a))


def acceptor_mac(secret: bytes, connector: int, acceptor: int, world_size: int,
                 nonce_c: bytes, nonce_a: bytes,
                 incarnations: tuple[int, int] = (0, 0)) -> bytes:
    """The acceptor's proof over this connection's transcript (``incarnations``: the
    connector's and the acceptor's)."""
    msg = _transcript(b"acceptor", connector, acceptor, world_size, nonce_c, nonce_a,
                      incarnations)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def connector_mac(secret: bytes, connector: int, acceptor: int, world_size: int,
                  nonce_c: bytes, nonce_a: bytes,
                  incarnations: tuple[int, int] = (0, 0)) -> bytes:
    """The connector's proof over this connection's transcript (``incarnations``: the
    connector's and the acceptor's)."""
    msg = _transcript(b"connector", connector, acceptor, world_size, nonce_c, nonce_a,
                      incarnations)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes | memoryview, who: str) -> None:
    """Compare proofs in constant time; :class:`AuthenticationError` naming ``who`` otherwise."""
    if not hmac.compare_digest(expected, bytes(got)):
        raise AuthenticationError(f"{who} failed to prove knowledge of the job secret")
