"""Choosing the allreduce algorithm from P and the message size, by a latency-bandwidth model.

Each algorithm's time is estimated with the classic model: ``alpha`` seconds per message on the
critical path, ``beta`` seconds per byte moved, ``gamma`` seconds per byte reduced. With P' the
largest power of two <= P, r = P - P' (the ranks folded onto partners), lg = log2 P', n bytes:

=====================  ============================================================
recursive_doubling     fold + lg·(alpha + n·beta + n·gamma)
rabenseifner           fold + 2·lg·alpha + 2·n·(P'-1)/P'·beta + n·(P'-1)/P'·gamma
ring                   2·(P-1)·alpha + 2·n·(P-1)/P·beta + n·(P-1)/P·gamma
fold (when r > 0)      2·(alpha + n·beta) + n·gamma
=====================  ============================================================

:func:`choose_allreduce` takes the cheapest (ties go to the earlier of
:data:`ALLREDUCE_ALGORITHMS`). The default constants are fitted to two processes over the tcp
transport on the development machine (about 100 µs per small allreduce step, about 1 GB/s
effective for 16 MiB; ``np.add`` at about 9 GB/s of output, ``../shared/FACTS.md``). With them:

* P = 2: recursive doubling below about 1.9 MB, then Rabenseifner (the same bytes on the wire,
  but each rank reduces only half the vector);
* P = 4, 8, 16: recursive doubling below about 330 KiB / 200 KiB / 170 KiB, Rabenseifner above;
* P = 3, 5, 6, 7: recursive doubling below 55 / 150 / 235 / 330 KiB, then ring (it needs no fold,
  whose two extra full-size transfers Rabenseifner and recursive doubling pay);
* P = 9 and up: recursive doubling below about 200 KiB, Rabenseifner in a band above that, ring
  from about 400 KiB (P = 9) to 1 MiB (P = 15).

The model assumes one core per rank. Where ranks share cores (P > 2 on a 2-core machine), the
measured crossovers lie later (docs/collectives.md has the figures), because every extra step
costs process wake-ups on a busy CPU. A faster network (smaller alpha and beta) moves them the
other way; pass your own :class:`CostModel` or an explicit ``algorithm=`` to override.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ALLGATHER_ALGORITHMS",
    "BROADCAST_ALGORITHMS",
    "ALLREDUCE_ALGORITHMS",
    "DEFAULT_COST_MODEL",
    "REDUCE_SCATTER_ALGORITHMS",
    "CostModel",
    "choose_allgather",
    "choose_broadcast",
    "choose_allreduce",
    "choose_reduce_scatter",
]

#: the allreduce algorithms, in the order ties are broken.
ALLREDUCE_ALGORITHMS: tuple[str, ...] = ("recursive_doubling", "rabenseifner", "ring")
#: the broadcast algorithms, in the order ties are broken.
BROADCAST_ALGORITHMS: tuple[str, ...] = ("binomial", "scatter_allgather")
#: the allgather algorithms, in the order ties are broken.
ALLGATHER_ALGORITHMS: tuple[str, ...] = ("ring", "bruck")
#: the reduce-scatter algorithms; recursive halving needs P to be a power of two.
REDUCE_SCATTER_ALGORITHMS: tuple[str, ...] = ("recursive_halving", "ring")


@dataclass(frozen=True)
class CostModel:
    """Latency ``alpha`` (s per message), ``beta`` (s per byte sent), ``gamma`` (s per byte
    reduced). Raises ``ValueError`` naming a negative constant."""

    alpha: float = 100e-6
    beta: float = 1 / 1.0e9
    gamma: float = 1 / 9e9

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    def cost(self, algorithm: str, world_size: int, nbytes: int) -> float:
        """Estimated seconds of one allreduce of ``nbytes`` over ``world_size`` ranks."""
        P, n = world_size, float(nbytes)
        a, b, g = self.alpha, self.beta, self.gamma
        if P < 1:
            raise ValueError(f"world_size must be >= 1, got {P}")
        if P == 1 or n == 0:
            return 0.0
        p2 = 1 << (P.bit_length() - 1)
        lg = p2.bit_length() - 1
        fold = 2 * (a + n * b) + n * g if P > p2 else 0.0
        if algorithm == "recursive_doubling":
            return fold + lg * (a + n * b + n * g)
        if algorithm == "rabenseifner":
            f = (p2 - 1) / p2
            return fold + 2 * lg * a + 2 * n * f * b + n * f * g
        if algorithm == "ring":
            f = (P - 1) / P
            return 2 * (P - 1) * a + 2 * n * f * b + n * f * g
        raise ValueError(f"algorithm must be one of {ALLREDUCE_ALGORITHMS}, got {algorithm!r}")

    def broadcast_cost(self, algorithm: str, world_size: int, nbytes: int) -> float:
        """Estimated seconds of a broadcast of ``nbytes``: binomial ceil(log2 P)·(alpha +
        n·beta) (the root sends the whole vector to each of its children); scatter-allgather
        (ceil(log2 P) + P - 1)·alpha + 2·n·(P-1)/P·beta."""
        P, n = world_size, float(nbytes)
        if P < 1:
            raise ValueError(f"world_size must be >= 1, got {P}")
        if P == 1 or n == 0:
            return 0.0
        lg = (P - 1).bit_length()
        if algorithm == "binomial":
            return lg * (self.alpha + n * self.beta)
        if algorithm == "scatter_allgather":
            return (lg + P - 1) * self.alpha + 2 * n * (P - 1) / P * self.beta
        raise ValueError(f"algorithm must be one of {BROADCAST_ALGORITHMS}, got {algorithm!r}")

    def allgather_cost(self, algorithm: str, world_size: int, nbytes: int) -> float:
        """Estimated seconds of an allgather of ``nbytes`` per rank: ring
        (P-1)·(alpha + n·beta); Bruck ceil(log2 P)·alpha + (P-1)·n·beta + 2·P·n·gamma (its
        two local copies, priced like reductions)."""
        P, n = world_size, float(nbytes)
        if P < 1:
            raise ValueError(f"world_size must be >= 1, got {P}")
        if P == 1 or n == 0:
            return 0.0
        if algorithm == "ring":
            return (P - 1) * (self.alpha + n * self.beta)
        if algorithm == "bruck":
            return ((P - 1).bit_length() * self.alpha + (P - 1) * n * self.beta
                    + 2 * P * n * self.gamma)
        raise ValueError(f"algorithm must be one of {ALLGATHER_ALGORITHMS}, got {algorithm!r}")

    def choose(self, world_size: int, nbytes: int) -> str:
        """The algorithm of least estimated cost."""
        costs = [self.cost(alg, world_size, nbytes) for alg in ALLREDUCE_ALGORITHMS]
        return ALLREDUCE_ALGORITHMS[costs.index(min(costs))]


DEFAULT_COST_MODEL = CostModel()


def choose_allreduce(world_size: int, nbytes: int, model: CostModel | None = None) -> str:
    """The allreduce algorithm for ``world_size`` ranks and ``nbytes`` per rank.

    Deterministic in its arguments, so every rank chooses the same. ``model`` defaults to
    :data:`DEFAULT_COST_MODEL`. Raises ``ValueError`` for ``world_size < 1`` or ``nbytes < 0``.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return (model or DEFAULT_COST_MODEL).choose(world_size, nbytes)


