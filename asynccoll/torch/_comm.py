"""What the PyTorch helpers share: the synchronous communicator they run on, flat buffers cut
back into tensors, and averaging by the world."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..collectives.policy import Accumulate
from ..comm.blocking import BlockingCollectives
from ..comm.communicator import Communicator
from ..results import PartialResult

__all__ = ["blocking", "by_world", "pieces", "world_accumulate"]


def pieces(flat: torch.Tensor, tensors: Sequence[torch.Tensor],
           ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(t, view)`` for each ``t`` of ``tensors`` in order: ``view`` is the next ``t.numel()``
    elements of the flat ``flat``, shaped like ``t`` (no copy)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        yield t, flat[offset:offset + n].view(t.shape)
        offset += n


def blocking(comm: Any) -> BlockingCollectives:
    """``comm`` as its blocking facade: a :class:`~asynccoll.Communicator` (with a progress
    thread) or what :func:`asynccoll.init` returned. ``TypeError`` naming ``comm`` otherwise."""
    if isinstance(comm, BlockingCollectives):
        return comm
    if isinstance(comm, Communicator):
        return comm.blocking
    raise TypeError(f"comm must be a Communicator or asynccoll.init()'s communicator, got "
                    f"{type(comm).__name__}")


def world_accumulate(accumulate: bool) -> Accumulate:
    """The handle's ``accumulate`` for ``average="world"``: missed rounds summed each divided by
    the size of the world it spanned as it completes (``WORLD``, as
    :class:`~asynccoll.train.EagerSGD`'s), or the latest round only (``LATEST``)."""
    return Accumulate.WORLD if accumulate else Accumulate.LATEST


def by_world(res: PartialResult, handle: Any) -> torch.Tensor:
    """``res.value`` averaged by the world: each round's sum divided by the number of ranks its
    execution spanned (``res.world_size``: P, or the survivors' number after a lost rank), the
    divisor :class:`~asynccoll.train.EagerSGD` uses. A ``WORLD`` handle divided each round as
    it completed; otherwise (``LATEST``: one round) it is divided here, in place. Every rank
    divides the same round by the same number, so the bits agree."""
    value: torch.Tensor = res.value
    if handle.accumulate is Accumulate.WORLD:
        return value
    return value.div_(res.world_size or handle.world_size)
