"""What tests/transport/test_tcp_rejoin.py and test_ucx_rejoin.py share: lose a rank of a
world of in-process transports, and a frame each way."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from asynccoll.errors import PeerLostError
from asynccoll.transport.frames import Kind


async def lose(ts: list[Any], victim: int) -> list[int]:
    """Close ``victim``'s transport; wait until every other one saw it lost."""
    seen: list[int] = []
    done = asyncio.Event()

    def on_lost(rank: int, exc: PeerLostError) -> None:
        seen.append(rank)
        if len(seen) == len(ts) - 1:
            done.set()

    for t in ts:
        if t.rank != victim:
            t.on_peer_lost(on_lost)
    await ts[victim].close()
    await asyncio.wait_for(done.wait(), 10)
    return seen


async def ping(a: Any, b: Any, execution: int, sched: int) -> bytes:
    """One frame from ``a`` to ``b`` (its payload depends on the rank and execution)."""
    data = np.arange(4, dtype=np.int64) + 100 * a.rank + execution
    fut = b.post_recv(a.rank, sched, execution, 0)
    a.post_frame(b.rank, int(Kind.DATA), sched, execution, 0, data.data.cast("B"))
    msg = await asyncio.wait_for(fut, 10)
    return bytes(msg.payload)
