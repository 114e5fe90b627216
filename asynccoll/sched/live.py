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
import weakref
from types import FrameType
from typing import IO, Any

from .executor import Executor
from .tracefile import TraceWriter

__all__ = ["DumpSignal", "LiveOps"]


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

    def add(self, ex: Executor, writer: TraceWriter | None = None) -> Executor:
        """Track ``ex``; ``writer`` receives its snapshot on a :meth:`dump`. Returns ``ex``."""
        with self._lock:
            self._live[ex] = writer
        return ex

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
        per executor; write a ``pending`` snapshot (reason ``"dump"``) of each executor with
        pending ops to its writer unless ``write_traces`` is false. Returns the text, and
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
