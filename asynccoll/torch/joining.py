"""The :class:`~asynccoll.torch.DistributedOptimizer`'s sync events and its side of taking a
lost rank back (:mod:`asynccoll.comm.joining`, :mod:`asynccoll.train.joining`).

Over a partial policy the optimizer has **sync events**, as eager-SGD's: a flush of the
partial allreduce (every rank hands in what it holds and applies what it has not) and one
allreduce of the parameters with two kinds of flags, "finished" and "ready joiners". Any rank
triggers one by flushing (a rank that learned a restarted rank is ready does, at its next
step); a flush marks the results ``flushed``, and a rank that receives such a result joins the
event, so every rank enters the same events whatever its step count. A member that learned a
rank is ready *plans* the event instead (``plan_flush``, as :class:`~asynccoll.train.EagerSGD`
does): every rank learns it from the next execution and holds the event's flush in its next
step's own execution (``flush(x=g)``), one to three executions fewer. ``finish()`` repeats them
until every rank has called it, so a rank still stepping never meets a collective another rank
skips.

At an event that admits restarted ranks, the members first make their optimizer state equal
(the lowest member's ``state_dict``, one broadcast of its serialised bytes; partial steps leave
an adaptive optimizer's moments slightly different per rank), then the state goes to the
joiners striped: the parameters and every tensor of the inner optimizer's state, flattened in
a fixed order (the joiner's state is made first by one zero step, so both sides have the same
arrays), and the step counter; every rank checks a digest. The joiner's first ``step()``
receives it (its gradient, computed on parameters it had not yet received, is dropped) and
returns with ``StepInfo.joined`` set; ``opt.step_count`` is the global step to loop on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..comm import joining
from ..errors import PeerLostError
from ..results import PartialResult
from ..train.info import StepInfo
from ..train.joining import JoinSide
from ._comm import blocking, pieces
from .broadcast import broadcast_optimizer_state

__all__ = ["SyncEvents", "flat64", "load_flat64", "state_tensors"]


def state_tensors(optimizer: torch.optim.Optimizer,
                  params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor of ``optimizer``'s state for ``params``, in their order, each
    parameter's keys sorted: the same list on every rank (the state a joiner receives)."""
    out = []
    for p in params:
        st = optimizer.state.get(p, {})
        for k in sorted(st):
            if isinstance(st[k], torch.Tensor):
                out.append(st[k])
    return out


def flat64(tensors: list[torch.Tensor]) -> Any:
    """``tensors`` as one float64 NumPy array (a copy; empty for none)."""
    if not tensors:
        return np.zeros(0, np.float64)
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]).numpy()


def load_flat64(tensors: list[torch.Tensor], flat: Any) -> None:
    """Copy the float64 array ``flat`` (:func:`flat64`'s layout) back into ``tensors``."""
    src = torch.from_numpy(np.ascontiguousarray(flat))
    with torch.no_grad():
        for t, piece in pieces(src, tensors):
            t.copy_(piece.to(t.dtype))


