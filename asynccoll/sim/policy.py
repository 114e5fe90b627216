"""Straggler policies by name, and the adaptive deadline's parameters.

A **policy spec** is what ``asynccoll sim replay --policies`` takes: ``sync`` (a dense
allreduce), ``solo``, ``majority``, ``two_choice``, ``quorum:K`` (start once K ranks arrived),
``backup:B`` (synchronous SGD with B backup workers: ``quorum:P-B``) and ``deadline`` or
``deadline:K`` (start once K ranks arrived, default all P, or when an adaptive deadline after
the first arrival expires, whichever comes first).

**The deadline** is the runtime's (:mod:`asynccoll.comm.partial`, ``kind="deadline"``), and so
is its decision function, :func:`~asynccoll.collectives.partial.next_deadline` (re-exported
here): the median of the recent arrival spreads plus ``m`` times their median absolute
deviation, clamped to ``[lo, hi]``; a median and a MAD, not a mean and a standard deviation,
because arrival spreads are heavy-tailed (one slow step must not double the next deadline).
An execution's spread is read from its allreduced meta by
:func:`~asynccoll.collectives.partial.arrival_spread` (the waiting calls' arrival stamps and
the late calls reported in it, so a deadline that cut calls off can grow); the first execution
uses ``hi``. :class:`DeadlinePolicy` holds the parameters the simulator passes on.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..collectives.partial import (
    DEFAULT_DEADLINE,
    DEFAULT_DEADLINE_WINDOW,
    DEFAULT_MAD_FACTOR,
    DeadlineConfig,
    check_deadline,
    next_deadline,
)

__all__ = ["POLICY_NAMES", "POLICY_SYNTAX", "DeadlinePolicy", "PolicySpec", "next_deadline",
           "parse_policies", "parse_policy"]

POLICY_NAMES = ("sync", "solo", "majority", "two_choice", "quorum", "backup", "deadline")
#: the spec syntax, for help texts
POLICY_SYNTAX = ("sync, solo, majority, two_choice, quorum:K (start once K ranks arrived), "
                 "backup:B (quorum:P-B), deadline or deadline:K (K arrived or an adaptive "
                 "deadline after the first arrival)")


@dataclass(frozen=True)
class DeadlinePolicy:
    """The deadline kind's parameters, as ``comm.partial_allreduce("deadline", deadline=(lo,
    hi), mad_factor=m, deadline_window=window)`` takes them (seconds); :meth:`config`
    validates them with :func:`~asynccoll.collectives.partial.check_deadline`, whose
    ``ValueError`` names the bad one."""

    m: float = DEFAULT_MAD_FACTOR
    lo: float = DEFAULT_DEADLINE[0]
    hi: float = DEFAULT_DEADLINE[1]
    window: int = DEFAULT_DEADLINE_WINDOW

    def config(self) -> DeadlineConfig:
        """The runtime's validated form."""
        c = check_deadline("deadline", (self.lo, self.hi), self.m, self.window)
        assert c is not None
        return c


@dataclass(frozen=True)
class PolicySpec:
    """A parsed policy: ``kind`` (a partial kind, or ``sync``) and its quorum (``None``
    unless quorum or deadline), with the text it came from as ``label``."""

    label: str
    kind: str
    quorum: int | None = None


def parse_policy(text: str, world_size: int) -> PolicySpec:
    """``"quorum:12"`` -> ``PolicySpec("quorum:12", "quorum", 12)``, for ``world_size`` ranks.

    Raises ``ValueError`` naming the spec for an unknown name, a missing or bad number, or a
    quorum outside 1..P (``backup:B`` needs 0 <= B < P).
    """
    name, _, arg = text.strip().partition(":")
    if name not in POLICY_NAMES:
        raise ValueError(f"policy {text!r}: name must be one of {POLICY_NAMES}")
    P = world_size
    if name in ("quorum", "backup") and not arg:
        raise ValueError(f"policy {text!r}: {name} needs a number ({name}:N)")
    if arg and name not in ("quorum", "backup", "deadline"):
        raise ValueError(f"policy {text!r}: {name} takes no argument")
    n: int | None = None
    if arg:
        try:
            n = int(arg)
        except ValueError:
            raise ValueError(f"policy {text!r}: {arg!r} is not an integer") from None
    if name == "backup":
        assert n is not None
        if not 0 <= n < P:
            raise ValueError(f"policy {text!r}: backup workers must be in 0..{P - 1}")
        return PolicySpec(text, "quorum", P - n)
    if name in ("quorum", "deadline"):
        k = P if n is None else n
        if not 1 <= k <= P:
            raise ValueError(f"policy {text!r}: quorum must be in 1..{P}")
        return PolicySpec(text, name, k)
    return PolicySpec(text, name)


def parse_policies(text: str, world_size: int) -> list[PolicySpec]:
    """A comma-separated list of specs (:func:`parse_policy`)."""
    specs = [parse_policy(t, world_size) for t in text.split(",") if t.strip()]
    if not specs:
        raise ValueError("policies must name at least one policy")
    return specs
