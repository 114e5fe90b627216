"""``DistributedOptimizer``: any ``torch.optim`` optimizer over a (partial) gradient allreduce.

Horovod-style: ``opt = DistributedOptimizer(torch.optim.Adam(model.parameters()), comm,
mode="majority")``, then the usual synchronous loop ``opt.zero_grad(); loss.backward();
opt.step()``. Each ``step()`` fuses the parameters' gradients into one flat bucket, reduces it
by ``mode`` and hands the averaged gradient to the inner optimizer's ``step()``; it returns
(and keeps as :attr:`DistributedOptimizer.last`) a :class:`~asynccoll.StepInfo`: round,
included, contributors, count, staleness.

Modes:

* ``"sync"``: an averaging allreduce, the synchronous baseline.
* ``"solo"``, ``"majority"``, ``"two_choice"``, ``"quorum"`` (``quorum=k``): eager-SGD's partial
  allreduce with stale gradients carried to the next round, **averaged by contributions**
  (each round's sum divided by its own count, RNA's contributor-weighted averaging), rounds
  missed by this rank summed (``accumulate=True``) or superseded by the latest (False).
* ``"backup"`` (``backups=b``): synchronous SGD with backup workers: a quorum of P - b, late
  gradients dropped (the combine hook of :class:`asynccoll.train.BackupSGD`).
* ``"odsgd"``: OD-SGD's one-step delay: step t starts the allreduce of g_t and applies the
  average of g_{t-1}, so the communication of a step overlaps the next step's computation
  (OD-SGD with a local rate of 0: ``staleness`` is 1).

The constructor broadcasts rank ``root``'s parameters and optimizer state
(:func:`~asynccoll.torch.broadcast_parameters`), so replicas start equal.
:meth:`DistributedOptimizer.finish` (collective, after the last step) drains what is in flight,
applies it and, with ``average=True``, averages the parameters so every replica ends equal
(stateful optimizers such as Adam drift apart under partial modes: each rank groups the same
rounds into different steps). ``zero_grad``, ``state_dict``, ``load_state_dict``,
``param_groups`` and ``state`` are the inner optimizer's.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch

from ..results import PartialResult
from ..train.backup import drop_late
from ..train.info import StepInfo
from ._comm import blocking, pieces
from .broadcast import broadcast_optimizer_state, broadcast_parameters

__all__ = ["DistributedOptimizer"]

MODES = ("sync", "solo", "majority", "two_choice", "quorum", "backup", "odsgd")


class DistributedOptimizer:
    """Wrap ``optimizer`` so that ``step()`` reduces gradients over ``comm`` first (module doc).

    ``comm``: a :class:`~asynccoll.Communicator` with a progress thread or
    :func:`asynccoll.init`'s communicator. ``mode``: one of :data:`MODES`; ``quorum``: k for
    ``"quorum"``; ``backups``: b for ``"backup"`` (default 1); ``accumulate``: partial modes,
    module doc; ``average``: partial modes, ``"contributions"`` (each round's sum divided by its
    count) or ``"world"`` (by P: every gradient enters once with weight 1/P, as in synchronous
    SGD, however rounds split the steps; see docs/torch.md). ``broadcast``: broadcast
    ``root``'s parameters and state at construction.
    ``name``: the partial handle's name (distinct per optimizer, equal on every rank).
    ``timeout``: per collective (default: the communicator's).

    Raises ``ValueError`` naming ``mode``, ``quorum`` or ``backups``, or when the parameters
    do not share one dtype and device (CPU). Costs per step: one copy of the gradients into the
    bucket, one collective of the parameter size, the inner step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Any, mode: str = "sync", *,
                 quorum: int | None = None, backups: int | None = None,
                 accumulate: bool = True, average: str = "contributions",
                 broadcast: bool = True, root: int = 0,
                 name: str = "distributed-optimizer", timeout: float | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if average not in ("contributions", "world"):
            raise ValueError(f"average must be 'contributions' or 'world', got {average!r}")
        self.average = average
        self.optimizer = optimizer
        self.comm = blocking(comm)
        self.mode = mode
        self.timeout = timeout
        P = self.comm.size
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups
                                           for p in g["params"]]
        dtypes = {(p.dtype, p.device.type) for p in self.params}
        if len(dtypes) != 1 or next(iter(dtypes))[1] != "cpu":
            raise ValueError(f"the parameters must share one dtype on the CPU, got "
                             f"{sorted(map(str, dtypes))}")
        n = sum(p.numel() for p in self.params)
        self._dtype = self.params[0].dtype
        if broadcast:
            broadcast_parameters({str(i): p.data for i, p in enumerate(self.params)}, root,
                                 comm=self.comm)
            broadcast_optimizer_state(optimizer, root, comm=self.comm)
        self.steps = 0
        self.last: StepInfo | None = None
        self._stale = 0
        self._combine: Any = None
        self._inflight: concurrent.futures.Future[Any] | None = None
        self._h: Any = None
        kind = {"backup": "quorum"}.get(mode, mode)
        if mode == "backup":
            b = 1 if backups is None else backups
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < P:
                raise ValueError(f"backups must be an int in 0..{P - 1}, got {backups!r}")
            quorum = P - b
            self._combine = drop_late
        if mode not in ("sync", "odsgd"):
            self._h = self.comm.comm.partial_allreduce(
                kind, like=torch.zeros(n, dtype=self._dtype),
                op="avg" if average == "contributions" else "sum",
                accumulate=accumulate, quorum=quorum, name=name, timeout=timeout)

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

    def _apply(self, flat: torch.Tensor) -> None:
        for p, piece in pieces(flat, self.params):
            p.grad = piece.clone()
        self.optimizer.step()

    def step(self) -> StepInfo:
        """Reduce the parameters' ``.grad`` (``None``: zeros) and step the inner optimizer
        with the result; return what happened (module doc). Raises what the collective
        raises (``CollectiveTimeoutError``, ``ExecutionError``, ``PeerLostError``)."""
        g = self._flat_grads()
        P = self.comm.size
        everyone = frozenset(range(P))
        s = self.steps
        self.steps += 1
        if self.mode == "sync":
            self._apply(self.comm.allreduce(g, op="avg", timeout=self.timeout))
            info = StepInfo(s, True, everyone, P, 0, self._lr(), fresh=everyone)
        elif self.mode == "odsgd":
            prev, self._inflight = self._inflight, self.comm.submit(
                self.comm.comm.allreduce(g, op="avg", timeout=self.timeout))
            if prev is not None:
                self._apply(prev.result())
            info = StepInfo(s - 1, True, everyone, P, 1, self._lr(), fresh=everyone)
        else:
            res: PartialResult = self.comm.submit(
                self._h(g, self.timeout, combine=self._combine)).result()
            self._stale = 0 if res.included else self._stale + 1
            if res.count:
                self._apply(self._averaged(res.value))
            info = StepInfo(res.round, res.included, res.contributors, res.count, self._stale,
                            self._lr(), res.missed, False, res.fresh, res.lateness,
                            res.latest_arrival)
        self.last = info
        return info

    def _averaged(self, value: torch.Tensor) -> torch.Tensor:
        return value if self.average == "contributions" else value.div_(self.comm.size)

    def _lr(self) -> float:
        lr = self.optimizer.param_groups[0].get("lr", 0.0)
        return float(lr)

    def finish(self, average: bool = True) -> int:
        """Collective: drain every gradient in flight and apply it (one inner step, if any
        was left), then, with ``average``, average the parameters over all ranks so that
        every replica is equal. Call it once on every rank after the last step. Returns how
        many local gradients (over all ranks) the drain applied."""
        held = 0
        if self._inflight is not None:
            prev, self._inflight = self._inflight, None
            self._apply(prev.result())
            held = self.comm.size
        elif self._h is not None:
            res = self._h.flush_blocking(self.timeout)
            held = res.count
            if res.count:
                self._apply(self._averaged(res.value))
        if average:
            with torch.no_grad():
                flat = torch.cat([p.detach().reshape(-1) for p in self.params])
                avg = self.comm.allreduce(flat, op="avg", timeout=self.timeout)
                for p, piece in pieces(avg, self.params):
                    p.copy_(piece)
        return held
