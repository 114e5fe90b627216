"""The shared-memory path of a joiner's state (:mod:`.joining`, step 4): a donor on the
joiner's host hands its stripe over through a small ring of slots in a segment it creates,
instead of through its tcp connection.

**The ring.** A donor's stripe is a list of units (the ``i``-th ``1/D`` of every array, cut
into pieces of at most 8 MiB: :func:`.state_digest.units`), packed whole into chunks of at most
:data:`SLOT` bytes (:func:`chunks`: a state of many small arrays takes few chunks), and chunk
``k`` goes through slot ``k % slots`` of the donor's segment (at most :data:`SLOTS` slots; a
smaller stripe takes fewer and smaller ones). The donor copies chunk ``k`` in and sends
``FILLED`` (frame ``k``, no payload, over the job's connection); the joiner copies it out into
its own arrays, sends ``FREED``, and hashes its units for the digest (while they are still in
the caches); the donor writes slot ``k % slots`` again only after ``FREED`` of chunk
``k - slots``. Donor and joiner thus copy at once (the stripe costs the slower of the two
copies, not their sum), the segment is at most 32 MiB however large the state, and its pages
are touched once. The copies run on the runtime loop's executor threads (NumPy copies release
the GIL), so the loop keeps serving the connections and several donors' chunks are copied out
in parallel. A chunk costs two empty frames, a fraction of a millisecond against the
milliseconds its copies take; on a machine with fewer free cores than processes each handoff
also waits for the scheduler: on the 2-core machine of docs/benchmarks.md this path is as fast
as tcp at 1 GiB, not faster.

**The segment's life.** Its name is :func:`~.shm.segment_path` of a random token the joiner
drew for this transfer and sent only over the authenticated connection (in its ``GO``), the
handle's channel, the donor's rank and the new world's first execution: unguessable outside the
job, derived by both sides (the joiner reads no path from the wire), and under the job's tag
(``ASYNCCOLL_JOB_TAG``), which ``asynccoll run`` unlinks when the job ends, however it ends.
Before that:

* the joiner unlinks it as soon as it has mapped it (the mapping stays valid): from then on
  nothing is left in the directory whatever dies;
* the donor unlinks it when its part ends, however it ends (the joiner lost mid-transfer
  included: the donor's waits fail with :class:`~asynccoll.PeerLostError`), and its
  ``SIGTERM`` handler does (:func:`~.shm.install_cleanup`: the segment is registered as the
  process's own at creation);
* the joiner, when its join ends however it ends, unlinks the name of every donor's segment,
  which removes the one of a donor killed after creating it and before the joiner mapped it.

A donor that cannot make its segment (no room in the tmpfs, a name taken, no shared memory)
says so in one warning per process and sends its stripe over tcp; so does, silently, a donor
whose stripe is under ``ASYNCCOLL_JOIN_RING_MIN`` (:data:`.route.RING_MIN`, 128 MiB, by
default: below it the ring's set-up costs more than it saves, measured: making and mapping a
32 MiB ring took 0.2-0.3 s under the load of docs/benchmarks.md) or whose joiner asked for none
(``ASYNCCOLL_SHM=0``); :func:`.route.state_route` decides. The joiner
reads which from the donor's ``PLAN`` frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .shm import Segment, segment_path

__all__ = ["SLOT", "SLOTS", "Ring", "chunks", "ring_shape"]

SLOT = 8 << 20  #: the largest chunk a slot carries (bytes)
SLOTS = 4  #: the most slots in a donor's ring
#: one piece of a stream: (array index, first byte, end byte) of that array's byte view
Unit = tuple[int, int, int]


def chunks(units: Sequence[Unit], slot: int) -> list[list[Unit]]:
    """``units`` (each at most ``slot`` bytes) grouped into the chunks that go through the
    slots: consecutive units, as many as fit in ``slot`` bytes (a state of many small arrays
    takes few chunks; a unit is never cut, so the joiner hashes each one whole)."""
    out: list[list[Unit]] = []
    fill = slot
    for u in units:
        n = u[2] - u[1]
        if fill + n > slot:
            out.append([])
            fill = 0
        out[-1].append(u)
        fill += n
    return out


def ring_shape(total: int, largest: int) -> tuple[int, int]:
    """``(slot bytes, slots)`` of the ring for a stream of ``total`` bytes (> 0) whose
    largest unit has ``largest`` bytes (at most :data:`SLOT`)."""
    slot = max(largest, min(SLOT, total))
    return slot, min(SLOTS, -(-total // slot))


def _copy(views: Sequence[Any], chunk: Sequence[Unit], buf: Any, into_buf: bool) -> None:
    """Copy the units of ``chunk`` to the start of ``buf`` (``into_buf``) or from it, one
    ``np.copyto`` per unit; runs on an executor thread (NumPy releases the GIL for it)."""
    pos = 0
    for j, lo, hi in chunk:
        n = hi - lo
        if into_buf:
            np.copyto(buf[pos: pos + n], views[j][lo:hi])
        else:
            np.copyto(views[j][lo:hi], buf[pos: pos + n])
        pos += n


class Ring:
    """One donor's segment for one joiner: ``slots`` slots of ``slot`` bytes at ``path``."""

    def __init__(self, seg: Segment, slot: int, slots: int) -> None:
        self.seg, self.slot, self.slots = seg, slot, slots
        self.buf: Any = seg.array(np.uint8, slot * slots)

    @staticmethod
    def path(token: int, sid: int, donor: int, first: int) -> str:
        """The segment name of ``donor``'s ring for the transfer keyed by the joiner's
        ``token`` (module doc), the channel ``sid`` and the first execution ``first``."""
        return segment_path(token, sid, donor, first)

    @classmethod
    def create(cls, path: str, units: Sequence[Unit]) -> Ring:
        """The donor's ring for ``units`` (``OSError`` when the segment cannot be made)."""
        slot, slots = ring_shape(sum(u[2] - u[1] for u in units),
                                 max(u[2] - u[1] for u in units))
        return cls(Segment.create(path, slot * slots), slot, slots)

    @classmethod
    def attach(cls, path: str, slot: int, slots: int) -> Ring:
        """The joiner's mapping of a donor's ring (read-only, checked as
        :meth:`Segment.attach`), its name unlinked at once."""
        seg = Segment.attach(path, slot * slots)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return cls(seg, slot, slots)

    def chunk(self, k: int) -> Any:
        """The slot that chunk ``k`` goes through."""
        s = (k % self.slots) * self.slot
        return self.buf[s: s + self.slot]

    def close(self) -> None:
        """Unlink (the donor's; idempotent) and unmap."""
        self.seg.unlink()
        self.buf = None
        self.seg.close()

    async def send(self, views: Sequence[Any], units: Sequence[Unit], filled: Any,
                   freed: list[asyncio.Future[Any]]) -> None:
        """The donor's side, on the runtime loop: every chunk of ``units`` (of ``views``, this
        rank's state) into its slot, then ``filled(k)`` (sends the ``FILLED`` frame);
        ``freed[k]``: the posted receive of the joiner's ``FREED`` of chunk ``k``. Returns
        once the joiner freed every chunk."""
        loop = asyncio.get_running_loop()
        for k, chunk in enumerate(chunks(units, self.slot)):
            if k >= self.slots:
                await freed[k - self.slots]
            await loop.run_in_executor(None, _copy, views, chunk, self.chunk(k), True)
            await filled(k)
        await asyncio.gather(*freed)

    async def receive(self, views: Sequence[Any], units: Sequence[Unit],
                      filled: list[asyncio.Future[Any]], freed: Any, then: Any) -> None:
        """The joiner's side, on the runtime loop: for each chunk, wait for its ``FILLED``
        (``filled[k]``, posted), copy it out into ``views`` (this rank's state), ``freed(k)``
        at once (the donor may refill the slot), then ``then(unit)`` for each of its units on
        another executor thread (the digest, while the bytes are still in the caches)."""
        loop = asyncio.get_running_loop()
        after: list[asyncio.Future[Any]] = []

        def each(chunk: list[Unit]) -> None:
            for u in chunk:
                then(u)

        try:
            for k, chunk in enumerate(chunks(units, self.slot)):
                await filled[k]
                await loop.run_in_executor(None, _copy, views, chunk, self.chunk(k), False)
                freed(k)
                after.append(loop.run_in_executor(None, each, chunk))
        finally:
            await asyncio.gather(*after)
