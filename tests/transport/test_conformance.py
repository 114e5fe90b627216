"""Every transport passes the public conformance suite (asynccoll.testing.check_transport)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from asynccoll.testing import check_transport, inproc_world
from asynccoll.testing.conformance import CHECKS
from asynccoll.transport.base import Transport

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


@asynccontextmanager
async def inproc_pair() -> AsyncIterator[tuple[Transport, Transport]]:
    async with inproc_world(2) as (t0, t1):
        yield t0, t1


@asynccontextmanager
async def _pair(scheme: str) -> AsyncIterator[tuple[Transport, Transport]]:
    """Ranks 0 and 1 of a world of two on ``scheme``, connected over loopback."""
    from asynccoll.transport.registry import transport_class

    secret = os.urandom(32)
    cls = transport_class(scheme)
    ts: list[Any] = [cls(r, 2, secret=secret) for r in range(2)]
    try:
        addrs = [await t.listen(f"{scheme}://127.0.0.1:0") for t in ts]
        await asyncio.gather(ts[0].connect({1: addrs[1]}, timeout=10),
                             ts[1].connect({0: addrs[0]}, timeout=10))
        yield ts[0], ts[1]
    finally:
        for t in ts:
            await t.close()


def tcp_pair() -> Any:
    return _pair("tcp")


def ucx_pair() -> Any:
    return _pair("ucx")


def _uvloop_factory() -> LoopFactory:
    uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed")
    factory: LoopFactory = uvloop.new_event_loop
    return factory


@pytest.fixture(params=["inproc", "tcp", "tcp-uvloop", "ucx"])
def transport_pair(request: pytest.FixtureRequest) -> tuple[Any, LoopFactory]:
    """(make_pair, loop factory) for each transport and event loop."""
    kind = request.param
    if kind == "inproc":
        return inproc_pair, asyncio.new_event_loop
    if kind == "tcp":
        return tcp_pair, asyncio.new_event_loop
    if kind == "tcp-uvloop":
        return tcp_pair, _uvloop_factory()
    if importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed (pip install 'asynccoll[ucx]')")
    return ucx_pair, asyncio.new_event_loop


@pytest.mark.timeout(90)
@pytest.mark.parametrize("check", list(CHECKS))
def test_conformance(transport_pair: tuple[Any, LoopFactory], check: str) -> None:
    make_pair, loop_factory = transport_pair
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(check_transport(make_pair, only=[check], timeout=60))


def test_unknown_check_is_named() -> None:
    with pytest.raises(KeyError, match="no-such-check"):
        asyncio.run(check_transport(inproc_pair, only=["no-such-check"]))


def test_a_broken_transport_fails_the_suite() -> None:
    """The suite catches a transport that corrupts payloads (it can fail)."""

    @asynccontextmanager
    async def corrupting_pair() -> AsyncIterator[tuple[Transport, Transport]]:
        async with inproc_pair() as (t0, t1):
            orig = t1.arrive  # type: ignore[attr-defined]

            def deliver(header: Any, data: memoryview) -> Any:
                if len(data):
                    data = memoryview(bytes(data)[::-1])
                return orig(header, data)

            t1.arrive = deliver  # type: ignore[attr-defined]
            yield t0, t1

    with pytest.raises(AssertionError, match="sizes"):
        asyncio.run(check_transport(corrupting_pair, only=["sizes"], max_size=4096))
