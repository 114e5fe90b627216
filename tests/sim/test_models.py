"""Compute-time models, policy specs, profiles: shapes, values and the errors they raise."""

from __future__ import annotations

import numpy as np
import pytest

from asynccoll.sim import (
    Constant,
    LinearSkew,
    LinkClass,
    LogNormal,
    Pareto,
    Profile,
    Replayed,
    Shifted,
    SlowGroup,
    Uniform,
    parse_model,
    parse_policies,
    parse_policy,
)


def test_models_shapes_and_patterns() -> None:
    rng = np.random.default_rng(0)
    for m in (Constant(0.1), LinearSkew(1e-3), Shifted(0.05, 0.4), Uniform(), LogNormal(),
              Pareto(), SlowGroup()):
        a = m.sample(5, 8, rng)
        assert a.shape == (5, 8)
        assert (a >= 0).all()
    np.testing.assert_allclose(LinearSkew(1e-3).sample(1, 4, rng)[0], [0, 1e-3, 2e-3, 3e-3])
    sh = Shifted(0.0, 0.3).sample(2, 4, rng)
    np.testing.assert_allclose(sh[1], np.roll(sh[0], -1))
    slow = SlowGroup(0.01, 0.25, 4.0, jitter=0.0).sample(1, 8, rng)[0]
    assert (slow[-2:] == 0.04).all() and (slow[:-2] == 0.01).all()  # noqa: PT018
    rep = Replayed([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(rep.sample(3, 2, rng), [[1, 2], [3, 4], [1, 2]])
    assert set(np.unique(rep.sample(2, 6, rng)[0])) <= {1.0, 2.0}


def test_model_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="skew"):
        LinearSkew(-1.0)
    with pytest.raises(ValueError, match="fraction"):
        SlowGroup(fraction=2.0)
    with pytest.raises(ValueError, match="times"):
        Replayed([1.0, 2.0])
    with pytest.raises(ValueError, match="compute model must be one of"):
        parse_model("gamma:k=1")
    assert parse_model("linear:skew=0.002,base=0.01") == LinearSkew(0.002, 0.01)


def test_policy_specs() -> None:
    assert parse_policy("backup:2", 10).quorum == 8
    assert parse_policy("deadline", 10).quorum == 10
    assert parse_policy("deadline:7", 10).quorum == 7
    assert [p.kind for p in parse_policies("sync, solo,quorum:3", 4)] == ["sync", "solo",
                                                                          "quorum"]
    for bad, msg in (("quorum", "needs a number"), ("quorum:11", "1..10"),
                     ("backup:10", "0..9"), ("solo:3", "takes no argument"),
                     ("fast", "name must be")):
        with pytest.raises(ValueError, match=msg):
            parse_policy(bad, 10)


def test_profile_checks() -> None:
    with pytest.raises(ValueError, match="alpha"):
        LinkClass(-1.0, 0.0)
    link = LinkClass(1e-6, 1e-9)
    with pytest.raises(ValueError, match="reduce_bps"):
        Profile("x", link, link, gamma=1e-6, reduce_bps=0.0)
    p = Profile("x", link, link, gamma=1e-6, reduce_bps=1e9, ranks_per_host=8, cores=2)
    assert p.cpu_scale == 4.0
    with pytest.raises(ValueError, match="not a simulator profile"):
        Profile.from_json({"name": "x"})
