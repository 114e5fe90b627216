"""Writing execution traces to disk: one JSON-lines file per rank in a directory.

A run traces into ``DIR`` when asked (``ASYNCCOLL_TRACE=DIR`` or ``connect(trace=DIR)``); rank
``R`` writes ``DIR/rank-R.jsonl`` (truncated when opened) with a :class:`TraceWriter`. Every line
is one JSON object with a ``type``:

- ``header``: ``format`` (``"asynccoll.trace/1"``), ``rank``, ``world_size``, ``pid``, ``host``,
  ``clock`` (timestamps are ``time.time()`` seconds, comparable across the ranks of one host);
- ``schedule``: ``sched_id``, ``name`` and the committed schedule's ``to_dict()`` under
  ``schedule``, plus metadata the caller gives (``collective``, ``kind``, ...);
- ``execution``: ``sched_id`` and the executor's :meth:`Trace.record
  <asynccoll.sched.Trace.record>` of one completed execution (``execution``, ``armed``,
  ``started``, ``completed``, ``activation``) plus what the caller put in ``Trace.extra``
  (``initiator``, ``contributors``, ``missed``, ...); per op, ``ops_us`` rows of [posted, fired,
  completed, bytes], times in integer µs after ``armed`` (-1: did not happen). The reader
  (:func:`asynccoll.inspect.tracefile.load_dir`) turns them back into ``ops`` rows of absolute
  seconds (``None``: did not happen), as ``Trace.record`` has them;
- ``pending``: a snapshot of an execution that has not completed: ``sched_id``, ``execution``,
  ``time``, ``reason``, ``pending`` ([rank, op, description] rows) and ``record`` (the partial
  record, or ``null`` when the execution was never armed on this rank).

Each record is written as one line. Execution records are flushed at most ``flush_interval``
seconds late (0.2 s); headers, schedules and pending snapshots at once, and a snapshot flushes
everything before it, so a hung run's file explains the hang. Writing costs one ``json.dumps``
and one buffered ``write`` per execution (about 1 µs per op on the development machine, on top
of the executor's ``Trace.record``). Reading, summarising and explaining traces is
:mod:`asynccoll.inspect`'s job.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .executor import Executor
from .schedule import Schedule

__all__ = ["FORMAT", "TraceWriter", "compact_record", "live_record", "pending_snapshot",
           "trace_path"]

FORMAT = "asynccoll.trace/1"


def trace_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """The file rank ``rank`` writes in ``directory``."""
    return Path(directory) / f"rank-{rank}.jsonl"


class TraceWriter:
    """Writes one rank's trace file. Thread-safe; use one per rank and close it.

    Typical use, for each executor a rank creates::

        w = TraceWriter(trace_dir, rank, world_size)
        ex = Executor(sched, transport, bufs, sched_id=sid,
                      trace_sink=w.add_schedule(sched, sid, collective="solo_allreduce"))

    Raises ``OSError`` if the directory cannot be created or the file opened.
    """

    def __init__(self, directory: str | os.PathLike[str], rank: int, world_size: int, *,
                 flush_interval: float = 0.2) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1} and world_size >= 1, got "
                             f"rank={rank}, world_size={world_size}")
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = trace_path(directory, rank)
        self.rank = rank
        self.world_size = world_size
        self.flush_interval = flush_interval
        self._flushed = time.monotonic()
        # Reentrant: a dump on a signal may interrupt a write on the same thread.
        self._lock = threading.RLock()
        self._f: IO[str] | None = open(self.path, "w", encoding="utf-8")
        self.write({"type": "header", "format": FORMAT, "rank": rank, "world_size": world_size,
                    "pid": os.getpid(), "host": socket.gethostname(), "clock": "time.time",
                    "opened": time.time()})

    def write(self, record: dict[str, Any], *, flush: bool = True) -> None:
        """Append one record as a line (no-op once closed). ``flush=False``: flush only if the
        last flush is older than ``flush_interval`` seconds (the file stays readable)."""
        line = json.dumps(record, separators=(",", ":"), default=_jsonable) + "\n"
        with self._lock:
            if self._f is None:
                return
            self._f.write(line)
            now = time.monotonic()
            if flush or now - self._flushed > self.flush_interval:
                self._f.flush()
                self._flushed = now

    def add_schedule(self, schedule: Schedule, sched_id: int,
                     **meta: Any) -> Callable[[dict[str, Any]], None]:
        """Record ``schedule`` under ``sched_id``; return the ``trace_sink`` for its executor.

        ``meta`` (e.g. ``collective="majority_allreduce", kind="majority"``) is stored with it.
        """
        self.write({"type": "schedule", "sched_id": sched_id, "name": schedule.name,
                    "schedule": schedule.to_dict(), **meta})

        def sink(record: dict[str, Any]) -> None:
            self.write({"type": "execution", "sched_id": sched_id, **compact_record(record)},
                       flush=False)

        return sink

    def write_pending(self, executor: Executor, reason: str = "") -> dict[str, Any]:
        """Snapshot ``executor``'s current, incomplete execution (for a timeout or a dump);
        returns the snapshot as :func:`pending_snapshot` makes it."""
        snap = {**pending_snapshot(executor), "time": time.time(), "reason": reason}
        rec = snap["record"]
        self.write({**snap, "record": None if rec is None else compact_record(rec)})
        return snap

    def close(self) -> None:
        """Close the file; later writes are dropped. Idempotent."""
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def live_record(ex: Executor) -> dict[str, Any] | None:
    """The trace record of ``ex``'s current execution so far; ``None`` if it is not armed.

    :meth:`Trace.record <asynccoll.sched.Trace.record>` reads a running execution's live
    columns, so this is the record as it stands when called.
    """
    try:
        return ex.trace.record(ex.execution)
    except KeyError:
        return None  # never armed here: this rank has not joined the execution


def pending_snapshot(ex: Executor) -> dict[str, Any]:
    """The ``pending`` record of ``ex``'s current execution, in memory (``ops`` in absolute
    seconds): ``type``, ``sched_id``, ``execution``, ``pending`` rows (the first, op id -1,
    about the execution as a whole), ``status`` (:meth:`Executor.status`: what it waits for,
    as data) and ``record``."""
    return {"type": "pending", "sched_id": ex.sched_id, "execution": ex.execution,
            "pending": [list(p) for p in ex.pending()], "status": ex.status(),
            "record": live_record(ex)}


def compact_record(rec: dict[str, Any]) -> dict[str, Any]:
    """``ops`` (absolute seconds) -> ``ops_us`` (integer µs after ``armed``, -1: not yet):
    a third of the bytes and half the encoding time of the floats."""
    base, ops = rec.get("armed"), rec.get("ops")
    if base is None or ops is None:
        return rec
    out = {k: v for k, v in rec.items() if k != "ops"}
    # inline arithmetic: this runs once per op of every traced execution
    out["ops_us"] = [[-1 if a is None else int((a - base) * 1e6 + 0.5),
                      -1 if b is None else int((b - base) * 1e6 + 0.5),
                      -1 if c is None else int((c - base) * 1e6 + 0.5), n] for a, b, c, n in ops]
    return out


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (set, frozenset, tuple)):
        return sorted(x) if isinstance(x, (set, frozenset)) else list(x)
    if isinstance(x, float) and math.isnan(x):
        return None
    raise TypeError(f"cannot write {type(x).__name__} to a trace")
