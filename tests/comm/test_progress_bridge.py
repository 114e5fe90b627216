"""The bridge from a caller's loop to the progress thread: outcomes and cancellation."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from asynccoll.comm.progress import ProgressEngine


@pytest.fixture
def engine() -> Iterator[ProgressEngine]:
    eng = ProgressEngine.thread()
    yield eng
    eng.close()


@pytest.mark.timeout(10)
async def test_results_and_errors_cross_back(engine: ProgressEngine) -> None:
    async def where() -> str:
        return threading.current_thread().name

    async def fails() -> None:
        raise KeyError("boom")

    assert await engine.run(where()) == "asynccoll-progress"
    with pytest.raises(KeyError, match="boom"):
        await engine.run(fails())


@pytest.mark.timeout(10)
async def test_cancelling_the_caller_cancels_the_runtimes_task(engine: ProgressEngine) -> None:
    started, cancelled = threading.Event(), threading.Event()

    async def waits() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    call = asyncio.ensure_future(engine.run(waits()))
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await asyncio.get_running_loop().run_in_executor(None, cancelled.wait, 5)


@pytest.mark.timeout(10)
async def test_a_caller_cancelled_before_the_task_starts_never_runs_it(
        engine: ProgressEngine) -> None:
    ran = threading.Event()
    gate = threading.Event()

    async def never() -> None:
        ran.set()

    engine.loop.call_soon_threadsafe(gate.wait, 5)  # hold the runtime's loop for a moment
    call = asyncio.ensure_future(engine.run(never()))
    await asyncio.sleep(0)  # the bridge is posted behind the gate
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    gate.set()
    await engine.run(asyncio.sleep(0))  # the runtime's loop has run what was posted
    assert not ran.is_set()
