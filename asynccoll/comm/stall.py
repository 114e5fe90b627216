"""Stall warnings: a collective that waits long says so, naming the rank(s) actually absent and
what they were last seen doing, well before its timeout (as Horovod's stall inspector does, on
every waiting rank).

A wait logs a warning after ``warn_after`` seconds, then again after twice as long each time
(a long stall is not a log flood), until the call completes or its timeout expires. To name
the absent rank, not merely the neighbour this rank's message comes from, the warning asks
every other rank what it waits for (:meth:`~asynccoll.comm.membership.Membership.probe`,
:data:`PROBE_WINDOW` seconds, or half the interval if shorter, before the warning is due, so
the warning still comes on time) and follows the chain of waits: a rank that does not answer
(stopped, its loop blocked, gone) or that has not called the execution is **absent**; one
that answers and waits for another is followed to whom it waits for. The explanation is kept
on the executor (:attr:`~asynccoll.sched.Executor.note`), so the timeout that follows fails
with the same content. Each warning reads ``...; absent rank(s) [3]: rank 3 not responding
(last heard from ...)``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..sched import Executor
from ..sched.waits import diagnose

__all__ = ["DEFAULT_STALL_WARN", "PROBE_WINDOW", "explain_wait", "wait_or_warn"]

log = logging.getLogger("asynccoll.comm")

#: seconds a collective waits before its first stall warning (``ASYNCCOLL_STALL_WARN``)
DEFAULT_STALL_WARN = 10.0
#: seconds a stall warning waits for the other ranks' answers
PROBE_WINDOW = 0.5


def _executor_of(pending: Callable[[], str] | Executor) -> Executor | None:
    if isinstance(pending, Executor):
        return pending
    owner = getattr(pending, "__self__", None)  # ex.pending_text, as the call sites pass it
    return owner if isinstance(owner, Executor) else None


async def wait_or_warn(fut: asyncio.Future[int], timeout: float | None,
                       warn_after: float | None, who: Callable[[], str],
                       pending: Callable[[], str] | Executor) -> None:
    """Await ``fut`` (shielded: a timeout leaves it running) for at most ``timeout`` seconds
    (``None``: forever); at ``warn_after`` seconds and then at doubling intervals (``None``:
    never) log that ``who()`` still waits, and on what. ``pending``: the executor waited on
    (or its ``pending_text``), whose execution is then explained by :func:`explain_wait`
    (asking the other ranks), or any callable giving the text. Nothing is formatted or asked
    unless the call stalls. Raises ``fut``'s error, or ``asyncio.TimeoutError`` (the
    executor's :attr:`~asynccoll.sched.Executor.note` then holds the explanation, refreshed
    at the deadline when no warning explained this execution yet, and the flight record of
    the executor's :class:`~asynccoll.sched.LiveOps` is written to its trace files, or
    logged when it has none)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = None if timeout is None else start + timeout
    interval = warn_after
    next_warn = None if interval is None else start + interval
    ex = _executor_of(pending)
    if ex is not None:
        # Kept after a timeout too: the call's data waits for this execution, and a snapshot
        # written after the timeout must say this rank called it.
        ex.called = ex.execution
        ex.called_at = time.time()
    while True:
        # The other ranks are asked shortly before a warning is due, so it comes on time.
        ask = None if next_warn is None or interval is None else \
            next_warn - min(PROBE_WINDOW, interval / 2)
        ends = [x for x in (deadline, ask) if x is not None]
        limit = None if not ends else max(min(ends) - loop.time(), 0.0)
        # which one is due is decided here: the loop may fire a timer a clock tick early
        at_deadline = deadline is not None and (ask is None or deadline <= ask)
        try:
            await asyncio.wait_for(asyncio.shield(fut), limit)
            return
        except asyncio.TimeoutError:
            now = loop.time()
            if at_deadline:
                if ex is not None and not fut.done():
                    if ex.note is None or ex.note[0] != ex.execution:
                        await explain_wait(ex, min(PROBE_WINDOW, timeout or PROBE_WINDOW))
                        if fut.done():  # completed while the others answered
                            await fut
                            return
                    _record_flight(ex, who)
                raise
            assert interval is not None
            assert next_warn is not None
            due = next_warn if deadline is None else min(next_warn, deadline)
            text = await explain_wait(ex, max(due - now, 0.0)) if ex is not None \
                else pending() if callable(pending) else ""
            rest = due - loop.time()
            if rest > 0 and not fut.done():  # the answers came early: warn when due
                try:
                    await asyncio.wait_for(asyncio.shield(fut), rest)
                    return
                except asyncio.TimeoutError:
                    pass
            if fut.done():
                continue  # it completed while the others answered: nothing to warn of
            now = loop.time()
            left = "" if deadline is None else f", {deadline - now:.3g} s before its timeout"
            log.warning("%s: still waiting after %.3g s%s; waiting on: %s", who(),
                        now - start, left, text)
            interval *= 2
            next_warn = now + interval


def _record_flight(ex: Executor, who: Callable[[], str]) -> None:
    """On a timeout: the flight record into the trace files, or the log when none."""
    live = ex.live
    if live is None:
        return
    what = who()
    if "execution" not in what:
        what += f" execution {ex.execution}"
    text, written = live.record_flight(f"timeout: {what}")
    if not written:
        log.warning("%s: timed out; %s", who(), text.rstrip())


async def explain_wait(ex: Executor, window: float = PROBE_WINDOW) -> str:
    """Why ``ex``'s current execution has not completed, in one line, asking the other ranks
    (for at most ``window`` seconds) when its :class:`~asynccoll.sched.LiveOps` has a prober;
    kept as ``ex.note`` for the timeout's message. Runs on the executor's loop."""
    e = ex.execution
    local = ex.status()
    prober = None if ex.live is None else ex.live.prober
    if prober is None or ex.schedule.world_size == 1:
        text = str(local["text"])
    else:
        try:
            answers = await prober.probe(window)
        except Exception as exc:  # closing, say: explain from what this rank sees
            log.debug("status probe failed: %r", exc)
            text = f"{local['text']} (the other ranks could not be asked: {exc!r})"
            ex.note = (e, text)
            return text
        if ex.execution != e:
            return f"execution {e} completed"
        text = diagnose(ex.schedule.rank, local, answers,
                        ex.live.last_heard if ex.live is not None else None)
    ex.note = (e, text)
    return text
