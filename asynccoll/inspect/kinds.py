"""The collectives ``asynccoll inspect schedule`` can render, by kind name.

A *kind* maps to a function ``(rank, P, size_bytes, algorithm) -> Schedule``. Builders live in
``asynccoll.collectives`` and are imported lazily, when a kind is first asked for; a kind whose
module or builder is not (yet) importable is simply not listed. Two hand-built example kinds are
always present so the tool works on a bare schedule engine: ``example-doubling`` (an
allreduce-shaped recursive-doubling DAG, AND dependencies) and ``example-quorum`` (an OR and a
k-of-n dependency).

Builders differ in their signatures; :func:`call_builder` passes each the arguments it accepts
(``rank``, ``P``/``world_size``, ``count`` derived from ``size_bytes`` as float32 elements,
``dtype``, ``op``, ``algorithm``, ``root``) plus the kind's fixed arguments (a callable is
called with ``(P, count)``), so a new builder needs one entry in ``_CANDIDATES``.
"""

from __future__ import annotations

import importlib
import inspect as _inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..sched import Schedule, SlotSpec

__all__ = ["KindSpec", "algorithms", "available_kinds", "build", "build_all", "call_builder",
           "check_args", "get_kind"]

#: the dtype a kind's buffers get when only a size in bytes is given
DEFAULT_DTYPE = "float32"
DEFAULT_SIZE = 4096

Builder = Callable[[int, int, int, "str | None"], Schedule]


@dataclass(frozen=True)
class KindSpec:
    """Where a kind's builder lives and what fixed arguments it gets."""

    name: str
    module: str
    attr: str
    fixed: dict[str, Any] = field(default_factory=dict)
    help: str = ""
    algorithms: tuple[str, ...] = ()
    algorithms_attr: str = ""


