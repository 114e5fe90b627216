"""Trace replay: the compute times a traced run recorded, through every policy.

A trace (``ASYNCCOLL_TRACE=DIR``) records, per rank and execution of each collective, when the
rank started it from inside (its call, for a rank that took part on its own call) and when the
execution completed there. Between a rank's completion of one execution and its next start it
was computing: that gap is the rank's **compute time** for a step. :func:`compute_times`
collects those gaps per rank (for the collective with the most executions, or the one named)
into a ``(steps, P)`` matrix; shorter per-rank sequences repeat cyclically, and a rank that
never started an execution itself (a partial collective always activated it from outside, so
its calls left no mark) draws from the pooled gaps of the others. The matrix drives
:func:`~asynccoll.sim.run.simulate` through a :class:`~asynccoll.sim.arrivals.Replayed` model,
optionally for more ranks (``scale_to``: each simulated rank replays a recorded one, drawn with
replacement), under every policy asked for.

:func:`recommend` names the policy with the most steps per second among those whose staleness
stays within a bound (the 99th percentile of the per-call staleness, in executions); policies
within a tolerance of the best tie (:func:`recommendation`), and of tied policies the one that
includes the most fresh data wins.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..inspect.tracefile import RankTrace, load_dir
from .arrivals import Replayed
from .cost import Profile
from .policy import parse_policies
from .run import simulate

__all__ = ["DEFAULT_TIE", "compute_times", "recommend", "recommendation", "render", "replay",
           "replay_png"]


def _pick(traces: Mapping[int, RankTrace], collective: str | None) -> int:
    counts: dict[int, int] = {}
    names: dict[int, set[str]] = {}
    for rt in traces.values():
        for sid, xs in rt.executions.items():
            counts[sid] = counts.get(sid, 0) + len(xs)
        for sid, rec in rt.schedules.items():
            names.setdefault(sid, set()).update(
                str(rec.get(k)) for k in ("collective", "name", "handle") if rec.get(k))
    if collective is not None:
        cand = [sid for sid, ns in names.items() if collective in ns or str(sid) == collective]
        if not cand:
            raise ValueError(f"collective {collective!r} is not in the trace (it has: "
                             f"{sorted({n for ns in names.values() for n in ns})})")
        return max(cand, key=lambda s: counts.get(s, 0))
    if not counts:
        raise ValueError("the trace records no execution to replay")
    return max(counts, key=lambda s: counts[s])


def compute_times(traces: Mapping[int, RankTrace], collective: str | None = None,
                  ) -> tuple[np.ndarray, int, dict[str, Any]]:
    """The ``(steps, P)`` compute-time matrix (module doc), the schedule id it came from, and
    what is known of that collective (its schedule record, less the schedule). Raises
    ``ValueError`` when no rank has two executions to measure a gap between."""
    sid = _pick(traces, collective)
    P = next(iter(traces.values())).world_size
    gaps: dict[int, list[float]] = {}
    for r, rt in traces.items():
        xs = sorted(rt.executions.get(sid, []), key=lambda x: int(x["execution"]))
        last_done: float | None = None
        g: list[float] = []
        for x in xs:
            st, done = x.get("started"), x.get("completed")
            if st is not None and last_done is not None and not x.get("flushed"):
                g.append(max(float(st) - last_done, 0.0))
            if done is not None:
                last_done = float(done)
        gaps[r] = g
    pooled = np.array([v for g in gaps.values() for v in g])
    if pooled.size == 0:
        raise ValueError(f"no rank of the trace started two executions of collective {sid}: "
                         "nothing to measure compute times from")
    steps = max(len(g) for g in gaps.values())
    rng = np.random.default_rng(0)
    out = np.empty((steps, P))
    for r in range(P):
        g = gaps.get(r) or []
        col = np.asarray(g) if g else rng.choice(pooled, steps)
        out[:, r] = col[np.arange(steps) % col.size]
    info: dict[str, Any] = {}
    for rt in traces.values():
        rec = rt.schedules.get(sid)
        if rec is not None:
            info = {k: v for k, v in rec.items() if k != "schedule"}
            sched = rec.get("schedule", {})
            slots = sched.get("slots", {})
            spec = slots.get("acc") or slots.get("data") or {}
            if spec.get("count"):
                itemsize = np.dtype(spec.get("dtype") or "<f4").itemsize
                info["nbytes"] = int(spec["count"]) * itemsize
            break
    return out, sid, info


def replay(trace_dir: str | os.PathLike[str], policies: str, *, profile: Profile,
           scale_to: int | None = None, steps: int | None = None,
           collective: str | None = None, nbytes: int | None = None,
           seed: int = 0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Replay the trace in ``trace_dir`` through every policy of ``policies`` (comma-separated
    policies' text, :func:`~asynccoll.sim.parse_policies`; each row names its policy by
    ``str()``); return one summary per policy (:meth:`SimRun.summary`) and what was replayed.
    ``steps``: how many steps (default: the recorded ones); ``nbytes``: each call's bytes
    (default: the traced collective's). Raises ``ValueError`` naming a bad argument, and the
    trace readers' errors for a bad directory."""
    traces = load_dir(trace_dir)
    times, sid, info = compute_times(traces, collective)
    P0 = times.shape[1]
    P = scale_to or P0
    if P < 1:
        raise ValueError(f"scale_to must be >= 1, got {scale_to!r}")
    n = steps or times.shape[0]
    model = Replayed(times)
    comp = model.sample(n, P, np.random.default_rng(seed))
    nb = nbytes or int(info.get("nbytes", 4))
    rows = []
    for policy in parse_policies(policies, P):
        run = simulate(policy, P, n, profile=profile, compute=comp, nbytes=nb, seed=seed)
        rows.append(run.summary())
    meta = {"trace": str(trace_dir), "sched_id": sid, "collective": info.get("collective"),
            "recorded_P": P0, "P": P, "steps": n, "nbytes": nb,
            "compute_median_s": float(np.median(times)),
            "compute_p99_s": float(np.percentile(times, 99)), "profile": profile.name}
    return rows, meta


