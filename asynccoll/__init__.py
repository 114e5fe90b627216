"""asynccoll: straggler-tolerant collective communication for asyncio.

The public API is re-exported here; everything else is an implementation detail.
"""

from ._partial_handle import PartialAllreduce
from .collectives.feedback import ErrorFeedback
from .collectives.sparse import SparseVector
from .comm import Communicator, connect
from .errors import (
    AsyncCollError,
    AuthenticationError,
    BusyError,
    CollectiveTimeoutError,
    ExecutionError,
    PeerLostError,
    ProtocolError,
    ScheduleError,
    TransportClosedError,
    TransportError,
)
from .results import PartialResult
from .sched import BufRef, Executor, Op, Schedule, SlotSpec, register_kernel
from .train import ODSGD, RNA, BackupSGD, EagerSGD, StepInfo, TopKSGD

__version__ = "0.1.0.dev0"

__all__ = [
    "AsyncCollError",
    "AuthenticationError",
    "BackupSGD",
    "BufRef",
    "BusyError",
    "CollectiveTimeoutError",
    "Communicator",
    "EagerSGD",
    "ErrorFeedback",
    "ExecutionError",
    "Executor",
    "ODSGD",
    "Op",
    "PartialAllreduce",
    "PartialResult",
    "PeerLostError",
    "ProtocolError",
    "RNA",
    "Schedule",
    "ScheduleError",
    "SlotSpec",
    "SparseVector",
    "StepInfo",
    "TopKSGD",
    "TransportClosedError",
    "TransportError",
    "__version__",
    "connect",
    "register_kernel",
]
