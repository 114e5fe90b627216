"""OD-SGD: one-step-delay SGD (*OD-SGD: One-step Delay SGD*, §3, Algorithm 2, Eq. 4-6), with an
allreduce in place of the parameter server.

Every rank keeps the global weights ``W`` (identical on all ranks: each applies the same
allreduced gradient with the global updater) and trains on local weights ``w_bak``:

* **warm-up** (``warmup`` steps): synchronous SGD; the model trains on ``W``.
* **then** step ``s`` starts the allreduce of its gradient ``g_s`` (computed at ``w_bak``) and,
  without waiting for it, takes the result of the previous step's allreduce, applies it to
  ``W`` (``W_s = W_{s-1} - lr * mean(g_{s-1})``) and sets ``w_bak = local_update(W_s, g_s)``:
  the weights for the next step's gradient, ready while ``g_s`` is still on the wire. The
  communication of step ``s`` overlaps the computation of step ``s + 1``.

Local updaters (``local``): ``"sgd"``, ``"dc-asgd-c"`` (Eq. 4) and ``"dc-asgd-a"`` (Eq. 5-6),
which compensate ``g_s`` for having been computed at ``w_bak`` rather than ``W_s``. With a local
rate of 0, ``w_bak = W_s``: synchronous SGD whose gradients are one step late.
:meth:`ODSGD.finish` waits for the last allreduce and leaves ``params = W`` on every rank.

**Lost and restarted ranks** (``comm.survive``, :mod:`.rounds`): the allreduces are the
rounds of :class:`~.rounds.SyncRounds`. After a loss the survivors settle the round some of
them completed (its result, lost rank included, to the others) and redo the rest over the
survivors, divided by their number; ``W`` stays equal to the bit. A restarted rank is admitted
at the end of a step in which a round said it is ready on every member: that step waits for
its own allreduce (no overlap then), and the joiner receives ``W``, the global updater's
momentum and the counters (the digest covers those: the replicated state); its local weights
start at ``W`` and its local updater afresh (DC-ASGD-a's mean square is per rank). Its first
step's gradient is not contributed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm.communicator import Communicator
from .bucket import ParamBucket
from .info import StepInfo
from .rounds import SyncRounds
from .updaters import DCASGD, SGD, make_updater

__all__ = ["ODSGD"]


class ODSGD(SyncRounds):
    """One-step-delay SGD (module doc).

    ``lr``, ``momentum``, ``weight_decay``: the global update rule. ``warmup``: synchronous
    steps first (>= 0). ``local``: the local updater's name; ``local_lr`` its rate (default
    ``lr``); ``lam``: DC-ASGD's lambda. ``name``: the channel restarted ranks join on (equal
    on every rank, distinct per optimizer of a job that survives losses). ``timeout``: per
    collective. Raises ``ValueError`` naming a bad argument. Costs per step: one allreduce (in
    flight across the next step) and two vectorised updates; with ``comm.survive``, P more
    entries in the allreduce (the ready flags of restarted ranks).
    """

    def __init__(self, comm: Communicator, params: Any, lr: float, *, warmup: int = 10,
                 local: str = "sgd", local_lr: float | None = None, lam: float = 0.04,
                 momentum: float = 0.0, weight_decay: float = 0.0, name: str = "odsgd",
                 timeout: float | None = None) -> None:
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a Communicator, got {type(comm).__name__}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        self.comm = comm
        self.bucket = ParamBucket(params)
        self.params: Any = self.bucket.flat
        self.lr = float(lr)
        self.warmup = warmup
        self.global_updater = SGD(self.lr, momentum, weight_decay)
        llr = self.lr if local_lr is None else float(local_lr)
        self.local_updater: SGD | DCASGD = (make_updater(local, llr) if local == "sgd"
                                            else make_updater(local, llr, lam=lam))
        self.timeout = timeout
        self.steps = 0
        self.weights = self.params.copy()  #: the global weights W
        self._rounds_init(name)  # losses and restarted ranks (.rounds)
        n = self.params.size + self._join_slots()
        self._gbufs = tuple(np.empty_like(self.params, shape=(n,)) for _ in range(2))
        self._wprev = np.empty_like(self.params)

    # -- the rounds (.rounds) ------------------------------------------------------------------
    async def _start(self, comm: Communicator, payload: Any) -> Any:
        return await comm.allreduce(payload, timeout=self.timeout)

    def _apply_round(self, total: Any, size: int) -> None:
        self.global_updater.apply(self.weights, total / size)

    def _template(self) -> Any:
        return self._gbufs[0]

    def _replica(self) -> Any:
        return self.weights

    def _replica_updater(self) -> Any:
        return self.global_updater

    def _restore(self, meta: dict[str, Any]) -> None:
        super()._restore(meta)
        np.copyto(self.params, self.weights)

    # -- the step ------------------------------------------------------------------------------
    async def step(self, grads: Any) -> StepInfo:
        """Hand in this step's gradient (computed at ``params``) and move ``params`` to the
        weights of the next step. Returns a :class:`~asynccoll.train.StepInfo` whose ``round``
        is the global update applied (``staleness`` 1 after warm-up). Raises what the
        allreduce raises (``PeerLostError`` only where the communicator does not survive
        losses)."""
        if self._joining:  # a restarted rank's first step: receive the state (.rounds)
            return await self._join_step()
        g = self.bucket.flatten(grads)
        s = self.steps
        self.steps += 1
        # Two alternating buffers: the allreduce of step s copies its buffer when it first
        # runs, and a redo after a loss copies it again; the round of step s is applied (and
        # its buffer free) before step s + 2 writes that buffer again.
        buf = self._gbufs[s % 2]
        n = self.params.size
        buf[:n] = g.reshape(-1)
        self._join_flags(buf[n:])
        self._issue(buf)
        if s < self.warmup:
            await self._complete()
            np.copyto(self.params, self.weights)
            await self._admit_pending()
            return self._info(s, 0, self.lr)
        if len(self._rounds) > 1:
            await self._complete()  # the previous step's round: W moves on
        np.copyto(self._wprev, self.params)  # the weights g was computed at
        np.copyto(self.params, self.weights)
        self.local_updater.apply(self.params, g, w_prev=self._wprev)
        await self._admit_pending()
        return self._info(s - 1, 1, self.local_updater.lr)

    def _info(self, k: int, staleness: int, lr: float) -> StepInfo:
        every = frozenset(self._members)
        return StepInfo(k, True, every, len(every), staleness, lr, fresh=every)

    async def finish(self) -> None:
        """Wait for the update in flight, apply it, and set ``params`` to the global weights
        (equal on every rank). Collective: every rank calls it after its last step (at the
        same global step: loop on ``step_count``)."""
        while self._rounds:
            await self._complete()
        await self._admit_pending()
        np.copyto(self.params, self.weights)

    def __repr__(self) -> str:
        return f"ODSGD(lr={self.lr}, warmup={self.warmup}, steps={self.steps})"
