"""``inproc://NAME/RANK``: many ranks in one process, for tests and simulation.

A :class:`InprocFabric` stands for the network: the ranks that listen on it, and optional seeded
per-link delays. With delays, messages of different ``(schedule, execution, tag)`` on one link may
overtake each other; messages with the same key never do (as in MPI). Without delays a send copies
the payload straight into the posted receive (one copy, like a wire), or into the held queue.

Fabrics are found by name in a per-process registry, as sockets are found by port.
"""

from __future__ import annotations

import asyncio
import math
import random
import weakref
from collections.abc import Mapping
from typing import Any

from ..errors import PeerLostError, TransportClosedError
from .base import Transport, _readable_bytes
from .frames import Header, Limits
from .registry import parse_address

__all__ = ["InprocFabric", "InprocTransport"]

_FABRICS: weakref.WeakValueDictionary[str, InprocFabric] = weakref.WeakValueDictionary()


class InprocFabric:
    """The in-process network named ``name``.

    ``delay``: the largest one-way delay in seconds; each message's delay is drawn uniformly
    from ``[0, delay]`` by a generator seeded with ``seed``; ``link_delay`` adds a fixed delay
    per ``(src, dst)`` link (a straggler's slow link, say).
    """

    def __init__(self, name: str, *, delay: float = 0.0, seed: int = 0,
                 link_delay: Mapping[tuple[int, int], float] | None = None) -> None:
        if name in _FABRICS:
            raise ValueError(f"an inproc fabric named {name!r} already exists")
        self.name = name
        self.delay = delay
        self.link_delay = dict(link_delay or {})
        self.rng = random.Random(seed)
        self.endpoints: dict[int, InprocTransport] = {}
        self._last: dict[tuple[int, int, int, int, int], float] = {}
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        _FABRICS[name] = self

    def join(self, endpoint: InprocTransport) -> None:
        """Make ``endpoint`` reachable and wake whoever waits for its rank."""
        if endpoint.rank in self.endpoints:
            raise ValueError(f"rank {endpoint.rank} already listens on fabric {self.name!r}")
        self.endpoints[endpoint.rank] = endpoint
        for fut in self._waiters.pop(endpoint.rank, ()):
            if not fut.done():
                fut.set_result(None)

    async def reachable(self, rank: int, timeout: float) -> InprocTransport:
        """The endpoint of ``rank`` once it listens; ``TimeoutError`` after ``timeout`` s."""
        while rank not in self.endpoints:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(rank, []).append(fut)
            await asyncio.wait_for(fut, timeout)
        return self.endpoints[rank]

    @classmethod
    def get(cls, name: str) -> InprocFabric:
        try:
            return _FABRICS[name]
        except KeyError:
            return cls(name)

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
    """One rank's endpoint on an :class:`InprocFabric`."""

    scheme = "inproc"

    def __init__(self, rank: int, world_size: int, *, fabric: InprocFabric | None = None,
                 limits: Limits | None = None) -> None:
        super().__init__(rank, world_size, limits=limits)
        self._fabric = fabric
        self._address = ""
        self._closed = False
        self._peers: dict[int, InprocTransport] = {}

    @property
    def address(self) -> str:
        return self._address

    async def listen(self, address: str = "") -> str:
        if self._fabric is None:
            scheme, loc = parse_address(address or "inproc://default")
            if scheme != "inproc":
                raise ValueError(f"InprocTransport cannot listen on {address!r}")
            self._fabric = InprocFabric.get(loc.split("/")[0] or "default")
        self._fabric.join(self)
        self._address = f"inproc://{self._fabric.name}/{self.rank}"
        return self._address

    async def connect(self, peers: Mapping[int, str], timeout: float = 30.0) -> None:
        if self._fabric is None:
            raise TransportClosedError("listen() first")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for rank, addr in peers.items():
            parse_address(addr)  # rejects a malformed address early
            try:
                self._peers[rank] = await self._fabric.reachable(
                    rank, max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise PeerLostError(rank, f"no endpoint at {addr} within {timeout} s") from None

    def post_send(self, dst: int, header: Header, payload: Any) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        if self._closed:
            fut: asyncio.Future[None] = loop.create_future()
            fut.set_exception(TransportClosedError("transport closed"))
            return fut
        if dst == self.rank:
            return self._loopback(header, payload)
        peer = self._peers.get(dst)
        if peer is None or peer._closed:
            fut = loop.create_future()
            fut.set_exception(PeerLostError(dst, "not connected" if peer is None else "closed"))
            return fut
        assert self._fabric is not None
        at = self._fabric.due_at(self.rank, dst, header)
        if at is None:
            return peer._deliver(header, _readable_bytes(payload))
        data = bytes(_readable_bytes(payload)[: header.length])  # the wire buffers it
        # call_at, not call_later: the arrival order of same-key messages is fixed by ``at``.
        loop.call_at(at, peer._deliver, header, memoryview(data))
        fut = loop.create_future()
        fut.set_result(None)
        return fut

    def _deliver(self, header: Header, data: memoryview) -> asyncio.Future[None]:
        if not self._closed:
            return self._loopback(header, data)  # the one-copy delivery of a self-send
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_result(None)  # the bytes left the sender; a closed peer drops them
        return fut

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.matcher.close()
        if self._fabric is not None:
            self._fabric.endpoints.pop(self.rank, None)
            for peer in self._fabric.endpoints.values():
                peer.matcher.fail_peer(self.rank, PeerLostError(self.rank, "peer closed"))
