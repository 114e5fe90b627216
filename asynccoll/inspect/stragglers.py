"""Straggler report: who arrives late at each collective, by how much, and how often last.

A rank's **arrival** at an execution is when it started the execution from inside (its call:
the executor's ``started`` time). Its **lateness** is its arrival minus the execution's first
arrival. Under a partial kind a rank may **miss** an execution: the others' activation reached it
before it called, the execution went ahead without its fresh data, and its call (made later)
left no arrival time in the trace. Missing is later than any arrival, so the report ranks ranks
by the share of executions they missed first (a rank that never arrives in time heads the list),
then by median lateness. For the executions a rank missed, its own trace bounds how late it was
from below: it had not called when the activation reached it (its first op past the sources
fired), so it was later than that moment minus the first arrival (``missed: > ms``).

Which executions count: flush executions (``flushed`` in the trace: a ``flush()`` that
collects what the ranks still hold, with no arrivals to compare) are left out, and so is an
execution that no rank started from inside. "last" counts executions with two or more
arrivals. :func:`render_stragglers` says how many executions it used of how many and why.

Clocks: times are each rank's ``time.time()`` plus the offset to rank 0's clock that
``connect()`` estimated and the trace recorded (:mod:`asynccoll.comm.clock`; exact to about half
a round trip across hosts, 0 on one host, where the ranks share a clock).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .tracefile import RankTrace

__all__ = ["RankLateness", "StragglerReport", "render_stragglers", "stragglers",
           "stragglers_png"]


@dataclass
class RankLateness:
    """One rank's lateness over the executions of one collective."""

    rank: int
    lateness_ms: list[float] = field(default_factory=list)  # per execution it arrived at
    times: list[float] = field(default_factory=list)  # the executions' first arrivals
    last: int = 0
    arrived: int = 0
    #: per execution it missed: the lower bound of its lateness (ms; module doc)
    missed_ms: list[float] = field(default_factory=list)
    missed_times: list[float] = field(default_factory=list)
    fresh: int | None = None

    @property
    def missed(self) -> int:
        """Executions this rank missed (activated from outside before it called)."""
        return len(self.missed_ms)

    def pct(self) -> dict[str, float]:
        """p50, p90, p99 and max of the lateness of its arrivals (ms); empty without any."""
        if not self.lateness_ms:
            return {}
        a = np.asarray(self.lateness_ms)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(a.max())}

    def missed_bound(self) -> float | None:
        """The median lower bound of its lateness over the executions it missed (ms)."""
        return float(np.median(self.missed_ms)) if self.missed_ms else None


@dataclass
class StragglerReport:
    """Lateness per rank of one collective (``sched_id``) over its ``executions`` (those
    used; ``recorded`` were traced, ``flushed`` of them were flush executions)."""

    sched_id: int
    name: str
    executions: int
    ranks: dict[int, RankLateness]
    recorded: int = 0
    flushed: int = 0

    def ranking(self) -> list[int]:
        """Ranks from the latest to the earliest: most executions missed first, then the
        highest median lateness."""
        def key(r: int) -> tuple[float, float, float, int]:
            rl = self.ranks[r]
            return (-rl.missed, -(rl.missed_bound() or 0.0), -rl.pct().get("p50", -1.0), r)

        return sorted(self.ranks, key=key)


def _activated(rec: Mapping[str, Any], sched: Mapping[str, Any] | None) -> float | None:
    """When an execution activated from outside reached the rank: the first op past the
    sources that fired (source receives are posted when the execution is armed)."""
    ops = (sched or {}).get("ops") or []
    fired = [row[1] for i, row in enumerate(rec.get("ops") or [])
             if row[1] is not None and i < len(ops) and ops[i].get("deps")]
    return min(fired) if fired else None


