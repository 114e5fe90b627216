"""Stall warnings: a collective that waits long says so, naming what it waits for, well before
its timeout (as Horovod's stall inspector does, on every waiting rank).

A wait logs a warning after ``warn_after`` seconds, then again after twice as long each time
(a long stall is not a log flood), until the call completes or its timeout expires. Each
warning names the ops still pending and the ranks they wait for, so the rank that is late or
stuck can be read off any rank's log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

__all__ = ["DEFAULT_STALL_WARN", "wait_or_warn"]

log = logging.getLogger("asynccoll.comm")

#: seconds a collective waits before its first stall warning (``ASYNCCOLL_STALL_WARN``)
DEFAULT_STALL_WARN = 10.0


async def wait_or_warn(fut: asyncio.Future[int], timeout: float | None,
                       warn_after: float | None, who: Callable[[], str],
                       pending: Callable[[], str]) -> None:
    """Await ``fut`` (shielded: a timeout leaves it running) for at most ``timeout`` seconds
    (``None``: forever); at ``warn_after`` seconds and then at doubling intervals (``None``:
    never) log that ``who()`` still waits, on ``pending()`` (both called only to warn: a call
    that does not stall formats nothing). Raises ``fut``'s error, or ``asyncio.TimeoutError``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = None if timeout is None else start + timeout
    interval = warn_after
    next_warn = None if interval is None else start + interval
    while True:
        ends = [x for x in (deadline, next_warn) if x is not None]
        limit = None if not ends else max(min(ends) - loop.time(), 0.0)
        try:
            await asyncio.wait_for(asyncio.shield(fut), limit)
            return
        except asyncio.TimeoutError:
            now = loop.time()
            if deadline is not None and now >= deadline:
                raise
            assert interval is not None
            left = "" if deadline is None else f", {deadline - now:.3g} s before its timeout"
            log.warning("%s: still waiting after %.3g s%s; waiting on: %s", who(),
                        now - start, left, pending())
            interval *= 2
            next_warn = now + interval

