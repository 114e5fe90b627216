"""Local update rules: SGD with momentum and weight decay, and the delay-compensated rules.

DC-ASGD (the compensation used by *OD-SGD: One-step Delay SGD*, Eq. 4-6) corrects a gradient
``g`` computed at weights ``w_prev`` before applying it at weights ``w``:

* constant (``dc_asgd_c``, Eq. 4): ``w -= lr * (g + lam * g*g*(w - w_prev))``
* adaptive (``dc_asgd_a``, Eq. 5-6): ``ms = m*ms + (1-m)*g*g`` then
  ``w -= lr * (g + lam / sqrt(ms + eps) * g*g*(w - w_prev))``

With ``lam = 0`` both are plain SGD; with ``w == w_prev`` the compensation term is zero.
All updates are in place and vectorised (NumPy or CuPy arrays).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DCASGD", "SGD", "make_updater"]


@dataclass
class SGD:
    """``v = momentum*v + g + weight_decay*w``; ``w -= lr*v`` (plain SGD when momentum = 0)."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    _v: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")

    def apply(self, w: Any, g: Any, lr: float | None = None, w_prev: Any = None) -> None:
        """Update ``w`` in place with gradient ``g`` (``lr`` overrides the configured rate)."""
        lr = self.lr if lr is None else lr
        d = g
        if self.weight_decay:
            d = g + self.weight_decay * w
        if self.momentum:
            if self._v is None:
                self._v = d.copy()
            else:
                self._v *= self.momentum
                self._v += d
            d = self._v
        w -= lr * d


@dataclass
class DCASGD:
    """Delay-compensated update; ``adaptive`` selects DC-ASGD-a (Eq. 5-6) over -c (Eq. 4)."""

    lr: float
    lam: float = 0.04
    adaptive: bool = False
    m: float = 0.95
    eps: float = 1e-7
    _ms: Any = field(default=None, repr=False)

    def apply(self, w: Any, g: Any, lr: float | None = None, w_prev: Any = None) -> None:
        """``w -= lr*(g + comp)``; ``w_prev``: the weights ``g`` was computed at."""
        lr = self.lr if lr is None else lr
        if w_prev is None or self.lam == 0.0:
            w -= lr * g
            return
        gg = g * g
        if self.adaptive:
            if self._ms is None:
                self._ms = (1.0 - self.m) * gg
            else:
                self._ms *= self.m
                self._ms += (1.0 - self.m) * gg
            scale = self.lam / (self._ms + self.eps) ** 0.5
        else:
            scale = self.lam
        w -= lr * (g + scale * gg * (w - w_prev))


def make_updater(name: str, lr: float, **kw: Any) -> SGD | DCASGD:
    """``"sgd"``, ``"dc-asgd-c"`` or ``"dc-asgd-a"``; ``ValueError`` naming the choices."""
    if name == "sgd":
        return SGD(lr, **kw)
    if name in ("dc-asgd-c", "dc_asgd_c"):
        return DCASGD(lr, adaptive=False, **kw)
    if name in ("dc-asgd-a", "dc_asgd_a"):
        return DCASGD(lr, adaptive=True, **kw)
    raise ValueError(f"unknown updater {name!r}; expected 'sgd', 'dc-asgd-c' or 'dc-asgd-a'")
