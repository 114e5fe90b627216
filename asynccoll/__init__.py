"""asynccoll: straggler-tolerant collective communication for asyncio.

The public API is re-exported here; everything else is an implementation detail.
"""

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
from .sched import BufRef, Executor, Op, Schedule, SlotSpec, register_kernel

__version__ = "0.1.0.dev0"

__all__ = [
    "AsyncCollError",
    "AuthenticationError",
    "BufRef",
    "BusyError",
    "CollectiveTimeoutError",
    "ExecutionError",
    "Executor",
    "Op",
    "PeerLostError",
    "ProtocolError",
    "Schedule",
    "ScheduleError",
    "SlotSpec",
    "TransportClosedError",
    "TransportError",
    "__version__",
    "register_kernel",
]
