"""Synchronous SGD with backup workers (*Revisiting Distributed Synchronous SGD*, §3,
Algorithms 3/4), decentralised over a quorum allreduce.

Each step is a partial allreduce of policy ``Backup(b)`` (a quorum of ``k = P - b``): the round
starts once ``P - b`` ranks have handed in this step's gradient, and the ``b`` slowest are the
backups. A gradient that arrives after its round started is **dropped** (the paper's workers
discard gradients of a finished step), through the partial allreduce's ``combine`` hook, instead
of being carried into the next round as eager-SGD does. The late rank applies the round's result
and goes on with the next step. Rounds are accumulated (``Accumulate.SUM``), so a rank that fell
behind by more than one round still applies every update and plain-SGD replicas stay equal.

**Averaging**: by ``P - b`` (the paper: ``average="quorum"``) or by the number of gradients
actually summed (``average="contributions"``), but never by fewer than the quorum: a round
that holds fewer than ``P - b`` gradients (only a flush makes one: a rank still stepping after
the others called ``finish()``, or at a sync event) is divided by the quorum, as if the
missing gradients were zeros (:func:`short_round_scale`). Divided by its own count, such a
round was a full step on one rank's gradient: measured on the digits, one reading after
``finish()`` fell 8 points (docs/torch.md, *Accuracy*). The quorum is a k-of-P trigger, not a cut: a
rank that hands in its gradient in the instant between the k-th arrival and the activation
reaching it is still summed, so a round can hold more than ``P - b`` gradients when ranks are
nearly tied; with ``b`` clear stragglers it holds exactly ``P - b``.
"""

from __future__ import annotations

from typing import Any

from ..collectives.policy import Backup, moved_arguments
from ..comm.communicator import Communicator
from ..results import PartialResult
from .eager import EagerSGD

__all__ = ["BackupSGD", "drop_late", "short_round_scale"]


def drop_late(acc: Any, x: Any, n: int, late: bool) -> int:
    """The ``combine`` hook of backup workers: a gradient late for its round is dropped, and
    a timely one replaces whatever the send buffer held (also used by
    :class:`asynccoll.torch.DistributedOptimizer`'s ``Backup(b)``)."""
    if late:
        return n  # late for its round: dropped
    acc[...] = x  # only this step's gradient; anything older is dropped too
    return 1


def short_round_scale(count: int, quorum: int) -> float:
    """The factor that turns a result averaged by its own ``count`` into one averaged by at
    least the ``quorum`` (module doc, "Averaging"): 1 for a full round, ``count / quorum``
    for a short one (also used by :class:`asynccoll.torch.DistributedOptimizer`'s
    ``Backup(b)``)."""
    return count / quorum if 0 < count < quorum else 1.0


class BackupSGD(EagerSGD):
    """Synchronous SGD with ``backups`` backup workers (module doc). Other arguments as
    :class:`EagerSGD` (its policy is ``Backup(backups)``; a quorum draws no initiators, so
    there is no seed). Raises ``ValueError`` naming ``backups`` unless ``0 <= backups < P``."""

    @moved_arguments(seed="backup workers draw no initiators: drop seed=",
                     policy="BackupSGD's policy is Backup(backups): give backups=")
    def __init__(self, comm: Communicator, params: Any, lr: float, backups: int = 1, *,
                 momentum: float = 0.0, weight_decay: float = 0.0, average: str = "quorum",
                 sync_every: int | None = None, name: str = "backup-sgd",
                 timeout: float | None = None) -> None:
        P = comm.size
        if isinstance(backups, bool) or not isinstance(backups, int) or not 0 <= backups < P:
            raise ValueError(f"backups must be an int in 0..{P - 1}, got {backups!r}")
        if average not in ("quorum", "contributions"):
            raise ValueError(f"average must be 'quorum' or 'contributions', got {average!r}")
        super().__init__(comm, params, lr, Backup(backups), momentum=momentum,
                         weight_decay=weight_decay, accumulate=True, average=average,
                         sync_every=sync_every, name=name, timeout=timeout)
        self.backups = backups

    def _combine(self) -> Any:
        return drop_late

    def _divisor(self, res: PartialResult) -> float:
        if self.average == "contributions":
            # each round already averaged by its own count (Accumulate.MEAN), and a short
            # one by the quorum (module doc)
            assert self._h is not None
            assert self._h.quorum is not None
            return 1 / short_round_scale(res.count, self._h.quorum)
        # Accumulate.SUM folds missed rounds in: each of them averaged by the quorum, P - b
        # (lowered to the survivors' number when ranks were lost: docs/groups.md)
        assert self._h is not None
        quorum = self._h.quorum
        assert quorum is not None
        return quorum
