"""Compute-time models, the policies the simulator reads, profiles: shapes, values and the
errors they raise."""

from __future__ import annotations

import numpy as np
import pytest

from asynccoll import (
    Backup,
    Deadline,
    Majority,
    Policy,
    Quorum,
    Solo,
    Sync,
    TwoChoice,
)
from asynccoll.collectives.partial import initiators
from asynccoll.sim import (
    Constant,
    LinearSkew,
    LinkClass,
    LogNormal,
    Pareto,
    Profile,
    Replayed,
    Shifted,
    SimPartial,
    SimWorld,
    SlowGroup,
    Uniform,
    parse_model,
    parse_policies,
    simulate,
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


def test_policies_are_the_runtimes_values() -> None:
    """The simulator reads policies with asynccoll.as_policy and prints them with str()."""
    assert parse_policies("sync, solo,quorum:3,backup:1,deadline:3:bounds=0.01..0.5", 4) == [
        Sync(), Solo(), Quorum(3), Backup(1), Deadline(quorum=3, bounds=(0.01, 0.5))]
    assert parse_policies("majority:seed=7") == [Majority(seed=7)]
    for bad, msg in (("quorum", "needs one number"), ("quorum:11", r"1\.\.10"),
                     ("backup:10", r"0\.\.9"), ("solo:3", "takes no argument"),
                     ("fast", "kind must be one of"), (" , ", "at least one policy")):
        with pytest.raises(ValueError, match=msg):
            parse_policies(bad, 10)


FAST = Profile("fast", LinkClass(1e-6, 1e-12), LinkClass(1e-6, 1e-12), gamma=1e-7,
               reduce_bps=1e12)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("text", "value"), [
    ("backup:2", Backup(2)), ("two_choice:seed=5", TwoChoice(seed=5)),
    ("deadline:6:bounds=0.0001..0.01", Deadline(quorum=6, bounds=(1e-4, 1e-2))),
    ("sync", Sync())])
def test_simulate_takes_a_policy_or_its_text(text: str, value: Policy) -> None:
    runs = [simulate(p, 8, 6, profile=FAST, compute=Uniform(0.0, 1e-3), seed=2)
            for p in (text, value)]
    assert runs[0].policy == runs[1].policy == str(value)
    assert runs[0].summary() | {"wall_s": 0} == runs[1].summary() | {"wall_s": 0}
    assert runs[0].conserved()


@pytest.mark.timeout(30)
def test_a_policy_seed_draws_the_initiators() -> None:
    """Majority(seed=s) draws as the runtime's handle of that seed does, whatever the
    simulation's own seed; Majority() draws from the simulation's seed."""
    w = SimWorld(8, FAST)
    seeded = [SimPartial(w, Majority(seed=9), np.zeros(1, np.float32), seed=s, data=False)
              for s in (0, 1)]
    assert [seeded[0].initiators(e) for e in range(20)] == \
        [initiators("majority", e, 8, 9) for e in range(20)]
    assert [seeded[1].initiators(e) for e in range(20)] == \
        [seeded[0].initiators(e) for e in range(20)]
    assert SimPartial(w, "majority", np.zeros(1, np.float32), seed=3, data=False).seed == 3


def test_sim_errors_name_the_new_spelling() -> None:
    w = SimWorld(4, FAST)
    like = np.zeros(1, np.float32)
    with pytest.raises(TypeError, match=r"quorum= is gone: give Quorum\(k\)"):
        SimPartial(w, "quorum:2", like, quorum=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"deadline= is gone: give Deadline\(bounds="):
        simulate("deadline", 4, 2, profile=FAST, compute=Uniform(0.0, 1e-3),
                 deadline=None)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="SimSync"):
        SimPartial(w, Sync(), like)
    with pytest.raises(ValueError, match=r"choices applies to TwoChoice\(\)"):
        SimPartial(w, Solo(), like, choices=3)
    with pytest.raises(ValueError, match="kind must be one of"):
        simulate("fastest", 4, 2, profile=FAST, compute=Uniform(0.0, 1e-3))


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
