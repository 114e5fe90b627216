"""Fusing many parameter / gradient arrays into one contiguous bucket.

Collectives run on one flat buffer per step, never one call per parameter. A
:class:`ParamBucket` owns a flat array and hands out views of it shaped like each parameter, so
that updating the flat array updates every parameter in place. Accepted parameters: one flat
NumPy/CuPy array (used as is, no copy), a list of NumPy/CuPy arrays, or PyTorch tensors (CPU
tensors share memory with the bucket through ``torch.from_numpy``; the module never imports
torch unless given tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..buffers import is_cupy

__all__ = ["ParamBucket"]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


class ParamBucket:
    """One flat buffer holding every parameter; ``views`` are shaped like the originals.

    After construction the *bucket* is the storage: for lists of NumPy arrays and torch tensors
    the originals are re-pointed at views of the bucket where the framework allows it (torch:
    ``param.data = view``), so optimisers and models keep working on the same memory.
    Raises ``ValueError`` for an empty list or mixed dtypes, naming the offending entry.
    """

    def __init__(self, params: Any) -> None:
        self._torch = False
        if isinstance(params, np.ndarray) or is_cupy(params):
            if not params.flags.c_contiguous:
                raise ValueError("params must be C-contiguous")
            self.flat = params.reshape(-1)
            self.shapes: list[tuple[int, ...]] = [tuple(params.shape)]
            self.offsets = [0, self.flat.size]
            self.originals: list[Any] = [params]
            return
        items = list(params)
        if not items:
            raise ValueError("params is empty")
        self._torch = _is_torch(items[0])
        dtypes = {str(p.dtype) for p in items}
        if len(dtypes) != 1:
            raise ValueError(f"params must share one dtype, got {sorted(dtypes)}")
        self.shapes = [tuple(p.shape) for p in items]
        sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = [0, *np.cumsum(sizes).tolist()]
        if self._torch:
            import torch

            if any(p.device.type != "cpu" for p in items):
                raise ValueError("torch parameters must live on the CPU (use CuPy arrays for "
                                 "device memory)")
            flat_t = torch.empty(self.offsets[-1], dtype=items[0].dtype)
            for p, a, b, s in zip(items, self.offsets, self.offsets[1:], self.shapes,
                                  strict=False):
                flat_t[a:b].copy_(p.detach().reshape(-1))
                p.data = flat_t[a:b].view(s)
            self._flat_t = flat_t
            self.flat = flat_t.numpy()
        else:
            xp: Any = np
            if is_cupy(items[0]):
                import cupy

                xp = cupy
            self.flat = xp.empty(self.offsets[-1], dtype=items[0].dtype)
            for p, a, b in zip(items, self.offsets, self.offsets[1:], strict=False):
                self.flat[a:b] = p.reshape(-1)
        self.originals = items

    @property
    def size(self) -> int:
        return int(self.offsets[-1])

    def views(self) -> list[Any]:
        """Arrays shaped like each parameter, sharing the bucket's memory."""
        return [self.flat[a:b].reshape(s) for a, b, s in
                zip(self.offsets, self.offsets[1:], self.shapes, strict=False)]

    def flatten(self, grads: Any, out: Any = None) -> Any:
        """The gradients as one flat array (no copy when given one flat array of our size).

        ``grads`` matches the parameters: one array, or a sequence in the same order and shapes;
        torch tensors (or ``None`` entries, read as zeros, for parameters without a gradient).
        """
        if isinstance(grads, np.ndarray) or is_cupy(grads):
            if grads.size != self.size:
                raise ValueError(f"grads has {grads.size} elements, params have {self.size}")
            return grads.reshape(-1)
        seq: Sequence[Any] = list(grads)
        if len(seq) != len(self.shapes):
            raise ValueError(f"got {len(seq)} gradients for {len(self.shapes)} parameters")
        if out is None:
            out = np.empty(self.size, self.flat.dtype) if not is_cupy(self.flat) else \
                self.flat.copy()
        for i, (g, a, b, s) in enumerate(zip(seq, self.offsets, self.offsets[1:], self.shapes,
                                             strict=False)):
            if g is None:
                out[a:b] = 0
                continue
            if tuple(g.shape) != s:
                raise ValueError(f"gradient {i} has shape {tuple(g.shape)}, parameter has {s}")
            out[a:b] = g.detach().reshape(-1).numpy() if _is_torch(g) else g.reshape(-1)
        return out