class SyncEvents(JoinSide):
    """The sync events and joining side of :class:`~.optimizer.DistributedOptimizer`
    (module doc); the optimizer provides what is declared here."""

    comm: Any  # the blocking communicator (asynccoll.torch._comm.blocking)
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]
    timeout: float | None
    _h: Any
    _dtype: torch.dtype

    def _flat_params(self) -> torch.Tensor:
        raise NotImplementedError

    def _load(self, flat: torch.Tensor) -> None:
        raise NotImplementedError

    def _apply_result(self, res: PartialResult) -> float:
        raise NotImplementedError

    def _job_comm(self) -> Any:
        return self.comm.comm

    def _handle(self) -> Any:
        return self._h

    def _comm_now(self) -> Any:
        c = self._h.communicator
        return self.comm.comm if c is None else c

    # -- sync events -------------------------------------------------------------------------
    def _sync(self, *, finished: bool, average: bool = True,
              flushed: bool = False) -> tuple[bool, int]:
        """One sync event (module doc): returns (whether every rank has finished, how many
        local gradients the flush applied). ``flushed``: the event's flush was the step's own
        (planned), its result applied."""
        count = 0
        if not flushed:
            res = self._h.flush_blocking(self.timeout)
            self._apply_result(res)
            count = res.count
        now = self._comm_now()
        P = self.comm.comm.job.size  # a flag per rank of the job (its vacant ranks too)
        flat = self._flat_params().to(torch.float64).numpy()
        n = flat.size
        buf = np.zeros(n + 2 + (P if self._joiners is not None else 0), np.float64)
        buf[:n] = flat
        buf[n] = 1.0 if finished else 0.0
        buf[n + 1] = 0.0 if average else 1.0
        if self._joiners is not None:
            buf[n + 2:] = self._joiners.flags(now.members)
        self._sync_wanted = False
        try:
            tot = self.comm.submit(now.allreduce(buf, timeout=self.timeout)).result()
        except PeerLostError as exc:  # (in a job that survives losses: another event follows)
            self._lost_in_event(exc, "its parameters' allreduce", now)
            return False, count
        averaged = bool(tot[n + 1] == 0)
        if averaged:
            self._load(torch.from_numpy(tot[:n] / now.size).to(self._dtype))
        done = bool(tot[n] >= now.size)
        if not done and self._joiners is not None:
            admitted = self._joiners.agreed(tot[n + 2:], now.members)
            if admitted:
                try:
                    self._admit(now, admitted, equal=averaged)
                except PeerLostError as exc:
                    self._joiners.again(admitted)
                    self._lost_in_event(exc, f"taking {admitted} back")
        return done, count

    def _admit(self, now: Any, admitted: list[int], *, equal: bool) -> None:
        if not equal:
            got = blocking(now).broadcast(self._flat_params().numpy(), 0, timeout=self.timeout)
            self._load(torch.as_tensor(got))
        self._ensure_state()
        broadcast_optimizer_state(self.optimizer, 0, comm=now)  # equal on every member
        state = [self._flat_params().numpy(), self._flat_state()]
        self.comm.submit(joining.admit(self._h, now, admitted, state,
                                       {"steps": self.steps})).result()

    def _join_step(self) -> StepInfo:
        """A restarted rank's first step: be taken back, receive the state."""
        self._joining = False
        self._ensure_state()
        params = self._flat_params().numpy().copy()
        flat_state = self._flat_state()
        c = self.comm.comm
        grown, first, meta = self.comm.submit(
            joining.join(c, self._h.name, [params, flat_state], self.timeout)).result()
        self._load(torch.from_numpy(params))
        self._load_flat_state(flat_state)
        members = list(grown.members)
        ranks = [members.index(m) if m in members else -1 for m in range(c.size)]
        h = self._h
        self.comm.submit(c.on_runtime(lambda: h.grow(grown, first, ranks))).result()
        self.steps = int(meta.get("steps", 0))
        return StepInfo(first - 1, False, frozenset(), 0, 0, 0.0, joined=True,
                        fresh=frozenset(range(grown.size)))

    # -- the inner optimizer's state as one array ------------------------------------------
    def _ensure_state(self) -> None:
        """Make the inner optimizer's state if it has none yet (one zero step: the same
        arrays on every rank; the parameters it may move are replaced by the state sent)."""
        if all(p in self.optimizer.state and self.optimizer.state[p] for p in self.params):
            return
        saved = [p.grad for p in self.params]
        with torch.no_grad():
            before = self._flat_params().clone()
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self._load(before)
        for p, g in zip(self.params, saved, strict=True):
            p.grad = g

    def _flat_state(self) -> Any:
        return flat64(state_tensors(self.optimizer, self.params))

    def _load_flat_state(self, flat: Any) -> None:
        load_flat64(state_tensors(self.optimizer, self.params), flat)
