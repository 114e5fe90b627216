"""Compute kernels, looked up by name in a registry so that a schedule stays data.

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

**Registries are values.** A :class:`KernelRegistry` maps names to kernels; nothing registers a
kernel by being imported. :data:`BUILTIN_KERNELS` holds the built-ins; the schedule builders that
name other kernels export registries of their own, and :data:`asynccoll.collectives.KERNELS`
gathers every kernel asynccoll's collectives name. Those shared registries are *frozen*
(:meth:`~KernelRegistry.register` raises ``TypeError``), so no module can change what another
one runs. :meth:`Schedule.commit <asynccoll.sched.Schedule.commit>` checks kernel names against a
registry and :class:`~asynccoll.sched.Executor` looks kernels up in one; both default to
:data:`BUILTIN_KERNELS`. A Communicator owns a mutable copy of the collectives' registry
(``comm.kernels``) and passes it to every executor it builds.

**Your own kernels**: register them into a registry you own, e.g. ``comm.kernels`` or a copy,
``reg = BUILTIN_KERNELS.extended({"scale": fn})`` (then ``s.commit(kernels=reg)`` and
``Executor(..., kernels=reg)``). ``register_kernel(registry, name, fn, replace=False)`` (exported
as ``asynccoll.register_kernel``) is the function form of ``registry.register(name, fn)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..buffers import REDUCE_OPS, is_cupy

__all__ = ["BUILTIN_KERNELS", "Kernel", "KernelRegistry", "Payload", "register_kernel"]


class Payload(NamedTuple):
    """A run-time payload for a send: bytes-like ``data`` with its header fields."""

    data: Any
    dtype: str = ""
    shape: tuple[int, ...] = ()
    fmt: int = 3  # Format.RAW


Kernel = Callable[[Any, Sequence[Any], Mapping[str, Any], Sequence[Any]], "Payload | None"]


class KernelRegistry(Mapping[str, Kernel]):
    """Kernels by name: a read-only mapping plus :meth:`register` (unless frozen).

    ``KernelRegistry(kernels)`` starts with a copy of ``kernels``. Lookups cost one dict
    access; the executor resolves each compute op's kernel once, when it is built, so a
    registration after that does not change a running executor.
    """

    __slots__ = ("_frozen", "_kernels")

    def __init__(self, kernels: Mapping[str, Kernel] | None = None) -> None:
        self._kernels: dict[str, Kernel] = {}
        self._frozen = False
        for name, fn in (kernels or {}).items():
            self.register(name, fn)

    def __getitem__(self, name: str) -> Kernel:
        return self._kernels[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._kernels)

    def __len__(self) -> int:
        return len(self._kernels)

    def __repr__(self) -> str:
        state = "frozen " if self._frozen else ""
        return f"<{state}KernelRegistry {sorted(self._kernels)}>"

    @property
    def frozen(self) -> bool:
        """Whether :meth:`register` is refused (registries shared by modules are frozen)."""
        return self._frozen

    def register(self, name: str, fn: Kernel, *, replace: bool = False) -> Kernel:
        """Add ``fn`` under ``name`` and return ``fn``.

        Raises ``ValueError`` if ``name`` is taken (unless ``replace``), ``TypeError`` if the
        registry is frozen, ``name`` is not a non-empty str or ``fn`` is not callable.
        """
        if self._frozen:
            raise TypeError(f"this kernel registry is frozen (shared); register {name!r} into "
                            "a copy of your own: registry.extended()")
        if not isinstance(name, str) or not name:
            raise TypeError(f"kernel name must be a non-empty str, got {name!r}")
        if not callable(fn):
            raise TypeError(f"kernel {name!r} must be callable, got {type(fn).__name__}")
        if name in self._kernels and not replace:
            raise ValueError(f"kernel {name!r} is already registered")
        self._kernels[name] = fn
        return fn

    def extended(self, *others: Mapping[str, Kernel], replace: bool = False) -> KernelRegistry:
        """A new, mutable registry: this one's kernels plus those of ``others``, in order.

        A name two of them hold must map to the same kernel (``ValueError`` naming it
        otherwise) unless ``replace``, when the later one wins. Costs a dict copy.
        """
        out = KernelRegistry(self)
        for other in others:
            for name, fn in other.items():
                if out._kernels.get(name, fn) is not fn and not replace:
                    raise ValueError(f"kernel {name!r} is already registered (as another "
                                     "function); pass replace=True to override it")
                out._kernels[name] = fn
        return out

    def freeze(self) -> KernelRegistry:
        """Refuse further :meth:`register` calls from now on; returns self."""
        self._frozen = True
        return self


def register_kernel(registry: KernelRegistry, name: str, fn: Kernel, *,
                    replace: bool = False) -> Kernel:
    """``registry.register(name, fn, replace=replace)``: add ``fn`` to a registry you own.

    Returns ``fn``; raises as :meth:`KernelRegistry.register` does (``TypeError`` for a frozen
    registry such as :data:`BUILTIN_KERNELS`: register into ``comm.kernels`` or a copy).
    """
    if not isinstance(registry, KernelRegistry):
        raise TypeError(f"registry must be a KernelRegistry, got {type(registry).__name__} "
                        "(the signature is register_kernel(registry, name, fn))")
    return registry.register(name, fn, replace=replace)


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


_REDUCERS: dict[str, Kernel] = {name: _reduce_with(name) for name in REDUCE_OPS}


def _reduce(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
            msgs: Sequence[Any]) -> None:
    _REDUCERS[params.get("op", "sum")](out, inputs, params, msgs)


def _copy(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
          msgs: Sequence[Any]) -> None:
    out[...] = inputs[0]


def _zero(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
          msgs: Sequence[Any]) -> None:
    out.fill(0)


#: the built-in kernels (frozen): the reductions, ``reduce``, ``copy`` and ``zero``
BUILTIN_KERNELS = KernelRegistry(
    {**_REDUCERS, "reduce": _reduce, "copy": _copy, "zero": _zero}).freeze()
