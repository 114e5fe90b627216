"""Sparse vectors (SparCML §5.1): the representation, its constructors, the two-way sum and
top-k selection.

A :class:`SparseVector` holds the nonzeros of a length-``size`` vector as sorted unique
``indices`` (``int32`` when ``size < 2**31``, else ``int64``) and ``values`` of a numeric dtype.
:func:`default_delta` is the size past which the sparse form is larger than the dense one.
Everything here is vectorised (no per-element Python) and re-exported by
:mod:`asynccoll.collectives.sparse`; :mod:`.streams` builds the many-way merges and the stream
format on it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...buffers import is_cupy

__all__ = [
    "SparseVector",
    "add",
    "bucket_topk",
    "default_delta",
    "from_dense",
    "from_pairs",
    "index_dtype",
    "to_dense",
    "topk",
]

_INT32_LIMIT = 1 << 31


def index_dtype(size: int) -> np.dtype[Any]:
    """The index dtype for vectors of ``size`` entries: int32 below 2**31, else int64."""
    return np.dtype(np.int32) if size < _INT32_LIMIT else np.dtype(np.int64)


def default_delta(size: int, dtype: Any) -> int:
    """SparCML's switch point ``floor(N * isize / (c + isize))``: past it dense is smaller."""
    isize = np.dtype(dtype).itemsize
    c = index_dtype(size).itemsize
    return int((size * isize) // (c + isize))


def _check_values_dtype(dt: np.dtype[Any], name: str) -> None:
    if dt.kind not in "fiu":
        raise TypeError(f"{name} must have a float or integer dtype, got {dt}")


class SparseVector:
    """The nonzeros of a vector of ``size`` entries: sorted unique ``indices`` and ``values``.

    Guarantees (checked on construction unless ``check=False``, which trusted internal callers
    use): ``indices`` is 1-D, strictly increasing, within ``0..size-1``, of
    :func:`index_dtype(size) <index_dtype>`; ``values`` is 1-D of the same length with a float
    or integer dtype. Explicit zeros are allowed (the collectives drop them from their results).
    Arrays are kept without copies when they already have the right dtype.
    Raises ``TypeError``/``ValueError`` naming the argument.
    """

    __slots__ = ("indices", "size", "values")

    def __init__(self, indices: Any, values: Any, size: int, *, check: bool = True) -> None:
        if check:
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
                raise ValueError(f"size must be a non-negative int, got {size!r}")
            size = int(size)
            indices = np.asarray(indices)
            values = np.asarray(values)
            if indices.ndim != 1 or (indices.dtype.kind not in "iu" and indices.size):
                raise TypeError(f"indices must be a 1-D integer array, got {indices.dtype} "
                                f"with shape {indices.shape}")
            if values.ndim != 1:
                raise ValueError(f"values must be 1-D, got shape {values.shape}")
            _check_values_dtype(values.dtype, "values")
            if indices.size != values.size:
                raise ValueError(f"indices ({indices.size}) and values ({values.size}) "
                                 "differ in length")
            if indices.size:
                if indices[0] < 0 or indices[-1] >= size:
                    raise ValueError(f"indices must lie in 0..{size - 1}")
                if indices.size > 1 and not bool(np.all(indices[1:] > indices[:-1])):
                    raise ValueError("indices must be strictly increasing (sorted, unique); "
                                     "use from_pairs() to coalesce duplicates")
            indices = indices.astype(index_dtype(size), copy=False)
        self.indices: np.ndarray = indices
        self.values: np.ndarray = values
        self.size: int = size

    @property
    def nnz(self) -> int:
        """The number of stored entries (explicit zeros included)."""
        return int(self.indices.size)

    @property
    def dtype(self) -> np.dtype[Any]:
        """The dtype of the values."""
        return self.values.dtype

    @property
    def density(self) -> float:
        """``nnz / size`` (0 for an empty vector)."""
        return self.nnz / self.size if self.size else 0.0

    def to_dense(self, out: np.ndarray | None = None) -> np.ndarray:
        """The dense array (``out`` when given: filled, of length ``size``); CuPy when the
        values are CuPy arrays."""
        if out is None:
            if is_cupy(self.values):
                import cupy

                dev: np.ndarray = cupy.zeros(self.size, self.values.dtype)
                dev[self.indices] = self.values
                return dev
            out = np.zeros(self.size, self.values.dtype)
        else:
            if out.shape != (self.size,):
                raise ValueError(f"out must have shape ({self.size},), got {out.shape}")
            out.fill(0)
        out[self.indices] = self.values
        return out

    def without_zeros(self) -> SparseVector:
        """This vector with exact zeros dropped (itself when it has none)."""
        if self.values.size == 0 or bool(np.all(self.values)):
            return self
        keep = self.values != 0
        return SparseVector(self.indices[keep], self.values[keep], self.size, check=False)

    def __add__(self, other: SparseVector) -> SparseVector | np.ndarray:
        return add(self, other)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, SparseVector) and self.size == other.size
                and self.values.dtype == other.values.dtype
                and np.array_equal(self.indices, other.indices)
                and np.array_equal(self.values, other.values))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SparseVector(size={self.size}, nnz={self.nnz}, dtype={self.values.dtype})"


