"""``DistributedOptimizer``: any ``torch.optim`` optimizer over a (partial) gradient allreduce.

Horovod-style: ``opt = DistributedOptimizer(torch.optim.Adam(model.parameters()), comm,
Majority())``, then the usual synchronous loop ``opt.zero_grad(); loss.backward();
opt.step()``. Each ``step()`` fuses the parameters' gradients into one flat bucket, reduces it
by the ``policy`` (and ``algorithm``) and hands the averaged gradient to the inner optimizer's
``step()``; it returns (and keeps as :attr:`DistributedOptimizer.last`) a
:class:`~asynccoll.StepInfo`: round, included, contributors, count, staleness, the learning
rate used.

**Policy and algorithm** (one vocabulary with :class:`asynccoll.train.EagerSGD` and
:func:`asynccoll.torch.partial_hook`). ``policy`` is a straggler policy value
(:mod:`asynccoll.collectives.policy`) or its text (``"majority"``, ``"quorum:3"``): *when* a
round starts. ``algorithm`` is what a step does with the rounds: ``None`` (the policy's plain
averaging), ``"rna"`` or ``"odsgd"``. RNA and OD-SGD are algorithms, not policies: RNA runs
its averaging over a policy (``TwoChoice()``, its paper's, by default), OD-SGD overlaps a
synchronous allreduce and takes no partial policy. So ``mode="rna"`` became
``algorithm="rna"`` (policy ``TwoChoice()``), ``mode="odsgd"`` ``algorithm="odsgd"``, and
``mode="quorum", quorum=k`` ``policy=Quorum(k)``; the old keywords raise ``TypeError`` naming
the new spelling.

* ``Sync()`` (the default): an averaging allreduce, the synchronous baseline.
* ``Solo()``, ``Majority()``, ``TwoChoice()``, ``Quorum(k)``: eager-SGD's partial allreduce
  with stale gradients carried to the next round, **averaged by the world** (each round's sum
  divided by P, so every gradient enters once with weight 1/P as under synchronous SGD; after
  a survived loss by the ranks the round spanned, ``PartialResult.world_size``, as
  :class:`asynccoll.train.EagerSGD`; the default because it keeps synchronous SGD's accuracy,
  docs/torch.md *Accuracy*;
  ``average="contributions"``: by the round's own count, larger steps when rounds are small),
  rounds missed by this rank summed (``accumulate=True``) or superseded by the latest (False).
  On examples/torch_ddp.py each ended 0.1 to 0.6 points below synchronous DDP over Gloo
  (rank 0's mean test accuracy over the last 10 evaluations, 3 seeds, 2 runs each:
  docs/torch.md *Accuracy*); ``algorithm="rna"`` 1.0 and ``"odsgd"`` 1.2 points below.
* ``Deadline(quorum=k, bounds=(lo, hi), mad_factor=, window=)``: as ``Quorum(k)`` (default
  k = P), but a round also starts when an adaptive deadline after its first arrival expires
  (docs/partial.md, *Deadline*); ``StepInfo.deadline`` and ``.deadline_expired`` say what
  happened.
* ``Backup(b)``: synchronous SGD with backup workers: a quorum of P - b, **late gradients
  dropped** (the combine hook of :class:`asynccoll.train.BackupSGD`), each round averaged by
  its contributions (the P - b gradients it kept) by default, and a round short of P - b
  (only a flush makes one: a rank still stepping after the others finished) by P - b, as if
  the missing gradients were zeros. (``Quorum(P - b)`` carries late gradients to the next
  round instead.) Over the last steps it keeps synchronous accuracy (-0.3 points on the
  digits); before short rounds were averaged by the quorum, a round that kept one gradient
  was a full step on it, and one reading after :meth:`~DistributedOptimizer.finish` fell 8
  points in one run of six there. ``average="world"`` (a quarter step for such a round, three
  quarters for every full one) measured -1.3 points, worse, so ``"contributions"`` stays the
  default.
* ``algorithm="rna"`` (``staleness_bound``, ``scale_lr``): RNA §3.2-3.3, as
  :class:`asynccoll.train.RNA`: a two-choice initiator by default (another partial policy may
  be given; ``Sync()`` is refused); a rank whose earlier gradients still wait in the send
  buffer contributes their **staleness-weighted mean** (the oldest weighs 1, newer ones
  linearly more; older than ``staleness_bound`` steps: dropped), so it counts once per round;
  the round's sum is **divided by its contributors** and, with ``scale_lr=True`` (RNA's
  linear scaling rule), each param group's learning rate is multiplied by contributors / P for
  that step (P: the ranks the round spanned, fewer after a survived loss). Around SGD a
  step is then ``lr * sum / P``, and with every rank in every round it is synchronous SGD
  exactly. Under a straggler per step less gradient reaches the model than under synchronous
  SGD: 1.0 point below it on the digits (0.3 to 1.8 per seed; docs/torch.md *Accuracy*);
  ``scale_lr=False`` (-0.9) and ``staleness_bound=None`` (-1.4) were no better, so the
  defaults stay.
* ``algorithm="odsgd"`` (``warmup``, ``local``, ``local_lr``, ``lam``; the policy
  ``Sync()``): OD-SGD (Algorithm 2). After ``warmup`` synchronous steps, step t starts the
  allreduce of g_t and, without waiting for it, applies the average of g_{t-1} with the inner
  optimizer to the **global weights** W (equal on every rank), so the communication of a step
  overlaps the next step's computation. Without a local updater (the default) the model trains
  on W: synchronous SGD one step late (``staleness`` 1). With one (``local="sgd"``,
  ``"dc-asgd-c"`` or ``"dc-asgd-a"``, rate ``local_lr``) the model trains on
  ``local(W, g_t)``: W moved at once by the rank's own gradient (compensated by DC-ASGD's
  ``lam`` for having been computed off W), while the global update arrives one step later.
  Does not keep synchronous accuracy: 1.2 points below it on the digits (0.4 to 2.3 per seed,
  deterministic); ``local="sgd"`` was 0.7 below but lost on one seed of three, within the
  seeds' spread, so the default stays the plain algorithm (docs/torch.md *Accuracy*).

The constructor broadcasts rank ``root``'s parameters and optimizer state
(:func:`~asynccoll.torch.broadcast_parameters`), so replicas start equal.
:meth:`DistributedOptimizer.finish` (collective, after the last step) drains what is in flight,
applies it and, with ``average=True``, averages the parameters (stateful optimizers such as
Adam drift apart under partial policies: each rank groups the same rounds into different
steps); ``average=False`` gives every rank rank 0's parameters instead. Either way every
replica ends equal to the bit. ``zero_grad``, ``state_dict``, ``load_state_dict``,
``param_groups`` and ``state`` are the inner optimizer's.

Do not wrap the model in ``DistributedDataParallel`` as well: DDP already averages the
gradients in the backward pass, and this wrapper would reduce them a second time. The
constructor and the first ``step()`` refuse parameters that a DDP model holds (``ValueError``
saying what to do).
"""

