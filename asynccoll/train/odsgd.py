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
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..comm.communicator import Communicator
from .bucket import ParamBucket
from .info import StepInfo
from .updaters import DCASGD, SGD, make_updater

__all__ = ["ODSGD"]


class ODSGD:
    """One-step-delay SGD (module doc).

    ``lr``, ``momentum``, ``weight_decay``: the global update rule. ``warmup``: synchronous
    steps first (>= 0). ``local``: the local updater's name; ``local_lr`` its rate (default
    ``lr``); ``lam``: DC-ASGD's lambda. Raises ``ValueError`` naming a bad argument. Costs per
    step: one allreduce (in flight across the next step) and two vectorised updates.
    """

    def __init__(self, comm: Communicator, params: Any, lr: float, *, warmup: int = 10,
                 local: str = "sgd", local_lr: float | None = None, lam: float = 0.04,
                 momentum: float = 0.0, weight_decay: float = 0.0,
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
        self.world_size = comm.size
        self.steps = 0
        self.weights = self.params.copy()  #: the global weights W
        self._gbufs = (np.empty_like(self.params), np.empty_like(self.params))
        self._wprev = np.empty_like(self.params)
        self._inflight: asyncio.Future[Any] | None = None

    async def step(self, grads: Any) -> StepInfo:
        """Hand in this step's gradient (computed at ``params``) and move ``params`` to the
        weights of the next step. Returns a :class:`~asynccoll.train.StepInfo` whose ``round``
        is the global update applied (``staleness`` 1 after warm-up)."""
        g = self.bucket.flatten(grads)
        P = self.world_size
        everyone = frozenset(range(P))
        s = self.steps
        self.steps += 1
        if s < self.warmup:
            total = await self.comm.allreduce(g, timeout=self.timeout)
            self.global_updater.apply(self.weights, total / P)
            np.copyto(self.params, self.weights)
            return StepInfo(s, True, everyone, P, 0, self.lr, fresh=everyone)
        # Two alternating buffers: the allreduce of step s copies its buffer when it first
        # runs, which is before step s + 2 writes that buffer again (step s + 1 awaits it).
        buf = self._gbufs[s % 2]
        np.copyto(buf, g)
        prev, self._inflight = self._inflight, asyncio.ensure_future(
            self.comm.allreduce(buf, timeout=self.timeout))
        if prev is not None:
            total = await prev
            self.global_updater.apply(self.weights, total / P)
        np.copyto(self._wprev, self.params)  # the weights g was computed at
        np.copyto(self.params, self.weights)
        self.local_updater.apply(self.params, g, w_prev=self._wprev)
        return StepInfo(s - 1, True, everyone, P, 1, self.local_updater.lr, fresh=everyone)

    async def finish(self) -> None:
        """Wait for the update in flight, apply it, and set ``params`` to the global weights
        (equal on every rank). Collective: every rank calls it after its last step."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            total = await prev
            self.global_updater.apply(self.weights, total / self.world_size)
        np.copyto(self.params, self.weights)

    def __repr__(self) -> str:
        return f"ODSGD(lr={self.lr}, warmup={self.warmup}, steps={self.steps})"
