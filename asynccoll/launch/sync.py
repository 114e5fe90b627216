"""``asynccoll.init()``: join the job from synchronous code; collectives that block.

For training loops without an event loop (``loss.backward(); opt.step()``), as
``torch.distributed.init_process_group`` or ``hvd.init()`` serve them. The returned object is
``comm.blocking`` of a :class:`~asynccoll.Communicator` connected by :func:`.connect` with a
progress thread: its collectives run on that thread and block the caller, while the thread
keeps answering the other ranks' activations when the caller computes.
"""

from __future__ import annotations

import asyncio

from ..comm.blocking import BlockingCollectives
from .connect import connect

__all__ = ["init"]


def init(rank: int | None = None, world_size: int | None = None,
         store: str | tuple[str, int] | None = None, transport: str | None = None, *,
         timeout: float = 60.0, secret: bytes | str | None = None,
         collective_timeout: float | None = None,
         trace: str | None = None) -> BlockingCollectives:
    """Join the job and return its synchronous communicator (``comm.blocking``).

    Arguments as :func:`asynccoll.connect` (the environment fills what is missing: ``asynccoll
    run``, torchrun, SLURM). ``comm.allreduce(x)`` and every other collective block and return
    what the coroutines return; ``comm.partial_allreduce(...)`` gives a handle whose calls
    block; ``comm.comm`` is the async Communicator underneath. Close with ``comm.close()``
    (collective) or ``with asynccoll.init() as comm:``. Raises ``RuntimeError`` when called
    with an event loop running in this thread (use ``await asynccoll.connect()`` there), and
    what :func:`connect` raises. Costs a rendezvous and a thread start.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("asynccoll.init() blocks; inside a running event loop use "
                           "'await asynccoll.connect()'")
    comm = asyncio.run(connect(rank, world_size, store, transport, progress="thread",
                               timeout=timeout, secret=secret,
                               collective_timeout=collective_timeout, trace=trace))
    return comm.blocking
