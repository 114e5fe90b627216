"""Schedules as data: ops, dependencies with thresholds, buffer slots, tags.

A :class:`Schedule` is built with :meth:`~Schedule.send`, :meth:`~Schedule.recv`,
:meth:`~Schedule.compute` and :meth:`~Schedule.nop`, each returning the new op's id, then frozen by
:meth:`~Schedule.commit`, which validates it. Building costs no I/O; a schedule round-trips
through :meth:`~Schedule.to_dict` / :meth:`~Schedule.from_dict` (JSON-safe) without loss.

Dependencies: an op lists the ops it depends on and a threshold ``k``: it may fire once ``k`` of
them have completed (AND: ``k = n``, the default; OR: ``k = 1``; any k-of-n). Every op is
consumable: it fires at most once per execution. Ops without dependencies are *sources*: a
source receive is posted when the execution is armed (so a message can activate the execution
from outside), every other source fires when the execution is started from inside
(:meth:`Executor.start <asynccoll.sched.Executor.start>`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import ScheduleError
from .kernels import BUILTIN_KERNELS

__all__ = ["BufRef", "Op", "Schedule", "SlotSpec"]

OP_KINDS = ("send", "recv", "compute", "nop")
MSG_KINDS = ("data", "activation")


@dataclass(frozen=True)
class BufRef:
    """``count`` elements of slot ``slot`` from element ``offset`` (``count=None``: to its end)."""

    slot: str
    offset: int = 0
    count: int | None = None

    def to_json(self) -> list[Any]:
        """``[slot, offset, count]``, which :meth:`of` turns back into an equal reference."""
        return [self.slot, self.offset, self.count]

    @classmethod
    def of(cls, x: BufRef | str | list[Any] | tuple[Any, ...]) -> BufRef:
        """``x`` as a reference: a BufRef as is, a slot name (the whole slot), or
        ``(slot, offset, count)``; validity against the slots is checked at commit."""
        if isinstance(x, BufRef):
            return x
        if isinstance(x, str):
            return cls(x)
        return cls(*x)


@dataclass(frozen=True)
class SlotSpec:
    """A named buffer slot: its length in elements (``None``: any) and dtype (``None``: any)."""

    count: int | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class Op:
    """One vertex of a schedule. Only the fields of its kind are meaningful."""

    kind: str
    deps: tuple[int, ...] = ()
    k: int = 0
    peer: int = -1
    buf: BufRef | None = None
    tag: int = 0
    msg: str = "data"
    kernel: str = ""
    inputs: tuple[BufRef, ...] = ()
    output: BufRef | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    #: send: the id of a compute op whose returned payload is sent instead of ``buf``
    payload_from: int = -1
    #: compute: ids of receive ops whose messages the kernel is given
    recvs: tuple[int, ...] = ()
    label: str = ""

    def describe(self) -> str:
        """A one-line human description, e.g. ``send(peer=3, tag=1, buf=tmp0[0:128])``."""
        parts: list[str] = []
        if self.kind in ("send", "recv"):
            parts += [f"peer={self.peer}", f"tag={self.tag}"]
            if self.msg != "data":
                parts.append(self.msg)
            if self.buf is not None:
                parts.append(f"buf={_ref(self.buf)}")
        elif self.kind == "compute":
            parts.append(self.kernel)
            if self.inputs:
                parts.append("in=" + ",".join(_ref(r) for r in self.inputs))
            if self.output is not None:
                parts.append(f"out={_ref(self.output)}")
        if self.label:
            parts.append(repr(self.label))
        return f"{self.kind}({', '.join(parts)})"

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict of the fields that differ from their defaults (:meth:`from_json`
        restores the op)."""
        d: dict[str, Any] = {"kind": self.kind}
        default = _DEFAULT_OP
        for f in fields(self):
            if f.name == "kind":
                continue
            v = getattr(self, f.name)
            if v == getattr(default, f.name):
                continue
            if isinstance(v, BufRef):
                v = v.to_json()
            elif f.name == "inputs":
                v = [r.to_json() for r in v]
            elif isinstance(v, tuple):
                v = list(v)
            elif f.name == "params":
                v = copy.deepcopy(dict(v))
            d[f.name] = v
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Op:
        """The op :meth:`to_json` described; :class:`ScheduleError` names unknown fields."""
        kw: dict[str, Any] = dict(d)
        for name in ("deps", "recvs"):
            if name in kw:
                kw[name] = tuple(kw[name])
        if kw.get("buf") is not None:
            kw["buf"] = BufRef.of(kw["buf"])
        if kw.get("output") is not None:
            kw["output"] = BufRef.of(kw["output"])
        if "inputs" in kw:
            kw["inputs"] = tuple(BufRef.of(r) for r in kw["inputs"])
        unknown = set(kw) - {f.name for f in fields(cls)}
        if unknown:
            raise ScheduleError(f"unknown op fields {sorted(unknown)}")
        if "kind" not in kw:
            raise ScheduleError(f"op {dict(d)!r} has no 'kind'")
        return cls(**kw)


