"""``DistributedOptimizer``: any ``torch.optim`` optimizer over a (partial) gradient allreduce.

Horovod-style: ``opt = DistributedOptimizer(torch.optim.Adam(model.parameters()), comm,
mode="majority")``, then the usual synchronous loop ``opt.zero_grad(); loss.backward();
opt.step()``. Each ``step()`` fuses the parameters' gradients into one flat bucket, reduces it
by ``mode`` and hands the averaged gradient to the inner optimizer's ``step()``; it returns
(and keeps as :attr:`DistributedOptimizer.last`) a :class:`~asynccoll.StepInfo`: round,
included, contributors, count, staleness, the learning rate used.

Modes:

* ``"sync"``: an averaging allreduce, the synchronous baseline.
* ``"solo"``, ``"majority"``, ``"two_choice"``, ``"quorum"`` (``quorum=k``, default P):
  eager-SGD's partial allreduce with stale gradients carried to the next round, **averaged by
  the world** (each round's sum divided by P, so every gradient enters once with weight 1/P as
  under synchronous SGD; the default because it keeps synchronous SGD's accuracy, docs/torch.md
  *Accuracy*; ``average="contributions"``: by the round's own count, larger steps when rounds
  are small), rounds missed by this rank summed (``accumulate=True``) or superseded by the
  latest (False). ``"majority"`` here ended 7.3 points below synchronous DDP's final accuracy
  on examples/torch_ddp.py (median of 3 seeds; ``"solo"``: +0.9), docs/torch.md *Accuracy*:
  prefer the DDP hook's majority or ``"solo"`` where final accuracy matters.
* ``"deadline"`` (``quorum=k``, default P; ``deadline=(lo, hi)``, ``mad_factor``,
  ``deadline_window``): as ``"quorum"``, but a round also starts when an adaptive deadline
  after its first arrival expires (docs/partial.md, *Deadline*); ``StepInfo.deadline`` and
  ``.deadline_expired`` say what happened.
* ``"backup"`` (``backups=b``): synchronous SGD with backup workers: a quorum of P - b, late
  gradients dropped (the combine hook of :class:`asynccoll.train.BackupSGD`), each round
  averaged by its contributions (the P - b gradients it kept) by default.
* ``"rna"`` (``staleness_bound``, ``scale_lr``): RNA §3.2-3.3, as
  :class:`asynccoll.train.RNA`: a two-choice initiator; a rank whose earlier gradients still
  wait in the send buffer contributes their **staleness-weighted mean** (the oldest weighs 1,
  newer ones linearly more; older than ``staleness_bound`` steps: dropped), so it counts once
  per round; the round's sum is **divided by its contributors** and, with ``scale_lr=True``
  (RNA's linear scaling rule), each param group's learning rate is multiplied by
  contributors / P for that step. Around SGD a step is then ``lr * sum / P``, and with every
  rank in every round it is synchronous SGD exactly.
* ``"odsgd"`` (``warmup``, ``local``, ``local_lr``, ``lam``): OD-SGD (Algorithm 2). After
  ``warmup`` synchronous steps, step t starts the allreduce of g_t and, without waiting for
  it, applies the average of g_{t-1} with the inner optimizer to the **global weights** W
  (equal on every rank), so the communication of a step overlaps the next step's
  computation. Without a local updater (the default) the model trains on W: synchronous SGD
  one step late (``staleness`` 1). With one (``local="sgd"``, ``"dc-asgd-c"`` or
  ``"dc-asgd-a"``, rate ``local_lr``) the model trains on ``local(W, g_t)``: W moved at once
  by the rank's own gradient (compensated by DC-ASGD's ``lam`` for having been computed off W),
  while the global update arrives one step later.

The constructor broadcasts rank ``root``'s parameters and optimizer state
(:func:`~asynccoll.torch.broadcast_parameters`), so replicas start equal.
:meth:`DistributedOptimizer.finish` (collective, after the last step) drains what is in flight,
applies it and, with ``average=True``, averages the parameters (stateful optimizers such as
Adam drift apart under partial modes: each rank groups the same rounds into different steps);
``average=False`` gives every rank rank 0's parameters instead. Either way every replica ends
equal to the bit. ``zero_grad``, ``state_dict``, ``load_state_dict``, ``param_groups`` and
``state`` are the inner optimizer's.

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

from ..collectives.partial import check_deadline, check_kind
from ..collectives.policy import (
    Accumulate,
    Deadline,
    Majority,
    Policy,
    Quorum,
    Solo,
    TwoChoice,
)
from ..results import PartialResult
from ..train._staleness import check_staleness_bound, staleness_combine
from ..train.backup import drop_late
from ..train.info import StepInfo
from ..train.updaters import DCASGD, SGD, make_updater
from ._comm import blocking, pieces
from .broadcast import broadcast_optimizer_state, broadcast_parameters

__all__ = ["DistributedOptimizer"]

MODES = ("sync", "solo", "majority", "two_choice", "quorum", "deadline", "backup", "rna",
         "odsgd")
#: OD-SGD's local updaters (:func:`asynccoll.train.make_updater`)
LOCAL_UPDATERS = ("sgd", "dc-asgd-c", "dc-asgd-a")

# The partial allreduce kind behind each mode that runs one.
_KIND = {"solo": "solo", "majority": "majority", "two_choice": "two_choice",
         "quorum": "quorum", "deadline": "deadline", "backup": "quorum", "rna": "two_choice"}
# Options that only some modes read; giving one to another mode is a mistake worth naming.
_ONLY = {"quorum": ("quorum", "deadline"), "backups": ("backup",),
         "deadline": ("deadline",), "mad_factor": ("deadline",),
         "deadline_window": ("deadline",), "scale_lr": ("rna",), "warmup": ("odsgd",),
         "local": ("odsgd",), "local_lr": ("odsgd",), "lam": ("odsgd",),
         "seed": tuple(_KIND)}


def _rate(arg: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{arg} must be a finite number >= 0, got {v!r}")
    return float(v)


class DistributedOptimizer:
    """Wrap ``optimizer`` so that ``step()`` reduces gradients over ``comm`` first (module doc).

    ``comm``: a :class:`~asynccoll.Communicator` with a progress thread or
    :func:`asynccoll.init`'s communicator. ``mode``: one of :data:`MODES` (module doc). Options,
    each read by the modes named (given to another mode: ``ValueError``):

    * ``backups``: b for ``"backup"`` (default 1).
    * ``quorum``: k for ``"quorum"`` (default P: every rank) as for ``"deadline"``.
    * ``accumulate`` (partial modes, default True): missed rounds summed, else superseded.
    * ``average`` (partial modes but ``"rna"``): ``"world"`` (by P: every gradient enters
      once with weight 1/P, as in synchronous SGD, however rounds split the steps; the default
      but for ``"backup"``) or ``"contributions"`` (each round's sum divided by its count; the
      default for ``"backup"``, whose rounds drop the late gradients). See docs/torch.md.
    * ``deadline=(lo, hi)`` seconds (or one number: fixed), ``mad_factor``,
      ``deadline_window``: ``"deadline"``'s adaptive deadline (defaults as
      :meth:`Communicator.partial_allreduce <asynccoll.Communicator.partial_allreduce>`).
    * ``staleness_bound`` (``"rna"``, steps, default 4; None: unbounded) and ``scale_lr``
      (``"rna"``, default True): RNA's bounded staleness and linear scaling rule.
    * ``warmup`` (``"odsgd"``, synchronous steps first, default 0), ``local`` (the local
      updater: ``"sgd"``, ``"dc-asgd-c"``, ``"dc-asgd-a"``), ``local_lr`` (its rate; default
      the first param group's ``lr`` when ``local`` is given, else no local updater) and
      ``lam`` (DC-ASGD's lambda, default 0.04).
    * ``seed``: the initiator draws of the partial modes (default: from ``name``).

    ``broadcast``: broadcast ``root``'s parameters and state at construction. ``name``: the
    partial handle's name (distinct per optimizer, equal on every rank). ``timeout``: per
    collective (default: the communicator's).

    Raises ``ValueError`` naming the bad argument (all checked before any communication), or
    when the parameters do not share one dtype and device (CPU). Costs per step: one copy of
    the gradients into the bucket, one collective of the parameter size, the inner step;
    ``"odsgd"`` with a local updater two more copies of the parameters and one vectorised
    update; ``"rna"`` with a staleness bound one copy of the gradient per waiting step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Any, mode: str = "sync", *,
                 quorum: int | None = None, backups: int | None = None,
                 accumulate: bool = True, average: str | None = None,
                 deadline: float | tuple[float, float] | None = None,
                 mad_factor: float | None = None, deadline_window: int | None = None,
                 staleness_bound: int | None = 4, scale_lr: bool | None = None,
                 warmup: int | None = None, local: str | None = None,
                 local_lr: float | None = None, lam: float | None = None,
                 seed: int | None = None, broadcast: bool = True, root: int = 0,
                 name: str = "distributed-optimizer", timeout: float | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        given = {"quorum": quorum, "backups": backups, "deadline": deadline,
                 "mad_factor": mad_factor, "deadline_window": deadline_window,
                 "scale_lr": scale_lr, "warmup": warmup, "local": local,
                 "local_lr": local_lr, "lam": lam, "seed": seed}
        for arg, v in given.items():
            if v is not None and mode not in _ONLY[arg]:
                raise ValueError(f"{arg} is only meaningful for mode in {_ONLY[arg]}, "
                                 f"got mode={mode!r}")
        if average is None:
            average = "contributions" if mode in ("backup", "rna") else "world"
        if average not in ("contributions", "world"):
            raise ValueError(f"average must be 'contributions' or 'world', got {average!r}")
        if mode == "rna" and average != "contributions":
            raise ValueError("average must be 'contributions' for mode='rna' (RNA averages by "
                             f"contributors; scale_lr scales the step), got {average!r}")
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
        self.comm = blocking(comm)
        P = self.comm.size
        kind = _KIND.get(mode)
        if mode == "backup":
            b = 1 if backups is None else backups
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < P:
                raise ValueError(f"backups must be an int in 0..{P - 1}, got {backups!r}")
            quorum = P - b
        if mode == "quorum" and quorum is None:
            quorum = P  # as documented: a quorum of every rank unless told otherwise
        if kind is not None:
            quorum = check_kind(kind, P, quorum)
        dconf = check_deadline(kind or mode, deadline, mad_factor, deadline_window)
        self.optimizer = optimizer
        self.mode = mode
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
        self._combine: Any = drop_late if mode == "backup" else None
        self._inflight: concurrent.futures.Future[Any] | None = None
        self._weights: torch.Tensor | None = None  # OD-SGD's W, kept while params differ
        self._pending: list[tuple[int, Any]] = []  # RNA: the steps the send buffer holds
        self._h: Any = None
        if kind is not None:
            policy: Policy = (
                Deadline(quorum, (dconf.lo, dconf.hi), dconf.m, dconf.window)
                if dconf is not None else Quorum(quorum) if quorum is not None
                else Majority(seed) if kind == "majority"
                else TwoChoice(seed) if kind == "two_choice" else Solo())
            #: the straggler policy of the mode (:mod:`asynccoll.collectives.policy`)
            self.policy = policy
            # RNA divides by contributors itself (its combine makes a rank count once).
            op = "avg" if average == "contributions" and mode != "rna" else "sum"
            self._h = self.comm.comm.partial_allreduce(
                policy, like=torch.zeros(n, dtype=self._dtype), op=op,
                accumulate=Accumulate.SUM if accumulate else Accumulate.LATEST, name=name,
                timeout=timeout)
            self._h.flush_hint = "'opt.finish()' of the DistributedOptimizer"

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
        return (f"DistributedOptimizer({type(self.optimizer).__name__}, mode={self.mode!r}, "
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
        if self.mode == "sync" or (self.mode == "odsgd" and s < self.warmup):
            self._apply(self.comm.allreduce(g, op="avg", timeout=self.timeout))
            info = StepInfo(s, True, everyone, P, 0, self._lr(), fresh=everyone)
        elif self.mode == "odsgd":
            self._odsgd(g)
            info = StepInfo(s - 1, True, everyone, P, 1, self._lr(), fresh=everyone)
        else:
            combine = self._combine if self.mode != "rna" else \
                staleness_combine(s, self._pending, self.staleness_bound)
            res: PartialResult = self.comm.submit(
                self._h(g, self.timeout, combine=combine)).result()
            self._stale = 0 if res.included else self._stale + 1
            lr = self._apply_result(res)
            info = StepInfo(res.round, res.included, res.contributors, res.count, self._stale,
                            lr, res.missed, False, res.fresh, res.lateness,
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
        """Apply a partial result as the mode averages it; returns the learning rate used."""
        lr = self._lr()
        if not res.count:
            return lr
        value: torch.Tensor = res.value
        if self.mode == "rna":
            c = len(res.contributors)
            scale = c / self.comm.size if self.scale_lr else 1.0
            self._apply(value.div_(c), scale)
            return lr * scale
        self._apply(value if self.average == "contributions" else value.div_(self.comm.size))
        return lr

    def _lr(self) -> float:
        lr = self.optimizer.param_groups[0].get("lr", 0.0)
        return float(lr)

    def finish(self, average: bool = True) -> int:
        """Collective: drain every gradient in flight and apply it (one inner step, if any
        was left), then, with ``average``, average the parameters over all ranks (one
        allreduce, whose result every rank receives alike), else give every rank rank 0's
        parameters (one broadcast): either way every replica ends equal to the bit. Call it
        once on every rank after the last step. Returns how many local gradients (over all
        ranks) the drain applied. ``"odsgd"`` leaves the model at the global weights W."""
        held = 0
        if self._inflight is not None:
            prev, self._inflight = self._inflight, None
            if self._weights is not None:
                self._load(self._weights)
                self._weights = None
            self._apply(prev.result())
            held = self.comm.size
        elif self._h is not None:
            res = self._h.flush_blocking(self.timeout)
            held = res.count
            self._apply_result(res)
            self._pending.clear()
        flat = self._flat_params()
        self._load(self.comm.allreduce(flat, op="avg", timeout=self.timeout) if average
                   else self.comm.broadcast(flat, 0, timeout=self.timeout))
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
