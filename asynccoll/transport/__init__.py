"""Point-to-point messaging: the interface, frames, matching, and the backends by scheme."""

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
