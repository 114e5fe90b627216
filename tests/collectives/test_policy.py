"""Straggler policies as values (asynccoll.collectives.policy): validated at construction, an
activation per world, printed as and parsed from the simulator CLI's text."""

from __future__ import annotations

import dataclasses

import pytest

from asynccoll import (
    Accumulate,
    Backup,
    Deadline,
    Majority,
    Policy,
    Quorum,
    Solo,
    Sync,
    TwoChoice,
    as_policy,
)
from asynccoll.collectives.policy import as_accumulate, moved_arguments

ALL = [Solo(), Majority(), Majority(seed=3), TwoChoice(), TwoChoice(seed=0), Quorum(3),
       Backup(0), Backup(2), Deadline(), Deadline(quorum=2), Deadline(bounds=0.05),
       Deadline(quorum=3, bounds=(0.01, 0.5), mad_factor=2.5, window=4), Sync()]


@pytest.mark.parametrize("policy", ALL, ids=str)
def test_text_round_trips(policy: Policy) -> None:
    assert as_policy(str(policy)) == policy
    assert Policy.parse(str(policy)) == policy


@pytest.mark.parametrize("policy", ALL, ids=str)
def test_frozen_and_hashable(policy: Policy) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.x = 1  # type: ignore[attr-defined]
    assert hash(policy) == hash(as_policy(str(policy)))


def test_the_cli_spellings() -> None:
    assert as_policy("quorum:12") == Quorum(12)
    assert as_policy("backup:2") == Backup(2)
    assert as_policy("deadline:12") == Deadline(quorum=12)
    assert as_policy(" two_choice ") == TwoChoice()
    assert str(Deadline(bounds=(0.01, 0.5))) == "deadline:bounds=0.01..0.5"
    assert str(Quorum(12)) == "quorum:12"
    assert str(Sync()) == "sync"


def test_activation_per_world() -> None:
    assert Solo().activation(4) == ("solo", None, None)
    assert Majority(seed=1).activation(4).kind == "majority"
    assert Quorum(3).activation(4) == ("quorum", 3, None)
    assert Backup(1).activation(4) == ("quorum", 3, None)
    a = Deadline().activation(5)
    assert a.kind == "deadline"
    assert a.quorum == 5
    assert a.deadline is not None
    assert (a.deadline.lo, a.deadline.hi) == (0.001, 1.0)
    assert Deadline(bounds=0.2).config().lo == Deadline(bounds=0.2).config().hi == 0.2
    assert not Sync().partial
    assert Solo().partial


@pytest.mark.parametrize(("make", "word"), [
    (lambda: Quorum(0), "k"), (lambda: Quorum(True), "k"), (lambda: Quorum(2.5), "k"),
    (lambda: Backup(-1), "b"), (lambda: Majority(seed=-1), "seed"),
    (lambda: TwoChoice(seed="x"), "seed"), (lambda: Deadline(quorum=0), "quorum"),
    (lambda: Deadline(bounds=(2, 1)), "bounds"), (lambda: Deadline(bounds="x"), "bounds"),
    (lambda: Deadline(mad_factor=-1), "mad_factor"), (lambda: Deadline(window=0), "window"),
    (lambda: Quorum(5).activation(4), "quorum"), (lambda: Backup(4).activation(4), "backup"),
    (lambda: Deadline(quorum=5).activation(4), "quorum"),
])
def test_bad_values_name_the_field(make: object, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        make()  # type: ignore[operator]


@pytest.mark.parametrize("text", ["quorum", "backup", "quorum:x", "quorum:1:2", "solo:3",
                                  "majority:3", "deadline:mad=2", "deadline:window=1:window=2",
                                  "nope", ""])
def test_bad_text_names_it(text: str) -> None:
    with pytest.raises(ValueError, match="policy"):
        as_policy(text)


def test_not_a_policy() -> None:
    with pytest.raises(TypeError, match="kind must be a policy"):
        as_policy(3, "kind")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode: policy 'x'"):
        as_policy("x", "mode")


def test_accumulate() -> None:
    assert as_accumulate("mean") is Accumulate.MEAN
    assert as_accumulate(Accumulate.WORLD) is Accumulate.WORLD
    assert not Accumulate.LATEST.sums
    assert Accumulate.SUM.sums
    with pytest.raises(TypeError, match=r"Accumulate\.SUM"):
        as_accumulate(True)
    with pytest.raises(TypeError, match=r"Accumulate\.LATEST"):
        as_accumulate(False)
    with pytest.raises(ValueError, match="accumulate"):
        as_accumulate("all")


def test_moved_arguments_names_the_new_spelling() -> None:
    @moved_arguments(quorum="give Quorum(k) as the policy")
    def f(policy: str, *, name: str | None = None) -> str:
        return policy

    assert f("solo", name="a") == "solo"
    with pytest.raises(TypeError, match=r"quorum= is gone: give Quorum\(k\)"):
        f("quorum", quorum=3)  # type: ignore[call-arg]
