"""Compute-time models: how long each rank computes before each step's call.

A model's :meth:`~ComputeModel.sample` returns a ``(steps, P)`` array of seconds, drawn at once
(vectorised) from a seeded generator, so a simulation is reproducible and its per-step cost is
an array lookup. The models are the straggler patterns of the papers:

* :class:`Constant`: every rank computes ``t`` (no stragglers);
* :class:`LinearSkew`: rank r computes ``base + r * skew`` (eager-SGD §7.1, Fig. 8: 1 ms per
  rank, so 32 ranks span 1-32 ms);
* :class:`Shifted`: an injection from ``lo`` to ``hi`` spread linearly over the ranks and
  shifted by one rank each step (eager-SGD §7.2.3: 50-400 ms over 8 processes);
* :class:`Uniform`: independent uniform draws per rank and step (RNA §8.4: 10-50 ms);
* :class:`LogNormal`: ``median * exp(sigma * N(0, 1))``;
* :class:`Pareto`: ``base`` plus a Pareto tail of shape ``alpha`` and scale ``scale`` (the
  "final few gradients" of the backup-worker paper, heavy-tailed);
* :class:`SlowGroup`: a fixed fraction of the ranks ``factor`` times slower (RNA §4's
  persistently slow machines), with ``jitter`` (relative, lognormal);
* :class:`Replayed`: a recorded ``(steps, P0)`` matrix, optionally resampled to P ranks
  (each simulated rank replays one recorded rank, drawn with replacement).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

__all__ = ["ComputeModel", "Constant", "LinearSkew", "LogNormal", "Pareto", "Replayed",
           "Shifted", "SlowGroup", "Uniform", "model_syntax", "parse_model"]


class ComputeModel(abc.ABC):
    """Seconds each rank computes before each step's call."""

    @abc.abstractmethod
    def sample(self, steps: int, world_size: int, rng: np.random.Generator) -> np.ndarray:
        """A ``(steps, world_size)`` float array of seconds, >= 0."""

    @staticmethod
    def _check(steps: int, world_size: int) -> None:
        if steps < 0 or world_size < 1:
            raise ValueError(f"steps must be >= 0 and world_size >= 1, got {steps}, "
                             f"{world_size}")


def _nonneg(**kw: float) -> None:
    for k, v in kw.items():
        if not v >= 0:
            raise ValueError(f"{k} must be >= 0, got {v!r}")


@dataclass(frozen=True)
class Constant(ComputeModel):
    t: float = 0.0

    def __post_init__(self) -> None:
        _nonneg(t=self.t)

    def sample(self, steps: int, world_size: int, rng: np.random.Generator) -> np.ndarray:
        self._check(steps, world_size)
        return np.full((steps, world_size), self.t)


@dataclass(frozen=True)
class LinearSkew(ComputeModel):
    skew: float = 1e-3
    base: float = 0.0

    def __post_init__(self) -> None:
        _nonneg(skew=self.skew, base=self.base)

    def sample(self, steps: int, world_size: int, rng: np.random.Generator) -> np.ndarray:
        self._check(steps, world_size)
        row = self.base + self.skew * np.arange(world_size)
        return np.broadcast_to(row, (steps, world_size)).copy()


@dataclass(frozen=True)
class Shifted(ComputeModel):
    lo: float = 0.05
    hi: float = 0.4

    def __post_init__(self) -> None:
        _nonneg(lo=self.lo, hi=self.hi - self.lo)

    def sample(self, steps: int, world_size: int, rng: np.random.Generator) -> np.ndarray:
        self._check(steps, world_size)
        P = world_size
        span = (self.hi - self.lo) / max(P - 1, 1)
        idx = (np.arange(P)[None, :] + np.arange(steps)[:, None]) % P
        return self.lo + span * idx


@dataclass(frozen=True)
class Uniform(ComputeModel):
    lo: float = 0.01
    hi: float = 0.05

    def __post_init__(self) -> None:
        _nonneg(lo=self.lo, hi=self.hi - self.lo)

    def sample(self, steps: int, world_size: int, rng: np.random.Generator) -> np.ndarray:
        self._check(steps, world_size)
        return rng.uniform(self.lo, self.hi, (steps, world_size))


