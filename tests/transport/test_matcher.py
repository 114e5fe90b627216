"""Receive matching (:class:`Matcher`) and frame header validation (``decode_header``)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccoll import ExecutionError, PeerLostError, ProtocolError, TransportClosedError
from asynccoll.transport import (
    PROTOCOL_VERSION,
    Format,
    Header,
    Kind,
    Limits,
    decode_header,
    encode_header,
)
from asynccoll.transport.matching import Matcher

pytestmark = pytest.mark.timeout(10)


def hdr(src: int = 1, sched: int = 7, execution: int = 0, tag: int = 0, length: int = 8,
        kind: Kind = Kind.DATA, dtype: str = "|u1", fmt: Format = Format.DENSE) -> Header:
    shape = (length,) if fmt == Format.DENSE and dtype == "|u1" else ()
    return Header(PROTOCOL_VERSION, int(kind), sched, execution, tag, src, dtype, shape,
                  int(fmt), length)


def arrive(m: Matcher, h: Header, data: bytes) -> None:
    """What a transport does with an inbound frame."""
    slot = m.begin(h)
    slot.view[:] = data
    m.complete(slot)


async def test_early_message_is_held_then_matched_with_one_copy() -> None:
    m = Matcher(0)
    arrive(m, hdr(), b"abcdefgh")
    assert m.held_count == 1
    assert m.posted_count == 0
    buf = bytearray(8)
    msg = await asyncio.wait_for(m.post(1, 7, 0, 0, memoryview(buf)), 1)
    assert bytes(buf) == b"abcdefgh"
    assert msg.payload.obj is buf  # delivered into the posted buffer
    assert m.held_count == 0


async def test_posted_receive_gets_zero_copy_delivery() -> None:
    m = Matcher(0)
    dst = np.zeros(2, np.float32)
    fut = m.post(1, 7, 0, 0, memoryview(dst.view(np.uint8)))
    assert m.posted_count == 1
    slot = m.begin(hdr(length=8))
    assert np.shares_memory(np.frombuffer(slot.view, np.uint8), dst)  # written in place
    slot.view[:] = np.array([1.5, 2.5], np.float32).tobytes()
    assert not fut.done()
    m.complete(slot)
    msg = await asyncio.wait_for(fut, 1)
    assert dst.tolist() == [1.5, 2.5]
    assert np.shares_memory(np.frombuffer(msg.payload, np.uint8), dst)
    assert m.posted_count == 0
    assert m.held_count == 0


async def test_receive_without_buffer_takes_any_length() -> None:
    m = Matcher(0)
    fut = m.post(1, 7, 0, 0)
    arrive(m, hdr(length=3, fmt=Format.RAW, dtype=""), b"xyz")
    assert bytes((await asyncio.wait_for(fut, 1)).payload) == b"xyz"


async def test_same_key_messages_keep_their_order_and_keys_do_not_mix() -> None:
    m = Matcher(0)
    for i in range(3):
        arrive(m, hdr(tag=5), bytes([i]) * 8)
    arrive(m, hdr(tag=6), b"T" * 8)
    arrive(m, hdr(execution=1, tag=5), b"E" * 8)
    got = [bytes((await m.post(1, 7, 0, 5)).payload)[:1] for _ in range(3)]
    assert got == [b"\0", b"\1", b"\2"]
    assert bytes((await m.post(1, 7, 1, 5)).payload) == b"E" * 8
    assert bytes((await m.post(1, 7, 0, 6)).payload) == b"T" * 8


async def test_finish_retires_posted_receives_and_held_messages() -> None:
    m = Matcher(0)
    old = [m.post(1, 7, 0, t) for t in range(3)]
    other_sched = m.post(1, 8, 0, 0)
    future_exec = m.post(1, 7, 1, 0)
    arrive(m, hdr(execution=0, tag=9), b"h" * 8)  # held, then its execution finishes
    assert m.finish(7, 0) == 3
    assert all(f.cancelled() for f in old)
    assert not other_sched.done()
    assert not future_exec.done()
    assert m.posted_count == 2
    assert m.held_count == 0
    assert len(m.errors) == 1  # the held data message was never consumed
    assert m.finish(7, 0) == 0


async def test_late_activation_is_dropped_and_counted() -> None:
    m = Matcher(0)
    m.finish(7, 3)
    for e in (0, 3):
        slot = m.begin(hdr(execution=e, kind=Kind.ACTIVATION))
        assert slot.discard
        m.complete(slot)
    assert m.dropped == 2
    assert not m.errors
    assert m.held_count == 0
    arrive(m, hdr(execution=4, kind=Kind.ACTIVATION), b"a" * 8)  # a future one is held
    assert m.held_count == 1
    assert m.dropped == 2


async def test_late_data_is_recorded_as_an_error() -> None:
    m = Matcher(3)
    m.finish(7, 2)
    slot = m.begin(hdr(execution=1, tag=4))
    assert slot.discard
    slot.view[:] = b"z" * 8
    m.complete(slot)
    assert m.held_count == 0
    assert m.dropped == 0
    (err,) = m.errors
    assert isinstance(err, ExecutionError)
    assert "finished execution 1 of schedule 7" in str(err)
    assert "rank 1" in str(err)


async def test_message_whose_execution_finishes_while_streaming_is_late() -> None:
    m = Matcher(0)
    slot = m.begin(hdr(execution=0))
    m.finish(7, 0)
    slot.view[:] = b"s" * 8
    m.complete(slot)
    assert m.held_count == 0
    assert len(m.errors) == 1


async def test_receive_posted_while_streaming_gets_the_message() -> None:
    m = Matcher(0)
    slot = m.begin(hdr())
    fut = m.post(1, 7, 0, 0)
    slot.view[:] = b"q" * 8
    m.complete(slot)
    assert bytes((await asyncio.wait_for(fut, 1)).payload) == b"q" * 8
    assert m.held_count == 0


async def test_overflow_of_posted_buffer_fails_that_receive_only() -> None:
    m = Matcher(0)
    small = m.post(1, 7, 0, 0, memoryview(bytearray(4)))
    other = m.post(1, 7, 0, 1, memoryview(bytearray(8)))
    slot = m.begin(hdr(length=8))
    assert slot.discard
    m.complete(slot)
    with pytest.raises(ProtocolError, match="overflows the posted receive of 4 bytes"):
        await asyncio.wait_for(small, 1)
    assert not other.done()
    # a held message that is too big fails the receive posted later in the same way
    arrive(m, hdr(tag=2, length=8), b"x" * 8)
    with pytest.raises(ProtocolError, match="overflows"):
        await m.post(1, 7, 0, 2, memoryview(bytearray(2)))


async def test_held_message_limit_raises_protocol_error() -> None:
    m = Matcher(0, Limits(max_held_messages=2))
    arrive(m, hdr(tag=0), b"a" * 8)
    arrive(m, hdr(tag=1), b"b" * 8)
    with pytest.raises(ProtocolError, match="too many early messages"):
        m.begin(hdr(tag=2))
    assert m.held_count == 2
    fut = m.post(1, 7, 0, 3)  # a posted receive still matches beyond the hold limit
    arrive(m, hdr(tag=3), b"c" * 8)
    assert fut.done()


async def test_held_bytes_limit_raises_protocol_error() -> None:
    m = Matcher(0, Limits(max_held_bytes=12))
    arrive(m, hdr(tag=0), b"a" * 8)
    with pytest.raises(ProtocolError, match="past its share of 12 bytes"):
        m.begin(hdr(tag=1, length=8))
    assert m.held_count == 0  # what the dropped peer made us hold is released at once
    assert m.charged_bytes == 0


async def test_fail_peer_fails_pending_and_later_receives() -> None:
    m = Matcher(0)
    pending = m.post(1, 7, 0, 0)
    unaffected = m.post(2, 7, 0, 0)
    exc = PeerLostError(1, "reset")
    m.fail_peer(1, exc)
    with pytest.raises(PeerLostError, match="peer rank 1 lost: reset"):
        await pending
    with pytest.raises(PeerLostError):
        await m.post(1, 7, 1, 0)
    assert not unaffected.done()
    assert m.posted_count == 1


async def test_close_fails_everything() -> None:
    m = Matcher(0)
    pending = m.post(1, 7, 0, 0)
    arrive(m, hdr(tag=1), b"a" * 8)
    m.close()
    with pytest.raises(TransportClosedError):
        await pending
    with pytest.raises(TransportClosedError):
        await m.post(1, 7, 0, 1)
    assert m.posted_count == 0
    assert m.held_count == 0


async def test_receive_cancelled_by_its_owner_is_skipped() -> None:
    m = Matcher(0)
    first = m.post(1, 7, 0, 0)
    second = m.post(1, 7, 0, 0)
    first.cancel()
    arrive(m, hdr(), b"k" * 8)
    assert bytes((await asyncio.wait_for(second, 1)).payload) == b"k" * 8
    only = m.post(1, 7, 0, 1)
    only.cancel()
    arrive(m, hdr(tag=1), b"j" * 8)  # nobody waits any more: held, not lost
    assert m.posted_count == 0
    assert m.held_count == 1


async def test_finish_touches_only_its_schedule() -> None:
    m = Matcher(0)
    futs = {s: [m.post(1, s, e, 0) for e in range(3)] for s in range(5)}
    arrive(m, hdr(sched=2, execution=5), b"x" * 8)
    assert m.finish(2, 1) == 2
    assert [f.cancelled() for f in futs[2]] == [True, True, False]
    assert not any(f.done() for s in (0, 1, 3, 4) for f in futs[s])
    assert m.posted_count == 13
    assert m.finish(2, 10) == 1
    assert m.held_count == 0  # the held message of execution 5 went with it
    assert len(m.errors) == 1
    assert m.finish(2, 11) == 0


async def test_forget_drops_a_schedule() -> None:
    m = Matcher(0)
    f = m.post(1, 7, 5, 0)
    m.forget(7)
    assert f.cancelled()
    assert m.posted_count == 0


# -- decode_header ---------------------------------------------------------------------------

GOOD = Header(PROTOCOL_VERSION, int(Kind.DATA), 3, 12, 4, 1, "<f4", (2, 3), int(Format.DENSE),
              24)


@pytest.mark.parametrize("h", [
    GOOD,
    GOOD._replace(kind=int(Kind.ACTIVATION), dtype="", shape=(), length=0),
    GOOD._replace(fmt=int(Format.SPARSE), shape=(), length=1000),  # unknown length is fine
    GOOD._replace(dtype="|b1", shape=(5,), length=5),
    GOOD._replace(sched=2**63 - 1, execution=2**63 - 1, src=3),
])
def test_decode_accepts_good_headers(h: Header) -> None:
    assert decode_header(encode_header(h), world_size=4) == h


def _raw(*fields: object) -> bytes:
    out: bytes = msgpack.packb(fields, use_bin_type=True)
    return out


@pytest.mark.parametrize(("raw", "reason"), [
    (b"\xc1", "not valid msgpack"),
    (_raw(*GOOD[:-1]), "10 fields"),
    (msgpack.packb({"version": 1}), "10 fields"),
    (encode_header(GOOD._replace(version=PROTOCOL_VERSION + 1)), "unsupported protocol version"),
    (encode_header(GOOD._replace(kind=9)), "unknown frame kind 9"),
    (encode_header(GOOD._replace(fmt=9)), "unknown payload format 9"),
    (encode_header(GOOD._replace(src=4)), "source rank 4 outside 0..3"),
    (encode_header(GOOD._replace(src=-1)), "source rank -1"),
    (encode_header(GOOD._replace(execution=-1)), "non-negative"),
    (encode_header(GOOD._replace(sched=2**63)), "non-negative 64-bit"),
    (encode_header(GOOD._replace(tag=-2)), "non-negative"),
    (encode_header(GOOD._replace(tag=2**64 - 1)), "non-negative 64-bit"),
    (encode_header(GOOD._replace(length=-1)), "payload length -1"),
    (encode_header(GOOD._replace(length=1 << 40, shape=(1 << 38,))), "payload length"),
    (encode_header(GOOD._replace(dtype="<U4")), "not on the allow list"),
    (encode_header(GOOD._replace(dtype="O")), "not on the allow list"),
    (_raw(*GOOD[:6], 5, *GOOD[7:]), "not on the allow list"),
    (encode_header(GOOD._replace(shape=(1,) * 9, length=4)), "at most 8"),
    (encode_header(GOOD._replace(shape=(-2, -3))), "non-negative ints"),
    (encode_header(GOOD._replace(shape=(2, 4))), "needs 32 bytes, header says 24"),
    (_raw(*GOOD[:4], "4", *GOOD[5:]), "field tag must be an int"),
    (_raw(*GOOD[:5], True, *GOOD[6:]), "field src must be an int"),
    (_raw(*GOOD[:7], 6, *GOOD[8:]), "shape must be an array"),
    (b"\x90" + b"\x00" * 2000, "exceeds 1024"),
])
def test_decode_rejects_bad_headers(raw: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode_header(raw, world_size=4)


def test_decode_honours_limits() -> None:
    tight = Limits(max_header_bytes=8)
    with pytest.raises(ProtocolError, match="exceeds 8"):
        decode_header(encode_header(GOOD), 4, tight)
    with pytest.raises(ProtocolError, match="shape must be an array of at most 1"):
        decode_header(encode_header(GOOD), 4, Limits(max_ndim=1))
    with pytest.raises(ProtocolError, match=r"payload length 24 outside 0\.\.16"):
        decode_header(encode_header(GOOD), 4, Limits(max_payload_bytes=16))


# -- the matcher against a model, on random interleavings -------------------------------------

_keys = st.tuples(st.sampled_from([1, 2]), st.sampled_from([7, 8]), st.integers(0, 2),
                  st.integers(0, 1))
_steps = st.lists(st.one_of(
    st.tuples(st.just("post"), _keys),
    st.tuples(st.just("arrive"), _keys, st.sampled_from([Kind.DATA, Kind.ACTIVATION])),
    st.tuples(st.just("finish"), st.sampled_from([7, 8]), st.integers(0, 2)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
), max_size=60)


@settings(max_examples=200)
@given(_steps)
def test_matcher_agrees_with_a_model(steps: list[tuple[Any, ...]]) -> None:
    """Receives get the messages of their key in arrival order, the earliest receive first;
    finished executions retire receives and make later messages late; counters agree."""

    async def run() -> None:
        m = Matcher(0)
        posted: dict[tuple[int, ...], list[int]] = {}  # key -> receive ids waiting, in order
        held: dict[tuple[int, ...], list[tuple[int, Kind]]] = {}  # key -> payload ids
        finished: dict[int, int] = {}
        futs: list[asyncio.Future[Any]] = []
        expect: list[int | str | None] = []  # per receive: payload id, "cancelled" or None
        dropped = errors = 0
        payload = 0

        def late(kind: Kind) -> None:
            nonlocal dropped, errors
            if kind == Kind.ACTIVATION:
                dropped += 1
            else:
                errors += 1

        for step in steps:
            if step[0] == "post":
                key = step[1]
                if key[2] < finished.get(key[1], 0):
                    continue  # an executor never posts for a finished execution
                futs.append(m.post(*key))
                if held.get(key):
                    expect.append(held[key].pop(0)[0])
                else:
                    posted.setdefault(key, []).append(len(futs) - 1)
                    expect.append(None)
            elif step[0] == "arrive":
                key, kind = step[1], step[2]
                src, sched, execution, tag = key
                payload += 1
                arrive(m, hdr(src, sched, execution, tag, 4, kind), payload.to_bytes(4, "little"))
                if posted.get(key):
                    expect[posted[key].pop(0)] = payload
                elif execution < finished.get(sched, 0):
                    late(kind)
                else:
                    held.setdefault(key, []).append((payload, kind))
            elif step[0] == "finish":
                sched, e = step[1], step[2]
                m.finish(sched, e)
                finished[sched] = max(finished.get(sched, 0), e + 1)
                for key in [k for k in posted if k[1] == sched and k[2] <= e]:
                    for rid in posted.pop(key):
                        expect[rid] = "cancelled"
                for key in [k for k in held if k[1] == sched and k[2] <= e]:
                    for _, kind in held.pop(key):
                        late(kind)
            elif step[1] < len(futs) and expect[step[1]] is None:  # the owner cancels
                futs[step[1]].cancel()
                expect[step[1]] = "cancelled"
                for q in posted.values():
                    if step[1] in q:
                        q.remove(step[1])
            for fut, want in zip(futs, expect, strict=True):
                if want is None:
                    assert not fut.done()
                elif want == "cancelled":
                    assert fut.cancelled()
                else:
                    assert int.from_bytes(fut.result().payload, "little") == want
            assert m.posted_count == sum(len(q) for q in posted.values())
            assert m.held_count == sum(len(q) for q in held.values())
            assert m.dropped == dropped
            assert len(m.errors) == min(errors, 64)

    asyncio.run(run())


async def test_held_message_of_a_lost_peer_is_still_delivered():
    """A peer that sent and then closed delivered its message: the receive must get it."""
    m = Matcher(0)
    h = Header(1, 0, 7, 0, 3, 1, "|u1", (2,), 0, 2)
    slot = m.begin(h)
    slot.view[:] = b"ok"
    m.complete(slot)
    m.fail_peer(1, PeerLostError(1, "closed"))
    msg = await asyncio.wait_for(m.post(1, 7, 0, 3, memoryview(bytearray(2))), 1)
    assert bytes(msg.payload) == b"ok"
    with pytest.raises(PeerLostError):
        await asyncio.wait_for(m.post(1, 7, 0, 4), 1)


async def test_one_budget_for_held_streaming_unknown_length_and_discarded() -> None:
    m = Matcher(0, Limits(max_held_bytes=1 << 20, max_discard_bytes=1 << 20), world_size=2)
    arrive(m, hdr(tag=0, length=300 << 10), bytes(300 << 10))  # held, complete
    streaming = m.begin(hdr(tag=1, length=300 << 10))  # held, still streaming in
    m.finish(9, 0)
    late = m.begin(hdr(sched=9, length=200 << 10))  # read only to be thrown away
    assert late.discard
    unknown = m.post(1, 7, 0, 2)
    with pytest.raises(ProtocolError, match="rank 1 claims 300000 bytes for a receive of "
                                            "unknown length while holding 819200"):
        m.begin(hdr(tag=2, length=300000))  # over the one budget: the peer is dropped
    assert m.charged_bytes == 0
    assert m.held_count == 0
    with pytest.raises(ProtocolError):
        await unknown
    with pytest.raises(ProtocolError, match="past its share"):
        m.begin(hdr(tag=3, length=1))  # its later frames are refused
    m.complete(streaming)  # its payload finishes after the drop: not held, not charged
    m.abandon(late)
    assert m.held_count == 0
    assert m.charged_bytes == 0


async def test_a_peer_past_its_share_is_dropped_when_another_needs_its_share() -> None:
    dropped: list[int] = []
    m = Matcher(0, Limits(max_held_bytes=3000), world_size=4)  # 1000 bytes a peer
    m.on_drop = lambda rank, err: dropped.append(rank)
    arrive(m, hdr(src=1, tag=0, length=2000), bytes(2000))  # past its share: room to borrow
    arrive(m, hdr(src=2, tag=0, length=900), bytes(900))
    assert m.charged(1) == 2000
    assert dropped == []
    arrive(m, hdr(src=3, tag=0, length=500), bytes(500))  # within its share: rank 1 goes
    assert dropped == [1]
    assert (m.charged(1), m.charged(2), m.charged(3)) == (0, 900, 500)
    assert m.held_count == 2
    got = await m.post(2, 7, 0, 0)  # a held message taken releases its bytes
    assert len(got.payload) == 900
    assert m.charged_bytes == 500


async def test_what_a_rank_sends_itself_is_not_charged() -> None:
    m = Matcher(0, Limits(max_held_bytes=100), world_size=2)
    arrive(m, hdr(src=0, tag=0, length=500), bytes(500))  # loopback: its own doing
    assert m.charged_bytes == 0
    arrive(m, hdr(src=1, tag=0, length=100), bytes(100))  # a peer still gets its whole share
    assert m.charged_bytes == 100
    assert len((await m.post(0, 7, 0, 0)).payload) == 500
