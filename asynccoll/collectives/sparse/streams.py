"""Sparse vectors and sparse streams (SparCML §5.1): representation, top-k, vectorised merges.

The representation, its constructors, top-k and the two-way sum :func:`add` live in
:mod:`.vector` and are re-exported here; this module adds the many-way merges and the stream
format. A :class:`SparseVector`
holds the nonzeros of a length-``size`` vector as sorted unique
``indices`` (``int32`` when ``size < 2**31``, else ``int64``) and ``values`` of a numeric dtype.
Sums of sparse vectors switch to a dense array once the result holds more than
``delta = floor(N * isize / (c + isize))`` entries (``c`` the index size): past that point the
sparse form is larger than the dense one. ``delta`` is configurable; forcing ``0`` (always dense)
or ``math.inf`` (never dense) changes the representation, never the values.

Every merge here is vectorised (``searchsorted``, fancy indexing, ``add.reduceat``); none loops
over elements in Python. A two-way sum is exactly ``a + b`` per coordinate, so ``add(a, b)`` and
``add(b, a)`` are bitwise identical: ranks that merge the same pair in either order agree.

**Streams** are the same data laid out in one byte buffer, so that a schedule can keep a partial
sum in a bound slot and send it without a copy: a 16-byte header (``int64`` flag ``0`` sparse /
``1`` dense, ``int64`` count), then either ``count`` indices followed by ``count`` values, or
``count`` dense values. On the wire the payload is the buffer after the header; the frame header
carries ``Format.SPARSE`` with shape ``(N, nnz)`` or ``Format.DENSE`` with shape ``(n,)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np

from ...errors import ProtocolError
from ...sched import Payload
from ...transport.frames import Format, Message
from .vector import (
    SparseVector,
    _coalesce,
    _dense_arg,
    add,
    bucket_topk,
    default_delta,
    from_dense,
    from_pairs,
    index_dtype,
    to_dense,
    topk,
)

__all__ = [
    "Piece",
    "SparseAccumulator",
    "SparseVector",
    "add",
    "add_into",
    "bucket_topk",
    "decode_piece",
    "scatter_sum",
    "default_delta",
    "dense_view",
    "from_dense",
    "from_pairs",
    "index_dtype",
    "piece_payload",
    "read_stream",
    "sparse_views",
    "stream_capacity",
    "stream_payload",
    "sum_pieces",
    "to_dense",
    "topk",
    "write_piece",
]

_HDR = 16
# -- merges ------------------------------------------------------------------------------------

#: a part of a vector: sparse (global indices) or a dense array of the range's entries
Piece: TypeAlias = "SparseVector | np.ndarray"


def sum_pieces(pieces: Sequence[SparseVector | np.ndarray], lo: int, hi: int, size: int,
               dtype: Any, delta: float, out: np.ndarray | None = None
               ) -> SparseVector | np.ndarray:
    """Sum pieces of the range ``lo:hi`` of a length-``size`` vector, in the given order.

    Sparse pieces carry global indices within the range; dense pieces are arrays of ``hi-lo``
    entries. The result is sparse (exact zeros dropped) when it has at most ``delta`` nonzeros,
    else the dense array (``out`` when given). Sparse-only sums of few entries use one stable
    sort and ``add.reduceat``; otherwise the pieces are scattered into a dense range.
    """
    dt = np.dtype(dtype)
    n = hi - lo
    sparse = [p for p in pieces if isinstance(p, SparseVector)]
    total = sum(p.nnz for p in sparse)
    if len(sparse) == len(pieces) and total <= delta:
        if not sparse:
            return SparseVector(np.empty(0, index_dtype(size)), np.empty(0, dt), size,
                                check=False)
        idx = np.concatenate([p.indices for p in sparse])
        vals = np.concatenate([p.values for p in sparse]).astype(dt, copy=False)
        if len(sparse) > 1:
            idx, vals = _coalesce(idx, vals)
        return SparseVector(idx, vals, size, check=False).without_zeros()
    acc = np.empty(n, dt) if out is None else out
    scatter_sum(acc, pieces, lo)
    nz = int(np.count_nonzero(acc))
    if nz <= delta:
        idx = np.flatnonzero(acc)
        return SparseVector((idx + lo).astype(index_dtype(size)), acc[idx], size, check=False)
    return acc



def scatter_sum(acc: np.ndarray, pieces: Sequence[SparseVector | np.ndarray], lo: int = 0) -> None:
    """``acc[:] = sum of pieces`` (sparse pieces shifted by ``lo``), vectorised per piece."""
    acc.fill(0)
    for x in pieces:
        if isinstance(x, SparseVector):
            acc[x.indices - lo] += x.values  # indices are unique within a piece
        else:
            acc += x


def add_into(total: SparseVector | np.ndarray, x: SparseVector | np.ndarray, delta: float,
             dtype: Any) -> SparseVector | np.ndarray:
    """``total + x``: in place when ``total`` is dense, else a new sum that stays sparse while
    :func:`add` keeps it under ``delta``; a dense ``x`` on a sparse total gives a dense copy of
    ``dtype``."""
    if isinstance(total, np.ndarray):
        if isinstance(x, SparseVector):
            total[x.indices] += x.values
        else:
            total += x
        return total
    if isinstance(x, SparseVector):
        return add(total, x, delta)
    d = x.astype(dtype)
    d[total.indices] += total.values
    return d

class SparseAccumulator:
    """A running sum of SparseVectors (stale contributions of a partial collective).

    :meth:`add` merges one vector in (O(nnz) amortised while sparse; the sum turns into a dense
    array once it passes ``delta``); :meth:`take` returns the sum and starts over. The sum is
    exact per coordinate in the order of the calls.
    """

    def __init__(self, size: int, dtype: Any, delta: float | None = None) -> None:
        self.size = size
        self.dtype = np.dtype(dtype)
        self.delta = default_delta(size, self.dtype) if delta is None else delta
        self.count = 0
        self._sum: SparseVector | np.ndarray | None = None

    def add(self, x: SparseVector | np.ndarray) -> None:
        """Add ``x`` (sparse, or dense of length ``size``)."""
        if isinstance(x, SparseVector):
            if x.size != self.size:
                raise ValueError(f"x has size {x.size}, the accumulator {self.size}")
        else:
            x = _dense_arg(x, "x")
            if x.size != self.size:
                raise ValueError(f"x has size {x.size}, the accumulator {self.size}")
        self.count += 1
        if self._sum is None:
            self._sum = x.astype(self.dtype) if isinstance(x, np.ndarray) else x
        else:
            self._sum = add_into(self._sum, x, self.delta, self.dtype)

    def take(self) -> SparseVector | np.ndarray:
        """The sum so far (an empty SparseVector when nothing was added); then reset."""
        s = self._sum
        self._sum = None
        self.count = 0
        if s is None:
            return SparseVector(np.empty(0, index_dtype(self.size)), np.empty(0, self.dtype),
                                self.size, check=False)
        return s


# -- streams and the wire format ---------------------------------------------------------------

def stream_capacity(size: int, dtype: Any, delta: float) -> int:
    """Bytes of a stream buffer for a length-``size`` vector that switches at ``delta``."""
    isize = np.dtype(dtype).itemsize
    c = index_dtype(size).itemsize
    sparse_max = int(min(delta, size)) * (c + isize) if delta >= 0 else 0
    return int(_HDR + max(size * isize, sparse_max))


def write_piece(buf: np.ndarray, x: SparseVector | np.ndarray) -> None:
    """Store ``x`` in stream buffer ``buf`` (uint8). One copy of ``x``'s data."""
    h = buf[:_HDR].view(np.int64)
    if isinstance(x, SparseVector):
        n = x.nnz
        c = x.indices.itemsize
        h[0], h[1] = 0, n
        end = _HDR + n * c
        buf[_HDR:end].view(x.indices.dtype)[:] = x.indices
        buf[end:end + n * x.values.itemsize].view(x.values.dtype)[:] = x.values
    else:
        h[0], h[1] = 1, x.size
        buf[_HDR:_HDR + x.nbytes].view(x.dtype)[:] = x


