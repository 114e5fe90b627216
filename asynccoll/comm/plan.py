"""What a partial allreduce handle is made of, besides its policy: the runtime it runs on
(:class:`HandleRuntime`, the communicator's) and its plan (:class:`HandlePlan`: the data, the
route's decisions, the options of the call that made it).

:meth:`Communicator.partial_allreduce <asynccoll.Communicator.partial_allreduce>` checks the
arguments, asks the route planner (:mod:`.route`) and hands these two values and a
:class:`~asynccoll.Policy` to :class:`~.partial.PartialAllreduce`; nothing else makes one.
:data:`MOVED` says where each keyword it took before went.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..collectives.policy import POLICY_MOVED, Accumulate
from ..sched import KernelRegistry, LiveOps, TraceWriter
from ..transport.base import Transport
from .contribution import Contribution
from .progress import ProgressEngine

__all__ = ["MOVED", "HandlePlan", "HandleRuntime"]

#: the keywords ``partial_allreduce`` took before straggler policies were values (0.1), and
#: what to write instead (the ``TypeError`` an old call gets says it)
MOVED = {
    "kind": "the first argument is the policy: Solo(), Majority(), TwoChoice(), Quorum(k), "
            "Backup(b), Deadline() (asynccoll), or its text ('solo', 'quorum:3')",
    **POLICY_MOVED,
    "algorithm": "give path=DataPath(algorithm=...) (a network algorithm; shared memory: "
                 "DataPath(shm=...); algorithm='hier': comm.hier_partial_allreduce(...))",
    "shm": "give path=DataPath(shm=...)",
    "density": "give path=DataPath(density=...)",
    "delta": "give path=DataPath(delta=...)",
}


@dataclass(frozen=True)
class HandleRuntime:
    """What a communicator lends each of its handles: its progress ``engine``, its
    ``transport``, its trace writer (``trace``, or None), kernel registry (``kernels``; None:
    the collectives'), live-op registry (``live``) and the seconds a call waits before it logs
    that it still waits (``stall_warn``; None: never; :mod:`.stall`)."""

    engine: ProgressEngine
    transport: Transport
    trace: TraceWriter | None = None
    kernels: KernelRegistry | None = None
    live: LiveOps | None = None
    stall_warn: float | None = None


@dataclass(frozen=True)
class HandlePlan:
    """One handle's plan: the ``contribution`` strategy that fits ``like`` (dense or sparse,
    the algorithm the route chose in it; :mod:`.contribution`), the handle's ``name`` (its
    schedule id derives from it) and initiator ``seed`` (resolved: the policy's, else from the
    name), ``accumulate``, the default ``timeout`` per call, ``shm_token`` (the job's segment
    token when the data phase goes through shared memory, else None), ``average`` (divide each
    value by its count: ``op="avg"`` without accumulation) and ``like_kind`` (the tensor type
    of ``like``, None for arrays)."""

    contribution: Contribution
    like: Any
    name: str
    seed: int
    accumulate: Accumulate = Accumulate.LATEST
    timeout: float | None = None
    shm_token: int | None = None
    average: bool = False
    like_kind: Any = None  # a .tensors.TensorKind (tensors imports the handle)
