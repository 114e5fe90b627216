"""The exceptions asynccoll raises.

Every library error derives from :class:`AsyncCollError`::

    AsyncCollError
    ├── ScheduleError              a schedule is malformed (names the op)
    ├── ExecutionError             an execution went wrong (stale data message, failed kernel)
    ├── CollectiveTimeoutError     a collective did not finish in time (names who is awaited)
    ├── BusyError                  two tasks used one resource that allows one at a time
    ├── TransportError
    │   ├── TransportClosedError   we closed it
    │   ├── PeerLostError          the peer or the network failed (``.rank``; cause chained)
    │   ├── ProtocolError          a peer sent a malformed or over-limit frame
    │   └── AuthenticationError    a peer failed the handshake
    ├── ConfigError                a launch setting is missing or malformed (``.variable``)
    ├── StoreError                 a rendezvous-store operation failed
    │   └── StoreTimeoutError      ... did not complete in time (``.missing`` keys)
    ├── RendezvousError            the ranks could not assemble
    │   └── RendezvousTimeoutError some ranks did not show up in time (``.missing`` ranks)
    └── TraceFormatError           a trace file is missing, empty or malformed

The ``...TimeoutError`` classes also derive from the built-in ``TimeoutError``, and
:class:`ScheduleError`, :class:`ConfigError` and :class:`TraceFormatError` from ``ValueError``.

Bad arguments raise the built-in ``TypeError`` / ``ValueError`` naming the parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AsyncCollError",
    "AuthenticationError",
    "BusyError",
    "CollectiveTimeoutError",
    "ConfigError",
    "ExecutionError",
    "PeerLostError",
    "ProtocolError",
    "RendezvousError",
    "RendezvousTimeoutError",
    "ScheduleError",
    "StoreError",
    "StoreTimeoutError",
    "TraceFormatError",
    "TransportClosedError",
    "TransportError",
]


class AsyncCollError(Exception):
    """Base class of every error asynccoll raises on its own account."""


class ScheduleError(AsyncCollError, ValueError):
    """A schedule is malformed; the message names the offending op."""


class ExecutionError(AsyncCollError):
    """An execution failed: a kernel raised, or a peer sent data for a finished execution."""


class CollectiveTimeoutError(AsyncCollError, TimeoutError):
    """A collective did not complete within its timeout.

    ``pending`` lists the ops still waiting, as ``(rank, op_id, description)`` tuples.
    """

    def __init__(self, message: str, pending: list[tuple[int, int, str]] | None = None) -> None:
        super().__init__(message)
        self.pending = pending or []


class BusyError(AsyncCollError):
    """Two tasks tried to use a resource that serves one at a time."""


class TransportError(AsyncCollError):
    """Base of the transport errors."""


class TransportClosedError(TransportError):
    """The transport (or this endpoint) was closed by us; nothing more can be sent or received."""


class PeerLostError(TransportError):
    """A peer disconnected or failed; every pending operation that needs it fails with this."""

    def __init__(self, rank: int, reason: str = "connection lost") -> None:
        super().__init__(f"peer rank {rank} lost: {reason}")
        self.rank = rank
        self.reason = reason


class ProtocolError(TransportError):
    """A frame was malformed or exceeded the limits."""


class AuthenticationError(TransportError):
    """A peer failed the handshake that proves knowledge of the job secret."""


class ConfigError(AsyncCollError, ValueError):
    """A launch setting is missing, malformed or contradictory; ``variable`` names it."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable


class StoreError(AsyncCollError):
    """A store operation failed (connection lost, limit exceeded, bad value for ``add``)."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store operation did not complete in time; ``missing`` lists keys still absent."""

    def __init__(self, message: str, missing: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)


class RendezvousError(AsyncCollError):
    """The ranks could not assemble (duplicate rank, world size mismatch, store unreachable)."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """Some ranks did not show up in time; ``missing`` lists them."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


class TraceFormatError(AsyncCollError, ValueError):
    """A trace file or directory is missing, empty or malformed (the message names the file)."""
