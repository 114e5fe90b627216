"""The pieces of a joiner's state transfer that need no processes (asynccoll.comm.joining,
asynccoll.comm.state_ring): the digest every rank compares, the units a stripe is cut into,
and a ring's copies through a real segment."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from asynccoll.comm import state_digest, state_ring
from asynccoll.comm.shm import new_token


def _state(n: int = (3 << 20) + 13) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.standard_normal(n // 8), rng.integers(0, 255, n, dtype=np.uint8)]


@pytest.mark.parametrize("parts", [1, 3])
def test_equal_bytes_equal_digests_and_any_change_shows(parts: int) -> None:
    a = _state()
    base = state_digest.digest(a, parts)
    assert state_digest.digest([x.copy() for x in a], parts) == base
    assert 0 <= base < 1 << 63  # fits the int64 allgather
    b = [x.copy() for x in a]
    b[0][[10, 20]] = b[0][[20, 10]]  # two words swapped: a sum of words would not see it
    assert state_digest.digest(b, parts) != base
    c = [x.copy() for x in a]
    c[0][[5, 99]] *= -1  # two sign bits flipped: neither a sum nor an xor of words would
    assert state_digest.digest(c, parts) != base
    d = [x.copy() for x in a]
    d[1][-1] ^= 1  # one bit, in the tail
    assert state_digest.digest(d, parts) != base


def test_the_digest_depends_on_the_parts_and_the_arrays_bounds() -> None:
    a = _state()
    assert state_digest.digest(a, 1) != state_digest.digest(a, 3)
    flat = np.concatenate([x.reshape(-1).view(np.uint8) for x in a])
    assert state_digest.digest([flat], 1) != state_digest.digest(a, 1)


@pytest.mark.parametrize("d", [1, 3, 4])
def test_units_cover_each_stripe_once_in_order(d: int) -> None:
    sizes = [0, 5, (17 << 20) + 3, state_digest.HASH_CHUNK]
    seen: list[list[tuple[int, int]]] = [[] for _ in sizes]
    for i in range(d):
        us = state_digest.units(sizes, i, d)
        for j, lo, hi in us:
            s = state_digest.stripe(sizes[j], i, d)
            assert s.start <= lo < hi <= s.stop
            assert hi - lo <= state_digest.HASH_CHUNK
            seen[j].append((lo, hi))
        assert us == sorted(us)
    for j, n in enumerate(sizes):  # the units of all stripes tile each array exactly
        ends = [0]
        for lo, hi in sorted(seen[j]):
            assert lo == ends[-1]
            ends.append(hi)
        assert ends[-1] == n


def test_chunks_pack_whole_units_into_slots() -> None:
    units = [(0, 0, 3), (0, 3, 8), (1, 0, 2), (2, 0, 8), (3, 0, 1)]
    got = state_ring.chunks(units, 8)
    assert got == [[(0, 0, 3), (0, 3, 8)], [(1, 0, 2)], [(2, 0, 8)], [(3, 0, 1)]]
    slot = state_ring.SLOT
    assert state_ring.ring_shape(5 * slot + 1, slot) == (slot, state_ring.SLOTS)
    assert state_ring.ring_shape(2 * slot, slot // 2) == (slot, 2)
    assert state_ring.ring_shape(25, 8) == (25, 1)


@pytest.mark.timeout(30)
def test_a_ring_carries_a_stripe_and_leaves_no_file() -> None:
    src = _state((40 << 20) + 7)
    dst = [np.zeros_like(x) for x in src]
    sv = [x.reshape(-1).view(np.uint8) for x in src]
    dv = [x.reshape(-1).view(np.uint8) for x in dst]
    us = state_digest.units([v.size for v in sv], 0, 1)
    path = state_ring.Ring.path(new_token(), 7, 0, 1)
    donor = state_ring.Ring.create(path, us)
    joiner = state_ring.Ring.attach(path, donor.slot, donor.slots)
    assert not os.path.exists(path)  # the joiner unlinks it once mapped
    n = len(state_ring.chunks(us, donor.slot))
    assert n > donor.slots  # the slots are reused

    async def run() -> list[tuple[int, int, int]]:
        loop = asyncio.get_running_loop()
        filled = [loop.create_future() for _ in range(n)]
        freed = [loop.create_future() for _ in range(n)]
        hashed: list[tuple[int, int, int]] = []

        async def fill(k: int) -> None:
            filled[k].set_result(None)

        await asyncio.gather(donor.send(sv, us, fill, freed),
                             joiner.receive(dv, us, filled,
                                            lambda k: freed[k].set_result(None), hashed.append))
        return hashed

    try:
        hashed = asyncio.run(run())
    finally:
        donor.close()
        joiner.close()
    assert sorted(hashed) == us
    for a, b in zip(src, dst, strict=True):
        assert np.array_equal(a, b)