_DEFAULT_OP = Op(kind="nop")


def _ref(r: BufRef) -> str:
    end = "" if r.count is None else str(r.offset + r.count)
    return f"{r.slot}[{r.offset}:{end}]" if (r.offset or r.count is not None) else r.slot


Deps = Iterable[int] | int | None


class Schedule:
    """The DAG of one rank for one collective.

    ``final`` designates the op whose completion completes an execution; when left ``None``,
    :meth:`commit` adds a no-op that depends on every sink (AND).
    """

    def __init__(self, rank: int, world_size: int, name: str = "",
                 slots: Mapping[str, SlotSpec | int | None] | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self.slots: dict[str, SlotSpec] = {}
        self.ops: list[Op] = []
        self.final: int | None = None
        self.meta: dict[str, Any] = {}
        self.committed = False
        for s, spec in (slots or {}).items():
            self.declare(s, spec if isinstance(spec, SlotSpec) else SlotSpec(spec))

    # -- building ----------------------------------------------------------------------------
    def declare(self, slot: str, spec: SlotSpec | None = None) -> None:
        """Declare buffer slot ``slot``."""
        self._mutable()
        self.slots[slot] = spec or SlotSpec()

    def add(self, op: Op) -> int:
        """Append ``op`` (its ``k`` defaults to AND when 0) and return its id."""
        self._mutable()
        if op.k == 0 and op.deps:
            op = _replace(op, k=len(op.deps))
        self.ops.append(op)
        return len(self.ops) - 1

    def send(self, peer: int, buf: BufRef | str | None, tag: int = 0, *, deps: Deps = None,
             k: int = 0, msg: str = "data", payload_from: int = -1, label: str = "",
             **params: Any) -> int:
        """Add a send of ``buf`` (or, with ``payload_from``, of that compute op's payload) to
        ``peer`` with ``tag``; fires once ``k`` of ``deps`` are done (AND when ``k`` is 0).
        ``msg="activation"`` marks an activation message. Returns the op id; raises
        :class:`ScheduleError` once committed (the rest is checked by :meth:`commit`)."""
        return self.add(Op("send", _deps(deps), k, peer=peer,
                           buf=None if buf is None else BufRef.of(buf), tag=tag, msg=msg,
                           payload_from=payload_from, label=label, params=params))

    def recv(self, peer: int, buf: BufRef | str | None, tag: int = 0, *, deps: Deps = None,
             k: int = 0, msg: str = "data", label: str = "", **params: Any) -> int:
        """Add a receive from ``peer`` with ``tag`` into ``buf`` (``None``: any length, kept
        as the message for compute ops that name it in ``recvs``). Dependencies, return value
        and errors as for :meth:`send`."""
        return self.add(Op("recv", _deps(deps), k, peer=peer,
                           buf=None if buf is None else BufRef.of(buf), tag=tag, msg=msg,
                           label=label, params=params))

    def compute(self, kernel: str, inputs: Iterable[BufRef | str] = (),
                output: BufRef | str | None = None, *, deps: Deps = None, k: int = 0,
                recvs: Iterable[int] = (), label: str = "", **params: Any) -> int:
        """Add a call of the registered ``kernel`` on ``inputs`` into ``output`` with
        ``params``; ``recvs`` names receive ops whose messages it gets. Dependencies, return
        value and errors as for :meth:`send`; the kernel name is checked at commit."""
        return self.add(Op("compute", _deps(deps), k, kernel=kernel,
                           inputs=tuple(BufRef.of(r) for r in inputs),
                           output=None if output is None else BufRef.of(output),
                           recvs=tuple(recvs), label=label, params=params))

    def nop(self, *, deps: Deps = None, k: int = 0, label: str = "") -> int:
        """Add an op that does nothing but complete (a join or a threshold point); returns
        its id, raises as :meth:`send` does."""
        return self.add(Op("nop", _deps(deps), k, label=label))

    # -- freezing ----------------------------------------------------------------------------
    def commit(self, kernels: Iterable[str] | None = None) -> Schedule:
        """Validate and freeze; raise :class:`ScheduleError` naming the first bad op.

        Checks: known kinds, dependencies in range, thresholds in 1..n (0 for sources),
        acyclic, peers in 0..P-1, buffers declared and slices within declared slots, kernels
        registered in ``kernels`` (a :class:`~asynccoll.sched.KernelRegistry`, or any iterable
        of the names to accept; default :data:`~asynccoll.sched.BUILTIN_KERNELS`).
        """
        if self.committed:
            return self
        self._commit(set(BUILTIN_KERNELS if kernels is None else kernels))
        return self

    def _commit(self, known: set[str] | None) -> None:
        """Validate and freeze; ``known=None`` accepts any kernel name."""
        if self.final is None:
            has_succ = {d for op in self.ops for d in op.deps}
            sinks = [i for i in range(len(self.ops)) if i not in has_succ]
            self.final = self.add(Op("nop", tuple(sinks), len(sinks), label="final"))
        n = len(self.ops)
        for i, op in enumerate(self.ops):
            self._check_op(i, op, n, known)
        if not 0 <= self.final < n:
            raise ScheduleError(f"final op {self.final} is not an op id (0..{n - 1})")
        self._check_acyclic()
        self.committed = True

    def _check_op(self, i: int, op: Op, n: int, kernels: set[str] | None) -> None:
        def where() -> str:  # only on an error: describing every op costs (P = 500: 10 %)
            return f"op {i} {op.describe()}"

        if op.kind not in OP_KINDS:
            raise ScheduleError(f"{where()}: unknown kind {op.kind!r}; expected one of {OP_KINDS}")
        for d in op.deps:
            if not 0 <= d < n:
                raise ScheduleError(f"{where()}: dependency {d} is not an op id (0..{n - 1})")
            if d == i:
                raise ScheduleError(f"{where()}: depends on itself (cycle)")
        if len(set(op.deps)) != len(op.deps):
            raise ScheduleError(f"{where()}: duplicate dependencies {list(op.deps)}")
        nd = len(op.deps)
        if nd == 0 and op.k != 0:
            raise ScheduleError(f"{where()}: threshold k={op.k} but no dependencies")
        if nd and not 1 <= op.k <= nd:
            raise ScheduleError(f"{where()}: threshold k={op.k} outside 1..{nd} (its dependencies)")
        if op.kind in ("send", "recv"):
            if not 0 <= op.peer < self.world_size:
                raise ScheduleError(f"{where()}: peer {op.peer} outside 0..{self.world_size - 1}")
            if op.msg not in MSG_KINDS:
                raise ScheduleError(f"{where()}: unknown message kind {op.msg!r}")
            if op.tag < 0:
                raise ScheduleError(f"{where()}: tag must be >= 0")
            if op.payload_from != -1:
                if op.kind != "send" or not 0 <= op.payload_from < n or \
                        self.ops[op.payload_from].kind != "compute":
                    raise ScheduleError(f"{where()}: payload_from must name a compute op")
                if op.payload_from not in op.deps:
                    raise ScheduleError(f"{where()}: payload_from op must be a dependency")
        if op.kind == "compute":
            if kernels is not None and op.kernel not in kernels:
                raise ScheduleError(f"{where()}: unknown kernel {op.kernel!r}; registered: "
                                    f"{sorted(kernels)}")
            for r in op.recvs:
                if not 0 <= r < n or self.ops[r].kind != "recv":
                    raise ScheduleError(f"{where()}: recvs entry {r} is not a receive op")
        for ref in (op.buf, op.output, *op.inputs):
            if ref is None:
                continue
            spec = self.slots.get(ref.slot)
            if spec is None:
                raise ScheduleError(f"{where()}: buffer slot {ref.slot!r} is not declared "
                                    f"(declared: {sorted(self.slots)})")
            if ref.offset < 0 or (ref.count is not None and ref.count < 0):
                raise ScheduleError(f"{where()}: negative offset or count in {_ref(ref)}")
            if spec.count is not None:
                end = ref.offset + (0 if ref.count is None else ref.count)
                if end > spec.count or ref.offset > spec.count:
                    raise ScheduleError(f"{where()}: {_ref(ref)} runs past slot {ref.slot!r} of "
                                        f"{spec.count} elements")

    def _check_acyclic(self) -> None:
        n = len(self.ops)
        indeg = [len(op.deps) for op in self.ops]
        succ: list[list[int]] = [[] for _ in range(n)]
        for i, op in enumerate(self.ops):
            for d in op.deps:
                succ[d].append(i)
        stack = [i for i in range(n) if indeg[i] == 0]
        seen = 0
        while stack:
            i = stack.pop()
            seen += 1
            for s in succ[i]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    stack.append(s)
        if seen != n:
            bad = next(i for i in range(n) if indeg[i] > 0)
            raise ScheduleError(f"op {bad} {self.ops[bad].describe()} lies on a cycle")

    def _mutable(self) -> None:
        if self.committed:
            raise ScheduleError(f"schedule {self.name!r} is committed and cannot change")

    # -- queries -----------------------------------------------------------------------------
    def successors(self) -> list[list[int]]:
        """For each op, the ops that depend on it, in id order."""
        succ: list[list[int]] = [[] for _ in self.ops]
        for i, op in enumerate(self.ops):
            for d in op.deps:
                succ[d].append(i)
        return succ

    def __len__(self) -> int:
        return len(self.ops)

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, rank={self.rank}, world_size={self.world_size}, "
                f"ops={len(self.ops)}, committed={self.committed})")

    # -- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict that :meth:`from_dict` turns back into an equal schedule."""
        return {
            "format": "asynccoll.schedule/1",
            "name": self.name,
            "rank": self.rank,
            "world_size": self.world_size,
            "slots": {s: {"count": v.count, "dtype": v.dtype} for s, v in self.slots.items()},
            "ops": [op.to_json() for op in self.ops],
            "final": self.final,
            "meta": copy.deepcopy(self.meta),
            "committed": self.committed,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], kernels: Iterable[str] | None = None) -> Schedule:
        """The schedule :meth:`to_dict` described (committed again if it was); raises
        :class:`ScheduleError` for a dict of another format or an invalid schedule.

        A committed schedule's kernel names are checked against ``kernels`` when given; by
        default any name is accepted, since a schedule read back (from a trace, say) may name
        kernels this process has no registry for (an executor checks them against its own).
        """
        if d.get("format") != "asynccoll.schedule/1":
            raise ScheduleError(f"not a schedule dict (format {d.get('format')!r})")
        s = cls(d["rank"], d["world_size"], d.get("name", ""),
                {k: SlotSpec(v.get("count"), v.get("dtype")) for k, v in d["slots"].items()})
        s.ops = [Op.from_json(o) for o in d["ops"]]
        s.final = d.get("final")
        s.meta = copy.deepcopy(dict(d.get("meta", {})))
        if d.get("committed"):
            s._commit(None if kernels is None else set(kernels))
        return s

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]


def _deps(deps: Deps) -> tuple[int, ...]:
    if deps is None:
        return ()
    if isinstance(deps, int):
        return (deps,)
    return tuple(deps)


def _replace(op: Op, **kw: Any) -> Op:
    """``op`` with the fields ``kw`` changed (``dataclasses.replace`` without its per-call
    field walk and ``__init__``: a quorum schedule at P = 500 adds 250,000 ops through here)."""
    new = object.__new__(Op)
    new.__dict__.update(op.__dict__, **kw)
    return new
