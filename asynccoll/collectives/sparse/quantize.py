"""QSGD stochastic quantisation (SparCML §6): 2, 4 or 8 bits per entry, bucketed, bit-packed.

A vector is cut into buckets of ``bucket`` consecutive entries (default 512; the last may be
shorter). Each bucket keeps one ``float32`` scale, its largest magnitude, and every entry becomes
a level ``l`` in ``-s..s`` with ``s = 2**(bits-1) - 1`` (1, 7, 127 for 2, 4, 8 bits), rounded
stochastically so that ``E[l * scale / s] = x`` exactly (unbiased). A bucket of zeros has scale
0 and decodes to zeros (never NaN). Levels are stored as ``l + s`` in ``bits`` bits, packed
little-end first into bytes. The random stream comes from ``numpy.random.default_rng(seed)``:
the same seed gives the same bits.

Wire form (:func:`to_payload` / :func:`from_message`): payload = the scales (``float32``) then
the packed codes; the frame header says ``Format.QUANTIZED``, the decoded dtype, and shape
``(n, bits, bucket)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ...errors import ProtocolError
from ...sched import Payload
from ...transport.frames import Format, Message

__all__ = ["BITS", "Quantized", "dequantize", "from_message", "levels", "pack", "quantize",
           "to_payload", "unpack"]

#: the supported widths
BITS = (2, 4, 8)


def levels(bits: int) -> int:
    """``s``, the number of positive levels of a ``bits``-wide code."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    return (1 << (bits - 1)) - 1


