"""SparCML's sparse allreduce as schedule builders and kernels (DESIGN §5).

:mod:`.vector` holds the representation and top-k, :mod:`.streams` the sparse streams and
their vectorised merges, :mod:`.schedules` SSAR/DSAR, :mod:`.quantize` QSGD,
:mod:`.feedback` error feedback, :mod:`.partial` the partial allreduce of sparse
contributions and :mod:`.kernels` the compute kernels the schedules name. Nothing here owns
a transport or an executor: running them is :mod:`asynccoll.comm.sparse`'s job.
"""

# The package's names are the streams module's (which re-exports the vector's): one list.
from .streams import *  # noqa: F403
from .streams import __all__ as __all__
