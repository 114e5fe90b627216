"""Summaries of a traced run: per collective and per execution.

Per collective: how many executions completed, who initiated them, the distribution of the
number of contributors (NAP: the number of active processes whose data entered an execution),
latency percentiles and staleness. Per execution: on each rank, how it was activated, when it
started and completed, bytes sent and received, initiator and contributors.

The **initiators** of an execution are the ranks that actually started it: their internal start
(or a forced activation) came before any activation message reached them. A rank that called
after an activation had reached it is not an initiator, even where it was allowed to start the
execution; the allowed set S(e) the runtime recorded (``initiators`` in ``Trace.extra``) is
kept apart (``allowed``). ``contributors`` are used as the run recorded them, else unknown.
Latency of a rank in an execution is completion minus its start: its internal activation, else
the firing of its first op past the sources (the external activation's arrival). Staleness is
the ``missed``/``staleness`` a rank recorded.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .tracefile import RankTrace

__all__ = ["CollectiveSummary", "ExecutionDetail", "execution_detail", "render_execution",
           "render_summary", "summarize"]


@dataclass
class ExecutionDetail:
    """One execution across ranks; per-rank dicts keyed by rank."""

    sched_id: int
    name: str
    execution: int
    activation: dict[int, str] = field(default_factory=dict)
    start: dict[int, float] = field(default_factory=dict)
    completed: dict[int, float] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)
    initiators: list[int] = field(default_factory=list)
    #: the initiator set S(e) the runtime recorded (who was allowed to start), if any
    allowed: list[int] | None = None
    contributors: list[int] | None = None
    staleness: dict[int, float] = field(default_factory=dict)
    extra: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def latency(self) -> float:
        """Seconds from the first rank's start to the last rank's completion."""
        if not self.start or not self.completed:
            return float("nan")
        return max(self.completed.values()) - min(self.start.values())


@dataclass
class CollectiveSummary:
    """Aggregates over the executions of one collective (one ``sched_id``)."""

    sched_id: int
    name: str
    meta: dict[str, Any]
    ranks: list[int]
    executions: list[ExecutionDetail]
    initiators: Counter[int]
    nap: Counter[int]
    latency_us: dict[str, float]
    staleness: dict[str, float]
    pending: int


_STD_KEYS = {"type", "sched_id", "execution", "armed", "started", "completed", "activation",
             "ops", "initiator", "initiators"}  # the last two: shown as ``allowed``


def _initiated(r: int, rec: Mapping[str, Any], k: Sequence[tuple[str, bool, int]]) -> bool:
    """Whether rank ``r`` started the execution itself: its start (or a forced activation, a
    message to itself) came before any activation message from another rank."""
    ops = rec.get("ops") or []
    own = [] if rec.get("started") is None else [float(rec["started"])]
    other: list[float] = []
    for i, row in enumerate(ops):
        if i < len(k) and k[i][2] >= 0 and row[2] is not None:
            (own if k[i][2] == r else other).append(float(row[2]))
    return bool(own) and (not other or min(own) <= min(other))


def _detail(sched_id: int, name: str, e: int, recs: Mapping[int, dict[str, Any]],
            kinds: Mapping[int, list[tuple[str, bool, int]]]) -> ExecutionDetail:
    d = ExecutionDetail(sched_id, name, e)
    given: set[int] = set()
    internal: list[int] = []
    for r, rec in sorted(recs.items()):
        ops = rec.get("ops") or []
        k = kinds.get(r, [])
        # activated from outside: its start is the first op past the sources that fired
        # (source receives are posted, i.e. "fired", when the execution is armed)
        fired = [row[1] for i, row in enumerate(ops)
                 if row[1] is not None and i < len(k) and k[i][1]]
        start = rec.get("started") if rec.get("started") is not None else (
            min(fired) if fired else rec.get("armed"))
        if start is not None:
            d.start[r] = float(start)
        if rec.get("completed") is not None:
            d.completed[r] = float(rec["completed"])
        d.activation[r] = str(rec.get("activation", "?"))
        if _initiated(r, rec, k):
            internal.append(r)
        d.sent[r] = sum(int(row[3]) for i, row in enumerate(ops)
                        if i < len(k) and k[i][0] == "send")
        d.received[r] = sum(int(row[3]) for i, row in enumerate(ops)
                            if i < len(k) and k[i][0] == "recv")
        if "initiator" in rec and rec["initiator"] is not None:
            given.add(int(rec["initiator"]))
        for x in rec.get("initiators") or ():
            given.add(int(x))
        if d.contributors is None and rec.get("contributors") is not None:
            d.contributors = sorted(int(x) for x in rec["contributors"])
        for key in ("staleness", "missed"):
            if rec.get(key) is not None:
                d.staleness[r] = float(rec[key])
                break
        extra = {k2: v for k2, v in rec.items() if k2 not in _STD_KEYS}
        if extra:
            d.extra[r] = extra
    d.initiators = internal
    d.allowed = sorted(given) if given else None
    return d


def _pct(xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        return {}
    a = np.asarray(xs, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": float(a.size), "min": float(a.min()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(a.max())}


def summarize(traces: Mapping[int, RankTrace]) -> list[CollectiveSummary]:
    """One summary per ``sched_id`` found in any rank's file, in ``sched_id`` order."""
    sids = sorted({sid for rt in traces.values() for sid in (*rt.schedules, *rt.executions)})
    out = []
    for sid in sids:
        out.append(_summary(traces, sid))
    return out


