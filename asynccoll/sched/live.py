"""The live-op registry: the executors of one owner, and a dump of what they wait on.

A :class:`LiveOps` is a value its owner passes down, not a process-wide table: a
:class:`~asynccoll.Communicator` owns one (``comm.live``), adds every executor it builds, and
installs :meth:`LiveOps.install_signal_handler` so that ``kill -USR1 PID`` (what ``asynccoll
inspect pending DIR --pid PID`` sends) prints :meth:`LiveOps.dump` to stderr and writes a
``pending`` snapshot of each waiting executor to its trace writer. Explaining the snapshots
(who never joined) is :mod:`asynccoll.inspect.pending`'s job.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from types import FrameType
from typing import IO, Any, Protocol

from .executor import Executor
from .flight import DEFAULT_FLIGHT, flight_entries, flight_text
from .tracefile import TraceWriter

__all__ = ["DumpSignal", "LiveOps", "Prober"]


class Prober(Protocol):
    """Asks the other ranks what they are doing (a communicator's membership does)."""

    async def probe(self, window: float) -> Mapping[int, list[dict[str, Any]] | None]:
        """Each other rank's :func:`~asynccoll.sched.waits.wait_status` of every executor it
        tracks, or ``None`` for a rank that did not answer within ``window`` seconds."""
        ...


class LiveOps:
    """Executors whose pending ops a dump lists, each with the trace writer (or ``None``) that
    receives its snapshot.

    Executors are held weakly: one that is dropped disappears. Thread-safe (a dump may run on
    another thread than the executors' loop); the lock is reentrant, so a signal handler that
    interrupts :meth:`add` on the same thread cannot deadlock. Adding costs a dict store.
    """

    def __init__(self) -> None:
        self._live: weakref.WeakKeyDictionary[Executor, TraceWriter | None] = \
            weakref.WeakKeyDictionary()
        self._lock = threading.RLock()
        #: who can ask the other ranks what they do (set by the owner's membership), or None
        self.prober: Prober | None = None

    def add(self, ex: Executor, writer: TraceWriter | None = None) -> Executor:
        """Track ``ex``; ``writer`` receives its snapshot on a :meth:`dump`. Returns ``ex``."""
        with self._lock:
            self._live[ex] = writer
        ex.live = self
        return ex

    def flight(self, n: int = DEFAULT_FLIGHT) -> list[dict[str, Any]]:
        """The flight record: the last ``n`` collectives of the tracked executors
        (:func:`~asynccoll.sched.flight.flight_entries`). O(executors x trace ring)."""
        return flight_entries(self.executors(), n)

    def record_flight(self, reason: str, n: int = DEFAULT_FLIGHT) -> tuple[str, bool]:
        """Take the flight record and write it as a ``flight`` line (with ``reason``) to every
        trace writer of the tracked executors; returns its text and whether any writer got
        it (without one, the caller should log the text)."""
        entries = self.flight(n)
        with self._lock:
            writers = {id(w): w for w in self._live.values() if w is not None}
        rank = None
        for ex in self.executors():
            rank = ex.schedule.rank
            break
        for w in writers.values():
            w.write({"type": "flight", "reason": reason, "time": time.time(),
                     "entries": entries})
        return flight_text(entries, rank), bool(writers)

    def statuses(self) -> list[dict[str, Any]]:
        """:meth:`Executor.status` of every tracked executor (what a probe answers). O(ops)
        per executor."""
        return [ex.status() for ex in self.executors()]

    def last_heard(self, peer: int) -> str:
        """When this rank last received from ``peer`` and in what, as words ("last heard
        from 2.1 s ago in allreduce (sched_id 3) execution 4"), or "never heard from"."""
        best: tuple[float, int, Executor] | None = None
        for ex in self.executors():
            h = ex.last_heard(peer)
            if h is not None and (best is None or h[0] > best[0]):
                best = (h[0], h[1], ex)
        if best is None:
            return "never heard from by this rank's collectives"
        t, e, ex = best
        return (f"last heard from {time.time() - t:.3g} s ago, in "
                f"{ex.schedule.name or 'schedule'} (sched_id {ex.sched_id}) execution {e}")

    def discard(self, ex: Executor) -> None:
        """Stop tracking ``ex`` (no error if it was not tracked)."""
        with self._lock:
            self._live.pop(ex, None)

    def _items(self) -> list[tuple[Executor, TraceWriter | None]]:
        with self._lock:
            items = list(self._live.items())
        return sorted(items, key=lambda kv: (kv[0].schedule.rank, kv[0].sched_id))

    def executors(self) -> list[Executor]:
        """The tracked executors, ordered by (rank, sched_id)."""
        return [ex for ex, _ in self._items()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def dump(self, stream: IO[str] | None = None, *, write_traces: bool = True) -> str:
        """Describe every pending op of every tracked executor, one line per op under a line
        per executor, then the flight record (:meth:`flight`); write a ``pending`` snapshot
        (reason ``"dump"``) of each executor with pending ops and a ``flight`` record to the
        writers unless ``write_traces`` is false. Returns the text, and
        writes it to ``stream`` if given. Costs O(ops) per executor."""
        lines = []
        for ex, writer in self._items():
            s = ex.schedule
            head = (f"rank {s.rank} {s.name or 'schedule'} (sched_id {ex.sched_id}) execution "
                    f"{ex.execution}")
            pend = [] if ex.test() else ex.pending()
            if not pend:
                lines.append(f"{head}: nothing pending (last completed {ex.completed})")
                continue
            lines.append(f"{head}: pending")
            lines.extend(f"  {d}" for _, _, d in pend)
            if write_traces and writer is not None:
                writer.write_pending(ex, reason="dump")
        text = "\n".join(lines or ["no live executors"]) + "\n"
        if lines:
            text += (self.record_flight("dump")[0] if write_traces
                     else flight_text(self.flight()))
        if stream is not None:
            stream.write(text)
            stream.flush()
        return text

    def install_signal_handler(self, signum: int | None = None, *, stream: IO[str] | None = None,
                               loop: asyncio.AbstractEventLoop | None = None) -> DumpSignal:
        """On ``signum`` (default ``SIGUSR1``), :meth:`dump` to ``stream`` (default: stderr at
        the time of the signal). See :class:`DumpSignal`; call its ``restore()`` when done.

        Raises ``ValueError`` off the main thread (only it may install signal handlers) and
        ``AttributeError`` where the platform has no ``SIGUSR1`` (Windows).
        """
        return DumpSignal(self, signal.SIGUSR1 if signum is None else signum, stream, loop)


class DumpSignal:
    """An installed signal handler that dumps a :class:`LiveOps`.

    With ``loop`` (the loop the executors run on) the handler only schedules the dump there
    (``call_soon_threadsafe``), so it reads a consistent state and never re-enters a trace
    writer the signal interrupted; the dump then waits for that loop, which a progress thread
    runs at once (a loop blocked by the application runs it when it gets back). Without
    ``loop``, or when that loop no longer runs, the handler dumps at once. The handler that was
    installed before is called after it when it is a Python callable, so several owners in one
    process (ranks of an in-process world) all dump.
    """

    def __init__(self, live: LiveOps, signum: int, stream: IO[str] | None,
                 loop: asyncio.AbstractEventLoop | None) -> None:
        self.live = live
        self.signum = signum
        self._stream = stream
        self._loop = loop
        self._active = True
        self._handler = self._handle  # one bound method, to recognise it when restoring
        self.previous: Any = signal.signal(signum, self._handler)

    def _dump(self) -> None:
        self.live.dump(self._stream or sys.stderr)

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        if not self._active:
            if self._uninstall():  # restored off the main thread; handlers run on it
                signal.raise_signal(sig)  # to the handler put back (SIG_DFL: terminate)
                return
        else:
            loop = self._loop
            if loop is not None and loop.is_running():
                try:
                    loop.call_soon_threadsafe(self._dump)
                except RuntimeError:  # closed in the meantime
                    self._dump()
            else:
                self._dump()
        if callable(self.previous):
            self.previous(sig, frame)

    def restore(self) -> None:
        """Stop dumping and reinstall the handler found at install (passing over those of
        owners already closed). Off the main thread (a blocking close runs on the progress
        thread), or while a handler installed later sits on top of this one, it stays
        installed and only forwards to the previous handler; if it is still the installed
        one when the next signal arrives (handled on the main thread), it reinstalls the
        previous handler then and re-raises the signal to it. Idempotent."""
        if self._active:
            self._active = False
            self._uninstall()

    def _uninstall(self) -> bool:
        if threading.current_thread() is not threading.main_thread() \
                or signal.getsignal(self.signum) is not self._handler:
            return False
        prev = self.previous
        # Skip handlers of owners closed out of order, down to one still in use.
        while isinstance(owner := getattr(prev, "__self__", None), DumpSignal) \
                and not owner._active:
            prev = owner.previous
        signal.signal(self.signum, signal.SIG_DFL if prev is None else prev)
        return True
