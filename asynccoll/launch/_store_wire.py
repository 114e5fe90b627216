"""The store's wire format, shared by :mod:`.store` (the server) and :mod:`.store_client`.

Every frame is a 4-byte big-endian length and a msgpack array; the handshake MACs are
HMAC-SHA256 over a label and both nonces (the module docstring of :mod:`.store` draws it).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from typing import Any

import msgpack

from ..errors import StoreError

_VERSION = 1
_LEN = struct.Struct(">I")
_CLIENT_LABEL = b"asynccoll-store-client-v1"
_SERVER_LABEL = b"asynccoll-store-server-v1"
_NONCE = 32
_HANDSHAKE_MAX = 256  # bytes an unauthenticated peer may make us read


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
