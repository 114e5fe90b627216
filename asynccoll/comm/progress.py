"""Where the runtime's event loop runs: a progress thread of its own, or the caller's loop.

External activations of partial collectives must be answered while the application computes,
so by default (:meth:`ProgressEngine.thread`) the runtime's loop runs in a daemon thread and the
application's awaitables bridge to it: one wake-up of the runtime's loop to start the task and
one of the caller's loop to hand back its outcome (a cancelled caller cancels the runtime's task
too). On the 2-core development machine the bridge cost 95-115 µs per round trip, almost all of
it the two wake-ups of sleeping threads; ``asyncio.run_coroutine_threadsafe`` with
``asyncio.wrap_future`` cost 125-145 µs in the same runs (``bench/sched_overhead.py``, case
``bridge``). Calls that can be answered at once do not cross at all (a partial call under rule
1: :mod:`.partial`). ``inline`` runs on the caller's loop instead, for code that never blocks it.

The progress thread runs uvloop when it is installed (a faster loop, for TCP in particular).

**At interpreter exit** every progress thread still running is stopped and joined (an
``atexit`` hook: its tasks cancelled, its loop stopped and closed, at most
:data:`EXIT_TIMEOUT` seconds each), as :meth:`ProgressEngine.close` does. A program that ends
without closing its communicator otherwise left a daemon thread inside its loop while the
interpreter tore down the modules that loop uses: measured, 4 of 10 such three-rank jobs had a
rank die of SIGSEGV at exit. Before that, the communicators left open close in order
(``asynccoll.comm.communicator._close_at_exit``), so the peers see goodbyes, not a lost rank.

**Process-wide side effect.** Starting a progress thread lowers the interpreter's switch interval
(``sys.setswitchinterval``, to 0.5 ms unless it is already lower; never raised, never restored):
this is the one piece of process-wide state asynccoll changes, and it affects every thread of the
process, not only the progress thread. It is done because, while the application runs pure-Python
code that holds the GIL, the progress thread gets the GIL back only after that interval. Pass
``switch_interval=None`` to :meth:`ProgressEngine.thread` to leave it alone. On a 2-core VM a
progress thread's round trip p50/p99 under a GIL-holding main thread measured 3.1/13.5 ms with
the default 5 ms and 0.84/2.2 ms with 0.5 ms; NumPy work that releases the GIL costs the thread
almost nothing.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from ..errors import TransportClosedError

__all__ = ["DEFAULT_SWITCH_INTERVAL", "EXIT_TIMEOUT", "ProgressEngine"]

T = TypeVar("T")

#: the switch interval a progress thread sets when the process's is larger (seconds).
DEFAULT_SWITCH_INTERVAL = 0.0005
#: at interpreter exit, how long stopping one progress thread may take (seconds)
EXIT_TIMEOUT = 2.0

#: the progress threads not closed yet (stopped at interpreter exit: module doc)
_RUNNING: weakref.WeakSet[ProgressEngine] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    for engine in list(_RUNNING):
        with contextlib.suppress(Exception):  # exiting: nobody is left to tell
            engine.close(EXIT_TIMEOUT)


class ProgressEngine:
    """An event loop that runs the runtime: in a thread of its own, or the caller's (inline).

    Create with :meth:`thread` or :meth:`inline`. Several communicators may share one engine
    (P ranks of one process must: in-process transports deliver on one loop); each holds a
    reference (:meth:`acquire`) and the last :meth:`release` stops the thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 thread: threading.Thread | None = None) -> None:
        self.loop = loop
        self._thread = thread
        self._refs = 0
        self._closed = False

    @property
    def thread_alive(self) -> bool:
        """Whether this engine's progress thread runs (False inline, after it stopped, and in
        a process forked from the one that started it)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def mode(self) -> str:
        """``"thread"`` or ``"inline"``."""
        return "inline" if self._thread is None else "thread"

    @classmethod
    def inline(cls, loop: asyncio.AbstractEventLoop | None = None) -> ProgressEngine:
        """An engine on ``loop`` (default: the running loop; ``RuntimeError`` if none runs)."""
        return cls(loop or asyncio.get_running_loop())

    @classmethod
    def thread(cls, *, use_uvloop: bool = True,
               switch_interval: float | None = DEFAULT_SWITCH_INTERVAL) -> ProgressEngine:
        """Start a daemon thread running a fresh loop; return once it runs.

        ``use_uvloop``: use uvloop when importable. ``switch_interval``: lower the process's
        ``sys.setswitchinterval`` to this (``None``: leave it). Costs a thread start (< 1 ms).
        """
        loop: asyncio.AbstractEventLoop | None = None
        if use_uvloop:
            try:
                import uvloop

                loop = uvloop.new_event_loop()
            except ImportError:
                loop = None
        if loop is None:
            loop = asyncio.new_event_loop()
        if switch_interval is not None and sys.getswitchinterval() > switch_interval:
            sys.setswitchinterval(switch_interval)
        started = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            try:
                loop.run_forever()
            finally:
                loop.close()

        t = threading.Thread(target=main, name="asynccoll-progress", daemon=True)
        t.start()
        started.wait()
        engine = cls(loop, t)
        _RUNNING.add(engine)
        return engine

    # -- sharing -----------------------------------------------------------------------------
    def acquire(self) -> ProgressEngine:
        """Count one more user; return self."""
        if self._closed:
            raise TransportClosedError("progress engine is closed")
        self._refs += 1
        return self

    def release(self) -> None:
        """Count one user less; the last one stops and joins the thread (a no-op inline)."""
        self._refs -= 1
        if self._refs <= 0:
            self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Cancel the loop's remaining tasks, stop it and join the thread (each step waits at
        most ``timeout`` seconds). Idempotent."""
        if self._closed:
            return
        self._closed = True
        _RUNNING.discard(self)
        t = self._thread
        if t is None or not t.is_alive():
            return
        if threading.current_thread() is t:
            raise RuntimeError("a progress engine cannot be closed from its own thread")

        async def cancel_rest() -> None:
            me = asyncio.current_task()
            rest = [task for task in asyncio.all_tasks() if task is not me]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_rest(), self.loop).result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            t.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- running things ----------------------------------------------------------------------
    def on_loop(self) -> bool:
        """True when called from the engine's loop (its thread, or inline: its running loop)."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    async def run(self, coro: Coroutine[Any, Any, T],
                  orphan: Callable[[T], None] | None = None) -> T:
        """Await ``coro`` on the engine's loop from any loop; cancellation propagates.

        ``orphan``: called (on the caller's loop) with the result of a ``coro`` that completed
        although its caller had been cancelled, so that what it took is not lost; a ``coro``
        given one runs its first step (up to its first wait) even when its caller was
        cancelled before it started, so that a partial call always deposits its data."""
        if self.on_loop():
            return await coro
        if self._thread is None:
            coro.close()
            raise RuntimeError("this communicator runs inline on another event loop; await it "
                               "there (or connect with progress='thread')")
        if self._closed:
            coro.close()
            raise TransportClosedError("progress engine is closed")
        return await _Bridge(coro, self.loop, asyncio.get_running_loop(), orphan).result()

    def run_blocking(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the progress thread and block until it is done (no loop needed).

        Raises ``RuntimeError`` inline or on the engine's own thread (it would deadlock).
        """
        if self._thread is None or threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking calls need progress='thread' and must not be made "
                               "from the progress thread itself")
        if self._closed:
            coro.close()
            raise TransportClosedError("progress engine is closed")
        cf = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return cf.result()
        except KeyboardInterrupt:
            cf.cancel()
            raise

    def call(self, fn: Callable[[], T]) -> T:
        """Run the plain function ``fn`` on the engine's loop (for objects bound to it).

        From the loop itself (or inline, with the loop running) it runs at once; from another
        thread it blocks until the loop has run it.
        """
        if self.on_loop() or self._thread is None:
            return fn()
        if self._closed:
            raise TransportClosedError("progress engine is closed")

        async def wrapper() -> T:
            return fn()

        cf: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(wrapper(), self.loop)
        return cf.result()


