"""The compute kernels of the sparse allreduce schedules (``sparse.*``): :data:`SPARSE_KERNELS`.

Each reads stream buffers from its input slots and received frames from its messages, writes
its result into its output slot and returns it as the payload of the next send (see
:mod:`.sparse_sched` for where they sit in the schedules and :mod:`.sparse` for the stream
layout). Params are JSON: ``n`` (vector length), ``dtype`` (wire string), ``delta`` (``None``:
never switch to dense), and per kernel ``lo``/``hi`` (a range) and ``pos`` (this rank).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...buffers import dtype_to_wire
from ...sched import BUILTIN_KERNELS, Payload
from ...transport.frames import Format
from . import quantize as qsgd
from .streams import (
    SparseVector,
    decode_piece,
    dense_view,
    index_dtype,
    read_stream,
    scatter_sum,
    sparse_views,
    stream_payload,
    write_piece,
)
from .vector import _Union as Union

__all__ = ["SPARSE_KERNELS", "assemble", "partition", "reduce_block"]


def partition(size: int, world_size: int) -> list[tuple[int, int]]:
    """The P index ranges ``[lo, hi)`` of the split algorithms (sizes differ by at most one;
    some are empty when ``size < P``)."""
    return [(j * size // world_size, (j + 1) * size // world_size) for j in range(world_size)]


# -- kernels -----------------------------------------------------------------------------------

def _plan(params: Mapping[str, Any]) -> tuple[int, np.dtype[Any], float]:
    d = params["delta"]
    return int(params["n"]), np.dtype(params["dtype"]), math.inf if d is None else float(d)


def _range_delta(delta: float, n: int, lo: int, hi: int) -> float:
    """The switch point of a range: ``delta`` scaled to the range's share of the vector."""
    return delta if math.isinf(delta) or n == 0 else delta * (hi - lo) / n


def _k_emit(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
            msgs: Sequence[Any]) -> Payload:
    n, dt, _ = _plan(params)
    return stream_payload(inputs[0], n, dt)


def _k_store(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
             msgs: Sequence[Any]) -> None:
    n, dt, _ = _plan(params)
    write_piece(out, decode_piece(msgs[0], n, 0, n, dt))


def _k_merge(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
             msgs: Sequence[Any]) -> Payload:
    """``out = stream(inputs[0]) + message``; dense once the union passes delta."""
    n, dt, delta = _plan(params)
    a = read_stream(inputs[0], n, dt)
    b = decode_piece(msgs[0], n, 0, n, dt)
    if isinstance(a, SparseVector) and isinstance(b, SparseVector):
        u = Union(a.indices, a.values, b.indices, b.values, dt)
        if u.size <= delta:
            oi, ov = sparse_views(out, u.size, n, dt)
            u.write(oi, ov)
            return stream_payload(out, n, dt)
    d = dense_view(out, n, dt)
    # 0 + a + b in either order: partners that merge the same pair agree bit for bit
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        np.add(a, b, out=d)
    else:
        d.fill(0)
        for x in (a, b):
            if isinstance(x, SparseVector):
                d[x.indices] += x.values
            else:
                d += x
    return stream_payload(out, n, dt)


def _slice(x: SparseVector | np.ndarray, lo: int, hi: int) -> SparseVector | np.ndarray:
    if isinstance(x, np.ndarray):
        return x[lo:hi]
    a, b = np.searchsorted(x.indices, (lo, hi))
    return SparseVector(x.indices[a:b], x.values[a:b], x.size, check=False)


def _k_piece(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
             msgs: Sequence[Any]) -> Payload:
    """The piece of range ``lo:hi`` of the input stream ``inputs[0]``, packed into its own
    region of the staging slot ``inputs[1]`` (where its entries sit in the input, so pieces
    never overlap) or dense past the range's switch point."""
    n, dt, delta = _plan(params)
    lo, hi = int(params["lo"]), int(params["hi"])
    x = read_stream(inputs[0], n, dt)
    wire = dtype_to_wire(dt)
    if isinstance(x, np.ndarray):
        return Payload(x[lo:hi], wire, (hi - lo,), int(Format.DENSE))
    a, b = (int(v) for v in np.searchsorted(x.indices, (lo, hi)))
    m = b - a
    if m > _range_delta(delta, n, lo, hi):
        d = np.zeros(hi - lo, dt)
        d[x.indices[a:b] - lo] = x.values[a:b]
        return Payload(d, wire, (hi - lo,), int(Format.DENSE))
    c = x.indices.itemsize
    region = inputs[1][a * (c + dt.itemsize): b * (c + dt.itemsize)]
    region[: m * c].view(x.indices.dtype)[:] = x.indices[a:b]
    region[m * c:].view(dt)[:] = x.values[a:b]
    return Payload(region, wire, (n, m), int(Format.SPARSE))


