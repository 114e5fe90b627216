"""Point-to-point messaging: the interface, frames, matching, and the backends by scheme. The names
are imported on first use (:mod:`asynccoll.transport.lazy`)."""

from typing import TYPE_CHECKING

from .lazy import exports

if TYPE_CHECKING:
    from .base import Transport
    from .frames import (
        PROTOCOL_VERSION,
        Format,
        Header,
        Kind,
        Limits,
        Message,
        decode_header,
        encode_header,
    )
    from .registry import make_transport, parse_address, schemes, transport_class

_WHERE = {"decode_header": ".frames", "encode_header": ".frames", "Format": ".frames", "Header":
          ".frames", "Kind": ".frames", "Limits": ".frames", "make_transport":
          ".registry", "Message": ".frames", "parse_address": ".registry",
          "PROTOCOL_VERSION": ".frames", "schemes": ".registry", "Transport": ".base",
          "transport_class": ".registry"}
__getattr__, __dir__ = exports(__name__, _WHERE, globals())

__all__ = [
    "PROTOCOL_VERSION",
    "Format",
    "Header",
    "Kind",
    "Limits",
    "Message",
    "Transport",
    "decode_header",
    "encode_header",
    "make_transport",
    "parse_address",
    "schemes",
    "transport_class",
]
