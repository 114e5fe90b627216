"""``ucx://``: the UCX transport over ``ucxx`` (imported lazily, on first use).

:mod:`.transport` holds :class:`UcxTransport`; beside it :mod:`.progress` (the event-loop
progress engine), :mod:`.handshake` (the authenticating handshake), :mod:`.library` (the lazy
``ucxx`` import and UCX settings) and :mod:`.device` (device-memory views).
"""

from .transport import PROGRESS_MODES, UcxTransport

__all__ = ["PROGRESS_MODES", "UcxTransport"]
