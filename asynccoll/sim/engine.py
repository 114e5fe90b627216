"""The discrete-event core: virtual time, messages, and an interpreter of committed schedules.

:class:`SimWorld` holds the clock (a heap of timed events), the cost model
(:class:`~asynccoll.sim.cost.Profile`) and the message fabric of P ranks. :class:`SimExecutor`
runs one rank's committed :class:`~asynccoll.sched.Schedule` with the semantics of
:class:`asynccoll.sched.Executor` (read its module doc; this is the same machine in virtual
time):

* an execution is **armed** (its source receives posted), **started** from inside
  (:meth:`SimExecutor.start`: the other sources fire) or activated from outside (a source
  receive completes), and completes when the final op completes; a **persistent** executor
  re-arms at once, a non-persistent one on the next start;
* an op fires once ``k`` of its dependencies have completed, at most once per execution
  (consumable), in the executor's deterministic order (a FIFO of ready ops, successors in
  op-id order);
* messages are matched by (source, schedule id, execution, tag); a message of a future
  execution is held until that execution is armed; an activation message of a finished
  execution is dropped; a data message of a finished execution is an error.

Time: firing an op costs the rank's CPU (``gamma``, plus bytes over ``reduce_bps`` for compute
ops; no-ops are free), serialised per rank; a send leaves after the rank's interface has
pushed the bytes before it and arrives ``alpha`` later (see :mod:`.cost`). Completions at the
current time are handled inline, as the executor's drain loop does; later ones are events,
except those handled as their op fires (next paragraph).

**Completions handled as they fire.** When everything a receive or a compute op can make
ready is a send, a receive, or a compute op that does not read the clock, each waiting for all
its dependencies and each one the final op waits for (through all-of dependencies), its
completion is handled when it fires (the receive: when its message is taken), not at its
completion time: the ops it makes ready fire at once, and their CPU work queues on the rank
behind its own, so none starts before it completes. That is the runtime's drain loop: a compute
op runs inline and the send it enables goes out before the event loop reads what arrived
meanwhile (the rank's CPU then serves this chain before a message that came in during it, where
one event per completion served them in time order). A send's completion (its bytes pushed out)
is handled when it is posted likewise, when all it can make ready are such sends and compute
ops; they start no sooner than that time (a per-op floor, reset at arming), and where the rank's
CPU would sit idle until then, the op fires at that time (an event), leaving the CPU to other
work meanwhile. Ops that read the clock (hooked kernels, the ``clocked`` ones), no-ops and the
final op are never fired ahead of their time; a k-of-n op is never made ready by a completion
not yet due (another dependency might have been first), and an execution never completes
before the completions handled ahead of time are due. What is left is about one event per
message (the solo run of issue 17 at P = 1024: 9.6 M events instead of 20.5 M).

**Data or timing only.** With ``kernels`` (a kernel registry, e.g.
:data:`asynccoll.collectives.KERNELS`) and bound ``buffers``, sends carry copies of their
buffers' bytes (or a compute op's :class:`~asynccoll.sched.Payload`), receives write into
theirs, and compute ops run the real kernels, so values equal a real run's. Without buffers
the simulator moves no data: it prices each op by the bytes its slots declare and calls only
the ``hooks`` given for some kernels (the partial allreduce's snapshot, for its accounting),
which is what makes P = 1024 cheap. The event loop is Python: about 1.9 µs of CPU per op
fired at P = 1024 on the development machine, a shared 2-core EPYC whose timings vary by
±15 % from run to run (docs/sim.md, "Cost of a simulation", has the figures).

**What else keeps it cheap** (each without changing any result): the P executors share one copy
of the op tables (kinds, successors, thresholds, tags: a builder's ranks differ in peers only),
which keeps them in cache; the drain loop fires sends, compute ops and no-ops inline; and a
completion that cannot make any successor ready, whatever completes before it (the typical
send: its successor also waits for the matching receive), is **deferred** instead of scheduled:
it takes its event number as if scheduled, is counted when the executor next handles an event
after it, and becomes a real event, with that number, the moment another completion brings one
of its successors within reach of its threshold (before completions were handled as they fire,
a quarter of the events went that way; now it is the sends that are not handled so, e.g. those
a no-op waits for). When a completion would bring a successor to its threshold and the only
other completions it waits for are deferred ones, the latest of those (by time and number) is
the one that makes it ready: when that is a deferred one later than the new completion (a send
still being pushed out while the receive beside it already has its message), that one becomes
the event and the new one is deferred (:meth:`SimExecutor._defer_late`).
Further, per event:

* the clock is a heap of distinct **times** with a list of events per time (in event-number
  order), not a heap of events: recursive doubling's partners are symmetric, so about a fifth
  of the events share their time with another and cost no heap operation, and the heap
  compares floats, not tuples;
* every virtual time is a Python float: :meth:`SimWorld.at` converts what it is given, and
  :func:`~asynccoll.sim.run.simulate` hands it the compute times as floats (a NumPy scalar
  there made every time derived from it one too: the same IEEE doubles, at about ten times
  the cost of each addition and comparison);
* an executor's drain loop and its message receiver are closures over the tables and world
  state they read (:meth:`SimExecutor._make_handlers`), made once per executor; the drain
  loop does a send's :meth:`SimWorld.post` inline, and a message's delivery event is its
  receiver's closure (its endpoint looked up when it is sent, in a per-schedule list by rank;
  :meth:`SimWorld.attach` redirects those under way if an endpoint changes hands);
* a message that comes before its receive is posted is held in a list, not a deque (a deque
  allocates a block of 64 slots; it is almost always one message);
* each op counts down the completions it still waits for (``_left``, reset from the
  thresholds at arming), and deferred completions are a heap, so settling the ones an event
  passed costs one comparison when there are none; the drain loop settles them inline, and
  the message receiver defers a completion inline (both were method calls, each made on
  about a quarter of the events);
* arming posts the source receives (a dozen per execution at P = 1024, mostly activation
  receives that never get a message) by copying two prepared tables (the fired flags, the
  posted receives) when no message waits for the new execution, instead of taking each
  through the drain loop: that is all the loop would do with them, in the same order;
* :func:`~asynccoll.sim.run.simulate` turns the cyclic garbage collector off while it runs
  (its passes over the schedules' objects cost about 5 %), and the partial allreduce's
  timing mode keeps one meta vector per execution instead of two per rank (50 MB at
  P = 1024, streamed through the caches once per execution).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..buffers import dtype_to_wire
from ..errors import AsyncCollError
from ..sched import Kernel, Payload, Schedule
from ..transport.frames import PROTOCOL_VERSION, Format, Header, Kind, Message
from .cost import Profile

__all__ = ["SimWorld", "SimExecutor", "SimulationError", "Hook"]

_NOP, _SEND, _RECV, _COMPUTE = 0, 1, 2, 3
_KIND = {"nop": _NOP, "send": _SEND, "recv": _RECV, "compute": _COMPUTE}
_DATA, _ACT = int(Kind.DATA), int(Kind.ACTIVATION)

#: ``hook(rank, execution, op_id)``: called when an op of a hooked kernel fires (timing mode)
Hook = Callable[[int, int, int], None]


class SimulationError(AsyncCollError):
    """The simulated schedules did something the runtime treats as an error (a data message
    for a finished execution, a missing payload), or the simulation cannot proceed."""


class _Receipts(dict[int, float]):
    """What a pooled intra-host message of n bytes costs its receiver (``self[n]``):
    ``msg_cpu + n * per_byte * factor(n)`` (:mod:`.cost`), computed once per size."""

    def __init__(self, msg_cpu: float, per_byte: float, factor: Callable[[int], float]) -> None:
        super().__init__()
        self._m, self._b, self._f = msg_cpu, per_byte, factor

    def __missing__(self, n: int) -> float:
        v = self[n] = self._m + n * self._b * self._f(n)
        return v


class SimWorld:
    """P ranks in virtual time priced by ``profile``. ``at(t, fn, *args)`` schedules
    ``fn(*args)`` at virtual time ``t``; :meth:`run` processes events in time order (ties in
    the order they were scheduled). Costs a dict look-up per event, and a heap operation per
    distinct time."""

    def __init__(self, world_size: int, profile: Profile) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(profile, Profile):
            raise TypeError(f"profile must be a Profile, got {type(profile).__name__}")
        self.world_size = world_size
        self.profile = profile
        self.now = 0.0
        #: the scheduling number of the event being processed (``now``'s tie-breaker)
        self.now_seq = -1
        #: pending events by time: ``pending[t]`` lists ``(seq, fn, a, b)`` in ``seq`` order,
        #: and ``fn(a, b)`` runs at ``t`` (two arguments, not ``*args``: an op's completion is
        #: most events, and saves a tuple); ``times`` is a heap of the keys of ``pending``
        self.pending: dict[float, list[tuple[int, Callable[[Any, Any], None], Any, Any]]] = {}
        self.times: list[float] = []
        #: the tie-breaker of events at one time (scheduling order)
        self.seq = itertools.count()
        scale = profile.cpu_scale
        self.gamma = profile.gamma * scale
        self.reduce_spb = scale / profile.reduce_bps
        self.cpu_free = [0.0] * world_size
        self.nic_free = [0.0] * world_size
        rph = profile.ranks_per_host
        #: the pool of cores (:mod:`.cost`): per host, when each core is next free
        self.pooled = profile.pooled
        self.cores_free = [[0.0] * max(profile.cores, 1)
                           for _ in range((world_size + rph - 1) // rph)] if self.pooled else []
        self.host = [r // rph for r in range(world_size)]
        self._one_per_host = rph == 1
        # more ranks than cores on a host: a message between two of them is CPU work too
        # (loopback or shared memory: no wire), so it slows down as the CPU does
        self.intra = (profile.intra.alpha * scale, profile.intra.beta * scale)
        self.inter = (profile.inter.alpha, profile.inter.beta)
        #: with the pool, what an intra-host message of n bytes costs its receiver beyond gamma
        #: (``receipt_cpu[n]``, memoised by size; :mod:`.cost`)
        self.receipt_cpu = _Receipts(profile.msg_cpu if self.pooled else 0.0, self.intra[1],
                                     profile.byte_factor)
        #: with the pool, a receipt at a rank idle for a while costs up to this much more
        self.wake_cpu = profile.wake_cpu if self.pooled else 0.0
        self.endpoints: dict[tuple[int, int], SimExecutor] = {}
        #: the endpoints by schedule id, as lists by rank (what a send reads)
        self._by_sid: dict[int, list[SimExecutor | None]] = {}
        #: the op tables the executors share: the ranks' schedules of one builder differ in
        #: peers and tags only, so P executors read one copy (and keep it in cache)
        self.tables: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.messages = 0
        self.dropped = 0
        self.events = 0

    # -- the clock ---------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (not before now). ``t`` is made a Python
        float: a NumPy scalar would make every time derived from it one too (same values, ~10x
        the cost per operation)."""
        t = float(t)
        self.push(t if t > self.now else self.now, next(self.seq), _apply, fn, args)

    def push(self, t: float, q: int, fn: Callable[[Any, Any], None], a: Any, b: Any) -> None:
        """Run ``fn(a, b)`` at ``t`` (>= now) as the event numbered ``q`` (from :attr:`seq`;
        ``(t, q)`` after the event being processed). One dict look-up, and a heap push for a
        time not pending yet."""
        bucket = self.pending.get(t)
        if bucket is None:
            self.pending[t] = [(q, fn, a, b)]
            heapq.heappush(self.times, t)
        elif q > bucket[-1][0]:
            bucket.append((q, fn, a, b))
        else:  # a deferred completion made an event (module doc): its number is an old one
            bisect.insort(bucket, (q, fn, a, b), key=_first)

    def run(self, until: float | None = None, max_events: int | None = None) -> None:
        """Process events until none is left (or virtual time passes ``until``, or
        ``max_events`` were processed)."""
        times, pending = self.times, self.pending
        pop = heapq.heappop
        limit = -1 if max_events is None else max_events
        n = 0
        bucket: list[tuple[int, Callable[[Any, Any], None], Any, Any]] = []
        t = 0.0
        try:
            while times and limit:
                t = times[0]
                if until is not None and t > until:
                    break
                bucket = pending[t]
                self.now = t
                if limit < 0:
                    # the common case: the list iterator also yields the events that those
                    # before them add at t (appended, or inserted after the current one)
                    for q, fn, a, b in bucket:
                        self.now_seq = q
                        fn(a, b)
                    n += len(bucket)
                else:
                    done = 0
                    while done < len(bucket) and done < limit:
                        q, fn, a, b = bucket[done]
                        self.now_seq = q
                        done += 1
                        fn(a, b)
                    n += done
                    limit -= done
                    if done < len(bucket):
                        del bucket[:done]
                        break
                pop(times)
                del pending[t]
        except BaseException:
            # drop what ran of the bucket, the failed event included (as a heap pop would)
            done = 1 + next(j for j, x in enumerate(bucket) if x[0] == self.now_seq)
            n += done
            del bucket[:done]
            if not bucket:
                pop(times)
                del pending[t]
            raise
        finally:
            self.events += n

    @property
    def idle(self) -> bool:
        """True when no event is pending."""
        return not self.times

    # -- costs -------------------------------------------------------------------------------
    def cpu(self, rank: int, cost: float, at: float | None = None, wake: bool = False) -> float:
        """Occupy ``rank``'s CPU for ``cost`` seconds from ``at`` (default now), or when it
        frees; return when the work is done. ``wake``: as :meth:`charge`'s (only the pool
        prices it)."""
        start = self.now if at is None else at
        if self.pooled:
            return self.charge(rank, start, cost, wake)
        t = self.cpu_free[rank]
        if t < start:
            t = start
        t += cost
        self.cpu_free[rank] = t
        return t

    def charge(self, rank: int, ready: float, cost: float, wake: bool = False) -> float:
        """The pool (:mod:`.cost`): ``rank``'s work of ``cost`` seconds, ready at ``ready``,
        runs once the rank's earlier work is done, on the core of its host free latest before
        then (leaving the earlier free ones to others) or, when none is, on the first to free.
        ``wake``: the work wakes the rank (a message's receipt, a call), which costs more at a
        rank that has been idle (:meth:`~.cost.Profile.wake_extra`). Returns when it is
        done."""
        t = self.cpu_free[rank]
        if wake and self.wake_cpu:
            cost += self.profile.wake_extra(ready - t)
        if t < ready:
            t = ready
        cores = self.cores_free[self.host[rank]]
        best = -1
        for j, c in enumerate(cores):
            if c <= t and (best < 0 or c > cores[best]):
                best = j
        if best < 0:
            best = min(range(len(cores)), key=cores.__getitem__)
            t = cores[best]
        t += cost
        cores[best] = t
        self.cpu_free[rank] = t
        return t

    def post(self, src: int, dst: int, sid: int, execution: int, tag: int, kind: int,
             nbytes: int, data: Any, header: tuple[str, tuple[int, ...], int] | None) -> float:
        """Send a message: returns when the sender's interface has pushed it (the send op's
        completion) and schedules its delivery at ``dst``. The delivery event is placed
        ``gamma`` after the arrival, when the receiver would be done with it if its CPU is free
        (saving an event per message; a busy receiver schedules the completion later)."""
        g = self.gamma
        now = self.now
        if self.pooled:
            t = self.charge(src, now, g)
        else:
            t = self.cpu_free[src]
            if t < now:
                t = now
            t += g
            self.cpu_free[src] = t
        # with the pool, an intra-host message is its receiver's CPU work beyond gamma (x),
        # booked from its arrival: delivered then (delay 0), not when an idle receiver would be
        # done with it, so that work ready later does not take the core first
        pool_msg = self.pooled and src != dst and self.host[src] == self.host[dst]
        x = self.receipt_cpu[nbytes] if pool_msg else 0.0
        msg = (src, execution, tag * self.world_size + src, kind, nbytes, data, header, x,
               0.0 if pool_msg else g)
        # straight to the executor (attach() keeps that right if the endpoint changes hands)
        ex = self.endpoints.get((dst, sid))
        if src == dst:
            out = t
            t += g  # >= now: what at() would clamp to
        else:
            a, b = self.inter if self._one_per_host or self.host[src] != self.host[dst] \
                else self.intra
            if pool_msg:
                b = 0.0  # the bytes are the receiver's CPU work (x)
            t0 = self.nic_free[src]
            if t0 < t:
                t0 = t
            out = t0 + nbytes * b
            self.nic_free[src] = out
            self.messages += 1
            t = out + a + (0.0 if pool_msg else g)
        if ex is None:
            self.push(t, next(self.seq), self.deliver, (dst, sid), msg)
            return out
        # push(), inlined: a message is a third of the events
        bucket = self.pending.get(t)
        if bucket is None:
            self.pending[t] = [(next(self.seq), ex.receiver, msg, ex)]
            heapq.heappush(self.times, t)
        else:
            bucket.append((next(self.seq), ex.receiver, msg, ex))
        return out

    def deliver(self, endpoint: tuple[int, int], msg: tuple[Any, ...]) -> None:
        """A delivery event for a message sent while nobody ran its schedule at ``endpoint``
        (rank, schedule id): given to whoever does now, else dropped."""
        ex = self.endpoints.get(endpoint)
        if ex is None:
            self.dropped += 1  # nobody runs that schedule (any more): as a closed endpoint
            return
        ex.deliver(msg)

    def endpoint_list(self, sid: int) -> list[SimExecutor | None]:
        """The endpoints of schedule id ``sid`` by rank (None: nobody runs it there); the
        list stays the same object, updated in place by :meth:`attach`."""
        eps = self._by_sid.get(sid)
        if eps is None:
            eps = self._by_sid[sid] = [None] * self.world_size
        return eps

    def attach(self, ex: SimExecutor) -> None:
        """Make ``ex`` the endpoint of its rank and schedule id: messages to it, including
        those under way to an executor it replaces, go to ``ex``."""
        key = (ex.rank, ex.sched_id)
        old = self.endpoints.get(key)
        self.endpoints[key] = ex
        self.endpoint_list(ex.sched_id)[ex.rank] = ex
        if old is not None:
            for bucket in self.pending.values():
                bucket[:] = [(q, ex.receiver, a, ex) if fn is old.receiver else (q, fn, a, b)
                             for q, fn, a, b in bucket]


