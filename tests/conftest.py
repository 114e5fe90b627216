"""Fixtures shared by the whole suite.

Hypothesis runs derandomized (the same examples on every run and machine) and without a
per-example deadline: the CI machine is small and shared, so timing-based health checks would
only make the suite flaky.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

# Under ``pytest -n N`` (``make test``) each worker's segments go to a directory of its own on
# the same tmpfs (``ASYNCCOLL_SHM_DIR``, read once when asynccoll is imported, so set before
# the import below; the ranks the tests start inherit it): the tests that count what a job
# left in the segment directory then count their own worker's only, not those of a job that
# another worker runs at the same moment. A plain ``pytest`` run keeps ``/dev/shm``.
_WORKER_SHM_DIR = None
if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("ASYNCCOLL_SHM_DIR"):
    _WORKER_SHM_DIR = tempfile.mkdtemp(
        prefix=f"asynccoll-tests-{os.environ['PYTEST_XDIST_WORKER']}-", dir="/dev/shm")
    os.environ["ASYNCCOLL_SHM_DIR"] = _WORKER_SHM_DIR

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from asynccoll.testing import inproc_world  # noqa: E402
from asynccoll.transport.inproc import InprocTransport  # noqa: E402

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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove this worker's segment directory (module doc of the setting above)."""
    if _WORKER_SHM_DIR is not None:
        shutil.rmtree(_WORKER_SHM_DIR, ignore_errors=True)
