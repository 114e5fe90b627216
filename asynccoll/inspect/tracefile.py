"""Reading the on-disk traces a run wrote: one JSON-lines file per rank in a directory.

The format, and the :class:`~asynccoll.sched.tracefile.TraceWriter` that writes it, belong to
the engine (:mod:`asynccoll.sched.tracefile` describes every record type); this module reads a
directory back (:func:`load_dir`) into one :class:`RankTrace` per rank, turning the compact
``ops_us`` rows back into ``ops`` rows of absolute seconds (``None``: did not happen), as
:meth:`Trace.record <asynccoll.sched.Trace.record>` has them. A malformed file raises
:class:`~asynccoll.TraceFormatError` naming the file and line; the last line of a killed writer
may be cut short and is skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import TraceFormatError
from ..sched import Schedule
from ..sched.tracefile import FORMAT, trace_path

__all__ = ["FORMAT", "RankTrace", "TraceFormatError", "load_dir", "load_file", "trace_path"]


def _expand(rec: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`~asynccoll.sched.tracefile.compact_record` (to µs precision)."""
    rows = rec.pop("ops_us", None)
    base = rec.get("armed")
    if rows is not None and base is not None:
        rec["ops"] = [[None if a < 0 else base + a * 1e-6, None if b < 0 else base + b * 1e-6,
                       None if c < 0 else base + c * 1e-6, n] for a, b, c, n in rows]
    return rec


@dataclass
class RankTrace:
    """What one rank's file holds."""

    rank: int
    world_size: int
    path: Path
    header: dict[str, Any]
    schedules: dict[int, dict[str, Any]] = field(default_factory=dict)
    executions: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    pending: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    #: ``flight`` records (the last collectives, taken on a timeout or a dump), oldest first
    flights: list[dict[str, Any]] = field(default_factory=list)
    #: seconds to add to this rank's times to read rank 0's clock (its ``clock`` record;
    #: 0 without one)
    clock_offset: float = 0.0

    def schedule(self, sched_id: int) -> Schedule | None:
        """The schedule recorded under ``sched_id`` (``None`` if this rank has none)."""
        rec = self.schedules.get(sched_id)
        return None if rec is None else Schedule.from_dict(rec["schedule"])


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                if n > 1 and not line.endswith("\n"):
                    return  # the last line of a killed writer may be cut short
                raise TraceFormatError(f"{path}:{n}: not JSON ({exc})") from exc
            if not isinstance(rec, dict) or "type" not in rec:
                raise TraceFormatError(f"{path}:{n}: not a trace record")
            yield n, rec


def load_file(path: str | os.PathLike[str]) -> RankTrace:
    """Parse one rank's file; :class:`TraceFormatError` names the file and line if malformed."""
    p = Path(path)
    it = _lines(p)
    first = next(it, None)
    if first is None or first[1].get("type") != "header" or first[1].get("format") != FORMAT:
        raise TraceFormatError(f"{p}: not an asynccoll trace (expected a {FORMAT} header line)")
    h = first[1]
    rt = RankTrace(int(h["rank"]), int(h["world_size"]), p, h)
    for n, rec in it:
        t = rec["type"]
        if t == "flight":
            rt.flights.append(rec)
            continue
        if t == "clock":
            rt.clock_offset = float(rec.get("offset") or 0.0)
            continue
        if t not in ("schedule", "execution", "pending"):
            continue  # unknown record types are for newer readers
        sid = rec.get("sched_id")
        if not isinstance(sid, int):
            raise TraceFormatError(f"{p}:{n}: {t} record without an integer sched_id")
        if t == "schedule":
            rt.schedules[sid] = rec
        elif t == "execution":
            rt.executions.setdefault(sid, []).append(_expand(rec))
        else:
            if rec.get("record") is not None:
                rec["record"] = _expand(rec["record"])
            rt.pending.setdefault(sid, []).append(rec)
    return rt


def load_dir(directory: str | os.PathLike[str]) -> dict[int, RankTrace]:
    """Every rank file in ``directory``, by rank. :class:`TraceFormatError` if there is none or
    the files disagree on the world size (leftovers of another run)."""
    d = Path(directory)
    if not d.is_dir():
        raise TraceFormatError(f"trace directory {str(d)!r} does not exist")
    files = sorted(d.glob("rank-*.jsonl"))
    if not files:
        raise TraceFormatError(f"no rank-*.jsonl trace files in {str(d)!r}")
    out: dict[int, RankTrace] = {}
    for f in files:
        rt = load_file(f)
        out[rt.rank] = rt
    sizes = {rt.world_size for rt in out.values()}
    if len(sizes) > 1:
        raise TraceFormatError(
            f"{str(d)!r} mixes runs of world sizes {sorted(sizes)} (files "
            + ", ".join(f"{rt.path.name}: P={rt.world_size}" for rt in out.values())
            + "); trace each run into a fresh directory")
    return out
