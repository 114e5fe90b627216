"""The hierarchical partial allreduce: a host activates as a unit.

``comm.hier_partial_allreduce(policy, like)``. Across hosts a partial collective
hides the stragglers among *hosts*; within a host the ranks share memory and a core budget, and
a call goes like the hierarchical synchronous allreduce (docs/collectives.md):

1. **within the host**, synchronously: the ranks of the host sum their data, through shared
   memory (the host group's allreduce, which takes that path from 128 KiB);
2. **among the hosts**, partially: the host's leader (its lowest rank) contributes the host's
   sum to a partial allreduce handle of ``policy`` among the leaders, over the network, with
   every rule of that kind (activation, rule 1, staleness, accumulation);
3. **within the host** again: the leader hands the result and what it says (round,
   contributors, ...) to its ranks, through shared memory as well (the value as a sum in which
   the other ranks put ``-0.0``, or 0 for integers: ``v + (-0.0) = v`` bit for bit, ``-0.0``
   included, so every rank of the host, the leader included, holds the same bits). A leader
   whose call failed says so instead, and every rank of its host raises.

So a host whose ranks are late is a late host: the fast hosts go on without it, and its sum
goes into a later execution, as a late rank's data does in the flat handle; a straggler within
a host delays its host (that is what "a host activates as a unit" means, and why this is asked
for by name, not the default: where stragglers are single ranks, the flat handle hides them).

What results say, in the world's ranks: ``contributors`` and ``fresh`` are the ranks of the
hosts whose leader was one, ``arrivals`` gives every rank of a host its leader's arrival;
``included`` is whether this host's sum of this call is in ``value``; ``count`` counts the
leaders' contributions (host sums), and ``world_size`` is the world's size. A policy's quorum
(``Quorum(k)``, ``Backup(b)``, ``Deadline(quorum=k)``) counts hosts. Not offered here, each
refused by name: ``op="avg"`` and ``Accumulate.MEAN``/``WORLD`` (their divisors count host
sums, not ranks), ``survive`` with an ``op`` other than ``"sum"`` (see **A lost rank**
below), a data path (the host step always takes shared memory), sparse and tensor data (NumPy
arrays only). Its calls are
awaited, or blocking (:meth:`HierPartialAllreduce.blocking`,
``comm.blocking.hier_partial_allreduce(...)``); no ``out=``, no ``combine``.

**A lost rank.** A result of this handle is complete only with every host's leader in the
leaders' handle and every rank of a host in its host's sum; a lost rank breaks one of them
while the other hosts could go on among themselves and return sums that lack it.

* Without ``survive`` the handle follows the communicator's membership (:mod:`.membership`):
  from the moment this rank learns of a loss (within a round trip of it, DESIGN §10), the
  call under way and every later one raise :class:`~asynccoll.PeerLostError` naming the lost
  rank in the communicator's numbering, on every rank of every host, and no result is
  returned after it.
* With ``survive`` (``survive=True``, or the communicator's default, as ``asynccoll run
  --max-failures`` sets it; ``op="sum"`` only) the handle goes on: every survivor regroups
  once per agreed loss, a host that lost a member goes on with the rest (its lowest rank the
  leader, a new one if the leader died), a host that lost every rank drops out, the
  contributions stay exactly accounted (with ``Accumulate.SUM``), and every result from then
  on reports the loss in ``lost`` and ``world_size`` (:mod:`.hier_survival`). Such a handle
  also takes a restarted rank back (``asynccoll run --max-restarts``) through the flat handles'
  protocol (:func:`~.joining.admit_ready` / :func:`~.joining.join_handle` at a flush boundary):
  the restarted rank is back in its host's group from the next call.

**Setup.** The first call (or flush) of the handle on each rank makes the host groups and the
leaders' group (``comm.split("host")``, ``comm.group(leaders)``: collective over the whole
communicator, so every rank makes its first call among its other collectives in the same
order), and the leaders' partial handle; a leader that cannot make it (a ``quorum`` above the
number of hosts, where the hosts were not known at creation) fails its whole host, and the
handle raises that error from then on. The hosts are the communicator's (:attr:`Communicator.hosts
<asynccoll.Communicator.hosts>`, in its own ranks: groups work too). One call at a time per
handle and rank (:class:`~asynccoll.BusyError`). After a call that failed or was cancelled
on some rank, a host's ranks and the leaders may be out of step: close the handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol, TypeVar

import numpy as np

from ..collectives.policy import Policy
from ..collectives.shm import host_groups
from ..errors import BusyError, ExecutionError, PeerLostError, TransportClosedError
from ..results import PartialResult
from .hier_survival import Regrouping
from .membership import Membership
from .shm import host_hash

T = TypeVar("T")


class _Submit(Protocol):
    def submit(self, coro: Coroutine[Any, Any, T]) -> Any: ...


class Communicator(Protocol):
    """What this handle needs of a :class:`~asynccoll.Communicator` (and of its groups), by
    shape: the communicator imports this module, so this module names no class of it."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def hosts(self) -> list[list[int]]: ...
    @property
    def membership(self) -> Membership: ...
    @property
    def members(self) -> tuple[int, ...]: ...
    @property
    def blocking(self) -> _Submit: ...
    async def shrink(self, timeout: float | None = None) -> Communicator: ...
    async def allgather(self, x: Any, timeout: float | None = None) -> Any: ...
    async def allreduce(self, x: Any, op: str = "sum", algorithm: str | None = None,
                        timeout: float | None = None, *, out: Any = None) -> Any: ...
    async def broadcast(self, x: Any, root: int = 0, timeout: float | None = None) -> Any: ...
    async def split(self, color: int | str | None, key: int | None = None,
                    timeout: float | None = None) -> Communicator | None: ...
    async def group(self, ranks: Any, timeout: float | None = None) -> Communicator | None: ...
    def partial_allreduce(self, policy: Policy, like: Any, *args: Any, **kw: Any) -> Any: ...

