"""The digest that proves a joiner's state equal to the members' (:mod:`.joining`, step 4), and
the cut of a state into the stripes and units that both the transfer and the digest follow.

A state is a list of host arrays, taken as bytes. Member ``i`` of ``D`` sends the ``i``-th
``1/D`` of every array's bytes (:func:`stripe`), in units of at most :data:`HASH_CHUNK` bytes
(:func:`units`): one frame over tcp, one place in a ring's slot through shared memory, and one
hash of the digest, so that a joiner hashes each unit as it lands, while it is in the caches.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from ..errors import AsyncCollError
from .state_ring import Unit

__all__ = ["HASH_CHUNK", "INLINE_BYTES", "Digest", "StateMismatchError", "digest", "pool",
           "stripe", "units"]

HASH_CHUNK = 8 << 20  #: bytes per unit hash of :func:`digest`
INLINE_BYTES = 1 << 20  #: a state (or a unit) this small is hashed where it is, not on a thread
_hashers: list[ThreadPoolExecutor] = []  # the digest's threads (made at first use)


class StateMismatchError(AsyncCollError):
    """After a join, the ranks' states differ (their digests do not match)."""


def stripe(nbytes: int, i: int, d: int) -> slice:
    """The byte range member ``i`` of ``d`` sends of an array of ``nbytes`` bytes."""
    return slice(nbytes * i // d, nbytes * (i + 1) // d)


def units(sizes: Sequence[int], i: int, d: int) -> list[Unit]:
    """Member ``i`` of ``d``'s stripe of arrays of ``sizes`` bytes, as units of at most
    :data:`HASH_CHUNK` bytes, ``(array, first byte, end byte)``, in order: what one frame
    (tcp) or one place in a slot (shared memory) carries, and what one hash of :func:`digest`
    covers, so that the joiner hashes each unit as it arrives."""
    out = []
    for j, n in enumerate(sizes):
        s = stripe(n, i, d)
        out += [(j, lo, min(s.stop, lo + HASH_CHUNK)) for lo in range(s.start, s.stop,
                                                                       HASH_CHUNK)]
    return out


def digest(arrays: Sequence[Any], parts: int = 1) -> int:
    """A 63-bit digest of the bytes of ``arrays`` (host arrays), equal on every rank that
    holds equal bytes and gives the same ``parts``: a 64-bit XXH3 of every unit of each of the
    ``parts`` stripes (:func:`units`), and a BLAKE2b of those hashes and the arrays' lengths.
    Every byte counts and so does its place (a stripe put at the wrong offset, two words
    swapped, a flipped bit anywhere change it); a check against replicas that drifted apart,
    not against an adversary. The units are hashed on a few threads (``xxhash`` releases the
    GIL): about 10 GiB/s per core on the 2-core machine, against zlib's CRC-32 at 3 (which it
    replaces: every rank hashes its whole state in a join, so the hash was most of a large
    join's CPU time), sha1's 1.5 and BLAKE2b's 0.6 (measured). A joiner hashes each unit as it
    arrives (:class:`Digest`), the members theirs while they send."""
    sums = Digest([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays], parts)
    sums.all()
    return sums.value()


class Digest:
    """:func:`digest`'s unit hashes, taken one by one (:meth:`take`) or at once (:meth:`all`)."""

    def __init__(self, views: Sequence[Any], parts: int) -> None:
        self.views, self.parts = list(views), parts
        self._sizes = [int(v.size) for v in self.views]
        self._sums: dict[tuple[int, int], int] = {}

    def take(self, u: Unit) -> None:
        """Hash unit ``u`` (any thread: the GIL is released while it runs)."""
        j, lo, hi = u
        self._sums[(j, lo)] = xxhash.xxh3_64_intdigest(self.views[j][lo:hi])

    def all(self) -> None:
        """Hash every unit, on the digest's threads (here, for a small state)."""
        work = [u for i in range(self.parts) for u in units(self._sizes, i, self.parts)]
        if sum(self._sizes) <= INLINE_BYTES:
            for u in work:
                self.take(u)
        else:
            list(pool().map(self.take, work))

    def value(self) -> int:
        """The digest (every unit hashed)."""
        h = hashlib.blake2b(digest_size=8, person=b"asynccoll.join")
        h.update(struct.pack("<QQ", len(self.views), self.parts))
        for j, n in enumerate(self._sizes):
            h.update(struct.pack("<Q", n))
            for i in range(self.parts):
                st = stripe(n, i, self.parts)
                sums = [self._sums[(j, lo)] for lo in range(st.start, st.stop, HASH_CHUNK)]
                h.update(struct.pack(f"<{len(sums)}Q", *sums))
        return int.from_bytes(h.digest(), "little") >> 1


def pool() -> ThreadPoolExecutor:
    """The threads that hash (made at the first digest; a few, as the host has cores)."""
    if not _hashers:
        _hashers.append(ThreadPoolExecutor(min(4, os.cpu_count() or 1),
                                           thread_name_prefix="asynccoll-digest"))
    return _hashers[0]
