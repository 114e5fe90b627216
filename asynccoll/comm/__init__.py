"""The runtime of one process (DESIGN §6): the Communicator and what it runs.

:mod:`.communicator` (the :class:`Communicator`), :mod:`.progress` (the engine and the bridge
between loops), :mod:`.blocking` (``comm.blocking``), :mod:`.partial` (the persistent partial
allreduce handle) with :mod:`.contribution` (what a rank contributes to it: dense or sparse
data), :mod:`.dense` (the cached synchronous collectives) with :mod:`.shm` (the allreduce
through shared memory on one host, hierarchical across hosts), :mod:`.sparse` (the sparse
allreduce runtime and its persistent handle), :mod:`.tensors` (torch tensors in and out),
:mod:`.membership` (lost ranks told to everyone, the goodbyes of an orderly close, the status
probe) and :mod:`.stall` (stall warnings). The names are imported on first use
(:mod:`asynccoll.transport.lazy`): the launcher and its reaper need :mod:`.shm`'s cleanup, not the
runtime. ``connect()``, which reads the environment and runs the rendezvous, lives in
:mod:`asynccoll.launch`."""

from typing import TYPE_CHECKING

from ..transport.lazy import exports

if TYPE_CHECKING:
    from .communicator import Communicator
    from .partial import PartialAllreduce
    from .progress import ProgressEngine
    from .sparse import SparseAllreduceHandle

_WHERE = {"Communicator": ".communicator", "PartialAllreduce": ".partial",
          "ProgressEngine": ".progress", "SparseAllreduceHandle": ".sparse"}
__getattr__, __dir__ = exports(__name__, _WHERE, globals())

__all__ = ["Communicator", "PartialAllreduce", "ProgressEngine", "SparseAllreduceHandle"]
