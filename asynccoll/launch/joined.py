"""Tell the launcher when a restarted rank has joined, so that it says so in one line.

``asynccoll run`` says when a rank left ("rank 2 was killed by SIGKILL; restarting it") and when
it was restarted ("rank 2 restarted as pid N"); the third event of a restart, the members taking
the new process back, happens inside the job. A process restarted in a lost rank's place
(``ASYNCCOLL_RESTART=k``) sets the store key ``asynccoll/launch/joined/R/k`` once, when its
first admission ends (:func:`asynccoll.comm.joining.join`), to a line that says by whom, into
what and how long after its start; the launcher that restarted it waits on that key
(:func:`watch`) and prints ``rank R joined the job (restart k): ...``. Only under a launcher
(``ASYNCCOLL_STORE_HOSTED=1``: the store outlives the ranks); elsewhere nobody is told.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from ..errors import StoreError
from .store_client import StoreClient

__all__ = ["KEY", "Reporter", "watch"]

KEY = "asynccoll/launch/joined/"
log = logging.getLogger("asynccoll.launch")


class Reporter:
    """``reporter(text)``: report this process's first join to the store at ``store`` (host,
    port), once; call it on a loop that outlives the report (the communicator's runtime)."""

    def __init__(self, store: tuple[str, int], secret: bytes, rank: int, restart: int) -> None:
        self.store, self.secret, self.rank, self.restart = store, secret, rank, restart
        self.started = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def __call__(self, text: str) -> None:
        if self._task is None:
            took = time.monotonic() - self.started
            self._task = asyncio.get_running_loop().create_task(
                self._report(f"{text}, {took:.1f} s after its connect()"))

    async def _report(self, text: str) -> None:
        try:
            client = await StoreClient.connect(*self.store, self.secret, timeout=10.0)
            try:
                await client.set(f"{KEY}{self.rank}/{self.restart}", text.encode())
            finally:
                await client.close()
        except (OSError, StoreError) as exc:  # the launcher is gone: nobody left to tell
            log.info("rank %d: could not tell the launcher it joined: %s", self.rank, exc)


async def watch(store: tuple[str, int], secret: bytes, say: Callable[[str], None], rank: int,
                restart: int) -> None:
    """Say ``rank R joined the job (restart k): ...`` once the restarted process reports it;
    runs until then or until cancelled (one store connection, one blocked ``get``)."""
    try:
        client = await StoreClient.connect(*store, secret, timeout=30.0)
    except (OSError, StoreError):
        return  # the store is gone: the launcher says so on its own
    try:
        got = await client.get(f"{KEY}{rank}/{restart}", timeout=float(1 << 31))
        say(f"rank {rank} joined the job (restart {restart}): "
            f"{got.decode(errors='replace')}")
    except (OSError, StoreError):
        pass
    finally:
        with contextlib.suppress(Exception):
            await client.close()
