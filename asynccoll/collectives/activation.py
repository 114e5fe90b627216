"""The activation broadcast of partial collectives (eager-SGD §4.1.1) as schedule ops.

Any rank may start an execution; the others must learn of it and join. As in the paper, the
activation runs over the union of the binomial trees rooted at every rank of a hypercube: a rank
that starts sends an empty ACTIVATION message along every dimension; a rank reached along
dimension k forwards along the dimensions below k only. From one initiator that is a binomial
tree: every rank is reached exactly once, ``ceil(log2 P)`` hops deep, with P - 1 messages. Every
op is consumable and every dependency is an OR, so with several initiators each send still
fires at most once per execution and the ranks reached are the union of their trees.

**Any P.** The binomial trees need a complete hypercube, and with P not a power of two the
missing nodes cut ranks off (the original library fails for P = 3, 5, 6). Here the hypercube has
``Q = 2**ceil(log2 P)`` nodes and each missing node ``v >= P`` is *hosted* by the real rank
``v - Q/2`` (its neighbour along the top dimension, always < P): the host posts the virtual
node's receives and performs its sends, with tags that say whether source and destination are
virtual (:data:`TAGS_USED` tags from ``tag``). The edge between host and hosted node is internal:
the hosted node counts as reached when its host starts. Every tree of the complete hypercube is
then present, so the activation reaches every rank from every initiator set, for every P >= 1
(tested for P = 1..17 and all initiator sets). An activated virtual node activates its host.

Cost per execution and rank: at most ``2 * ceil(log2 P)`` receives posted when the execution is
armed (one set for the rank, one for the node it hosts), and from a single initiator at most two
messages received and ``2 * ceil(log2 P)`` sent; fewer than 2P messages in all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from ..sched import Schedule
from .dense import build_barrier

__all__ = ["TAGS_USED", "Activation", "activation_broadcast", "add_triggers",
           "build_activation", "hosted_node", "hypercube_neighbours"]

#: the number of tags the activation uses from its ``tag`` (real/virtual source x destination).
TAGS_USED = 4


def hypercube_neighbours(rank: int, world_size: int) -> list[int]:
    """The ranks ``rank ^ 2**i`` below ``world_size``, in increasing ``i``.

    >>> hypercube_neighbours(5, 6)
    [4, 1]
    >>> hypercube_neighbours(2, 3)
    [0]
    """
    _check(rank, world_size)
    out: list[int] = []
    bit = 1
    while bit < world_size:
        peer = rank ^ bit
        if peer < world_size:
            out.append(peer)
        bit <<= 1
    return out


def hosted_node(rank: int, world_size: int) -> int | None:
    """The missing hypercube node ``rank + Q/2`` that ``rank`` hosts, or ``None``.

    >>> [hosted_node(r, 5) for r in range(5)]
    [None, 5, 6, 7, None]
    """
    _check(rank, world_size)
    half = _half(world_size)
    v = rank + half
    return v if half and rank < half and v >= world_size else None


class Activation(NamedTuple):
    """The ops :func:`build_activation` added: the OR no-op, the receives and the sends."""

    activated: int
    recvs: tuple[int, ...]
    sends: tuple[int, ...]


def build_activation(s: Schedule, triggers: Sequence[int], *, tag: int = 0,
                     fused: int | None = None, quiet: Sequence[int] = ()) -> Activation:
    """Append the activation broadcast to ``s``; return its ops.

    ``triggers``: ops of ``s`` whose completion starts the activation from this rank (an
    internal start, a quorum of arrivals, a forced activation, ...). The returned ``activated``
    no-op fires once, on the first trigger or activation receive to complete (threshold 1); hang
    the collective's ops on it. The receives are sources (posted when the execution is armed, so
    a message can activate the rank from outside); the sends are OR-dependent on the triggers
    and on the receives of higher dimensions. Uses tags ``tag .. tag + TAGS_USED - 1``.

    ``fused``: a hypercube neighbour (P a power of two) with which this rank exchanges data
    as soon as it is activated, whichever way: the activation message along that edge is left
    out in both directions, and the caller adds the receives of that data to the
    ``activated`` op's dependencies (:func:`add_triggers`), so the data itself activates the
    rank. Every activated rank sends that data, so the edge still carries the activation.
    ``quiet``: ops that activate this rank without starting the broadcast from it (a quorum
    that every rank counts for itself, so nobody needs to be told).
    Raises ``ValueError`` when ``triggers`` is empty, ``tag`` is negative or ``fused`` is not
    a neighbour in a power-of-two world.
    """
    if tag < 0:
        raise ValueError(f"tag must be >= 0, got {tag}")
    if not triggers:
        raise ValueError("triggers must not be empty: nothing could start the activation")
    P, r = s.world_size, s.rank
    dims = (P - 1).bit_length()
    half = _half(P)

    def host(u: int) -> int:
        return u if u < P else u - half

    def tag_of(src: int, dst: int) -> int:
        return tag + 2 * (src >= P) + (dst >= P)

    if fused is not None and (P & (P - 1) or fused not in hypercube_neighbours(r, P)):
        raise ValueError(f"fused must be a hypercube neighbour of rank {r} in a power-of-two "
                         f"world, got {fused} with P = {P}")
    v = hosted_node(r, P)
    nodes = [r] if v is None else [r, v]
    recv: dict[tuple[int, int], int] = {}  # (node, dimension) -> receive op
    for u in nodes:
        for i in range(dims):
            w = u ^ (1 << i)
            if host(w) != r and w != fused:  # the host <-> hosted edge is internal
                recv[u, i] = s.recv(host(w), None, tag_of(w, u), msg="activation",
                                    label="activation in" if u == r else
                                    f"activation in (for node {u})")
    activated = s.nop(deps=[*triggers, *quiet, *recv.values()], k=1, label="activated")
    sends: list[int] = []
    for u in nodes:
        for j in range(dims):
            w = u ^ (1 << j)
            if host(w) == r or w == fused:
                continue
            # Along j once started, or once reached along a higher dimension; the hosted node
            # is "reached along the top dimension" when its host starts.
            deps = [*triggers, *(recv[u, i] for i in range(j + 1, dims) if (u, i) in recv)]
            sends.append(s.send(host(w), None, tag_of(u, w), deps=deps, k=1, msg="activation",
                                label="activation out" if u == r else
                                f"activation out (for node {u})"))
    return Activation(activated, tuple(recv.values()), tuple(sends))


def add_triggers(s: Schedule, activated: int, triggers: Sequence[int]) -> None:
    """Let any of ``triggers`` (source receives added after ``activated``: the fused data's)
    fire the ``activated`` op of :func:`build_activation` too, before ``s`` is committed."""
    op = s.ops[activated]
    s.ops[activated] = dataclasses.replace(op, deps=(*op.deps, *triggers), k=1)


def activation_broadcast(rank: int, world_size: int, *, tag: int = 0) -> Schedule:
    """A committed schedule: the activation broadcast, then a barrier (for tests and inspection).

    Its single start source is the internal trigger. The activation sends are not waited for (a
    rank reached from outside forwards along lower dimensions only, so some never fire); the
    barrier stands for the collective a partial schedule runs after activation: no rank
    completes, and so retires its receives, before every rank has been activated.
    """
    s = Schedule(rank, world_size, name="activation")
    start = s.nop(label="internal start")
    act = build_activation(s, [start], tag=tag)
    s.final = build_barrier(s, tag_base=tag + TAGS_USED, after=[act.activated])
    return s.commit()


def _check(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")


def _half(world_size: int) -> int:
    """Q/2 for the hypercube of Q = 2**ceil(log2 P) nodes (0 when P == 1)."""
    dims = (world_size - 1).bit_length()
    return (1 << dims) >> 1
