import numpy as np
import pytest

from asynccoll.train.bucket import ParamBucket
from asynccoll.train.updaters import DCASGD, SGD, make_updater


def test_sgd_plain_and_momentum():
    w = np.ones(4)
    SGD(0.5).apply(w, np.full(4, 2.0))
    np.testing.assert_allclose(w, 0.0)
    u = SGD(1.0, momentum=0.5)
    w = np.zeros(2)
    u.apply(w, np.ones(2))  # v = 1
    u.apply(w, np.ones(2))  # v = 1.5
    np.testing.assert_allclose(w, -2.5)


def test_weight_decay_adds_to_gradient():
    w = np.full(3, 2.0)
    SGD(0.1, weight_decay=0.5).apply(w, np.zeros(3))
    np.testing.assert_allclose(w, 2.0 - 0.1 * 1.0)


@pytest.mark.parametrize("adaptive", [False, True])
def test_dcasgd_lambda_zero_is_sgd(adaptive):
    rng = np.random.default_rng(0)
    w, g, wp = rng.normal(size=8), rng.normal(size=8), rng.normal(size=8)
    a, b = w.copy(), w.copy()
    DCASGD(0.1, lam=0.0, adaptive=adaptive).apply(a, g, w_prev=wp)
    SGD(0.1).apply(b, g)
    np.testing.assert_allclose(a, b)


@pytest.mark.parametrize("adaptive", [False, True])
def test_dcasgd_no_compensation_when_weights_equal(adaptive):
    rng = np.random.default_rng(1)
    w, g = rng.normal(size=8), rng.normal(size=8)
    a, b = w.copy(), w.copy()
    DCASGD(0.1, lam=0.9, adaptive=adaptive).apply(a, g, w_prev=w.copy())
    SGD(0.1).apply(b, g)
    np.testing.assert_allclose(a, b)


def test_dcasgd_constant_formula():
    w, wp, g = np.array([1.0, 2.0]), np.array([0.0, 1.0]), np.array([2.0, -1.0])
    expect = w - 0.1 * (g + 0.5 * g * g * (w - wp))
    DCASGD(0.1, lam=0.5).apply(w, g, w_prev=wp)
    np.testing.assert_allclose(w, expect)


def test_dcasgd_adaptive_formula_first_step():
    w, wp, g = np.array([1.0, 2.0]), np.array([0.0, 1.0]), np.array([2.0, -1.0])
    ms = 0.05 * g * g
    expect = w - 0.1 * (g + 0.5 / np.sqrt(ms + 1e-7) * g * g * (w - wp))
    DCASGD(0.1, lam=0.5, adaptive=True, m=0.95).apply(w, g, w_prev=wp)
    np.testing.assert_allclose(w, expect)


def test_make_updater_rejects_unknown():
    with pytest.raises(ValueError, match="unknown updater"):
        make_updater("adam", 0.1)
    assert isinstance(make_updater("dc-asgd-a", 0.1), DCASGD)


def test_bucket_fuses_and_shares_memory():
    ps = [np.arange(6.0).reshape(2, 3), np.arange(3.0)]
    b = ParamBucket(ps)
    assert b.size == 9
    b.flat += 1
    v = b.views()
    np.testing.assert_allclose(v[0], np.arange(6.0).reshape(2, 3) + 1)
    g = b.flatten([np.ones((2, 3)), None])
    np.testing.assert_allclose(g, [1] * 6 + [0] * 3)
    with pytest.raises(ValueError, match="gradient 1 has shape"):
        b.flatten([np.ones((2, 3)), np.ones(4)])


def test_bucket_flat_array_is_used_without_copy():
    w = np.zeros(5)
    b = ParamBucket(w)
    b.flat[:] = 3
    assert w[0] == 3
    g = np.ones(5)
    assert b.flatten(g) is not None
    assert np.shares_memory(b.flatten(g), g)


def test_bucket_rejects_mixed_dtypes():
    with pytest.raises(ValueError, match="one dtype"):
        ParamBucket([np.zeros(2, np.float32), np.zeros(2, np.float64)])
