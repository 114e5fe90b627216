"""Export traces as Chrome trace-event JSON (opens in Perfetto and chrome://tracing) and as an
HTML timeline.

Each rank is a process (``pid`` = rank). Within it, each collective gets a track of its
executions and as many op tracks as needed so that no two op slices of one track overlap
(lane 0 holds the executions). Thread ids are small and stable: ``tid`` = 1 + the index of
``(sched_id, lane)`` in the run's sorted table of tracks (the same track has the same id on
every rank), named by ``thread_name`` metadata and listed in ``otherData.tracks``; schedule
ids are 64-bit hashes, and ids built from them would not survive a reader that takes JSON
numbers as doubles. Ops are complete events
(``"ph": "X"``) from firing to completion (a source receive, posted when the execution is
armed, from the rank's start of the execution); each message is a flow from its send slice
(``"ph": "s"``) to its matching receive slice (``"ph": "f"``, ``"bp": "e"``) with one id per
message. Times are µs from the earliest event of the run. Costs O(ops · lanes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..sched import Schedule
from .graph import KIND_COLOR, match_messages, op_label
from .tracefile import RankTrace

__all__ = ["Slice", "Timeline", "perfetto_json", "timeline", "timeline_page", "timeline_png",
           "trace_events", "track_table"]


@dataclass
class Slice:
    """One op (or execution) of one rank, times in µs from the run's start."""

    rank: int
    sched_id: int
    lane: int
    ts: float
    dur: float
    name: str
    cat: str
    args: dict[str, Any]


@dataclass
class Timeline:
    """Slices, flows (pairs of slice indices: send, receive) and track names."""

    slices: list[Slice]
    flows: list[tuple[int, int]]
    names: dict[int, str]  # sched_id -> collective name
    span_us: float


def _t0(traces: Mapping[int, RankTrace]) -> float:
    ts = [rec["armed"] for rt in traces.values() for recs in rt.executions.values()
          for rec in recs if rec.get("armed") is not None]
    ts += [p["record"]["armed"] for rt in traces.values() for ps in rt.pending.values()
           for p in ps if p.get("record") and p["record"].get("armed") is not None]
    return min(ts, default=0.0)


