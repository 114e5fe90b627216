"""Fixtures shared by the whole suite.

Hypothesis runs derandomized (the same examples on every run and machine) and without a
per-example deadline: the CI machine is small and shared, so timing-based health checks would
only make the suite flaky.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import pytest
from hypothesis import HealthCheck, settings

from asynccoll.testing import inproc_world
from asynccoll.transport.inproc import InprocTransport

settings.register_profile(
    "asynccoll",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile("asynccoll")


@pytest.fixture
async def inproc2() -> AsyncIterator[list[InprocTransport]]:
    """Two connected in-process ranks, closed after the test."""
    async with inproc_world(2) as ts:
        yield ts


@pytest.fixture
def world() -> Callable[..., AbstractAsyncContextManager[list[InprocTransport]]]:
    """``async with world(P, delay=..., seed=...) as transports``: a fresh in-process world."""
    return inproc_world


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip the single-copy allreduce's tests (marker ``cma``) where processes may not read
    each other's memory (``_helpers.cma_allowed``)."""
    if item.get_closest_marker("cma") is not None:
        from _helpers import cma_allowed

        if not cma_allowed():
            pytest.skip("process_vm_readv/writev between processes refused here (the runtime "
                        "takes the shared-memory segments instead)")