from __future__ import annotations

import concurrent.futures
import math
from typing import Any

import torch

from ..collectives.policy import (
    POLICY_MOVED,
    Accumulate,
    Backup,
    Policy,
    Sync,
    TwoChoice,
    as_policy,
    moved_arguments,
)
from ..results import PartialResult
from ..train._staleness import check_staleness_bound, staleness_combine
from ..train.backup import drop_late, short_round_scale
from ..train.info import StepInfo
from ..train.updaters import DCASGD, SGD, make_updater
from ._comm import blocking, by_world, pieces, world_accumulate
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .joining import SyncEvents

__all__ = ["ALGORITHMS", "MOVED", "DistributedOptimizer"]

#: what a step does with the rounds, besides the policy's plain averaging (module doc)
ALGORITHMS = ("rna", "odsgd")
#: OD-SGD's local updaters (:func:`asynccoll.train.make_updater`)
LOCAL_UPDATERS = ("sgd", "dc-asgd-c", "dc-asgd-a")
# Options that only one algorithm reads; giving one without it is a mistake worth naming.
_ONLY = {"scale_lr": "rna", "warmup": "odsgd", "local": "odsgd", "local_lr": "odsgd",
         "lam": "odsgd"}

#: the keywords the constructor took before policies were values (0.1), and what to write now
MOVED = {
    "mode": "give policy=Sync(), Solo(), Majority(), TwoChoice(), Quorum(k), Deadline() or "
            "Backup(b) (asynccoll), or its text ('majority', 'quorum:3'); mode='rna' is "
            "algorithm='rna' (policy TwoChoice() by default), mode='odsgd' algorithm='odsgd'",
    "backups": "give policy=Backup(b)",
    **POLICY_MOVED,
}


