"""``local_world(P)``: P connected communicators in one process (re-exported by ``testing``)."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from ..comm.communicator import Communicator
from ..comm.progress import ProgressEngine
from ..transport.inproc import InprocFabric, InprocTransport
from ..transport.registry import make_transport

__all__ = ["local_world"]

_names = itertools.count()
_TRANSPORTS = ("inproc", "tcp", "ucx")


@asynccontextmanager
async def local_world(world_size: int, transport: str = "inproc", *, progress: str = "thread",
                      timeout: float | None = None, delay: float = 0.0, seed: int = 0,
                      link_delay: Mapping[tuple[int, int], float] | None = None,
                      trace: str | None = None, stall_warn: float | None = None,
                      ) -> AsyncIterator[list[Communicator]]:
    """Yield ``world_size`` connected :class:`~asynccoll.Communicator` objects, rank order.

    ``transport``: ``inproc`` (an in-process fabric; ``delay``, ``seed`` and ``link_delay``
    shape its latencies as :class:`~asynccoll.transport.inproc.InprocFabric` says), ``tcp``
    (loopback sockets) or ``ucx`` (loopback; needs ucxx). All ranks share one engine:
    ``progress="thread"`` (a progress thread, so a rank may block its caller's loop and still
    be activated) or ``"inline"`` (the caller's loop). ``timeout``: the communicators' default
    collective timeout; ``stall_warn``: their stall-warning threshold (default None: no
    warnings, unlike :func:`~asynccoll.connect`). ``trace``: a directory each rank writes its
    execution trace to (see :class:`~asynccoll.Communicator`). Everything is closed on exit.
    Raises ``ValueError`` naming a bad ``world_size``, ``transport`` or ``progress``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if transport not in _TRANSPORTS:
        raise ValueError(f"transport must be one of {_TRANSPORTS}, got {transport!r}")
    if progress not in ("thread", "inline"):
        raise ValueError(f"progress must be 'thread' or 'inline', got {progress!r}")
    engine = (ProgressEngine.thread(use_uvloop=transport != "ucx") if progress == "thread"
              else ProgressEngine.inline())
    engine.acquire()
    comms: list[Communicator] = []
    try:
        ts = await engine.run(_connect(world_size, transport, delay, seed, link_delay))
        comms = [Communicator(t, progress=engine, timeout=timeout, trace=trace,
                              stall_warn=stall_warn) for t in ts]
        yield comms
    except BaseException:
        # The body failed: abort (no goodbyes to wait for), as ``async with comm`` does.
        try:
            for c in comms:
                await c.close(timeout=0)
        finally:
            engine.release()
        raise
    else:
        # Closing is collective: every rank says goodbye at once, or each would wait for
        # the ones after it.
        try:
            await asyncio.gather(*(c.close() for c in comms))
        finally:
            engine.release()


async def _connect(world_size: int, scheme: str, delay: float, seed: int,
                   link_delay: Mapping[tuple[int, int], float] | None) -> list[Any]:
    ts: list[Any]
    if scheme == "inproc":
        fabric = InprocFabric(f"local-world-{next(_names)}", delay=delay, seed=seed,
                              link_delay=link_delay)
        ts = [InprocTransport(r, world_size, fabric=fabric) for r in range(world_size)]
        address = ""
    else:
        secret = secrets.token_bytes(32)
        ts = [make_transport(scheme, r, world_size, secret=secret) for r in range(world_size)]
        address = f"{scheme}://127.0.0.1:0"
    try:
        addrs = {r: await t.listen(address) if address else await t.listen()
                 for r, t in enumerate(ts)}
        await asyncio.gather(*(t.connect({r: a for r, a in addrs.items() if r != t.rank})
                               for t in ts))
    except BaseException:
        for t in ts:
            await t.close()
        raise
    return ts
