"""The DDP hook's sync events and its side of taking a lost rank back (:mod:`.hook`;
:mod:`asynccoll.comm.joining`, :mod:`asynccoll.train.joining`, :mod:`.joining`).

In a job whose partial collectives survive a loss (``comm.survive``: ``asynccoll run
--max-failures``), the hook's state has **sync events** at step boundaries, as eager-SGD's
model synchronisation and the :class:`~asynccoll.torch.DistributedOptimizer`'s: every bucket's
handle flushed at once (what each rank held is drained and applied with one step of the
optimizer), then one allreduce of the parameters (averaged) that also carries two kinds of
flags, "finished" and "ready joiners". The step boundary is the optimizer's ``step()``: the
state watches every optimizer's steps (``torch.optim``'s global step hook) and keeps to the
first one that steps the DDP model's parameters, so the training loop needs no call of its
own. Any rank triggers an event by flushing (one that learned a restarted rank is ready does,
after its next step); a flush marks the buckets' results ``flushed``, and a rank that receives
one joins the event after that step, so every rank enters the same events whatever its step
count. :meth:`~.hook.PartialHookState.finish` repeats them until every rank has called it.

At an event that admits restarted ranks, the members make their optimizer state equal (the
lowest member's ``state_dict``, one broadcast), then stripe the parameters and every tensor of
the optimizer's state (as float64, in a fixed order) and the counters to the joiners; every
rank checks a digest (:func:`asynccoll.comm.joining.admit`). The meta data also lists every
bucket's handle and the execution it goes on from, so the joiner makes the same handles and
grows them to the new membership.

A restarted process runs the same script: :func:`~.broadcast.init_process_group` gives each
process of such a job a one-rank Gloo group of its own (a restarted process cannot enter the
job's Gloo group; DDP needs a process group only for its setup here, the hook moves the
gradients), :func:`~.broadcast.broadcast_parameters` does nothing on a process that took a lost
rank's place (``comm.joined``: its state arrives when it is taken back), and its first
backward pass reduces nothing: its ``step()`` applies its own gradient, and the step hook then
replaces parameters and optimizer state by the members'. ``state.step_count`` is the members'
global step from then on, so a loop ``while state.step_count < N`` runs unchanged on every
rank, first start or restart.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..comm import joining
from ..errors import PeerLostError
from ..train.joining import JoinSide
from .broadcast import broadcast_optimizer_state
from .joining import flat64, load_flat64, state_tensors

__all__ = ["HookEvents"]

log = logging.getLogger("asynccoll.torch")

#: the states that watch the optimizers' steps. One global step hook per process, registered
#: once and never removed, hands each step to them: a state that finishes leaves this set
#: instead of removing a hook of its own, which would change torch's hook table while another
#: thread's step reads it (three ranks of one process did: "OrderedDict mutated")
_watching: weakref.WeakSet[HookEvents] = weakref.WeakSet()
_watch_lock = threading.Lock()
_hooked: list[bool] = []


def _after_any_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    with _watch_lock:
        states = list(_watching)
    for state in states:
        state._after_step(opt)


def _watch(state: HookEvents) -> None:
    with _watch_lock:
        _watching.add(state)
        if not _hooked:
            register_optimizer_step_post_hook(_after_any_step)
            _hooked.append(True)


def _unwatch(state: HookEvents) -> None:
    with _watch_lock:
        _watching.discard(state)


class _Buckets:
    """The hook's buckets as one :class:`~asynccoll.comm.joining.Joinable`: one admission
    grows every bucket's handle onto the grown communicator, each from its own next
    execution; the admission's key counts the hook's sync events (equal on every member)."""

    def __init__(self, state: HookEvents) -> None:
        self._state = state
        self.name = f"{state.name}/join"

    @property
    def timeout(self) -> float | None:
        return self._state.timeout

    @property
    def completed(self) -> int:
        return self._state.syncs

    def grow(self, comm: Any, first: int, ranks: list[int]) -> None:  # on the runtime's loop
        for h in self._state.bucket_handles().values():
            h.grow(comm, h.completed + 1, ranks)


class HookEvents(JoinSide):
    """The sync events and the joining side of :class:`~.hook.PartialHookState` (module doc);
    the state provides what is declared here."""

    comm: Any  # the blocking communicator (asynccoll.torch._comm.blocking)
    name: str
    timeout: float | None = None
    steps: int
    #: the hook's sync events so far (equal on every member; a joiner takes the members')
    syncs: int = 0
    _params: dict[int, list[torch.Tensor]]
    _handles: dict[tuple[int, int, str], Any]
    _in_event: bool = False
    _opt: torch.optim.Optimizer | None = None
    _buckets: _Buckets | None = None

    def _bucket_handle(self, index: int, buf: torch.Tensor) -> Any:
        raise NotImplementedError

    def bucket_handles(self) -> dict[tuple[int, int, str], Any]:
        """Every bucket's partial handle made so far, by (index, size, dtype)."""
        return dict(self._handles)

    # -- JoinSide ----------------------------------------------------------------------------
    def _job_comm(self) -> Any:
        return self.comm.comm

    def _comm_now(self) -> Any:
        for key in sorted(self._handles):
            c = self._handles[key].communicator
            if c is not None:
                return c
        return self.comm.comm

    def _events_init(self) -> None:
        """In a surviving job: watch for restarted ranks (members), or be one (a restarted
        process joins after its first step), and watch the optimizer's steps."""
        c = self.comm.comm
        if not c.survive:
            return
        self._buckets = _Buckets(self)
        self._joiners = joining.Joiners(c.job, self._buckets.name)
        self._joining = bool(c.joined)
        _watch(self)

    def _stop_watching(self) -> None:
        _unwatch(self)

    def _owns(self, opt: torch.optim.Optimizer) -> bool:
        mine = {id(p) for ps in self._params.values() for p in ps}
        return any(id(p) in mine for g in opt.param_groups for p in g["params"])

    def _after_step(self, opt: torch.optim.Optimizer) -> None:
        """Every optimizer's step ends here (module doc): the DDP model's starts the events."""
        if self._in_event or not self._params:
            return
        if self._opt is None:
            if not self._owns(opt):
                return
            self._opt = opt
        elif opt is not self._opt:
            return
        if self._joining:
            self._join_step(opt)
        elif self._handles and (self._sync_wanted or self._join_wanted()):
            self._event(opt, finished=False)

    def _saw_flushed(self) -> None:
        """A bucket's result was flushed: join the event after this step (progress thread)."""
        if self._joiners is not None:
            self._sync_wanted = True

    # -- the events --------------------------------------------------------------------------
    def _flush_all(self) -> tuple[int, dict[int, torch.Tensor]]:
        """Flush every bucket's handle at once (a rank still in its backward may wait on a
        bucket whose execution only another rank's flush of it can force); returns the local
        gradients held over all ranks and the drained gradient per bucket index."""
        raise NotImplementedError

    def _write_grads(self, flushed: dict[int, torch.Tensor]) -> None:
        raise NotImplementedError

    def _all_params(self) -> list[torch.Tensor]:
        """The DDP model's parameters in the optimizer's order (the same on every rank; the
        buckets' order is not: a restarted process has seen DDP's first buckets only)."""
        assert self._opt is not None
        return [p for g in self._opt.param_groups for p in g["params"]]

    def _apply_drained(self, opt: torch.optim.Optimizer) -> int:
        """The flush of every bucket, applied with one step of ``opt`` (if anything was held),
        the gradients the caller's backward left in ``.grad`` put back afterwards."""
        held, flushed = self._flush_all()
        if held:
            params = self._all_params()
            saved = [p.grad for p in params]
            self._write_grads(flushed)
            self._in_event = True
            try:
                opt.step()
            finally:
                self._in_event = False
                for p, g in zip(params, saved, strict=True):
                    p.grad = g
        return held

    def _event(self, opt: torch.optim.Optimizer, *, finished: bool) -> tuple[bool, int]:
        """One sync event (module doc); returns whether every rank has finished and how many
        local gradients its flush drained (over all ranks)."""
        assert self._joiners is not None
        self._sync_wanted = False
        held = self._apply_drained(opt)
        now = self._comm_now()
        params = self._all_params()
        flat = flat64(params)
        n = flat.size
        buf = np.zeros(n + 1 + self.comm.comm.job.size, np.float64)
        buf[:n] = flat
        buf[n] = 1.0 if finished else 0.0
        buf[n + 1:] = self._joiners.flags(now.members)
        try:
            tot = self.comm.submit(now.allreduce(buf, timeout=self.timeout)).result()
        except PeerLostError as exc:
            self._lost_in_event(exc, "its parameters' allreduce", now)
            return False, held
        load_flat64(params, tot[:n] / now.size)
        self.syncs += 1
        done = bool(tot[n] >= now.size)
        if not done:
            admitted = self._joiners.agreed(tot[n + 1:], now.members)
            if admitted:
                try:
                    self._admit(opt, now, admitted)
                except PeerLostError as exc:
                    self._joiners.again(admitted)
                    self._lost_in_event(exc, f"taking {admitted} back")
        return done, held

    def _finish_events(self, opt: torch.optim.Optimizer) -> int:
        """:meth:`~.hook.PartialHookState.finish` in a surviving job: events until every rank
        has called it, then the lowest member's optimizer state for all; returns the local
        gradients the events drained."""
        self._stop_watching()
        self._opt = opt
        held, done = 0, False
        while not done:
            done, n = self._event(opt, finished=True)
            held += n
        broadcast_optimizer_state(opt, 0, comm=self._comm_now())
        return held

    # -- joining -----------------------------------------------------------------------------
    def _admit(self, opt: torch.optim.Optimizer, now: Any, admitted: list[int]) -> None:
        broadcast_optimizer_state(opt, 0, comm=now)  # equal on every member
        assert self._buckets is not None
        state = [flat64(self._all_params()), flat64(state_tensors(opt, self._all_params()))]
        at = {id(p): i for i, p in enumerate(self._all_params())}
        buckets = [[i, n, dtype, h.completed + 1, [at[id(p)] for p in self._params[i]]]
                   for (i, n, dtype), h in sorted(self._handles.items())]
        self.comm.submit(joining.admit(self._buckets, now, admitted, state,
                                       {"steps": self.steps, "syncs": self.syncs,
                                        "buckets": buckets})).result()

    def _join_step(self, opt: torch.optim.Optimizer) -> None:
        """A restarted process, after its first step: be taken back, receive the state, make
        the members' bucket handles and grow them (module doc)."""
        self._joining = False
        assert self._buckets is not None
        params = self._all_params()
        flat, flat_state = flat64(params), flat64(state_tensors(opt, self._all_params()))
        c = self.comm.comm
        grown, _, meta = self.comm.submit(
            joining.join(c, self._buckets.name, [flat, flat_state], self.timeout)).result()
        load_flat64(params, flat)
        load_flat64(state_tensors(opt, params), flat_state)
        members = list(grown.members)
        ranks = [members.index(m) if m in members else -1 for m in range(c.size)]
        grows: list[Callable[[], None]] = []
        # the members' buckets (DDP rebuilt them after its first step; this process has seen
        # only the first ones): the handles, and which parameters each bucket holds
        self._params = {int(b[0]): [params[i] for i in b[4]] for b in meta["buckets"]}
        for index, numel, dtype, first, _ in meta["buckets"]:
            like = torch.zeros(int(numel), dtype=getattr(torch, str(dtype).split(".")[-1]))
            h = self._bucket_handle(int(index), like)
            grows.append(functools.partial(h.grow, grown, int(first), ranks))
        self.comm.submit(c.on_runtime(lambda: [g() for g in grows])).result()
        self.steps = int(meta.get("steps", 0))
        self.syncs = int(meta.get("syncs", 0))
