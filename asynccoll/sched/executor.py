"""The executor: runs one rank's committed schedule on an asyncio loop.

Ops fire in a deterministic order (a FIFO of ready ops, filled in op-id order of successors) as
their thresholds are met; completion notifies successors in O(out-degree). Sends and receives are
futures from the transport (no task per op); small kernels run inline, large ones in the loop's
default executor (NumPy releases the GIL), so the loop never blocks for long. Nothing polls.

An **execution** is one run of the schedule. It is *armed* (its source receives posted), then
*started* from inside (:meth:`Executor.start`: its other sources fire) or activated from outside
(a source receive completes), and completes when the schedule's final op completes. Then its
unmatched receives are retired, ``on_complete(execution)`` runs (read results there: a persistent
schedule may begin overwriting its buffers right after), and a **persistent** executor arms the
next execution at once; a non-persistent one arms it on the next :meth:`start`.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from ..buffers import as_bytes, dtype_to_wire, is_cupy
from ..errors import (
    CollectiveTimeoutError,
    ExecutionError,
    PeerLostError,
    ScheduleError,
    TransportClosedError,
)
from ..transport.base import Transport
from ..transport.frames import Format, Kind, Message
from ..transport.matching import ignore_outcome
from .kernels import BUILTIN_KERNELS, Kernel, Payload
from .schedule import BufRef, Schedule
from .trace import COMPLETED, Trace
from .waits import activation_op, wait_status

__all__ = ["Executor", "KernelWaits"]


class KernelWaits(Exception):
    """Raised by a kernel whose op cannot complete now and will not by itself: the op stays
    pending and the execution waits for what fails it (a loss notice on its way, a timeout,
    or an :meth:`Executor.abort` the kernel arranged), instead of failing with the kernel's
    symptom (:meth:`asynccoll.comm.shm.PartialSegments.attach_or_wait`)."""

_NOP, _SEND, _RECV, _COMPUTE = 0, 1, 2, 3
_KIND_CODE = {"nop": _NOP, "send": _SEND, "recv": _RECV, "compute": _COMPUTE}
_NAN = float("nan")
_DENSE = int(Format.DENSE)
_NO_MSGS: tuple[Message, ...] = ()
_MSG_KIND = {"data": int(Kind.DATA), "activation": int(Kind.ACTIVATION)}
_ACTIVATION, _RAW = int(Kind.ACTIVATION), int(Format.RAW)
_NO_PAYLOAD = memoryview(b"")


class Executor:
    """Executes ``schedule`` for one rank over ``transport`` with ``buffers`` bound to its slots.

    ``sched_id`` must be the same on every rank for the same collective (messages carry it).
    ``persistent``: re-arm for the next execution as soon as one completes (then the executor
    must be created on the running loop, since it arms at once). ``on_complete(e)`` runs after
    execution ``e`` completed and before the next is armed. ``trace_capacity`` executions are
    kept in :attr:`trace`; ``trace_sink`` receives each finished execution's record.
    ``offload_bytes``: kernels whose output exceeds this run in the loop's executor.
    ``kernels``: the registry the compute ops' kernels are looked up in, once, here (default
    :data:`~asynccoll.sched.BUILTIN_KERNELS`; a Communicator passes its ``kernels``).
    ``first_execution``: the index of the first execution (default 0; a partial handle that
    survived a lost rank goes on numbering where the old world stopped).

    Raises :class:`ScheduleError` for an uncommitted schedule or a kernel ``kernels`` lacks,
    ``ValueError`` for a transport of
    another rank or world size, and ``ValueError``/``TypeError`` naming the slot for a missing or
    ill-fitting buffer. Costs per op fired: a few list stores and, for messages, one transport
    call; no task and no polling.
    """

    def __init__(self, schedule: Schedule, transport: Transport,
                 buffers: Mapping[str, Any] | None = None, *, sched_id: int,
                 persistent: bool = False, on_complete: Callable[[int], None] | None = None,
                 trace_capacity: int = 64,
                 trace_sink: Callable[[dict[str, Any]], None] | None = None,
                 offload_bytes: int = 4 << 20,
                 kernels: Mapping[str, Kernel] | None = None,
                 first_execution: int = 0) -> None:
        if not schedule.committed:
            raise ScheduleError(f"schedule {schedule.name!r} must be committed before execution")
        if transport.rank != schedule.rank or transport.world_size != schedule.world_size:
            raise ValueError(
                f"schedule is for rank {schedule.rank} of {schedule.world_size}, transport is "
                f"rank {transport.rank} of {transport.world_size}")
        self.schedule = schedule
        self.transport = transport
        self.sched_id = sched_id
        self.persistent = persistent
        self.on_complete = on_complete
        self.offload_bytes = offload_bytes
        ops = schedule.ops
        n = len(ops)
        self._n = n
        self._kind = [_KIND_CODE[op.kind] for op in ops]
        self._succ = schedule.successors()
        self._thr = [op.k for op in ops]
        self._start_sources = [i for i, op in enumerate(ops) if not op.deps and op.kind != "recv"]
        self._recv_sources = [i for i, op in enumerate(ops) if not op.deps and op.kind == "recv"]
        assert schedule.final is not None
        self._final = schedule.final
        self._kernels = _resolve_kernels(schedule, BUILTIN_KERNELS if kernels is None
                                         else kernels)
        self.trace = Trace(n, trace_capacity, trace_sink)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: deque[int] = deque()
        self._draining = False
        self._count = [0] * n
        self._fired = bytearray(n)
        self._payloads: dict[int, Payload] = {}
        self._msgs: dict[int, Message] = {}
        # This execution's trace, in plain lists: a list store costs a fraction of a NumPy
        # scalar store; the lists go into the trace's arrays once, when the execution ends.
        self._t_posted: list[float] = [_NAN] * n
        self._t_fired: list[float] = [_NAN] * n
        self._t_done: list[float] = [_NAN] * n
        self._nbytes: list[int] = [0] * n
        self._done: asyncio.Future[int] | None = None
        self._last_started: asyncio.Future[int] | None = None
        self._armed = False
        self._started = False
        self._closed = False
        self._error: BaseException | None = None
        if isinstance(first_execution, bool) or not isinstance(first_execution, int) \
                or first_execution < 0:
            raise ValueError(f"first_execution must be an int >= 0, got {first_execution!r}")
        self.execution = first_execution
        self.completed = first_execution - 1
        # What explains a wait (read only on a stall, a timeout or a dump; see pending()):
        #: the :class:`~asynccoll.sched.LiveOps` tracking this executor (set by its ``add``)
        self.live: Any = None
        #: the latest execution a call waited for (-1: none), set by whoever waits: with
        #: :attr:`execution` equal to it, this rank has called the current execution
        self.called = -1
        #: when that call began waiting (``time.time()``)
        self.called_at = _NAN
        #: ``initiators(e)``: the ranks whose start may begin execution ``e``, when the owner
        #: of a partial schedule knows them (None: unknown); names the initiator waited for
        self.initiators: Callable[[int], Collection[int]] | None = None
        #: ``(execution, text)``: the latest explanation that asked the other ranks
        self.note: tuple[int, str] | None = None
        self.bind(buffers or {})
        if persistent:
            self._arm()

    # -- binding -----------------------------------------------------------------------------
    def bind(self, buffers: Mapping[str, Any]) -> None:
        """Bind arrays to slots (flattened views, no copies); precompute every op's views."""
        bound: dict[str, Any] = {}
        for slot, spec in self.schedule.slots.items():
            if slot not in buffers:
                raise ValueError(f"buffer for slot {slot!r} is missing (slots: "
                                 f"{sorted(self.schedule.slots)})")
            a = buffers[slot]
            if not (isinstance(a, np.ndarray) or is_cupy(a)):
                raise TypeError(f"buffer {slot!r} must be a NumPy or CuPy array, "
                                f"got {type(a).__name__}")
            if not a.flags.c_contiguous:
                raise ValueError(f"buffer {slot!r} must be C-contiguous")
            a = a.reshape(-1)
            if spec.count is not None and a.size != spec.count:
                raise ValueError(f"buffer {slot!r} has {a.size} elements, the schedule "
                                 f"declares {spec.count}")
            if spec.dtype is not None and np.dtype(spec.dtype) != a.dtype:
                raise ValueError(f"buffer {slot!r} has dtype {a.dtype}, the schedule "
                                 f"declares {spec.dtype}")
            bound[slot] = a
        self.buffers = bound
        device_ok = getattr(self.transport, "supports_device", False)

        def view(ref: BufRef | None) -> Any:
            if ref is None:
                return None
            a = bound[ref.slot]
            end = a.size if ref.count is None else ref.offset + ref.count
            if end > a.size:
                raise ValueError(f"{ref} runs past buffer {ref.slot!r} of {a.size} elements")
            return a[ref.offset:end]

        self._views: list[tuple[Any, ...]] = []
        for op in self.schedule.ops:
            if op.kind in ("send", "recv"):
                arr = view(op.buf)
                wire: Any
                if arr is None:
                    wire = None
                    meta: tuple[Any, ...] = ("", (), 0)
                elif is_cupy(arr) and not device_ok:
                    wire = np.empty(arr.size, arr.dtype)  # host staging
                    meta = (dtype_to_wire(arr.dtype), (arr.size,), arr.nbytes)
                else:
                    wire = arr.view(np.uint8).data if isinstance(arr, np.ndarray) else arr
                    meta = (dtype_to_wire(arr.dtype), (arr.size,), arr.nbytes)
                self._views.append((arr, wire, *meta))
            elif op.kind == "compute":
                out = view(op.output)
                ins = [view(r) for r in op.inputs]
                self._views.append((out, ins, 0 if out is None else out.nbytes))
            else:
                self._views.append(())
        # What the hot path needs per message op, resolved once here rather than per firing.
        sid = self.sched_id
        self._sendinfo: list[tuple[Any, ...]] = []
        self._recvinfo: list[tuple[int, int, Any]] = []
        for op, v in zip(self.schedule.ops, self._views, strict=True):
            if op.kind == "send":
                # (peer, kind, sched, tag, payload_from, arr, wire, dtype, shape, length)
                self._sendinfo.append((op.peer, _MSG_KIND[op.msg], sid, op.tag, op.payload_from,
                                       v[0], _NO_PAYLOAD if v[1] is None else v[1], *v[2:]))
            else:
                self._sendinfo.append(())
            self._recvinfo.append((op.peer, op.tag, v[1]) if op.kind == "recv" else (0, 0, None))

    # -- public control ----------------------------------------------------------------------
    def start(self) -> asyncio.Future[int]:
        """Activate the current execution from inside; return the future of its completion.

        Idempotent per execution (its start ops are consumable). The future resolves to the
        execution number, or fails with the execution's error.
        """
        if self._closed:
            raise TransportClosedError("executor is closed")
        if self._error is not None:
            raise self._error
        if not self._armed:
            self._arm()
        assert self._done is not None
        fut = self._done
        self._last_started = fut
        if not self._started:
            self._started = True
            self.trace.started(self.execution, time.time())
            self._ready.extend(self._start_sources)
            self._drain()
        return fut

    @property
    def current(self) -> asyncio.Future[int]:
        """The completion future of the armed (or next, which it arms) execution.

        After a failure or :meth:`close` it is the failed future; nothing is armed again.
        """
        if not self._armed and not self._closed and self._error is None:
            self._arm()
        if self._done is None:  # closed before anything was armed
            self._done = asyncio.get_running_loop().create_future()
            self._done.set_exception(TransportClosedError("executor closed"))
            self._done.exception()
        return self._done

    async def wait(self, timeout: float | None = None) -> int:
        """Wait for the execution last started by :meth:`start` (none yet: the armed one).

        Returns its execution number; raises its error, or :class:`CollectiveTimeoutError`
        listing the pending ops after ``timeout`` seconds (the execution goes on).
        """
        try:
            return await asyncio.wait_for(asyncio.shield(self.waited), timeout)
        except asyncio.TimeoutError:
            raise self.timeout_error(timeout) from None

    @property
    def waited(self) -> asyncio.Future[int]:
        """The future :meth:`wait` waits for: the execution last started (none yet: the armed
        one)."""
        return self._last_started if self._last_started is not None else self.current

    def pending_text(self) -> str:
        """The ops still pending, one description each (what a timeout or stall names)."""
        return "; ".join(d for _, _, d in self.pending())

    def timeout_error(self, timeout: float | None) -> CollectiveTimeoutError:
        """The error of a wait that gave up after ``timeout`` seconds, naming what pends."""
        return CollectiveTimeoutError(
            f"rank {self.schedule.rank}: execution {self.execution} of "
            f"{self.schedule.name or 'schedule'} not complete after {timeout} s; waiting on: "
            + self.pending_text(), self.pending())

    def abort(self, exc: BaseException) -> None:
        """Fail the execution under way (or armed) with ``exc``; every later :meth:`start`
        raises it, and a persistent executor does not re-arm. No-op once closed or failed."""
        if not self._closed and self._error is None:
            self._fail(exc)

    @property
    def in_flight(self) -> bool:
        """True while the armed execution has begun (started here, or an op of it completed:
        an activation or data arrived) and has not completed or failed. O(ops)."""
        if not self._armed or self._done is None or self._done.done():
            return False
        return self._started or any(t == t for t in self._t_done)  # not NaN: completed

    @property
    def error(self) -> BaseException | None:
        """The error that failed this executor, or None; every later start() raises it."""
        return self._error

    def test(self) -> bool:
        """True when the current execution (:attr:`current`; for a persistent executor, the one
        armed after the last completion) has completed or failed; never arms one."""
        return self._done is not None and self._done.done()

    def pending(self) -> list[tuple[int, int, str]]:
        """``(rank, op id, description)`` of each op of the current execution not yet done
        (empty once it completed or failed: what it left unmatched was retired), after one
        entry with op id -1 that says what the execution waits for as a whole (the ranks it
        waits for, never this rank itself; the latest explanation that asked the other ranks
        when there is one for this execution: :attr:`note`). Costs O(ops)."""
        out: list[tuple[int, int, str]] = []
        if not self._armed:
            return out
        me = self.schedule.rank
        done = self._t_done
        act = activation_op(self)
        # before activation, the receives that would activate it are paths, not waits
        paths = set() if act is None or done[act] == done[act] else \
            set(self.schedule.ops[act].deps)
        for i, op in enumerate(self.schedule.ops):
            if done[i] == done[i]:  # not NaN: completed
                continue
            if self._fired[i] or (op.kind == "recv" and not op.deps and self._armed):
                desc = f"op {i} {op.describe()}"
                if op.kind in ("send", "recv"):
                    if op.peer == me:
                        desc += " (a message of this rank to itself)"
                    elif op.msg == "activation" or i in paths:
                        desc += f" (an activation path, via rank {op.peer})"
                    else:
                        what = "sending to" if op.kind == "send" else "waiting for"
                        desc += f" ({what} rank {op.peer})"
                out.append((me, i, desc))
        note = self.note
        head = note[1] if note is not None and note[0] == self.execution \
            else wait_status(self)["text"]
        return [(me, -1, head), *out]

    def status(self) -> dict[str, Any]:
        """What the current execution waits for, as data (see
        :func:`~asynccoll.sched.waits.wait_status`). O(ops)."""
        return wait_status(self)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def armed(self) -> bool:
        """True while an execution is armed (posted) and not yet completed or failed."""
        return self._armed

    @property
    def started(self) -> bool:
        """True once the armed execution was started from inside (:meth:`start`)."""
        return self._armed and self._started

    def progress(self) -> tuple[bytearray, list[float]]:
        """The armed execution's per-op fired flags and completion times (``nan``: not yet),
        live (not copies: read, never write)."""
        return self._fired, self._t_done

    def last_heard(self, peer: int) -> tuple[float, int] | None:
        """``(time, execution)`` of the latest receive from ``peer`` this executor completed
        (the armed execution, then the trace ring), or ``None``. O(ops x trace capacity)."""
        ops = self.schedule.ops
        idx = [i for i, op in enumerate(ops) if op.kind == "recv" and op.peer == peer]
        if not idx:
            return None
        best: tuple[float, int] | None = None
        if self._armed:
            ts = [self._t_done[i] for i in idx if self._t_done[i] == self._t_done[i]]
            if ts:
                best = (max(ts), self.execution)
        tr = self.trace
        for row in range(tr.capacity):
            e = tr.meta[row, 0]
            if e != e:
                continue
            col = tr.times[row, idx, COMPLETED]
            col = col[col == col]
            if col.size and (best is None or float(col.max()) > best[0]):
                best = (float(col.max()), int(e))
        return best

    def close(self) -> None:
        """Stop: the pending execution fails with TransportClosedError; receives are retired."""
        if self._closed:
            return
        self._closed = True
        if self._armed:
            self._store_trace()
        self._armed = False  # callbacks of sends or kernels still in flight now do nothing
        if self._done is not None and not self._done.done():
            self._done.set_exception(TransportClosedError("executor closed"))
            self._done.exception()
        self._ready.clear()
        self.transport.forget(self.sched_id)

    def activate(self, execution: int, tag: int) -> None:
        """Deliver an activation message to this rank itself for ``execution`` under ``tag``
        (a forced activation: the schedule's receive on ``tag`` from this rank then fires).

        A failed self-send (the transport closed, say) is swallowed: the caller waiting for the
        execution then times out naming it. Costs one self-send, no payload.
        """
        fut = self.transport.post_frame(self.schedule.rank, _ACTIVATION, self.sched_id,
                                        execution, tag, _NO_PAYLOAD, fmt=_RAW)
        fut.add_done_callback(ignore_outcome)

    # -- the engine --------------------------------------------------------------------------
    def _arm(self) -> None:
        self._loop = asyncio.get_running_loop()
        e = self.execution
        n = self._n
        self._count = [0] * n
        self._fired = bytearray(n)
        self._payloads.clear()
        self._msgs.clear()
        self.trace.begin(e, time.time())
        self._t_posted = [_NAN] * n
        self._t_fired = [_NAN] * n
        self._t_done = [_NAN] * n
        self._nbytes = [0] * n
        self.trace.attach(e, self._t_posted, self._t_fired, self._t_done, self._nbytes)
        self._done = self._loop.create_future()
        self._armed = True
        self._started = False
        self._ready.extend(self._recv_sources)
        self._drain()

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
        now = time.time()
        self._t_fired[i] = now
        self._t_posted[i] = now
        kind = self._kind[i]
        e = self.execution
        if kind == _NOP:
            self._complete(i, 0)
        elif kind == _SEND:
            self._post_send(i, e)
        elif kind == _RECV:
            peer, tag, wire = self._recvinfo[i]
            fut = self.transport.post_recv(peer, self.sched_id, e, tag, wire)
            if fut.done():
                self._recv_done(e, i, fut)
            else:
                fut.add_done_callback(functools.partial(self._recv_done, e, i))
        else:
            self._run_kernel(i, e)

    def _post_send(self, i: int, e: int) -> None:
        (peer, msg_kind, sid, tag, payload_from, arr, wire, dtype, shape,
         length) = self._sendinfo[i]
        fmt = _DENSE
        if payload_from >= 0:
            p = self._payloads.get(payload_from)
            if p is None:
                self._fail(ExecutionError(f"op {i}: compute op {payload_from} returned no "
                                          "payload to send"))
                return
            wire = as_bytes(p.data, "kernel payload")
            dtype, shape, fmt, length = p.dtype, p.shape, p.fmt, len(wire)
        elif arr is not wire and isinstance(wire, np.ndarray):
            arr.get(out=wire)  # CuPy over a host-only transport: stage through host memory
            wire = wire.view(np.uint8).data
        fut = self.transport.post_frame(peer, msg_kind, sid, e, tag, wire, dtype, shape, fmt)
        if fut.done():
            self._send_done(e, i, length, fut)
        else:
            fut.add_done_callback(functools.partial(self._send_done, e, i, length))

    def _send_done(self, e: int, i: int, length: int, fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if e != self.execution or not self._armed:
            return
        if exc is not None:
            self._fail(exc)
            return
        self._complete(i, length)

    def _recv_done(self, e: int, i: int, fut: asyncio.Future[Message]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if e != self.execution or not self._armed:
            return
        if exc is not None:
            self._fail(exc)
            return
        msg = fut.result()
        arr, wire, dtype, _shape, length = self._views[i]
        h = msg.header
        if wire is not None and h.fmt == Format.DENSE and (h.dtype != dtype or h.length != length):
            op = self.schedule.ops[i]
            self._fail(ExecutionError(
                f"rank {self.schedule.rank} op {i} {op.describe()}: rank {h.src} sent "
                f"{h.length} bytes of {h.dtype or 'raw'}, expected {length} bytes of {dtype} "
                "(mismatched shapes or dtypes across ranks?)"))
            return
        if isinstance(wire, np.ndarray):
            arr.set(wire)  # staged CuPy receive
        self._msgs[i] = msg
        self._complete(i, h.length)

    def _run_kernel(self, i: int, e: int) -> None:
        op = self.schedule.ops[i]
        out, ins, nbytes = self._views[i]
        recvs = op.recvs
        msgs = [self._msgs[r] for r in recvs if r in self._msgs] if recvs else _NO_MSGS
        kernel = self._kernels[i]
        assert kernel is not None
        if nbytes > self.offload_bytes and isinstance(out, np.ndarray):
            assert self._loop is not None
            fut = self._loop.run_in_executor(None, kernel, out, ins, op.params, msgs)
            fut.add_done_callback(functools.partial(self._kernel_done, e, i, nbytes))
            return
        try:
            result = kernel(out, ins, op.params, msgs)
        except PeerLostError as exc:  # a kernel that reads a peer's memory saw it gone
            self._fail(exc)
            return
        except KernelWaits:
            return
        except Exception as exc:
            self._fail(ExecutionError(f"rank {self.schedule.rank} op {i} {op.describe()} "
                                      f"failed: {exc!r}"), exc)
            return
        if result is not None:
            self._payloads[i] = result
        self._complete(i, nbytes)

    def _kernel_done(self, e: int, i: int, nbytes: int, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled() or e != self.execution or not self._armed:
            return
        exc = fut.exception()
        if isinstance(exc, KernelWaits):
            return
        if isinstance(exc, PeerLostError):
            self._fail(exc)
            return
        if exc is not None:
            op = self.schedule.ops[i]
            self._fail(ExecutionError(f"rank {self.schedule.rank} op {i} {op.describe()} "
                                      f"failed: {exc!r}"), exc)
            return
        result = fut.result()
        if result is not None:
            self._payloads[i] = result
        self._complete(i, nbytes)
        self._drain()

    def _complete(self, i: int, nbytes: int) -> None:
        self._t_done[i] = time.time()
        self._nbytes[i] = nbytes
        if i == self._final:
            self._finish()
            return
        count = self._count
        thr = self._thr
        ready = self._ready
        for s in self._succ[i]:
            c = count[s] + 1
            count[s] = c
            if c == thr[s]:
                ready.append(s)
        if not self._draining:
            self._drain()

    def _finish(self) -> None:
        e = self.execution
        self._armed = False
        self._ready.clear()
        self.completed = e
        self.transport.finish(self.sched_id, e)
        self._store_trace()
        done = self._done
        assert done is not None
        try:
            if self.on_complete is not None:
                self.on_complete(e)
        except Exception as exc:
            self._fail(ExecutionError(f"on_complete of execution {e} raised {exc!r}"), exc)
            return
        finally:
            self.trace.end(e, time.time())
        self.execution = e + 1
        if not done.done():
            done.set_result(e)
        if self.persistent and not self._closed:
            self._arm()

    def _fail(self, exc: BaseException, cause: BaseException | None = None) -> None:
        if cause is not None and exc.__cause__ is None:
            exc.__cause__ = cause
        self._error = exc
        if self._armed:
            self._store_trace()
        self._armed = False
        self._ready.clear()
        self.transport.finish(self.sched_id, self.execution)
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)
            self._done.exception()  # also raised by the next start(); no unretrieved warning

    def _store_trace(self) -> None:
        self.trace.store(self.execution, self._t_posted, self._t_fired, self._t_done,
                         self._nbytes)


def _resolve_kernels(schedule: Schedule, kernels: Mapping[str, Kernel]) -> list[Kernel | None]:
    """Each op's kernel (``None`` for non-compute ops); ScheduleError names a missing one."""
    out: list[Kernel | None] = []
    for i, op in enumerate(schedule.ops):
        if op.kind != "compute":
            out.append(None)
            continue
        fn = kernels.get(op.kernel)
        if fn is None:
            raise ScheduleError(f"op {i} {op.describe()}: kernel {op.kernel!r} is not in the "
                                f"executor's registry (registered: {sorted(kernels)})")
        out.append(fn)
    return out
