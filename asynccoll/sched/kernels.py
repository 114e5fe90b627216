"""Compute kernels, registered by name so that a schedule stays data.

A kernel is called as ``fn(out, inputs, params, msgs)``:

* ``out``: the array view of the op's ``output`` (or ``None``),
* ``inputs``: the array views of its ``inputs``,
* ``params``: the op's params (JSON-safe),
* ``msgs``: the :class:`~asynccoll.transport.base.Message` of each receive in the op's ``recvs``.

It may return a :class:`Payload`, which a send with ``payload_from`` set to this op transmits
(payloads whose size is known only at run time: sparse streams, quantised buckets).
Built-ins: ``sum``/``prod``/``min``/``max`` (``out = in0 op in1 op ...``; ``out`` may alias an
input; with a single input they accumulate, ``out = out op in0``), ``reduce`` (``params["op"]``
names one of those), ``copy`` and ``zero``. Boolean buffers reduce logically (sum/max: or,
prod/min: and). Each runs as one NumPy/CuPy call per input, in place, without temporaries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..buffers import REDUCE_OPS, is_cupy

__all__ = ["KERNELS", "Kernel", "Payload", "register_kernel"]


class Payload(NamedTuple):
    """A run-time payload for a send: bytes-like ``data`` with its header fields."""

    data: Any
    dtype: str = ""
    shape: tuple[int, ...] = ()
    fmt: int = 3  # Format.RAW


Kernel = Callable[[Any, Sequence[Any], Mapping[str, Any], Sequence[Any]], "Payload | None"]

KERNELS: dict[str, Kernel] = {}


def register_kernel(name: str, fn: Kernel, *, replace: bool = False) -> Kernel:
    """Register ``fn`` under ``name``; ``ValueError`` if taken unless ``replace``."""
    if name in KERNELS and not replace:
        raise ValueError(f"kernel {name!r} is already registered")
    KERNELS[name] = fn
    return fn


def _ufunc(out: Any, name: str) -> Any:
    fn = REDUCE_OPS[name]
    if is_cupy(out):
        import cupy

        return getattr(cupy, fn.__name__)
    if out.dtype == np.bool_ and name in ("sum", "max"):
        return np.logical_or
    if out.dtype == np.bool_ and name in ("prod", "min"):
        return np.logical_and
    return fn


def _reduce_with(name: str) -> Kernel:
    # Resolved once: on a small buffer the choice of ufunc would cost more than the reduction.
    host_fn = REDUCE_OPS[name]
    bool_fn = np.logical_or if name in ("sum", "max") else np.logical_and

    def kernel(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
               msgs: Sequence[Any]) -> None:
        if type(out) is np.ndarray:
            fn = bool_fn if out.dtype.kind == "b" else host_fn
        else:
            fn = _ufunc(out, name)
        if len(inputs) == 1:
            fn(out, inputs[0], out=out)
            return
        fn(inputs[0], inputs[1], out=out)
        for x in inputs[2:]:
            fn(out, x, out=out)

    kernel.__name__ = f"reduce_{name}"
    return kernel


for _name in REDUCE_OPS:
    register_kernel(_name, _reduce_with(_name))


def _reduce(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
            msgs: Sequence[Any]) -> None:
    KERNELS[params.get("op", "sum")](out, inputs, params, msgs)


def _copy(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
          msgs: Sequence[Any]) -> None:
    out[...] = inputs[0]


def _zero(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
          msgs: Sequence[Any]) -> None:
    out.fill(0)


register_kernel("reduce", _reduce)
register_kernel("copy", _copy)
register_kernel("zero", _zero)