class _Bridge(Generic[T]):
    """One coroutine run on the runtime's loop for a caller on another loop.

    Exactly one wake-up each way: ``call_soon_threadsafe`` on the runtime's loop creates the
    task; the task's done callback hands its outcome to the caller's loop with one
    ``call_soon_threadsafe``. Cancelling the caller cancels the task, before or after it
    started (as ``wrap_future`` of ``run_coroutine_threadsafe`` does: the caller does not wait
    for the task to end).
    """

    __slots__ = ("_caller", "_cancelled", "_coro", "_done", "_loop", "_orphan", "_task")

    def __init__(self, coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop,
                 caller: asyncio.AbstractEventLoop,
                 orphan: Callable[[T], None] | None = None) -> None:
        self._coro = coro
        self._orphan = orphan
        self._loop = loop
        self._caller = caller
        self._done: asyncio.Future[T] = caller.create_future()
        self._task: asyncio.Task[T] | None = None
        self._cancelled = False
        loop.call_soon_threadsafe(self._start)

    def _start(self) -> None:  # on the runtime's loop
        if self._cancelled and self._orphan is None:
            self._coro.close()
            self._caller.call_soon_threadsafe(self._finish, None)
            return
        self._task = self._loop.create_task(self._coro)
        self._task.add_done_callback(self._ended)
        if self._cancelled:  # (a call that hands results back runs its first step: below)
            self._loop.call_soon(self._task.cancel)

    def _ended(self, task: asyncio.Task[T]) -> None:  # on the runtime's loop
        try:
            self._caller.call_soon_threadsafe(self._finish, task)
        except RuntimeError:  # the caller's loop is closed: nobody waits for the outcome
            # (the exception is retrieved, so asyncio does not log it as lost)
            if not task.cancelled() and task.exception() is None and self._orphan is not None:
                self._orphan(task.result())

    def _finish(self, task: asyncio.Task[T] | None) -> None:  # on the caller's loop
        done = self._done
        if done.done():  # the caller was cancelled: a result it never got goes back
            if (task is not None and not task.cancelled() and task.exception() is None
                    and self._orphan is not None):
                self._orphan(task.result())
            return
        if task is None or task.cancelled():
            done.cancel()
        elif (exc := task.exception()) is not None:
            done.set_exception(exc)
        else:
            done.set_result(task.result())

    def _cancel(self) -> None:  # on the runtime's loop
        self._cancelled = True
        if self._task is None:
            return
        if self._orphan is None:
            self._task.cancel()
        else:
            # after the task's first step, which _start queued before this ran: a call that
            # was cancelled has still deposited its data (a partial handle's promise)
            self._loop.call_soon(self._task.cancel)

    async def result(self) -> T:
        try:
            return await self._done
        except asyncio.CancelledError:
            done = self._done
            if done.done() and not done.cancelled():
                # the outcome arrived, but this caller was cancelled before it resumed
                if done.exception() is None and self._orphan is not None:
                    self._orphan(done.result())
                raise
            if not self._cancelled:
                try:
                    self._loop.call_soon_threadsafe(self._cancel)
                except RuntimeError:  # the runtime's loop is closed: nothing left to cancel
                    pass
            raise
