"""Straggler policies as values: one vocabulary from ``partial_allreduce`` to the simulator.

A **policy** says when an execution of a partial allreduce starts (DESIGN §5, docs/partial.md)::

    Solo()                      any rank's call starts it (wait-free)
    Majority(seed=None)         one rank drawn per execution starts it
    TwoChoice(seed=None)        two drawn ranks, the first to arrive starts it (RNA)
    Quorum(k)                   it starts once k ranks have arrived
    Backup(b)                   Quorum(P - b): synchronous SGD with b backup workers
    Deadline(quorum=None, bounds=(0.001, 1.0), mad_factor=3.0, window=16)
                                k arrived (default all P), or an adaptive deadline after the
                                first arrival expired, whichever is first
    Sync()                      no partial collective: a synchronous allreduce (the training
                                classes, the torch wrappers and the simulator take it)

Each is a small frozen dataclass that validates itself at construction (``ValueError`` naming
the field), builds its :class:`Activation` for a world of P ranks (:meth:`Policy.activation`:
what the schedule builders take: the kind's name, the arrival quorum, the deadline's
parameters; ``ValueError`` when the policy does not fit P), and prints as the text the
simulator's CLI takes (``str(Quorum(12)) == "quorum:12"``), which :func:`as_policy` parses
back. Strings are accepted where a user types them (``asynccoll sim run --policy quorum:12``,
a ``"solo"`` shortcut) and converted in one place, :func:`as_policy`.

**Accumulation** (:class:`Accumulate`): what a call that missed results is given: the
latest, their sum, the sum of each one averaged by its count, or by the world it spanned.

Choices where the issue is silent: a ``Quorum(k)`` larger than the world is refused when the
handle is made (the policy does not know P before); ``Backup(b)`` keeps ``P - b`` as it was
when the handle was made: after a lost rank the quorum is lowered to the survivors' number only
when it exceeds it, as for ``Quorum`` (docs/groups.md). The ``majority`` and ``two_choice``
seeds default to one derived from the handle's name, so two handles draw differently.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, ParamSpec, TypeVar

import numpy as np

from .partial import (
    DEFAULT_DEADLINE,
    DEFAULT_DEADLINE_WINDOW,
    DEFAULT_MAD_FACTOR,
    DeadlineConfig,
    check_deadline,
)

__all__ = [
    "POLICY_MOVED",
    "POLICY_SYNTAX",
    "Accumulate",
    "Activation",
    "Backup",
    "Deadline",
    "Majority",
    "Policy",
    "Quorum",
    "Solo",
    "Sync",
    "TwoChoice",
    "as_accumulate",
    "as_policy",
    "moved_arguments",
]

#: the text syntax of :func:`as_policy`, for help texts and errors
POLICY_SYNTAX = ("sync, solo, majority[:seed=S], two_choice[:seed=S], quorum:K (start once K "
                 "ranks arrived), backup:B (quorum:P-B), deadline[:K][:bounds=LO..HI]"
                 "[:mad_factor=M][:window=W] (K arrived or an adaptive deadline after the first "
                 "arrival)")


class Activation(NamedTuple):
    """A policy's activation for one world (:meth:`Policy.activation`): what the schedule
    builders and the handle take."""

    #: the initiator set's name: ``solo``, ``majority``, ``two_choice``, ``quorum``,
    #: ``deadline`` (:data:`~asynccoll.collectives.partial.KINDS`), or ``sync``
    kind: str
    #: the arrival quorum k (quorum and deadline), else None
    quorum: int | None
    #: the deadline's validated parameters (deadline), else None
    deadline: DeadlineConfig | None


def _int(v: Any, what: str, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
        raise ValueError(f"{what} must be an int >= {low}, got {v!r}")
    return int(v)


def _seed(v: Any, cls: str) -> int | None:
    return None if v is None else _int(v, f"{cls}(seed=...): seed", 0)


@dataclass(frozen=True)
class Policy:
    """A straggler policy (module doc); the base of :class:`Solo`, :class:`Majority`,
    :class:`TwoChoice`, :class:`Quorum`, :class:`Backup`, :class:`Deadline` and :class:`Sync`."""

    #: the name it prints and parses as
    name: ClassVar[str] = ""

    @property
    def seed(self) -> int | None:
        """The initiator draws' seed (majority and two-choice; None: from the handle's name)."""
        return None

    @property
    def partial(self) -> bool:
        """Whether it is a partial collective (every policy but :class:`Sync`)."""
        return True

    def activation(self, world_size: int) -> Activation:
        """The activation for ``world_size`` ranks; ``ValueError`` when it does not fit."""
        return Activation(self.name, None, None)

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def parse(text: str) -> Policy:
        """The policy ``text`` spells (:data:`POLICY_SYNTAX`); ``ValueError`` naming it."""
        return _parse(text)


@dataclass(frozen=True)
class Solo(Policy):
    """Any rank's call starts an execution (eager-SGD's solo allreduce): wait-free."""

    name: ClassVar[str] = "solo"


@dataclass(frozen=True)
class _Drawn(Policy):
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "seed", _seed(self.seed, type(self).__name__))

    def __str__(self) -> str:
        return self.name if self.seed is None else f"{self.name}:seed={self.seed}"


@dataclass(frozen=True)
class Majority(_Drawn):
    """One rank drawn per execution (the same on every rank, from ``seed``) starts it
    (eager-SGD's majority allreduce). ``seed``: an int >= 0, or None (from the handle's
    name)."""

    name: ClassVar[str] = "majority"


@dataclass(frozen=True)
class TwoChoice(_Drawn):
    """Two ranks drawn per execution, the first to arrive starts it (RNA's two-choice).
    ``seed``: as :class:`Majority`'s."""

    name: ClassVar[str] = "two_choice"


@dataclass(frozen=True)
class Quorum(Policy):
    """An execution starts once ``k`` ranks have arrived (a k-of-P dependency); ``k`` an int
    >= 1, at most the world's size (checked when a handle is made)."""

    k: int
    name: ClassVar[str] = "quorum"

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", _int(self.k, "Quorum(k): the quorum k", 1))

    def activation(self, world_size: int) -> Activation:
        if self.k > world_size:
            raise ValueError(f"{self!r}: quorum must be in 1..{world_size} (the world's size), "
                             f"got {self.k}")
        return Activation("quorum", self.k, None)

    def __str__(self) -> str:
        return f"quorum:{self.k}"


@dataclass(frozen=True)
class Backup(Policy):
    """Synchronous SGD with ``b`` backup workers: :class:`Quorum` of ``P - b``; ``b`` an int
    >= 0, below the world's size (checked when a handle is made)."""

    b: int
    name: ClassVar[str] = "backup"

    def __post_init__(self) -> None:
        object.__setattr__(self, "b", _int(self.b, "Backup(b): the backup workers b", 0))

    def activation(self, world_size: int) -> Activation:
        if self.b >= world_size:
            raise ValueError(f"{self!r}: backup workers must be in 0..{world_size - 1} (fewer "
                             f"than the world's {world_size} ranks), got {self.b}")
        return Activation("quorum", world_size - self.b, None)

    def __str__(self) -> str:
        return f"backup:{self.b}"


@dataclass(frozen=True)
class Deadline(Policy):
    """An execution starts once ``quorum`` ranks have arrived (default: all P) or an adaptive
    deadline after the first arrival expired, whichever is first: the median plus
    ``mad_factor`` median absolute deviations of the arrival spreads of the last ``window``
    executions, within ``bounds=(lo, hi)`` seconds (one number: a fixed deadline).
    ``ValueError`` naming ``quorum``, ``bounds``, ``mad_factor`` or ``window`` when bad."""

    quorum: int | None = None
    bounds: tuple[float, float] = DEFAULT_DEADLINE
    mad_factor: float = DEFAULT_MAD_FACTOR
    window: int = DEFAULT_DEADLINE_WINDOW
    name: ClassVar[str] = "deadline"

    def __post_init__(self) -> None:
        if self.quorum is not None:
            object.__setattr__(self, "quorum", _int(self.quorum, "Deadline(quorum=...)", 1))
        try:
            c = check_deadline("deadline", self.bounds, self.mad_factor, self.window)
        except ValueError as exc:  # the runtime's words name deadline=/deadline_window=
            raise ValueError(f"Deadline(...): {exc}".replace("deadline_window", "window")
                             .replace("deadline must", "the deadline's bounds must")) \
                from None
        assert c is not None
        object.__setattr__(self, "bounds", (c.lo, c.hi))
        object.__setattr__(self, "mad_factor", c.m)
        object.__setattr__(self, "window", c.window)

    def config(self) -> DeadlineConfig:
        """The runtime's validated form of the deadline's parameters."""
        return DeadlineConfig(self.bounds[0], self.bounds[1], self.mad_factor, self.window)

    def activation(self, world_size: int) -> Activation:
        k = world_size if self.quorum is None else self.quorum
        if k > world_size:
            raise ValueError(f"{self!r}: quorum must be in 1..{world_size} (the world's size), "
                             f"got {k}")
        return Activation("deadline", k, self.config())

    def __str__(self) -> str:
        parts = [self.name] + ([] if self.quorum is None else [str(self.quorum)])
        lo, hi = self.bounds
        if (lo, hi) != DEFAULT_DEADLINE:
            parts.append(f"bounds={lo!r}" if lo == hi else f"bounds={lo!r}..{hi!r}")
        if self.mad_factor != DEFAULT_MAD_FACTOR:
            parts.append(f"mad_factor={self.mad_factor!r}")
        if self.window != DEFAULT_DEADLINE_WINDOW:
            parts.append(f"window={self.window}")
        return ":".join(parts)


@dataclass(frozen=True)
class Sync(Policy):
    """No partial collective: every step waits for every rank (a synchronous allreduce); for
    the training classes, the torch wrappers and the simulator, to compare with."""

    name: ClassVar[str] = "sync"

    @property
    def partial(self) -> bool:
        return False


_BY_NAME: dict[str, type[Policy]] = {
    c.name: c for c in (Solo, Majority, TwoChoice, Quorum, Backup, Deadline, Sync)}


def _number(text: str, arg: str, conv: Callable[[str], Any]) -> Any:
    try:
        return conv(arg)
    except ValueError:
        raise ValueError(f"policy {text!r}: {arg!r} is not a number") from None


def _parse(text: str) -> Policy:
    name, *args = text.strip().split(":")
    cls = _BY_NAME.get(name)
    if cls is None:
        raise ValueError(f"policy {text!r}: the kind must be one of {tuple(_BY_NAME)} "
                         f"({POLICY_SYNTAX})")
    try:
        if cls in (Quorum, Backup):
            if len(args) != 1 or not args[0]:
                raise ValueError(f"policy {text!r}: {name} needs one number ({name}:N)")
            return cls(_number(text, args[0], int))  # type: ignore[call-arg]
        kw: dict[str, Any] = {}
        for i, a in enumerate(args):
            key, eq, val = a.partition("=")
            if cls is Deadline and i == 0 and not eq:
                key, val = "quorum", a
            allowed: Mapping[str, Callable[[str], Any]] = (
                {"seed": int} if cls in (Majority, TwoChoice) else
                {"quorum": int, "bounds": _bounds, "mad_factor": float, "window": int}
                if cls is Deadline else {})
            if key not in allowed or key in kw:
                raise ValueError(f"policy {text!r}: {name} takes "
                                 f"{', '.join(f'{k}=' for k in allowed) or 'no argument'}")
            kw[key] = _number(text, val, allowed[key])
        return cls(**kw)
    except ValueError as exc:
        msg = str(exc)
        raise ValueError(msg if msg.startswith("policy ") else f"policy {text!r}: {msg}") \
            from None


def _bounds(arg: str) -> tuple[float, float]:
    lo, sep, hi = arg.partition("..")
    return (float(lo), float(hi)) if sep else (float(lo), float(lo))


def as_policy(value: Policy | str, what: str = "policy") -> Policy:
    """``value`` as a :class:`Policy`: a policy as it is, a string parsed
    (:data:`POLICY_SYNTAX`: ``"solo"``, ``"quorum:12"``, ``"deadline:bounds=0.01..0.5"``). The
    one place where strings become policies. Raises ``ValueError`` naming ``what`` for a bad
    string (a bare ``"quorum"`` or ``"backup"``: the number is missing), ``TypeError`` naming
    it for anything else."""
    if isinstance(value, Policy):
        return value
    if isinstance(value, str):
        try:
            return _parse(value)
        except ValueError as exc:
            if what == "policy":
                raise
            raise ValueError(f"{what}: {exc}") from None
    raise TypeError(f"{what} must be a policy (Solo(), Majority(), TwoChoice(), Quorum(k), "
                    f"Backup(b), Deadline(), Sync()) or its text, got {type(value).__name__}")


class Accumulate(str, enum.Enum):
    """What a call that missed results is given (the handle's ``accumulate``): a str enum,
    so ``Accumulate("sum")`` parses the word."""

    #: the latest result (the papers'); results of missed executions are superseded
    LATEST = "latest"
    #: the sum of every result completed since the previous call (keeps plain-SGD replicas
    #: equal)
    SUM = "sum"
    #: the sum of each of those results divided by its own ``count`` (averaging by
    #: contributions; dense floating-point data, ``op="sum"``)
    MEAN = "mean"
    #: the sum of each of those results divided by the size of the world it spanned, as it
    #: completes (synchronous SGD's average, still right after a lost rank; dense
    #: floating-point data, ``op="sum"``)
    WORLD = "world"

    @property
    def sums(self) -> bool:
        """Whether results not yet given are summed (every mode but :attr:`LATEST`)."""
        return self is not Accumulate.LATEST


def as_accumulate(value: Accumulate | str) -> Accumulate:
    """``value`` as an :class:`Accumulate`: a member, or its word (``"sum"``). Raises
    ``TypeError`` naming ``accumulate`` and the new spelling for the old booleans
    (``True``: ``Accumulate.SUM``, ``False``: ``Accumulate.LATEST``), ``ValueError`` for other
    words."""
    if isinstance(value, Accumulate):
        return value
    if isinstance(value, (bool, np.bool_)):
        new = "Accumulate.SUM" if value else "Accumulate.LATEST"
        raise TypeError(f"accumulate={bool(value)!r} is gone: give accumulate={new} "
                        "(asynccoll.Accumulate)")
    if isinstance(value, str):
        try:
            return Accumulate(value)
        except ValueError:
            pass
    raise ValueError(f"accumulate must be one of {[a.value for a in Accumulate]} "
                     f"(asynccoll.Accumulate), got {value!r}")


#: the keywords that spelled a policy's parameters before policies were values (0.1), and what
#: to write instead (the training classes and torch wrappers add their ``mode``/``kind``)
POLICY_MOVED = {
    "quorum": "give Quorum(k) (or Backup(b), Deadline(quorum=k)) as the policy",
    "seed": "give Majority(seed=...) or TwoChoice(seed=...) as the policy",
    "deadline": "give Deadline(bounds=(lo, hi)) as the policy",
    "mad_factor": "give Deadline(mad_factor=...) as the policy",
    "deadline_window": "give Deadline(window=...) as the policy",
}

P = ParamSpec("P")
R = TypeVar("R")


def moved_arguments(**moved: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator: a call that passes one of ``moved``'s keywords (an argument that is gone)
    raises ``TypeError`` saying the new spelling (``moved[keyword]``) instead of Python's
    bare "unexpected keyword argument". The signature the function shows stays its own."""
    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def call(*args: P.args, **kw: P.kwargs) -> R:
            old = sorted(k for k in kw if k in moved)
            if old:
                raise TypeError(f"{fn.__qualname__}(): {old[0]}= is gone: {moved[old[0]]}")
            return fn(*args, **kw)
        return call
    return wrap
