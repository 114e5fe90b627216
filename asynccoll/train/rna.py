"""RNA: non-blocking allreduce with a two-choice initiator (*Mitigating Stragglers in the
Decentralized Training on Heterogeneous Clusters*, §3.2-3.3).

* **Initiator** (§3.2): two ranks drawn per round, the first to arrive starts it
  (``two_choice`` partial allreduce).
* **Averaging by contributors** (§3.3, Algorithm 2): with ``w_k = 1`` for every rank that had
  a gradient in the round, the update is ``W * sum(g)`` with ``W = 1 / sum(w)``.
* **Learning rate scaled by contributors** (§3.3, linear scaling rule): ``lr_k = sum(w) * gamma``.
  Here ``lr`` is the rate of a full round, ``gamma = lr / P``, so with every rank contributing
  the step is exactly synchronous SGD with ``lr``.
* **Staleness-weighted local accumulation** (§3.3): a rank whose earlier gradients still wait in
  the send buffer contributes their weighted mean ``g' = sum(w_t g_t) / sum(w_t)`` with
  ``w_t = t - (k - tau) + 1`` (``tau``: the largest gap, so the oldest weighs 1 and newer ones
  linearly more). Weights of entries already in the buffer do not change when a newer one
  arrives, so the buffer is updated in place as a running weighted mean, atomically with the
  collective's snapshots (the partial allreduce's ``combine`` hook). Each rank therefore counts
  once per round (``count`` = contributors).
* **Bounded staleness** (§3.3): a waiting gradient more than ``staleness_bound`` steps old is
  dropped from the send buffer; those within the bound stay (re-weighted, since the oldest kept
  one now weighs 1). Dropping one entry of a running mean needs that entry, so with a bound the
  handle keeps a copy of each waiting gradient (at most ``staleness_bound + 1`` of them, one
  gradient's copy per step) and recomputes the weighted mean from them, a few vector operations
  per waiting gradient; without a bound (``None``) nothing is ever dropped and the running mean
  needs no copies.

Model synchronisation and the staleness-triggered synchronous step work as in
:class:`~asynccoll.train.EagerSGD`.
"""

from __future__ import annotations

from typing import Any

from ..comm.communicator import Communicator
from ..results import PartialResult
from .eager import EagerSGD

__all__ = ["RNA"]


class RNA(EagerSGD):
    """RNA training (module doc). Arguments as :class:`EagerSGD` (``mode`` is two-choice),
    plus ``staleness_bound`` (steps; ``None``: unbounded). Raises ``ValueError`` naming a bad
    argument."""

    def __init__(self, comm: Communicator, params: Any, lr: float, *,
                 staleness_bound: int | None = 4, momentum: float = 0.0,
                 weight_decay: float = 0.0, accumulate: bool = False,
                 sync_every: int | None = None, max_staleness: int | None = None,
                 seed: int | None = None, name: str = "rna",
                 timeout: float | None = None) -> None:
        if staleness_bound is not None and (isinstance(staleness_bound, bool) or not
                                            isinstance(staleness_bound, int)
                                            or staleness_bound < 0):
            raise ValueError(f"staleness_bound must be an int >= 0 or None, "
                             f"got {staleness_bound!r}")
        super().__init__(comm, params, lr, "two_choice", momentum=momentum,
                         weight_decay=weight_decay, accumulate=accumulate,
                         average="contributions", sync_every=sync_every,
                         max_staleness=max_staleness, seed=seed, name=name, timeout=timeout)
        self.staleness_bound = staleness_bound
        #: the steps whose gradients the send buffer holds (a weighted mean), with a copy of each
        #: gradient when a staleness bound may drop one of them (else None)
        self._pending: list[tuple[int, Any]] = []

    def _combine(self) -> Any:
        k = self.steps
        pending = self._pending
        bound = self.staleness_bound

        def combine(acc: Any, x: Any, n: int, late: bool) -> int:
            # Runs on the runtime's loop between snapshots: ``n == 0`` means the buffer was
            # taken by a round since the last call.
            if n == 0:
                pending.clear()
            if bound is None:
                if not pending:
                    acc[...] = x
                else:  # the running mean: older weights do not change when a step is added
                    t0 = pending[0][0]
                    sw = sum(t - t0 + 1 for t, _ in pending)
                    wk = k - t0 + 1
                    acc *= sw / (sw + wk)
                    acc += (wk / (sw + wk)) * x
                pending.append((k, None))
                return 1
            pending[:] = [(t, g) for t, g in pending if k - t <= bound]
            pending.append((k, x.copy()))
            t0 = pending[0][0]
            sw = sum(t - t0 + 1 for t, _ in pending)
            acc[...] = x * ((k - t0 + 1) / sw)
            for t, g in pending[:-1]:
                acc += ((t - t0 + 1) / sw) * g
            return 1

        return combine

    def _mean_rounds(self) -> bool:
        # Averaging by contributors with the lr scaled by them: per round the step is
        # lr * c/P * sum/c = lr * sum / P, so summed rounds need no per-round averaging.
        return False

    def _divisor(self, res: PartialResult) -> int:
        # W = 1 / sum(w): each contributing rank counts once (its weighted mean).
        return len(res.contributors)

    def _step_lr(self, res: PartialResult) -> float:
        return self.lr * len(res.contributors) / self.world_size