def timeline(traces: Mapping[int, RankTrace]) -> Timeline:
    """Build every slice and message flow of the traced executions (completed and pending)."""
    t0 = _t0(traces)
    slices: list[Slice] = []
    flows: list[tuple[int, int]] = []
    names: dict[int, str] = {}
    sids = sorted({sid for rt in traces.values() for sid in rt.schedules})
    lanes_end: dict[tuple[int, int], list[float]] = {}
    for sid in sids:
        scheds: dict[int, Schedule] = {}
        for r, rt in traces.items():
            s = rt.schedule(sid)
            if s is not None:
                scheds[r] = s
                rec = rt.schedules[sid]
                names[sid] = str(rec.get("collective") or rec.get("name") or f"sched {sid}")
        edges, _ = match_messages([scheds[r] for r in sorted(scheds)])
        recs: dict[tuple[int, int], dict[str, Any]] = {}
        for r, rt in traces.items():
            for rec in rt.executions.get(sid, []):
                recs[(r, int(rec["execution"]))] = rec
            for p in rt.pending.get(sid, []):
                if p.get("record") is not None:
                    recs.setdefault((r, int(p["execution"])), p["record"])
        index: dict[tuple[int, int, int], int] = {}  # (rank, execution, op) -> slice
        for (r, e), rec in sorted(recs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            s = scheds.get(r)
            rows = rec.get("ops") or []
            start = rec.get("started")
            if start is None and s is not None:  # activated from outside: when it arrived
                act = [row[1] for i, row in enumerate(rows)
                       if row[1] is not None and i < len(s.ops) and s.ops[i].deps]
                start = min(act) if act else None
            if start is None:
                start = rec.get("armed")
            end = rec.get("completed")
            if start is not None:
                slices.append(Slice(r, sid, 0, (start - t0) * 1e6,
                                    max(0.0, ((end if end is not None else start) - start) * 1e6),
                                    f"{names.get(sid, sid)} #{e}", "execution",
                                    {k: str(v) if k == "sched_id" else v
                                     for k, v in rec.items() if k != "ops"}))
            for i, (_posted, fired, done, nbytes) in enumerate(rows):
                if fired is None or done is None:
                    continue
                op = s.ops[i] if s is not None and i < len(s.ops) else None
                if op is not None and op.kind == "recv" and not op.deps and start is not None:
                    # a source receive is posted when the execution is armed, long before the
                    # rank takes part: draw it from the rank's start (or its arrival if earlier)
                    fired = min(max(fired, start), done)
                ts, dur = (fired - t0) * 1e6, max(0.0, (done - fired) * 1e6)
                ends = lanes_end.setdefault((r, sid), [])
                lane = next((k for k, x in enumerate(ends) if x <= ts), len(ends))
                if lane == len(ends):
                    ends.append(ts + dur)
                else:
                    ends[lane] = ts + dur
                args = {"op": i, "execution": e, "bytes": nbytes}
                if op is not None:
                    args["describe"] = op.describe()
                index[(r, e, i)] = len(slices)
                slices.append(Slice(r, sid, lane + 1, ts, dur,
                                    op_label(op) if op is not None else f"op {i}",
                                    op.kind if op is not None else "op", args))
        execs = sorted({e for (_, e) in recs})
        for e in execs:
            for m in edges:
                a = index.get((m.src, e, m.src_op))
                b = index.get((m.dst, e, m.dst_op))
                if a is not None and b is not None:
                    flows.append((a, b))
    span = max((s.ts + s.dur for s in slices), default=0.0)
    return Timeline(slices, flows, names, span)


def trace_events(traces: Mapping[int, RankTrace]) -> list[dict[str, Any]]:
    """The ``traceEvents`` list: metadata, X slices, and s/f flow pairs."""
    return _events(timeline(traces), traces)[0]


def track_table(tl: Timeline) -> dict[tuple[int, int], int]:
    """``(sched_id, lane) -> tid``: 1, 2, ... in (sched_id, lane) order."""
    return {k: i for i, k in enumerate(sorted({(s.sched_id, s.lane) for s in tl.slices}), 1)}


def _events(tl: Timeline, traces: Mapping[int, RankTrace]
            ) -> tuple[list[dict[str, Any]], dict[int, str]]:
    ev: list[dict[str, Any]] = []
    table = track_table(tl)

    def _tid(sid: int, lane: int) -> int:
        return table[(sid, lane)]

    tracks = sorted({(s.rank, s.sched_id, s.lane) for s in tl.slices})
    for r in sorted(traces):
        ev.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "ts": 0,
                   "args": {"name": f"rank {r}"}})
        ev.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "ts": 0,
                   "args": {"sort_index": r}})
    names = {tid: f"{tl.names.get(sid, sid)} " + ("executions" if lane == 0 else f"ops {lane}")
             for (sid, lane), tid in table.items()}
    for r, sid, lane in tracks:
        tid = _tid(sid, lane)
        ev.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "ts": 0,
                   "args": {"name": names[tid]}})
        ev.append({"name": "thread_sort_index", "ph": "M", "pid": r, "tid": tid, "ts": 0,
                   "args": {"sort_index": tid}})
    for s in tl.slices:
        ev.append({"name": s.name, "cat": s.cat, "ph": "X", "ts": s.ts, "dur": s.dur,
                   "pid": s.rank, "tid": _tid(s.sched_id, s.lane), "args": s.args})
    for fid, (a, b) in enumerate(tl.flows, 1):
        sa, sb = tl.slices[a], tl.slices[b]
        # the flow starts inside the send slice and ends inside (at the end of) the receive
        ev.append({"name": "message", "cat": "message", "ph": "s", "id": fid, "ts": sa.ts,
                   "pid": sa.rank, "tid": _tid(sa.sched_id, sa.lane)})
        ev.append({"name": "message", "cat": "message", "ph": "f", "bp": "e", "id": fid,
                   "ts": sb.ts + sb.dur, "pid": sb.rank, "tid": _tid(sb.sched_id, sb.lane)})
    return ev, names


def perfetto_json(traces: Mapping[int, RankTrace]) -> str:
    """The whole JSON document (``{"traceEvents": [...], "displayTimeUnit": "ms",
    "otherData": {"tracks": {tid: name}, "sched_ids": {tid: sched_id as a string}}}``)."""
    tl = timeline(traces)
    ev, names = _events(tl, traces)
    sids = {tid: str(sid) for (sid, _), tid in track_table(tl).items()}
    return json.dumps({"traceEvents": ev, "displayTimeUnit": "ms",
                       "otherData": {"source": "asynccoll inspect", "tracks": names,
                                     "sched_ids": sids}}, separators=(",", ":"))


