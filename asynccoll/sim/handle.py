"""The partial allreduce's call rules in virtual time (the dense allreduce and the barrier
are in :mod:`.dense`).

:class:`SimPartial` is :class:`asynccoll.comm.partial.PartialAllreduce` for P ranks of a
:class:`~asynccoll.sim.engine.SimWorld`: one persistent :class:`~asynccoll.sim.engine.SimExecutor`
per rank running the schedule :func:`~asynccoll.collectives.partial.build_partial_allreduce`
builds, and the same rules, in the same order (read that module's doc):

1. a call that finds an execution completed and not yet given returns at once with the latest
   result (``included=False``; with ``accumulate`` the sum) and leaves its data for later;
2. otherwise its data goes into the send buffer and the rank takes part in the current
   execution (starting it when it is in S(e); for quorum: announcing its arrival), or, when
   the execution was already activated here from outside, waits for it with
   ``included=False``.

``flush`` is the runtime's: every rank forces one execution not yet activated here after it
began flushing, and the flush ends at the first execution all P ranks flushed in.

**Data or accounting.** With ``data=True`` the handle uses the runtime's own
:class:`~asynccoll.comm.contribution.DenseContribution` (the same buffers, snapshot kernel and
meta vector), so values, contributors and rounds are a real run's. With ``data=False`` no data
moves: each rank keeps only its ``state`` vector, the snapshot hook writes the rank's meta with
the runtime's :func:`~asynccoll.collectives.partial.write_meta` and adds it to the execution's
sum (what the meta allreduce would compute), and results carry ``value=None``. Results are
:class:`~asynccoll.PartialResult` objects built by ``PartialResult.from_meta``, as the runtime's.

**Policies.** The handle takes the runtime's policy values (or their text,
:func:`~asynccoll.as_policy`): ``Solo()``, ``Majority(seed=)``, ``TwoChoice(seed=)``,
``Quorum(k)``, ``Backup(b)`` (a quorum of P - b) and ``Deadline(...)``; ``Sync()`` is
:class:`~asynccoll.sim.dense.SimSync`'s. The initiator draws use the policy's ``seed`` when it
gives one, else the handle's ``seed`` argument (the runtime derives a missing seed from the
handle's name instead; pass a seeded policy to compare with a runtime handle draw for draw).

**Deadline.** ``Deadline()`` is the runtime's, step for step: the deadline kind's schedule
(k of P arrivals activate), a timer armed by each call of rule 2 for the rank's current
deadline, which, when it fires before the execution was activated on the rank, sets the
rank's ``EXPIRED`` flag and forces the execution; late calls recorded in ``LATE``; after each
execution every rank reads its spread from the allreduced meta
(:func:`~asynccoll.collectives.partial.arrival_spread`) into a window and computes the next
deadline with :func:`~asynccoll.collectives.partial.next_deadline`. Results carry
``deadline`` and ``deadline_expired`` as the runtime's do; :attr:`SimPartial.deadlines`
records the deadline each execution used.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..collectives import KERNELS
from ..collectives.partial import (
    ARRIVAL_KINDS,
    ARRIVED,
    COUNT,
    DSIG,
    EXPIRED,
    FLUSHING,
    FRESH,
    LATE,
    SNAPSHOTS,
    STATE_LEN,
    TAG_FORCE,
    DeadlineConfig,
    activation,
    arrival_spread,
    arrival_stamp,
    build_partial_allreduce,
    call_rule,
    deadline_signature,
    decode_arrivals,
    decode_expired,
    first_stamp,
    initiators,
    late_mark,
    meta_len,
    next_deadline,
    signature,
    signature_sum,
    write_meta,
)
from ..collectives.policy import Policy, as_policy, moved_arguments
from ..comm.contribution import DenseContribution
from ..results import PartialResult
from ..sched import Schedule
from .engine import SimExecutor, SimulationError, SimWorld

__all__ = ["Returned", "SimPartial"]

#: ``on_return(result, rank)``: called at the virtual time a call returns
Returned = Callable[[PartialResult, int], None]

#: the keywords ``SimPartial`` took before policies were values, and what to write now
MOVED = {"quorum": "give Quorum(k) or Deadline(quorum=k) as the policy",
         "deadline": "give Deadline(bounds=(lo, hi), mad_factor=..., window=...) as the policy",
         "kind": "give the policy (Solo(), Majority(), ..., or its text) as the second argument"}


@functools.lru_cache(maxsize=16)
def _partial_schedules(world_size: int, count: int, dtype: str, kind: str, op: str,
                       quorum: int | None, algorithm: str | None) -> tuple[Schedule, ...]:
    """Every rank's schedule (cached: building costs ~3 ms per rank at P = 1024)."""
    return tuple(build_partial_allreduce(r, world_size, count, dtype, kind=kind, op=op,
                                         quorum=quorum, algorithm=algorithm)
                 for r in range(world_size))


