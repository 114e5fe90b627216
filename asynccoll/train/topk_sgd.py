"""Top-k SGD with error feedback over the sparse allreduce (*SparCML: High-Performance Sparse
Communication for Machine Learning*, Algorithms 1/2).

Each step a rank adds its gradient to its residual, sends the ``k`` largest entries (per bucket
of ``bucket`` entries when given: bucketed top-k), optionally QSGD-quantised (Algorithm 2), and
keeps the rest as the residual for later steps
(:class:`~asynccoll.collectives.sparse.feedback.ErrorFeedback`).
The sparse allreduce (SparCML §5, sparse streams switching to dense past the switch point) sums
what every rank sends; every rank applies ``lr * sum / P``. With ``k = N`` it is dense
synchronous SGD.

**Lost and restarted ranks** (``comm.survive``, :mod:`.rounds`): each step's sparse allreduce
is a round of :class:`~.rounds.SyncRounds`. A sparse allreduce handle is synchronous and a
failed call closes it, and a handle cannot be rebuilt over another communicator, so after a
loss (over the survivors) or an admission (over the grown world) a new handle of the same name
is made on the new communicator, at its first round there. After a loss the survivors settle
the round some of them completed and redo the rest over themselves with the same sent entries
(what the lost rank sent to such a round is lost with it; every survivor's residual stays as
its compression left it). The ready flags of restarted ranks ride in the sparse allreduce as P
extra entries of the vector, sent only by a rank that has a ready rank to flag (nothing while
nobody joins). A joiner receives the parameters, the momentum and the counters (the
replicated state: the digest covers those); its residual starts at zero, since what the lost
process had not sent was lost with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..collectives.sparse.feedback import ErrorFeedback
from ..collectives.sparse.streams import SparseVector, index_dtype
from ..comm.communicator import Communicator
from ..comm.sparse import SparseAllreduceHandle
from .bucket import ParamBucket
from .info import StepInfo
from .rounds import SyncRounds
from .updaters import SGD

__all__ = ["TopKSGD"]


class TopKSGD(SyncRounds):
    """Top-k SGD with error feedback (module doc).

    ``k`` or ``density``: entries sent per step (per bucket with ``bucket``). ``quantize``: 2, 4
    or 8 bits of QSGD on the sent values (buckets of ``qbucket``). ``name``: distinct per
    optimizer, equal on every rank (the name of its :meth:`Communicator.sparse_allreduce_handle
    <asynccoll.Communicator.sparse_allreduce_handle>`, and the channel restarted ranks join
    on). ``timeout``: per step (default: the communicator's). NumPy parameters only (the sparse
    path is host-side). Raises ``ValueError`` naming a bad argument. Costs per step: a top-k
    selection over N entries and one sparse allreduce.
    """

    def __init__(self, comm: Communicator, params: Any, lr: float, *, k: int | None = None,
                 density: float | None = None, bucket: int | None = None,
                 quantize: int | None = None, qbucket: int = 512, momentum: float = 0.0,
                 weight_decay: float = 0.0, seed: int = 0, name: str = "topk-sgd",
                 timeout: float | None = None) -> None:
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a Communicator, got {type(comm).__name__}")
        self.comm = comm
        self.bucket = ParamBucket(params)
        self.params: Any = self.bucket.flat
        n = int(self.params.size)
        self.lr = float(lr)
        self.updater = SGD(self.lr, momentum, weight_decay)
        self.feedback = ErrorFeedback(n, self.params.dtype, k=k, density=density,
                                      bucket=bucket, quantize=quantize, qbucket=qbucket,
                                      seed=seed * 65537 + comm.rank)
        span = n if bucket is None else bucket
        self._density = min(1.0, self.feedback.k / span) if span else 1.0
        self.name = name
        self.timeout = timeout
        self.steps = 0
        self._rounds_init(name)  # losses and restarted ranks (.rounds)
        self._size = n + self._join_slots()
        self._allreduce: SparseAllreduceHandle | None = None
        self._on: Communicator | None = None  # the communicator _allreduce runs on
        if not self._joining:  # (a joiner's rounds run on the world it joins)
            self._handle_on(comm)

    # -- the rounds (.rounds) ------------------------------------------------------------------
    def _handle_on(self, comm: Communicator) -> SparseAllreduceHandle:
        if self._on is not comm or self._allreduce is None:
            self._allreduce = comm.sparse_allreduce_handle(
                self._size, self.params.dtype, name=self.name, density=self._density,
                timeout=self.timeout)
            self._on = comm
        return self._allreduce

    async def _start(self, comm: Communicator, payload: Any) -> Any:
        if self._on is not comm and self._allreduce is not None:
            await self._allreduce.close()  # (local) the old world's; closed already if failed
        total = await self._handle_on(comm)(payload)
        if isinstance(total, SparseVector):
            return total.to_dense()
        # a dense result is a view of the handle's buffer, which its next call reuses: a copy
        # where it is kept for the survivors of a loss (.rounds)
        return total.copy() if comm.survive else total

    def _apply_round(self, total: Any, size: int) -> None:
        self.updater.apply(self.params, total / size)

    def _template(self) -> Any:
        return np.empty(self._size, self.params.dtype)

    def _sent(self, sent: SparseVector) -> SparseVector:
        """``sent`` as an entry of the round: with the ready flags of restarted ranks, when
        this rank knows of any (module doc)."""
        n = self.params.size
        if self._size == n:
            return sent
        flags = np.zeros(self._size - n)
        self._join_flags(flags)
        ready = np.flatnonzero(flags)
        if not ready.size:
            return SparseVector(sent.indices, sent.values, self._size, check=False)
        dt = index_dtype(self._size)
        return SparseVector(np.concatenate([sent.indices.astype(dt, copy=False),
                                            (ready + n).astype(dt)]),
                            np.concatenate([sent.values, np.ones(ready.size, sent.dtype)]),
                            self._size, check=False)

    # -- the step ------------------------------------------------------------------------------
    async def step(self, grads: Any) -> StepInfo:
        """Send this step's top-k (plus residual), apply the summed update. Raises what the
        sparse allreduce raises (``PeerLostError`` only where the communicator does not
        survive losses)."""
        if self._joining:  # a restarted rank's first step: receive the state (.rounds)
            return await self._join_step()
        g = self.bucket.flatten(grads)
        self._issue(self._sent(self.feedback.compress(g)))
        await self._complete()
        s = self.steps
        self.steps += 1
        await self._admit_pending()
        every = frozenset(self._members)
        return StepInfo(s, True, every, len(every), 0, self.lr, fresh=every)

    def _restore(self, meta: dict[str, Any]) -> None:
        super()._restore(meta)
        self.feedback.step_count = self._done  # QSGD's seeds go on from the job's round

    async def finish(self) -> None:
        """Release the sparse allreduce's executor (the residual is not sent). Call it on
        every rank after its last step (at the same global step: loop on ``step_count``)."""
        await self._admit_pending()
        if self._allreduce is not None:
            await self._allreduce.close()