def _pieces(inputs: Sequence[Any], params: Mapping[str, Any], msgs: Sequence[Any]
            ) -> tuple[list[SparseVector | np.ndarray], int, int]:
    """The pieces of this rank's range in rank order: the received ones and its own."""
    n, dt, _ = _plan(params)
    lo, hi = int(params["lo"]), int(params["hi"])
    pieces = [decode_piece(m, n, lo, hi, dt) for m in msgs]
    pieces.insert(int(params["pos"]), _slice(read_stream(inputs[0], n, dt), lo, hi))
    return pieces, lo, hi


def _k_reduce(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
              msgs: Sequence[Any]) -> Payload:
    """Sum the pieces of this rank's range into the block stream ``out``."""
    n, dt, delta = _plan(params)
    pieces, lo, hi = _pieces(inputs, params, msgs)
    return reduce_block(out, pieces, lo, hi, n, dt, delta)


def reduce_block(out: np.ndarray, pieces: Sequence[SparseVector | np.ndarray], lo: int, hi: int,
                 n: int, dt: np.dtype[Any], delta: float) -> Payload:
    """Sum ``pieces`` (of the range ``lo:hi``, in rank order) into the block stream ``out``:
    sparse while the sum has at most the range's share of ``delta`` entries, else dense."""
    rd = _range_delta(delta, n, lo, hi)
    sparse = [x for x in pieces if isinstance(x, SparseVector)]
    total = sum(x.nnz for x in sparse)
    if len(sparse) == len(pieces) and total <= rd:
        # the pieces are sorted runs: one stable sort merges them (cheaper than a dense pass)
        idx = np.concatenate([x.indices for x in sparse])
        vals = np.concatenate([x.values for x in sparse])
        order = np.argsort(idx, kind="stable")  # rank order among equal indices
        idx, vals = idx[order], vals[order]
        if idx.size:
            starts = np.flatnonzero(np.concatenate(([True], idx[1:] != idx[:-1])))
            idx, vals = idx[starts], np.add.reduceat(vals, starts)
        oi, ov = sparse_views(out, idx.size, n, dt)
        oi[:] = idx
        ov[:] = vals
        return stream_payload(out, n, dt)
    acc = dense_view(out, hi - lo, dt)
    scatter_sum(acc, pieces, lo)
    nz = int(np.count_nonzero(acc))
    if nz <= rd:
        idx = np.flatnonzero(acc)
        vals = acc[idx]
        oi, ov = sparse_views(out, nz, n, dt)  # idx and vals are copies: acc may be overwritten
        ov[:] = vals
        oi[:] = idx + lo
    return stream_payload(out, n, dt)


def _k_assemble(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
                msgs: Sequence[Any]) -> None:
    """Concatenate the reduced ranges, in range order, into the result stream ``out``."""
    n, dt, delta = _plan(params)
    world = len(msgs) + 1
    parts = partition(n, world)
    others = [j for j in range(world) if j != int(params["pos"])]
    got = {j: decode_piece(m, n, parts[j][0], parts[j][1], dt)
           for j, m in zip(others, msgs, strict=True)}
    got[int(params["pos"])] = read_stream(inputs[0], n, dt)
    assemble(out, [got[j] for j in range(world)], n, dt, delta)


def assemble(out: np.ndarray, ordered: Sequence[SparseVector | np.ndarray], n: int,
             dt: np.dtype[Any], delta: float) -> None:
    """Concatenate the reduced ranges ``ordered`` (of :func:`partition`'s ranges, in order)
    into the result stream ``out``: sparse when the sum has at most ``delta`` nonzeros,
    whichever ranges went dense."""
    parts = partition(n, len(ordered))
    counts = [b.nnz if isinstance(b, SparseVector) else int(np.count_nonzero(b))
              for b in ordered]
    total = sum(counts)
    if total <= delta:
        oi, ov = sparse_views(out, total, n, dt)
        at = 0
        for (lo, _hi), b, m in zip(parts, ordered, counts, strict=True):
            if isinstance(b, SparseVector):
                oi[at:at + m] = b.indices
                ov[at:at + m] = b.values
            else:
                nz = np.flatnonzero(b)
                oi[at:at + m] = nz + lo
                ov[at:at + m] = b[nz]
            at += m
        return
    _fill_dense(dense_view(out, n, dt), ordered)


def _fill_dense(d: np.ndarray, ordered: Sequence[SparseVector | np.ndarray]) -> None:
    """Write the reduced ranges ``ordered`` (sparse or dense) into the dense vector ``d``."""
    for (lo, hi), b in zip(partition(d.size, len(ordered)), ordered, strict=True):
        if isinstance(b, SparseVector):
            d[lo:hi] = 0
            d[b.indices] = b.values
        else:
            d[lo:hi] = b


# -- the shared-memory split allgather (:mod:`.shm`) ---------------------------------------------

