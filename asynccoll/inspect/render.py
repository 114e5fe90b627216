"""Render schedules as text (rich), Graphviz DOT, JSON, self-contained HTML and PNG.

Every renderer takes a list of committed schedules: one schedule draws that rank's DAG; several
(one per rank, rank order) draw the *global view*: each rank's ops grouped by rank, with message
edges between matching sends and receives. Ops are labelled by kind, peer, tag, buffer and bytes;
dependency edges are drawn by threshold: AND solid, OR dashed, k-of-n dotted and labelled
``k/n`` (a single dependency is drawn solid). Rendering costs O(ops + edges) and no I/O except
:func:`render_png`, which writes a file and needs matplotlib.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

from ..sched import Op, Schedule
from .graph import (
    EDGE_STYLE,
    KIND_COLOR,
    Layout,
    MsgEdge,
    dep_class,
    layout,
    match_messages,
    op_bytes,
    op_fields,
    op_label,
)

# The drawing model lives in .graph (shared with .html, which this module imports for the
# "html" format); its names are re-exported here, where renderers have always found them.
__all__ = ["EDGE_STYLE", "FORMATS", "KIND_COLOR", "Layout", "MsgEdge", "dep_class", "layout",
           "match_messages", "op_bytes", "op_fields", "op_label", "render", "render_dot",
           "render_json", "render_png", "render_text"]

FORMATS = ("text", "dot", "json", "html")


def _deps_text(op: Op) -> str:
    cls = dep_class(op)
    ids = ",".join(str(d) for d in op.deps)
    if cls == "none":
        return "-"
    if cls in ("single", "and"):
        return f"AND({ids})" if cls == "and" else ids
    if cls == "or":
        return f"OR({ids})"
    return f"{op.k}-of-{len(op.deps)}({ids})"


# -- text ------------------------------------------------------------------------------------
def render_text(schedules: Sequence[Schedule], *, width: int = 120, color: bool = False) -> str:
    """One rich table per rank (id, kind, peer, tag, buffer, bytes, deps, label) + messages."""
    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=width, force_terminal=color, color_system=None
                      if not color else "standard", file=io.StringIO())
    for s in schedules:
        t = Table(title=f"{s.name or 'schedule'}: rank {s.rank} of {s.world_size}, "
                        f"{len(s.ops)} ops, final op {s.final}", title_justify="left")
        for col in ("op", "kind", "peer", "tag", "buffer", "bytes", "deps", "what"):
            t.add_column(col, justify="right" if col in ("op", "peer", "tag", "bytes") else
                         "left")
        for i, op in enumerate(s.ops):
            ref = op.buf if op.kind in ("send", "recv") else op.output
            nb = op_bytes(s, op)
            t.add_row(str(i), op.kind + ("*" if op.msg != "data" else ""),
                      str(op.peer) if op.kind in ("send", "recv") else "",
                      str(op.tag) if op.kind in ("send", "recv") else "",
                      "" if ref is None else _ref(ref), "?" if nb is None else str(nb),
                      _deps_text(op), _what(op))
        console.print(t)
    if len(schedules) > 1:
        edges, unmatched = match_messages(schedules)
        m = Table(title=f"messages ({len(edges)} matched, {len(unmatched)} unmatched)",
                  title_justify="left")
        for col in ("from rank:op", "to rank:op", "tag", "kind"):
            m.add_column(col)
        for e in edges:
            m.add_row(f"{e.src}:{e.src_op}", f"{e.dst}:{e.dst_op}", str(e.tag), e.msg)
        for r, i in unmatched:
            m.add_row(f"{r}:{i}", "(unmatched)", "", "")
        console.print(m)
    console.print("deps: AND(a,b) all of, OR(a,b) any of, k-of-n(...) any k of; "
                  "* activation message")
    return console.export_text(styles=color)


def _ref(r: Any) -> str:
    end = "" if r.count is None else str(r.offset + r.count)
    return f"{r.slot}[{r.offset}:{end}]" if (r.offset or r.count is not None) else str(r.slot)


def _what(op: Op) -> str:
    if op.kind == "compute":
        ins = ",".join(_ref(r) for r in op.inputs)
        out = "" if op.output is None else _ref(op.output)
        return f"{op.kernel}({ins}) -> {out}" + (f" {op.label}" if op.label else "")
    return op.label


# -- DOT -------------------------------------------------------------------------------------
def _q(s: str) -> str:
    """A DOT string literal; real newlines become DOT's ``\\n`` line breaks."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_dot(schedules: Sequence[Schedule], name: str = "schedule") -> str:
    """Graphviz DOT: a cluster per rank, dependency edges styled by threshold, message edges
    (bold, red for activation) between matching sends and receives in the global view."""
    lines = [f"digraph {_q(name)} {{", "  rankdir=LR;", "  compound=true;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=9];']
    for s in schedules:
        lines.append(f"  subgraph cluster_r{s.rank} {{")
        lines.append(f"    label={_q(f'rank {s.rank}')}; style=rounded; color=gray50;")
        for i, op in enumerate(s.ops):
            nb = op_bytes(s, op)
            lab = op_label(op) + f"\n#{i}"
            ref = op.buf if op.kind in ("send", "recv") else op.output
            if ref is not None:
                lab += f" {_ref(ref)}"
            if nb:
                lab += f" {nb}B"
            cls = dep_class(op)
            if cls in ("or", "k-of-n"):
                lab += f"\n[{op.k}/{len(op.deps)}]"
            shape = ", peripheries=2" if i == s.final else ""
            lines.append(f"    r{s.rank}_{i} [label={_q(lab)}, fillcolor={_q(KIND_COLOR[op.kind])}"
                         f"{shape}, tooltip={_q(op.describe())}];")
        for i, op in enumerate(s.ops):
            cls = dep_class(op)
            style = EDGE_STYLE.get(cls, ("solid", ""))[0]
            extra = f", label={_q(f'{op.k}/{len(op.deps)}')}" if cls == "k-of-n" else (
                ', label="OR"' if cls == "or" else "")
            for d in op.deps:
                lines.append(f"    r{s.rank}_{d} -> r{s.rank}_{i} [style={style}{extra}];")
        lines.append("  }")
    if len(schedules) > 1:
        edges, _ = match_messages(schedules)
        for e in edges:
            color = "red" if e.msg == "activation" else "black"
            lines.append(f"  r{e.src}_{e.src_op} -> r{e.dst}_{e.dst_op} [penwidth=2, "
                         f"color={color}, constraint=false, label={_q(f't{e.tag}')}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- JSON ------------------------------------------------------------------------------------
def render_json(schedules: Sequence[Schedule], kind: str = "") -> str:
    """One rank: exactly ``schedule.to_dict()``. Several: every rank's ``to_dict()`` and the
    matched messages under ``{"format": "asynccoll.schedules/1", ...}``."""
    if len(schedules) == 1:
        return json.dumps(schedules[0].to_dict(), indent=1)
    edges, unmatched = match_messages(schedules)
    return json.dumps({
        "format": "asynccoll.schedules/1", "kind": kind,
        "world_size": schedules[0].world_size,
        "schedules": [s.to_dict() for s in schedules],
        "messages": [[e.src, e.src_op, e.dst, e.dst_op, e.tag, e.msg] for e in edges],
        "unmatched": [list(u) for u in unmatched],
    }, indent=1)


def render(schedules: Sequence[Schedule], fmt: str, *, kind: str = "",
           color: bool = False) -> str:
    """Dispatch on ``fmt`` (one of :data:`FORMATS`); ``ValueError`` listing them otherwise."""
    if not schedules:
        raise ValueError("schedules must not be empty")
    if fmt == "text":
        return render_text(schedules, color=color)
    if fmt == "dot":
        return render_dot(schedules, kind or schedules[0].name or "schedule")
    if fmt == "json":
        return render_json(schedules, kind)
    if fmt == "html":
        from .html import schedule_html

        return schedule_html(schedules, title=kind or schedules[0].name)
    raise ValueError(f"unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")


# -- PNG (docs pictures; needs matplotlib) ---------------------------------------------------
def render_png(schedules: Sequence[Schedule], path: str, *, title: str = "") -> None:
    """Draw the layered layout with matplotlib into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    lay = layout(schedules)
    fig_w = min(1.5 + lay.width * 1.25, 32)
    fig_h = min(1.2 + lay.height * 0.5, 40)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    sx = 1.6
    for r, (y0, y1) in lay.bands.items():
        ax.add_patch(Rectangle((-0.7, y0 - 0.45), lay.width * sx + 0.2, y1 - y0 + 0.1 - 0.2,
                                   fc="#f4f4f4", ec="#999999", lw=0.8))
        ax.text(-0.65, y0 - 0.42, f"rank {r}", fontsize=8, va="bottom", color="#444444")
    for s in schedules:
        for i, op in enumerate(s.ops):
            x, y = lay.pos[(s.rank, i)]
            for d in op.deps:
                xd, yd = lay.pos[(s.rank, d)]
                ls = EDGE_STYLE.get(dep_class(op), ("solid", ""))[0]
                ax.annotate("", xy=(x * sx - 0.5, y), xytext=(xd * sx + 0.5, yd),
                            arrowprops={"arrowstyle": "->", "ls": ls, "color": "#555555",
                                        "lw": 0.8})
    if len(schedules) > 1:
        for e in match_messages(schedules)[0]:
            xs, ys = lay.pos[(e.src, e.src_op)]
            xd, yd = lay.pos[(e.dst, e.dst_op)]
            ax.annotate("", xy=(xd * sx, yd), xytext=(xs * sx, ys),
                        arrowprops={"arrowstyle": "->", "color": "#c0392b" if
                                    e.msg == "activation" else "#222222", "lw": 1.0,
                                    "alpha": 0.6, "connectionstyle": "arc3,rad=0.08"})
    for s in schedules:
        for i, op in enumerate(s.ops):
            x, y = lay.pos[(s.rank, i)]
            lab = op_label(op)
            if dep_class(op) in ("or", "k-of-n"):
                lab += f" [{op.k}/{len(op.deps)}]"
            ax.text(x * sx, y, lab, ha="center", va="center", fontsize=8,
                    bbox={"boxstyle": "round,pad=0.25", "fc": KIND_COLOR[op.kind], "ec":
                          "#333333" if i == s.final else "none", "alpha": 0.9})
    ax.set_xlim(-0.8, lay.width * sx)
    ax.set_ylim(lay.height + 0.2, -1.0)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
