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
current time are handled inline, as the executor's drain loop does; later ones are events.

**Data or timing only.** With ``kernels`` (a kernel registry, e.g.
:data:`asynccoll.collectives.KERNELS`) and bound ``buffers``, sends carry copies of their
buffers' bytes (or a compute op's :class:`~asynccoll.sched.Payload`), receives write into
theirs, and compute ops run the real kernels, so values equal a real run's. Without buffers
the simulator moves no data: it prices each op by the bytes its slots declare and calls only
the ``hooks`` given for some kernels (the partial allreduce's snapshot, for its accounting),
which is what makes P = 1024 cheap. The event loop is Python; the per-op work is a few list
operations (about 2-4 µs per op fired on the development machine).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Mapping
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


class SimWorld:
    """P ranks in virtual time priced by ``profile``. ``at(t, fn, *args)`` schedules
    ``fn(*args)`` at virtual time ``t``; :meth:`run` processes events in time order (ties in
    the order they were scheduled). Costs one heap operation per event."""

    def __init__(self, world_size: int, profile: Profile) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(profile, Profile):
            raise TypeError(f"profile must be a Profile, got {type(profile).__name__}")
        self.world_size = world_size
        self.profile = profile
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        scale = profile.cpu_scale
        self.gamma = profile.gamma * scale
        self.reduce_spb = scale / profile.reduce_bps
        self.cpu_free = [0.0] * world_size
        self.nic_free = [0.0] * world_size
        rph = profile.ranks_per_host
        self.host = [r // rph for r in range(world_size)]
        # more ranks than cores on a host: a message between two of them is CPU work too
        # (loopback or shared memory: no wire), so it slows down as the CPU does
        self._intra = (profile.intra.alpha * scale, profile.intra.beta * scale)
        self._inter = (profile.inter.alpha, profile.inter.beta)
        self.endpoints: dict[tuple[int, int], SimExecutor] = {}
        self.messages = 0
        self.dropped = 0
        self.events = 0

    # -- the clock ---------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (not before now)."""
        heapq.heappush(self._heap, (t if t > self.now else self.now, next(self._seq), fn, args))

    def run(self, until: float | None = None, max_events: int | None = None) -> None:
        """Process events until none is left (or virtual time passes ``until``, or
        ``max_events`` were processed)."""
        heap = self._heap
        pop = heapq.heappop
        n = 0
        while heap:
            if until is not None and heap[0][0] > until:
                break
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            n += 1
            if max_events is not None and n >= max_events:
                break
        self.events += n

    @property
    def idle(self) -> bool:
        """True when no event is pending."""
        return not self._heap

    # -- costs -------------------------------------------------------------------------------
    def cpu(self, rank: int, cost: float, at: float | None = None) -> float:
        """Occupy ``rank``'s CPU for ``cost`` seconds from ``at`` (default now), or when it
        frees; return when the work is done."""
        t = self.cpu_free[rank]
        start = self.now if at is None else at
        if t < start:
            t = start
        t += cost
        self.cpu_free[rank] = t
        return t

    def post(self, src: int, dst: int, sid: int, execution: int, tag: int, kind: int,
             nbytes: int, data: Any, header: tuple[str, tuple[int, ...], int] | None) -> float:
        """Send a message: returns when the sender's interface has pushed it (the send op's
        completion) and schedules its delivery at ``dst``. The delivery event is placed
        ``gamma`` after the arrival, when the receiver would be done with it if its CPU is free
        (saving an event per message; a busy receiver schedules the completion later)."""
        g = self.gamma
        t = self.cpu(src, g)
        if src == dst:
            self.at(t + g, self._deliver, dst, sid,
                    (src, execution, tag, kind, nbytes, data, header, 0.0, g))
            return t
        a, b = self._intra if self.host[src] == self.host[dst] else self._inter
        t0 = self.nic_free[src]
        if t0 < t:
            t0 = t
        out = t0 + nbytes * b
        self.nic_free[src] = out
        self.messages += 1
        self.at(out + a + g, self._deliver, dst, sid,
                (src, execution, tag, kind, nbytes, data, header, 0.0, g))
        return out

    def _deliver(self, dst: int, sid: int, msg: tuple[Any, ...]) -> None:
        ex = self.endpoints.get((dst, sid))
        if ex is None:
            self.dropped += 1  # nobody runs that schedule (any more): as a closed endpoint
            return
        ex.deliver(msg)


class SimExecutor:
    """One rank's committed ``schedule`` in ``world`` under ``sched_id`` (module doc).

    ``buffers`` (slot -> NumPy array) and ``kernels`` run it with data; without buffers it
    runs timing only, calling ``hooks[kernel](rank, execution, op)`` when a compute op of a
    hooked kernel fires. ``on_complete(e)`` runs when execution ``e`` completes, before a
    persistent executor re-arms. Raises ``ValueError`` for an uncommitted schedule, a missing
    buffer or kernel.
    """

    def __init__(self, world: SimWorld, schedule: Schedule, *, sched_id: int,
                 persistent: bool = False, buffers: Mapping[str, Any] | None = None,
                 kernels: Mapping[str, Kernel] | None = None,
                 hooks: Mapping[str, Hook] | None = None,
                 on_complete: Callable[[int], None] | None = None) -> None:
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
        self._kind, self._succ, self._thr = c.kind, c.succ, c.thr
        self._start_sources, self._recv_sources = c.start_sources, c.recv_sources
        self._final = c.final
        self._peer, self._tag, self._msg, self._nbytes = c.peer, c.tag, c.msg, c.nbytes
        # ops whose completion nobody waits for (activation and arrival sends): completing
        # them would only cost an event
        self._silent = bytearray(1 if not c.succ[i] and i != c.final else 0
                                 for i in range(len(schedule.ops)))
        self._n = len(schedule.ops)
        self._data = buffers is not None
        self._hooks: list[Hook | None] = [None] * self._n
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
                    self._hooks[i] = hooks[op.kernel]
        self.execution = 0
        self.completed = -1
        self.armed = False
        self.started = False
        self._count = [0] * self._n
        self._fired = bytearray(self._n)
        self._ready: deque[int] = deque()
        self._draining = False
        self._posted: dict[tuple[int, int], int] = {}
        self._held: dict[int, dict[tuple[int, int], deque[tuple[Any, ...]]]] = {}
        self._msgs: dict[int, Message] = {}
        self._payloads: dict[int, Payload] = {}
        world.endpoints[(self.rank, sched_id)] = self
        if persistent:
            self._arm()

    # -- binding (data mode) -----------------------------------------------------------------
    def _bind(self, buffers: Mapping[str, Any], kernels: Mapping[str, Kernel]) -> None:
        bound: dict[str, np.ndarray] = {}
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
                    self._nbytes[i] = int(self._views[i].nbytes)
            elif op.kind == "compute":
                fn = kernels.get(op.kernel)
                if fn is None:
                    raise ValueError(f"op {i} {op.describe()}: kernel {op.kernel!r} is not in "
                                     f"the registry (registered: {sorted(kernels)})")
                self._kernels[i] = fn
                out = view(op.output)
                self._views[i] = (out, [view(r) for r in op.inputs])
                self._nbytes[i] = 0 if out is None else int(out.nbytes)

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
        n = self._n
        self._count = [0] * n
        self._fired = bytearray(n)
        self._posted.clear()
        self._msgs.clear()
        self._payloads.clear()
        self.armed = True
        self.started = False
        self._ready.extend(self._recv_sources)
        self._drain()

    # -- messages ----------------------------------------------------------------------------
    def deliver(self, msg: tuple[Any, ...]) -> None:
        """A message arrives (``(src, execution, tag, kind, nbytes, data, header, extra
        receive cost, delay of this delivery after the arrival)``)."""
        src, e, tag, kind = msg[0], msg[1], msg[2], msg[3]
        cur = self.execution
        if e < cur or (e == cur and not self.armed and self.completed == e):
            if kind == _ACT:
                self.world.dropped += 1
                return
            raise SimulationError(f"rank {self.rank}: data message from rank {src} tag {tag} "
                                  f"for execution {e}, which completed here")
        if e == cur and self.armed:
            i = self._posted.pop((src, tag), -1)
            if i >= 0:
                self._recv_arrived(i, msg, self.world.now - msg[8])
                return
        self._held.setdefault(e, {}).setdefault((src, tag), deque()).append(msg)

    def _recv_arrived(self, i: int, msg: tuple[Any, ...], arrived: float) -> None:
        w = self.world
        t = w.cpu(self.rank, w.gamma + msg[7], arrived)
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
                self._msgs[i] = _message(msg, self.sched_id)
        succ = self._succ[i]
        if self._silent[i] or (succ and all(self._fired[s] for s in succ)):
            return  # nobody waits for it (any more): e.g. arrivals past a reached quorum
        if t <= w.now + 1e-15:
            self._complete(i)
        else:
            w.at(t, self._complete_at, i, e)

    # -- the engine --------------------------------------------------------------------------
    def _drain(self) -> None:
        if self._draining:
            return
        self._draining = True
        try:
            ready = self._ready
            while ready:
                self._fire(ready.popleft())
        finally:
            self._draining = False

    def _fire(self, i: int) -> None:
        fired = self._fired
        if fired[i]:
            return
        fired[i] = 1
        kind = self._kind[i]
        if kind == _NOP:
            self._complete(i)
            return
        w = self.world
        e = self.execution
        if kind == _SEND:
            self._send(i, e)
        elif kind == _RECV:
            key = (self._peer[i], self._tag[i])
            held = self._held.get(e)
            q = None if held is None else held.get(key)
            if q:
                msg = q.popleft()
                if not q:
                    del held[key]  # type: ignore[union-attr]
                self._recv_arrived(i, msg, w.now)
            else:
                self._posted[key] = i
        else:
            t = w.cpu(self.rank, w.gamma + self._nbytes[i] * w.reduce_spb)
            if self._data:
                self._run_kernel(i)
            else:
                h = self._hooks[i]
                if h is not None:
                    h(self.rank, e, i)
            if t <= w.now:
                self._complete(i)
            else:
                w.at(t, self._complete_at, i, e)

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
        if t <= w.now:
            self._complete(i)
        else:
            w.at(t, self._complete_at, i, e)

    def _run_kernel(self, i: int) -> None:
        op = self.schedule.ops[i]
        out, ins = self._views[i]
        msgs = [self._msgs[r] for r in op.recvs if r in self._msgs] if op.recvs else ()
        fn = self._kernels[i]
        assert fn is not None
        result = fn(out, ins, op.params, msgs)
        if result is not None:
            self._payloads[i] = result

    def _complete_at(self, i: int, e: int) -> None:
        if e == self.execution and self.armed:
            self._complete(i)

    def _complete(self, i: int) -> None:
        if i == self._final:
            self._finish()
            return
        count, thr, ready = self._count, self._thr, self._ready
        for s in self._succ[i]:
            c = count[s] + 1
            count[s] = c
            if c == thr[s]:
                ready.append(s)
        if not self._draining:
            self._drain()

    def _finish(self) -> None:
        e = self.execution
        self.armed = False
        self._ready.clear()
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


def _compiled(s: Schedule) -> _Compiled:
    """The schedule's op tables (a copy of ``nbytes``, which data mode refines per binding)."""
    c = _Compiled(s)
    c.nbytes = list(c.nbytes)
    return c


def _ref_bytes(s: Schedule, ref: Any) -> int:
    """The bytes a buffer reference covers by the slot's declaration (0 when unknown)."""
    if ref is None:
        return 0
    spec = s.slots.get(ref.slot)
    if spec is None or spec.count is None:
        return 0
    n = spec.count - ref.offset if ref.count is None else ref.count
    return int(max(n, 0) * (np.dtype(spec.dtype).itemsize if spec.dtype else 4))


def _message(msg: tuple[Any, ...], sid: int) -> Message:
    src, e, tag, kind, _nbytes, data, header = msg[:7]
    dtype, shape, fmt = header if header is not None else ("", (), int(Format.RAW))
    payload = memoryview(b"") if data is None else memoryview(data).cast("B")
    return Message(Header(PROTOCOL_VERSION, kind, sid, e, tag, src, dtype, shape, fmt,
                          len(payload)), payload)
