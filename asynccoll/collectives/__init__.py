"""Schedule builders for collectives: pure functions that build one rank's :class:`Schedule`.

The dense, synchronous collectives live in :mod:`.dense` (see its docstring for the slot, tag
and composition conventions), the algorithm choice in :mod:`.select`.
"""

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

__all__ = [
    "ALLGATHER_ALGORITHMS",
    "ALLREDUCE_ALGORITHMS",
    "BROADCAST_ALGORITHMS",
    "DEFAULT_COST_MODEL",
    "DEFAULT_SEGMENT_BYTES",
    "REDUCE_OPS",
    "REDUCE_SCATTER_ALGORITHMS",
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