def _schedule_info(traces: Mapping[int, RankTrace], sid: int
                   ) -> tuple[str, dict[str, Any], dict[int, list[tuple[str, bool, int]]]]:
    """Name, metadata, and per rank each op's (kind, has dependencies, the peer of an
    activation receive that is a source, else -1)."""
    name, meta = "", {}
    kinds: dict[int, list[tuple[str, bool, int]]] = {}
    for r, rt in traces.items():
        rec = rt.schedules.get(sid)
        if rec is None:
            continue
        kinds[r] = [(op["kind"], bool(op.get("deps")),
                     int(op.get("peer", -1)) if op["kind"] == "recv" and not op.get("deps")
                     and op.get("msg") == "activation" else -1)
                    for op in rec["schedule"]["ops"]]
        meta = {k: v for k, v in rec.items() if k not in ("type", "sched_id", "schedule")}
        name = str(rec.get("collective") or rec.get("name") or "")
    return name or f"sched {sid}", meta, kinds


def _by_execution(traces: Mapping[int, RankTrace], sid: int) -> dict[int, dict[int, Any]]:
    by_e: dict[int, dict[int, dict[str, Any]]] = {}
    for r, rt in traces.items():
        for rec in rt.executions.get(sid, []):
            by_e.setdefault(int(rec["execution"]), {})[r] = rec
    return by_e


def _summary(traces: Mapping[int, RankTrace], sid: int) -> CollectiveSummary:
    name, meta, kinds = _schedule_info(traces, sid)
    by_e = _by_execution(traces, sid)
    details = [_detail(sid, name, e, recs, kinds) for e, recs in sorted(by_e.items())]
    initiators: Counter[int] = Counter()
    nap: Counter[int] = Counter()
    lat: list[float] = []
    stale: list[float] = []
    for d in details:
        initiators.update(d.initiators)
        if d.contributors is not None:
            nap[len(d.contributors)] += 1
        lat.extend((d.completed[r] - d.start[r]) * 1e6 for r in d.completed if r in d.start)
        stale.extend(d.staleness.values())
    st = _pct(stale)
    if stale:
        st["mean"] = float(np.mean(stale))
    return CollectiveSummary(
        sid, name, meta, sorted(r for r, rt in traces.items() if sid in rt.schedules),
        details, initiators, nap, _pct(lat), st,
        sum(len(rt.pending.get(sid, [])) for rt in traces.values()))


