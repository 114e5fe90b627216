"""Top-k SGD with error feedback: conservation of what is not yet sent, over the allreduce."""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest

from asynccoll.collectives.sparse import SparseVector
from asynccoll.collectives.sparse.feedback import ErrorFeedback
from asynccoll.comm.sparse import sparse_allreduce
from asynccoll.testing import inproc_world


@pytest.mark.parametrize("bucket", [None, 64])
def test_conservation_exact_over_steps(bucket: int | None) -> None:
    n, T = 1000, 25
    rng = np.random.default_rng(0)
    ef = ErrorFeedback(n, np.float32, k=10 if bucket is None else 2, bucket=bucket)
    sent_sum = np.zeros(n, np.float64)
    grad_sum = np.zeros(n, np.float64)
    for _ in range(T):
        g = rng.integers(-50, 51, n).astype(np.float32)  # integer-valued: additions are exact
        before = ef.residual.copy()
        s = ef.compress(g)
        assert isinstance(s, SparseVector)
        # sent + new residual == old residual + gradient, bit for bit
        assert np.array_equal(s.to_dense() + ef.residual, before + g)
        sent_sum += s.to_dense()
        grad_sum += g
    assert np.array_equal(sent_sum + ef.residual, grad_sum)
    assert ef.step_count == T


def test_sends_the_largest_accumulated_entries() -> None:
    ef = ErrorFeedback(6, np.float32, k=2)
    s = ef.compress(np.array([1, -5, 2, 0, 4, 3], np.float32))
    assert np.array_equal(s.indices, [1, 4])
    # the residual grows until it wins a later step
    s = ef.compress(np.array([1, 0, 2, 0, 0, 0], np.float32))
    assert np.array_equal(s.indices, [2, 5])
    assert np.array_equal(s.values, [4, 3])
    assert np.array_equal(ef.residual, [2, 0, 0, 0, 0, 0])


def test_quantized_conservation_within_rounding() -> None:
    n, T = 2000, 20
    rng = np.random.default_rng(3)
    ef = ErrorFeedback(n, np.float64, density=0.02, quantize=4, seed=9)
    sent = np.zeros(n)
    total = np.zeros(n)
    for _ in range(T):
        g = rng.standard_normal(n)
        s = ef.compress(g)
        sent += s.to_dense()
        total += g
    assert np.allclose(sent + ef.residual, total, atol=1e-9)
    # quantised values differ from the accumulated ones they replace
    assert ef.quantize == 4


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        ErrorFeedback(10)
    with pytest.raises(ValueError, match="density"):
        ErrorFeedback(10, density=2.0)
    with pytest.raises(ValueError, match="bits"):
        ErrorFeedback(10, k=2, quantize=5)
    with pytest.raises(ValueError, match="gradient"):
        ErrorFeedback(10, k=2).compress(np.zeros(11, np.float32))


@pytest.mark.timeout(30)
async def test_step_over_sparse_allreduce() -> None:
    P, n, T = 3, 500, 5
    rng = np.random.default_rng(1)
    efs = [ErrorFeedback(n, np.float32, k=20) for _ in range(P)]
    async with inproc_world(P) as ts:
        total_sent = np.zeros(n, np.float64)
        grads = np.zeros(n, np.float64)
        for t in range(T):
            gs = [rng.integers(-9, 10, n).astype(np.float32) for _ in range(P)]
            for g in gs:
                grads += g
            outs = await asyncio.wait_for(asyncio.gather(*[
                ef.step(g, functools.partial(sparse_allreduce, tr, sched_id=500 + t, timeout=10))
                for ef, g, tr in zip(efs, gs, ts, strict=True)]), 15)
            for o in outs[1:]:
                assert np.array_equal(o, outs[0])
            total_sent += outs[0]
        residuals = np.sum([ef.residual for ef in efs], axis=0)
        assert np.array_equal(total_sent + residuals, grads)
