"""``ucx://``: the UCX transport over ``ucxx`` (imported lazily, on first use).

:mod:`.transport` holds :class:`UcxTransport`, :mod:`.support` the machinery under it.
"""

from .transport import PROGRESS_MODES, UcxTransport

__all__ = ["PROGRESS_MODES", "UcxTransport"]
