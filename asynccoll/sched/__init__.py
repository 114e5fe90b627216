"""The schedule engine: ops, dependencies, schedules, the executor, the kernel registry, trace
recording, the live-op registry, what an execution waits for (:mod:`.waits`) and the flight
recorder (:mod:`.flight`)."""

from .executor import Executor
from .kernels import BUILTIN_KERNELS, Kernel, KernelRegistry, Payload, register_kernel
from .live import DumpSignal, LiveOps
from .schedule import BufRef, Op, Schedule, SlotSpec
from .trace import Trace
from .tracefile import TraceWriter

__all__ = ["BUILTIN_KERNELS", "BufRef", "DumpSignal", "Executor", "Kernel", "KernelRegistry",
           "LiveOps", "Op", "Payload", "Schedule", "SlotSpec", "Trace", "TraceWriter",
           "register_kernel"]
