"""PyTorch tensors at the Communicator's boundary: in as arrays, out as tensors of the same kind.

Every collective of a :class:`~asynccoll.Communicator` (and every call of a partial handle)
accepts a ``torch.Tensor`` wherever it accepts an array, and returns a tensor where it would
return an array. torch is never imported here: a value is a tensor only if ``torch`` is already
in ``sys.modules`` (a program that passes tensors has imported it), so code that never passes one
never loads torch.

* **CPU tensors** are shared, not copied: ``tensor.numpy()`` in, ``torch.from_numpy(result)``
  out (the result owns new memory, as an array result does; ``out=tensor`` reduces in place).
* **CUDA tensors** go through DLPack as CuPy arrays (``cupy.from_dlpack`` in,
  ``torch.from_dlpack`` out; no copy): device memory over UCX, staged through host memory over
  TCP, as CuPy arrays are.
* **bfloat16** has no NumPy (or CuPy) dtype: such a tensor is converted to float32 (a copy),
  reduced in float32 and rounded back to bfloat16, which is exact for broadcast and allgather
  and at least as accurate as a bfloat16 reduction for the reducing collectives.
* **Non-contiguous tensors are refused** with a ``ValueError`` naming the argument (copying
  them silently would hide a cost, and ``out=`` could not write into them): pass
  ``t.contiguous()``.
* A tensor that requires grad is read through ``tensor.detach()`` (same memory).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..buffers import is_cupy
from ..collectives.policy import Policy
from ..collectives.sparse.streams import SparseVector
from ..results import PartialResult
from .contribution import Combine
from .partial import PartialAllreduce
from .plan import HandlePlan, HandleRuntime

__all__ = ["TensorKind", "TensorPartialAllreduce", "as_host", "from_tensor", "is_tensor",
           "to_device", "wrap_result"]


def is_tensor(x: Any) -> bool:
    """True when ``x`` is a ``torch.Tensor`` (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


@dataclass(frozen=True)
class TensorKind:
    """What a tensor argument was, to turn an array result back into a tensor like it.

    ``converted``: the array is a converted copy (bfloat16), not the tensor's own memory.
    """

    torch: Any
    dtype: Any
    cuda: bool
    converted: bool

    def wrap(self, a: Any) -> Any:
        """The array ``a`` as a tensor of the original dtype and device (no copy unless the
        dtype was converted)."""
        t = self.torch.from_dlpack(a) if self.cuda else self.torch.from_numpy(a)
        return t if t.dtype == self.dtype else t.to(self.dtype)

    def write_back(self, tensor: Any, a: Any) -> None:
        """Copy ``a`` into ``tensor`` when ``a`` is a converted copy of it (else a no-op)."""
        if self.converted:
            with self.torch.no_grad():
                tensor.copy_(self.wrap(a))


def from_tensor(x: Any, name: str) -> tuple[Any, TensorKind | None]:
    """``(array, kind)`` for a tensor ``x`` (``kind`` is None and ``x`` comes back as it is
    when it is not a tensor). Raises ``ValueError`` naming ``name`` for a non-contiguous
    tensor; costs nothing but for bfloat16 (one conversion to float32)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return x, None
    if not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous tensor (got shape {tuple(x.shape)} "
                         f"with strides {tuple(x.stride())}); asynccoll does not copy "
                         f"silently: pass {name}.contiguous()")
    t = x.detach()
    converted = t.dtype == torch.bfloat16
    if converted:
        t = t.to(torch.float32)
    cuda = t.device.type == "cuda"
    if cuda:
        import cupy

        a = cupy.from_dlpack(t)
    elif t.device.type == "cpu":
        a = t.numpy()
    else:
        raise ValueError(f"{name} is a tensor on {t.device}; asynccoll takes CPU and CUDA "
                         "tensors")
    return a, TensorKind(torch, x.dtype, cuda, converted)


def wrap_result(res: PartialResult, kind: TensorKind | None, *,
                divide: bool = False) -> PartialResult:
    """``res`` with its value divided by its ``count`` (``divide``; an empty round stays
    zeros) and turned into a tensor like the call's (``kind``); ``res`` itself when neither
    applies. A sparse value stays a SparseVector."""
    v = res.value
    if divide and res.count:
        v = v / res.count
    if kind is not None and not isinstance(v, SparseVector):
        v = kind.wrap(v)
    return res if v is res.value else dataclasses.replace(res, value=v)


class TensorPartialAllreduce(PartialAllreduce):
    """A :class:`~asynccoll.PartialAllreduce` whose calls take and return tensors too, and
    which can average (``op="avg"``).

    Made by :meth:`Communicator.partial_allreduce <asynccoll.Communicator.partial_allreduce>`.
    A call returns its value as the type of its ``x`` (a tensor for a tensor); :meth:`flush`
    as the type of the handle's ``like``. The plan's ``average``: the handle was made with
    ``op="avg"`` and without accumulation, so each value is divided by its ``count`` here (with
    ``accumulate`` the handle's ``"mean"`` mode does it per execution).
    """

    def __init__(self, runtime: HandleRuntime, policy: Policy, plan: HandlePlan) -> None:
        super().__init__(runtime, policy, plan)
        self.average = plan.average
        self.like_kind: TensorKind | None = plan.like_kind

    async def __call__(self, x: Any, timeout: float | None = None, *,
                       combine: Combine | None = None, out: Any = None) -> PartialResult:
        a, kind = from_tensor(x, "x")
        if out is None:
            return wrap_result(await super().__call__(a, timeout, combine=combine), kind,
                               divide=self.average)
        o, _ = from_tensor(out, "out")  # a tensor's memory: the result lands in it
        return self._into(await super().__call__(a, timeout, combine=combine, out=o), out, o)

    def blocking(self, x: Any, timeout: float | None = None, *,
                 out: Any = None) -> PartialResult:
        a, kind = from_tensor(x, "x")
        if out is None:
            return wrap_result(super().blocking(a, timeout), kind, divide=self.average)
        o, _ = from_tensor(out, "out")
        return self._into(super().blocking(a, timeout, out=o), out, o)

    def _into(self, res: PartialResult, out: Any, o: Any) -> PartialResult:
        """``res``, its value in ``o`` (the array view of the caller's ``out``), as a result
        whose value is ``out`` itself, divided by its count in place when averaging."""
        if self.average and res.count:
            o /= res.count
        return dataclasses.replace(res, value=out)

    async def flush(self, timeout: float | None = None, x: Any = None, *,
                    combine: Combine | None = None, out: Any = None) -> PartialResult:
        a = None if x is None else from_tensor(x, "x")[0]
        if out is None:
            return wrap_result(await super().flush(timeout, a, combine=combine),
                               self.like_kind, divide=self.average)
        o, _ = from_tensor(out, "out")
        return self._into(await super().flush(timeout, a, combine=combine, out=o), out, o)

    def flush_blocking(self, timeout: float | None = None) -> PartialResult:
        return wrap_result(super().flush_blocking(timeout), self.like_kind,
                           divide=self.average)


def as_host(x: Any) -> tuple[SparseVector | np.ndarray, bool]:
    """``x`` in host memory and whether it was on the device (CuPy). Raises ``TypeError``
    naming ``x`` unless it is a SparseVector or an array."""
    if isinstance(x, SparseVector):
        if is_cupy(x.values):
            dev: Any = x
            return SparseVector(dev.indices.get(), dev.values.get(), x.size, check=False), True
        return x, False
    if isinstance(x, np.ndarray):
        return x, False
    if is_cupy(x):
        host: np.ndarray = x.get()
        return host, True
    raise TypeError(f"x must be a SparseVector or an array, got {type(x).__name__}")


def to_device(res: SparseVector | np.ndarray) -> Any:
    """A result moved to the current CuPy device (the form of a CuPy input)."""
    import cupy

    if isinstance(res, SparseVector):
        return SparseVector(cupy.asarray(res.indices), cupy.asarray(res.values), res.size,
                            check=False)
    return cupy.asarray(res)
