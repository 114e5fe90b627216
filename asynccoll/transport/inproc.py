"""``inproc://NAME/RANK``: many ranks in one process, for tests and simulation.

An :class:`InprocFabric` stands for the network: the ranks that listen on it, and optional seeded
per-link delays. With delays, messages of different ``(schedule, execution, tag)`` on one link may
overtake each other; messages with the same key never do (as in MPI). Without delays a send copies
the payload straight into the posted receive (one copy, like a wire), or into the held queue.

**Who owns a fabric.** Whoever creates the ranks creates their fabric and hands it to each
transport (``InprocTransport(rank, P, fabric=f)``), as :func:`asynccoll.testing.inproc_world` and
:func:`asynccoll.testing.local_world` do; such a fabric is found by no name, and dies with its
transports. Only ranks that meet by address, each created on its own (``make_transport("inproc",
...)`` then ``listen("inproc://NAME")``, as a rendezvous with ``transport="inproc"`` does), need a
name resolved. Names are resolved per event loop (:meth:`InprocFabric.get`), the one scope in
which in-process ranks can talk at all: their futures and timers belong to one loop. The table is
weak on both sides, so a fabric goes with its last transport and a name with its loop.
"""

from __future__ import annotations

import asyncio
import math
import random
import weakref
from collections.abc import Mapping
from typing import Any

from ..errors import PeerLostError
from .base import Transport
from .frames import Header, Limits
from .registry import parse_address

__all__ = ["InprocFabric", "InprocTransport"]

#: event loop -> {name: fabric}: the fabrics made by :meth:`InprocFabric.get` on that loop
_BY_LOOP: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, weakref.WeakValueDictionary[str, InprocFabric]
] = weakref.WeakKeyDictionary()


class InprocFabric:
    """The in-process network called ``name`` (a label for addresses).

    ``delay``: the largest one-way delay in seconds; each message's delay is drawn uniformly
    from ``[0, delay]`` by a generator seeded with ``seed``; ``link_delay`` adds a fixed delay
    per ``(src, dst)`` link (a straggler's slow link, say). Creating one registers nothing: pass
    it to the transports that share it.
    """

    def __init__(self, name: str, *, delay: float = 0.0, seed: int = 0,
                 link_delay: Mapping[tuple[int, int], float] | None = None) -> None:
        self.name = name
        self.delay = delay
        self.link_delay = dict(link_delay or {})
        self.rng = random.Random(seed)
        self.endpoints: dict[int, InprocTransport] = {}
        self._last: dict[tuple[int, int, int, int, int], float] = {}
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}

    @classmethod
    def get(cls, name: str) -> InprocFabric:
        """The fabric called ``name`` on the running event loop, created (without delays) on
        first use: how ranks that meet by ``inproc://NAME`` address find one another.

        Fabrics created directly are not found here. Raises ``RuntimeError`` outside a loop.
        """
        named = _BY_LOOP.setdefault(asyncio.get_running_loop(), weakref.WeakValueDictionary())
        fabric = named.get(name)
        if fabric is None:
            fabric = named[name] = cls(name)
        return fabric

    def join(self, endpoint: InprocTransport) -> None:
        """Make ``endpoint`` reachable and wake whoever waits for its rank."""
        if endpoint.rank in self.endpoints:
            raise ValueError(f"rank {endpoint.rank} already listens on fabric {self.name!r}")
        self.endpoints[endpoint.rank] = endpoint
        for fut in self._waiters.pop(endpoint.rank, ()):
            if not fut.done():
                fut.set_result(None)

    def leave(self, endpoint: InprocTransport) -> None:
        """``endpoint`` closed: forget it and tell every other endpoint."""
        if self.endpoints.get(endpoint.rank) is not endpoint:
            return
        del self.endpoints[endpoint.rank]
        for peer in self.endpoints.values():
            peer.peer_closed(endpoint.rank)

    async def reachable(self, rank: int, timeout: float) -> InprocTransport:
        """The endpoint of ``rank`` once it listens; ``TimeoutError`` after ``timeout`` s."""
        while rank not in self.endpoints:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(rank, []).append(fut)
            await asyncio.wait_for(fut, timeout)
        return self.endpoints[rank]

    def due_at(self, src: int, dst: int, h: Header) -> float | None:
        """When (loop time) a message ``src -> dst`` with header ``h`` arrives; ``None``: now.

        Messages with the same ``(src, dst, sched, execution, tag)`` get strictly increasing
        times, so the loop's timer heap (which breaks ties arbitrarily) keeps them in order.
        """
        d = self.link_delay.get((src, dst), 0.0)
        if self.delay:
            d += self.rng.uniform(0.0, self.delay)
        key = (src, dst, h.sched, h.execution, h.tag)
        if not d and key not in self._last:
            return None
        now = asyncio.get_running_loop().time()
        last = self._last.get(key)
        at = now + d if last is None else max(now + d, math.nextafter(last, math.inf))
        self._last[key] = at
        if len(self._last) > 4096:
            # Entries already due can no longer be overtaken: a later message is due after now.
            self._last = {k: v for k, v in self._last.items() if v > now}
        return at


