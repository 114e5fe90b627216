"""SparseVector, its constructors, top-k, merges and the sparse-stream wire format."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asynccoll.collectives.sparse import (
    SparseAccumulator,
    SparseVector,
    add,
    bucket_topk,
    decode_piece,
    default_delta,
    from_dense,
    from_pairs,
    index_dtype,
    read_stream,
    stream_capacity,
    stream_payload,
    sum_pieces,
    to_dense,
    topk,
    write_piece,
)
from asynccoll.errors import AsyncCollError, ProtocolError
from asynccoll.transport.frames import PROTOCOL_VERSION, Format, Header, Message


def sparse_of(rng: np.random.Generator, n: int, p: float) -> SparseVector:
    x = np.zeros(n, np.float32)
    m = rng.random(n) < p
    x[m] = rng.integers(-9, 10, int(m.sum()))
    return from_dense(x)


def test_construction_validates_and_keeps_arrays() -> None:
    idx = np.array([1, 4, 7], np.int32)
    vals = np.array([1.0, -2.0, 3.0], np.float32)
    v = SparseVector(idx, vals, 10)
    assert v.indices is idx
    assert v.values is vals
    assert v.nnz == 3
    assert v.density == 0.3
    assert v.dtype == np.float32
    assert np.array_equal(v.to_dense(), [0, 1, 0, 0, -2, 0, 0, 3, 0, 0])
    with pytest.raises(ValueError, match="strictly increasing"):
        SparseVector([4, 1], [1.0, 2.0], 10)
    with pytest.raises(ValueError, match="strictly increasing"):
        SparseVector([1, 1], [1.0, 2.0], 10)
    with pytest.raises(ValueError, match=r"0\.\.9"):
        SparseVector([10], [1.0], 10)
    with pytest.raises(ValueError, match=r"0\.\.9"):
        SparseVector([-1], [1.0], 10)
    with pytest.raises(ValueError, match="differ in length"):
        SparseVector([1, 2], [1.0], 10)
    with pytest.raises(ValueError, match="size"):
        SparseVector([], [], -1)
    with pytest.raises(TypeError, match="values"):
        SparseVector([1], np.array([True]), 10)
    with pytest.raises(TypeError, match="indices"):
        SparseVector(np.array([1.0]), [1.0], 10)


def test_index_dtype_by_size() -> None:
    assert index_dtype(10) == np.int32
    assert index_dtype((1 << 31) - 1) == np.int32
    assert index_dtype(1 << 31) == np.int64
    assert SparseVector(np.array([3], np.int64), [1.0], 5).indices.dtype == np.int32


def test_from_pairs_coalesces_duplicates_in_order() -> None:
    v = from_pairs([5, 1, 5, 3, 1], np.array([1.0, 2.0, 3.0, 4.0, 5.0]), 8)
    assert np.array_equal(v.indices, [1, 3, 5])
    assert np.array_equal(v.values, [7.0, 4.0, 4.0])
    with pytest.raises(ValueError, match=r"0\.\.7"):
        from_pairs([8], [1.0], 8)


def test_topk_selects_largest_magnitudes() -> None:
    x = np.array([0.5, -7.0, 3.0, 0.0, 6.0, -1.0], np.float32)
    v = topk(x, 3)
    assert np.array_equal(v.indices, [1, 2, 4])
    assert np.array_equal(v.values, [-7.0, 3.0, 6.0])
    assert topk(x, 0).nnz == 0
    assert topk(x, 6).nnz == 6
    with pytest.raises(ValueError, match="k must"):
        topk(x, 7)


def test_bucket_topk_per_bucket() -> None:
    x = np.array([1, 9, 2, 3, -8, 0, 5, 4, 7, -6], np.float32)
    v = bucket_topk(x, 2, bucket=4)  # buckets [1 9 2 3] [-8 0 5 4] [7 -6]
    assert np.array_equal(v.indices, [1, 3, 4, 6, 8, 9])
    assert np.array_equal(v.values, x[v.indices])
    assert bucket_topk(x, 4, bucket=4).nnz == 10
    rng = np.random.default_rng(0)
    y = rng.standard_normal(5000).astype(np.float32)
    w = bucket_topk(y, 8, 512)
    assert w.nnz == 8 * 9 + min(8, 5000 - 9 * 512)
    for b in range(0, 5000, 512):  # each kept entry beats every dropped one of its bucket
        seg = np.abs(y[b:b + 512])
        kept = (w.indices >= b) & (w.indices < b + 512)
        kmin = np.abs(w.values[kept]).min()
        assert np.sort(seg)[-int(kept.sum())] == kmin


@given(st.integers(1, 300), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(0, 2**31))
def test_add_equals_dense_sum_and_commutes(n: int, pa: float, pb: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, b = sparse_of(rng, n, pa), sparse_of(rng, n, pb)
    want = a.to_dense() + b.to_dense()
    for delta in (None, 0, math.inf, n // 3):
        ab, ba = add(a, b, delta), add(b, a, delta)
        assert np.array_equal(to_dense(ab), want)
        assert type(ab) is type(ba)
        assert to_dense(ab).tobytes() == to_dense(ba).tobytes()
        if isinstance(ab, SparseVector):
            assert np.all(np.diff(ab.indices) > 0)
            assert ab.nnz == np.union1d(a.indices, b.indices).size
    assert isinstance(a + b, (SparseVector, np.ndarray))


def test_add_switches_to_dense_past_delta() -> None:
    n = 64
    d = default_delta(n, np.float32)
    assert d == 32
    a = SparseVector(np.arange(0, 32, dtype=np.int32), np.ones(32, np.float32), n)
    b = SparseVector(np.arange(31, 32, dtype=np.int32), np.ones(1, np.float32), n)
    assert isinstance(add(a, b), SparseVector)  # union 32 == delta
    c = SparseVector(np.arange(32, 33, dtype=np.int32), np.ones(1, np.float32), n)
    assert isinstance(add(a, c), np.ndarray)  # union 33 > delta


@given(st.integers(1, 200), st.integers(1, 6), st.integers(0, 2**31))
def test_sum_pieces_matches_dense(n: int, k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lo, hi = n // 4, n - n // 4
    pieces: list[SparseVector | np.ndarray] = []
    want = np.zeros(hi - lo, np.float32)
    for i in range(k):
        v = sparse_of(rng, n, rng.random())
        keep = (v.indices >= lo) & (v.indices < hi)
        piece = SparseVector(v.indices[keep], v.values[keep], n, check=False)
        if i % 3 == 2:
            d = np.zeros(hi - lo, np.float32)
            d[piece.indices - lo] = piece.values
            pieces.append(d)
        else:
            pieces.append(piece)
        want[piece.indices - lo] += piece.values
    for delta in (0.0, math.inf, (hi - lo) / 2):
        got = sum_pieces(pieces, lo, hi, n, np.float32, delta)
        if isinstance(got, SparseVector):
            dense = np.zeros(hi - lo, np.float32)
            dense[got.indices - lo] = got.values
            assert np.all(got.values != 0)
        else:
            dense = got
        assert np.array_equal(dense, want)


def test_accumulator_sums_stale_contributions() -> None:
    rng = np.random.default_rng(4)
    n = 200
    acc = SparseAccumulator(n, np.float32)
    assert acc.take().nnz == 0
    want = np.zeros(n, np.float32)
    for i in range(12):
        v = sparse_of(rng, n, 0.05 * (i + 1))
        acc.add(v if i % 4 else v.to_dense())
        want += v.to_dense()
    assert acc.count == 12
    assert np.array_equal(to_dense(acc.take()), want)
    assert acc.count == 0
    with pytest.raises(ValueError, match="size"):
        acc.add(SparseVector([], np.array([], np.float32), n + 1))


def _msg(payload: object, dtype: str, shape: tuple[int, ...], fmt: int, src: int = 1) -> Message:
    mv = memoryview(bytearray(memoryview(payload).cast("B")))  # type: ignore[arg-type]
    h = Header(PROTOCOL_VERSION, 0, 1, 0, 0, src, dtype, shape, fmt, len(mv))
    return Message(h, mv)


def test_stream_round_trip_sparse_and_dense() -> None:
    rng = np.random.default_rng(1)
    n = 100
    v = sparse_of(rng, n, 0.2)
    buf = np.empty(stream_capacity(n, np.float32, default_delta(n, np.float32)), np.uint8)
    write_piece(buf, v)
    back = read_stream(buf, n, np.float32)
    assert back == v
    p = stream_payload(buf, n, np.float32)
    assert p.fmt == Format.SPARSE
    assert p.shape == (n, v.nnz)
    assert len(memoryview(p.data)) == v.nnz * 8
    got = decode_piece(_msg(p.data, p.dtype, p.shape, p.fmt), n, 0, n, np.float32)
    assert got == v
    d = v.to_dense()
    write_piece(buf, d)
    p = stream_payload(buf, n, np.float32)
    assert p.fmt == Format.DENSE
    assert p.shape == (n,)
    got_d = decode_piece(_msg(p.data, p.dtype, p.shape, p.fmt), n, 0, n, np.float32)
    assert isinstance(got_d, np.ndarray)
    assert np.array_equal(got_d, d)
    # capacity with delta = inf holds a full sparse stream
    assert stream_capacity(n, np.float32, math.inf) == 16 + n * 8


def test_decode_rejects_malformed_pieces() -> None:
    n = 50
    pairs = np.concatenate([np.array([3, 2], np.int32).view(np.uint8),
                            np.array([1, 1], np.float32).view(np.uint8)])
    with pytest.raises(ProtocolError, match="sorted"):
        decode_piece(_msg(pairs, "<f4", (n, 2), Format.SPARSE), n, 0, n, np.float32)
    ok = np.concatenate([np.array([2, 3], np.int32).view(np.uint8),
                         np.array([1, 1], np.float32).view(np.uint8)])
    with pytest.raises(ProtocolError, match="inside"):
        decode_piece(_msg(ok, "<f4", (n, 2), Format.SPARSE), n, 10, 20, np.float32)
    with pytest.raises(ProtocolError, match="malformed"):
        decode_piece(_msg(ok, "<f4", (n, 3), Format.SPARSE), n, 0, n, np.float32)
    with pytest.raises(ProtocolError, match="expected <f4"):
        decode_piece(_msg(ok, "<f8", (n, 1), Format.SPARSE), n, 0, n, np.float32)
    with pytest.raises(ProtocolError, match="dense piece"):
        decode_piece(_msg(np.zeros(4, np.float32), "<f4", (4,), Format.DENSE), n, 0, n,
                     np.float32)
    with pytest.raises(ProtocolError, match="format"):
        decode_piece(_msg(ok, "<f4", (n, 2), Format.RAW), n, 0, n, np.float32)
    assert issubclass(ProtocolError, AsyncCollError)
