"""Sparse allreduce over inproc: exact against the dense sum for every algorithm and P, canonical
output, identical results on every rank, message sizes as the model says."""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import Any

import numpy as np
import pytest

from asynccoll.collectives.sparse import SparseVector, default_delta, from_dense, to_dense
from asynccoll.collectives.sparse.kernels import SPARSE_KERNELS
from asynccoll.collectives.sparse.schedules import (
    ALGORITHMS,
    append_sparse_allreduce,
    build_sparse_allreduce,
    choose_algorithm,
    load_stream,
    partition,
    read_result,
    sparse_tags,
)
from asynccoll.comm.sparse import SparseAllreduce, sparse_allreduce
from asynccoll.errors import ExecutionError
from asynccoll.sched import Executor, Schedule, SlotSpec, register_kernel
from asynccoll.testing import inproc_world

PS = [1, 2, 3, 5, 6, 8]
_ids = itertools.count(1000)


def _ints(rng: np.random.Generator, n: int, dtype: Any = np.float32) -> np.ndarray:
    v = rng.integers(1, 9, n) * rng.choice([-1, 1], n)
    return v.astype(dtype)


def make_case(case: str, P: int, N: int, seed: int = 0) -> list[np.ndarray]:
    """Per-rank dense inputs with integer values (sums exact in any order)."""
    rng = np.random.default_rng(seed)
    xs = [np.zeros(N, np.float32) for _ in range(P)]
    if case == "empty":
        return xs
    if case == "identical":
        idx = rng.choice(N, max(1, N // 4), replace=False)
        for x in xs:
            x[idx] = _ints(rng, idx.size)
    elif case == "disjoint":
        perm = rng.permutation(N)
        per = max(1, N // (2 * P))
        for r, x in enumerate(xs):
            idx = perm[r * per:(r + 1) * per]
            x[idx] = _ints(rng, idx.size)
    elif case == "random":
        for x in xs:
            mask = rng.random(N) < 0.2
            x[mask] = _ints(rng, int(mask.sum()))
    elif case == "zero_ranks":  # every other rank contributes nothing
        for r, x in enumerate(xs):
            if r % 2:
                mask = rng.random(N) < 0.3
                x[mask] = _ints(rng, int(mask.sum()))
    elif case == "cancel":  # rank 1 cancels rank 0 exactly: those zeros must be dropped
        xs[0][: N // 2] = _ints(rng, N // 2)
        if P > 1:
            xs[1][: N // 2] = -xs[0][: N // 2]
    elif case == "dense":
        for x in xs:
            x[:] = _ints(rng, N)
    else:
        raise AssertionError(case)
    return xs


def check_canonical(res: SparseVector | np.ndarray, want: np.ndarray) -> None:
    if isinstance(res, SparseVector):
        assert res.size == want.size
        assert res.indices.dtype == np.int32
        if res.nnz:
            assert res.indices[0] >= 0
            assert res.indices[-1] < res.size
            assert np.all(np.diff(res.indices) > 0)
        assert np.all(res.values != 0), "only exact zeros may be dropped, and all of them"
        assert np.array_equal(res.indices, np.flatnonzero(want))
    assert np.array_equal(to_dense(res), want)


def same_bits(results: list[SparseVector | np.ndarray]) -> None:
    first = results[0]
    for r in results[1:]:
        assert type(r) is type(first)
        if isinstance(first, SparseVector):
            assert isinstance(r, SparseVector)
            assert np.array_equal(r.indices, first.indices)
            assert r.values.tobytes() == first.values.tobytes()
        else:
            assert isinstance(r, np.ndarray)
            assert r.tobytes() == first.tobytes()


async def allreduce_all(ts: list[Any], xs: list[Any], **kw: Any) -> list[Any]:
    sid = next(_ids)
    calls = [sparse_allreduce(t, x, sched_id=sid, timeout=20, **kw)
             for t, x in zip(ts, xs, strict=True)]
    return await asyncio.wait_for(asyncio.gather(*calls), 25)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("P", PS)
async def test_exact_against_dense_sum(P: int, algorithm: str) -> None:
    cases = ["empty", "identical", "disjoint", "random", "zero_ranks", "cancel", "dense"]
    sizes = [max(1, P - 1), 37, 256]  # N < P (when P > 1), N not divisible by P, larger
    async with inproc_world(P) as ts:
        for case, N in itertools.product(cases, sizes):
            xs = make_case(case, P, N, seed=N + P)
            want = np.sum(xs, axis=0)
            # half the ranks pass SparseVectors, half dense arrays
            args = [from_dense(x) if r % 2 == 0 else x for r, x in enumerate(xs)]
            res = await allreduce_all(ts, args, algorithm=algorithm)
            for r in res:
                check_canonical(r, want)
            same_bits(res)
            if algorithm == "dsar_split_allgather":
                assert isinstance(res[0], np.ndarray)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("delta", [0, math.inf, None, 5])
async def test_forced_delta_does_not_change_values(algorithm: str, delta: float | None) -> None:
    P, N = 5, 203
    async with inproc_world(P) as ts:
        for case in ("random", "identical", "cancel"):
            xs = make_case(case, P, N, seed=3)
            want = np.sum(xs, axis=0)
            res = await allreduce_all(ts, [from_dense(x) for x in xs], algorithm=algorithm,
                                      delta=delta)
            for r in res:
                check_canonical(r, want)
            same_bits(res)
            if delta == 0 and want.any():
                assert isinstance(res[0], np.ndarray)
            if delta == math.inf and algorithm != "dsar_split_allgather":
                assert isinstance(res[0], SparseVector)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["ssar_recursive_double", "ssar_split_allgather"])
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("offset", [-1, 0, 1])
async def test_result_nnz_around_delta(P: int, algorithm: str, offset: int) -> None:
    """Disjoint index sets whose union has delta-1, delta, delta+1 entries: sparse up to delta,
    dense past it."""
    N = 96
    delta = default_delta(N, np.float32)  # 48
    total = delta + offset
    rng = np.random.default_rng(total)
    perm = rng.permutation(N)[:total]
    xs = [np.zeros(N, np.float32) for _ in range(P)]
    for r, chunk in enumerate(np.array_split(perm, P)):
        xs[r][chunk] = _ints(rng, chunk.size)
    want = np.sum(xs, axis=0)
    async with inproc_world(P) as ts:
        res = await allreduce_all(ts, [from_dense(x) for x in xs], algorithm=algorithm)
    for r in res:
        check_canonical(r, want)
        assert isinstance(r, SparseVector) == (offset <= 0)
    same_bits(res)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("offset", [-1, 0, 1])
async def test_input_nnz_around_delta(algorithm: str, offset: int) -> None:
    """One rank's own vector sits at delta-1, delta, delta+1 nonzeros (sparse vs dense input)."""
    P, N = 3, 80
    delta = default_delta(N, np.float32)
    rng = np.random.default_rng(offset + 7)
    xs = [np.zeros(N, np.float32) for _ in range(P)]
    xs[0][rng.choice(N, delta + offset, replace=False)] = 1.0
    xs[1][rng.choice(N, 4, replace=False)] = 2.0
    want = np.sum(xs, axis=0)
    async with inproc_world(P) as ts:
        for args in ([from_dense(x) for x in xs], xs):
            res = await allreduce_all(ts, args, algorithm=algorithm)
            for r in res:
                check_canonical(r, want)
            same_bits(res)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
async def test_float_results_bitwise_identical(algorithm: str) -> None:
    """Random (non-integer) values: sums round, but every rank rounds the same way."""
    P, N = 6, 500
    rng = np.random.default_rng(11)
    xs = []
    for _ in range(P):
        x = np.zeros(N, np.float32)
        m = rng.random(N) < 0.3
        x[m] = rng.standard_normal(int(m.sum()))
        xs.append(x)
    async with inproc_world(P) as ts:
        res = await allreduce_all(ts, [from_dense(x) for x in xs], algorithm=algorithm)
    same_bits(res)
    assert np.allclose(to_dense(res[0]), np.sum(xs, axis=0), atol=1e-5)


def _send_bytes(op: SparseAllreduce) -> list[tuple[int, int, int]]:
    """(tag, peer, bytes) of every send of the last execution."""
    ex = op.executor
    assert ex is not None
    row = ex.trace.nbytes[ex.completed % ex.trace.capacity]
    return [(o.tag, o.peer, int(row[i])) for i, o in enumerate(op.schedule.ops)
            if o.kind == "send"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("P", [2, 3, 4, 5])
async def test_message_sizes_never_exceed_dense(P: int, algorithm: str) -> None:
    N = 300
    isize, c = 4, 4
    parts = partition(N, P)
    async with inproc_world(P) as ts:
        for case in ("random", "dense", "identical", "disjoint"):
            xs = make_case(case, P, N, seed=5)
            sid = next(_ids)
            ops = [SparseAllreduce(t, N, np.float32, sched_id=sid, algorithm=algorithm)
                   for t in ts]
            await asyncio.wait_for(asyncio.gather(
                *[o.run(from_dense(x), timeout=10) for o, x in zip(ops, xs, strict=True)]), 15)
            for r, o in enumerate(ops):
                for tag, peer, nbytes in _send_bytes(o):
                    if algorithm == "ssar_recursive_double":
                        dense = N * isize
                    elif tag == 3:  # split: the piece of the receiver's range
                        dense = (parts[peer][1] - parts[peer][0]) * isize
                    else:  # gather: this rank's range
                        dense = (parts[r][1] - parts[r][0]) * isize
                    assert nbytes <= dense, (case, r, tag, peer, nbytes, dense)
                    if case != "dense":
                        # sparse frames carry (index, value) pairs: a multiple of c + isize
                        assert nbytes % (c + isize) == 0 or nbytes == dense
                o.close()


@pytest.mark.timeout(30)
async def test_recursive_doubling_bytes_match_model() -> None:
    """Identical index sets of k entries: every stage moves exactly k (index, value) pairs."""
    P, N, k = 4, 1000, 50
    idx = np.sort(np.random.default_rng(0).choice(N, k, replace=False)).astype(np.int32)
    xs = [SparseVector(idx, np.full(k, r + 1, np.float32), N) for r in range(P)]
    sid = next(_ids)
    async with inproc_world(P) as ts:
        ops = [SparseAllreduce(t, N, np.float32, sched_id=sid,
                               algorithm="ssar_recursive_double") for t in ts]
        res = await asyncio.wait_for(asyncio.gather(
            *[o.run(x, timeout=10) for o, x in zip(ops, xs, strict=True)]), 15)
        for o in ops:
            sent = _send_bytes(o)
            assert len(sent) == 2  # log2(4) stages
            assert all(b == k * 8 for _, _, b in sent)
            o.close()
    assert isinstance(res[0], SparseVector)
    assert np.array_equal(res[0].values, np.full(k, 10, np.float32))


@pytest.mark.timeout(30)
async def test_quantized_dsar_identical_and_close() -> None:
    P, N = 4, 3000
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(N).astype(np.float32) for _ in range(P)]
    async with inproc_world(P) as ts:
        for bits in (2, 4, 8):
            res = await allreduce_all(ts, xs, quantize=bits)
            same_bits(res)
            want = np.sum(xs, axis=0)
            err = np.abs(res[0] - want)
            # one level of the bucket's scale at most
            assert err.max() <= np.abs(want).max() / ((1 << (bits - 1)) - 1) + 1e-5
        # two runs of one reusable op use different random bits but both decode on levels
        sid = next(_ids)
        ops = [SparseAllreduce(t, N, np.float32, sched_id=sid, quantize=4) for t in ts]
        a = await asyncio.gather(*[o.run(x, timeout=10) for o, x in zip(ops, xs, strict=True)])
        b = await asyncio.gather(*[o.run(x, timeout=10) for o, x in zip(ops, xs, strict=True)])
        for o in ops:
            o.close()
        same_bits(a)
        same_bits(b)
        assert not np.array_equal(a[0], b[0])
        assert ops[0].executor is not None
        assert ops[0].executor.completed == 1


@pytest.mark.timeout(30)
async def test_reusable_op_keeps_earlier_results() -> None:
    P, N = 3, 64
    async with inproc_world(P) as ts:
        sid = next(_ids)
        ops = [SparseAllreduce(t, N, np.float32, sched_id=sid,
                               algorithm="ssar_split_allgather") for t in ts]
        first = await asyncio.gather(*[o.run(make_case("random", P, N, 1)[r], timeout=10)
                                       for r, o in enumerate(ops)])
        keep = to_dense(first[0]).copy()
        await asyncio.gather(*[o.run(make_case("random", P, N, 2)[r], timeout=10)
                               for r, o in enumerate(ops)])
        assert np.array_equal(to_dense(first[0]), keep)
        assert np.array_equal(keep, np.sum(make_case("random", P, N, 1), axis=0))
        for o in ops:
            o.close()


def test_choose_algorithm_follows_density_and_p() -> None:
    N = 1 << 24
    assert choose_algorithm(0.0001, 8, N) == "ssar_recursive_double"
    assert choose_algorithm(0.00781, 8, N) == "ssar_split_allgather"
    assert choose_algorithm(0.1, 8, N) == "dsar_split_allgather"
    assert choose_algorithm(None, 8, N) == "ssar_split_allgather"
    assert choose_algorithm(0.5, 1, N) == "ssar_recursive_double"
    with pytest.raises(ValueError, match="density"):
        choose_algorithm(1.5, 4, N)


def test_schedules_are_data_and_validate_arguments() -> None:
    for algorithm in ALGORITHMS:
        for P in (1, 3, 8):
            for r in range(P):
                s = build_sparse_allreduce(r, P, 100, np.float32, algorithm=algorithm)
                assert Schedule.from_dict(s.to_dict()) == s
                assert s.meta["result"] in s.slots
    with pytest.raises(ValueError, match="algorithm"):
        build_sparse_allreduce(0, 2, 10, algorithm="ring")
    with pytest.raises(ValueError, match="quantize"):
        build_sparse_allreduce(0, 2, 10, algorithm="ssar_split_allgather", quantize=4)
    with pytest.raises(ValueError, match="bits"):
        build_sparse_allreduce(0, 2, 10, algorithm="dsar_split_allgather", quantize=3)
    with pytest.raises(ValueError, match="delta"):
        build_sparse_allreduce(0, 2, 10, delta=-1)


@pytest.mark.timeout(30)
async def test_bad_input_is_rejected_by_name() -> None:
    async with inproc_world(1) as ts:
        op = SparseAllreduce(ts[0], 10, np.float32, sched_id=next(_ids))
        with pytest.raises(ValueError, match="x has"):
            await op.run(np.zeros(11, np.float32))
        with pytest.raises(ValueError, match="dtype"):
            await op.run(SparseVector([1], np.array([1.0]), 10))
        with pytest.raises(TypeError, match="x must"):
            await op.run([1.0] * 10)  # type: ignore[arg-type]
        op.close()


@pytest.mark.timeout(30)
async def test_mismatched_sizes_across_ranks_fail_clearly() -> None:
    async with inproc_world(2) as ts:
        sid = next(_ids)
        results = await asyncio.gather(
            sparse_allreduce(ts[0], np.ones(10, np.float32), sched_id=sid, timeout=5,
                             algorithm="ssar_recursive_double"),
            sparse_allreduce(ts[1], np.ones(12, np.float32), sched_id=sid, timeout=5,
                             algorithm="ssar_recursive_double"),
            return_exceptions=True)
    assert all(isinstance(r, ExecutionError) for r in results), results
    assert "dense piece" in str(results[0])


@pytest.mark.timeout(60)
async def test_cupy_input_gives_cupy_result() -> None:
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # CUDA driver missing
        pytest.skip(f"no usable CUDA device: {exc}")
    P, N = 3, 100
    xs = make_case("random", P, N, seed=4)
    want = np.sum(xs, axis=0)
    async with inproc_world(P) as ts:
        for algorithm in ALGORITHMS:
            res = await allreduce_all(ts, [cupy.asarray(x) for x in xs], algorithm=algorithm)
            for r in res:
                dense = r.to_dense() if isinstance(r, SparseVector) else r
                assert type(dense).__module__.startswith("cupy")
                assert np.array_equal(cupy.asnumpy(dense), want)


def _load_kernel(out: Any, inputs: Any, params: Any, msgs: Any) -> None:
    load_stream(out, inputs[0], int(params["n"]), np.float32, float(params["delta"]))


#: the sparse allreduce's kernels and this module's loader
KERNELS = SPARSE_KERNELS.extended()
register_kernel(KERNELS, "test.sparse_load", _load_kernel)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
async def test_appended_after_a_snapshot_op(algorithm: str) -> None:
    """The appending form composes: a kernel fills the input stream (as a partial collective's
    snapshot would), the sparse allreduce waits for it, under a slot prefix and a tag base."""
    P, N = 3, 150
    xs = make_case("random", P, N, seed=8)
    delta = default_delta(N, np.float32)
    async with inproc_world(P) as ts:
        exs, bufs_all, results = [], [], []
        for r, t in enumerate(ts):
            s = Schedule(r, P, "composed")
            s.declare("x", SlotSpec(N, "<f4"))
            s.nop(label="unrelated op")
            pre = "sp_"
            src = pre + ("s0" if algorithm == "ssar_recursive_double" else "in")
            load = s.compute("test.sparse_load", ["x"], src, n=N, delta=float(delta))
            done, src_slot, res = append_sparse_allreduce(
                s, N, np.float32, algorithm=algorithm, prefix=pre, tag_base=100, after=[load])
            assert src_slot == src
            s.final = done
            s.commit(KERNELS)
            assert all(o.tag == 0 or 100 <= o.tag < 100 + sparse_tags(P) for o in s.ops
                       if o.kind in ("send", "recv"))
            bufs = {k: np.empty(v.count or 0, np.dtype(v.dtype or "u1"))
                    for k, v in s.slots.items()}
            bufs["x"][:] = xs[r]
            exs.append(Executor(s, t, bufs, sched_id=77, kernels=KERNELS))
            bufs_all.append(bufs)
            results.append(res)
        await asyncio.wait_for(asyncio.gather(*[ex.start() for ex in exs]), 10)
        want = np.sum(xs, axis=0)
        outs = [read_result(b[res], N, np.float32) for b, res in zip(bufs_all, results,
                                                                      strict=True)]
        for o in outs:
            check_canonical(o, want)
        same_bits(outs)