class InprocTransport(Transport):
    """One rank's endpoint on an :class:`InprocFabric`.

    ``fabric``: the fabric its creator owns; without one, :meth:`listen` finds the fabric its
    address names on the running loop (see the module docstring).
    """

    scheme = "inproc"

    def __init__(self, rank: int, world_size: int, *, fabric: InprocFabric | None = None,
                 limits: Limits | None = None) -> None:
        super().__init__(rank, world_size, limits=limits)
        self._fabric = fabric
        self._address = ""
        self._peers: dict[int, InprocTransport] = {}
        self._gone: set[int] = set()  # peers that closed

    @property
    def address(self) -> str:
        return self._address

    @property
    def fabric(self) -> InprocFabric | None:
        """The fabric this rank is (or will be) on; ``None`` before :meth:`listen` finds it."""
        return self._fabric

    async def _listen(self, address: str | None) -> str:
        if self._fabric is None:
            scheme, loc = parse_address(address or "inproc://default")
            if scheme != "inproc":
                raise ValueError(f"InprocTransport cannot listen on {address!r}")
            self._fabric = InprocFabric.get(loc.split("/")[0] or "default")
        self._fabric.join(self)
        self._address = f"inproc://{self._fabric.name}/{self.rank}"
        return self._address

    async def _connect(self, peers: Mapping[int, str], timeout: float) -> None:
        if self._fabric is None:
            raise RuntimeError("an InprocTransport must listen() before connect()")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for rank, addr in peers.items():
            parse_address(addr)  # rejects a malformed address early
            try:
                self._peers[rank] = await self._fabric.reachable(
                    rank, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise PeerLostError(rank, f"no endpoint at {addr} within {timeout} s") from None

    def peer_closed(self, rank: int) -> None:
        """The fabric's news that ``rank`` closed: receives from it and sends to it fail with
        :class:`PeerLostError`."""
        self._peers.pop(rank, None)
        self._gone.add(rank)
        self._peer_lost(rank, PeerLostError(rank, "peer closed"))

    def _post_send(self, dst: int, header: Header, payload: Any) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        peer = self._peers.get(dst)
        if peer is None:
            fut: asyncio.Future[None] = loop.create_future()
            fut.set_exception(PeerLostError(dst, "closed" if dst in self._gone
                                            else "not connected"))
            return fut
        assert self._fabric is not None
        at = self._fabric.due_at(self.rank, dst, header)
        if at is None:
            return peer.arrive(header, payload)
        data = bytes(payload)  # the wire buffers it
        # call_at, not call_later: the arrival order of same-key messages is fixed by ``at``.
        loop.call_at(at, peer.arrive, header, memoryview(data))
        fut = loop.create_future()
        fut.set_result(None)
        return fut

    def arrive(self, header: Header, data: memoryview) -> asyncio.Future[None]:
        """A frame from a peer on the fabric arrives (what a wire would do; the sender checked
        it): ``data`` is copied into its receive, or held. A closed rank drops it."""
        if not self._closed:
            return self._loopback(header, data)  # the one-copy delivery of a self-send
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)  # the bytes left the sender; a closed peer drops them
        return fut

    async def _close(self) -> None:
        if self._fabric is not None:
            self._fabric.leave(self)