def sparse_views(buf: np.ndarray, nnz: int, size: int, dtype: Any
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Mark ``buf`` as a sparse stream of ``nnz`` entries; return its (indices, values) views
    for the caller to fill."""
    it = index_dtype(size)
    dt = np.dtype(dtype)
    h = buf[:_HDR].view(np.int64)
    h[0], h[1] = 0, nnz
    end = _HDR + nnz * it.itemsize
    return buf[_HDR:end].view(it), buf[end:end + nnz * dt.itemsize].view(dt)


def dense_view(buf: np.ndarray, n: int, dtype: Any) -> np.ndarray:
    """Mark ``buf`` as a dense stream of ``n`` entries; return the values view to fill."""
    dt = np.dtype(dtype)
    h = buf[:_HDR].view(np.int64)
    h[0], h[1] = 1, n
    return buf[_HDR:_HDR + n * dt.itemsize].view(dt)


def read_stream(buf: np.ndarray, size: int, dtype: Any) -> SparseVector | np.ndarray:
    """The piece a stream buffer holds (views into ``buf``, no copy)."""
    flag, n = (int(v) for v in buf[:_HDR].view(np.int64))
    dt = np.dtype(dtype)
    if flag:
        dense: np.ndarray = buf[_HDR:_HDR + n * dt.itemsize].view(dt)
        return dense
    it = index_dtype(size)
    end = _HDR + n * it.itemsize
    return SparseVector(buf[_HDR:end].view(it), buf[end:end + n * dt.itemsize].view(dt), size,
                        check=False)


def stream_payload(buf: np.ndarray, size: int, dtype: Any) -> Payload:
    """The frame payload of a stream buffer (a view: the buffer is sent without a copy)."""
    flag, n = (int(v) for v in buf[:_HDR].view(np.int64))
    dt = np.dtype(dtype)
    wire = dt.str if dt.itemsize == 1 else dt.newbyteorder("<").str
    if flag:
        return Payload(buf[_HDR:_HDR + n * dt.itemsize], wire, (n,), int(Format.DENSE))
    c = index_dtype(size).itemsize
    return Payload(buf[_HDR:_HDR + n * (c + dt.itemsize)], wire, (size, n), int(Format.SPARSE))


def piece_payload(x: SparseVector | np.ndarray, staging: np.ndarray) -> Payload:
    """A payload for ``x``: a dense piece is sent from its own memory, a sparse one is packed
    into ``staging`` (uint8, at least ``nnz * (c + isize)`` bytes after the 16-byte header)."""
    if isinstance(x, SparseVector):
        write_piece(staging, x)
        return stream_payload(staging, x.size, x.dtype)
    dt = x.dtype
    wire = dt.str if dt.itemsize == 1 else dt.newbyteorder("<").str
    return Payload(x, wire, (x.size,), int(Format.DENSE))


def decode_piece(msg: Message, size: int, lo: int, hi: int, dtype: Any
                 ) -> SparseVector | np.ndarray:
    """Decode a received piece of the range ``lo:hi`` (views of the payload, no copy).

    Raises :class:`ProtocolError` unless the frame is a well-formed sparse piece (shape
    ``(size, nnz)``, indices strictly increasing inside ``lo:hi``) or dense piece (shape
    ``(hi-lo,)``) of ``dtype``.
    """
    h = msg.header
    dt = np.dtype(dtype)
    wire = dt.str if dt.itemsize == 1 else dt.newbyteorder("<").str
    if h.dtype != wire:
        raise ProtocolError(f"rank {h.src} sent {h.dtype or 'raw'} values, expected {wire}")
    raw = np.frombuffer(msg.payload, np.uint8)
    if h.fmt == Format.DENSE:
        if h.shape != (hi - lo,):
            raise ProtocolError(f"rank {h.src} sent a dense piece of shape {h.shape}, "
                                f"expected ({hi - lo},)")
        dense: np.ndarray = raw.view(dt)
        return dense
    if h.fmt != Format.SPARSE:
        raise ProtocolError(f"rank {h.src} sent payload format {h.fmt}, expected sparse/dense")
    it = index_dtype(size)
    if len(h.shape) != 2 or h.shape[0] != size or \
            h.length != h.shape[1] * (it.itemsize + dt.itemsize):
        raise ProtocolError(f"rank {h.src} sent a malformed sparse header {h.shape} "
                            f"({h.length} bytes) for a vector of {size}")
    n = h.shape[1]
    idx = raw[:n * it.itemsize].view(it)
    if n and (idx[0] < lo or idx[-1] >= hi or
              (n > 1 and not bool(np.all(idx[1:] > idx[:-1])))):
        raise ProtocolError(f"rank {h.src} sent indices that are not sorted, unique and "
                            f"inside {lo}..{hi - 1}")
    return SparseVector(idx, raw[n * it.itemsize:].view(dt), size, check=False)