class Quantized(NamedTuple):
    """A quantised vector: ``buf`` holds the scales then the packed codes (one allocation)."""

    buf: np.ndarray  #: uint8
    size: int
    bits: int
    bucket: int
    dtype: np.dtype[Any]  #: of the decoded values

    @property
    def nbuckets(self) -> int:
        return -(-self.size // self.bucket)

    @property
    def scales(self) -> np.ndarray:
        return self.buf[:4 * self.nbuckets].view(np.float32)

    @property
    def packed(self) -> np.ndarray:
        return self.buf[4 * self.nbuckets:]

    @property
    def nbytes(self) -> int:
        return int(self.buf.size)


def _packed_len(n: int, bits: int) -> int:
    per = 8 // bits
    return -(-n // per)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ``codes`` (< 2**bits) ``8 // bits`` to a byte, first code in the low bits."""
    levels(bits)
    codes = np.asarray(codes, dtype=np.uint8).reshape(-1)
    if bits == 8:
        return codes.copy()
    per = 8 // bits
    n = codes.size
    padded = np.zeros(_packed_len(n, bits) * per, np.uint8)
    padded[:n] = codes
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    out: np.ndarray = np.bitwise_or.reduce(padded.reshape(-1, per) << shifts, axis=1)
    return out.astype(np.uint8, copy=False)


def unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The first ``n`` codes of ``packed`` (inverse of :func:`pack`)."""
    levels(bits)
    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    if _packed_len(n, bits) > packed.size:
        raise ValueError(f"packed holds {packed.size} bytes, {n} codes of {bits} bits need "
                         f"{_packed_len(n, bits)}")
    if bits == 8:
        return packed[:n]
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    mask = np.uint8((1 << bits) - 1)
    codes = (packed[:, None] >> shifts) & mask
    return codes.reshape(-1)[:n]


def quantize(x: np.ndarray, bits: int = 4, bucket: int = 512, *,
             seed: int | tuple[int, ...] | None = None,
             rng: np.random.Generator | None = None) -> Quantized:
    """Quantise float array ``x`` stochastically (unbiased) to ``bits`` bits per entry.

    Randomness: ``rng`` when given, else ``default_rng(seed)``. Raises ``TypeError`` for
    non-float ``x`` and ``ValueError`` for bad ``bits``/``bucket`` or non-finite entries.
    Costs a few passes over ``x``; the result is ``4 * ceil(n / bucket) + ceil(n * bits / 8)``
    bytes.
    """
    s = levels(bits)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a NumPy array, got {type(x).__name__}")
    if x.dtype.kind != "f":
        raise TypeError(f"x must have a float dtype, got {x.dtype}")
    if not isinstance(bucket, (int, np.integer)) or bucket < 1:
        raise ValueError(f"bucket must be an int >= 1, got {bucket!r}")
    x = x.reshape(-1)
    n = x.size
    nb = -(-n // bucket)
    work = np.float64 if x.dtype == np.float64 else np.float32
    mag = np.zeros(nb * bucket, work)
    np.abs(x, out=mag[:n], casting="unsafe")
    mag2 = mag.reshape(nb, bucket)
    top = mag2.max(axis=1) if nb else np.zeros(0, work)
    if not bool(np.all(np.isfinite(top))):
        raise ValueError("x must be finite to be quantised")
    scales: np.ndarray = top.astype(np.float32)
    low = np.less(scales.astype(work), top)  # rounded below the maximum: step up one ulp
    scales[low] = np.nextafter(scales[low], np.float32(np.inf))
    inv = np.zeros(nb, work)
    np.divide(work(s), scales, out=inv, where=scales > 0)
    np.multiply(mag2, inv[:, None], out=mag2)  # |x| in units of one level, within 0..s
    lev = np.floor(mag2)
    frac = mag2 - lev
    gen = rng if rng is not None else np.random.default_rng(seed)
    lev += gen.random(frac.shape, dtype=work) < frac
    np.minimum(lev, s, out=lev)
    codes = lev.reshape(-1)[:n].astype(np.int16)
    neg = np.signbit(x)
    codes[neg] = -codes[neg]
    codes += s
    buf = np.empty(4 * nb + _packed_len(n, bits), np.uint8)
    buf[:4 * nb].view(np.float32)[:] = scales
    buf[4 * nb:] = pack(codes.astype(np.uint8), bits)
    return Quantized(buf, n, bits, bucket, np.dtype(x.dtype))


def dequantize(q: Quantized, out: np.ndarray | None = None) -> np.ndarray:
    """The decoded values ``(code - s) * (scale / s)`` into ``out`` (or a new array).

    Every output lies on a level of its bucket; a bucket with scale 0 decodes to zeros.
    """
    s = levels(q.bits)
    n = q.size
    if out is None:
        out = np.empty(n, q.dtype)
    elif out.shape != (n,):
        raise ValueError(f"out must have shape ({n},), got {out.shape}")
    if n == 0:
        return out
    codes = unpack(q.packed, q.bits, n).astype(np.int16) - s
    step = (q.scales.astype(q.dtype) / q.dtype.type(s))
    nb = q.nbuckets
    full = (n // q.bucket) * q.bucket
    if full:
        np.multiply(codes[:full].reshape(-1, q.bucket), step[:full // q.bucket, None],
                    out=out[:full].reshape(-1, q.bucket), casting="unsafe")
    if full < n:
        np.multiply(codes[full:], step[nb - 1], out=out[full:], casting="unsafe")
    return out


def to_payload(q: Quantized) -> Payload:
    """The frame payload of ``q`` (its buffer, no copy)."""
    dt = q.dtype
    wire = dt.str if dt.itemsize == 1 else dt.newbyteorder("<").str
    return Payload(q.buf, wire, (q.size, q.bits, q.bucket), int(Format.QUANTIZED))


def from_message(msg: Message, size: int | None = None, dtype: Any = None) -> Quantized:
    """Decode a quantised frame (views of its payload); :class:`ProtocolError` if malformed or
    not of the expected ``size``/``dtype``."""
    h = msg.header
    if h.fmt != Format.QUANTIZED or len(h.shape) != 3:
        raise ProtocolError(f"rank {h.src} sent format {h.fmt} shape {h.shape}, expected a "
                            "quantised payload of shape (n, bits, bucket)")
    n, bits, bucket = h.shape
    if bits not in BITS or bucket < 1:
        raise ProtocolError(f"rank {h.src} sent bits={bits}, bucket={bucket}")
    dt = np.dtype(h.dtype or "u1")
    if dt.kind != "f":
        raise ProtocolError(f"rank {h.src} sent quantised {dt}, expected a float dtype")
    if size is not None and n != size:
        raise ProtocolError(f"rank {h.src} sent {n} quantised entries, expected {size}")
    if dtype is not None and dt != np.dtype(dtype):
        raise ProtocolError(f"rank {h.src} sent quantised {dt}, expected {np.dtype(dtype)}")
    nb = -(-n // bucket)
    if h.length != 4 * nb + _packed_len(n, bits):
        raise ProtocolError(f"rank {h.src} sent {h.length} bytes for {n} entries of {bits} bits")
    buf = np.frombuffer(msg.payload, np.uint8)
    q = Quantized(buf, n, bits, bucket, dt)
    if not bool(np.all(np.isfinite(q.scales))) or bool(np.any(q.scales < 0)):
        raise ProtocolError(f"rank {h.src} sent invalid scales")
    return q
