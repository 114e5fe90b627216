"""Tell the launcher which rank stopped answering, so that it kills the process and names it.

A rank that drops a peer for silence (:class:`~asynccoll.transport.liveness.SilentPeerError`)
sets the store key ``asynccoll/launch/unresponsive/R`` (R: the silent rank; the value says who
saw it and how long it was silent). Each ``asynccoll run`` launcher waits on the keys of its own
ranks (:func:`watch`) and kills a rank named there: a stopped process (``SIGSTOP``) would
otherwise never exit, and the launcher would wait for it forever although the job went on
without it (``--max-failures``) or failed because of it. Only under a launcher
(``ASYNCCOLL_STORE_HOSTED=1``: the store outlives the ranks); elsewhere nobody is told.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from ..errors import PeerLostError, StoreError
from .store_client import StoreClient

__all__ = ["KEY", "Reporter", "watch"]

KEY = "asynccoll/launch/unresponsive/"
log = logging.getLogger("asynccoll.launch")


class Reporter:
    """A loss listener (``transport.on_peer_lost(reporter)``) that reports silent peers to the
    store at ``store`` (host, port); called on the transport's loop. Each report opens one
    store connection for a moment; the other losses cost nothing."""

    def __init__(self, store: tuple[str, int], secret: bytes, rank: int) -> None:
        self.store = store
        self.secret = secret
        self.rank = rank
        self._tasks: set[asyncio.Task[None]] = set()

    def __call__(self, rank: int, exc: PeerLostError) -> None:
        from ..transport.liveness import SilentPeerError  # not at the top: the launcher
        # imports this module and needs no transport (nor NumPy)

        if not isinstance(exc, SilentPeerError):
            return
        task = asyncio.get_running_loop().create_task(self._report(rank, exc.reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report(self, rank: int, reason: str) -> None:
        try:
            client = await StoreClient.connect(*self.store, self.secret, timeout=10.0)
            try:
                await client.set(f"{KEY}{rank}", f"rank {self.rank} saw it: {reason}".encode())
            finally:
                await client.close()
        except (OSError, StoreError) as exc:  # the launcher is gone: nobody left to tell
            log.info("rank %d: could not report silent rank %d to the launcher: %s",
                     self.rank, rank, exc)


async def watch(store: tuple[str, int], secret: bytes, ranks: Iterable[int],
                on_silent: Callable[[int, str], None]) -> None:
    """Call ``on_silent(rank, why)`` for each of ``ranks`` reported silent; runs until
    cancelled (one store connection and one blocked ``get`` per rank)."""
    client = await StoreClient.connect(*store, secret, timeout=30.0)
    gets = {asyncio.ensure_future(client.get(f"{KEY}{r}", timeout=float(1 << 31))): r
            for r in ranks}
    try:
        while gets:
            done, _ = await asyncio.wait(gets, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                rank = gets.pop(fut)
                if not fut.cancelled() and fut.exception() is None:
                    on_silent(rank, fut.result().decode(errors="replace"))
    finally:
        for fut in gets:
            fut.cancel()
        await asyncio.gather(*gets, return_exceptions=True)
        with contextlib.suppress(Exception):
            await client.close()