# -- the two-way sum ---------------------------------------------------------------------------

class _Union:
    """The sorted union of two sorted unique index sets, before its values are summed.

    One stable sort of the concatenation (two sorted runs: linear-time in practice) puts
    ``a``'s entry of a shared index right before ``b``'s; ``size`` is the union's size.
    """

    __slots__ = ("dup", "idx", "size", "vals")

    def __init__(self, ia: np.ndarray, va: np.ndarray, ib: np.ndarray, vb: np.ndarray,
                 dtype: np.dtype[Any]) -> None:
        c = np.concatenate((ia, ib))
        order = np.argsort(c, kind="stable")
        self.idx = c[order]
        self.vals = np.concatenate((va.astype(dtype, copy=False),
                                    vb.astype(dtype, copy=False)))[order]
        #: positions i whose index repeats at i + 1 (a's entry, then b's)
        self.dup = np.flatnonzero(self.idx[1:] == self.idx[:-1])
        self.size = int(self.idx.size - self.dup.size)

    def write(self, oi: np.ndarray, ov: np.ndarray) -> None:
        """Write the union into ``oi``/``ov`` (sized ``self.size``); shared indices get
        ``a + b``, which equals ``b + a`` bit for bit."""
        if not self.dup.size:
            oi[:] = self.idx
            ov[:] = self.vals
            return
        self.vals[self.dup] += self.vals[self.dup + 1]
        keep = np.ones(self.idx.size, dtype=bool)
        keep[self.dup + 1] = False
        np.compress(keep, self.idx, out=oi)
        np.compress(keep, self.vals, out=ov)


def add(a: SparseVector, b: SparseVector, delta: float | None = None
        ) -> SparseVector | np.ndarray:
    """``a + b``: a SparseVector while the union has at most ``delta`` entries, else dense.

    ``delta`` defaults to :func:`default_delta`. Commutative bit for bit. Costs
    O(|a| + |b|) sparse (a stable sort of two sorted runs), O(N) when the result is dense.
    """
    if a.size != b.size:
        raise ValueError(f"sizes differ: {a.size} and {b.size}")
    dt = np.result_type(a.values.dtype, b.values.dtype)
    if delta is None:
        delta = default_delta(a.size, dt)
    if a.nnz + b.nnz > delta:  # |H1| + |H2| bounds the union; only then count it
        u = _Union(a.indices, a.values, b.indices, b.values, dt)
        if u.size > delta:
            out = np.zeros(a.size, dt)
            out[a.indices] += a.values
            out[b.indices] += b.values
            return out
    else:
        u = _Union(a.indices, a.values, b.indices, b.values, dt)
    oi = np.empty(u.size, a.indices.dtype)
    ov = np.empty(u.size, dt)
    u.write(oi, ov)
    return SparseVector(oi, ov, a.size, check=False)


