"""What a partial allreduce handle keeps and hands out, and the deadline kind's timing.

A completed execution's result is kept (summed into what is kept, with ``accumulate``) until a
call or flush takes it; a call cancelled after taking it gives it back, so no contribution is
lost; a result kept from before a rebuild is handed out in the layout of the world it came
from (:meth:`KeptResults._take`, :meth:`KeptResults._relayout`).

**Deadline.** ``kind="deadline"`` runs the quorum's schedule (k of P arrivals activate) and
adds a timer: a call of rule 2 arms ``loop.call_later(d_e, ...)`` and cancels it when it
returns; if it fires before e was activated on r, r sets its ``EXPIRED`` flag and forces e
(the self-message a flush uses), and the activation broadcast starts e everywhere. So e starts
at its k-th arrival or ``d_e`` after its first arrival (the first caller's timer is the
earliest), whichever comes first. *Agreement on how e started*: every rank's snapshot adds its
flag to the meta vector, which is allreduced with the data, so every rank reads the same
``deadline_expired``. *Agreement on d_e*: after each completed execution every rank computes
its arrival spread from that execution's allreduced meta (the waiting calls' arrival stamps,
and the late calls reported in it: a call that found the execution it was meant for already
activated or completed records how long after that execution's first arrival it came, and
its next snapshot carries it) and ``d = next_deadline(window of spreads, m, lo, hi)``; the
same data and the same pure function give the same deadline on every rank. Flushed
executions are left out of the window; the first execution uses ``hi``.

:class:`KeptResults` is a part of :class:`~.partial.PartialAllreduce`, in a module of its own
for size; the handle's state is declared here for the type checker and set by the handle.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..collectives.partial import (
    ARRIVAL_KINDS,
    EXPIRED,
    LATE,
    SNAPSHOTS,
    arrival_spread,
    decode_arrivals,
    decode_expired,
    first_stamp,
    initiators,
    late_mark,
    next_deadline,
)
from ..results import PartialResult
from .partial_member import HandleState

__all__ = ["KeptResults"]

_NONE: frozenset[int] = frozenset()


class KeptResults(HandleState):
    """Results kept and handed out, and deadlines (module doc)."""

    # the handle's own (this class is a part of it)
    def _force(self, e: int) -> None:
        raise NotImplementedError

    def _note_late(self, stamp: int, first: int | None = None) -> None:
        """Record (deadline kind) that a call stamped ``stamp`` missed the execution whose
        first arrival was stamped ``first`` (default: the latest completed one's); this rank's
        next snapshot reports it (the latest, or the largest of several, wins). Under the
        lock."""
        if self.deadline_config is not None:
            st = self._state
            st[LATE] = late_mark(int(st[LATE]), stamp,
                                 self._first_stamp if first is None else first)

    def _expire(self, e: int) -> None:
        """The deadline of execution ``e`` expired on this rank (a loop timer): unless ``e``
        was activated here meanwhile, flag it and force it (module doc)."""
        with self._lock:
            if self._closed or self._ex.error is not None or self._state[SNAPSHOTS] > e:
                return
            self._state[EXPIRED] = 1
        self._force(e)

    def _adapt(self, e: int) -> None:
        """Deadline kind, after execution ``e`` completed: note the deadline it used, its
        first arrival (for late calls), a late waiting call, and the next deadline."""
        dc = self.deadline_config
        assert dc is not None
        assert self.next_deadline is not None
        P, m = self.world_size, self._meta
        self._deadline_of[e] = self.next_deadline
        self._deadline_of.pop(e - 64, None)
        first = first_stamp(m[self._stamps])
        self._first_stamp = first
        if e == self._wait_round and not self._wait_included:
            self._note_late(self._wait_stamp, first)  # activated here before this call came
        if not m[2 * P + 1]:  # a flush's executions say nothing of the arrivals
            spread = arrival_spread(m, P, self.quorum or P)
            if spread is not None:
                self._spreads.append(spread)
        self.next_deadline = next_deadline(list(self._spreads), dc.m, dc.lo, dc.hi)

    def _keep(self) -> None:
        """Keep the result just completed (and its meta) for the next call to hand out."""
        self._relayout()  # a result kept from before a rebuild: meet this world's layout
        summed = self._value is not None and self.accumulate.sums
        divisor = 1
        if self.accumulate == "mean":
            divisor = int(self._meta[:self.world_size].sum()) or 1
        elif self.accumulate == "world":  # each execution by the size of the world it spanned
            divisor = self.world_size
        # the kept value was never handed out, so nobody sees it change
        self._value = self._contribution.keep(self._value, self.accumulate.sums, divisor)
        if summed:
            self._vmeta += self._meta
            self._vmeta[self._stamps] = self._meta[self._stamps]  # the latest execution's
        else:
            self._vmeta[...] = self._meta

    def _trace_extra(self, e: int) -> None:
        P = self.world_size
        m = self._meta
        extra = self._ex.trace.extra[e % self._ex.trace.capacity]
        extra["contributors"] = np.flatnonzero(m[:P]).tolist()
        extra["fresh"] = np.flatnonzero(m[P:2 * P]).tolist()
        extra["count"] = int(m[:P].sum())
        extra["flushed"] = bool(m[2 * P + 1])
        if self.next_deadline is not None:
            extra["deadline"] = self._deadline_of.get(e)
            extra["deadline_expired"] = bool(decode_expired(m[self._stamps]))
        if self.kind not in ARRIVAL_KINDS and not extra["flushed"]:
            extra["initiators"] = sorted(initiators(self.kind, e, P, self.seed))

    def _take(self, included: bool, missed: int,
              dest: tuple[Any, Any] | None = None) -> PartialResult:
        """The kept result as a call's (``dest``: the call's ``out=`` and its flat view, which
        receive a copy; the kept value goes back to the contribution once the call has it,
        :meth:`_recycle`)."""
        value, self._value = self._value, None
        assert value is not None
        given, self._given = self._given, self._round
        # a result kept from before a rebuild is handed out as that world's (its size, its
        # counts; :meth:`rebuild`)
        P = self.world_size if self._vold is None else self._vold[0]
        stamps = slice(2 * P + 2, 3 * P + 2)
        if dest is not None:
            dest[1][...] = value
        shown = self._contribution.present(value) if dest is None else dest[0]
        res = PartialResult.from_meta(shown, self._round, included,
                                      self._vmeta, P, missed, self.rank,
                                      decode_arrivals(self._vmeta[stamps]),
                                      *self._deadline_fields(stamps),
                                      lost=_NONE if self._survival is None
                                      else self._survival.lost)
        self._relayout()  # what a cancelled call gives back is merged in this world's layout
        self._takes.append((res, value, self._vmeta.copy(), given))
        return res

    def _deadline_fields(self, stamps: slice) -> tuple[float | None, bool | None]:
        """``deadline`` and ``deadline_expired`` of the result to take (None, None unless the
        deadline kind), its arrival stamps at ``stamps`` in ``_vmeta``."""
        if self.deadline_config is None:
            return None, None
        return (self._deadline_of.get(self._round),
                bool(decode_expired(self._vmeta[stamps])))

    def _recycle(self, res: PartialResult) -> None:
        """``res`` reached its caller, its value copied into the call's ``out``: it can no
        longer be given back, so its kept value may serve the next result (no fresh array,
        no page faults). Any thread."""
        with self._lock:
            i = next((i for i, t in enumerate(self._takes) if t[0] is res), None)
            if i is None:
                return
            value = self._takes[i][1]
            del self._takes[i]
            self._contribution.recycle(value)

    def _give_back(self, res: PartialResult) -> None:
        """Take back ``res``, a result taken for a call that never received it (the call was
        cancelled after the take): the next call or flush hands it out, summed with what is
        kept when accumulating, else only if nothing newer was taken or kept since (a newer
        result supersedes it). So a cancelled call loses no contribution. Any thread."""
        with self._lock:
            i = next((i for i, t in enumerate(self._takes) if t[0] is res), None)
            if i is None:
                return
            self._relayout()  # the takes are in this world's layout
            _, value, vmeta, given = self._takes[i]
            newest = i == len(self._takes) - 1
            del self._takes[i]
            if self._value is None and newest:  # nothing taken or kept since: as if never
                self._value = value
                self._vmeta[...] = vmeta
                self._given = min(self._given, given)
            elif self.accumulate.sums:
                if self._value is None:
                    self._value = value
                    self._vmeta[...] = vmeta
                else:
                    self._value = self._contribution.merge(self._value, value)
                    stamps = self._vmeta[self._stamps].copy()
                    self._vmeta += vmeta
                    self._vmeta[self._stamps] = stamps  # the newer execution's
                self._given = min(self._given, self._round - 1)  # something to hand out

    def _relayout(self) -> None:
        """Under the lock: if ``_vmeta`` is in an old world's layout (:meth:`rebuild`),
        move it into this world's: counts, fresh flags and arrival stamps to the new ranks,
        the lost ranks' dropped."""
        if self._vold is None:
            return
        (Q, ranks), old = self._vold, self._vmeta
        P = self.world_size
        new = np.zeros(len(self._meta), np.int64)
        for i, j in enumerate(ranks):
            if j >= 0:
                new[j], new[P + j], new[2 * P + 2 + j] = \
                    old[i], old[Q + i], old[2 * Q + 2 + i]
        new[2 * P:2 * P + 2] = old[2 * Q:2 * Q + 2]
        new[3 * P + 2:3 * P + 4] = old[3 * Q + 2:3 * Q + 4]
        self._vmeta, self._vold = new, None
