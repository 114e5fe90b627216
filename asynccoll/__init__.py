"""asynccoll: straggler-tolerant collective communication for asyncio.

The public API is re-exported here; everything else is an implementation detail. The names are
imported on first use (:mod:`asynccoll.transport.lazy`): a process that needs only part of the
package (the launcher, its reaper, a NumPy rank) does not pay for the rest.
"""

from typing import TYPE_CHECKING

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
from .transport.lazy import exports

if TYPE_CHECKING:
    from . import testing as testing
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
    from .launch import connect
    from .launch.sync import init
    from .results import PartialResult
    from .sched import BufRef, Executor, Op, Schedule, SlotSpec, register_kernel
    from .train import ODSGD, RNA, BackupSGD, EagerSGD, StepInfo, TopKSGD

_WHERE = {
    "Accumulate": ".collectives.policy",
    "as_policy": ".collectives.policy",
    "Backup": ".collectives.policy",
    "BackupSGD": ".train",
    "BufRef": ".sched",
    "Communicator": ".comm",
    "connect": ".launch",
    "DataPath": ".comm.route",
    "Deadline": ".collectives.policy",
    "EagerSGD": ".train",
    "ErrorFeedback": ".collectives.sparse.feedback",
    "Executor": ".sched",
    "init": ".launch.sync",
    "Majority": ".collectives.policy",
    "ODSGD": ".train",
    "Op": ".sched",
    "PartialAllreduce": ".comm",
    "PartialResult": ".results",
    "Policy": ".collectives.policy",
    "Quorum": ".collectives.policy",
    "register_kernel": ".sched",
    "RNA": ".train",
    "Schedule": ".sched",
    "SlotSpec": ".sched",
    "Solo": ".collectives.policy",
    "SparseAllreduceHandle": ".comm",
    "SparseVector": ".collectives.sparse",
    "StepInfo": ".train",
    "Sync": ".collectives.policy",
    "TopKSGD": ".train",
    "TwoChoice": ".collectives.policy",
}
__getattr__, __dir__ = exports(__name__, _WHERE, globals(), modules=("testing",))

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
