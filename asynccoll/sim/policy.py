"""The simulator's side of the straggler policies, and the adaptive deadline.

The simulator takes the runtime's policy values (:mod:`asynccoll.collectives.policy`:
``Solo()``, ``Majority(seed=)``, ``TwoChoice(seed=)``, ``Quorum(k)``, ``Backup(b)``,
``Deadline(quorum=, bounds=, mad_factor=, window=)`` and ``Sync()``, a dense allreduce) or
their text, converted by :func:`~asynccoll.collectives.policy.as_policy`
(:data:`POLICY_SYNTAX`: ``quorum:12``, ``backup:2``, ``deadline:6:bounds=0.001..0.5``), and
prints them with ``str()``, so a policy reads the same in ``asynccoll sim run --policy``, in
a replay's table and in ``comm.partial_allreduce``. :func:`parse_policies` splits the
comma-separated list ``asynccoll sim replay --policies`` takes.

**The deadline** is the runtime's (:mod:`asynccoll.comm.partial`, ``Deadline()``), and so is
its decision function, :func:`~asynccoll.collectives.partial.next_deadline` (re-exported
here): the median of the recent arrival spreads plus ``mad_factor`` times their median
absolute deviation, clamped to ``bounds``; a median and a MAD, not a mean and a standard
deviation, because arrival spreads are heavy-tailed (one slow step must not double the next
deadline). An execution's spread is read from its allreduced meta by
:func:`~asynccoll.collectives.partial.arrival_spread` (the waiting calls' arrival stamps and
the late calls reported in it, so a deadline that cut calls off can grow); the first
execution uses the upper bound. The simulator runs it in virtual time with the
:class:`~asynccoll.Deadline` value's own parameters (:class:`~asynccoll.sim.SimPartial`).
"""

from __future__ import annotations

from ..collectives.partial import next_deadline
from ..collectives.policy import POLICY_SYNTAX, Policy, as_policy

__all__ = ["POLICY_SYNTAX", "next_deadline", "parse_policies"]


def parse_policies(text: str, world_size: int | None = None) -> list[Policy]:
    """The policies of a comma-separated list (each :func:`~asynccoll.as_policy`'s text),
    checked against ``world_size`` ranks when given (``ValueError`` naming the policy when
    one does not fit it: ``quorum:11`` for 10 ranks), so a replay refuses a bad list before it
    simulates anything. Raises ``ValueError`` naming the bad text, or for an empty list."""
    policies = [as_policy(t.strip()) for t in text.split(",") if t.strip()]
    if not policies:
        raise ValueError("policies must name at least one policy")
    if world_size is not None:
        for p in policies:
            if p.partial:
                p.activation(world_size)
    return policies