def _rate(arg: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{arg} must be a finite number >= 0, got {v!r}")
    return float(v)


def _policy(policy: Policy | str | None, algorithm: str | None, P: int) -> Policy:
    """The policy the constructor runs (module doc), checked against the algorithm and P."""
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be None or one of {ALGORITHMS}, got {algorithm!r}")
    if isinstance(policy, str) and policy.strip() in ALGORITHMS:
        raise ValueError(f"policy={policy!r} is an algorithm, not a policy: give "
                         f"algorithm={policy.strip()!r} (module doc)")
    if policy is None:
        return TwoChoice() if algorithm == "rna" else Sync()
    p = as_policy(policy)
    if algorithm == "rna" and not p.partial:
        raise ValueError("policy must be a partial policy for algorithm='rna' (TwoChoice() by "
                         f"default), got {p!r}")
    if algorithm == "odsgd" and p.partial:
        raise ValueError("policy must be Sync() for algorithm='odsgd' (it overlaps a "
                         f"synchronous allreduce), got {p!r}")
    if p.partial:
        p.activation(P)  # ValueError naming the policy when it does not fit the world
    return p


class DistributedOptimizer(SyncEvents):
    """Wrap ``optimizer`` so that ``step()`` reduces gradients over ``comm`` first (module doc).

    ``comm``: a :class:`~asynccoll.Communicator` with a progress thread or
    :func:`asynccoll.init`'s communicator. ``policy``: a straggler policy value or its text
    (default ``Sync()``; ``TwoChoice()`` with ``algorithm="rna"``). ``algorithm``: None,
    ``"rna"`` or ``"odsgd"`` (:data:`ALGORITHMS`). Options:

    * ``accumulate`` (partial policies, default True): missed rounds summed, else superseded.
    * ``average`` (partial policies but ``algorithm="rna"``): ``"world"`` (by P: every gradient
      enters once with weight 1/P, as in synchronous SGD, however rounds split the steps;
      after a survived loss each round by the ranks it spanned; the default but for
      ``Backup(b)``) or ``"contributions"`` (each round's sum divided by its
      count; the default for ``Backup(b)``, whose rounds drop the late gradients). See
      docs/torch.md.
    * ``staleness_bound`` (``"rna"``, steps, default 4; None: unbounded) and ``scale_lr``
      (``"rna"`` only, default True): RNA's bounded staleness and linear scaling rule.
    * ``warmup`` (synchronous steps first, default 0), ``local`` (the local updater:
      ``"sgd"``, ``"dc-asgd-c"``, ``"dc-asgd-a"``), ``local_lr`` (its rate; default the first
      param group's ``lr`` when ``local`` is given, else no local updater) and ``lam``
      (DC-ASGD's lambda, default 0.04): ``"odsgd"`` only.

    ``broadcast``: broadcast ``root``'s parameters and state at construction. ``name``: the
    partial handle's name (distinct per optimizer, equal on every rank). ``timeout``: per
    collective (default: the communicator's).

    Raises ``ValueError`` naming the bad argument (all checked before any communication), or
    when the parameters do not share one dtype and device (CPU); ``TypeError`` naming the new
    spelling for the keywords of 0.1 (:data:`MOVED`: ``mode``, ``quorum``, ``backups``,
    ``seed``, ``deadline``, ``mad_factor``, ``deadline_window``). Costs per step: one copy of
    the gradients into the bucket, one collective of the parameter size, the inner step;
    ``"odsgd"`` with a local updater two more copies of the parameters and one vectorised
    update; ``"rna"`` with a staleness bound one copy of the gradient per waiting step.
    """

    @moved_arguments(**MOVED)
    def __init__(self, optimizer: torch.optim.Optimizer, comm: Any,
                 policy: Policy | str | None = None, *, algorithm: str | None = None,
                 accumulate: bool = True, average: str | None = None,
                 staleness_bound: int | None = 4, scale_lr: bool | None = None,
                 warmup: int | None = None, local: str | None = None,
                 local_lr: float | None = None, lam: float | None = None,
                 broadcast: bool = True, root: int = 0,
                 name: str = "distributed-optimizer", timeout: float | None = None) -> None:
        self.comm = blocking(comm)
        P = self.comm.size
        policy = _policy(policy, algorithm, P)
        given = {"scale_lr": scale_lr, "warmup": warmup, "local": local,
                 "local_lr": local_lr, "lam": lam}
        for arg, v in given.items():
            if v is not None and algorithm != _ONLY[arg]:
                raise ValueError(f"{arg} is only meaningful for algorithm={_ONLY[arg]!r}, "
                                 f"got algorithm={algorithm!r}")
        backup = isinstance(policy, Backup) and algorithm is None
        if average is None:
            average = "contributions" if backup or algorithm == "rna" else "world"
        if average not in ("contributions", "world"):
            raise ValueError(f"average must be 'contributions' or 'world', got {average!r}")
        if algorithm == "rna" and average != "contributions":
            raise ValueError("average must be 'contributions' for algorithm='rna' (RNA averages "
                             f"by contributors; scale_lr scales the step), got {average!r}")
        self.staleness_bound = check_staleness_bound(staleness_bound)
        self.scale_lr = True if scale_lr is None else bool(scale_lr)
        if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, int)
                                   or warmup < 0):
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        self.warmup = warmup or 0
        if local is not None and local not in LOCAL_UPDATERS:
            raise ValueError(f"local must be one of {LOCAL_UPDATERS}, got {local!r}")
        llr = None if local_lr is None else _rate("local_lr", local_lr)
        dc_lam = 0.04 if lam is None else _rate("lam", lam)
        self.optimizer = optimizer
        #: the straggler policy (:mod:`asynccoll.collectives.policy`; ``Sync()``: none)
        self.policy = policy
        #: ``"rna"``, ``"odsgd"`` or None (module doc)
        self.algorithm = algorithm
        self.average = average
        self.timeout = timeout
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups
                                           for p in g["params"]]
        refuse_ddp(self.params)
        dtypes = {(p.dtype, p.device.type) for p in self.params}
        if len(dtypes) != 1 or next(iter(dtypes))[1] != "cpu":
            raise ValueError(f"the parameters must share one dtype on the CPU, got "
                             f"{sorted(map(str, dtypes))}")
        #: OD-SGD's local updater (None: the model trains on the global weights)
        self.local: SGD | DCASGD | None = None
        if local is not None or llr is not None:
            name_ = local or "sgd"
            rate = self._lr() if llr is None else llr
            self.local = make_updater(name_, rate) if name_ == "sgd" else \
                make_updater(name_, rate, lam=dc_lam)
        n = sum(p.numel() for p in self.params)
        self._dtype = self.params[0].dtype
        if broadcast:
            broadcast_parameters({str(i): p.data for i, p in enumerate(self.params)}, root,
                                 comm=self.comm)
            broadcast_optimizer_state(optimizer, root, comm=self.comm)
        self.steps = 0
        self.last: StepInfo | None = None
        self._stale = 0
        self._combine: Any = drop_late if backup else None
        self._inflight: concurrent.futures.Future[Any] | None = None
        self._weights: torch.Tensor | None = None  # OD-SGD's W, kept while params differ
        self._pending: list[tuple[int, Any]] = []  # RNA: the steps the send buffer holds
        self._h: Any = None
        if policy.partial:
            # RNA divides by contributors itself (its combine makes a rank count once).
            op = "avg" if average == "contributions" and algorithm != "rna" else "sum"
            acc = world_accumulate(accumulate) if algorithm != "rna" and op == "sum" else \
                Accumulate.SUM if accumulate else Accumulate.LATEST
            self._h = self.comm.comm.partial_allreduce(
                policy, like=torch.zeros(n, dtype=self._dtype), op=op, accumulate=acc,
                name=name, timeout=timeout)
            self._h.flush_hint = "'opt.finish()' of the DistributedOptimizer"
            self._join_init()  # restarted ranks taken back at sync events (.joining)

    @property
    def world_size(self) -> int:
        """The ranks training now: the communicator's size, or, once the partial allreduce
        went on without lost ranks or took ranks in (a restart, a job that grew), the size of
        the membership it runs on (as ``EagerSGD.world_size``)."""
        return self.comm.size if self._h is None else int(self._h.world_size)

    # -- the inner optimizer's surface -------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        alg = "" if self.algorithm is None else f", algorithm={self.algorithm!r}"
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, {self.policy!r}{alg}, "
                f"rank={self.comm.rank}/{self.comm.size}, steps={self.steps})")

    # -- the step ----------------------------------------------------------------------------
    def _flat_grads(self) -> torch.Tensor:
        parts = [torch.zeros(p.numel(), dtype=self._dtype) if p.grad is None
                 else p.grad.detach().reshape(-1) for p in self.params]
        return torch.cat(parts)

    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _load(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, piece in pieces(flat, self.params):
                p.copy_(piece)

    def _apply(self, flat: torch.Tensor, lr_scale: float = 1.0) -> None:
        for p, piece in pieces(flat, self.params):
            p.grad = piece.clone()
        if lr_scale == 1.0:
            self.optimizer.step()
            return
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * lr_scale
        try:
            self.optimizer.step()
        finally:  # the very objects back, so schedulers see their own values
            for g, lr in zip(groups, saved, strict=True):
                g["lr"] = lr

    def step(self) -> StepInfo:
        """Reduce the parameters' ``.grad`` (``None``: zeros) and step the inner optimizer
        with the result; return what happened (module doc). Raises what the collective
        raises (``CollectiveTimeoutError``, ``ExecutionError``, ``PeerLostError``)."""
        if self.steps == 0:  # a DDP model made after the wrapper
            refuse_ddp(self.params)
        g = self._flat_grads()
        P = self.comm.size
        everyone = frozenset(range(P))
        s = self.steps
        self.steps += 1
        if self._h is None and (self.algorithm != "odsgd" or s < self.warmup):
            self._apply(self.comm.allreduce(g, op="avg", timeout=self.timeout))
            info = StepInfo(s, True, everyone, P, 0, self._lr(), fresh=everyone)
        elif self._h is None:  # OD-SGD after its warm-up
            self._odsgd(g)
            info = StepInfo(s - 1, True, everyone, P, 1, self._lr(), fresh=everyone)
        elif self._joining:  # a restarted rank's first step: receive the state (.joining)
            info = self._join_step()
        else:
            combine = self._combine if self.algorithm != "rna" else \
                staleness_combine(s, self._pending, self.staleness_bound)
            # a sync event planned to take a rank in (.joining): held in this step's own
            # execution, every rank that learned of the plan flushing with its gradient in it
            planned = self._joiners is not None and self._h.flush_planned
            coro = self._h.flush(self.timeout, g, combine=combine) if planned \
                else self._h(g, self.timeout, combine=combine)
            res: PartialResult = self.comm.submit(coro).result()
            self._stale = 0 if res.included else self._stale + 1
            lr = self._apply_result(res)
            # Sync events where the job takes restarted ranks back (.joining); elsewhere a
            # flushed result is just a result, as before
            synced = self._joiners is not None and (planned or res.flushed
                                                     or self._sync_wanted)
            drained = 0
            if synced:  # a sync event another rank started or planned, or one cut short
                drained = self._sync(finished=False, flushed=planned)[1]  # (applied here)
                self._pending.clear()
            if self._join_wanted():
                self._h.plan_flush()  # a rank is ready here: every rank holds the event soon
            info = StepInfo(res.round, res.included, res.contributors, res.count + drained,
                            self._stale,
                            lr, res.missed, synced, res.fresh, res.lateness,
                            res.latest_arrival, res.deadline, res.deadline_expired)
        self.last = info
        return info

    def _odsgd(self, g: torch.Tensor) -> None:
        """OD-SGD after warm-up: start g's allreduce, apply the previous one to W, then (with
        a local updater) move the model to ``local(W, g)``."""
        prev, self._inflight = self._inflight, self.comm.submit(
            self.comm.comm.allreduce(g, op="avg", timeout=self.timeout))
        if self.local is None:  # the model is W
            if prev is not None:
                self._apply(prev.result())
            return
        at = self._flat_params()  # the weights g was computed at
        if self._weights is None:  # first delayed step: the model is still W
            self._weights = at
        if prev is not None:
            self._load(self._weights)
            self._apply(prev.result())
            self._weights = self._flat_params()
        w = self._weights.clone()
        with torch.no_grad():
            self.local.apply(w, g, w_prev=at)
        self._load(w)

    def _apply_result(self, res: PartialResult) -> float:
        """Apply a partial result as the policy and algorithm average it; returns the learning
        rate used."""
        lr = self._lr()
        if not res.count:
            return lr
        value: torch.Tensor = res.value
        if self.algorithm == "rna":
            c = len(res.contributors)
            # the world the round spanned (fewer after a survived loss), as by_world's divisor
            scale = c / (res.world_size or self._h.world_size) if self.scale_lr else 1.0
            self._apply(value.div_(c), scale)
            return lr * scale
        if self.average != "contributions":
            value = by_world(res, self._h)
        elif self._combine is drop_late and self._h.quorum:
            # Backup(b): a round short of the quorum (only a flush makes one) is averaged by
            # the quorum, not by its own count (asynccoll.train.backup, "Averaging")
            value = value.mul_(short_round_scale(res.count, self._h.quorum))
        self._apply(value)
        return lr

    def _lr(self) -> float:
        lr = self.optimizer.param_groups[0].get("lr", 0.0)
        return float(lr)

    def finish(self, average: bool = True) -> int:
        """Collective: drain every gradient in flight and apply it (one inner step, if any
        was left), then, with ``average``, average the parameters over all ranks (one
        allreduce, whose result every rank receives alike), else give every rank rank 0's
        parameters (one broadcast): either way every replica ends equal to the bit, after a
        survived loss too (both over the survivors, rank 0 the lowest of them). Over a
        partial policy the inner optimizer's state ends equal too (rank 0's, one broadcast),
        and in a job that takes restarted ranks back (``survive``) this is a repeated sync
        event (every rank joins those another rank's finish starts, until all have called
        it: :mod:`.joining`). Call it once on every rank after the
        last step. Returns how many local gradients (over all ranks) the drain applied.
        ``"odsgd"`` leaves the model at the global weights W."""
        held = 0
        if self._inflight is not None:
            prev, self._inflight = self._inflight, None
            if self._weights is not None:
                self._load(self._weights)
                self._weights = None
            self._apply(prev.result())
            held = self.comm.size
        elif self._h is not None and self._joiners is not None:
            # sync events until every rank has called finish (ranks still stepping join the
            # events it starts: .joining), each averaging the parameters
            done = False
            while not done:
                done, n = self._sync(finished=True, average=average)
                held += n
            self._pending.clear()
            # Partial steps leave an adaptive optimizer's state a little different per rank:
            # rank 0's for all, so that every rank's checkpoint is the same to the bit.
            broadcast_optimizer_state(self.optimizer, 0, comm=self._comm_now())
            if average:
                return held
        elif self._h is not None:
            res = self._h.flush_blocking(self.timeout)
            held = res.count
            self._apply_result(res)
            self._pending.clear()
            broadcast_optimizer_state(self.optimizer, 0, comm=self.comm)  # (as above)
        # over the ranks training now: the survivors' after a lost rank (rank 0 the lowest)
        now = blocking(self._comm_now()) if self._h is not None else self.comm
        flat = self._flat_params()
        self._load(now.allreduce(flat, op="avg", timeout=self.timeout) if average
                   else now.broadcast(flat, 0, timeout=self.timeout))
        return held


def refuse_ddp(params: list[torch.Tensor]) -> None:
    """``ValueError`` when a ``DistributedDataParallel`` model holds any of ``params``: its
    backward pass already averages their gradients. Costs one pass over the collector's
    objects, and only while ``torch.distributed`` is initialised (DDP needs it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    import gc

    from torch.nn.parallel import DistributedDataParallel

    mine = {id(p) for p in params}
    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel) and any(
                id(p) in mine for p in obj.parameters()):
            raise ValueError(
                "the optimizer's parameters belong to a DistributedDataParallel model, which "
                "already averages their gradients in backward(): DistributedOptimizer would "
                "reduce them a second time. Use one of the two: drop DDP (train `ddp.module`, "
                "or the model itself, with DistributedOptimizer), or keep DDP with a plain "
                "optimizer and asynccoll.torch.partial_hook for a partial allreduce per bucket")
