"""Which ranks differ, when the ranks define one collective differently.

At a collective's first use every rank contributes a hash of its definition (kind, shape, dtype,
op, algorithm, ...) to an allgather, so that every rank holds every rank's hash and can say who
differs, not only that someone does: :func:`odd_ranks` groups the ranks by hash and names those
outside the largest group (the ranks below the first one of the largest group win a tie), and
:func:`disagreement` words the error every rank raises. Pure functions of the gathered hashes:
every rank names the same ranks. O(P).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["disagreement", "odd_ranks"]


def odd_ranks(hashes: Sequence[int]) -> list[int]:
    """The ranks whose hash differs from the most common one (of two equally common, the one
    of the lower rank); ``[]`` when all agree."""
    groups: dict[int, list[int]] = {}
    for r, h in enumerate(hashes):
        groups.setdefault(int(h), []).append(r)
    if len(groups) <= 1:
        return []
    common = max(groups.values(), key=lambda rs: (len(rs), -rs[0]))
    return [r for r in range(len(hashes)) if int(hashes[r]) != int(hashes[common[0]])]


def disagreement(rank: int, kind: str, hashes: Sequence[int],
                 definition: Mapping[str, Any]) -> str:
    """The message of the error raised on ``rank`` when the gathered ``hashes`` differ: which
    ranks differ from the others, and this rank's ``definition``."""
    odd = odd_ranks(hashes)
    desc = ", ".join(f"{k}={v!r}" for k, v in definition.items() if k != "slot")
    same = [r for r in range(len(hashes)) if int(hashes[r]) == int(hashes[rank])]
    who = (f"rank {odd[0]} differs" if len(odd) == 1 else f"ranks {odd} differ")
    alike = f" (as ranks {same} do)" if len(same) > 1 else ""
    return (f"rank {rank}: the ranks disagree on the {kind} called at the same point: {who} "
            f"from the others in its definition (shape, dtype, op, root or algorithm); rank "
            f"{rank} has {desc}{alike}")
