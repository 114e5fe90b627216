"""Straggler report: who arrives late at each collective, by how much, and how often last.

A rank's **arrival** at an execution is when it started the execution from inside (its call:
the executor's ``started`` time); a rank activated from outside before it called (a partial
collective that went ahead without it) did not arrive in time, and counts as absent from that
execution's arrivals. Its **lateness** is its arrival minus the execution's first arrival.
Per rank the report gives lateness percentiles (ms), how often it was the last of at least two
arrivals, in how many executions it arrived at all, and how often it contributed fresh data
(the ``fresh`` ranks the runtime recorded; partial collectives record them).

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
    fresh: int | None = None

    def pct(self) -> dict[str, float]:
        """p50, p90, p99 and max of the lateness (ms); empty without arrivals."""
        if not self.lateness_ms:
            return {}
        a = np.asarray(self.lateness_ms)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(a.max())}


@dataclass
class StragglerReport:
    """Lateness per rank of one collective (``sched_id``) over its ``executions``."""

    sched_id: int
    name: str
    executions: int
    ranks: dict[int, RankLateness]

    def ranking(self) -> list[int]:
        """Ranks from the latest (highest median lateness) to the earliest."""
        return sorted(self.ranks, key=lambda r: (-self.ranks[r].pct().get("p50", -1.0), r))


def stragglers(traces: Mapping[int, RankTrace]) -> list[StragglerReport]:
    """One report per collective with at least one execution that two ranks arrived at."""
    sids = sorted({sid for rt in traces.values() for sid in rt.executions})
    out = []
    for sid in sids:
        by_e: dict[int, dict[int, dict[str, Any]]] = {}
        name = f"sched {sid}"
        for r, rt in traces.items():
            rec = rt.schedules.get(sid)
            if rec is not None:
                name = str(rec.get("collective") or rec.get("name") or name)
            for x in rt.executions.get(sid, []):
                by_e.setdefault(int(x["execution"]), {})[r] = x
        ranks = {r: RankLateness(r) for r in sorted(traces)}
        fresh_seen = False
        used = 0
        for _, recs in sorted(by_e.items()):
            arr = {r: float(x["started"]) + traces[r].clock_offset for r, x in recs.items()
                   if x.get("started") is not None}
            fr = next((x.get("fresh") for x in recs.values() if x.get("fresh") is not None), None)
            if fr is not None:
                fresh_seen = True
                for r in fr:
                    if int(r) in ranks:
                        ranks[int(r)].fresh = (ranks[int(r)].fresh or 0) + 1
            if len(arr) < 2:
                continue
            used += 1
            first = min(arr.values())
            last = max(arr, key=lambda r: arr[r])
            for r, t in arr.items():
                rl = ranks[r]
                rl.lateness_ms.append((t - first) * 1e3)
                rl.times.append(first)
                rl.arrived += 1
            ranks[last].last += 1
        if not used:
            continue
        if fresh_seen:
            for rl in ranks.values():
                rl.fresh = rl.fresh or 0
        out.append(StragglerReport(sid, name, used, ranks))
    return out


def render_stragglers(reports: Sequence[StragglerReport], width: int = 110) -> str:
    """A table per collective, latest rank first."""
    from rich.console import Console
    from rich.table import Table

    con = Console(record=True, width=width, file=io.StringIO(), color_system=None)
    if not reports:
        con.print("no execution with two or more ranks arriving from inside: nothing to rank")
    for rep in reports:
        t = Table(title=f"{rep.name} (sched_id {rep.sched_id}): lateness over "
                        f"{rep.executions} executions, latest first", title_justify="left")
        for col in ("rank", "p50 ms", "p90 ms", "p99 ms", "max ms", "last", "arrived",
                    "fresh data"):
            t.add_column(col, justify="right")
        for r in rep.ranking():
            rl = rep.ranks[r]
            p = rl.pct()

            def ms(k: str, p: dict[str, float] = p) -> str:
                return f"{p[k]:.2f}" if k in p else "-"

            t.add_row(str(r), ms("p50"), ms("p90"), ms("p99"), ms("max"),
                      f"{rl.last}", f"{rl.arrived}/{rep.executions}",
                      "not recorded" if rl.fresh is None else str(rl.fresh))
        con.print(t)
    return con.export_text()


def stragglers_png(reports: Sequence[StragglerReport], path: str, title: str = "") -> None:
    """Plot lateness per rank over time (one panel per collective) into ``path``. Needs
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(reports), 1)
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.6 * n), squeeze=False)
    for ax, rep in zip(axes[:, 0], reports, strict=False):
        t0 = min((t for rl in rep.ranks.values() for t in rl.times), default=0.0)
        for r, rl in sorted(rep.ranks.items()):
            if rl.lateness_ms:
                ax.plot([t - t0 for t in rl.times], rl.lateness_ms, marker=".", lw=0.8,
                        label=f"rank {r}")
        ax.set_title(f"{rep.name} (sched_id {rep.sched_id})", fontsize=9)
        ax.set_ylabel("lateness (ms)")
        ax.legend(fontsize=7, loc="upper right", ncol=4)
    axes[-1, 0].set_xlabel("time since the first arrival (s)")
    fig.suptitle(title or "lateness per rank", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
