"""Liveness: a peer from which nothing arrives for a set time is lost, as if its connection broke.

A stopped process (``SIGSTOP``, a hung host, a frozen VM) keeps its TCP connections open, so no
transport sees it fail; without this, every rank would wait for it until the collective timeout.
:class:`Liveness` runs on the transport's loop, which is the progress thread's loop under
:func:`asynccoll.connect`: every ``seconds / PROBES`` it sends each peer a **probe**, an empty
control frame on :data:`LIVENESS_SCHED`, and checks which peers it heard from since its last
look. Any frame counts as an answer (a peer busy streaming a large payload is alive), and so does
the probe each peer sends us. A peer silent for ``seconds`` is dropped through the transport's
own path for a broken connection (:class:`SilentPeerError`, a :class:`PeerLostError`): its
operations fail, the loss listeners hear of it, the communicator tells the other ranks.

Because the progress thread sends and reads the probes, a rank whose main thread computes for
long with the GIL released, or sleeps, is never lost; a garbage-collection pause or a main thread
that holds the GIL delays the probes by at most the interpreter's switch interval (0.5 ms in a
progress thread's process). A look that comes late because this rank's own loop was held up (by
more than two probe intervals) counts nobody's silence, so a stall here never blames the peers.
With ``progress="inline"``, the application's loop sends the probes: a coroutine that blocks it
for longer than ``seconds`` gets its rank dropped by the others.

Costs: one timer wake-up per probe interval and one small frame per peer (P - 1 frames of about
30 bytes every ``seconds / 5``); one set insertion per inbound frame
(:meth:`~.matching.Matcher.heard`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from ..errors import PeerLostError
from .frames import LIVENESS_SCHED, Kind
from .matching import Matcher, ignore_outcome


class Transport(Protocol):
    """What the probes use of a :class:`~.base.Transport` (named by shape: the transport
    imports this module)."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def matcher(self) -> Matcher: ...
    def post_frame(self, dst: int, kind: int, sched: int, execution: int, tag: int,
                   payload: Any) -> asyncio.Future[None]: ...
    def drop_peer(self, rank: int, exc: PeerLostError) -> None: ...

__all__ = ["LIVENESS_SCHED", "PROBES", "Liveness", "SilentPeerError"]

#: probes per liveness time: a silent peer is dropped between ``seconds`` and ``seconds *
#: (1 + 1 / PROBES)`` after its last frame
PROBES = 5
_EMPTY = memoryview(b"")


class SilentPeerError(PeerLostError):
    """A peer sent nothing, not even a liveness probe, for the liveness time: stopped or hung."""

    def __init__(self, rank: int, silent: float, seconds: float) -> None:
        super().__init__(rank, f"answered no liveness probe for {silent:.1f} s (the liveness "
                               f"time is {seconds:g} s, ASYNCCOLL_LIVENESS)")
        self.silent = silent
        self.seconds = seconds


class Liveness:
    """Probes the peers of ``transport`` and drops those silent for ``seconds`` (module doc).

    Create on the transport's loop, after it connected; :meth:`stop` (the transport's
    ``close`` calls it) cancels the timer.
    """

    def __init__(self, transport: Transport, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"liveness seconds must be > 0, got {seconds!r}")
        self.transport = transport
        self.seconds = float(seconds)
        self.interval = self.seconds / PROBES
        self._loop = asyncio.get_running_loop()
        self._silent = [0.0] * transport.world_size
        self._last = self._loop.time()
        self._handle: asyncio.TimerHandle | None = None
        self._probe()
        self._handle = self._loop.call_later(self.interval, self._tick)

    def stop(self) -> None:
        """Stop probing. Idempotent."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _probe(self) -> None:
        t = self.transport
        for r in range(t.world_size):
            if r != t.rank and not t.matcher.is_lost(r):
                t.post_frame(r, int(Kind.CONTROL), LIVENESS_SCHED, 0, 0,
                             _EMPTY).add_done_callback(ignore_outcome)

    def _tick(self) -> None:
        t = self.transport
        if t.closed:
            self._handle = None
            return
        now = self._loop.time()
        elapsed, self._last = now - self._last, now
        heard = t.matcher.heard()
        # our own loop was held up: what the peers sent meanwhile is not read yet
        stalled = elapsed > 2 * self.interval
        for r in range(t.world_size):
            if r == t.rank:
                continue
            if r in heard or stalled or t.matcher.is_lost(r):
                # (a lost rank's count starts afresh: a process that takes its place later,
                # :meth:`~.base.Transport.on_peer_joined`, is not dropped for the old one's
                # silence)
                self._silent[r] = 0.0
                continue
            self._silent[r] += elapsed
            if self._silent[r] >= self.seconds:
                t.drop_peer(r, SilentPeerError(r, self._silent[r], self.seconds))
        self._probe()
        self._handle = self._loop.call_later(self.interval, self._tick)
