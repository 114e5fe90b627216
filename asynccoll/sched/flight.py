"""The flight recorder: the last collectives of one rank, for a post-mortem of a hang.

Each executor already keeps its last executions in its :class:`~asynccoll.sched.Trace` ring
(preallocated arrays: when it was armed, started, completed, each op's times, and what the
runtime recorded, such as contributors). The flight record merges the rings of the executors a
:class:`~asynccoll.sched.LiveOps` tracks into one list, newest last: per collective its kind
and name, execution, arrival (this rank's call, or the activation that reached it), completion,
duration, activation and contributors, and, for an execution not complete, what it waits for.
So recording costs nothing beyond the trace the engine keeps anyway; the cost, O(executors x
ring x ops), is paid when a record is taken: on a timeout, on ``SIGUSR1``
(:meth:`LiveOps.dump`) or when asked.

A record is written to the trace file as a ``flight`` line (read back by
:func:`asynccoll.inspect.tracefile.load_dir`, shown by ``asynccoll inspect flight DIR``) and
rendered as text by :func:`flight_text`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .executor import Executor

__all__ = ["DEFAULT_FLIGHT", "flight_entries", "flight_text"]

#: how many collectives a flight record holds by default
DEFAULT_FLIGHT = 32


def _f(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def _arrival(ex: Executor, row: int, started: float) -> float | None:
    """This rank's arrival at the execution in ring row ``row``: its start, or the first op
    past the sources that fired (an activation from outside)."""
    if not math.isnan(started):
        return started
    ops = ex.schedule.ops
    fired = ex.trace.times[row, :, 1]
    ts = [float(fired[i]) for i, op in enumerate(ops) if op.deps and not math.isnan(fired[i])]
    return min(ts) if ts else None


def flight_entries(executors: Iterable[Executor], n: int = DEFAULT_FLIGHT
                   ) -> list[dict[str, Any]]:
    """The last ``n`` executions of ``executors``, by arrival (oldest first), as JSON-safe
    dicts: ``sched_id`` (a string: schedule ids are 64-bit), ``name``, ``execution``,
    ``state`` (``completed`` or what :meth:`Executor.status` says of one under way),
    ``armed``, ``arrival``, ``completed`` (``time.time()`` seconds), ``duration`` (completion
    minus arrival), ``activation`` and ``contributors`` (when the runtime recorded them), and
    ``waiting`` (the status line of an execution under way)."""
    out: list[dict[str, Any]] = []
    for ex in executors:
        tr = ex.trace
        current = ex.execution if ex.armed or ex.error is not None else None
        for row in range(tr.capacity):
            e, armed, started, completed = (float(x) for x in tr.meta[row])
            if math.isnan(e):
                continue
            arrival = _arrival(ex, row, started)
            ent: dict[str, Any] = {
                "sched_id": str(ex.sched_id), "name": ex.schedule.name or "schedule",
                "execution": int(e), "armed": _f(armed), "arrival": arrival,
                "completed": _f(completed),
                "duration": None if arrival is None or math.isnan(completed)
                else completed - arrival,
                "activation": "internal" if not math.isnan(started) else "external",
                "contributors": tr.extra[row].get("contributors"),
            }
            if not math.isnan(completed):
                ent["state"] = "completed"
            elif int(e) == current:
                st = ex.status()
                if st["state"] in ("not called", "idle") and arrival is None:
                    continue  # armed for the next call, nothing happened yet
                if ex.note is not None and ex.note[0] == current:
                    st = {**st, "text": ex.note[1]}
                ent["state"] = st["state"]
                ent["waiting"] = st["text"]
                if arrival is None and ex.called == current:
                    ent["arrival"] = _f(ex.called_at)  # called, waits to be activated
            else:
                continue  # armed once, never run (closed before it began)
            out.append(ent)
    out.sort(key=lambda x: (x["arrival"] if x["arrival"] is not None else
                            x["armed"] if x["armed"] is not None else 0.0))
    return out[-n:] if n > 0 else []


def flight_text(entries: Sequence[Mapping[str, Any]], rank: int | None = None) -> str:
    """One line per collective: arrival (s, relative to the first), name, execution, state,
    duration, contributors, and for one under way what it waits for."""
    head = "flight recorder" + ("" if rank is None else f" of rank {rank}")
    if not entries:
        return f"{head}: no collectives recorded\n"
    t0 = min((x["arrival"] for x in entries if x.get("arrival") is not None), default=0.0)
    lines = [f"{head}: last {len(entries)} collectives (arrival s, name, execution, state, "
             "duration, contributors)"]
    for x in entries:
        a = x.get("arrival")
        d = x.get("duration")
        c = x.get("contributors")
        line = (f"  {'?' if a is None else f'{a - t0:9.4f}'} {x.get('name')} "
                f"(sched_id {x.get('sched_id')}) #{x.get('execution')} {x.get('state')}"
                f"{'' if d is None else f' {d * 1e3:.3f} ms'}"
                f"{'' if c is None else f' contributors {c}'}")
        if x.get("waiting"):
            line += f": {x['waiting']}"
        lines.append(line)
    return "\n".join(lines) + "\n"
