"""Clock offsets between ranks, estimated once at connect, so that arrival times compare.

Arrival stamps (``PartialResult.arrivals``, ``lateness``) and trace times are each rank's
``time.time()``. Ranks of one host share that clock; across hosts the clocks differ by
whatever their synchronisation left (milliseconds with NTP, more without), which would show up
as lateness. So :func:`~asynccoll.connect` estimates each rank's offset to rank 0's clock, as
NTP does: rank r sends rank 0 a ping at its time t0, rank 0 answers with its own time t1, the
answer arrives at r's time t2; then ``t1 - (t0 + t2) / 2`` is the offset, exact when the two
legs take the same time and off by at most half the round trip otherwise. Of ``rounds``
pings, the one with the shortest round trip wins. Rank 0 answers every rank at once; each rank
pings in turn. Costs ``rounds`` round trips per rank, once (a few milliseconds on a LAN).

Every rank then adds its offset to the times it stamps arrivals with (so the stamps of all
ranks are in rank 0's clock) and records it in its trace (a ``clock`` record, which
``asynccoll inspect`` applies). Groups inherit their parent's offset.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from ..errors import ProtocolError
from ..transport.base import Transport
from ..transport.frames import Kind
from ..transport.matching import ignore_outcome
from .membership import CLOSE_SCHED

__all__ = ["CLOCK_ASK", "CLOCK_ANSWER", "estimate_offset", "now"]

#: the channels of the clock exchange (execution = the ping's number): pings to rank 0, and
#: its answers (float64 seconds)
CLOCK_ASK = CLOSE_SCHED + 7
CLOCK_ANSWER = CLOSE_SCHED + 8


def now() -> float:
    """This rank's wall clock (``time.time()``): what arrivals are stamped with, before the
    offset is added."""
    return time.time()


async def estimate_offset(transport: Transport, rounds: int = 8,
                          timeout: float = 30.0, first: int = 0) -> float:
    """This rank's clock offset to rank 0's (seconds to add to :func:`now`), 0 for rank 0 and
    for one rank. Collective: every rank calls it once, on the transport's loop; ``first``
    numbers its pings (``first .. first + rounds - 1``: a later exchange over the same
    transport starts past them). Raises ``ValueError`` naming ``rounds`` unless in
    1..65535, ``TimeoutError`` after ``timeout``."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds < 1 << 16:
        raise ValueError(f"rounds must be an int in 1..65535, got {rounds!r}")
    t = transport
    if t.world_size == 1:
        return 0.0
    return await asyncio.wait_for(_serve(t, rounds, first) if t.rank == 0
                                  else _ping(t, rounds, first), timeout)


async def _serve(t: Transport, rounds: int, first: int) -> float:
    async def answer(r: int) -> None:
        for i in range(first, first + rounds):
            await t.post_recv(r, CLOCK_ASK, i, 0)
            stamp = np.array([now()], np.float64)
            t.post_frame(r, int(Kind.DATA), CLOCK_ANSWER, i, 0,
                         stamp.data.cast("B")).add_done_callback(ignore_outcome)

    await asyncio.gather(*(answer(r) for r in range(1, t.world_size)))
    return 0.0


async def _ping(t: Transport, rounds: int, first: int) -> float:
    best: tuple[float, float] | None = None  # (round trip, offset)
    nothing = memoryview(b"")
    for i in range(first, first + rounds):
        reply = t.post_recv(0, CLOCK_ANSWER, i, 0)
        t0 = now()
        t.post_frame(0, int(Kind.DATA), CLOCK_ASK, i, 0, nothing
                     ).add_done_callback(ignore_outcome)
        msg = await reply
        t2 = now()
        if len(msg.payload) != 8:
            raise ProtocolError(f"a clock answer of {len(msg.payload)} bytes (not a float64)")
        t1 = float(np.frombuffer(msg.payload, np.float64)[0])
        sample = (t2 - t0, t1 - (t0 + t2) / 2)
        if best is None or sample[0] < best[0]:
            best = sample
    assert best is not None
    return best[1]