class SimExecutor:
    """One rank's committed ``schedule`` in ``world`` under ``sched_id`` (module doc).

    ``buffers`` (slot -> NumPy array) and ``kernels`` run it with data; without buffers it
    runs timing only, calling ``hooks[kernel](rank, execution, op)`` when a compute op of a
    hooked kernel fires. ``on_complete(e)`` runs when execution ``e`` completes, before a
    persistent executor re-arms. ``clocked`` names the kernels that read the clock (as hooks
    may): their ops are fired at their own time, never ahead of it (module doc). Raises
    ``ValueError`` for an uncommitted schedule, a missing buffer or kernel.
    """

    # P executors: slots keep each one small and its attributes one load away
    __slots__ = ("_data", "_draining", "_early", "_final", "_fired", "_floor", "_held", "_hooks",
                 "_kernels", "_key", "_kind", "_lazy", "_left", "_lmax", "_loop", "_msg", "_msgs",
                 "_n", "_nbytes", "_no_floor", "_payloads", "_peer", "_pend", "_posted", "_ready",
                 "_recv_sources", "_silent", "_source_fired", "_source_posts", "_start_sources",
                 "_succ", "_tag", "_thr", "_unfired", "_views", "armed", "completed", "execution",
                 "on_complete", "persistent", "rank", "receiver", "sched_id", "schedule", "started",
                 "world")

    def __init__(self, world: SimWorld, schedule: Schedule, *, sched_id: int,
                 persistent: bool = False, buffers: Mapping[str, Any] | None = None,
                 kernels: Mapping[str, Kernel] | None = None,
                 hooks: Mapping[str, Hook] | None = None,
                 on_complete: Callable[[int], None] | None = None,
                 clocked: Iterable[str] = ()) -> None:
        if not schedule.committed:
            raise ValueError(f"schedule {schedule.name!r} must be committed")
        if schedule.world_size != world.world_size:
            raise ValueError(f"schedule is for P = {schedule.world_size}, the world has "
                             f"P = {world.world_size}")
        self.world = world
        self.schedule = schedule
        self.rank = schedule.rank
        self.sched_id = sched_id
        self.persistent = persistent
        self.on_complete = on_complete
        c = _compiled(schedule)
        # sequences: lists here, the world's shared tuples once built (below)
        self._kind: Sequence[int] = c.kind
        self._succ: Sequence[Sequence[int]] = c.succ
        self._thr: Sequence[int] = c.thr
        self._start_sources, self._recv_sources = c.start_sources, c.recv_sources
        self._final = c.final
        self._peer = c.peer
        self._tag: Sequence[int] = c.tag
        self._msg: Sequence[int] = c.msg
        self._nbytes: Sequence[int] = c.nbytes
        # ops whose completion nobody waits for (activation and arrival sends): completing
        # them would only cost an event
        self._silent: bytes | bytearray = bytearray(1 if not c.succ[i] and i != c.final else 0
                                 for i in range(len(schedule.ops)))
        self._n = len(schedule.ops)
        self._data = buffers is not None
        hook_of: list[Hook | None] = [None] * self._n
        self._kernels: list[Kernel | None] = [None] * self._n
        self._views: list[Any] = [None] * self._n
        ops = schedule.ops
        if self._data:
            assert buffers is not None
            if kernels is None:
                raise ValueError("kernels are needed to run a schedule with data")
            self._bind(buffers, kernels)
        else:
            for i, op in enumerate(ops):
                if op.kind == "compute" and hooks and op.kernel in hooks:
                    hook_of[i] = hooks[op.kernel]
        self._hooks: Sequence[Hook | None] = hook_of
        self._early = _early_table(schedule, c, [
            op.kind == "compute" and (hook_of[i] is not None or op.kernel in clocked)
            for i, op in enumerate(ops)])
        self.execution = 0
        self.completed = -1
        self.armed = False
        self.started = False
        self._unfired = bytes(self._n)
        #: what arming does to the source receives when no message waits for the execution
        #: (:meth:`_arm`): each is fired and posted under its key
        fired_sources = bytearray(self._n)
        for i in self._recv_sources:
            fired_sources[i] = 1
        self._source_fired = bytes(fired_sources)
        #: per op, how many more completions it waits for (its threshold at each arming)
        self._left = [0] * self._n
        self._fired = bytearray(self._n)
        #: deferred completions (module doc): a heap of (time, event seq, op), and per op how
        #: many of them count towards it
        self._lazy: list[tuple[float, int, int]] = []
        self._pend = [0] * self._n
        #: per op with a pending count, the latest of its deferred completions (what
        #: :meth:`_defer_late` asks; kept as they come and go, so no pass over them per ask)
        self._lmax: dict[int, tuple[float, int, int]] = {}
        #: per op, the time before which its work cannot start (a send handled when it was
        #: posted made it ready: module doc), reset at arming
        self._no_floor = [0.0] * self._n
        self._floor = [0.0] * self._n
        self._ready: deque[int] = deque()
        self._draining = False
        self._posted: dict[int, int] = {}
        #: messages that came before their receive was posted: execution -> (source, tag) ->
        #: messages in arrival order (lists: almost always one, and a deque costs a block)
        self._held: dict[int, dict[int, list[tuple[Any, ...]]]] = {}
        self._msgs: dict[int, Message] = {}
        self._payloads: dict[int, Payload] = {}
        table = (tuple(self._kind), tuple(tuple(x) for x in self._succ), tuple(self._thr),
                 bytes(self._silent), tuple(self._hooks), tuple(self._msg), tuple(self._tag),
                 self._early, None if self._data else tuple(self._nbytes))
        table = world.tables.setdefault(table, table)
        (self._kind, self._succ, self._thr, self._silent, self._hooks, self._msg,
         self._tag, self._early) = table[:8]
        if table[8] is not None:
            self._nbytes = table[8]
        #: per op, the key its message is matched by, tag * P + the sending rank (an int: no
        #: tuple to build and hash per message): a receive's peer, a send's own rank
        P = world.world_size
        self._key = [self._tag[i] * P + (self.rank if k == _SEND else self._peer[i])
                     if k in (_SEND, _RECV) else -1 for i, k in enumerate(self._kind)]
        self._source_posts = {self._key[i]: i for i in self._recv_sources}
        #: a delivery event's function, ``receiver(message, self)`` (:meth:`deliver`)
        self._loop, self.receiver = self._make_handlers()
        world.attach(self)
        if persistent:
            self._arm()

    # -- binding (data mode) -----------------------------------------------------------------
    def _bind(self, buffers: Mapping[str, Any], kernels: Mapping[str, Kernel]) -> None:
        bound: dict[str, np.ndarray] = {}
        nb = list(self._nbytes)
        for slot in self.schedule.slots:
            if slot not in buffers:
                raise ValueError(f"buffer for slot {slot!r} is missing (slots: "
                                 f"{sorted(self.schedule.slots)})")
            bound[slot] = np.asarray(buffers[slot]).reshape(-1)

        def view(ref: Any) -> Any:
            if ref is None:
                return None
            a = bound[ref.slot]
            end = a.size if ref.count is None else ref.offset + ref.count
            return a[ref.offset:end]

        for i, op in enumerate(self.schedule.ops):
            if op.kind in ("send", "recv"):
                self._views[i] = view(op.buf)
                if self._views[i] is not None:
                    nb[i] = int(self._views[i].nbytes)
            elif op.kind == "compute":
                fn = kernels.get(op.kernel)
                if fn is None:
                    raise ValueError(f"op {i} {op.describe()}: kernel {op.kernel!r} is not in "
                                     f"the registry (registered: {sorted(kernels)})")
                self._kernels[i] = fn
                out = view(op.output)
                self._views[i] = (out, [view(r) for r in op.inputs])
                nb[i] = 0 if out is None else int(out.nbytes)
        self._nbytes = nb

    # -- control -----------------------------------------------------------------------------
    def start(self) -> None:
        """Activate the current execution from inside (idempotent per execution)."""
        if not self.armed:
            self._arm()
        if not self.started:
            self.started = True
            self._ready.extend(self._start_sources)
            self._drain()

    def _arm(self) -> None:
        # in place: the drain loop holds these lists across a re-arm
        self._left[:] = self._thr
        self._floor[:] = self._no_floor
        if self._lazy:
            self._drop_lazy()
        self._posted.clear()
        self._msgs.clear()
        self._payloads.clear()
        self.armed = True
        self.started = False
        if self._ready or self._held.get(self.execution):
            # messages came first for this execution: the drain loop matches them in order
            self._fired[:] = self._unfired
            self._ready.extend(self._recv_sources)
            self._drain()
        else:
            # nothing is ready and no message waits: firing the source receives, in op order
            # (the drain loop's), only posts them, which is what these two copies do at once
            # (an execution's dozen of posts, through the loop, cost ~2 % of a P = 1024 run)
            self._fired[:] = self._source_fired
            self._posted.update(self._source_posts)

    # -- messages ----------------------------------------------------------------------------
    def deliver(self, msg: tuple[Any, ...]) -> None:
        """A message arrives (``(src, execution, tag, kind, nbytes, data, header, extra
        receive cost, delay of this delivery after the arrival)``)."""
        self.receiver(msg, self)

    def _refuse(self, msg: tuple[Any, ...]) -> None:
        # a message for an execution that completed here
        if msg[3] == _ACT:
            self.world.dropped += 1
            return
        raise SimulationError(f"rank {self.rank}: data message from rank {msg[0]} tag "
                              f"{msg[2] // self.world.world_size} for execution {msg[1]}, "
                              "which completed here")

    def _recv_arrived(self, i: int, msg: tuple[Any, ...], arrived: float,
                      wake: bool = True) -> None:
        """A message for the posted receive op ``i``, arrived at ``arrived``; ``wake``: price
        its wake-up here (a held message's was priced when it came)."""
        w = self.world
        t = w.cpu(self.rank, w.gamma + msg[7], arrived, wake)
        e = self.execution
        if self._data:
            arr = self._views[i]
            data, header = msg[5], msg[6]
            if arr is not None and data is not None:
                if arr.nbytes != data.nbytes:
                    op = self.schedule.ops[i]
                    raise SimulationError(
                        f"rank {self.rank} op {i} {op.describe()}: rank {msg[0]} sent "
                        f"{data.nbytes} bytes, expected {arr.nbytes}")
                arr[...] = data.view(arr.dtype).reshape(arr.shape)
            if header is not None or data is not None:
                self._msgs[i] = _message(msg, self.sched_id, self.world.world_size)
        if self._silent[i]:
            return
        succ = self._succ[i]
        if succ:
            fired = self._fired
            for s in succ:
                if not fired[s]:
                    break
            else:
                return  # nobody waits for it any more: e.g. arrivals past a reached quorum
        if t <= w.now + 1e-15 or self._early[i]:
            self._complete(i)
        else:
            w.push(t, next(w.seq), self._loop, i, e)

    # -- the engine --------------------------------------------------------------------------
    def _drain(self) -> None:
        if not self._draining:
            self._loop(-1, self.execution)

    def _make_handlers(self) -> tuple[Callable[[int, int], None],
                                      Callable[[tuple[Any, ...], Any], None]]:
        """The executor's drain loop and message receiver, closures over what they read per
        op (no attribute look-ups or unpacking per call; each of those is mutated in place
        only, never rebound)."""
        ex = self
        world = self.world
        ready = self._ready
        fired, left, succ, kind = self._fired, self._left, self._succ, self._kind
        final, silent, nbytes, hooks = self._final, self._silent, self._nbytes, self._hooks
        early, floor = self._early, self._floor
        pooled, charge, rcpu = world.pooled, world.charge, world.receipt_cpu
        wake_cpu, wake_extra = world.wake_cpu, world.profile.wake_extra
        g, spb, rank, data = world.gamma, world.reduce_spb, self.rank, self._data
        push, seq, lazy, pend = world.push, world.seq, self._lazy, self._pend
        lmax = self._lmax
        heappop, heappush = heapq.heappop, heapq.heappush
        popleft, append, sid = ready.popleft, ready.append, self.sched_id
        peer, key_of, msgk = self._peer, self._key, self._msg
        held, posted = self._held, self._posted
        pending, pget, times, tpush = world.pending, world.pending.get, world.times, heapq.heappush
        cpu_free, nic_free, eps = world.cpu_free, world.nic_free, world.endpoint_list(sid)
        inter, intra, host = world.inter, world.intra, world.host
        myhost = host[rank]

        def loop(i: int, e: int) -> None:
            """Op ``i`` of execution ``e`` completed now (``i < 0``: none did; a completion of an
            execution no longer current is ignored); fire the ops that are ready until none is.
            ``_fire`` and ``_complete`` inlined for sends, compute ops and no-ops: this is the
            per-op work of a simulation, and the event an op's completion schedules."""
            if e != ex.execution or not ex.armed:
                return
            if ex._draining:
                if i >= 0:
                    ex._complete(i)
                return
            ex._draining = True
            try:
                w = world
                now = w.now
                if lazy:
                    # _settle, inlined: count the deferred completions before this event
                    cur = w.now_seq
                    x = lazy[0]
                    while x[0] < now or (x[0] == now and x[1] < cur):
                        heappop(lazy)
                        for s in succ[x[2]]:
                            left[s] -= 1
                            pend[s] -= 1
                            if not pend[s]:
                                del lmax[s]
                        if not lazy:
                            break
                        x = lazy[0]
                while True:
                    if i >= 0:  # op i completed now
                        if i == final:
                            ex._finish()
                            e = ex.execution
                        else:
                            for s in succ[i]:
                                c = left[s] - 1
                                left[s] = c
                                if not c:
                                    append(s)
                                elif lazy and c > 0 and pend[s] >= c:
                                    ex._unlazy()
                    if not ready:
                        return
                    i = popleft()
                    if fired[i]:
                        i = -1
                        continue
                    if floor[i] > now and floor[i] > cpu_free[rank]:
                        # a send handled when posted made it ready, and the CPU would sit idle
                        # until the send's bytes are out: fire it then (an event), leaving the
                        # CPU to other work meanwhile
                        push(floor[i], next(seq), refire, i, e)
                        i = -1
                        continue
                    fired[i] = 1
                    k = kind[i]
                    if k == _SEND:
                        if data:
                            ex._send(i, e)
                            i = -1
                            continue
                        # SimWorld.post, inlined: a send is a third of the ops
                        dst = peer[i]
                        if pooled:
                            t = charge(rank, now, g)
                        else:
                            t = cpu_free[rank]
                            if t < now:
                                t = now
                            t += g
                            cpu_free[rank] = t
                        if dst == rank:
                            msg = (rank, e, key_of[i], msgk[i], nbytes[i], None, None, 0.0, g)
                            tq = t + g
                        else:
                            if host[dst] != myhost or not pooled:
                                a, b = inter if host[dst] != myhost else intra
                                msg = (rank, e, key_of[i], msgk[i], nbytes[i], None, None, 0.0,
                                       g)
                                d = g
                            else:
                                # the pool: the message is its receiver's CPU work, booked
                                # from its arrival (SimWorld.post)
                                a, b = intra
                                msg = (rank, e, key_of[i], msgk[i], nbytes[i], None, None,
                                       rcpu[nbytes[i]], 0.0)
                                b = 0.0
                                d = 0.0
                            tq = nic_free[rank]
                            if tq < t:
                                tq = t
                            t = tq + nbytes[i] * b
                            nic_free[rank] = t
                            w.messages += 1
                            tq = t + a + d
                        to = eps[dst]
                        if to is None:
                            push(tq, next(seq), w.deliver, (dst, sid), msg)
                        elif (bucket := pget(tq)) is None:
                            pending[tq] = [(next(seq), to.receiver, msg, to)]
                            tpush(times, tq)
                        else:
                            bucket.append((next(seq), to.receiver, msg, to))
                        if silent[i]:
                            i = -1
                        elif t > now and early[i]:
                            # handled now: what it makes ready starts no sooner than t
                            for s in succ[i]:
                                if floor[s] < t:
                                    floor[s] = t
                        elif t > now:
                            # _defer, inlined
                            q = next(seq)
                            if i != final:
                                for s in succ[i]:
                                    if 0 < left[s] <= pend[s] + 1:
                                        break
                                else:
                                    x = (t, q, i)
                                    heappush(lazy, x)
                                    for s in succ[i]:
                                        pend[s] += 1
                                        m = lmax.get(s)
                                        if m is None or x > m:
                                            lmax[s] = x
                                    i = -1
                                    continue
                                if lazy:
                                    ex._defer_late(i, t, q, e)
                                    i = -1
                                    continue
                            push(t, q, loop, i, e)
                            i = -1
                    elif k == _RECV:
                        key = key_of[i]
                        hq = held.get(e) if held else None
                        mq = hq.get(key) if hq is not None else None
                        if not mq:
                            posted[key] = i
                            i = -1
                        elif data:
                            ex._fire_recv(i, e)
                            i = -1
                        else:
                            # _fire_recv and _recv_arrived without data, inlined: a message that
                            # came before its receive was posted
                            msg = mq.pop(0)
                            if not mq:
                                del hq[key]  # type: ignore[union-attr]
                            if pooled:  # its wake-up was priced when it came (recv)
                                t = charge(rank, now, g + msg[7])
                            else:
                                t = cpu_free[rank]
                                if t < now:
                                    t = now
                                t += g + msg[7]
                                cpu_free[rank] = t
                            if silent[i]:
                                i = -1
                                continue
                            for s in succ[i]:
                                if not fired[s]:
                                    break
                            else:
                                if succ[i]:
                                    i = -1
                                    continue
                            if t > now + 1e-15 and not early[i]:
                                if lazy:
                                    ex._defer(i, t, e)
                                else:
                                    push(t, next(seq), loop, i, e)
                                i = -1
                    elif k != _NOP:
                        if pooled:
                            t = charge(rank, now, g + nbytes[i] * spb)
                        else:
                            t = cpu_free[rank]
                            if t < now:
                                t = now
                            t += g + nbytes[i] * spb
                            cpu_free[rank] = t
                        if data:
                            ex._run_kernel(i)
                        else:
                            h = hooks[i]
                            if h is not None:
                                h(rank, e, i)
                        if t > now and not early[i]:
                            # push(), inlined: a compute op's completion is a third of the events
                            bucket = pget(t)
                            if bucket is None:
                                pending[t] = [(next(seq), loop, i, e)]
                                tpush(times, t)
                            else:
                                bucket.append((next(seq), loop, i, e))
                            i = -1
            finally:
                ex._draining = False

        def recv(msg: tuple[Any, ...], _to: Any) -> None:
            """:meth:`deliver` (a delivery event's function: ``recv(message, executor)``)."""
            _src, e, key, _kind, _nbytes, _data, _header, extra, delay = msg
            cur = ex.execution
            if e < cur or (e == cur and not ex.armed and ex.completed == e):
                ex._refuse(msg)
                return
            if e == cur and ex.armed:
                i = posted.pop(key, -1)
                if i >= 0:
                    now = world.now
                    if data:
                        ex._recv_arrived(i, msg, now - delay)
                        return
                    # _recv_arrived without data, inlined (one of every op's few events)
                    arrived = now - delay
                    if pooled:
                        t = charge(rank, arrived, g + extra, True)
                    else:
                        t = cpu_free[rank]
                        if t < arrived:
                            t = arrived
                        t += g + extra
                        cpu_free[rank] = t
                    if silent[i]:
                        return
                    sc = succ[i]
                    if sc:
                        for s in sc:
                            if not fired[s]:
                                break
                        else:
                            return
                    if t <= now + 1e-15 or early[i]:
                        loop(i, e)
                        return
                    # _defer, inlined: the CPU was busy when the message came (common: the
                    # data and the meta allreduce share it)
                    q = next(seq)
                    if i != final:
                        for s in sc:
                            if 0 < left[s] <= pend[s] + 1:
                                break
                        else:
                            x = (t, q, i)
                            heappush(lazy, x)
                            for s in sc:
                                pend[s] += 1
                                m = lmax.get(s)
                                if m is None or x > m:
                                    lmax[s] = x
                            return
                        if lazy:
                            ex._defer_late(i, t, q, e)
                            return
                    push(t, q, loop, i, e)
                    return
            if wake_cpu:
                # its receipt is booked when its receive is posted, but the rank woke for it
                # now: the wake-up is priced by how long the rank had idled before it came
                woke = wake_extra(world.now - delay - cpu_free[rank])
                if woke:
                    msg = (*msg[:7], extra + woke, delay)
            hq = held.get(e)
            if hq is None:
                held[e] = {key: [msg]}
            elif (mq := hq.get(key)) is None:
                hq[key] = [msg]
            else:
                mq.append(msg)

        def refire(i: int, e: int) -> None:
            """Fire op ``i`` of execution ``e`` now (its floor, above)."""
            if e == ex.execution and ex.armed and not fired[i]:
                append(i)
                loop(-1, e)

        return loop, recv

    def _fire_recv(self, i: int, e: int) -> None:
        key = self._key[i]
        held = self._held.get(e)
        q = None if held is None else held.get(key)
        if q:
            msg = q.pop(0)
            if not q:
                del held[key]  # type: ignore[union-attr]
            self._recv_arrived(i, msg, self.world.now, False)
        else:
            self._posted[key] = i

    def _send(self, i: int, e: int) -> None:
        w = self.world
        nbytes = self._nbytes[i]
        data: Any = None
        header: tuple[str, tuple[int, ...], int] | None = None
        if self._data:
            op = self.schedule.ops[i]
            if op.payload_from >= 0:
                p = self._payloads.get(op.payload_from)
                if p is None:
                    raise SimulationError(f"rank {self.rank} op {i}: compute op "
                                          f"{op.payload_from} returned no payload to send")
                data = np.frombuffer(bytes(memoryview(p.data).cast("B")), np.uint8)
                nbytes = int(data.nbytes)
                header = (p.dtype, tuple(p.shape), int(p.fmt))
            else:
                arr = self._views[i]
                if arr is not None:
                    data = arr.copy().view(np.uint8).reshape(-1)
                    header = (dtype_to_wire(arr.dtype), (arr.size,), int(Format.DENSE))
        t = w.post(self.rank, self._peer[i], self.sched_id, e, self._tag[i], self._msg[i],
                   nbytes, data, header)
        if self._silent[i]:
            return
        if t <= w.now or self._early[i]:
            floor = self._floor
            for s in self._succ[i]:
                if floor[s] < t:
                    floor[s] = t
            self._complete(i)
        else:
            w.push(t, next(w.seq), self._loop, i, e)

    def _run_kernel(self, i: int) -> None:
        op = self.schedule.ops[i]
        out, ins = self._views[i]
        msgs = [self._msgs[r] for r in op.recvs if r in self._msgs] if op.recvs else ()
        fn = self._kernels[i]
        assert fn is not None
        result = fn(out, ins, op.params, msgs)
        if result is not None:
            self._payloads[i] = result

    def _complete(self, i: int) -> None:
        if self._lazy and not self._draining:
            self._settle()
        if i == self._final:
            self._finish()
            return
        left, ready, pend = self._left, self._ready, self._pend
        for s in self._succ[i]:
            c = left[s] - 1
            left[s] = c
            if not c:
                ready.append(s)
            elif c > 0 and pend[s] >= c:
                self._unlazy()
        if not self._draining:
            self._drain()

    # -- deferred completions ------------------------------------------------------------------
    def _defer(self, i: int, t: float, e: int) -> None:
        """Op ``i`` completes at ``t`` (> now): an event, or, when that completion cannot make
        a successor ready whatever else completes first, a deferred completion (module doc)."""
        q = next(self.world.seq)
        if i != self._final:
            left, pend = self._left, self._pend
            succ = self._succ[i]
            for s in succ:
                if 0 < left[s] <= pend[s] + 1:
                    break
            else:
                x = (t, q, i)
                heapq.heappush(self._lazy, x)
                lmax = self._lmax
                for s in succ:
                    pend[s] += 1
                    m = lmax.get(s)
                    if m is None or x > m:
                        lmax[s] = x
                return
            if self._lazy:
                self._defer_late(i, t, q, e)
                return
        self.world.push(t, q, self._loop, i, e)

    def _defer_late(self, i: int, t: float, q: int, e: int) -> None:
        """Op ``i`` (not the final op) completes at ``(t, q)``, deferred completions are
        pending, and some successor waits for nothing else than this one and deferred ones:
        the latest of those makes it ready. When that is a deferred one later than ``(t, q)``
        (typically a send still being pushed out while the receive beside it has its message),
        it becomes an event, with its number, and this one is deferred instead; otherwise this
        one is an event. The latest deferred completion before each successor is kept as they
        come and go (``_lmax``): a quorum's rank defers O(P) sends, and a pass over them per
        call made a simulation O(P^3) (at P = 1000 most of its time); a pass is left only where
        a deferred completion that was some successor's latest becomes an event."""
        lazy, left, pend, succ, lmax = self._lazy, self._left, self._pend, self._succ, self._lmax
        mine = (t, q, i)
        late: list[tuple[float, int, int]] = []
        for s in succ[i]:
            c = left[s]
            if c <= 0 or c > pend[s] + 1:
                continue
            last = lmax.get(s) if c == pend[s] + 1 else None
            if last is None or last < mine:
                self.world.push(t, q, self._loop, i, e)
                return
            if last not in late:
                late.append(last)
        push, loop = self.world.push, self._loop
        for x in late:
            lazy.remove(x)
            for s in succ[x[2]]:
                pend[s] -= 1
                if lmax.get(s) == x:  # its latest left: the next latest, if any
                    if pend[s]:
                        lmax[s] = max(y for y in lazy if s in succ[y[2]])
                    else:
                        del lmax[s]
            push(x[0], x[1], loop, x[2], e)
        heapq.heapify(lazy)
        heapq.heappush(lazy, mine)
        for s in succ[i]:
            pend[s] += 1
            m = lmax.get(s)
            if m is None or mine > m:
                lmax[s] = mine

    def _settle(self) -> None:
        """Count the deferred completions that lie before the current event (none of them
        made a successor ready: :meth:`_unlazy` keeps it so)."""
        w = self.world
        now, cur = w.now, w.now_seq
        left, pend, succ = self._left, self._pend, self._succ
        lazy = self._lazy
        mark = (now, cur)
        lmax = self._lmax
        while lazy and lazy[0] < mark:
            i = heapq.heappop(lazy)[2]
            for s in succ[i]:
                left[s] -= 1
                pend[s] -= 1
                if not pend[s]:  # (the earliest of all: the latest of s only if it was alone)
                    del lmax[s]

    def _unlazy(self) -> None:
        """A deferred completion may now make a successor ready: make them all events, with
        the scheduling numbers they were given (so the event order is the same)."""
        push, e, event = self.world.push, self.execution, self._loop
        for t, q, i in self._lazy:
            push(t, q, event, i, e)
        self._drop_lazy()

    def _drop_lazy(self) -> None:
        # only the successors of deferred completions have a pending count: a few stores
        # instead of a copy of the whole table
        pend, succ = self._pend, self._succ
        for _t, _q, i in self._lazy:
            for s in succ[i]:
                pend[s] = 0
        self._lazy.clear()
        self._lmax.clear()

    def _finish(self) -> None:
        e = self.execution
        self.armed = False
        self._ready.clear()
        if self._lazy:
            self._drop_lazy()
        self.completed = e
        self._held.pop(e, None)
        self._posted.clear()
        if self.on_complete is not None:
            self.on_complete(e)
        self.execution = e + 1
        if self.persistent:
            self._arm()


