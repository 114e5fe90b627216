"""Persistent handles and the partial collectives of a :class:`~asynccoll.Communicator`.

:class:`PartialCollectives` holds what the communicator offers beyond the synchronous
collectives: ``partial_allreduce`` (flat dense and sparse handles, :mod:`.partial`, and the
hierarchical one, :mod:`.hier_partial`), the shortcuts (``solo_allreduce`` and the others, a
handle cached per shape and dtype) and ``sparse_allreduce_handle``. Each asks the route
(:mod:`.route`) how its data goes and follows the communicator's membership (a loss:
:mod:`.survival`). A part of the communicator's class, in a module of its own for size; it
holds no state of its own.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

import numpy as np

from ..buffers import check_array
from ..collectives._plan import check_op
from ..collectives.policy import (
    Accumulate,
    Policy,
    Quorum,
    as_accumulate,
    as_policy,
    moved_arguments,
)
from ..collectives.sparse.schedules import choose_algorithm
from ..collectives.sparse.streams import SparseVector
from ..results import PartialResult
from ..sched import KernelRegistry, LiveOps, TraceWriter
from ..transport.base import Transport
from .contribution import Contribution, DenseContribution, SparseContribution
from .dense import DenseOps
from .grouping import Grouping
from .hier_partial import Communicator as HierComm
from .hier_partial import HierPartialAllreduce
from .membership import Membership
from .partial import PartialAllreduce, stable_id
from .plan import MOVED, HandlePlan, HandleRuntime
from .progress import ProgressEngine
from .route import DataPath, shm_flag
from .sparse import SparseAllreduceHandle, SparseOps
from .survival import Survival
from .tensors import (
    TensorKind,
    TensorPartialAllreduce,
    as_host,
    from_tensor,
    to_device,
    wrap_result,
)

__all__ = ["PartialCollectives", "as_kind", "avg_op"]

T = TypeVar("T")



class PartialCollectives(Grouping):
    """The communicator's persistent handles and partial collectives (module doc)."""

    # the communicator's state these methods use (set by its ``__init__``)
    transport: Transport
    timeout: float | None
    survive: bool
    kernels: KernelRegistry
    live: LiveOps
    stall_warn: float | None
    clock_offset: float
    membership: Membership
    _engine: ProgressEngine
    _dense: DenseOps
    _sparse: SparseOps
    _writer: TraceWriter | None
    _closed: bool
    _handles: dict[str, PartialAllreduce]
    _hier_handles: dict[str, HierPartialAllreduce]
    _shortcuts: dict[tuple[Any, ...], PartialAllreduce]
    _auto_names: dict[str, int]

    async def sparse_allreduce(self, x: Any, density: float | None = None,
                               algorithm: str | None = None, quantize: int | None = None,
                               timeout: float | None = None, *, delta: float | None = None,
                               bucket: int = 512, seed: int = 0) -> Any:
        """Sum sparse (or sparsified dense) ``x`` over all ranks (SparCML; docs/sparse.md).

        ``x``: a :class:`~asynccoll.SparseVector`, or an array whose nonzeros are this rank's
        contribution (CuPy is staged through host memory; the result comes back as CuPy).
        ``density``: the expected fraction of nonzeros per rank, the same on every rank, to
        choose the algorithm; ``algorithm`` (``ssar_recursive_double``,
        ``ssar_split_allgather``, ``dsar_split_allgather``) overrides it. ``quantize``: 2, 4
        or 8 QSGD bits for the dense stage (implies ``dsar_split_allgather``; ``bucket``
        entries per scale, ``seed`` for the rounding). ``delta``: the switch point to dense.

        Returns a new :class:`~asynccoll.SparseVector` (sorted unique indices, no exact zeros)
        while the sum fits the sparse form, else a new dense array (shaped like ``x`` when
        ``x`` is an array; DSAR always returns it dense); every rank gets the same type and
        bitwise the same values. Call it in the same order on every rank, like the other
        collectives: the schedule of each distinct (size, dtype, algorithm, quantize, delta,
        bucket, seed) is built once and reused. Raises ``TypeError``/``ValueError`` naming
        ``x``, ``density``, ``algorithm``, ``quantize`` or ``delta``,
        :class:`~asynccoll.CollectiveTimeoutError` after ``timeout`` seconds (default: the
        communicator's), ``ExecutionError`` when ranks disagree on the vector.
        """
        self._check_open()
        x, kind = from_tensor(x, "x")
        host, device = as_host(x)
        if isinstance(host, np.ndarray) and not host.flags.c_contiguous:
            raise ValueError(f"x must be C-contiguous (got strides {host.strides})")
        dt = host.values.dtype if isinstance(host, SparseVector) else host.dtype
        alg = self._sparse.resolve(int(host.size), np.dtype(dt), density, algorithm, quantize,
                                   delta)
        t = self.timeout if timeout is None else timeout
        agree = None if self.size == 1 else (
            lambda what: self._dense.agree_on("sparse_allreduce", what, t))
        res = await self._run(self._sparse.run(host, algorithm=alg, quantize=quantize,
                                               delta=delta, bucket=bucket, seed=seed,
                                               timeout=t, agree=agree))
        if isinstance(res, np.ndarray) and not isinstance(x, SparseVector):
            res = res.reshape(x.shape)
        res = to_device(res) if device else res
        return res if isinstance(res, SparseVector) else as_kind(res, kind)

    def sparse_allreduce_handle(self, size: int, dtype: Any = np.float32, *,
                                name: str | None = None, density: float | None = None,
                                algorithm: str | None = None, quantize: int | None = None,
                                delta: float | None = None, bucket: int = 512, seed: int = 0,
                                timeout: float | None = None,
                                shm: bool | None = None) -> SparseAllreduceHandle:
        """A persistent sparse allreduce ``h`` of length-``size`` vectors of ``dtype``:
        ``await h(x)`` sums ``x`` as :meth:`sparse_allreduce` does, with the schedule built
        once for the handle's life (for a training loop's every step).

        ``name`` identifies the handle across ranks (its schedule id derives from it, so the
        handle stays out of the order of the other collectives; default: the order of
        creation of sparse handles). ``density``, ``algorithm``, ``quantize``, ``delta``,
        ``bucket``, ``seed``: as for :meth:`sparse_allreduce`, fixed per handle; ``timeout``:
        the default per call (default: the communicator's). ``await h.close()`` frees it;
        ``comm.close()`` closes it.

        ``shm``: whether the data goes through this host's shared memory, as
        :meth:`sparse_allreduce`'s does (docs/sparse.md, *On one host: shared memory*), with a
        partial handle's segments (made here, mapped at the first call, nothing left in
        ``/dev/shm`` after it, nor after a SIGKILL of one rank once a survivor learns of it).
        ``None`` (the default): when every rank is on this host, the algorithm is a split one
        and not quantised, ``ASYNCCOLL_SHM`` is not ``0`` and ``/dev/shm`` is large enough for
        every rank's segment twice over (its size, the same on every rank, not what is free).
        ``True``: asks for it (``ssar_split_allgather`` when no ``algorithm`` is given and the
        chooser's pick is not a split one; ``ValueError`` naming ``shm`` where it cannot be).
        ``False``: over the network. ``h.shm`` says which. As for partial handles, nothing
        checks that the ranks chose alike: give every rank the same ``shm``, ``algorithm`` and
        ``ASYNCCOLL_SHM`` (ranks that differ time out at the first call, whose
        ``CollectiveTimeoutError`` says so and names this rank's path).

        Raises ``ValueError`` naming ``name`` (in use), ``density``, ``algorithm``,
        ``quantize``, ``delta``, ``size`` or ``shm``; ``OSError`` (ENOSPC naming the fix) where
        this rank's segment cannot be created (``/dev/shm`` full of other segments: give
        ``shm=False``). Costs the schedule's construction and, through shared memory, creating
        this rank's segment; no I/O with the peers.
        """
        self._check_open()
        dt = np.dtype(dtype)
        shm = shm_flag(shm)
        alg = self._sparse.resolve(int(size), dt, density, algorithm, quantize, delta)
        token: int | None = None
        if quantize is not None:
            if shm is True:
                raise ValueError("shm=True: a quantised sparse allreduce goes over the network "
                                 "(quantisation is for fewer bytes on a network); give "
                                 "quantize=None or shm=None")
        else:
            alg, token = self._dense.router.sparse_partial(self._dense.layout, alg, algorithm,
                                                           shm)
        name = self._handle_name(name, "sparse")
        sid = stable_id(name, 3)
        entry = self._engine.call(lambda: self._sparse.named(
            name, sid, int(size), dt, algorithm=alg, quantize=quantize, delta=delta,
            bucket=bucket, seed=seed, shm_token=token))
        t = self.timeout if timeout is None else timeout
        return SparseAllreduceHandle(entry, name, run=self._run, release=self._sparse.release,
                                     timeout=t)

    def _handle_name(self, name: str | None, kind: str) -> str:
        """``name`` checked, or the next of ``kind#0``, ``kind#1``, ... by order of creation."""
        if name is None:
            # By order of creation only: ranks that disagree on the arguments then share a
            # schedule id and get an ExecutionError instead of waiting on each other forever.
            n = self._auto_names.get(kind, 0)
            self._auto_names[kind] = n + 1
            return f"{kind}#{n}"
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str or None, got {name!r}")
        return name

    # -- partial collectives -----------------------------------------------------------------
    @moved_arguments(**MOVED)
    def partial_allreduce(self, policy: Policy | str, like: Any, op: str = "sum",
                          accumulate: Accumulate | str = Accumulate.LATEST, *,
                          name: str | None = None, timeout: float | None = None,
                          survive: bool | None = None,
                          path: DataPath | None = None) -> PartialAllreduce:
        """A persistent partial allreduce handle ``h``: ``await h(x) -> PartialResult``.

        ``policy``: when an execution starts (:mod:`asynccoll.collectives.policy`,
        docs/partial.md): ``Solo()`` (any rank's call), ``Majority(seed=)`` (one drawn rank per
        execution), ``TwoChoice(seed=)`` (two drawn ranks, the first to arrive), ``Quorum(k)``
        (once k ranks have arrived), ``Backup(b)`` (``Quorum(P - b)``: synchronous SGD with b
        backup workers), ``Deadline(quorum=, bounds=, mad_factor=, window=)`` (k arrived,
        default all P, or an adaptive deadline after the first arrival, whichever is first:
        ``PartialResult.deadline`` and ``.deadline_expired`` say what happened), or the text
        of one (``"solo"``, ``"quorum:3"``; :func:`~asynccoll.as_policy`). The draws' seed
        defaults to one from the name. ``like``: an array of the shape and dtype of every
        call's data.

        ``accumulate`` (:class:`~asynccoll.Accumulate`): ``LATEST`` (default, the papers'): a
        call returns the latest result; ``SUM``: the sum of every result completed since the
        previous call; ``MEAN``: the sum of each of those results divided by its own ``count``
        (the per-execution average, what averaging by contributions needs: dividing summed
        results by summed counts would weigh executions by their size); ``WORLD``: the sum of
        each of those results divided by the size of the world it spanned (P, or the
        survivors' number after a lost rank: ``survive``), as it completes: synchronous SGD's
        average over every gradient, still right when a loss changes the world between a
        result's completion and the call that takes it. ``MEAN`` and ``WORLD``: dense
        floating-point data and ``op="sum"`` only.
        ``op="avg"``: **averaging by contributions**: each execution's sum is divided by its
        own ``count`` (the local contributions summed into it, over all ranks; an empty
        execution stays zeros), not by P; accumulating, the value is the sum of those
        per-execution averages (``MEAN``). Floating-point data only.
        **Tensors**: ``like`` and every call's ``x`` may be torch tensors (CPU or CUDA, see
        :mod:`asynccoll.comm.tensors`); a call returns its value as the type of its ``x``,
        ``flush`` as the type of ``like``.
        ``name``: identifies the handle across ranks (default: the order of creation).
        ``timeout``: default per call.

        **Sparse contributions**: with ``like`` a :class:`~asynccoll.SparseVector`, calls take
        SparseVectors (or dense arrays) of its size and dtype, stale data accumulates sparse
        until it passes ``path.delta``, and each result's ``value`` is a SparseVector or a
        dense 1-D array as the sum's density dictates (docs/partial.md). ``op`` must be
        ``sum``; the sparse algorithm is ``path.algorithm`` or chosen from ``path.density``
        (the expected per-rank fraction of nonzeros, the same on every rank) and P.

        ``survive``: whether the handle goes on without a lost rank (default:
        :attr:`survive`): the survivors agree on who is lost, settle the execution under way
        and rebuild the schedule for themselves, and ``PartialResult.lost`` names the ranks
        lost (:mod:`asynccoll.comm.survival`, docs/groups.md). Dense and sparse handles; one
        made while a rank is being lost goes on without it like the others.

        ``path`` (:class:`~asynccoll.DataPath`): the route planner (:mod:`asynccoll.comm.route`)
        decides how the data moves; ``path`` overrides it. By default the data phase goes
        through shared memory (:mod:`asynccoll.comm.shm`; the activation rides on its
        wake-ups) when every rank is on this host, ``like`` is a NumPy array of at least
        128 KiB and no ``path.algorithm`` is named (unless ``ASYNCCOLL_SHM=0``), else over the
        network with the algorithm chosen by size and P. ``DataPath(shm=True)`` (or
        ``"one_shot"``/``"two_shot"``): always through shared memory, ``ValueError`` if the
        ranks are on several hosts; ``DataPath(shm=False)``: never; ``DataPath(algorithm=)``:
        a network algorithm. Creating the handle stays free of collectives: this rank's
        segments are made at once, its peers' mapped at the first execution
        (docs/collectives.md). A handle that survives a lost rank goes on over the network.
        Sparse handles go through shared memory with the split algorithms only
        (``ssar_split_allgather``, ``dsar_split_allgather``; ``shm=True`` without an
        algorithm takes the first), by default when every rank is on this host, the algorithm
        (chosen or given) is a split one and ``/dev/shm`` could hold every rank's segment
        twice over, at any size (docs/sparse.md). The hierarchical handle (shared memory
        within each host, a partial allreduce among hosts) is
        :meth:`hier_partial_allreduce`.

        Raises ``ValueError`` naming ``policy`` (a bad text, ``Sync()``, a quorum above P),
        ``op``, ``accumulate``, ``name`` (in use), ``like`` or ``path``; ``TypeError`` naming
        the new spelling for a keyword that is gone (``quorum=``: ``Quorum(k)``; ``shm=``:
        ``path=DataPath(shm=...)``; ...) and for ``accumulate=True``/``False``; ``OSError``
        when this rank's shared-memory segments cannot be created. Builds and arms the
        schedule at once (so other ranks' activations are answered from now on); costs
        O(P log P) Python work.
        """
        survives = self.survive if survive is None else bool(survive)
        if self._closed or not survives:  # (a surviving handle made after a loss recovers)
            self._check_open()
        policy = _partial_policy(policy)
        accumulate = as_accumulate(accumulate)
        path = DataPath() if path is None else path
        if not isinstance(path, DataPath):
            raise TypeError(f"path must be a DataPath or None, got {type(path).__name__}")
        like, like_kind = from_tensor(like, "like")
        sparse = isinstance(like, SparseVector)
        if not sparse:
            check_array(like, "like")
            if path.density is not None or path.delta is not None:
                raise ValueError("path: density and delta apply to sparse handles only (like "
                                 "must be a SparseVector)")
        policy.activation(self.size)  # ValueError naming the policy when it does not fit P
        average = op == "avg"
        if average:
            avg_op(op, like)
            if accumulate is Accumulate.WORLD:
                raise ValueError("accumulate=Accumulate.WORLD divides by the world size; "
                                 "op='avg' divides by contributions: give one of them")
            op = "sum"
            accumulate = Accumulate.MEAN if accumulate.sums else Accumulate.LATEST
        check_op(op)
        if accumulate in (Accumulate.MEAN, Accumulate.WORLD) and (
                sparse or op != "sum" or not np.issubdtype(np.dtype(like.dtype), np.floating)):
            raise ValueError(f"accumulate=Accumulate.{accumulate.name} needs dense "
                             f"floating-point data and op='sum' (got like="
                             f"{type(like).__name__}, op={op!r})")
        token: int | None = None
        algorithm, shm = path.router_args()
        # before the name is taken: a refusal must not shift the automatic names
        if sparse:
            sdt = np.dtype(like.values.dtype)
            chosen = choose_algorithm(path.density, self.size, like.size, sdt,
                                      path.delta)  # checks them
            algorithm, token = self._dense.router.sparse_partial(
                self._dense.layout, algorithm or chosen, algorithm, shm)
        else:
            token, algorithm = self._dense.router.dense_partial(self._dense.layout, like,
                                                                algorithm, shm)
        name = self._partial_name(name)
        contribution: Contribution = (
            SparseContribution(op, algorithm, density=path.density, delta=path.delta,
                               shm=token is not None) if sparse
            else DenseContribution(op, algorithm))
        runtime = HandleRuntime(self._engine, self.transport, self._writer, self.kernels,
                                self.live, self.stall_warn)
        plan = HandlePlan(contribution, like, name,
                          stable_id(name, 2) if policy.seed is None else policy.seed,
                          accumulate, self.timeout if timeout is None else timeout, token,
                          average=average and not accumulate.sums, like_kind=like_kind)
        h = self._engine.call(lambda: TensorPartialAllreduce(runtime, policy, plan))
        h.clock_offset = self.clock_offset
        if survives:
            self._engine.call(lambda: h.follow(Survival(h, self)))
        self._handles[name] = h
        return h

    @moved_arguments(**MOVED)
    def hier_partial_allreduce(self, policy: Policy | str, like: Any, op: str = "sum",
                               accumulate: Accumulate | str = Accumulate.LATEST, *,
                               name: str | None = None, timeout: float | None = None,
                               survive: bool | None = None) -> HierPartialAllreduce:
        """A hierarchical partial allreduce: within each host synchronous, through shared
        memory; among the hosts a partial allreduce of ``policy`` among their leaders, so a
        host activates as a unit (:mod:`asynccoll.comm.hier_partial`, docs/partial.md).
        ``policy``, ``op``, ``name``, ``timeout``: as :meth:`partial_allreduce`'s, a quorum
        counting hosts; ``accumulate``: ``LATEST`` or ``SUM``. NumPy arrays only.
        ``survive`` (default: :attr:`survive`): the handle goes on without a lost rank (a
        host without it, a new leader, a host without ranks dropped;
        :mod:`asynccoll.comm.hier_survival`); with ``op="sum"`` only (the default does not
        apply to another ``op``: such a handle raises on a loss).

        Raises ``TypeError`` naming ``like`` (not a NumPy array), ``ValueError`` naming
        ``policy``, ``op``, ``accumulate`` (``op="avg"``, ``MEAN`` and ``WORLD``: their
        divisors would count host sums, not ranks) or ``name``. Collective at its first call
        (it makes the host and leader groups); building it costs no I/O.
        """
        policy = _partial_policy(policy)
        accumulate = as_accumulate(accumulate)
        like, like_kind = from_tensor(like, "like")
        if isinstance(like, SparseVector) or like_kind is not None:
            raise TypeError("hier_partial_allreduce takes NumPy arrays (like), got "
                            f"{type(like).__name__}")
        if op == "avg" or accumulate in (Accumulate.MEAN, Accumulate.WORLD):
            raise ValueError(f"hier_partial_allreduce: op={op!r}, accumulate="
                             f"Accumulate.{accumulate.name}: averaging divisors would count "
                             "host sums, not ranks (use op='sum' and divide)")
        check_op(op)
        # the communicator's default gives way to another op (the handle then raises on a
        # loss); asked for by name, it is refused
        survives = self.survive and op == "sum" if survive is None else bool(survive)
        if survives and op != "sum":
            raise ValueError(f"hier_partial_allreduce: survive with op={op!r}: a lost "
                             "leader's host sums are counted again as sums (use op='sum')")
        if self.hosts:  # known (connect() learns them): quorum counts hosts
            policy.activation(len(self.hosts))
        name = self._partial_name(name)
        options: dict[str, Any] = {"op": op, "accumulate": accumulate, "timeout": timeout,
                                   "survive": survives}
        h = HierPartialAllreduce(cast("HierComm", self), policy, like, name, options, survives)
        self._hier_handles[name] = h
        return h

    def _partial_name(self, name: str | None) -> str:
        """``name`` checked (or the next automatic one) for a new partial handle, flat or
        hierarchical; ``ValueError`` when one of this communicator's has it already."""
        name = self._handle_name(name, "partial")
        if name in self._handles or name in self._hier_handles:
            raise ValueError(f"name {name!r} is already used by a partial allreduce of this "
                             "communicator")
        return name

    def _shortcut(self, kind: str, x: Any, quorum: int | None = None) -> PartialAllreduce:
        if isinstance(x, SparseVector):
            key: tuple[Any, ...] = (kind, "sparse", x.size, x.values.dtype.str, quorum)
        else:
            check_array(x, "x")
            key = (kind, tuple(x.shape), np.dtype(x.dtype).str, quorum)
        h = self._shortcuts.get(key)
        if h is None:
            h = self.partial_allreduce(Quorum(quorum) if quorum is not None else kind, x)
            h.flush_hint = None  # no flush to advise (PartialAllreduce.flush_hint)
            self._shortcuts[key] = h
        return h

    async def _shortcut_call(self, kind: str, x: Any, timeout: float | None,
                             quorum: int | None = None) -> PartialResult:
        a, tkind = from_tensor(x, "x")
        return wrap_result(await self._shortcut(kind, a, quorum)(a, timeout), tkind)

    def _shortcut_blocking(self, kind: str, x: Any, timeout: float | None,
                           quorum: int | None = None) -> PartialResult:
        # the handle's own blocking call: a call that rule 1 answers stays on this thread
        a, tkind = from_tensor(x, "x")
        return wrap_result(self._shortcut(kind, a, quorum).blocking(a, timeout), tkind)

    async def solo_allreduce(self, x: Any, timeout: float | None = None) -> PartialResult:
        """``partial_allreduce(Solo(), like=x)(x)`` with the handle cached per shape/dtype."""
        return await self._shortcut_call("solo", x, timeout)

    async def majority_allreduce(self, x: Any, timeout: float | None = None) -> PartialResult:
        """``partial_allreduce(Majority(), like=x)(x)``, cached per shape/dtype."""
        return await self._shortcut_call("majority", x, timeout)

    async def two_choice_allreduce(self, x: Any,
                                   timeout: float | None = None) -> PartialResult:
        """``partial_allreduce(TwoChoice(), like=x)(x)``, cached per shape/dtype."""
        return await self._shortcut_call("two_choice", x, timeout)

    async def quorum_allreduce(self, x: Any, k: int,
                               timeout: float | None = None) -> PartialResult:
        """``partial_allreduce(Quorum(k), like=x)(x)``, cached per shape/dtype/k."""
        return await self._shortcut_call("quorum", x, timeout, k)


def _partial_policy(policy: Policy | str) -> Policy:
    """``policy`` converted (:func:`~asynccoll.as_policy`) and refused when it is ``Sync()``."""
    p = as_policy(policy)
    if not p.partial:
        raise ValueError("policy Sync() is no partial allreduce: call comm.allreduce(x) "
                         "(partial_allreduce takes Solo(), Majority(), TwoChoice(), Quorum(k), "
                         "Backup(b) or Deadline())")
    return p


def avg_op(op: Any, x: Any) -> tuple[Any, bool]:
    """``("sum", True)`` for ``op="avg"`` on floating-point ``x`` (``ValueError`` naming
    ``op`` for other data), else ``(op, False)``."""
    if op != "avg":
        return op, False
    dt = x.values.dtype if isinstance(x, SparseVector) else x.dtype
    if np.dtype(dt).kind not in "fc":
        raise ValueError(f"op='avg' needs floating-point data, got dtype {dt}")
    return "sum", True


def as_kind(a: Any, kind: TensorKind | None) -> Any:
    """``a`` as the tensor type its input had (``kind``; None: as it is)."""
    return a if kind is None else kind.wrap(a)
