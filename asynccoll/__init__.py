"""asynccoll: straggler-tolerant collective communication for asyncio.

The public API is re-exported here; everything else is an implementation detail.
"""

from . import testing as testing  # `asynccoll.testing` without a second import
from .collectives.policy import (
    Accumulate,
    Backup,
    Deadline,
    Majority,
    Policy,
    Quorum,
    Solo,
    Sync,
    TwoChoice,
    as_policy,
)
from .collectives.sparse import SparseVector
from .collectives.sparse.feedback import ErrorFeedback
from .comm import Communicator, PartialAllreduce, SparseAllreduceHandle
from .comm.route import DataPath
from .errors import (
    AsyncCollError,
    AuthenticationError,
    BusyError,
    CollectiveTimeoutError,
    ConfigError,
    ExecutionError,
    PeerLostError,
    ProtocolError,
    RendezvousError,
    RendezvousTimeoutError,
    ScheduleError,
    StoreError,
    StoreTimeoutError,
    TraceFormatError,
    TransportClosedError,
    TransportError,
)
from .launch import connect
from .launch.sync import init
from .results import PartialResult
from .sched import BufRef, Executor, Op, Schedule, SlotSpec, register_kernel
from .train import ODSGD, RNA, BackupSGD, EagerSGD, StepInfo, TopKSGD

__version__ = "0.1.0.dev0"

__all__ = [
    "Accumulate",
    "AsyncCollError",
    "AuthenticationError",
    "Backup",
    "BackupSGD",
    "BufRef",
    "BusyError",
    "CollectiveTimeoutError",
    "Communicator",
    "ConfigError",
    "DataPath",
    "Deadline",
    "EagerSGD",
    "ErrorFeedback",
    "ExecutionError",
    "Majority",
    "Executor",
    "ODSGD",
    "Op",
    "PartialAllreduce",
    "PartialResult",
    "PeerLostError",
    "Policy",
    "ProtocolError",
    "Quorum",
    "RNA",
    "RendezvousError",
    "RendezvousTimeoutError",
    "Schedule",
    "ScheduleError",
    "SlotSpec",
    "Solo",
    "SparseAllreduceHandle",
    "SparseVector",
    "StepInfo",
    "StoreError",
    "StoreTimeoutError",
    "Sync",
    "TopKSGD",
    "TraceFormatError",
    "TransportClosedError",
    "TransportError",
    "TwoChoice",
    "__version__",
    "as_policy",
    "connect",
    "init",
    "register_kernel",
]
