"""The in-process transport: addressing, delivery, seeded delays and reordering, closing."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from asynccoll import PeerLostError, TransportClosedError
from asynccoll.testing import inproc_world
from asynccoll.transport import PROTOCOL_VERSION, Format, Header, Kind, make_transport
from asynccoll.transport.inproc import InprocFabric, InprocTransport

pytestmark = pytest.mark.timeout(20)


def hdr(src: int, tag: int = 0, length: int = 8, execution: int = 0) -> Header:
    return Header(PROTOCOL_VERSION, int(Kind.DATA), 1, execution, tag, src, "|u1", (length,),
                  int(Format.DENSE), length)


async def test_listen_connect_by_address_and_registry() -> None:
    a = make_transport("inproc", 0, 2)
    b = InprocTransport(1, 2)
    assert isinstance(a, InprocTransport)
    try:
        addr_a = await a.listen("inproc://reg-test")
        addr_b = await b.listen("inproc://reg-test/1")
        assert (addr_a, addr_b) == ("inproc://reg-test/0", "inproc://reg-test/1")
        await asyncio.wait_for(asyncio.gather(a.connect({1: addr_b}), b.connect({0: addr_a})), 5)
        data = np.arange(4, dtype=np.int16)
        out = np.zeros(4, np.int16)
        recv = b.post_recv(0, 1, 0, 0, out)
        await asyncio.wait_for(a.post_send(1, hdr(0), data), 1)
        msg = await asyncio.wait_for(recv, 1)
        assert out.tolist() == [0, 1, 2, 3]
        assert msg.header.src == 0
    finally:
        await a.close()
        await b.close()


async def test_listen_rejects_other_schemes_and_double_listen() -> None:
    t = InprocTransport(0, 1)
    with pytest.raises(ValueError, match="cannot listen on 'tcp://"):
        await t.listen("tcp://127.0.0.1:1")
    async with inproc_world(1) as (t0,):
        dup = InprocTransport(0, 1, fabric=t0.fabric)
        with pytest.raises(ValueError, match="rank 0 already listens"):
            await dup.listen()


async def test_fabric_names_are_unique_per_loop() -> None:
    f = InprocFabric.get("unique-name-test")
    assert InprocFabric.get("unique-name-test") is f  # one name, one fabric on this loop
    owned = InprocFabric("unique-name-test")  # its creator passes it on; no name finds it
    assert owned is not f
    assert InprocFabric.get("unique-name-test") is f
    elsewhere = await asyncio.to_thread(asyncio.run, _named("unique-name-test"))
    assert elsewhere is not f  # another loop, another namespace


async def _named(name: str) -> InprocFabric:
    return InprocFabric.get(name)


async def test_worlds_own_their_fabrics() -> None:
    async with inproc_world(2) as (a, b):
        assert a.fabric is b.fabric is not None
        assert InprocFabric.get(a.fabric.name) is not a.fabric  # not registered by name


async def test_connect_waits_for_a_peer_that_listens_later(world: Any) -> None:
    fabric = InprocFabric("late-joiner")
    a = InprocTransport(0, 2, fabric=fabric)
    b = InprocTransport(1, 2, fabric=fabric)
    await a.listen()
    connecting = asyncio.ensure_future(a.connect({1: "inproc://late-joiner/1"}, timeout=5))
    await asyncio.sleep(0.01)
    assert not connecting.done()
    await b.listen()
    await asyncio.wait_for(connecting, 1)  # woken by the listen, not by polling
    await a.close()
    await b.close()
    async with world(2) as (c, d):  # the shared fixture builds connected worlds
        assert c.address != d.address


async def test_connect_times_out_naming_the_peer() -> None:
    t = InprocTransport(0, 2, fabric=InprocFabric("lonely"))
    await t.listen()
    with pytest.raises(PeerLostError, match="peer rank 1 lost"):
        await t.connect({1: "inproc://lonely/1"}, timeout=0.05)
    await t.close()


async def test_send_to_self_loops_back() -> None:
    async with inproc_world(1) as (t,):
        out = bytearray(3)
        f = t.post_recv(0, 1, 0, 0, out)
        await t.post_send(0, hdr(0, length=3), b"abc")
        await asyncio.wait_for(f, 1)
        assert out == b"abc"


async def test_delays_reorder_across_tags_but_never_within_a_key() -> None:
    n_tags, per_tag = 4, 30
    async with inproc_world(2, delay=0.004, seed=11) as (a, b):
        arrivals: list[tuple[int, int]] = []
        futs = []
        for tag in range(n_tags):
            for _ in range(per_tag):
                f = b.post_recv(0, 1, 0, tag)
                f.add_done_callback(
                    lambda f: arrivals.append((f.result().header.tag, f.result().payload[0])))
                futs.append(f)
        for i in range(per_tag):
            for tag in range(n_tags):
                await a.post_send(1, hdr(0, tag, 1), bytes([i]))
        await asyncio.wait_for(asyncio.gather(*futs), 5)
    for tag in range(n_tags):  # same key: FIFO
        assert [i for t, i in arrivals if t == tag] == list(range(per_tag))
    sent_order = [(t, i) for i in range(per_tag) for t in range(n_tags)]
    assert arrivals != sent_order  # different keys did overtake each other


async def test_delays_are_seeded() -> None:
    loop = asyncio.get_running_loop()

    def delays(name: str, seed: int) -> list[float]:
        f = InprocFabric(name, delay=0.003, seed=seed)
        out = []
        for tag in range(12):
            now = loop.time()
            at = f.due_at(0, 1, hdr(0, tag, 0))
            assert at is not None
            out.append(at - now)
        return out

    first = delays("seeded-a", 5)
    assert all(0.0 <= d <= 0.0031 for d in first)
    assert len({round(d, 6) for d in first}) == 12  # drawn, not constant
    again = delays("seeded-b", 5)
    assert all(abs(a - b) < 1e-4 for a, b in zip(first, again, strict=True))  # same draws
    other = delays("seeded-c", 6)
    assert any(abs(a - b) > 1e-4 for a, b in zip(first, other, strict=True))


async def test_link_delay_slows_one_link() -> None:
    async with inproc_world(3, link_delay={(0, 1): 0.05}) as (a, b, c):
        loop = asyncio.get_running_loop()
        fb = b.post_recv(0, 1, 0, 0)
        fc = c.post_recv(0, 1, 0, 0)
        t0 = loop.time()
        await a.post_send(1, hdr(0, length=0), b"")
        await a.post_send(2, hdr(0, length=0), b"")
        assert fc.done()  # no delay: delivered during the send
        assert not fb.done()
        await asyncio.wait_for(fb, 1)
        assert loop.time() - t0 >= 0.045


async def test_payload_is_copied_at_send_under_delay() -> None:
    async with inproc_world(2, delay=0.002, seed=1) as (a, b):
        src = np.full(4, 7, np.uint8)
        f = b.post_recv(0, 1, 0, 0)
        await a.post_send(1, hdr(0, length=4), src)
        src[:] = 0  # the send completed: the buffer may be reused
        msg = await asyncio.wait_for(f, 1)
        assert bytes(msg.payload) == b"\x07" * 4


async def test_closed_peer_fails_receives_and_sends() -> None:
    async with inproc_world(3) as (a, b, c):
        pending = a.post_recv(1, 1, 0, 0)
        await b.close()
        with pytest.raises(PeerLostError, match="peer rank 1 lost: peer closed"):
            await asyncio.wait_for(pending, 1)
        with pytest.raises(PeerLostError, match="rank 1"):
            await a.post_send(1, hdr(0), b"x" * 8)
        with pytest.raises(PeerLostError):
            await a.post_recv(1, 1, 1, 0)
        assert not c.post_recv(0, 1, 0, 0).done()  # other links unaffected


async def test_closed_transport_refuses_everything() -> None:
    async with inproc_world(2) as (a, _b):
        pending = a.post_recv(1, 1, 0, 0)
        await a.close()
        await a.close()  # idempotent
        with pytest.raises(TransportClosedError):
            await pending
        with pytest.raises(TransportClosedError):
            await a.post_send(1, hdr(0), b"x" * 8)


async def test_post_recv_validates_arguments() -> None:
    async with inproc_world(2) as (a, _b):
        with pytest.raises(ValueError, match=r"src must be in 0\.\.1"):
            a.post_recv(2, 1, 0, 0)
        with pytest.raises(ValueError, match="C-contiguous"):
            a.post_recv(1, 1, 0, 0, np.zeros((4, 4))[:, 1])
        with pytest.raises(ValueError, match="writable"):
            a.post_recv(1, 1, 0, 0, b"readonly")
