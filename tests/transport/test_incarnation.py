"""Which process of a rank a connection reaches (its *incarnation*: 0 first, k after its k-th
restart) travels in the handshake, bound by both proofs, and a loss notice names it: a notice
about a process that a restart already replaced is not a loss of the new one.

The race this closes: ranks 1 and 2 are killed and restarted; rank 0 sees old rank 1 go and
tells everyone, and its notice reaches new rank 2 after new rank 1 connected there. Rank 2
used to take it for a loss of the live new rank 1 (one CI run in a few of
``tests/adversarial/test_rejoin.py::test_two_ranks_killed_are_both_restarted_and_join``).
Real sockets on 127.0.0.1, the ranks transports of one process.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _rejoin_helpers import lose

from asynccoll.comm.membership import LOST_SCHED, Membership
from asynccoll.errors import AuthenticationError
from asynccoll.sched import LiveOps
from asynccoll.transport import auth
from asynccoll.transport.frames import Kind
from asynccoll.transport.tcp import TcpTransport

SECRET = b"i" * 32

pytestmark = pytest.mark.timeout(60)


def test_the_handshake_messages_carry_each_sides_incarnation() -> None:
    nonce = auth.new_nonce()
    hello = auth.parse_hello(auth.make_hello(3, 8, 1, nonce, incarnation=5))
    assert (hello.rank, hello.wanted, hello.nonce, hello.incarnation) == (3, 1, nonce, 5)
    mac = auth.acceptor_mac(SECRET, 3, 1, 8, nonce, nonce, (5, 2))
    ch = auth.parse_challenge(auth.make_challenge(1, 8, nonce, mac, incarnation=2))
    assert (ch.rank, ch.incarnation, ch.mac) == (1, 2, mac)
    # the proofs cover both incarnations: a claim altered on the way fails the check
    assert auth.acceptor_mac(SECRET, 3, 1, 8, nonce, nonce, (4, 2)) != mac
    assert auth.acceptor_mac(SECRET, 3, 1, 8, nonce, nonce, (5, 3)) != mac
    good = auth.connector_mac(SECRET, 3, 1, 8, nonce, nonce, (5, 2))
    with pytest.raises(AuthenticationError, match="failed to prove"):
        auth.verify(auth.connector_mac(SECRET, 3, 1, 8, nonce, nonce, (0, 2)), good, "rank 3")


async def _world(n: int) -> tuple[list[TcpTransport], dict[int, str]]:
    ts = [TcpTransport(r, n, secret=SECRET) for r in range(n)]
    for t in ts:
        t.admit_rejoins = True
    addrs = {t.rank: await t.listen("tcp://127.0.0.1:0") for t in ts}
    await asyncio.gather(*(t.connect({r: a for r, a in addrs.items() if r != t.rank}, timeout=10)
                           for t in ts))
    return ts, addrs


async def _restart(ts: list[TcpTransport], addrs: dict[int, str], rank: int,
                   incarnation: int) -> TcpTransport:
    await lose(ts, rank)
    new = TcpTransport(rank, len(ts), secret=SECRET)
    new.admit_rejoins = True
    new.incarnation = incarnation
    at = await new.listen("tcp://127.0.0.1:0")
    assert await new.rejoin({r: a for r, a in addrs.items() if r != rank}, timeout=10) == \
        [r for r in range(len(ts)) if r != rank]
    ts[rank], addrs[rank] = new, at
    return new


async def test_every_member_learns_the_incarnation_of_a_restarted_process() -> None:
    ts, addrs = await _world(3)
    try:
        assert [t.incarnation_of(p) for t in ts for p in range(3) if p != t.rank] == [0] * 6
        new = await _restart(ts, addrs, 2, 4)
        await asyncio.sleep(0.1)  # the acceptors record it as they accept
        assert ts[0].incarnation_of(2) == ts[1].incarnation_of(2) == 4
        assert new.incarnation_of(0) == new.incarnation_of(1) == 0
        await _restart(ts, addrs, 0, 1)  # a member restarted later: the new process learns it
        await asyncio.sleep(0.1)
        assert new.incarnation_of(0) == ts[1].incarnation_of(0) == 1
        assert ts[0].incarnation_of(2) == 4  # and the restarted one learns the others'
    finally:
        await asyncio.gather(*(t.close() for t in ts))


def _notice(src: TcpTransport, m: Membership, dst: int, lost: int, incarnation: int) -> None:
    """A loss notice from ``src`` to ``dst`` as ``m`` (``src``'s membership) would number it."""
    seq = m._sent.get(dst, 0)
    m._sent[dst] = seq + 1
    src.post_frame(dst, int(Kind.DATA), LOST_SCHED, seq, 0,
                   np.array([lost, incarnation], np.int64).data.cast("B"))


async def test_a_notice_about_a_replaced_process_is_not_a_loss_of_the_new_one() -> None:
    ts, addrs = await _world(3)
    ms: list[Membership] = []
    try:
        await _restart(ts, addrs, 1, 1)
        await asyncio.sleep(0.1)
        ms = [Membership(t, LiveOps()) for t in ts]
        for m in ms:
            m.watch(lambda: False)
        # rank 0 reports the process of rank 1 that the restart replaced: rank 2 talks to the
        # new one, and keeps it
        _notice(ts[0], ms[0], 2, 1, 0)
        await asyncio.sleep(0.3)
        assert ms[2].gone == set()
        assert ms[2].lost is None
        # a notice about the process rank 2 talks to is a loss
        _notice(ts[0], ms[0], 2, 1, 1)
        for _ in range(100):
            if ms[2].gone:
                break
            await asyncio.sleep(0.02)
        assert ms[2].gone == {1}
        assert ms[2].lost is not None
        assert "reported lost by rank 0" in ms[2].lost.reason
    finally:
        for m in ms:
            m.stop()
        await asyncio.gather(*(t.close() for t in ts))


async def test_a_rank_tells_a_loss_with_the_incarnation_it_talks_to() -> None:
    ts, addrs = await _world(3)
    try:
        await _restart(ts, addrs, 2, 3)
        await asyncio.sleep(0.1)
        got = ts[1].post_recv(0, LOST_SCHED, 0, 0)
        Membership(ts[0], LiveOps())._notify(2)
        msg = await asyncio.wait_for(got, 10)
        assert np.frombuffer(msg.payload, np.int64).tolist() == [2, 3]
    finally:
        await asyncio.gather(*(t.close() for t in ts))
