"""PyTorch, the way PyTorch users train (extra ``torch``; torch is imported only here).

* :func:`partial_hook`: a DDP communication hook running a partial allreduce per bucket.
* :class:`DistributedOptimizer`: any ``torch.optim`` optimizer over a (partial) allreduce.
* :func:`broadcast_parameters`, :func:`broadcast_optimizer_state`: start replicas equal.
* :func:`init_process_group`: torch.distributed for DDP's setup, under any launcher.

Every Communicator collective takes tensors as well (:mod:`asynccoll.comm.tensors`); the
helpers here are synchronous and take a Communicator with a progress thread or
:func:`asynccoll.init`'s communicator. See ``docs/torch.md``.
"""

from .broadcast import broadcast_optimizer_state, broadcast_parameters, init_process_group
from .hook import BucketStep, PartialHookState, partial_hook
from .optimizer import DistributedOptimizer

__all__ = ["BucketStep", "DistributedOptimizer", "PartialHookState", "broadcast_optimizer_state",
           "broadcast_parameters", "init_process_group", "partial_hook"]