@dataclass(frozen=True)
class LogNormal(ComputeModel):
    median: float = 0.01
    sigma: float = 0.5

    def __post_init__(self) -> None:
        _nonneg(median=self.median, sigma=self.sigma)

    def sample(self, steps: int, world_size: int, rng: np.random.Generator) -> np.ndarray:
        self._check(steps, world_size)
        return self.median * np.exp(self.sigma * rng.standard_normal((steps, world_size)))


@dataclass(frozen=True)
class Pareto(ComputeModel):
    base: float = 1.4
    scale: float = 0.05
    alpha: float = 1.5

    def __post_init__(self) -> None:
        _nonneg(base=self.base, scale=self.scale)
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")

    def sample(self, steps: int, world_size: int, rng: np.random.Generator) -> np.ndarray:
        self._check(steps, world_size)
        return self.base + self.scale * rng.pareto(self.alpha, (steps, world_size))


@dataclass(frozen=True)
class SlowGroup(ComputeModel):
    t: float = 0.01
    fraction: float = 0.25
    factor: float = 4.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        _nonneg(t=self.t, jitter=self.jitter)
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {self.fraction!r}")
        if not self.factor >= 1:
            raise ValueError(f"factor must be >= 1, got {self.factor!r}")

    def sample(self, steps: int, world_size: int, rng: np.random.Generator) -> np.ndarray:
        self._check(steps, world_size)
        slow = round(self.fraction * world_size)
        row = np.full(world_size, self.t)
        row[world_size - slow:] *= self.factor
        return row[None, :] * np.exp(self.jitter * rng.standard_normal((steps, world_size)))


@dataclass(frozen=True)
class Replayed(ComputeModel):
    """Recorded compute times ``times`` (``(steps, P0)`` seconds); steps beyond the record
    wrap around; with P != P0 each simulated rank replays a recorded rank drawn with
    replacement (a fixed draw per simulation)."""

    times: Any = field(default=None)

    def __post_init__(self) -> None:
        a = np.asarray(self.times, float)
        if a.ndim != 2 or a.size == 0:
            raise ValueError(f"times must be a non-empty (steps, ranks) array, got shape "
                             f"{a.shape}")
        if np.isnan(a).any() or (a < 0).any():
            raise ValueError("times must be finite and >= 0")
        object.__setattr__(self, "times", a)

    def sample(self, steps: int, world_size: int, rng: np.random.Generator) -> np.ndarray:
        self._check(steps, world_size)
        a = np.asarray(self.times, float)
        rows: np.ndarray = a[np.arange(steps) % a.shape[0]]
        if world_size == a.shape[1]:
            return rows.copy()
        cols = rng.integers(0, a.shape[1], world_size)
        out: np.ndarray = rows[:, cols]
        return out


_MODELS: dict[str, type[ComputeModel]] = {
    "constant": Constant, "linear": LinearSkew, "shifted": Shifted, "uniform": Uniform,
    "lognormal": LogNormal, "pareto": Pareto, "slow_group": SlowGroup,
}


def model_syntax() -> str:
    """What :func:`parse_model` accepts, one model per entry with its parameters and their
    defaults (seconds): ``"constant[:t=0.0]; linear[:skew=0.001,base=0.0]; ..."``."""
    from dataclasses import fields

    return "; ".join(
        f"{name}[:" + ",".join(f"{f.name}={f.default!r}" for f in fields(cast(Any, cls))) + "]"
        for name, cls in _MODELS.items())


def parse_model(text: str) -> ComputeModel:
    """``"linear:skew=0.001,base=0"`` -> ``LinearSkew(0.001, 0)`` (seconds). Raises
    ``ValueError`` naming an unknown model or parameter."""
    name, _, args = text.partition(":")
    cls = _MODELS.get(name)
    if cls is None:
        raise ValueError(f"compute model must be one of {sorted(_MODELS)}, got {name!r}")
    kw: dict[str, float] = {}
    for part in filter(None, args.split(",")):
        k, sep, v = part.partition("=")
        if not sep:
            raise ValueError(f"compute model parameter {part!r} must be name=value")
        kw[k.strip()] = float(v)
    try:
        return cls(**kw)
    except TypeError as exc:
        raise ValueError(f"compute model {name!r}: {exc}") from None
