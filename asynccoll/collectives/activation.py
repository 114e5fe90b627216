"""The activation broadcast of partial collectives (eager-SGD §4.1.1) as schedule ops.

Any rank may start an execution; the others must learn of it and join. Each rank floods an empty
ACTIVATION message to its **hypercube neighbours** ``r ^ 2**i`` (those ``< P``) once it is
activated, and is activated by its own trigger or by the first activation message from any
neighbour (an OR dependency). Every op is consumable, so each send fires at most once per
execution however many ranks initiate it and however many messages arrive.

Why this graph: it reaches every rank for every ``P >= 1``. Clearing the top bit of ``r > 0``
gives a neighbour ``r' < r < P``, so every rank has a path to rank 0 and the neighbour graph is
connected; a flood over a connected graph reaches everyone. (A union of binomial trees that
sends only "down" from the initiator, as the original library did, leaves ranks unreached when P
is not a power of two.) For ``P = 2**m`` it is the union of the P binomial trees of the paper;
from a single initiator the activation reaches the farthest rank in ``ceil(log2 P)`` hops.

Cost per execution and rank: ``floor(log2 P) + 1`` receives posted when the execution is armed
(fewer for ranks whose neighbours fall outside P) and as many empty sends after activation.
Activation messages that arrive after the rank was activated are absorbed by their consumed
receives, or dropped by the matcher once the execution finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ..sched import Schedule

__all__ = ["Activation", "activation_broadcast", "build_activation", "hypercube_neighbours"]


def hypercube_neighbours(rank: int, world_size: int) -> list[int]:
    """The ranks ``rank ^ 2**i`` below ``world_size``, in increasing ``i``.

    >>> hypercube_neighbours(5, 6)
    [4, 1]
    >>> hypercube_neighbours(2, 3)
    [0]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    out: list[int] = []
    bit = 1
    while bit < world_size:
        peer = rank ^ bit
        if peer < world_size:
            out.append(peer)
        bit <<= 1
    return out


class Activation(NamedTuple):
    """The ops :func:`build_activation` added: the OR no-op, the receives and the sends."""

    activated: int
    recvs: tuple[int, ...]
    sends: tuple[int, ...]


def build_activation(s: Schedule, triggers: Sequence[int], *, tag: int = 0) -> Activation:
    """Append the activation broadcast to ``s``; return its ops.

    ``triggers``: ops of ``s`` whose completion activates this rank from inside (an internal
    start, a quorum of arrivals, ...). The returned ``activated`` no-op fires once, on the first
    of the triggers or activation receives to complete (threshold 1); hang the collective's ops
    on it. The receives are sources (posted when the execution is armed, so a message can
    activate the rank from outside) and use ``tag`` with ``msg="activation"``; the sends depend
    on ``activated``. Raises ``ValueError`` when there is no trigger and no neighbour (nothing
    could ever activate the rank) or ``tag`` is negative.
    """
    if tag < 0:
        raise ValueError(f"tag must be >= 0, got {tag}")
    peers = hypercube_neighbours(s.rank, s.world_size)
    if not triggers and not peers:
        raise ValueError("triggers must not be empty for a world of one rank")
    recvs = tuple(s.recv(p, None, tag, msg="activation", label="activation in")
                  for p in peers)
    activated = s.nop(deps=[*triggers, *recvs], k=1, label="activated")
    sends = tuple(s.send(p, None, tag, deps=activated, msg="activation",
                         label="activation out") for p in peers)
    return Activation(activated, recvs, sends)


def activation_broadcast(rank: int, world_size: int, *, tag: int = 0) -> Schedule:
    """A committed schedule that is only the activation broadcast (for tests and inspection).

    Its single start source is the internal trigger; an execution completes when the rank is
    activated and its activation sends have completed.
    """
    s = Schedule(rank, world_size, name="activation")
    start = s.nop(label="internal start")
    act = build_activation(s, [start], tag=tag)
    s.final = s.nop(deps=[act.activated, *act.sends], label="final")
    return s.commit()
