"""Partial collectives that outlive a lost rank (DESIGN §10; ``Communicator.survive``).

A partial allreduce is built not to need every rank, so with ``survive=True`` a handle whose
execution fails with :class:`~asynccoll.PeerLostError` does not fail its call: it

1. **agrees** with the other survivors on who is lost: ``comm.shrink()`` (the same set on
   every survivor; :meth:`Membership.agree <.membership.Membership.agree>`), which gives the
   communicator of the survivors, shared by every handle of ``comm``;
2. **settles the execution under way**, so that no contribution is lost or counted twice. An
   allreduce result is complete only with every rank's data in it, and a rank cannot complete
   execution e + 1 before every rank has completed e, so the survivors' last completed
   executions differ by one at most. If some survivor completed the newest one, its result
   (data and meta) goes to the survivors that did not, which complete it as if it had arrived:
   their snapshot of it is in it. Otherwise nobody has it, and each survivor puts the snapshot
   it took for it (when it took one) back into its send buffer, to go into the next execution.
   What the lost rank had contributed to completed executions is in their results; what it
   held in its send buffer, or in the snapshot of an execution nobody completed, is lost with
   it, and every later result names it in ``PartialResult.lost``;
3. **rebuilds** its schedule for the survivors over their communicator (same kind and name;
   quorum lowered to the new world size when it exceeds it), carrying over the send buffer,
   the count of contributions in it and the execution numbering (the next execution is the
   one after the newest completed), and goes on: the call that was waiting takes part in the
   next execution, or returns the settled one's result.

The survivors exchange their last completed execution, and the result of the newest, with
messages of the handle's own (over the survivors' transport), so handles that recover in
different orders on different ranks never meet. Costs while nobody is lost: one copy of this
rank's snapshot and one of each result, per execution (``survive=False``, the default, pays
neither). Dense and sparse handles alike (the contribution says what a snapshot and a result
are, :mod:`.contribution`); results handed out to calls cancelled at the moment of a loss do
not survive.

Survival drives its handle only through the handle's membership side (:class:`Survivor`:
``completed``, ``failure``, ``survivable``, ``result_buffers``, ``complete_settled``,
``put_back``, ``rebuild``), and knows its communicator by what it uses of it
(:class:`Members`), so this module reaches into neither.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import numpy as np

from ..errors import CollectiveTimeoutError, PeerLostError
from ..transport.base import Transport
from ..transport.frames import Kind
from ..transport.matching import ignore_outcome
from .membership import Membership
from .partial import stable_id

__all__ = ["Survival"]

log = logging.getLogger("asynccoll.comm")

_COMPLETED, _WORK, _META = 0, 1, 2  # tags of the recovery messages


class Members(Protocol):
    """What survival uses of a :class:`~asynccoll.Communicator` (named by shape: the
    communicator imports this module)."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def members(self) -> tuple[int, ...]: ...
    @property
    def membership(self) -> Membership: ...
    @property
    def transport(self) -> Transport: ...
    #: whether it is the job communicator of a process that took a lost rank's place
    joined: bool
    async def shrink(self, timeout: float | None = None) -> Members: ...


class Survivor(Protocol):
    """The membership side of a persistent handle (:class:`~.partial.PartialAllreduce`)."""

    name: str
    timeout: float | None

    @property
    def completed(self) -> int: ...
    @property
    def failure(self) -> BaseException | None: ...
    def survivable(self, err: BaseException | None) -> bool: ...
    def result_buffers(self) -> tuple[Any, Any]: ...
    def complete_settled(self, e: int) -> None: ...
    def put_back(self, snapshot: Any, count: int) -> None: ...
    def rebuild(self, comm: Any, first: int, ranks: list[int]) -> None: ...