# Kinds whose builders other modules provide; listed only once importable. Order = listing order.
_CANDIDATES: tuple[KindSpec, ...] = (
    KindSpec("allreduce", "asynccoll.collectives.dense", "allreduce",
             help="dense allreduce",
             algorithms=("recursive_doubling", "ring", "rabenseifner"),
             algorithms_attr="ALLREDUCE_ALGORITHMS"),
    KindSpec("broadcast", "asynccoll.collectives.dense", "broadcast",
             help="binomial broadcast from rank 0"),
    KindSpec("allgather", "asynccoll.collectives.dense", "allgather", help="allgather"),
    KindSpec("reduce_scatter", "asynccoll.collectives.dense", "reduce_scatter",
             help="reduce-scatter"),
    KindSpec("barrier", "asynccoll.collectives.dense", "barrier", help="barrier"),
    KindSpec("activation", "asynccoll.collectives.activation", "activation_broadcast",
             help="activation broadcast: any rank may start it"),
    KindSpec("solo", "asynccoll.collectives.partial", "build_partial_allreduce",
             {"kind": "solo"}, help="solo allreduce: every rank may initiate"),
    KindSpec("majority", "asynccoll.collectives.partial", "build_partial_allreduce",
             {"kind": "majority"}, help="majority allreduce: one drawn initiator"),
    KindSpec("two_choice", "asynccoll.collectives.partial", "build_partial_allreduce",
             {"kind": "two_choice"}, help="two-choice allreduce: two drawn initiators"),
    KindSpec("quorum", "asynccoll.collectives.partial", "build_partial_allreduce",
             {"kind": "quorum", "quorum": lambda world, count: world // 2 + 1},
             help="quorum allreduce: a majority (P//2+1) of arrivals starts it"),
    KindSpec("deadline", "asynccoll.collectives.partial", "build_partial_allreduce",
             {"kind": "deadline", "quorum": lambda world, count: world // 2 + 1},
             help="deadline allreduce: a majority (P//2+1) of arrivals or the runtime's "
                  "deadline starts it"),
    KindSpec("sparse_allreduce", "asynccoll.collectives.sparse.schedules", "build_sparse_allreduce",
             {"size": lambda world, count: count},
             help="sparse allreduce (SparCML)",
             algorithms=("ssar_recursive_double", "ssar_split_allgather",
                         "dsar_split_allgather"), algorithms_attr="ALGORITHMS"),
)


def _example_doubling(rank: int, world: int, size_bytes: int, algorithm: str | None) -> Schedule:
    """Recursive doubling with the extra ranks folded onto partners (any P >= 1)."""
    n = max(1, size_bytes // 4)
    s = Schedule(rank, world, "example-doubling",
                 {"x": _slot(n), "tmp": _slot(n)})
    p2 = 1 << (world.bit_length() - 1)
    extra = world - p2
    prev: list[int] = []
    if rank >= p2:  # fold: hand the data to a partner, get the result back
        snd = s.send(rank - p2, "x", tag=100)
        s.recv(rank - p2, "x", tag=101, deps=[snd])
        return s.commit()
    if rank < extra:
        rcv = s.recv(rank + p2, "tmp", tag=100)
        prev = [s.compute("sum", ["x", "tmp"], "x", deps=[rcv])]
    dist, step = 1, 0
    while dist < p2:
        peer = rank ^ dist
        snd = s.send(peer, "x", tag=step, deps=prev)
        rcv = s.recv(peer, "tmp", tag=step, deps=prev)
        prev = [s.compute("sum", ["x", "tmp"], "x", deps=[snd, rcv])]
        dist, step = dist * 2, step + 1
    if rank < extra:
        s.send(rank + p2, "x", tag=101, deps=prev)
    return s.commit()


def _example_quorum(rank: int, world: int, size_bytes: int, algorithm: str | None) -> Schedule:
    """Rank 0 gathers and proceeds on a k-of-n quorum (k = majority); others OR-activate."""
    n = max(1, size_bytes // 4)
    s = Schedule(rank, world, "example-quorum", {"x": _slot(n), "tmp": _slot(n)})
    if rank == 0:
        if world == 1:
            s.compute("copy", ["x"], "tmp")
            return s.commit()
        rcvs = [s.recv(p, None, tag=1, msg="activation") for p in range(1, world)]
        k = len(rcvs) // 2 + 1
        gate = s.nop(deps=rcvs, k=k, label=f"quorum {k}-of-{len(rcvs)}")
        for p in range(1, world):
            s.send(p, "x", tag=2, deps=[gate])
        return s.commit()
    start = s.nop(label="called")
    ext = s.recv(0, "tmp", tag=2)
    act = s.send(0, None, tag=1, msg="activation", deps=[start, ext], k=1)
    s.compute("copy", ["tmp"], "x", deps=[ext, act])
    return s.commit()


def _slot(n: int) -> SlotSpec:
    return SlotSpec(n, DEFAULT_DTYPE)


_EXAMPLES: dict[str, tuple[Builder, str]] = {
    "example-doubling": (_example_doubling, "hand-built recursive-doubling DAG (AND edges)"),
    "example-quorum": (_example_quorum, "hand-built DAG with OR and k-of-n edges"),
}


def call_builder(fn: Callable[..., Any], rank: int, world: int, size_bytes: int,
                 algorithm: str | None, fixed: dict[str, Any] | None = None) -> Schedule:
    """Call a collective builder with the arguments its signature accepts.

    Raises ``TypeError`` if a required parameter cannot be supplied, naming it.
    """
    params = _inspect.signature(fn).parameters
    count = max(1, size_bytes // 4)
    offer: dict[str, Any] = {
        "rank": rank, "P": world, "world_size": world, "world": world,
        "count": count, "n": count, "dtype": DEFAULT_DTYPE, "op": "sum", "root": 0,
        "size_bytes": size_bytes, "nbytes": size_bytes,
    }
    if algorithm is not None:
        offer["algorithm"] = algorithm
    for k, v in (fixed or {}).items():
        offer[k] = v(world, count) if callable(v) else v
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for name, p in params.items():
        if name not in offer:
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"builder {fn.__qualname__} needs argument {name!r}, which "
                                "inspect cannot supply")
            continue
        if p.kind == p.POSITIONAL_ONLY:
            args.append(offer[name])
        else:
            kwargs[name] = offer[name]
    sched = fn(*args, **kwargs)
    if not isinstance(sched, Schedule):
        raise TypeError(f"builder {fn.__qualname__} returned {type(sched).__name__}, "
                        "not a Schedule")
    return sched


def _load(spec: KindSpec) -> Callable[..., Any] | None:
    try:
        mod = importlib.import_module(spec.module)
    except ImportError:
        return None
    fn = getattr(mod, spec.attr, None)
    return fn if callable(fn) else None


def available_kinds() -> dict[str, str]:
    """Kind name -> one-line help, for every kind whose builder can be imported now."""
    out = {spec.name: spec.help for spec in _CANDIDATES if _load(spec) is not None}
    out.update({name: help_ for name, (_, help_) in _EXAMPLES.items()})
    return out


def algorithms(name: str) -> tuple[str, ...]:
    """The ``--algorithm`` values of kind ``name`` (empty: it has one): the builder module's
    own list where it has one (``algorithms_attr``), else the list kept here."""
    for spec in _CANDIDATES:
        if spec.name == name:
            if spec.algorithms_attr:
                try:
                    own = getattr(importlib.import_module(spec.module), spec.algorithms_attr)
                    return tuple(str(a) for a in own)
                except (ImportError, AttributeError, TypeError):
                    pass
            return spec.algorithms
    return ()


def get_kind(name: str) -> Builder:
    """The builder of kind ``name``; ``ValueError`` listing the valid kinds if unknown."""
    if name in _EXAMPLES:
        return _EXAMPLES[name][0]
    for spec in _CANDIDATES:
        if spec.name == name:
            fn = _load(spec)
            if fn is None:
                break
            return _bind(fn, spec)
    raise ValueError(f"unknown kind {name!r}; available kinds: "
                     f"{', '.join(sorted(available_kinds()))}")


def _bind(fn: Callable[..., Any], spec: KindSpec) -> Builder:
    def build_one(rank: int, world: int, size_bytes: int, algorithm: str | None) -> Schedule:
        return call_builder(fn, rank, world, size_bytes, algorithm, spec.fixed)

    return build_one


def build(kind: str, rank: int, world: int, size_bytes: int = DEFAULT_SIZE,
          algorithm: str | None = None) -> Schedule:
    """Rank ``rank``'s committed schedule of ``kind`` for ``world`` ranks.

    Raises ``ValueError`` naming the argument for an unknown kind, ``world < 1``, a rank outside
    ``0..world-1`` or ``size_bytes < 1``. Costs only the builder's work (no I/O).
    """
    check_args(kind, world, rank, size_bytes)
    sched = get_kind(kind)(rank, world, size_bytes, algorithm)
    return sched.commit() if not sched.committed else sched


def build_all(kind: str, world: int, size_bytes: int = DEFAULT_SIZE,
              algorithm: str | None = None) -> list[Schedule]:
    """Every rank's schedule of ``kind``, rank order."""
    check_args(kind, world, 0, size_bytes)
    return [build(kind, r, world, size_bytes, algorithm) for r in range(world)]


def check_args(kind: str, world: int, rank: int | None, size_bytes: int) -> None:
    """Raise ``ValueError`` naming what is wrong and what is valid."""
    get_kind(kind)
    if world < 1:
        raise ValueError(f"--ranks (P) must be >= 1, got {world}")
    if rank is not None and not 0 <= rank < world:
        raise ValueError(f"--rank must be in 0..{world - 1} for P={world}, got {rank}")
    if size_bytes < 1:
        raise ValueError(f"--size must be >= 1 byte, got {size_bytes}")
