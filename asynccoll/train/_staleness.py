"""RNA's staleness-weighted local accumulation (RNA §3.3) as a partial allreduce ``combine``
hook, shared by :class:`~asynccoll.train.RNA` and
:class:`~asynccoll.torch.DistributedOptimizer`'s ``mode="rna"``.

A rank whose earlier gradients still wait in the send buffer contributes their weighted mean
``g' = sum(w_t g_t) / sum(w_t)`` with ``w_t = t - t0 + 1`` (``t0``: the oldest waiting step, so
it weighs 1 and newer ones linearly more). The rank therefore counts **once** per round (the
hook returns 1), so a round's ``count`` is its number of contributors. With
``staleness_bound`` a waiting gradient more than that many steps old is dropped and the mean
recomputed from the copies kept (at most ``staleness_bound + 1``); without one (``None``)
nothing is dropped and the mean is updated in place, no copies kept.
"""

from __future__ import annotations

from typing import Any

from ..comm.contribution import Combine

__all__ = ["check_staleness_bound", "staleness_combine"]


def check_staleness_bound(staleness_bound: Any) -> int | None:
    """``staleness_bound`` validated: an int >= 0 or None; ``ValueError`` naming it."""
    if staleness_bound is not None and (isinstance(staleness_bound, bool) or not
                                        isinstance(staleness_bound, int)
                                        or staleness_bound < 0):
        raise ValueError(f"staleness_bound must be an int >= 0 or None, "
                         f"got {staleness_bound!r}")
    return staleness_bound


def staleness_combine(step: int, pending: list[tuple[int, Any]],
                      staleness_bound: int | None) -> Combine:
    """The ``combine`` hook for the call of ``step`` (module doc).

    ``pending``: the caller's record of the steps whose gradients the send buffer holds (with
    a copy of each when ``staleness_bound`` may drop one, else None), one list per handle,
    kept across calls; the hook updates it. It runs under the handle's lock, atomically with
    the collective's snapshots. Costs O(size) per call without a bound, O(size) per waiting
    gradient with one.
    """
    bound = staleness_bound

    def combine(acc: Any, x: Any, n: int, late: bool) -> int:
        # ``n == 0``: a round took the buffer since the last call.
        if n == 0:
            pending.clear()
        if bound is None:
            if not pending:
                acc[...] = x
            else:  # the running mean: older weights do not change when a step is added
                t0 = pending[0][0]
                sw = sum(t - t0 + 1 for t, _ in pending)
                wk = step - t0 + 1
                acc *= sw / (sw + wk)
                acc += (wk / (sw + wk)) * x
            pending.append((step, None))
            return 1
        pending[:] = [(t, g) for t, g in pending if step - t <= bound]
        pending.append((step, x.copy()))
        t0 = pending[0][0]
        sw = sum(t - t0 + 1 for t, _ in pending)
        acc[...] = x * ((step - t0 + 1) / sw)
        for t, g in pending[:-1]:
            acc += ((t - t0 + 1) / sw) * g
        return 1

    return combine