class Survival:
    """The survival state of one handle (module doc): its communicator now, copies of this
    rank's latest snapshot and result, and the ranks lost so far (in the numbering of the
    communicator the handle was made on)."""

    def __init__(self, handle: Survivor, comm: Members) -> None:
        self.handle = handle
        self.comm = comm
        #: the job ranks of the handle's first communicator, in its rank order
        self.first = comm.members
        self.lost: frozenset[int] = frozenset()
        self._task: asyncio.Future[None] | None = None
        comm.membership.listeners.append(self._on_loss)
        self._mine: tuple[int, Any, int] | None = None  # (execution, snapshot, count)
        self._last: tuple[int, Any, Any] | None = None  # (execution, work, meta)

    # -- while nobody is lost (under the handle's lock) ------------------------------------
    def after_snapshot(self, e: int, data: Any, count: int) -> None:
        """This rank's snapshot of execution ``e`` (``count`` contributions): keep a copy."""
        mine = self._mine
        if mine is not None and mine[1].shape == data.shape:
            mine[1][...] = data
            self._mine = (e, mine[1], count)
        else:
            self._mine = (e, data.copy(), count)

    def after_complete(self, e: int, work: Any, meta: Any) -> None:
        """Execution ``e`` completed here: keep a copy of its result (data and meta)."""
        last = self._last
        if last is not None and last[1].shape == work.shape and last[2].shape == meta.shape:
            last[1][...] = work
            last[2][...] = meta
            self._last = (e, last[1], last[2])
        else:
            self._last = (e, work.copy(), meta.copy())

    # -- after a loss (on the runtime's loop) -----------------------------------------------
    def _on_loss(self, rank: int) -> None:
        """A loss listener of the communicator the handle runs on: start the recovery at
        once, on the runtime's loop, whether or not a call is under way, so that every
        survivor's every surviving handle recovers without waiting for its caller (handles
        called in different orders on different ranks would otherwise wait on each other)."""
        self.start()

    def start(self) -> None:
        """Start the recovery now, on the runtime's loop, unless one is under way or the
        handle has nothing to recover from (also for a handle made after the loss was
        learned: :meth:`PartialAllreduce.follow <.partial.PartialAllreduce.follow>`).
        Not while the handle waits to be taken back (it runs on the job communicator of a
        restarted process, ``joined``): the admission decides its membership (:mod:`.joining`);
        a recovery would wait forever for an agreement that no member makes, and the
        handle's recovery from a loss after it joined would wait on that one."""
        h = self.handle
        if self._task is None and h.survivable(h.failure) and not self.comm.joined:
            self._task = asyncio.ensure_future(self._recover())
            self._task.add_done_callback(_retrieve)

    async def recover(self) -> None:
        """Wait for the recovery under way (or start one): agree, settle, rebuild (module
        doc). Raises what it failed with (:class:`~asynccoll.PeerLostError` when the
        survivors decided this rank is lost, :class:`~asynccoll.CollectiveTimeoutError`)."""
        h = self.handle
        while h.survivable(h.failure):
            if self._task is None:
                self._task = asyncio.ensure_future(self._recover())
                self._task.add_done_callback(_retrieve)
            task = self._task
            try:
                await asyncio.shield(task)  # a cancelled call leaves the recovery running
            finally:
                if task.done() and self._task is task:
                    self._task = None

    def moved_to(self, comm: Members) -> None:
        """The handle goes on over ``comm``, a grown membership (:mod:`.joining`): the ranks
        of the first communicator in it are no longer lost, and its losses are followed."""
        alive = set(comm.members)
        self.lost = frozenset(i for i, m in enumerate(self.first) if m not in alive)
        self.comm = comm
        comm.membership.listeners.append(self._on_loss)
        self._mine = None
        self._last = None

    def cancel(self) -> None:
        """Stop a recovery under way (the handle closes)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _recover(self) -> None:
        h = self.handle
        comm = self.comm
        while True:
            new = await comm.shrink(h.timeout)
            while new.membership.lost is not None:  # lost more since: shrink that too
                new = await new.shrink(h.timeout)
            alive = set(new.members)
            self.lost = frozenset(i for i, m in enumerate(self.first) if m not in alive)
            c = h.completed
            try:
                cs = await self._exchange(new, c)
                cmax = max(cs)
                if min(cs) < cmax - 1:  # pragma: no cover - impossible (module doc)
                    raise AssertionError(f"survivors' completed executions differ by more "
                                         f"than one: {cs}")
                await self._settle(new, cs, c, cmax)
            except PeerLostError:
                comm = new  # a survivor lost during the recovery: again, among fewer
                continue
            break
        log.warning("rank %d: partial allreduce %r goes on with %d ranks (lost %s) from "
                    "execution %d", self.comm.rank, h.name, new.size, sorted(self.lost),
                    cmax + 1)
        h.rebuild(new, cmax + 1,
                   [new.members.index(m) if m in alive else -1 for m in self.comm.members])
        self.comm = new
        new.membership.listeners.append(self._on_loss)
        self._mine = None  # put back, or in the settled result
        # _last stays: the newest completed result, for a survivor that missed it

    async def _exchange(self, new: Members, c: int) -> list[int]:
        """Every survivor's last completed execution, by new rank (all-to-all, 8 bytes)."""
        t = new.transport
        sid = self._sched_id()
        mine = np.array([c], np.int64)
        peers = [r for r in range(new.size) if r != new.rank]
        futs = {r: t.post_recv(r, sid, 0, _COMPLETED) for r in peers}
        for r in peers:
            t.post_frame(r, int(Kind.DATA), sid, 0, _COMPLETED,
                         mine.data.cast("B")).add_done_callback(ignore_outcome)
        out = [c] * new.size
        for r, fut in futs.items():
            msg = await self._wait(fut)
            out[r] = int(np.frombuffer(msg.payload, np.int64)[0])
        return out

    async def _settle(self, new: Members, cs: list[int], c: int, cmax: int) -> None:
        h = self.handle
        t = new.transport
        sid = self._sched_id()
        behind = [r for r, x in enumerate(cs) if x < cmax]
        if behind:
            root = cs.index(cmax)
            if new.rank == root:
                assert self._last is not None
                assert self._last[0] == cmax
                _, work, meta = self._last
                for r in behind:
                    t.post_frame(r, int(Kind.DATA), sid, 0, _WORK,
                                 _bytes(work)).add_done_callback(ignore_outcome)
                    t.post_frame(r, int(Kind.DATA), sid, 0, _META,
                                 _bytes(meta)).add_done_callback(ignore_outcome)
            elif c < cmax:
                work, meta = h.result_buffers()
                host = work if isinstance(work, np.ndarray) else work.get()  # CuPy: staged
                fw = t.post_recv(root, sid, 0, _WORK, host)
                fm = t.post_recv(root, sid, 0, _META, meta)
                await self._wait(fw)
                await self._wait(fm)
                if host is not work:
                    work.set(host)
                # my snapshot of cmax is in this result: complete it as if it had arrived
                h.complete_settled(cmax)
                return
        mine = self._mine
        if mine is not None and mine[0] == c + 1 and mine[0] > cmax:
            # nobody completed the execution this rank's snapshot went into: put it back
            h.put_back(mine[1], mine[2])

    def _sched_id(self) -> int:
        return stable_id(f"{self.handle.name}#survive", 1)

    async def _wait(self, fut: asyncio.Future[Any]) -> Any:
        try:
            if self.handle.timeout is None:
                return await fut
            return await asyncio.wait_for(fut, self.handle.timeout)
        except asyncio.TimeoutError:
            raise CollectiveTimeoutError(
                f"partial allreduce {self.handle.name!r}: a survivor did not answer the "
                f"recovery within {self.handle.timeout} s") from None


def _retrieve(task: asyncio.Future[None]) -> None:
    """Mark a recovery's outcome retrieved (the next call raises it, if it failed)."""
    if not task.cancelled():
        task.exception()


def _bytes(a: Any) -> memoryview:
    host = a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else a
    return np.ascontiguousarray(host).data.cast("B")
