"""Schedule builders for collectives: pure functions that build one rank's :class:`Schedule`.

The dense, synchronous collectives live in :mod:`.dense` (see its docstring for the slot, tag
and composition conventions), the algorithm choice in :mod:`.select`.

:data:`KERNELS` is every kernel these builders' schedules name (the built-ins, the partial
allreduce's snapshot, the sparse allreduce's ``sparse.*`` and the sparse partial snapshot), built
here from the values the modules export (nothing registers on import) and frozen; a
Communicator runs its executors with a copy of it (``comm.kernels``).
"""

from ..sched import KernelRegistry
from .dense import (
    DEFAULT_SEGMENT_BYTES,
    REDUCE_OPS,
    allgather,
    allreduce,
    barrier,
    block_bounds,
    broadcast,
    build_allgather,
    build_allreduce,
    build_barrier,
    build_broadcast,
    build_reduce_scatter,
    next_tag,
    reduce_scatter,
    scratch_buffers,
    scratch_slots,
)
from .partial import PARTIAL_KERNELS
from .select import (
    ALLGATHER_ALGORITHMS,
    ALLREDUCE_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    DEFAULT_COST_MODEL,
    REDUCE_SCATTER_ALGORITHMS,
    CostModel,
    choose_allgather,
    choose_allreduce,
    choose_broadcast,
    choose_reduce_scatter,
)
from .sparse.kernels import SPARSE_KERNELS
from .sparse.partial import SPARSE_PARTIAL_KERNELS

#: every kernel the schedules of :mod:`asynccoll.collectives` name (frozen)
KERNELS: KernelRegistry = PARTIAL_KERNELS.extended(SPARSE_PARTIAL_KERNELS).freeze()

__all__ = [
    "ALLGATHER_ALGORITHMS",
    "ALLREDUCE_ALGORITHMS",
    "BROADCAST_ALGORITHMS",
    "DEFAULT_COST_MODEL",
    "DEFAULT_SEGMENT_BYTES",
    "KERNELS",
    "PARTIAL_KERNELS",
    "REDUCE_OPS",
    "REDUCE_SCATTER_ALGORITHMS",
    "SPARSE_KERNELS",
    "SPARSE_PARTIAL_KERNELS",
    "CostModel",
    "allgather",
    "allreduce",
    "barrier",
    "block_bounds",
    "broadcast",
    "build_allgather",
    "build_allreduce",
    "build_barrier",
    "build_broadcast",
    "build_reduce_scatter",
    "choose_allgather",
    "choose_allreduce",
    "choose_broadcast",
    "choose_reduce_scatter",
    "next_tag",
    "reduce_scatter",
    "scratch_buffers",
    "scratch_slots",
]