def _dense_arg(x: Any, name: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    _check_values_dtype(x.dtype, name)
    out: np.ndarray = x.reshape(-1)
    return out


def from_dense(x: np.ndarray) -> SparseVector:
    """The nonzeros of dense ``x`` (flattened). Costs one pass over ``x`` plus the copy-out."""
    x = _dense_arg(x, "x")
    idx = np.flatnonzero(x).astype(index_dtype(x.size), copy=False)
    return SparseVector(idx, x[idx], x.size, check=False)


def from_pairs(indices: Any, values: Any, size: int) -> SparseVector:
    """A vector from unsorted ``(indices, values)`` pairs; duplicate indices are summed.

    Duplicates are summed in their input order (so the result is deterministic). Raises
    ``ValueError`` for indices outside ``0..size-1`` or mismatched lengths.
    """
    idx = np.asarray(indices).reshape(-1)
    vals = np.asarray(values).reshape(-1)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers, got {idx.dtype}")
    _check_values_dtype(vals.dtype, "values")
    if idx.size != vals.size:
        raise ValueError(f"indices ({idx.size}) and values ({vals.size}) differ in length")
    if idx.size and (idx.min() < 0 or idx.max() >= size):
        raise ValueError(f"indices must lie in 0..{size - 1}")
    if idx.size > 1 and not bool(np.all(idx[1:] > idx[:-1])):
        idx, vals = _coalesce(idx, vals)
    return SparseVector(idx, vals, size)


def _coalesce(idx: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort by index (stable) and sum runs of equal indices in their original order."""
    if idx.size == 0:
        return idx, vals
    order = np.argsort(idx, kind="stable")
    s = idx[order]
    v = vals[order]
    starts = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1])))
    return s[starts], np.add.reduceat(v, starts)


def topk(x: np.ndarray, k: int) -> SparseVector:
    """The ``k`` entries of ``x`` largest in magnitude (ties broken arbitrarily but
    deterministically). O(N) selection (``argpartition``) plus sorting the ``k`` indices."""
    x = _dense_arg(x, "x")
    if not isinstance(k, (int, np.integer)) or not 0 <= k <= x.size:
        raise ValueError(f"k must be an int in 0..{x.size}, got {k!r}")
    n = x.size
    if k == n:
        idx = np.arange(n, dtype=index_dtype(n))
    elif k == 0:
        idx = np.empty(0, index_dtype(n))
    else:
        idx = np.sort(np.argpartition(np.abs(x), n - k)[n - k:]).astype(index_dtype(n))
    return SparseVector(idx, x[idx], n, check=False)


def bucket_topk(x: np.ndarray, k: int, bucket: int = 512) -> SparseVector:
    """Top-``k`` by magnitude within each bucket of ``bucket`` consecutive entries (the last
    bucket may be shorter), as in SparCML's experiments. Vectorised over buckets."""
    x = _dense_arg(x, "x")
    if not isinstance(bucket, (int, np.integer)) or bucket < 1:
        raise ValueError(f"bucket must be an int >= 1, got {bucket!r}")
    if not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    n = x.size
    if k >= bucket:
        return topk(x, n)
    if k == 0 or n == 0:
        return topk(x, 0)
    nb = -(-n // bucket)
    mag = np.zeros(nb * bucket, dtype=np.abs(x[:1]).dtype)
    np.abs(x, out=mag[:n])
    mag[n:] = -1  # padding never beats a real entry
    sel = np.argpartition(mag.reshape(nb, bucket), bucket - k, axis=1)[:, bucket - k:]
    idx = (sel + (np.arange(nb) * bucket)[:, None]).reshape(-1)
    idx = np.sort(idx[idx < n]).astype(index_dtype(n))
    return SparseVector(idx, x[idx], n, check=False)


def to_dense(x: SparseVector | np.ndarray) -> np.ndarray:
    """A dense view of a collective's result: ``x`` itself when dense."""
    return x.to_dense() if isinstance(x, SparseVector) else x