class _Compiled:
    __slots__ = ("final", "kind", "msg", "nbytes", "peer", "recv_sources", "start_sources",
                 "succ", "tag", "thr")

    def __init__(self, s: Schedule) -> None:
        ops = s.ops
        self.kind = [_KIND[op.kind] for op in ops]
        self.succ = s.successors()
        self.thr = [op.k for op in ops]
        self.start_sources = [i for i, op in enumerate(ops) if not op.deps and op.kind != "recv"]
        self.recv_sources = [i for i, op in enumerate(ops) if not op.deps and op.kind == "recv"]
        assert s.final is not None
        self.final = s.final
        self.peer = [op.peer for op in ops]
        self.tag = [op.tag for op in ops]
        self.msg = [_ACT if op.msg == "activation" else _DATA for op in ops]
        self.nbytes = [_ref_bytes(s, op.buf) if op.kind in ("send", "recv") else
                       _ref_bytes(s, op.output) if op.kind == "compute" else 0 for op in ops]


def _early_table(s: Schedule, c: _Compiled, clocked: Sequence[bool]) -> bytes:
    """Per op, 1 where a completion is handled when the op fires (module doc, "Completions
    handled as they fire"): a send, a receive or a compute op, not the final op, whose
    successors are all sends, receives (not after a send) or compute ops that do not read the
    clock (``clocked``: hooked, or a kernel named so), each waiting for all its dependencies
    and one the final op waits for through all-of dependencies only. So every op fired ahead
    of its time is work the rank's CPU does after this one's, no k-of-n op is fired by a
    completion that was not yet due (it might have been another dependency's to fire), and
    no execution completes before the completions handled ahead of time are due."""
    kind, succ, thr, ops = c.kind, c.succ, c.thr, s.ops
    all_of = [thr[y] == len(op.deps) for y, op in enumerate(ops)]
    # the ops the final op waits for through all-of dependencies only
    needed = {c.final}
    stack = [c.final]
    while stack:
        y = stack.pop()
        if all_of[y]:
            for d in ops[y].deps:
                if d not in needed:
                    needed.add(d)
                    stack.append(d)
    out = bytearray(len(ops))
    for i, k in enumerate(kind):
        if k == _NOP or i == c.final or not succ[i]:
            continue
        out[i] = all(
            x != c.final and x in needed and all_of[x]
            and (kind[x] == _SEND or (kind[x] == _RECV and k != _SEND)
                 or (kind[x] == _COMPUTE and not clocked[x]))
            for x in succ[i])
    return bytes(out)


def _compiled(s: Schedule) -> _Compiled:
    """The schedule's op tables (a copy of ``nbytes``, which data mode refines per binding)."""
    c = _Compiled(s)
    c.nbytes = list(c.nbytes)
    return c


def _apply(fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    fn(*args)


def _first(entry: tuple[Any, ...]) -> Any:
    return entry[0]


def _ref_bytes(s: Schedule, ref: Any) -> int:
    """The bytes a buffer reference covers by the slot's declaration (0 when unknown)."""
    if ref is None:
        return 0
    spec = s.slots.get(ref.slot)
    if spec is None or spec.count is None:
        return 0
    n = spec.count - ref.offset if ref.count is None else ref.count
    return int(max(n, 0) * (np.dtype(spec.dtype).itemsize if spec.dtype else 4))


def _message(msg: tuple[Any, ...], sid: int, world_size: int) -> Message:
    src, e, key, kind, _nbytes, data, header = msg[:7]
    tag = key // world_size
    dtype, shape, fmt = header if header is not None else ("", (), int(Format.RAW))
    payload = memoryview(b"") if data is None else memoryview(data).cast("B")
    return Message(Header(PROTOCOL_VERSION, kind, sid, e, tag, src, dtype, shape, fmt,
                          len(payload)), payload)
