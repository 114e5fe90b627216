"""SparCML's sparse allreduce as schedule builders and kernels (DESIGN §5).

:mod:`.vector` holds the representation and top-k, :mod:`.streams` the sparse streams and
their vectorised merges, :mod:`.schedules` SSAR/DSAR, :mod:`.quantize` QSGD,
:mod:`.feedback` error feedback, :mod:`.partial` the partial allreduce of sparse
contributions and :mod:`.kernels` the compute kernels the schedules name. Nothing here owns
a transport or an executor: running them is :mod:`asynccoll.comm.sparse`'s job.
"""

from .streams import (
    Piece,
    SparseAccumulator,
    SparseVector,
    add,
    add_into,
    bucket_topk,
    decode_piece,
    default_delta,
    dense_view,
    from_dense,
    from_pairs,
    index_dtype,
    piece_payload,
    read_stream,
    scatter_sum,
    sparse_views,
    stream_capacity,
    stream_payload,
    sum_pieces,
    to_dense,
    topk,
    write_piece,
)

__all__ = [
    "Piece",
    "SparseAccumulator",
    "SparseVector",
    "add",
    "add_into",
    "bucket_topk",
    "decode_piece",
    "scatter_sum",
    "default_delta",
    "dense_view",
    "from_dense",
    "from_pairs",
    "index_dtype",
    "piece_payload",
    "read_stream",
    "sparse_views",
    "stream_capacity",
    "stream_payload",
    "sum_pieces",
    "to_dense",
    "topk",
    "write_piece",
]
