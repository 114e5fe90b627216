"""Fixtures of the launcher's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._netns import two_hosts, why_not


@pytest.fixture(scope="module")
def namespaces() -> Iterator[tuple[str, str]]:
    """Namespaces A (10.231.0.1) and B (10.231.0.2) linked by a veth pair, removed after the
    module with whatever runs in them; skips with the reason where they cannot be made."""
    reason = why_not()
    if reason:
        pytest.skip(reason)
    with two_hosts() as ns:
        yield ns
