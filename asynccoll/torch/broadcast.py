"""Start replicas equal: broadcast a model's parameters and an optimizer's state from a root,
as Horovod's ``broadcast_parameters`` / ``broadcast_optimizer_state`` do."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ._comm import blocking, pieces

__all__ = ["broadcast_optimizer_state", "broadcast_parameters", "init_process_group"]


def broadcast_parameters(module_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
                         root: int = 0, *, comm: Any) -> None:
    """Overwrite every rank's parameters and buffers with ``root``'s, in place.

    ``module_or_state_dict``: a module (its ``state_dict()``: parameters and buffers) or a
    mapping of names to tensors; every rank passes the same names, shapes and dtypes.
    ``comm``: a :class:`~asynccoll.Communicator` (progress thread) or :func:`asynccoll.init`'s
    communicator. Tensors are fused per dtype into one broadcast each (a copy in and out of
    the fused buffer), so it costs one collective per dtype, not per tensor. Collective: every
    rank calls it. Raises ``ExecutionError`` when ranks disagree on the tensors. On a process
    that took a lost rank's place in a running job (``comm.joined``) it does nothing: the
    members are far past their start, and its state arrives when they take it back
    (:mod:`.hook_events`, :mod:`.joining`), so one script serves first starts and restarts.
    """
    sd = module_or_state_dict.state_dict() if isinstance(module_or_state_dict,
                                                         torch.nn.Module) \
        else module_or_state_dict
    c = blocking(comm)
    if c.comm.joined:
        return
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for name in sorted(sd):
        t = sd[name]
        if isinstance(t, torch.Tensor):
            groups.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype in sorted(groups, key=str):
            ts = groups[dtype]
            flat = torch.cat([t.detach().reshape(-1).cpu() for t in ts])
            for t, piece in pieces(c.broadcast(flat, root), ts):
                t.copy_(piece)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0, *,
                              comm: Any) -> None:
    """Load ``root``'s ``optimizer.state_dict()`` (state and hyper-parameters) on every rank.

    The state dict is serialised with ``torch.save`` on ``root`` and read back with
    ``torch.load(weights_only=True)`` elsewhere (tensors, numbers, lists, dicts only), so
    ranks whose optimizer has not stepped yet get root's state too. Collective. Costs two
    broadcasts (length, bytes) of the serialised size. Does nothing on a process that took
    a lost rank's place (``comm.joined``), as :func:`broadcast_parameters`.
    """
    c = blocking(comm)
    if c.comm.joined:
        return
    data = b""
    if c.rank == root:
        bio = io.BytesIO()
        torch.save(optimizer.state_dict(), bio)
        data = bio.getvalue()
    n = int(c.broadcast(np.array([len(data)], np.int64), root)[0])
    buf = np.frombuffer(data, np.uint8).copy() if c.rank == root else np.empty(n, np.uint8)
    got = c.broadcast(buf, root)
    if c.rank != root:
        optimizer.load_state_dict(torch.load(io.BytesIO(got.tobytes()), weights_only=True))


def init_process_group(comm: Any, backend: str = "gloo") -> None:
    """Initialise ``torch.distributed`` (for ``DistributedDataParallel``'s own setup) with the
    rank and world size of ``comm``, under any launcher.

    Under torchrun (``MASTER_ADDR``/``MASTER_PORT`` set) it uses ``env://``; otherwise (``asynccoll
    run``) rank 0 picks a free port on the host of the job's store (``ASYNCCOLL_STORE``, else
    127.0.0.1) and broadcasts it. Does nothing when torch.distributed is already initialised.
    Collective.

    In a job that takes lost ranks back (``comm.survive``: ``asynccoll run --max-failures``)
    every process gets a one-rank group of its own instead, without a collective: a process
    restarted in a lost rank's place cannot enter the first processes' Gloo group, and DDP
    needs its group only for its setup when :func:`~.hook.partial_hook` moves the gradients
    (``torch.distributed.get_world_size()`` is then 1: give ``DistributedSampler`` the
    communicator's ``size`` and ``rank``, and keep ``broadcast_buffers=False``).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    c = blocking(comm)
    if c.comm.survive:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        return
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        dist.init_process_group(backend, init_method="env://", rank=c.rank,
                                world_size=c.size)
        return
    host = os.environ.get("ASYNCCOLL_STORE", "127.0.0.1:0").rpartition(":")[0].strip("[]")
    host = host or "127.0.0.1"
    port = np.zeros(1, np.int64)
    if c.rank == 0:
        import socket

        with socket.socket() as s:
            s.bind((host, 0))
            port[0] = s.getsockname()[1]
    port = c.broadcast(port, 0)
    dist.init_process_group(backend, init_method=f"tcp://{host}:{int(port[0])}", rank=c.rank,
                            world_size=c.size)
