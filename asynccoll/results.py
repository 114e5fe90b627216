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
    """

    value: Any
    round: int
    included: bool
    contributors: frozenset[int]
    count: int
    missed: int = 0
    fresh: frozenset[int] = field(default_factory=frozenset)
    flushed: bool = False

    @classmethod
    def from_meta(cls, value: Any, round: int, included: bool, meta: np.ndarray,
                  world_size: int, missed: int) -> PartialResult:
        """Build from the allreduced ``meta`` vector: P counts, P fresh flags, the signature,
        the number of ranks that forced the execution."""
        counts = meta[:world_size]
        return cls(value, round, included,
                   frozenset(np.flatnonzero(counts).tolist()), int(counts.sum()), missed,
                   frozenset(np.flatnonzero(meta[world_size:2 * world_size]).tolist()),
                   bool(meta[2 * world_size + 1]))
