"""The frame header: its fields, limits, and validating encode/decode.

A message is a **frame**: a small msgpack header followed by ``length`` payload bytes. A header
is validated (lengths bounded, ranks in range, dtype on the allow list, shape consistent with the
length) before any payload is accepted.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import msgpack
import numpy as np

from ..buffers import ALLOWED_DTYPES
from ..errors import ProtocolError

__all__ = [
    "LIVENESS_SCHED",
    "PROTOCOL_VERSION",
    "Format",
    "Header",
    "Kind",
    "Limits",
    "Message",
    "decode_header",
    "encode_header",
]

PROTOCOL_VERSION = 1
#: the schedule id of liveness probes (:mod:`.liveness`): empty control frames, never held
LIVENESS_SCHED = (3 << 60) - 1


class Kind(enum.IntEnum):
    """What a frame carries."""

    DATA = 0  #: payload of a collective; late arrival is an error
    ACTIVATION = 1  #: starts an execution remotely; late arrival is dropped
    CONTROL = 2  #: runtime bookkeeping (handshakes, shutdown); never matched late


class Format(enum.IntEnum):
    """How a payload is laid out."""

    DENSE = 0
    SPARSE = 1
    QUANTIZED = 2
    RAW = 3


class Header(NamedTuple):
    """The fields of a frame header, in wire order."""

    version: int
    kind: int
    sched: int
    execution: int
    tag: int
    src: int
    dtype: str
    shape: tuple[int, ...]
    fmt: int
    length: int


class Message(NamedTuple):
    """A received frame: its header and the payload (a view of the destination buffer)."""

    header: Header
    payload: memoryview


@dataclass(frozen=True)
class Limits:
    """Bounds a transport enforces on what peers send it."""

    max_header_bytes: int = 1024
    max_payload_bytes: int = 1 << 36
    max_ndim: int = 8
    max_held_messages: int = 65536
    #: the memory budget of the rank: everything its peers can make it hold at once (early
    #: messages held or streaming in, receives of unknown length, payloads read to be thrown
    #: away, claims not sent yet), each peer granted ``1 / (P - 1)`` of it (see
    #: :class:`~.matching.Matcher`); also the most one receive of unknown length may be given
    max_held_bytes: int = 1 << 31
    #: the most a payload that is read only to be thrown away (a data message for a finished
    #: execution, one that overflows its receive) may claim; a peer that claims more is dropped
    max_discard_bytes: int = 1 << 26


def encode_header(h: Header) -> bytes:
    """The msgpack bytes of a header (an array, in field order)."""
    out: bytes = msgpack.packb(tuple(h), use_bin_type=True)
    return out


_KINDS = frozenset(int(k) for k in Kind)
_FORMATS = frozenset(int(f) for f in Format)


def decode_header(raw: bytes | memoryview, world_size: int, limits: Limits = Limits()) -> Header:
    """Parse and validate a header; raise :class:`ProtocolError` with the reason otherwise.

    Checks: size bound, msgpack well-formed, 10 fields of the right types, known version, kind
    and format, ranks in ``0..world_size-1``, non-negative ids, dtype on the allow list, shape
    bounded and consistent with ``length`` for dense payloads, ``length`` bounded.
    """
    if len(raw) > limits.max_header_bytes:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {limits.max_header_bytes}")
    try:
        f = msgpack.unpackb(raw, use_list=False, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not valid msgpack: {exc}") from exc
    if not isinstance(f, tuple) or len(f) != len(Header._fields):
        raise ProtocolError(f"header must be an array of {len(Header._fields)} fields")
    version, kind, sched, execution, tag, src, dtype, shape, fmt, length = f
    for name, v in (("version", version), ("kind", kind), ("sched", sched),
                    ("execution", execution), ("tag", tag), ("src", src), ("fmt", fmt),
                    ("length", length)):
        if type(v) is not int:
            raise ProtocolError(f"header field {name} must be an int, got {type(v).__name__}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (speaks {PROTOCOL_VERSION})")
    if kind not in _KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    if fmt not in _FORMATS:
        raise ProtocolError(f"unknown payload format {fmt}")
    if not 0 <= src < world_size:
        raise ProtocolError(f"source rank {src} outside 0..{world_size - 1}")
    if min(sched, execution, tag) < 0 or max(sched, execution, tag) >= 1 << 63:
        raise ProtocolError("schedule id, execution and tag must be non-negative 64-bit ints")
    if not 0 <= length <= limits.max_payload_bytes:
        raise ProtocolError(f"payload length {length} outside 0..{limits.max_payload_bytes}")
    if type(dtype) is not str or dtype not in ALLOWED_DTYPES:
        raise ProtocolError(f"dtype {dtype!r} is not on the allow list")
    if not isinstance(shape, tuple) or len(shape) > limits.max_ndim:
        raise ProtocolError(f"shape must be an array of at most {limits.max_ndim} ints")
    n = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise ProtocolError(f"shape {shape!r} must hold non-negative ints")
        n *= d
    if fmt == Format.DENSE and dtype:
        expect = n * np.dtype(dtype).itemsize
        if expect != length:
            raise ProtocolError(
                f"shape {shape} of {dtype} needs {expect} bytes, header says {length}")
    return Header(version, kind, sched, execution, tag, src, dtype, shape, fmt, length)