def choose_allgather(world_size: int, nbytes: int, model: CostModel | None = None) -> str:
    """The allgather algorithm for ``nbytes`` per rank: Bruck (log2 P steps, two local copies)
    for small blocks, ring (no copies) for large ones; ties to ring."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    m = model or DEFAULT_COST_MODEL
    costs = [m.allgather_cost(a, world_size, nbytes) for a in ALLGATHER_ALGORITHMS]
    return ALLGATHER_ALGORITHMS[costs.index(min(costs))]


def choose_reduce_scatter(world_size: int, nbytes: int) -> str:
    """Recursive halving when ``world_size`` is a power of two (log2 P steps instead of P - 1,
    the same bytes; scratch of the whole vector instead of two blocks), ring otherwise."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return "recursive_halving" if world_size & (world_size - 1) == 0 else "ring"


def choose_broadcast(world_size: int, nbytes: int, model: CostModel | None = None) -> str:
    """The broadcast algorithm: binomial for small messages, scatter-allgather (about 2n bytes
    on the critical path instead of n·log2 P) for large ones; ties to binomial."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    m = model or DEFAULT_COST_MODEL
    costs = [m.broadcast_cost(a, world_size, nbytes) for a in BROADCAST_ALGORITHMS]
    return BROADCAST_ALGORITHMS[costs.index(min(costs))]
