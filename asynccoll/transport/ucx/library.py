"""The lazy import of ``ucxx`` and the UCX settings every :class:`UcxTransport` context gets.

Nothing imports ``ucxx`` until :func:`load` is called (by creating a transport), so that
``import asynccoll`` costs nothing when UCX is not used and a missing ``ucxx`` is reported with
the extra to install. UCX settings travel in each context's configuration
(:func:`context_options`), never through ``os.environ``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = ["DEFAULT_OPTIONS", "Ucxx", "context_options", "load"]

#: UCX settings (without the ``UCX_`` prefix) each context starts from; a transport's
#: ``ucx_options`` override them. ucxx puts ``UCX_MEMTYPE_CACHE`` into the environment when
#: imported, a variable UCX >= 1.19 no longer knows: without this setting every context would
#: print two warnings about it.
DEFAULT_OPTIONS: Mapping[str, str] = {"WARN_UNUSED_ENV_VARS": "n"}


class Ucxx(NamedTuple):
    """The parts of ``ucxx`` this transport uses."""

    lib: Any  #: ``ucxx._lib.libucxx``, the low-level API (contexts, workers, endpoints)
    Array: Any  #: ``ucxx._lib.arr.Array``, a buffer UCX reads or writes
    Tag: Any  #: ``ucxx.types.Tag``


_ucxx: Ucxx | None = None  # the import, once done


def load() -> Ucxx:
    """Import ``ucxx`` on first use; ``ImportError`` naming the ``ucx`` extra when absent."""
    global _ucxx
    if _ucxx is None:
        try:
            import ucxx  # noqa: F401  (loads libucx and sets ucxx's UCX defaults)
            import ucxx._lib.libucxx as lib
            from ucxx._lib.arr import Array
            from ucxx.types import Tag
        except ImportError as exc:
            raise ImportError(
                f"the ucx:// transport needs the ucxx package ({exc}); install it with: "
                "pip install 'asynccoll[ucx]'") from exc
        _ucxx = Ucxx(lib, Array, Tag)
    return _ucxx


def context_options(options: Mapping[str, str] | None) -> dict[str, str]:
    """The configuration of a new UCX context: :data:`DEFAULT_OPTIONS` overridden by
    ``options``. Both override the ``UCX_*`` environment variables. Raises ``TypeError`` unless
    ``options`` maps str to str."""
    if options is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in options.items()):
        raise TypeError("ucx_options must map str to str")
    return {**DEFAULT_OPTIONS, **(options or {})}