class SimPartial:
    """A persistent partial allreduce of every rank of ``world`` (module doc).

    ``policy``: a partial policy value or its text (module doc, *Policies*). ``like``: an
    array of each call's shape and dtype. ``seed``: the initiator draws' seed when the policy
    gives none. ``data``: move data (module doc). ``choices``: for ``TwoChoice()``, draw that
    many initiators instead (a what-if the runtime does not offer). Raises ``ValueError``
    naming a bad ``policy`` (``Sync()``, or one that does not fit the world), ``choices``,
    ``accumulate`` or ``like``; ``TypeError`` naming the new spelling for ``kind=``,
    ``quorum=`` and ``deadline=`` (:data:`MOVED`).
    """

    @moved_arguments(**MOVED)
    def __init__(self, world: SimWorld, policy: Policy | str, like: Any, *, seed: int = 0,
                 accumulate: bool | str = False, op: str = "sum", data: bool = True,
                 algorithm: str | None = None, sched_id: int = 1,
                 choices: int | None = None) -> None:
        policy = as_policy(policy)
        if not policy.partial:
            raise ValueError(f"policy must be a partial policy, got {policy!r} (a synchronous "
                             "allreduce is asynccoll.sim.SimSync)")
        P = world.world_size
        act = policy.activation(P)  # ValueError naming the policy when it does not fit
        kind = act.kind
        if choices is not None and (kind != "two_choice" or not 1 <= choices):
            raise ValueError(f"choices applies to TwoChoice() and must be >= 1, got "
                             f"{choices!r} with {policy!r}")
        if accumulate not in (False, True, "sum"):
            raise ValueError(f"accumulate must be False, True or 'sum', got {accumulate!r}")
        quorum = act.quorum
        #: the deadline's validated parameters (``Deadline()``), else None
        self.config: DeadlineConfig | None = act.deadline
        skind = kind
        like = np.asarray(like)
        self.world = world
        #: the straggler policy (:mod:`asynccoll.collectives.policy`)
        self.policy = policy
        self.kind = kind
        self.quorum = quorum
        self.seed = seed if policy.seed is None else policy.seed
        self.accumulate = bool(accumulate)
        self.op = op
        self.data = data
        self.world_size = P
        self.shape = like.shape
        self.dtype = like.dtype
        self.sched_id = sched_id
        self.choices = choices
        m = meta_len(P)
        self._stamps = slice(2 * P + 2, 3 * P + 2)
        self._contrib: list[DenseContribution] = []
        self._meta: list[np.ndarray] = []
        self._state: list[np.ndarray] = []
        self.executors: list[SimExecutor] = []
        self._agg: dict[int, np.ndarray] = {}
        self._agg_left: dict[int, int] = {}
        # what deadline policy observations and staleness need
        self.deadlines: dict[int, float] = {}
        #: execution -> when its first call arrived / when its first snapshot was taken (the
        #: virtual times the deadline tests read)
        self.first_arrival: dict[int, float] = {}
        self.started_at: dict[int, float] = {}
        self.forced_by_deadline: set[int] = set()
        #: per rank: the calls whose data waits in its send buffer
        self._pending: list[list[int]] = [[] for _ in range(P)]
        #: call id -> the execution its data went into / the round of the result it returned
        self.snapshot_of: dict[int, int] = {}
        self.returned_round: dict[int, int] = {}
        self._cid = [-1] * P
        #: execution -> (count, fresh ranks, forced by a flush), at its first completion
        self.executions: dict[int, tuple[int, int, bool]] = {}
        self._calls = 0
        if data:
            kernels = dict(KERNELS)
            snap = KERNELS["partial_snapshot"]

            def snapshot(out: Any, inputs: Any, params: Any, msgs: Any) -> Any:
                r = params["rank"]
                self._snapshot_taken(r, self.executors[r].execution)
                return snap(out, inputs, params, msgs)

            kernels["partial_snapshot"] = snapshot
            for r in range(P):
                c = DenseContribution(op, algorithm)
                sched, bufs = c.build(like, r, P, skind, quorum)
                self._contrib.append(c)
                self._meta.append(bufs["meta"])
                self._state.append(bufs["state"])
                self.executors.append(self._executor(sched, bufs, kernels))
            self._sig = self._contrib[0].signature
        else:
            scheds = _partial_schedules(P, int(like.size), like.dtype.str, skind, op, quorum,
                                        algorithm)
            # one scratch meta for all ranks: a snapshot writes it whole and adds it to its
            # execution's sum at once (P meta vectors of 3P + 4 int64 would be 50 MB at
            # P = 1024, streamed through the cache once per execution)
            scratch = np.zeros(m, np.int64)
            for r in range(P):
                self._meta.append(scratch)
                self._state.append(np.zeros(STATE_LEN, np.int64))
                self.executors.append(self._executor(scheds[r], None, None))
            self._sig = signature(skind, op, quorum, int(like.size), like.dtype, algorithm)
        self._given = [-1] * P
        #: id(meta) -> (meta, its result without the per-call fields): timing mode (_take)
        self._decoded: dict[int, tuple[np.ndarray, PartialResult]] = {}
        self._round = [-1] * P
        self._value: list[Any] = [None] * P
        #: per rank, the meta of the value kept: its own buffer with data; without, the
        #: execution's sum itself (never written once complete), or a new array for a sum
        self._vmeta = [np.zeros(m, np.int64) for _ in range(P)] if data \
            else [np.zeros(m, np.int64)] * P
        self._has_value = [False] * P
        self._wait_round = [-1] * P
        self._wait_included = [False] * P
        self._waiter: list[Returned | None] = [None] * P
        self._busy = [False] * P
        self._flushing_seen = [0] * P
        self._flush: list[dict[str, Any] | None] = [None] * P
        dsig = deadline_signature(self.config)
        for st in self._state:
            st[DSIG] = dsig
        dc = self.config
        #: per rank, as the runtime: the next deadline, the window of spreads, the deadline
        #: each execution used, the latest first-arrival stamp, the waiting call's stamp
        self._next = [None if dc is None else dc.hi] * P
        self._spreads: list[deque[float]] = [deque(maxlen=dc.window if dc else 1)
                                             for _ in range(P)]
        self._deadline_of: list[dict[int, float]] = [{} for _ in range(P)]
        self._first_stamp = [0] * P
        self._wait_stamp = [0] * P

    def _executor(self, sched: Schedule, bufs: dict[str, Any] | None,
                  kernels: dict[str, Any] | None) -> SimExecutor:
        r = sched.rank
        hooks = None if bufs is not None else {"partial_snapshot": self._hook_snapshot}
        # the snapshot kernel notes when an execution started (data mode): never fired ahead
        return SimExecutor(self.world, sched, sched_id=self.sched_id, persistent=True,
                           buffers=bufs, kernels=kernels, hooks=hooks,
                           on_complete=functools.partial(self._on_complete, r),
                           clocked=("partial_snapshot",))

    def staleness(self) -> np.ndarray:
        """Per call whose data went into an execution: that execution minus the round of the
        result the call returned (0: its data is in its own result; rule-1 calls are >= 1)."""
        return np.array([e - self.returned_round[c] for c, e in self.snapshot_of.items()
                         if c in self.returned_round], np.int64)

    def initiators(self, e: int) -> frozenset[int]:
        """S(e): the runtime's :func:`~asynccoll.collectives.partial.initiators`, or with
        ``choices=q`` (a simulator-only what-if: RNA's q probes) q distinct ranks drawn from
        ``(seed, e)``."""
        if self.choices is None or self.choices == 2:
            return initiators(self.kind, e, self.world_size, self.seed)
        rng = np.random.default_rng((self.seed, e))
        q = min(self.choices, self.world_size)
        return frozenset(rng.choice(self.world_size, q, replace=False).tolist())

    def leftover(self) -> int:
        """Contributions still in the ranks' send buffers (not in any execution yet)."""
        return int(sum(int(st[COUNT]) for st in self._state))

    @property
    def calls(self) -> int:
        """How many calls the handle has had (flushes not counted)."""
        return self._calls

    # -- snapshots ---------------------------------------------------------------------------
    def _hook_snapshot(self, rank: int, e: int, op: int) -> None:
        self._snapshot_taken(rank, e)
        params = self.executors[rank].schedule.ops[op].params
        meta = self._meta[rank]
        write_meta(meta, self._state[rank], params)
        agg = self._agg.get(e)
        if agg is None:
            agg = self._agg[e] = np.zeros_like(meta)
            self._agg_left[e] = self.world_size
        agg += meta

    def _snapshot_taken(self, rank: int, e: int) -> None:
        if e not in self.started_at:
            self.started_at[e] = self.world.now
        pend = self._pending[rank]
        if pend:
            for cid in pend:
                self.snapshot_of[cid] = e
            pend.clear()

    # -- calls -------------------------------------------------------------------------------
    def call(self, rank: int, x: Any, on_return: Returned) -> None:
        """Rank ``rank`` calls the handle with ``x`` now (virtual time); ``on_return(result,
        rank)`` runs when the call returns. ``x`` is ignored without data. Raises
        ``SimulationError`` when the rank has a call or flush under way."""
        if self._busy[rank]:
            raise SimulationError(f"rank {rank}: a call or flush of this handle is under way")
        st = self._state[rank]
        ex = self.executors[rank]
        cid = self._calls
        self._pending[rank].append(cid)
        self._calls += 1
        rule = call_rule(self._round[rank], self._given[rank], int(st[SNAPSHOTS]))
        stamp = arrival_stamp(self.world.now)
        if rule.answer_now:
            self._note_late(rank, stamp)
            self._add(rank, x, True)
            res = self._take(rank, False, rule.missed)
            self.returned_round[cid] = res.round
            w = self.world
            w.at(w.cpu(rank, w.gamma), on_return, res, rank)
            return
        cur, late = rule.execution, rule.late
        self._add(rank, x, late)
        self._wait_round[rank] = cur
        self._wait_included[rank] = not late
        self._waiter[rank] = on_return
        self._cid[rank] = cid
        self._wait_stamp[rank] = stamp
        self._busy[rank] = True
        if not late:
            st[FRESH] = 1
            st[ARRIVED] = stamp
            how = activation(self.kind in ARRIVAL_KINDS or rank in self.initiators(cur),
                             bool(self._flushing_seen[rank]))
            if how == "force":
                self._force(rank, cur)
            else:
                d = self._next[rank]
                if d is not None:
                    w = self.world
                    if cur not in self.first_arrival:
                        self.first_arrival[cur] = w.now
                    w.at(w.now + d, self._expire, rank, cur)
                if how == "start":
                    ex.start()

    def flush(self, rank: int, on_return: Returned) -> None:
        """Rank ``rank`` begins its flush (collective: every rank must); ``on_return`` gets
        what was not yet given, as the runtime's flush returns it."""
        if self._busy[rank]:
            raise SimulationError(f"rank {rank}: a call or flush of this handle is under way")
        self._busy[rank] = True
        self._state[rank][FLUSHING] = 1
        self._flush[rank] = {"forced": False, "cb": on_return}
        self._flush_step(rank)

    def _flush_step(self, rank: int) -> None:
        f = self._flush[rank]
        assert f is not None
        ex = self.executors[rank]
        cur = ex.completed + 1
        if not f["forced"] and self._state[rank][SNAPSHOTS] <= cur:
            self._force(rank, cur)
            f["forced"] = True

    def _force(self, rank: int, e: int) -> None:
        self.world.post(rank, rank, self.sched_id, e, TAG_FORCE, 2, 0, None, None)

    def _note_late(self, rank: int, stamp: int, first: int | None = None) -> None:
        if self.config is not None:
            st = self._state[rank]
            st[LATE] = late_mark(int(st[LATE]), stamp,
                                 self._first_stamp[rank] if first is None else first)

    def _expire(self, rank: int, e: int) -> None:
        st = self._state[rank]
        if st[SNAPSHOTS] > e:
            return
        st[EXPIRED] = 1
        self.forced_by_deadline.add(e)
        self._force(rank, e)

    def _add(self, rank: int, x: Any, late: bool) -> None:
        st = self._state[rank]
        if self.data:
            flat = self._contrib[rank].check(np.asarray(x, self.dtype).reshape(self.shape))
            st[COUNT] = self._contrib[rank].add(flat, int(st[COUNT]), None, late)
        else:
            st[COUNT] += 1

    # -- completions -------------------------------------------------------------------------
    def _on_complete(self, rank: int, e: int) -> None:
        P = self.world_size
        if self.data:
            c = self._contrib[rank]
            c.unpack_meta()
            meta = self._meta[rank]
        else:
            meta = self._agg[e]
            self._agg_left[e] -= 1
            if not self._agg_left[e]:
                del self._agg[e], self._agg_left[e]
        sig = self._sig ^ int(self._state[rank][DSIG])
        total = signature_sum(meta, P)
        if total != P * sig:
            raise SimulationError(f"rank {rank}: the ranks disagree on the partial allreduce "
                                  f"(signature sum {total} != {P} x {sig})")
        if e not in self.executions:
            self.executions[e] = (int(meta[:P].sum()), int(np.count_nonzero(meta[P:2 * P])),
                                  bool(meta[2 * P + 1]))
        self._keep(rank, meta)
        self._round[rank] = e
        if self._next[rank] is not None:
            self._adapt(rank, e, meta)
        self._flushing_seen[rank] = int(meta[2 * P + 1])
        if e == self._wait_round[rank]:
            res = self._take(rank, self._wait_included[rank], 0)
            self.returned_round[self._cid[rank]] = res.round
            cb = self._waiter[rank]
            self._waiter[rank] = None
            self._busy[rank] = False
            self._wait_round[rank] = -1
            assert cb is not None
            w = self.world
            w.at(w.now, cb, res, rank)
        f = self._flush[rank]
        if f is not None:
            if self._flushing_seen[rank] == P:
                self._flushing_seen[rank] = 0
                self._flush[rank] = None
                self._state[rank][FLUSHING] = 0
                self._busy[rank] = False
                c2 = self._round[rank]
                res = self._take(rank, True, c2 - self._given[rank] - 1)
                w = self.world
                w.at(w.now, f["cb"], res, rank)
            else:
                self._flush_step_after(rank)

    def _flush_step_after(self, rank: int) -> None:
        # the executor re-arms after on_complete returns; force once it has
        w = self.world
        w.at(w.now, self._flush_step, rank)

    def _keep(self, rank: int, meta: np.ndarray) -> None:
        summed = self._has_value[rank] and self.accumulate
        if self.data:
            self._value[rank] = self._contrib[rank].keep(self._value[rank], self.accumulate)
        self._has_value[rank] = True
        vm = self._vmeta[rank]
        if not self.data:
            if summed:
                vm = vm + meta
                vm[self._stamps] = meta[self._stamps]
            self._vmeta[rank] = vm if summed else meta
        elif summed:
            vm += meta
            vm[self._stamps] = meta[self._stamps]
        else:
            vm[...] = meta

    def _take(self, rank: int, included: bool, missed: int) -> PartialResult:
        value = self._value[rank]
        self._value[rank] = None
        self._has_value[rank] = False
        self._given[rank] = self._round[rank]
        vm = self._vmeta[rank]
        if value is not None:
            value = self._contrib[rank].present(value)
        dl: float | None = None
        if self.config is not None:
            dl = self._deadline_of[rank].get(self._round[rank])
        if not self.data:
            # timing mode: the ranks that take one execution's result share its meta (the
            # execution's sum), so decode it once per execution, not once per call (O(P)
            # NumPy work and sets of up to P ranks)
            base = self._decoded.get(id(vm))
            if base is None or base[0] is not vm:
                if len(self._decoded) > 64:
                    self._decoded.clear()
                base = (vm, self._from_meta(None, False, vm, 0, None, rank))
                self._decoded[id(vm)] = base
            res = base[1]
            return dataclasses.replace(res, included=included, missed=missed,
                                       arrivals=dict(res.arrivals),
                                       lateness=res.arrivals.get(rank), deadline=dl)
        return self._from_meta(value, included, vm, missed, dl, rank)

    def _from_meta(self, value: Any, included: bool, vm: np.ndarray, missed: int,
                   dl: float | None, rank: int) -> PartialResult:
        expired = bool(decode_expired(vm[self._stamps])) if self.config is not None else None
        return PartialResult.from_meta(value, self._round[rank], included, vm,
                                       self.world_size, missed, rank,
                                       decode_arrivals(vm[self._stamps]), dl, expired)

    # -- the deadline ------------------------------------------------------------------------
    def _adapt(self, rank: int, e: int, meta: np.ndarray) -> None:
        """The runtime's ``_adapt``: note the deadline e used, its first arrival (for late
        calls), a late waiting call, and the next deadline."""
        dc = self.config
        assert dc is not None
        P = self.world_size
        used = self._next[rank]
        assert used is not None
        self._deadline_of[rank][e] = used
        self._deadline_of[rank].pop(e - 64, None)
        if e not in self.deadlines:
            self.deadlines[e] = used
        first = first_stamp(meta[self._stamps])
        self._first_stamp[rank] = first
        if e == self._wait_round[rank] and not self._wait_included[rank]:
            self._note_late(rank, self._wait_stamp[rank], first)
        if not meta[2 * P + 1]:
            spread = arrival_spread(meta, P, self.quorum or P)
            if spread is not None:
                self._spreads[rank].append(spread)
        self._next[rank] = next_deadline(list(self._spreads[rank]), dc.m, dc.lo, dc.hi)
