"""Tell the launcher when a restarted rank has joined, so that it says so in one line.

``asynccoll run`` says when a rank left ("rank 2 was killed by SIGKILL; restarting it") and when
it was restarted ("rank 2 restarted as pid N"); the third event of a restart, the members taking
the new process back, happens inside the job. A process restarted in a lost rank's place
(``ASYNCCOLL_RESTART=k``) sets the store key ``asynccoll/launch/joined/R/k`` once, when its
first admission ends (:func:`asynccoll.comm.joining.join`), to a line that says by whom, into
what and how long after its start; the launcher that restarted it waits on that key
(:func:`watch`) and prints ``rank R joined the job (restart k): ...``. A restarted process that
the members never take back because the job ended first (they closed, or all of them are gone,
while it waited) sets the key too, to :data:`ENDED` and why, before its join raises: the
launcher then says so and does not count its exit as a failure (nor restart it: the job is
done). Only under a launcher (``ASYNCCOLL_STORE_HOSTED=1``: the store outlives the ranks);
elsewhere nobody is told.
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
ENDED = "ended: "  #: the report's prefix when the job ended before the restart was taken back
log = logging.getLogger("asynccoll.launch")


class Reporter:
    """``reporter(text, ended)``: report how this process's first join went to the store at
    ``store`` (host, port), once (``ended``: the job ended before it was taken back); call it on
    a loop that outlives the report (the communicator's runtime). Returns the report's task."""

    def __init__(self, store: tuple[str, int], secret: bytes, rank: int, restart: int) -> None:
        self.store, self.secret, self.rank, self.restart = store, secret, rank, restart
        self.started = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def __call__(self, text: str, ended: bool = False) -> asyncio.Task[None]:
        if self._task is None:
            took = time.monotonic() - self.started
            self._task = asyncio.get_running_loop().create_task(self._report(
                f"{ENDED}{text}" if ended else f"{text}, {took:.1f} s after its connect()"))
        return self._task

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
                restart: int) -> bool:
    """Say ``rank R joined the job (restart k): ...`` once the restarted process reports it,
    or that the job ended before it was taken back (then returns True); runs until then or
    until cancelled (one store connection, one blocked ``get``)."""
    try:
        client = await StoreClient.connect(*store, secret, timeout=30.0)
    except (OSError, StoreError):
        return False  # the store is gone: the launcher says so on its own
    try:
        got = (await client.get(f"{KEY}{rank}/{restart}", timeout=float(1 << 31))
               ).decode(errors="replace")
        if got.startswith(ENDED):
            say(f"rank {rank} (restart {restart}) was not taken back: {got[len(ENDED):]}")
            return True
        say(f"rank {rank} joined the job ({f'restart {restart}' if restart else 'a new rank'}): "
            f"{got}")
    except (OSError, StoreError):
        pass
    finally:
        with contextlib.suppress(Exception):
            await client.close()
    return False
