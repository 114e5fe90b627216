"""A DDP communication hook running a partial allreduce per bucket (eager-SGD §5 for DDP).

``state, hook = partial_hook(comm, Majority())`` then ``ddp.register_comm_hook(state,
hook)``. Each DDP bucket gets one persistent partial handle (``op="avg"``), made at the
bucket's first partial step and named by the hook's ``name``, the bucket's index and size, so
equal on every rank. The hook starts the bucket's call on the progress thread and returns a
``torch.futures.Future`` at once, so buckets overlap with the rest of the backward pass.

* **Averaging by the world** (``average="world"``, the default; eager-SGD's choice): the
  future resolves to the bucket's gradients summed over the local gradients the round holds and
  divided by P: every gradient enters the model exactly once with weight 1/P, as under
  synchronous SGD, however the rounds split the steps. After a survived loss each round is
  divided by the ranks it spanned (``PartialResult.world_size``), as
  :class:`asynccoll.train.EagerSGD` does. This is the default because it keeps the final
  accuracy of synchronous DDP: on examples/torch_ddp.py every policy ended 0.0 to 0.7 points
  below DDP over Gloo (the mean test accuracy over the last 10 evaluations, 3 seeds, 2 runs
  each; docs/torch.md, *Accuracy*).
* ``average="contributions"`` divides each round's sum by its own ``count`` instead: a round
  that only three of four ranks made is the mean of those three. Under solo and majority,
  where ranks out of phase start several small rounds per step (and the final ``finish()``
  drains many one-gradient rounds), that sums several full-size averages into one step, a
  larger effective rate that cost accuracy in docs/torch.md's measurements.
* **Stale gradients** (eager-SGD §5): a rank whose gradient arrives after its round started
  gets that round's result at once and its gradient stays in the handle's send buffer for the
  next round: never dropped, never counted twice.
* **accumulate** (default True): a rank that missed rounds gets the sum of their per-round
  averages (each round divided as it completes: the handle's ``Accumulate.WORLD`` or its
  ``op="avg"``) (every rank applies the same total, so plain-SGD replicas stay equal after
  :meth:`PartialHookState.finish`); False: only the latest round's average (the paper).
* ``Sync()``: a plain averaging allreduce per bucket, DDP's default hook over asynccoll.
* ``Deadline(quorum=, bounds=, mad_factor=, window=)``: a bucket's round starts once its
  quorum of ranks (default all) have arrived or an adaptive deadline after the first arrival
  expired (as :meth:`Communicator.partial_allreduce
  <asynccoll.Communicator.partial_allreduce>`); each bucket adapts its own deadline, and
  :class:`BucketStep` reports ``deadline`` and ``deadline_expired``.
* **The first step is synchronous** whatever the policy: DDP rebuilds its buckets after its first
  iteration, and handles are only made for the buckets it keeps.

``state.buckets`` holds, per bucket index, what its latest step did (:class:`BucketStep`:
round, included, contributors, count, staleness); ``state.finish(opt)`` (collective, on every
rank after the last backward) flushes every bucket, applies what was still in flight with one
``opt.step()`` and hands rank 0's parameters to every rank, so replicas end equal to the bit.
``finish()`` without the optimizer refuses (the drained gradients would sit in ``.grad``
unapplied); ``finish(None)`` writes them there for a step of your own.
DDP's ``broadcast_buffers`` re-synchronises buffers through its own process group at every
forward: pass ``broadcast_buffers=False`` for models with buffers, or stragglers make everyone
wait there.

In a job that survives losses (``asynccoll run --max-failures``/``--max-restarts``) the state
also has **sync events** at the optimizer's step boundary, where restarted ranks are taken back
with the parameters, the optimizer's state and the bucket layout; ``state.step_count`` is the
global step to loop on, and ``finish(opt)`` repeats events until every rank has called it
(``finish(None)`` refuses there): :mod:`.hook_events`.
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..collectives.policy import (
    POLICY_MOVED,
    Accumulate,
    Majority,
    Policy,
    as_policy,
    moved_arguments,
)
from ..comm.blocking import BlockingCollectives
from ..results import PartialResult
from ._comm import blocking, by_world, pieces, world_accumulate
from .broadcast import broadcast_parameters
from .hook_events import HookEvents

__all__ = ["BucketStep", "PartialHookState", "partial_hook"]

AVERAGES = ("world", "contributions")

#: hooks made so far per communicator, for default names that never collide (every rank makes
#: its hooks in the same order, so the n-th hook has the same name everywhere)
_hooks_made: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

#: ``finish()``'s optimizer when the caller gave none (a refusal, not a default)
_MISSING: Any = object()


@dataclass(frozen=True)
class BucketStep:
    """What one bucket's latest step did (the fields of :class:`~asynccoll.PartialResult`,
    plus ``step``: this rank's step count for the bucket, and ``staleness``: how many
    consecutive steps of this rank, this one included, were not in the result they got;
    ``deadline`` and ``deadline_expired`` are None unless ``kind="deadline"``)."""

    step: int
    round: int
    included: bool
    contributors: frozenset[int]
    count: int
    staleness: int
    missed: int = 0
    deadline: float | None = None
    deadline_expired: bool | None = None


class PartialHookState(HookEvents):
    """The state of :func:`partial_hook` (the ``state`` DDP passes to the hook).

    ``buckets``: bucket index -> :class:`BucketStep` of its latest step (updated on the
    progress thread as each future resolves). ``steps``: backward passes seen (counted at
    bucket 0, which DDP always reduces first); ``step_count``: the same, the members' global
    step on a process that took a lost rank's place (loop on it: :mod:`.hook_events`).
    ``calls``: buckets handed to the hook so far (this rank's contributions: over all ranks,
    the ``count`` of every result plus what :meth:`finish` drains adds up to P times this).
    ``syncs``: the sync events so far (only in a surviving job: :mod:`.hook_events`).
    """

    def __init__(self, comm: BlockingCollectives, policy: Policy, accumulate: bool, name: str,
                 average: str = "world") -> None:
        self.comm = comm
        #: the straggler policy of every bucket (:mod:`asynccoll.collectives.policy`)
        self.policy = policy
        self.kind = policy.name
        self.accumulate = accumulate
        self.name = name
        self.average = average
        self.buckets: dict[int, BucketStep] = {}
        self.steps = 0
        #: buckets handed to the hook so far (this rank's contributions, for accounting)
        self.calls = 0
        self._handles: dict[tuple[int, int, str], Any] = {}
        self._params: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._events_init()  # sync events and joining, in a surviving job (.hook_events)

    def __repr__(self) -> str:
        return (f"PartialHookState({self.policy!r}, name={self.name!r}, steps={self.steps}, "
                f"buckets={len(self._params)})")

    def _bucket_handle(self, index: int, buf: torch.Tensor) -> Any:
        key = (index, buf.numel(), str(buf.dtype))
        h = self._handles.get(key)
        if h is None:
            by_count = self.average == "contributions"
            h = self.comm.comm.partial_allreduce(
                self.policy, like=buf, op="avg" if by_count else "sum",
                # (op="avg" turns accumulating into its per-round MEAN itself)
                accumulate=(Accumulate.SUM if self.accumulate else Accumulate.LATEST)
                if by_count else world_accumulate(self.accumulate),
                name=f"{self.name}/bucket{index}/{buf.numel()}/{buf.dtype}")
            h.flush_hint = "'state.finish(opt)' of the DDP hook's state"
            self._handles[key] = h
        return h

    def reduce(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """The hook's work for one bucket (see the module doc)."""
        index = bucket.index()
        buf = bucket.buffer()
        self._params[index] = list(bucket.parameters())
        if index == 0:  # DDP reduces its buckets in index order: 0 opens a backward pass
            self.steps += 1
        step = self.steps - 1
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        if self._joining:
            # a restarted process's first backward: nothing to reduce with the members yet;
            # its step applies its own gradient, then the state arrives (.hook_events)
            fut.set_result(buf)
            return fut
        self.calls += 1
        P = self.comm.size
        if not self.policy.partial or step == 0:
            cf: concurrent.futures.Future[Any] = self.comm.submit(
                self.comm.comm.allreduce(buf, op="avg"))
            everyone = frozenset(range(P))
            self._record(index, BucketStep(step, step, True, everyone, P, 0))

            def done_sync(f: concurrent.futures.Future[Any]) -> None:
                _complete(fut, f, lambda v: v)

            cf.add_done_callback(done_sync)
            return fut
        # the result into the bucket itself (out=, read after the call took buf's data), as
        # the default hook's in-place allreduce: no fresh tensor per bucket and step
        h = self._bucket_handle(index, buf)
        cf = self.comm.submit(h(buf, out=buf))

        def done(f: concurrent.futures.Future[Any]) -> None:
            _complete(fut, f, lambda r: self._result(index, step, r, h))

        cf.add_done_callback(done)
        return fut

    def _result(self, index: int, step: int, res: PartialResult, h: Any) -> torch.Tensor:
        if res.flushed:
            self._saw_flushed()
        prev = self.buckets.get(index)
        stale = 0 if res.included else (prev.staleness + 1 if prev is not None else 1)
        self._record(index, BucketStep(step, res.round, res.included, res.contributors,
                                       res.count, stale, res.missed, res.deadline,
                                       res.deadline_expired))
        value: torch.Tensor = res.value
        return value if self.average == "contributions" else by_world(res, h)

    def _record(self, index: int, info: BucketStep) -> None:
        with self._lock:
            self.buckets[index] = info

    def finish(self, optimizer: torch.optim.Optimizer | None = _MISSING) -> int:
        """Collective: flush every bucket's handle; write what was still in flight into the
        parameters' ``.grad`` (zeros where nothing was), apply it with one ``optimizer.step()``
        and give every rank rank 0's parameters (one broadcast per dtype), so that every
        replica ends equal to the bit whatever rounds each rank applied on its way (after a
        survived loss: over the survivors, from the lowest of them). Call it on
        every rank after the last backward pass, with the optimizer that steps the DDP model.

        ``optimizer=None``: only write the drained gradients into ``.grad`` (your own step
        applies them; the replicas are then equal only as far as your step keeps them). Without
        the argument it raises ``TypeError``: the in-flight gradients would otherwise sit in
        ``.grad`` unapplied and the replicas stay apart without a word. Returns how many local
        gradients the flush held, over all ranks (0: nothing was in flight; ``optimizer.step()``
        is then not called)."""
        if optimizer is _MISSING:
            raise TypeError("finish() needs the optimizer that steps the DDP model: "
                            "state.finish(opt) applies the gradients still in flight and "
                            "leaves every replica equal; state.finish(None) only writes them "
                            "into .grad for a step of your own")
        if self._joiners is not None and self._handles:
            if optimizer is None:
                raise TypeError("in a job that takes lost ranks back (asynccoll run "
                                "--max-failures), finish() needs the optimizer: its sync "
                                "events apply what they drain (asynccoll.torch.hook_events)")
            held = self._finish_events(optimizer)
        else:
            self._stop_watching()
            held, flushed = self._flush_all()
            self._write_grads(flushed)
            if optimizer is None:
                return held
            if held:
                optimizer.step()
        # one rank computes, the others receive: ranks that applied the same rounds grouped
        # differently hold the same model up to rounding, and rounding must not split them;
        # over the ranks training now (the survivors' after a lost rank: the lowest sends)
        params = [p for index in sorted(self._params) for p in self._params[index]]
        broadcast_parameters({str(i): p.data for i, p in enumerate(params)}, 0,
                             comm=self._comm_now())
        return held

    def _flush_all(self) -> tuple[int, dict[int, torch.Tensor]]:
        held = 0
        flushed: dict[int, torch.Tensor] = {}
        # All at once: a rank still in its last backward may wait on a bucket whose
        # execution only another rank's flush of that bucket can force.
        keys = sorted(self._handles)
        futs = [self.comm.submit(self._handles[k].flush()) for k in keys]
        for key, fut in zip(keys, futs, strict=True):
            res = fut.result()
            held += res.count
            value = res.value if self.average == "contributions" else \
                by_world(res, self._handles[key])
            if key[0] in flushed:
                flushed[key[0]] = flushed[key[0]] + value
            else:
                flushed[key[0]] = value
        return held, flushed

    def _write_grads(self, flushed: dict[int, torch.Tensor]) -> None:
        """Each bucket's drained gradient into its parameters' ``.grad`` (zeros where nothing
        was drained)."""
        for index, params in self._params.items():
            flat = flushed.get(index)
            if flat is None:
                for p in params:
                    p.grad = torch.zeros_like(p)
                continue
            for p, piece in pieces(flat, params):
                p.grad = piece.to(p.dtype).clone()


