"""What a partial collective returns: :class:`PartialResult` (the ADS object of eager-SGD §6)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["PartialResult"]


@dataclass(frozen=True)
class PartialResult:
    """The outcome of one call of a partial allreduce.

    * ``value``: the reduced array, shaped like the handle's ``like``. The runtime never writes
      it again once returned (a new array per result), so it is safe to keep.
    * ``round``: the execution whose result this is (with ``accumulate=True``: the latest of
      those summed). Every rank sees the same ``value`` and ``contributors`` for a round.
    * ``included``: whether this call's data is in ``value``. When False it waits in the send
      buffer and goes into a later execution: it is never lost and never counted twice.
    * ``contributors``: the ranks whose data (fresh or stale) is in ``value``.
    * ``count``: how many local contributions (calls' arrays) were summed into ``value`` over
      all ranks, for averaging by contributions.
    * ``missed``: executions completed since this rank's previous call and before this one; with
      ``accumulate=False`` the results of all but the latest of them were superseded.
    * ``fresh``: the ranks that had a call waiting when the execution snapshot their buffer
      (the initiator and the ranks that arrived before it: eager-SGD's *active processes*).
    * ``flushed``: a flush forced (one of) the execution(s), bypassing the initiator set and
      the quorum.
    * ``arrivals``: for each rank whose call was waiting in the execution (``fresh``), when it
      arrived, in seconds after the first of them (the ranks' clocks: exact on one host,
      corrected across hosts by the offsets estimated at connect, :mod:`asynccoll.comm.clock`);
      empty for a flush.
    * ``lateness``: this rank's entry in ``arrivals`` (None: its call was not in it).
    * ``latest_arrival``: the largest entry of ``arrivals`` (how long the last of the waiting
      calls came after the first; None when empty).
    * ``deadline``: ``kind="deadline"`` only (None for the other kinds): the deadline, in
      seconds after the first arrival, that this execution used; the same on every rank.
    * ``deadline_expired``: ``kind="deadline"`` only (None otherwise): whether the deadline
      expired on some rank before that rank was activated, so the timer (not k arrivals)
      started the execution; the same on every rank (it rides in the meta vector).
    * ``world_size``: the number of ranks the execution spanned: the communicator's size, or
      fewer once the handle went on without lost ranks (``survive=True``; docs/groups.md).
      ``contributors`` and ``fresh`` name ranks among them.
    * ``lost``: the ranks lost so far (in the numbering of the communicator the handle was
      made on); empty while none is. What they held when lost is not in any result.
    """

    value: Any
    round: int
    included: bool
    contributors: frozenset[int]
    count: int
    missed: int = 0
    fresh: frozenset[int] = field(default_factory=frozenset)
    flushed: bool = False
    arrivals: dict[int, float] = field(default_factory=dict)
    lateness: float | None = None
    latest_arrival: float | None = None
    deadline: float | None = None
    deadline_expired: bool | None = None
    world_size: int = 0
    lost: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_meta(cls, value: Any, round: int, included: bool, meta: np.ndarray,
                  world_size: int, missed: int, rank: int | None = None,
                  arrivals: dict[int, float] | None = None,
                  deadline: float | None = None,
                  deadline_expired: bool | None = None,
                  lost: frozenset[int] = frozenset()) -> PartialResult:
        """Build from the allreduced ``meta`` vector: P counts, P fresh flags, the signature,
        the number of ranks that forced the execution; ``arrivals``, ``deadline`` and
        ``deadline_expired`` as the fields (decoded by the runtime), ``rank`` this rank,
        ``lost`` the ranks lost so far."""
        counts = meta[:world_size]
        arr = arrivals or {}
        return cls(value, round, included,
                   frozenset(np.flatnonzero(counts).tolist()), int(counts.sum()), missed,
                   frozenset(np.flatnonzero(meta[world_size:2 * world_size]).tolist()),
                   bool(meta[2 * world_size + 1]), arr,
                   None if rank is None else arr.get(rank),
                   max(arr.values()) if arr else None, deadline, deadline_expired, world_size,
                   lost)
