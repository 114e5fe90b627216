"""Top-k SGD with error feedback (SparCML Algorithms 1/2), over the sparse allreduce.

Each rank keeps a residual: ``acc = residual + gradient``; it sends ``Q(TopK(acc))`` and keeps
``residual = acc - sent``. Without quantisation the sent entries are copied from ``acc`` and
their residual set to exactly zero, so ``sent + residual == acc`` holds bit for bit and, over
any number of steps, ``sum(sent) + residual == sum(gradients)`` exactly whenever the additions
``residual + gradient`` are exact (integer-valued data, say). With QSGD (``quantize=bits``) the
sent values are quantised and the residual keeps ``acc - Q(...)``, exact up to the rounding of
that one subtraction.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from . import quantize as qsgd
from .streams import SparseVector, bucket_topk, to_dense, topk

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """The per-rank state of top-k SGD with error feedback for a flat vector of ``size``.

    ``k``: entries sent per step (or per bucket when ``bucket`` is given: bucketed top-k, as in
    SparCML's experiments); ``density`` instead gives k as a fraction. ``quantize``: 2, 4 or 8
    to QSGD-quantise the sent values (in buckets of ``qbucket``), seeded by ``seed`` and the
    step number, so runs repeat. Raises ``ValueError`` naming a bad argument.
    """

    def __init__(self, size: int, dtype: Any = np.float32, *, k: int | None = None,
                 density: float | None = None, bucket: int | None = None,
                 quantize: int | None = None, qbucket: int = 512, seed: int = 0) -> None:
        if not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be a non-negative int, got {size!r}")
        if (k is None) == (density is None):
            raise ValueError("give exactly one of k and density")
        span = size if bucket is None else bucket
        if density is not None:
            if not 0.0 <= density <= 1.0:
                raise ValueError(f"density must be in 0..1, got {density!r}")
            k = max(1, round(density * span)) if span else 0
        assert k is not None
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if quantize is not None:
            qsgd.levels(quantize)
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise TypeError(f"dtype must be a float dtype, got {self.dtype}")
        self.size = size
        self.k = min(k, size) if bucket is None else k
        self.bucket = bucket
        self.quantize = quantize
        self.qbucket = qbucket
        self.seed = seed
        self.step_count = 0
        #: what this rank has not sent yet
        self.residual = np.zeros(size, self.dtype)

    def compress(self, gradient: np.ndarray) -> SparseVector:
        """Add ``gradient`` to the residual and take out what is sent this step.

        Costs O(size) for the selection plus O(k) for the rest; ``gradient`` is not modified.
        """
        g = np.asarray(gradient)
        if g.shape != (self.size,) and g.size != self.size:
            raise ValueError(f"gradient has {g.size} entries, expected {self.size}")
        acc = self.residual
        acc += g.reshape(-1)
        sel = topk(acc, self.k) if self.bucket is None else bucket_topk(acc, self.k, self.bucket)
        vals = acc[sel.indices]  # a copy: fancy indexing
        if self.quantize is not None and vals.size:
            q = qsgd.quantize(vals, self.quantize, self.qbucket,
                              seed=(self.seed, self.step_count))
            vals = qsgd.dequantize(q)
            acc[sel.indices] -= vals
        else:
            acc[sel.indices] = 0
        self.step_count += 1
        return SparseVector(sel.indices, vals, self.size, check=False)

    async def step(self, gradient: np.ndarray,
                   allreduce: Callable[[SparseVector], Awaitable[SparseVector | np.ndarray]]
                   ) -> np.ndarray:
        """Compress ``gradient``, sum what every rank sends with ``allreduce`` (for example
        ``functools.partial(sparse_allreduce, transport, sched_id=...)`` or
        ``comm.sparse_allreduce``), and return the sum as a dense array (the update direction
        before the learning rate and averaging)."""
        sent = self.compress(gradient)
        return to_dense(await allreduce(sent))
