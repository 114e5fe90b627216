"""The drawing model of schedules that every renderer shares: op labels and sizes, dependency
classes, colours and edge styles, message matching across ranks, and the layered layout.

:mod:`.render` (text, DOT, JSON, PNG), :mod:`.html` (the pages) and :mod:`.perfetto` build on it;
it imports none of them. Everything here is pure and costs O(ops + edges).
"""

from __future__ import annotations

import html
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..sched import Op, Schedule

__all__ = ["EDGE_STYLE", "KIND_COLOR", "Layout", "MsgEdge", "dep_class", "escape", "layout",
           "match_messages", "op_bytes", "op_fields", "op_label"]

#: per dependency class: DOT style, and the SVG dash pattern the HTML page uses
EDGE_STYLE = {"single": ("solid", ""), "and": ("solid", ""), "or": ("dashed", "6,4"),
              "k-of-n": ("dotted", "2,3")}
KIND_COLOR = {"send": "#4e79a7", "recv": "#59a14f", "compute": "#f28e2b", "nop": "#bab0ac"}


@dataclass(frozen=True)
class MsgEdge:
    """A message: send op ``src_op`` of rank ``src`` matched to receive ``dst_op`` of ``dst``."""

    src: int
    src_op: int
    dst: int
    dst_op: int
    tag: int
    msg: str


def dep_class(op: Op) -> str:
    """``"none"``, ``"single"``, ``"and"`` (k = n), ``"or"`` (k = 1) or ``"k-of-n"``."""
    n = len(op.deps)
    if n == 0:
        return "none"
    if n == 1:
        return "single"
    if op.k == n:
        return "and"
    return "or" if op.k == 1 else "k-of-n"


def op_bytes(s: Schedule, op: Op) -> int | None:
    """Bytes an op moves or writes (``None`` when its slot's size or dtype is unknown)."""
    ref = op.buf if op.kind in ("send", "recv") else op.output
    if ref is None:
        return 0 if op.kind != "compute" else None
    spec = s.slots.get(ref.slot)
    if spec is None:
        return None
    count = ref.count if ref.count is not None else (
        None if spec.count is None else spec.count - ref.offset)
    dtype = spec.dtype or s.meta.get("dtype")
    if count is None or dtype is None:
        return None
    return int(count) * np.dtype(dtype).itemsize


def op_label(op: Op) -> str:
    """A short label: ``send→3 t1``, ``recv←2 t0``, ``sum``, ``nop``."""
    if op.kind == "send":
        return f"send→{op.peer} t{op.tag}" + (" act" if op.msg != "data" else "")
    if op.kind == "recv":
        return f"recv←{op.peer} t{op.tag}" + (" act" if op.msg != "data" else "")
    if op.kind == "compute":
        return op.kernel
    return op.label or "nop"


def op_fields(s: Schedule, i: int) -> dict[str, Any]:
    """Every field of op ``i`` plus derived ones (bytes, dependency class), JSON-safe."""
    op = s.ops[i]
    d = op.to_json()
    d.update(id=i, rank=s.rank, describe=op.describe(), bytes=op_bytes(s, op),
             deps_class=dep_class(op), deps=list(op.deps), k=op.k, final=(i == s.final))
    return d


def match_messages(schedules: Sequence[Schedule]) -> tuple[list[MsgEdge], list[tuple[int, int]]]:
    """Pair sends with receives by (src, dst, tag, message kind), in op-id order.

    Returns the matched edges and the ``(rank, op)`` of every send or receive left unmatched
    (for example a receive whose peer's schedule is not in ``schedules``).
    """
    sends: dict[tuple[int, int, int, str], deque[int]] = defaultdict(deque)
    for s in schedules:
        for i, op in enumerate(s.ops):
            if op.kind == "send":
                sends[(s.rank, op.peer, op.tag, op.msg)].append(i)
    edges: list[MsgEdge] = []
    unmatched: list[tuple[int, int]] = []
    for s in schedules:
        for i, op in enumerate(s.ops):
            if op.kind != "recv":
                continue
            q = sends.get((op.peer, s.rank, op.tag, op.msg))
            if q:
                edges.append(MsgEdge(op.peer, q.popleft(), s.rank, i, op.tag, op.msg))
            else:
                unmatched.append((s.rank, i))
    for (src, _, _, _), q in sends.items():
        unmatched.extend((src, i) for i in q)
    return edges, sorted(unmatched)


# -- layout ----------------------------------------------------------------------------------
@dataclass
class Layout:
    """Node positions in grid units: x = dependency depth, y = row within the whole picture.

    ``pos[(rank, op)] = (x, y)``; ``bands[rank] = (y0, y1)`` the rows of that rank's cluster.
    """

    pos: dict[tuple[int, int], tuple[float, float]]
    bands: dict[int, tuple[float, float]]
    width: float
    height: float


def _depths(s: Schedule) -> list[int]:
    """Longest path from a source to each op (Kahn order: op ids need not be topological)."""
    n = len(s.ops)
    succ = s.successors()
    indeg = [len(op.deps) for op in s.ops]
    depth = [0] * n
    todo = deque(i for i in range(n) if indeg[i] == 0)
    while todo:
        i = todo.popleft()
        for j in succ[i]:
            depth[j] = max(depth[j], depth[i] + 1)
            indeg[j] -= 1
            if indeg[j] == 0:
                todo.append(j)
    return depth


def layout(schedules: Sequence[Schedule]) -> Layout:
    """Layered layout: columns by dependency depth, one horizontal band per rank. O(ops)."""
    pos: dict[tuple[int, int], tuple[float, float]] = {}
    bands: dict[int, tuple[float, float]] = {}
    y0 = 0.0
    width = 1.0
    for s in schedules:
        depth = _depths(s)
        rows: dict[int, int] = defaultdict(int)
        for i, d in enumerate(depth):
            pos[(s.rank, i)] = (float(d), y0 + rows[d])
            rows[d] += 1
        h = float(max(rows.values(), default=1))
        bands[s.rank] = (y0, y0 + h)
        width = max(width, float(max(depth, default=0) + 1))
        y0 += h + 0.6
    return Layout(pos, bands, width, max(y0 - 0.6, 1.0))


def escape(s: str) -> str:
    """HTML-escape ``s`` (quotes too)."""
    return html.escape(s, quote=True)