#: policies whose steps/s are within this fraction of the best tie (:func:`recommendation`);
#: replays of one trace under different seeds move steps/s by about this much
DEFAULT_TIE = 0.02


def recommendation(rows: Sequence[dict[str, Any]], max_staleness: int,
                   tie: float = DEFAULT_TIE) -> tuple[dict[str, Any] | None,
                                                      list[dict[str, Any]]]:
    """The recommended row and the rows tied with it.

    Of the rows whose per-call staleness has a 99th percentile of at most ``max_staleness``
    executions, those with steps per second within ``tie`` (a fraction) of the best **tie**
    (fastest first); of those, the one that includes the most fresh data (``included_frac``),
    then has the least staleness, then comes first in ``rows``, is recommended: a throughput
    difference within the noise does not pay for staler gradients. ``(None, [])`` when no row
    qualifies. Raises ``ValueError`` for a negative ``tie``.
    """
    if not tie >= 0:
        raise ValueError(f"tie must be a fraction >= 0, got {tie!r}")
    ok = [r for r in rows if _p99(r["staleness"]) <= max_staleness]
    if not ok:
        return None, []
    top = max(r["steps_per_s"] for r in ok)
    tied = sorted((r for r in ok if r["steps_per_s"] >= top * (1 - tie)),
                  key=lambda r: -r["steps_per_s"])
    order = {id(r): i for i, r in enumerate(rows)}
    best = min(tied, key=lambda r: (-r.get("included_frac", 0.0), _mean(r["staleness"]),
                                    order[id(r)]))
    return best, tied


def recommend(rows: Sequence[dict[str, Any]], max_staleness: int,
              tie: float = DEFAULT_TIE) -> dict[str, Any] | None:
    """The recommended row of :func:`recommendation` (``None`` if no row qualifies)."""
    return recommendation(rows, max_staleness, tie)[0]


def _mean(hist: Mapping[Any, int]) -> float:
    total = sum(int(v) for v in hist.values())
    return sum(int(k) * int(v) for k, v in hist.items()) / total if total else 0.0


def _p99(hist: Mapping[Any, int]) -> int:
    if not hist:
        return 0
    vals = sorted((int(k), int(v)) for k, v in hist.items())
    total = sum(v for _, v in vals)
    acc = 0
    for k, v in vals:
        acc += v
        if acc >= 0.99 * total:
            return k
    return vals[-1][0]


def render(rows: Sequence[dict[str, Any]], meta: Mapping[str, Any], width: int = 120) -> str:
    """A table of the replayed policies."""
    from rich.console import Console
    from rich.table import Table

    con = Console(record=True, width=width, file=io.StringIO(), color_system=None)
    t = Table(title=f"replay of {meta['trace']} ({meta.get('collective')}, recorded P = "
                    f"{meta['recorded_P']}) at P = {meta['P']}, {meta['steps']} steps, "
                    f"{meta['nbytes']} B, profile {meta['profile']}", title_justify="left")
    for col in ("policy", "steps/s", "mean ms", "p99 ms", "NAP", "included", "staleness "
                "(executions: calls)"):
        t.add_column(col, justify="right")
    for r in rows:
        hist = ", ".join(f"{k}: {v}" for k, v in sorted(r["staleness"].items()))
        t.add_row(r["policy"], f"{r['steps_per_s']:.2f}", f"{r['latency_mean_s'] * 1e3:.3f}",
                  f"{r['latency_p99_s'] * 1e3:.3f}", f"{r['nap']:.1f}",
                  f"{r['included_frac']:.0%}", hist)
    con.print(t)
    return con.export_text()


def replay_png(rows: Sequence[dict[str, Any]], meta: Mapping[str, Any], path: str) -> None:
    """Steps per second and latency per policy, side by side, into ``path`` (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["policy"] for r in rows]
    x = np.arange(len(rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows)), 4))
    a1.bar(x, [r["steps_per_s"] for r in rows])
    a1.set_xticks(x, names, rotation=30, fontsize=8)
    a1.set_ylabel("steps/s (simulated)")
    a2.bar(x - 0.2, [r["latency_mean_s"] * 1e3 for r in rows], 0.4, label="mean")
    a2.bar(x + 0.2, [r["latency_p99_s"] * 1e3 for r in rows], 0.4, label="p99")
    a2.set_xticks(x, names, rotation=30, fontsize=8)
    a2.set_ylabel("call latency (ms)")
    a2.legend()
    fig.suptitle(f"replay at P = {meta['P']} ({meta['steps']} steps, profile "
                 f"{meta['profile']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
