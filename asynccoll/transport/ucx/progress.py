"""The progress engine of ``ucx://``: one UCX worker driven from an asyncio loop.

Nothing here imports ``ucxx``: the worker and its requests arrive as objects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["WATCHDOG_S", "Callback", "Progress"]

WATCHDOG_S = 0.5

#: what :meth:`Progress.watch` calls when a request completes: with ``None``, or the UCX error
Callback = Callable[[BaseException | None], None]


class Progress:
    """Drives one UCX worker from an asyncio loop, without threads and without polling.

    The worker's wake-up descriptor is registered with the loop; on an event, and soon after
    new operations are posted (:meth:`kick`), the worker is progressed until it can be re-armed
    (yielding to the loop every few rounds while UCX stays busy, so that other workers on the
    loop can drain what this one waits for) and finished requests are reaped.
    ``watch(req, cb)`` calls ``cb(None)`` once ``req`` completes, or ``cb(exc)`` with the UCX
    error. Costs O(pending requests) per wake-up; an
    idle worker costs a watchdog wake-up every :data:`WATCHDOG_S` seconds (ucxx documents that a
    wake-up can be missed).
    """

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.loop = loop
        worker.init_blocking_progress_mode()
        self.fd: int = worker.epoll_file_descriptor
        self.pending: list[tuple[Any, Callback]] = []
        self.scheduled = False
        self.stopped = False
        loop.add_reader(self.fd, self.run)
        self.watchdog = loop.call_later(WATCHDOG_S, self._tick)

    def watch(self, req: Any, cb: Callback) -> None:
        self.pending.append((req, cb))
        self.kick()

    def kick(self) -> None:
        """Progress soon (after the current callback): new operations were posted."""
        if not self.scheduled and not self.stopped:
            self.scheduled = True
            self.loop.call_soon(self.run)

    def run(self) -> None:
        self.scheduled = False
        if self.stopped:
            return
        w = self.worker
        for _ in range(4):
            w.progress()
            if self.pending:
                self._reap()
            # Re-arm only when UCX has nothing left to do; otherwise its wake-up could be lost.
            if self.stopped or w.arm():
                return
        # UCX is still busy (waiting for room in a shared-memory queue, say, that another
        # worker of this loop must drain): let the loop's other callbacks run, then go on.
        self.kick()

    def _reap(self) -> None:
        keep: list[tuple[Any, Callback]] = []
        done: list[tuple[Any, Callback]] = []
        for item in self.pending:
            (done if item[0].completed else keep).append(item)
        if not done:
            return
        self.pending = keep
        for req, cb in done:
            try:
                req.check_error()
            except Exception as exc:  # the ucxx error hierarchy, mapped by the callback
                cb(exc)
            else:
                cb(None)

    def _tick(self) -> None:
        if not self.stopped:
            self.run()
            self.watchdog = self.loop.call_later(WATCHDOG_S, self._tick)

    def fail_all(self, exc: BaseException) -> None:
        """Give every pending callback ``exc`` and forget the requests."""
        pending, self.pending = self.pending, []
        for _req, cb in pending:
            cb(exc)

    def stop(self, exc: BaseException) -> None:
        """Stop driving the worker; every pending callback gets ``exc``."""
        if self.stopped:
            return
        self.stopped = True
        self.watchdog.cancel()
        self.loop.remove_reader(self.fd)
        self.fail_all(exc)