def _region_stream(region: np.ndarray, n: int, dt: np.dtype[Any], q: int, what: str
                   ) -> SparseVector | np.ndarray:
    """The stream rank ``q`` wrote into ``region`` of its segment, its header checked (form,
    count within the region); ``ValueError`` naming ``q`` otherwise."""
    if region.size < 16:
        raise ValueError(f"rank {q}'s {what} region is too small for a stream")
    flag, count = (int(v) for v in region[:16].view(np.int64))
    per = dt.itemsize if flag == 1 else index_dtype(n).itemsize + dt.itemsize
    if flag not in (0, 1) or count < 0 or count > n or 16 + count * per > region.size:
        raise ValueError(f"rank {q} wrote a malformed {what} stream into its segment "
                         f"(form {flag}, {count} entries, for a vector of {n})")
    x = read_stream(region, n, dt)
    if isinstance(x, SparseVector) and x.nnz and (x.indices[0] < 0 or x.indices[-1] >= n):
        # outside every range: no rank's window would see it (the ranges tile 0..n-1)
        raise ValueError(f"rank {q}'s {what} has indices outside 0..{n - 1}")
    return x


def _checked_range(x: SparseVector | np.ndarray, n: int, lo: int, hi: int, q: int,
                   what: str) -> SparseVector | np.ndarray:
    """The part in ``lo:hi`` of ``x``, which rank ``q`` wrote: its input (the whole vector of
    ``n`` entries) or, ``what == "block"``, its reduced range (every entry in the range). A
    dense ``x`` must have that many entries, a sparse one's indices in the range must be
    sorted and unique; ``ValueError`` naming ``q`` otherwise."""
    block = what == "block"
    if isinstance(x, np.ndarray):
        length = hi - lo if block else n
        if x.size != length:
            raise ValueError(f"rank {q}'s dense {what} has {x.size} entries, expected {length}")
        return x if block else x[lo:hi]
    part = _slice(x, lo, hi)
    assert isinstance(part, SparseVector)
    idx = part.indices
    if (block and part.nnz != x.nnz) or (idx.size and (
            idx[0] < lo or idx[-1] >= hi
            or (idx.size > 1 and not bool(np.all(idx[1:] > idx[:-1]))))):
        raise ValueError(f"rank {q}'s {what} has indices that are not sorted, unique and "
                         f"inside {lo}..{hi - 1}")
    return part


def _k_shm_reduce(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
                  msgs: Sequence[Any]) -> None:
    """Sum range ``lo:hi`` of every rank's input region (``inputs``: the segments in rank
    order) into this rank's block region ``out``."""
    n, dt, delta = _plan(params)
    lo, hi, cap = int(params["lo"]), int(params["hi"]), int(params["input_bytes"])
    pieces = []
    for q, seg in enumerate(inputs):
        x = _region_stream(seg[:cap], n, dt, q, "input")
        pieces.append(_checked_range(x, n, lo, hi, q, "input"))
    if params.get("dense"):
        scatter_sum(dense_view(out, hi - lo, dt), pieces, lo)
    else:
        reduce_block(out, pieces, lo, hi, n, dt, delta)


def _k_shm_assemble(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
                    msgs: Sequence[Any]) -> None:
    """Concatenate every rank's block region (``inputs``: the segments in rank order) into
    the result: the stream ``out``, or with ``dense`` the dense array ``out``."""
    n, dt, delta = _plan(params)
    at = int(params["input_bytes"])
    end = at + int(params["block_bytes"])
    parts = partition(n, len(inputs))
    blocks = [_checked_range(_region_stream(seg[at:end], n, dt, q, "block"), n, lo, hi, q,
                             "block")
              for q, (seg, (lo, hi)) in enumerate(zip(inputs, parts, strict=True))]
    if params.get("dense"):
        _fill_dense(out, blocks)
    else:
        assemble(out, blocks, n, dt, delta)


def _k_reduce_dense(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
                    msgs: Sequence[Any]) -> Payload | None:
    """Sum this rank's range densely into the result; quantise it when asked (then the
    decoded values replace it, so that every rank holds the same numbers)."""
    pieces, lo, _hi = _pieces(inputs, params, msgs)
    scatter_sum(out, pieces, lo)
    bits = params.get("bits")
    if bits is None:
        return None
    seed = (int(inputs[1][0]), int(params["pos"]))
    q = qsgd.quantize(out, int(bits), int(params["bucket"]), seed=seed)
    qsgd.dequantize(q, out=out)
    return qsgd.to_payload(q)


def _k_dequantize(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
                  msgs: Sequence[Any]) -> None:
    q = qsgd.from_message(msgs[0], out.size, out.dtype)
    qsgd.dequantize(q, out=out)


#: the kernels a sparse allreduce schedule names: the built-ins and ``sparse.*`` (frozen)
SPARSE_KERNELS = BUILTIN_KERNELS.extended({
    "sparse.emit": _k_emit, "sparse.store": _k_store, "sparse.merge": _k_merge,
    "sparse.piece": _k_piece, "sparse.reduce": _k_reduce, "sparse.assemble": _k_assemble,
    "sparse.reduce_dense": _k_reduce_dense, "sparse.dequantize": _k_dequantize,
    "sparse.shm_reduce": _k_shm_reduce, "sparse.shm_assemble": _k_shm_assemble}).freeze()
