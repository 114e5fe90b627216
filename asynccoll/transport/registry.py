"""Addresses as URIs and the ``{scheme: backend}`` registry.

Backends are imported lazily by scheme, so that ``ucx`` costs nothing until it is used and a
missing optional dependency is reported with the package to install.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["make_transport", "parse_address", "schemes", "transport_class"]

#: scheme -> (module, class name, pip extra that provides its dependencies or "")
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "inproc": ("asynccoll.transport.inproc", "InprocTransport", ""),
    "tcp": ("asynccoll.transport.tcp", "TcpTransport", ""),
    "ucx": ("asynccoll.transport.ucx", "UcxTransport", "ucx"),
}


def schemes() -> list[str]:
    """The known address schemes."""
    return sorted(_BACKENDS)


def parse_address(address: str) -> tuple[str, str]:
    """Split ``scheme://location``.

    >>> parse_address("tcp://127.0.0.1:5000")
    ('tcp', '127.0.0.1:5000')
    >>> parse_address("inproc://world/3")
    ('inproc', 'world/3')
    """
    if not isinstance(address, str):
        raise TypeError(f"address must be a str, got {type(address).__name__}")
    scheme, sep, loc = address.partition("://")
    if not sep:
        raise ValueError(
            f"address {address!r} has no scheme; expected SCHEME://LOCATION with SCHEME one of "
            f"{schemes()}")
    if scheme not in _BACKENDS:
        raise ValueError(f"unknown transport scheme {scheme!r} in {address!r}; known: {schemes()}")
    return scheme, loc


def transport_class(scheme: str) -> Any:
    """The transport class of ``scheme``, imported on first use."""
    try:
        module, name, extra = _BACKENDS[scheme]
    except KeyError:
        raise ValueError(f"unknown transport scheme {scheme!r}; known: {schemes()}") from None
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        hint = f" (install it with: pip install 'asynccoll[{extra}]')" if extra else ""
        raise ImportError(f"transport {scheme!r} is unavailable: {exc}{hint}") from exc
    return getattr(mod, name)


def make_transport(scheme: str, rank: int, world_size: int, **kwargs: Any) -> Any:
    """Instantiate the transport of ``scheme`` for ``rank`` of ``world_size``."""
    return transport_class(scheme)(rank, world_size, **kwargs)
