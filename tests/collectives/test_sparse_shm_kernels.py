"""The kernels and schedule of the sparse split allgather through shared memory
(asynccoll.collectives.sparse.shm), driven by hand over byte arrays that stand for the segments:
every rank's result equals the sum, in the form the network schedule gives, bitwise the same
on every rank; what a peer wrote badly fails naming the peer. Real processes and real segments:
tests/comm/test_comm_sparse_shm.py."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccoll.collectives.sparse import SparseVector
from asynccoll.collectives.sparse.kernels import SPARSE_KERNELS, partition
from asynccoll.collectives.sparse.schedules import load_stream, read_result
from asynccoll.collectives.sparse.shm import build_sparse_shm_allreduce, shm_layout
from asynccoll.collectives.sparse.streams import default_delta


def _kernel_op(sched: Any, name: str) -> Any:
    (op,) = [o for o in sched.ops if o.kind == "compute" and o.kernel == name]
    return op


def _run(xs: list[Any], n: int, dtype: Any = np.float32, delta: float | None = None,
         dense: bool = False, segs: list[np.ndarray] | None = None) -> list[Any]:
    """Every rank's result, the kernels run in the schedule's order: every reduce, then every
    assemble (the two wake-up rounds)."""
    P = len(xs)
    in_cap, blk_cap, d = shm_layout(n, dtype, delta, P)
    if segs is None:
        segs = [np.zeros(in_cap + blk_cap, np.uint8) for _ in range(P)]
        for r in range(P):
            load_stream(segs[r][:in_cap], xs[r], n, np.dtype(dtype), d)
    scheds = [build_sparse_shm_allreduce(r, P, n, dtype, delta=delta, dense=dense)
              for r in range(P)]
    for r in range(P):
        op = _kernel_op(scheds[r], "sparse.shm_reduce")
        SPARSE_KERNELS["sparse.shm_reduce"](segs[r][in_cap:in_cap + blk_cap], segs, op.params,
                                            [])
    out = []
    for r in range(P):
        op = _kernel_op(scheds[r], "sparse.shm_assemble")
        spec = scheds[r].slots[scheds[r].meta["result"]]
        buf = np.empty(spec.count, np.dtype(spec.dtype))
        SPARSE_KERNELS["sparse.shm_assemble"](buf, segs, op.params, [])
        out.append(read_result(buf, n, dtype))
    return out


def _dense(r: Any, n: int) -> np.ndarray:
    return r.to_dense() if isinstance(r, SparseVector) else np.asarray(r)


def _random(rng: np.random.Generator, n: int, density: float, dtype: Any = np.float32,
            sparse: bool = True) -> Any:
    vals = rng.integers(-4, 5, n).astype(dtype)
    x = np.where(rng.random(n) < density, vals, 0).astype(dtype)
    if not sparse:
        return x
    idx = np.flatnonzero(x).astype(np.int32)
    return SparseVector(idx, x[idx], n)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.3, 0.9])
def test_equals_the_sum_in_the_network_form(P: int, density: float) -> None:
    rng = np.random.default_rng(P * 100 + int(density * 10))
    n = 1003
    xs = [_random(rng, n, density, sparse=r % 2 == 0) for r in range(P)]
    want = np.sum([_dense(x, n) for x in xs], axis=0)
    rs = _run(xs, n)
    delta = default_delta(n, np.float32)
    for r in rs:
        assert np.array_equal(_dense(r, n), want)
        # the split allgather's rule: sparse iff the sum has at most delta nonzeros
        assert isinstance(r, SparseVector) == (np.count_nonzero(want) <= delta)
        if isinstance(r, SparseVector):
            assert np.all(r.values != 0)
            assert np.all(np.diff(r.indices) > 0)
    for r in rs[1:]:
        assert type(r) is type(rs[0])
        assert np.array_equal(_dense(r, n), _dense(rs[0], n))


@pytest.mark.parametrize("P", [2, 3, 7])
def test_dense_form_returns_a_dense_array(P: int) -> None:
    rng = np.random.default_rng(P)
    n = 50
    xs = [_random(rng, n, 0.1, np.float64) for _ in range(P)]
    want = np.sum([_dense(x, n) for x in xs], axis=0)
    for r in _run(xs, n, np.float64, dense=True):
        assert isinstance(r, np.ndarray)
        assert r.dtype == np.float64
        assert np.array_equal(r, want)


@pytest.mark.parametrize("delta", [0.0, 3.0, math.inf])
def test_the_switch_point_changes_the_form_never_the_values(delta: float) -> None:
    rng = np.random.default_rng(3)
    n, P = 200, 4
    xs = [_random(rng, n, 0.2, np.int32) for _ in range(P)]
    want = np.sum([_dense(x, n) for x in xs], axis=0)
    rs = _run(xs, n, np.int32, delta=delta)
    for r in rs:
        assert np.array_equal(_dense(r, n), want)
    assert isinstance(rs[0], SparseVector) == (np.count_nonzero(want) <= delta)


def test_fewer_entries_than_ranks() -> None:
    xs = [SparseVector(np.array([r % 3]), np.array([r + 1], np.float32), 3)  # ranges empty
          for r in range(5)]
    for r in _run(xs, 3):
        assert np.array_equal(_dense(r, 3), [1 + 4, 2 + 5, 3.0])


@settings(max_examples=40, deadline=None)
@given(P=st.integers(1, 8), n=st.integers(1, 300), seed=st.integers(0, 2 ** 32 - 1),
       density=st.floats(0, 1))
def test_any_world_any_vector(P: int, n: int, seed: int, density: float) -> None:
    rng = np.random.default_rng(seed)
    xs = [_random(rng, n, density, sparse=bool(rng.integers(2))) for _ in range(P)]
    want = np.sum([_dense(x, n) for x in xs], axis=0)
    for r in _run(xs, n):
        assert np.array_equal(_dense(r, n), want)


# -- what a peer wrote is checked --------------------------------------------------------------

def _segments(P: int, n: int) -> tuple[list[np.ndarray], int, int]:
    rng = np.random.default_rng(0)
    in_cap, blk_cap, d = shm_layout(n, np.float32, None, P)
    segs = [np.zeros(in_cap + blk_cap, np.uint8) for _ in range(P)]
    for r in range(P):
        load_stream(segs[r][:in_cap], _random(rng, n, 0.1), n, np.dtype(np.float32), d)
    return segs, in_cap, blk_cap


@pytest.mark.parametrize("bad", ["form", "count", "order", "dense length", "outside"])
def test_a_malformed_input_fails_naming_its_rank(bad: str) -> None:
    P, n = 3, 300
    segs, _in_cap, _ = _segments(P, n)
    head = segs[1][:16].view(np.int64)
    if bad == "form":
        head[0] = 7
    elif bad == "count":
        head[1] = n + 1
    elif bad == "order":
        count = int(head[1])
        assert count >= 2
        idx = segs[1][16:16 + 4 * count].view(np.int32)
        idx[0], idx[1] = idx[1], idx[0]  # two entries of range 0 out of order
    elif bad == "outside":
        count = int(head[1])
        segs[1][16:16 + 4 * count].view(np.int32)[-1] = n + 5  # in no rank's range
    else:
        head[0], head[1] = 1, n - 1  # a dense input one entry short
    with pytest.raises(ValueError, match="rank 1"):
        _run([None] * P, n, segs=segs)


def test_a_block_outside_its_range_fails_naming_its_rank() -> None:
    P, n = 3, 300
    segs, in_cap, blk_cap = _segments(P, n)
    scheds = [build_sparse_shm_allreduce(r, P, n, np.float32) for r in range(P)]
    for r in range(P):
        op = _kernel_op(scheds[r], "sparse.shm_reduce")
        SPARSE_KERNELS["sparse.shm_reduce"](segs[r][in_cap:in_cap + blk_cap], segs, op.params,
                                            [])
    blk = segs[2][in_cap:in_cap + blk_cap]
    count = int(blk[:16].view(np.int64)[1])
    assert count >= 1
    blk[16:20].view(np.int32)[0] = partition(n, P)[0][0]  # rank 2's block, index of range 0
    op = _kernel_op(scheds[0], "sparse.shm_assemble")
    out = np.empty(scheds[0].slots["res"].count, np.uint8)
    with pytest.raises(ValueError, match="rank 2's block"):
        SPARSE_KERNELS["sparse.shm_assemble"](out, segs, op.params, [])


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="size"):
        build_sparse_shm_allreduce(0, 2, -1)
    with pytest.raises(TypeError, match="dtype"):
        build_sparse_shm_allreduce(0, 2, 10, np.bool_)
    with pytest.raises(ValueError, match="delta"):
        build_sparse_shm_allreduce(0, 2, 10, delta=-1.0)


def test_the_schedule_moves_no_data_over_the_network() -> None:
    s = build_sparse_shm_allreduce(1, 4, 1000)
    msgs = [o for o in s.ops if o.kind in ("send", "recv")]
    assert len(msgs) == 4 * 3  # two rounds, P - 1 each way
    assert all(o.buf is None and o.payload_from < 0 for o in msgs)