def stragglers(traces: Mapping[int, RankTrace]) -> list[StragglerReport]:
    """One report per collective with at least one execution that a rank started from
    inside (module doc)."""
    sids = sorted({sid for rt in traces.values() for sid in rt.executions})
    out = []
    for sid in sids:
        by_e: dict[int, dict[int, dict[str, Any]]] = {}
        name = f"sched {sid}"
        scheds: dict[int, Mapping[str, Any]] = {}
        for r, rt in traces.items():
            rec = rt.schedules.get(sid)
            if rec is not None:
                name = str(rec.get("collective") or rec.get("name") or name)
                scheds[r] = rec.get("schedule") or {}
            for x in rt.executions.get(sid, []):
                by_e.setdefault(int(x["execution"]), {})[r] = x
        ranks = {r: RankLateness(r) for r in sorted(traces)}
        fresh_seen = False
        used = flushed = 0
        for _, recs in sorted(by_e.items()):
            if any(x.get("flushed") for x in recs.values()):
                flushed += 1
                continue
            arr = {r: float(x["started"]) + traces[r].clock_offset for r, x in recs.items()
                   if x.get("started") is not None}
            fr = next((x.get("fresh") for x in recs.values() if x.get("fresh") is not None), None)
            if fr is not None:
                fresh_seen = True
                for r in fr:
                    if int(r) in ranks:
                        ranks[int(r)].fresh = (ranks[int(r)].fresh or 0) + 1
            if not arr:
                continue
            used += 1
            first = min(arr.values())
            for r, t in arr.items():
                rl = ranks[r]
                rl.lateness_ms.append((t - first) * 1e3)
                rl.times.append(first)
                rl.arrived += 1
            for r, x in recs.items():
                if r in arr:
                    continue
                act = _activated(x, scheds.get(r))
                bound = 0.0 if act is None else max(act + traces[r].clock_offset - first, 0.0)
                ranks[r].missed_ms.append(bound * 1e3)
                ranks[r].missed_times.append(first)
            if len(arr) >= 2:
                ranks[max(arr, key=lambda r: arr[r])].last += 1
        if not used:
            continue
        if fresh_seen:
            for rl in ranks.values():
                rl.fresh = rl.fresh or 0
        out.append(StragglerReport(sid, name, used, ranks, len(by_e), flushed))
    return out


def render_stragglers(reports: Sequence[StragglerReport], width: int = 120) -> str:
    """A table per collective, latest rank first, with what it counts."""
    from rich.console import Console
    from rich.table import Table

    con = Console(record=True, width=width, file=io.StringIO(), color_system=None)
    if not reports:
        con.print("no execution that a rank started from inside: nothing to rank")
    for rep in reports:
        left = rep.recorded - rep.executions
        why = []
        if rep.flushed:
            why.append(f"{rep.flushed} flush execution{'s' * (rep.flushed != 1)}")
        if left - rep.flushed:
            n = left - rep.flushed
            why.append(f"{n} that no rank started from inside")
        t = Table(title=f"{rep.name} (sched_id {rep.sched_id}): lateness over "
                        f"{rep.executions} of {rep.recorded} executions"
                        + (f" (left out: {', '.join(why)})" if why else "")
                        + ", latest first", title_justify="left")
        for col in ("rank", "in time", "p50 ms", "p90 ms", "p99 ms", "max ms", "missed: > ms",
                    "last", "fresh data"):
            t.add_column(col, justify="right")
        for r in rep.ranking():
            rl = rep.ranks[r]
            p = rl.pct()

            def ms(k: str, p: dict[str, float] = p) -> str:
                return f"{p[k]:.2f}" if k in p else "-"

            mb = rl.missed_bound()
            t.add_row(str(r), f"{rl.arrived}/{rep.executions}", ms("p50"), ms("p90"),
                      ms("p99"), ms("max"), "-" if mb is None else f"{mb:.2f}",
                      f"{rl.last}", "not recorded" if rl.fresh is None else str(rl.fresh))
        con.print(t)
    if reports:
        con.print(
            "in time: executions the rank started by its own call (its arrival); p50..max: "
            "its arrival minus the execution's first arrival; missed: > ms: in the executions "
            "that went ahead without it (activated from outside before it called), the median "
            "of how long after the first arrival the activation reached it, a lower bound of "
            "its lateness; last: executions it arrived at last of two or more; fresh data: "
            "executions that included its data of that step (partial kinds record it). Ranks "
            "that missed more executions come first, then the latest by median.")
    return con.export_text()


def stragglers_png(reports: Sequence[StragglerReport], path: str, title: str = "") -> None:
    """Plot lateness per rank over time (one panel per collective) into ``path``: arrivals as
    dots on lines, missed executions as hollow triangles at their lower bound. Needs
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(reports), 1)
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.6 * n), squeeze=False)
    for ax, rep in zip(axes[:, 0], reports, strict=False):
        t0 = min((t for rl in rep.ranks.values() for t in rl.times), default=0.0)
        for r, rl in sorted(rep.ranks.items()):
            line = None
            if rl.lateness_ms:
                (line,) = ax.plot([t - t0 for t in rl.times], rl.lateness_ms, marker=".",
                                  lw=0.8, label=f"rank {r}")
            if rl.missed_ms:  # hollow: a lower bound, the execution went ahead without it
                ax.plot([t - t0 for t in rl.missed_times], rl.missed_ms, ls="none", marker="^",
                        mfc="none", color=None if line is None else line.get_color(),
                        label=f"rank {r} missed (at least)")
        ax.set_title(f"{rep.name} (sched_id {rep.sched_id})", fontsize=9)
        ax.set_ylabel("lateness (ms)")
        ax.legend(fontsize=7, loc="upper right", ncol=4)
    axes[-1, 0].set_xlabel("time since the first arrival (s)")
    fig.suptitle(title or "lateness per rank", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