def _complete(fut: torch.futures.Future[torch.Tensor], f: concurrent.futures.Future[Any],
              value: Callable[[Any], torch.Tensor]) -> None:
    target: Any = fut  # torch types set_exception's argument as the result type
    exc = f.exception()
    if exc is not None:
        target.set_exception(exc)
        return
    try:
        fut.set_result(value(f.result()))
    except Exception as e:  # a bad result must fail DDP's wait, not the progress thread
        target.set_exception(e)


@moved_arguments(kind="give the policy: Solo(), Majority(), TwoChoice(), Quorum(k), Backup(b), "
                      "Deadline() or Sync() (asynccoll), or its text", **POLICY_MOVED)
def partial_hook(comm: Any, policy: Policy | str = Majority(), *, accumulate: bool = True,
                 average: str = "world", name: str | None = None,
                 ) -> tuple[PartialHookState, Callable[[PartialHookState, Any],
                                                       torch.futures.Future[torch.Tensor]]]:
    """``(state, hook)`` for ``ddp.register_comm_hook(state, hook)`` (module doc).

    ``comm``: a :class:`~asynccoll.Communicator` with a progress thread, or
    :func:`asynccoll.init`'s communicator. ``policy``: the straggler policy of every bucket
    (:class:`~asynccoll.Policy` or its text: ``Solo()``, ``Majority(seed=)``, ``TwoChoice()``,
    ``Quorum(k)``, ``Backup(b)``, ``Deadline(...)``: module doc; ``Sync()``: DDP's averaging
    allreduce); a seed left None is one per bucket, from its name.
    ``accumulate``, ``average`` (``"world"``, the default, or ``"contributions"``): module
    doc. ``name``: the prefix of the buckets' handle names, distinct per hook of one
    communicator and equal on every rank; default ``"ddp"`` for the communicator's first hook,
    ``"ddp-1"``, ``"ddp-2"``, ... for later ones (a second model, or DDP rebuilt), so every
    rank must make its hooks in the same order. Raises ``ValueError`` naming ``policy`` (a bad
    text, a quorum above P) or ``average``; ``TypeError`` naming the new spelling for a
    keyword that is gone (``kind=``, ``quorum=``, ``seed=``, ``deadline=``, ...). Costs per
    bucket and step: one partial allreduce of the bucket (the first step: one allreduce),
    started without blocking the backward pass.
    """
    policy = as_policy(policy)
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    c = blocking(comm)
    if policy.partial:
        policy.activation(c.size)  # ValueError naming the policy when it does not fit
    made = _hooks_made.get(c.comm, 0)
    _hooks_made[c.comm] = made + 1
    if name is None:
        name = "ddp" if made == 0 else f"ddp-{made}"
    state = PartialHookState(c, policy, bool(accumulate), name, average)

    def hook(st: PartialHookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        return st.reduce(bucket)

    # DDP compares the annotations with the classes themselves (not the strings that
    # ``from __future__ import annotations`` leaves).
    import torch.distributed as dist

    grad_bucket = dist.GradBucket  # type: ignore[attr-defined]
    hook.__annotations__ = {"st": PartialHookState, "bucket": grad_bucket,
                            "return": torch.futures.Future[torch.Tensor]}
    return state, hook