def timeline_page(traces: Mapping[int, RankTrace], title: str = "asynccoll trace") -> str:
    """A self-contained HTML timeline of the traced run."""
    from .html import timeline_html

    tl = timeline(traces)
    tracks = sorted({(s.rank, s.sched_id, s.lane) for s in tl.slices})
    row_of = {t: i for i, t in enumerate(tracks)}
    rows = [f"r{r} {tl.names.get(sid, sid)}" + ("" if lane == 0 else f" ·{lane}")
            for r, sid, lane in tracks]
    colors = {**KIND_COLOR, "execution": "#9c755f", "op": "#999999"}
    sl = [{"row": row_of[(s.rank, s.sched_id, s.lane)], "ts": s.ts, "dur": s.dur,
           "name": f"rank {s.rank}: {s.name}", "color": colors.get(s.cat, "#999999"),
           "fields": {"rank": s.rank, "sched_id": str(s.sched_id), "name": s.name, "start_us": s.ts,
                      "dur_us": s.dur, **s.args}} for s in tl.slices]
    fl = []
    for a, b in tl.flows:
        sa, sb = tl.slices[a], tl.slices[b]
        fl.append({"r0": row_of[(sa.rank, sa.sched_id, sa.lane)], "t0": sa.ts,
                   "r1": row_of[(sb.rank, sb.sched_id, sb.lane)], "t1": sb.ts + sb.dur})
    used = {s.cat for s in tl.slices}
    legend = {("execution (a rank's start to its completion)" if k == "execution" else k): c
              for k, c in colors.items() if k in used}
    return timeline_html(title, rows, sl, fl, tl.span_us, legend)


def timeline_png(traces: Mapping[int, RankTrace], path: str, title: str = "") -> None:
    """Draw the timeline with matplotlib into ``path`` (PNG): a row per track, named by rank
    and collective, ops coloured by kind (a legend of the kinds drawn), messages as lines from
    send to receive, time in ms. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    tl = timeline(traces)
    tracks = sorted({(s.rank, s.sched_id, s.lane) for s in tl.slices})
    row_of = {t: i for i, t in enumerate(tracks)}
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.32 * len(tracks)))
    colors = {**KIND_COLOR, "execution": "#9c755f"}
    ms = 1e-3  # the timeline is in µs; the picture in ms
    span = tl.span_us * ms
    for s in tl.slices:
        y = row_of[(s.rank, s.sched_id, s.lane)]
        ax.broken_barh([(s.ts * ms, max(s.dur * ms, span / 2000))], (y - 0.38, 0.76),
                       facecolors=colors.get(s.cat, "#999999"), edgecolor="none")
    for a, b in tl.flows:
        sa, sb = tl.slices[a], tl.slices[b]
        ax.plot([sa.ts * ms, (sb.ts + sb.dur) * ms],
                [row_of[(sa.rank, sa.sched_id, sa.lane)], row_of[(sb.rank, sb.sched_id, sb.lane)]],
                color="#222222", lw=0.6, alpha=0.5)
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([f"rank {r} {tl.names.get(sid, sid)} "
                        + ("executions" if lane == 0 else f"ops {lane}")
                        for r, sid, lane in tracks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time since the first execution was armed (ms)")
    ax.set_xlim(left=min((sl.ts * ms for sl in tl.slices), default=0.0) - span / 100)
    used = {s.cat for s in tl.slices}
    shown = {k: c for k, c in colors.items() if k in used}
    handles: list[Any] = [Rectangle((0, 0), 1, 1, color=c) for c in shown.values()]
    handles.append(Line2D([0], [0], color="#222222", lw=0.8, alpha=0.5))
    ax.legend(handles, [*shown, "message (send to receive)"], fontsize=7, loc="lower left",
              bbox_to_anchor=(0.0, 1.0), ncol=len(handles), frameon=False)
    names = sorted({tl.names.get(sid, str(sid)) for _, sid, _ in tracks})
    ax.set_title((title or "traced run") + ": " + ", ".join(names), fontsize=10, pad=22)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
