"""What one training step did: :class:`StepInfo`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """The outcome of ``await opt.step(grads)``, for logging.

    * ``round``: the collective execution (global step) whose result was applied; for
      synchronous methods the step number.
    * ``included``: whether this step's gradient is in the applied update (False: it waits in
      the send buffer for a later round, or was dropped where the method drops late data).
    * ``contributors``: the ranks whose gradients (fresh or stale) are in the update.
    * ``count``: how many local gradients were summed into the update, over all ranks.
    * ``staleness``: how many consecutive steps of this rank, this one included, were not in
      the result they returned (0 when ``included``); OD-SGD: the delay of the applied global
      update in steps (0 in warm-up, 1 after).
    * ``lr``: the learning rate actually used (RNA scales it by the contributors).
    * ``missed``: rounds completed since this rank's previous step (folded in or superseded).
    * ``synced``: a model synchronisation (flush and parameter average) ran in this step.
    * ``lateness``, ``latest_arrival``: as :class:`~asynccoll.PartialResult`'s (seconds after
      the first waiting call of the round; None for synchronous methods).
    * ``deadline``, ``deadline_expired``: as :class:`~asynccoll.PartialResult`'s (the
      deadline the round used, and whether it, not k arrivals, started the round; None
      unless the method runs a ``deadline`` partial allreduce).
    * ``joined``: this step took this rank back into a running job (a restarted rank's first
      step, :mod:`asynccoll.train.joining`): it received the parameters and contributed
      nothing (its gradient was computed on the parameters it had before).
    """

    round: int
    included: bool
    contributors: frozenset[int]
    count: int
    staleness: int
    lr: float
    missed: int = 0
    synced: bool = False
    fresh: frozenset[int] = field(default_factory=frozenset)
    lateness: float | None = None
    latest_arrival: float | None = None
    deadline: float | None = None
    deadline_expired: bool | None = None
    joined: bool = False
