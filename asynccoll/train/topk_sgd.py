"""Top-k SGD with error feedback over the sparse allreduce (*SparCML: High-Performance Sparse
Communication for Machine Learning*, Algorithms 1/2).

Each step a rank adds its gradient to its residual, sends the ``k`` largest entries (per bucket
of ``bucket`` entries when given: bucketed top-k), optionally QSGD-quantised (Algorithm 2), and
keeps the rest as the residual for later steps
(:class:`~asynccoll.collectives.sparse.feedback.ErrorFeedback`).
The sparse allreduce (SparCML §5, sparse streams switching to dense past the switch point) sums
what every rank sends; every rank applies ``lr * sum / P``. With ``k = N`` it is dense
synchronous SGD.
"""

from __future__ import annotations

from typing import Any

from ..collectives.sparse.feedback import ErrorFeedback
from ..collectives.sparse.streams import to_dense
from ..comm.communicator import Communicator
from .bucket import ParamBucket
from .info import StepInfo
from .updaters import SGD

__all__ = ["TopKSGD"]


class TopKSGD:
    """Top-k SGD with error feedback (module doc).

    ``k`` or ``density``: entries sent per step (per bucket with ``bucket``). ``quantize``: 2, 4
    or 8 bits of QSGD on the sent values (buckets of ``qbucket``). ``name``: distinct per
    optimizer, equal on every rank (the name of its :meth:`Communicator.sparse_allreduce_handle
    <asynccoll.Communicator.sparse_allreduce_handle>`). ``timeout``: per step (default: the
    communicator's). NumPy parameters only (the sparse path is host-side). Raises
    ``ValueError`` naming a bad argument. Costs per step: a top-k selection over N entries and
    one sparse allreduce.
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
        expect = min(1.0, self.feedback.k / span) if span else 1.0
        self._allreduce = comm.sparse_allreduce_handle(n, self.params.dtype, name=name,
                                                       density=expect, timeout=timeout)
        self.timeout = timeout
        self.world_size = comm.size
        self.steps = 0

    async def step(self, grads: Any) -> StepInfo:
        """Send this step's top-k (plus residual), apply the summed update. Raises what the
        sparse allreduce raises."""
        g = self.bucket.flatten(grads)
        sent = self.feedback.compress(g)
        total = await self._allreduce(sent)
        P = self.world_size
        self.updater.apply(self.params, to_dense(total) / P)
        s = self.steps
        self.steps += 1
        everyone = frozenset(range(P))
        return StepInfo(s, True, everyone, P, 0, self.lr, fresh=everyone)

    async def finish(self) -> None:
        """Release the sparse allreduce's executor (the residual is not sent)."""
        await self._allreduce.close()
