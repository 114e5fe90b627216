"""The schedule engine: ops, dependencies, schedules, the executor and traces."""

from .executor import Executor
from .kernels import KERNELS, Payload, register_kernel
from .schedule import BufRef, Op, Schedule, SlotSpec
from .trace import Trace

__all__ = ["KERNELS", "BufRef", "Executor", "Op", "Payload", "Schedule", "SlotSpec", "Trace",
           "register_kernel"]
