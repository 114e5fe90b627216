"""What the PyTorch helpers share: the synchronous communicator they run on, and flat
buffers cut back into tensors."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..comm.blocking import BlockingCollectives
from ..comm.communicator import Communicator

__all__ = ["blocking", "pieces"]


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