__all__ = ["HierPartialAllreduce"]

# the header the leader hands to its host: these fields, then per leader its contributor
# flag, its fresh flag and its arrival (NaN: none); _FAILED: the leader's call raised;
# _PENDING: the leader knows of a loss (regroup next); _MINE: the host's count in the value
(_ROUND, _INCLUDED, _COUNT, _MISSED, _FLUSHED, _EXPIRED, _DEADLINE, _FAILED, _PENDING, _MINE,
 _FIELDS) = range(11)


class HierPartialAllreduce(Regrouping):
    """A partial allreduce of ``policy`` among hosts, synchronous within each (module doc).

    Made by :meth:`Communicator.hier_partial_allreduce
    <asynccoll.Communicator.hier_partial_allreduce>`; the same calls as
    :class:`~asynccoll.comm.partial.PartialAllreduce`: ``await h(x)``, ``await h.flush()``,
    ``await h.close()``. One call at a time per handle (:class:`~asynccoll.BusyError`).
    """

    def __init__(self, comm: Communicator, policy: Policy, like: np.ndarray[Any, Any],
                 name: str, options: dict[str, Any], survive: bool = False) -> None:
        #: the straggler policy among the hosts (:mod:`asynccoll.collectives.policy`)
        self.policy = policy
        self.kind = policy.name
        self.name = name
        self._comm = comm
        self._like = like
        self._options = options
        self._setup_lock = asyncio.Lock()
        self._host: Communicator | None = None
        self._handle: Any = None
        self._hosts: list[list[int]] = []  # the ranks of each leader's host, in order
        self._failed: BaseException | None = None  # the setup's error, raised at every call
        self._busy = False
        self._closed = False
        # A loss the communicator learned (on the runtime's loop) ends the handle; the call
        # under way (on the caller's loop) is woken through ``_waiter``.
        self._lost: PeerLostError | None = comm.membership.lost
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None
        self._guard = threading.Lock()
        self._init_survival(survive)
        if survive:  # the regroup follows the losses (.hier_survival)
            self._lost = None
        else:
            comm.membership.listeners.append(self._on_loss)

    @property
    def hosts(self) -> list[list[int]]:
        """The ranks of each host (the communicator's ranks), in the order of their leaders
        (after the first call)."""
        return [list(h) for h in self._hosts]

    async def _setup(self, timeout: float | None) -> Communicator:
        async with self._setup_lock:
            if self._failed is not None:
                raise self._failed
            if self._host is None:
                comm = self._comm
                hosts = comm.hosts
                if not hosts:  # a communicator made without connect(): learn them here
                    got = await comm.allgather(np.array([host_hash()], np.int64), timeout)
                    hosts = host_groups(got[:, 0].tolist())
                host = await comm.split("host", timeout=timeout)
                assert host is not None
                lead = await comm.group([g[0] for g in hosts], timeout)
                err: BaseException | None = None
                if lead is not None:
                    try:
                        self._handle = lead.partial_allreduce(
                            self.policy, self.leaders_like(len(hosts)),
                            name=f"{self.name}/leaders", **self._options)
                    except (ValueError, TypeError) as exc:
                        err = exc
                # a leader that could not make its handle says so to its host (every leader
                # fails alike: the same arguments, the same hosts)
                flag = await host.allreduce(np.array([err is not None], np.int64), "max",
                                            timeout=timeout)
                if err is not None or flag[0]:
                    self._failed = err or ExecutionError(
                        f"hierarchical partial allreduce {self.name!r}: this host's leader "
                        "could not make the leaders' handle (see its error)")
                    raise self._failed
                self._hosts = hosts
                self._host = host
            return self._host

    async def __call__(self, x: Any, timeout: float | None = None) -> PartialResult:
        """Contribute ``x`` (shape and dtype of ``like``): its host's sum goes to the leaders'
        handle; returns what that call returned, for every rank of the host (module doc).
        Raises as the flat handle's call does; every rank of a host raises when its leader's
        call failed; :class:`~asynccoll.PeerLostError` naming the rank once a rank of the
        communicator is lost (module doc)."""
        x = np.asarray(x)
        if x.shape != self._like.shape or x.dtype != self._like.dtype:
            raise ValueError(f"x must have like's shape {self._like.shape} and dtype "
                             f"{self._like.dtype}, got {x.shape} {x.dtype}")
        async with self._one_at_a_time():
            if self._survive:
                return await self.surviving(lambda: self._call(x, timeout), self._steps + 1,
                                            timeout)
            return await self._unless_lost(self._call(x, timeout))

    async def _call(self, x: Any, timeout: float | None) -> PartialResult:
        host = await self._setup(timeout)
        # before the host step: a leader whose host step fails on a loss right after a flush
        # boundary must flush in its regroup, to release the other leaders' calls of this step
        # (else each waited on the other until the timeout)
        self.lead_flushed = False
        summed = await self.host_step(host, x, timeout)
        return await self._lead_and_hand_out(
            host, None if self._handle is None else self._handle(summed, timeout), timeout)

    async def flush(self, timeout: float | None = None) -> PartialResult:
        """Collective over the communicator: every rank calls it after its last call; the
        leaders flush their handle (:meth:`PartialAllreduce.flush
        <asynccoll.comm.partial.PartialAllreduce.flush>`) and hand its result out."""
        async with self._one_at_a_time():
            if self._survive:
                return await self.surviving(lambda: self._flush(timeout), self._steps + 1,
                                            timeout, flush=True)
            return await self._unless_lost(self._flush(timeout))

    async def _flush(self, timeout: float | None) -> PartialResult:
        host = await self._setup(timeout)
        self.lead_flushed = True
        return await self._lead_and_hand_out(
            host, None if self._handle is None else self._handle.flush(timeout), timeout)

    def blocking(self, x: Any, timeout: float | None = None) -> PartialResult:
        """``await h(x)`` for code without an event loop (runs on the progress thread;
        ``RuntimeError`` with ``progress="inline"``)."""
        res: PartialResult = self._comm.blocking.submit(self(x, timeout)).result()
        return res

    def flush_blocking(self, timeout: float | None = None) -> PartialResult:
        """``await h.flush()`` for code without an event loop."""
        res: PartialResult = self._comm.blocking.submit(self.flush(timeout)).result()
        return res

    # -- a lost rank (module doc) ------------------------------------------------------------
    def _on_loss(self, rank: int) -> None:
        """A loss listener of the communicator (on the runtime's loop): end the handle and
        wake the call under way, on whatever loop it awaits."""
        with self._guard:
            if self._lost is None:
                self._lost = PeerLostError(
                    rank, f"hierarchical partial allreduce {self.name!r}: rank {rank} of its "
                    "communicator was lost, so no later result would hold its host's data")
            waiter = self._waiter
        if waiter is not None:
            loop, fut = waiter
            loop.call_soon_threadsafe(_settle, fut)

    def _raise_if_lost(self, cause: BaseException | None = None) -> None:
        lost = self._lost
        if lost is not None:
            raise PeerLostError(lost.rank, lost.reason) from cause

    async def _unless_lost(self, coro: Coroutine[Any, Any, PartialResult]) -> PartialResult:
        """Run ``coro`` (a call or flush) unless or until the communicator loses a rank: then
        stop it and raise :class:`~asynccoll.PeerLostError` naming that rank (whatever the
        call would have raised: a host group's or the leaders' error names their ranks)."""
        if self._lost is not None:
            coro.close()
            self._raise_if_lost()
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        task = asyncio.ensure_future(coro)
        with self._guard:
            self._waiter = (loop, woken)
            if self._lost is not None:
                woken.set_result(None)
        try:
            waits: set[asyncio.Future[Any]] = {task, woken}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            with self._guard:
                self._waiter = None
            woken.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
        if task.cancelled():
            self._raise_if_lost()
        exc = task.exception()
        if exc is not None:
            self._raise_if_lost(exc)
            raise exc
        if self._lost is not None:  # a result made while the loss was under way: not given
            self._raise_if_lost()
        res: PartialResult = task.result()
        return res

    async def close(self) -> None:
        """Stop this handle on this rank (local, as the flat handle's close; a call under way
        on a host whose leader closed raises on every rank of that host). Idempotent."""
        self._closed = True
        with self._guard:
            listeners = self._comm.membership.listeners
            if self._on_loss in listeners:
                listeners.remove(self._on_loss)
        if self._handle is not None:
            await self._handle.close()

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self) -> AsyncIterator[None]:
        if self._closed:
            raise TransportClosedError(f"hierarchical partial allreduce {self.name!r} is "
                                       "closed")
        if self._busy:
            raise BusyError(f"hierarchical partial allreduce {self.name!r}: a call or flush "
                            "is under way on this rank (one at a time per handle)")
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    async def _lead_and_hand_out(self, host: Communicator, lead: Any,
                                 timeout: float | None) -> PartialResult:
        """Await the leader's call ``lead`` (None elsewhere) and hand its result to every
        rank of its host (module doc, step 3); a leader whose call failed tells its host so,
        and every rank of it raises."""
        res: PartialResult | None = None
        err: BaseException | None = None
        if lead is not None:
            try:
                res = await lead
            except Exception as exc:  # told to the host below, then raised here
                err = exc
        n = len(self._hosts)
        head = np.full(_FIELDS + 3 * n, np.nan)
        head[_FAILED] = err is not None
        # the leader's value in a sum where the others put -0.0 (floats) or 0: x + -0.0 is
        # x bit for bit, -0.0 included, so every rank of the host holds the same bits
        fill = -0.0 if self._like.dtype.kind in "fc" else 0
        value = np.full_like(self._like, fill)
        head[_PENDING] = self._survive and self.loss_known()
        head[_MINE] = 0
        if res is not None:
            expired = res.deadline_expired
            data, head[_MINE] = self.took(res)
            head[:_FAILED] = (self._offset + res.round, res.included, res.count, res.missed,
                              res.flushed,
                              -1 if expired is None else expired,
                              np.nan if res.deadline is None else res.deadline)
            # the leaders' ranks now (fewer after a lost leader) -> their hosts; a result of an
            # execution that still spanned every leader (settled by the survivors and
            # reported with the loss already in ``lost``) names the leaders as they were
            at = [i for i in range(n) if i not in res.lost]
            if res.world_size == n:
                at = list(range(n))
            head[_FIELDS:_FIELDS + 2 * n] = 0
            for i in res.contributors:
                head[_FIELDS + at[i]] = 1
            for i in res.fresh:
                head[_FIELDS + n + at[i]] = 1
            for i, t in res.arrivals.items():
                head[_FIELDS + 2 * n + at[i]] = t
            value[...] = data
        head = await host.broadcast(head, 0, timeout)
        if head[_FAILED]:
            if err is not None:
                raise err
            raise ExecutionError(f"hierarchical partial allreduce {self.name!r}: the call of "
                                 "this host's leader failed (see its error)")
        value = await host.allreduce(value, timeout=timeout)
        self.handed(bool(head[_PENDING]), int(head[_MINE]), int(head[_ROUND]))
        return self._result(value, head)

    def _result(self, value: Any, head: np.ndarray[Any, Any]) -> PartialResult:
        n = len(self._hosts)

        def ranks(flags: np.ndarray[Any, Any]) -> frozenset[int]:
            return frozenset(r for i in np.flatnonzero(flags) for r in self._hosts[i])

        arrivals = {r: float(t) for i, t in enumerate(head[_FIELDS + 2 * n:])
                    if not np.isnan(t) for r in self._hosts[i]}
        expired = int(head[_EXPIRED])
        deadline = float(head[_DEADLINE])
        rank = self._comm.rank
        return PartialResult(
            value, int(head[_ROUND]), bool(head[_INCLUDED]),
            ranks(head[_FIELDS:_FIELDS + n]), int(head[_COUNT]), int(head[_MISSED]),
            ranks(head[_FIELDS + n:_FIELDS + 2 * n]), bool(head[_FLUSHED]), arrivals,
            arrivals.get(rank), max(arrivals.values()) if arrivals else None,
            None if np.isnan(deadline) else deadline, None if expired < 0 else bool(expired),
            self._comm.size)

    def __repr__(self) -> str:
        return (f"HierPartialAllreduce({self.policy!r}, name={self.name!r}, "
                f"hosts={self._hosts or 'not yet known'})")


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