def execution_detail(traces: Mapping[int, RankTrace], execution: int,
                     sched_id: int | None = None) -> list[ExecutionDetail]:
    """Execution ``execution`` of every collective (or only ``sched_id``); ``KeyError`` if no
    rank recorded it."""
    out = []
    sids = sorted({sid for rt in traces.values() for sid in rt.executions})
    for sid in sids:
        if sched_id is not None and sid != sched_id:
            continue
        recs = _by_execution(traces, sid).get(execution)
        if recs:
            name, _, kinds = _schedule_info(traces, sid)
            out.append(_detail(sid, name, execution, recs, kinds))
    if not out:
        raise KeyError(f"no rank recorded execution {execution}"
                       + ("" if sched_id is None else f" of sched_id {sched_id}"))
    return out


# -- rendering -------------------------------------------------------------------------------
def _fmt_counter(c: Counter[int], total: int) -> str:
    return ", ".join(f"{k}: {v}" + (f" ({100 * v / total:.0f}%)" if total else "")
                     for k, v in sorted(c.items())) or "-"


def render_summary(summaries: Sequence[CollectiveSummary], width: int = 110) -> str:
    """The per-collective summary as text (rich tables)."""
    from rich.console import Console
    from rich.table import Table

    con = Console(record=True, width=width, file=io.StringIO(), color_system=None)
    for s in summaries:
        n = len(s.executions)
        t = Table(title=f"{s.name} (sched_id {s.sched_id}, ranks {s.ranks})",
                  title_justify="left", show_header=False)
        t.add_column("what")
        t.add_column("value")
        for k in ("collective", "kind"):
            if k in s.meta:
                t.add_row(k, str(s.meta[k]))
        t.add_row("executions", str(n))
        t.add_row("initiators (rank: executions)", _fmt_counter(s.initiators, 0))
        t.add_row("contributors per execution (NAP: executions)",
                  _fmt_counter(s.nap, n) if s.nap else "not recorded")
        lat = s.latency_us
        t.add_row("latency per rank µs", "-" if not lat else
                  f"p50 {lat['p50']:.0f}  p90 {lat['p90']:.0f}  p99 {lat['p99']:.0f}  "
                  f"min {lat['min']:.0f}  max {lat['max']:.0f}  (n={lat['n']:.0f})")
        st = s.staleness
        t.add_row("staleness (missed executions)", "not recorded" if not st else
                  f"mean {st['mean']:.2f}  p50 {st['p50']:.0f}  max {st['max']:.0f}")
        if s.pending:
            t.add_row("pending snapshots", f"{s.pending} (see `asynccoll inspect pending`)")
        con.print(t)
    return con.export_text()


def render_execution(details: Sequence[ExecutionDetail], width: int = 110) -> str:
    """Per-rank table of one execution of each collective."""
    from rich.console import Console
    from rich.table import Table

    con = Console(record=True, width=width, file=io.StringIO(), color_system=None)
    for d in details:
        t0 = min(d.start.values(), default=0.0)
        allowed = "" if d.allowed is None else f" (allowed {d.allowed})"
        t = Table(title=f"{d.name} execution {d.execution}: initiators {d.initiators}{allowed}, "
                        f"contributors {d.contributors if d.contributors is not None else '?'}, "
                        f"latency {d.latency * 1e6:.0f} µs", title_justify="left")
        for col in ("rank", "activation", "start µs", "done µs", "sent B", "recv B",
                    "staleness", "extra"):
            t.add_column(col)
        for r in sorted(d.activation):
            t.add_row(str(r), d.activation[r],
                      f"{(d.start[r] - t0) * 1e6:.0f}" if r in d.start else "-",
                      f"{(d.completed[r] - t0) * 1e6:.0f}" if r in d.completed else "-",
                      str(d.sent.get(r, 0)), str(d.received.get(r, 0)),
                      str(d.staleness.get(r, "-")),
                      ", ".join(f"{k}={v}" for k, v in d.extra.get(r, {}).items()))
        con.print(t)
    return con.export_text()
