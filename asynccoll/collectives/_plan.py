"""The machinery under the dense builders: a schedule written as a sequential program.

A :class:`Plan` appends sends, receives and reductions to a schedule in *program order* and
derives each op's dependencies from the buffer regions it touches (read after write, write after
read, write after write), per element interval, as a compiler orders loads and stores. So an op
waits for exactly the ops whose data it needs or whose data it would overwrite, nothing more:
a segment's reduction waits for its own receive only, a receive into a region waits until the
sends reading that region have completed. This makes the algorithms below correct with respect to
buffer reuse by construction, and as concurrent as their data flow allows.

Tags: every algorithm step reserves a block of tags, one per segment of the step's largest
message; all ranks reserve the same blocks in the same order, whatever part they play in the
step, so sender and receiver agree on each message's tag.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..buffers import ALLOWED_DTYPES, dtype_to_wire
from ..sched import BufRef, Schedule, SlotSpec

__all__ = ["REDUCE_OPS", "Plan", "block_bounds", "check_count", "check_dtype", "check_op"]

#: the reduction ops every builder accepts (registered kernels of the same names).
REDUCE_OPS: tuple[str, ...] = ("sum", "prod", "min", "max")


def check_op(op: Any) -> None:
    """``ValueError`` naming ``op`` unless it is sum, prod, min or max."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")


def check_count(count: Any) -> None:
    """``ValueError`` naming ``count`` unless it is an int >= 0."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")


def check_dtype(dtype: Any) -> np.dtype[Any]:
    """The NumPy dtype ``dtype`` names; ``ValueError`` naming ``dtype`` unless it can travel."""
    try:
        dt: np.dtype[Any] = np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"dtype must name a NumPy dtype, got {dtype!r}") from exc
    if dt.kind not in "biufc" or dtype_to_wire(dt) not in ALLOWED_DTYPES:
        raise ValueError(f"dtype must be a numeric dtype that travels on the wire (bool, int, "
                         f"uint, float16/32/64, complex64/128), got {dt}")
    return dt


def block_bounds(count: int, world_size: int) -> list[int]:
    """``world_size + 1`` offsets splitting ``count`` elements into blocks, as
    ``numpy.array_split`` does: the first ``count % world_size`` blocks have one element more.

    >>> block_bounds(10, 4)
    [0, 3, 6, 8, 10]
    """
    check_count(count)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    q, r = divmod(int(count), world_size)
    return [i * q + min(i, r) for i in range(world_size + 1)]


class _Track:
    """Who last wrote, and who read since, each interval of one slot."""

    __slots__ = ("bounds", "readers", "writer")

    def __init__(self, n: int) -> None:
        self.bounds = [0, n]
        self.writer = [-1]
        self.readers: list[list[int]] = [[]]

    def _cut(self, x: int) -> int:
        b = self.bounds
        i = bisect_left(b, x)
        if i < len(b) and b[i] == x:
            return i
        b.insert(i, x)
        self.writer.insert(i, self.writer[i - 1])
        self.readers.insert(i, list(self.readers[i - 1]))
        return i

    def deps(self, lo: int, hi: int, write: bool, into: set[int]) -> None:
        i, j = self._cut(lo), self._cut(hi)
        for p in range(i, j):
            if self.writer[p] >= 0:
                into.add(self.writer[p])
            if write:
                into.update(self.readers[p])

    def mark(self, lo: int, hi: int, op: int, write: bool) -> None:
        i, j = self._cut(lo), self._cut(hi)
        for p in range(i, j):
            if write:
                self.writer[p] = op
                self.readers[p] = []
            else:
                self.readers[p].append(op)


Access = tuple[str, int, int, bool]  # slot, lo, hi, write


class Plan:
    """Appends one collective's ops to ``s`` in program order (see the module docstring)."""

    def __init__(self, s: Schedule, dtype: np.dtype[Any], tag_base: int, after: Sequence[int],
                 segment_bytes: int) -> None:
        self.s = s
        self.rank = s.rank
        self.P = s.world_size
        self.dtype = dtype
        self.dtype_name = dtype.name
        self.itemsize = dtype.itemsize
        self.seg = max(1, segment_bytes // dtype.itemsize)
        self.tag = tag_base
        self.count = 0
        self._p2 = 1 << (self.P.bit_length() - 1)  # the largest power of two <= P
        self._t_out = 0
        self.label = ""
        self.dry = False  # reserve tags only (a folded rank shadowing the core's steps)
        #: the next recv_reduce's receives are sources (posted when the execution is armed,
        #: not after ``after``): a partial collective's fused activation (module doc of
        #: :mod:`asynccoll.collectives.partial`). Reset by the recv_reduce that uses it.
        self.source_recvs = False
        self.mine: list[int] = []
        self.tracks: dict[str, _Track] = {}
        if after:
            self.entry = sorted(set(after))
        else:
            self.entry = [s.nop(label="start")]
            self.mine.append(self.entry[0])

    # -- slots -------------------------------------------------------------------------------
    def data_slot(self, name: str, count: int) -> None:
        """Declare (or check) the caller's slot ``name`` of ``count`` elements."""
        self._declare(name, count, "slot")
        self.count = count

    def scratch(self, name: str, count: int) -> None:
        """Declare scratch slot ``name`` with at least ``count`` elements (shared by builders
        appended with the same prefix, so it grows to the largest need)."""
        prev = self.s.meta.setdefault("scratch", {}).get(name)
        if name in self.s.slots and prev is None:
            raise ValueError(f"scratch_prefix: slot {name!r} is already declared by the caller")
        count = max(count, prev or 0)
        spec = self.s.slots.get(name)
        if spec is not None and spec.dtype not in (None, self.dtype_name):
            raise ValueError(f"scratch_prefix: scratch slot {name!r} has dtype {spec.dtype}, "
                             f"this collective needs {self.dtype_name}; use another prefix")
        self.s.declare(name, SlotSpec(count, self.dtype_name))
        self.s.meta["scratch"][name] = count
        self.tracks[name] = _Track(count)

    def _declare(self, name: str, count: int, arg: str) -> None:
        spec = self.s.slots.get(name)
        if spec is not None:
            if spec.count is not None and spec.count != count:
                raise ValueError(f"{arg}: slot {name!r} is declared with {spec.count} elements, "
                                 f"this collective needs {count}")
            if spec.dtype is not None and np.dtype(spec.dtype) != self.dtype:
                raise ValueError(f"{arg}: slot {name!r} is declared with dtype {spec.dtype}, "
                                 f"this collective needs {self.dtype_name}")
        self.s.declare(name, SlotSpec(count, self.dtype_name))
        self.tracks[name] = _Track(count)

    # -- primitives --------------------------------------------------------------------------
    def step(self, max_elems: int, label: str) -> int:
        """Reserve the tags of one step whose largest message has ``max_elems`` elements;
        ``label`` names the step in its ops' labels (shown by ``pending()`` and inspect)."""
        self.label = label
        t0 = self.tag
        self.tag += max(1, -(-max_elems // self.seg))
        return t0

    def _add(self, accesses: Sequence[Access], make: Any) -> int:
        deps: set[int] = set()
        for slot, lo, hi, write in accesses:
            self.tracks[slot].deps(lo, hi, write, deps)
        op: int = make(sorted(deps) or self.entry)
        for slot, lo, hi, write in accesses:
            self.tracks[slot].mark(lo, hi, op, write)
        self.mine.append(op)
        return op

    def _segments(self, n: int) -> list[tuple[int, int]]:
        return [(a, min(n, a + self.seg)) for a in range(0, n, self.seg)]

    def _label(self, k: int, n: int) -> str:
        return self.label if n <= self.seg else f"{self.label} seg {k}"

    def send(self, peer: int, slot: str, lo: int, n: int, t0: int) -> None:
        if self.dry:
            return
        for k, (a, b) in enumerate(self._segments(n)):
            self._add([(slot, lo + a, lo + b, False)],
                      lambda d, a=a, b=b, k=k: self.s.send(
                          peer, BufRef(slot, lo + a, b - a), t0 + k, deps=d,
                          label=self._label(k, n)))

    def recv(self, peer: int, slot: str, lo: int, n: int, t0: int) -> None:
        if self.dry:
            return
        for k, (a, b) in enumerate(self._segments(n)):
            self._add([(slot, lo + a, lo + b, True)],
                      lambda d, a=a, b=b, k=k: self.s.recv(
                          peer, BufRef(slot, lo + a, b - a), t0 + k, deps=d,
                          label=self._label(k, n)))

    def recv_reduce(self, peer: int, slot: str, lo: int, n: int, tmp: str, tlo: int, op: str,
                    t0: int) -> None:
        """Receive ``n`` elements into ``tmp[tlo:]`` and reduce them into ``slot[lo:]``, per
        segment (each reduction depends on its own receive only)."""
        if self.dry:
            return
        source, self.source_recvs = self.source_recvs, False
        for k, (a, b) in enumerate(self._segments(n)):
            into = BufRef(slot, lo + a, b - a)
            got = BufRef(tmp, tlo + a, b - a)
            lab = self._label(k, n)
            # ``tmp`` is untouched before the first step, so a source receive races nothing
            self._add([(tmp, tlo + a, tlo + b, True)],
                      lambda d, got=got, k=k, lab=lab: self.s.recv(
                          peer, got, t0 + k, deps=() if source else d, label=lab))
            # (a source receive no longer orders its reduction after ``after``: add it)
            self._add([(slot, lo + a, lo + b, True), (tmp, tlo + a, tlo + b, False)],
                      lambda d, into=into, got=got, lab=lab: self.s.compute(
                          op, [into, got], into,
                          deps=sorted({*d, *self.entry}) if source else d, label=lab))

    def finish(self) -> int:
        """Add the result no-op (AND of this collective's sinks); record the tags used."""
        mine = set(self.mine)
        has_succ = {d for i in self.mine for d in self.s.ops[i].deps}
        sinks = sorted(i for i in mine if i not in has_succ) or self.entry
        done = self.s.nop(deps=sinks, label="done")
        self.s.meta["next_tag"] = max(int(self.s.meta.get("next_tag", 0)), self.tag)
        return done

    # -- algorithms --------------------------------------------------------------------------
    def fold_in(self, slot: str, tmp: str, op: str) -> int:
        """Fold ranks P' + i onto i (P' the largest power of two <= P); reserve the tags of
        :meth:`fold_out` too. Returns this rank's rank among the P' (-1 for a folded rank)."""
        P, r, p2 = self.P, self.rank, self._p2
        if P == p2:
            return r
        t0 = self.step(self.count, "fold in")
        self._t_out = self.step(self.count, "fold out")
        self.label = "fold in"
        if r >= p2:
            self.send(r - p2, slot, 0, self.count, t0)
            return -1
        if r < P - p2:
            self.recv_reduce(r + p2, slot, 0, self.count, tmp, 0, op, t0)
        return r

    def fold_out(self, slot: str) -> None:
        """Hand the result back to the folded ranks (the mirror of :meth:`fold_in`)."""
        P, r, p2 = self.P, self.rank, self._p2
        if P == p2:
            return
        self.label = "fold out"
        if r >= p2:
            self.recv(r - p2, slot, 0, self.count, self._t_out)
        elif r < P - p2:
            self.send(r + p2, slot, 0, self.count, self._t_out)

    def recursive_doubling(self, slot: str, tmp: str, op: str, me: int) -> None:
        """log2 P' exchanges of the whole vector with partner ``me ^ 2**i``."""
        n = self.count
        mask = 1
        while mask < self._p2:
            t0 = self.step(n, f"doubling {mask.bit_length() - 1}")
            peer = me ^ mask
            self.send(peer, slot, 0, n, t0)
            self.recv_reduce(peer, slot, 0, n, tmp, 0, op, t0)
            mask <<= 1

    def rabenseifner(self, slot: str, tmp: str, op: str, me: int) -> None:
        """Reduce-scatter by recursive halving, then allgather by recursive doubling, over P'
        blocks (:func:`block_bounds`)."""
        lo, hi = self.halving(slot, tmp, op, me)
        p2 = self._p2
        b = block_bounds(self.count, p2)
        big = b[1] - b[0]
        mask = 1
        while mask < p2:
            t0 = self.step(big * mask, f"gathering {mask.bit_length() - 1}")
            peer = me ^ mask
            other = (lo - mask, lo) if me & mask else (hi, hi + mask)
            self.send(peer, slot, b[lo], b[hi] - b[lo], t0)
            self.recv(peer, slot, b[other[0]], b[other[1]] - b[other[0]], t0)
            lo, hi = min(lo, other[0]), max(hi, other[1])
            mask <<= 1

    def halving_reduce_scatter(self, slot: str, tmp: str, op: str) -> None:
        """Reduce-scatter over all P ranks (a power of two) by :meth:`halving`."""
        assert self.P == self._p2
        self.halving(slot, tmp, op, self.rank)

    def halving(self, slot: str, tmp: str, op: str, me: int) -> tuple[int, int]:
        """Reduce-scatter by recursive halving over P' blocks: in each step exchange half of the
        blocks still held with ``me ^ mask`` (keeping the lower half when that bit of ``me`` is
        0) and reduce the kept half. Afterwards block ``me`` is fully reduced here; returns
        ``(me, me + 1)``. ``tmp`` mirrors ``slot`` (``count`` elements)."""
        p2 = self._p2
        b = block_bounds(self.count, p2)
        big = b[1] - b[0]
        lo, hi = 0, p2
        mask = p2 >> 1
        while mask:
            mid = (lo + hi) // 2
            peer = me ^ mask
            t0 = self.step(big * mask, f"halving {p2.bit_length() - mask.bit_length() - 1}")
            keep, give = ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
            self.send(peer, slot, b[give[0]], b[give[1]] - b[give[0]], t0)
            self.recv_reduce(peer, slot, b[keep[0]], b[keep[1]] - b[keep[0]], tmp,
                             b[keep[0]], op, t0)
            lo, hi = keep
            mask >>= 1
        return lo, hi

    def ring_reduce_scatter(self, slot: str, tmp: str, op: str, b: Sequence[int]) -> None:
        """P - 1 ring steps; afterwards rank r's block ``b[r]:b[r+1]`` is fully reduced.

        Step s sends block r - s - 1 to the right and reduces block r - s - 2 from the left
        into place, receiving through alternating halves of ``tmp`` (two blocks), so a step's
        receive can land while the previous step's reduction runs.
        """
        P, r = self.P, self.rank
        big = b[1] - b[0]
        right, left = (r + 1) % P, (r - 1) % P
        for s in range(P - 1):
            t0 = self.step(big, f"ring reduce-scatter {s}")
            sb, rb = (r - s - 1) % P, (r - s - 2) % P
            self.send(right, slot, b[sb], b[sb + 1] - b[sb], t0)
            self.recv_reduce(left, slot, b[rb], b[rb + 1] - b[rb], tmp, (s % 2) * big, op, t0)

    def ring_allgather(self, slot: str, b: Sequence[int], shift: int = 0) -> None:
        """P - 1 ring steps passing each rank's block around, in place: rank q owns block
        ``(q - shift) % P``, which is ``b[i]:b[i+1]`` for block i."""
        P, r = self.P, self.rank
        big = max(b[i + 1] - b[i] for i in range(P))
        right, left = (r + 1) % P, (r - 1) % P
        for t in range(P - 1):
            t0 = self.step(big, f"ring allgather {t}")
            sb, rb = (r - shift - t) % P, (r - shift - t - 1) % P
            self.send(right, slot, b[sb], b[sb + 1] - b[sb], t0)
            self.recv(left, slot, b[rb], b[rb + 1] - b[rb], t0)

    def binomial_scatter(self, slot: str, root: int, b: Sequence[int]) -> None:
        """Scatter block i (``b[i]:b[i+1]``) from ``root`` to rank ``(root + i) % P`` down a
        binomial tree: each rank receives its subtree's blocks (contiguous, as blocks are
        numbered by rank relative to the root) and forwards the children's parts."""
        P = self.P
        vr = (self.rank - root) % P
        # no message holds more than P // 2 blocks (a subtree below the root's largest child)
        t0 = self.step((b[1] - b[0]) * max(1, P // 2), f"scatter from {root}")
        mask = 1
        while mask < P:
            if vr & mask:
                hi = min(vr + mask, P)
                self.recv((self.rank - mask) % P, slot, b[vr], b[hi] - b[vr], t0)
                break
            mask <<= 1
        mask >>= 1
        while mask:
            if vr + mask < P:
                lo, hi = vr + mask, min(vr + 2 * mask, P)
                self.send((self.rank + mask) % P, slot, b[lo], b[hi] - b[lo], t0)
            mask >>= 1

    def bruck_allgather(self, slot: str, tmp: str, c: int) -> None:
        """Bruck's allgather of ``c`` elements per rank in ceil(log2 P) steps, for any P.

        ``tmp`` (``P * c``) collects the blocks of ranks r, r + 1, ... in that order: step k
        sends the first min(2**k, P - 2**k) blocks to r - 2**k and receives as many from
        r + 2**k behind them. Then two copies rotate ``tmp`` into place in ``slot``.
        """
        P, r = self.P, self.rank
        self.label = "bruck copy in"
        self._copy(tmp, 0, slot, r * c, c)
        dist = 1
        while dist < P:
            nb = min(dist, P - dist)
            t0 = self.step(nb * c, f"bruck {dist.bit_length() - 1}")
            self.send((r - dist) % P, tmp, 0, nb * c, t0)
            self.recv((r + dist) % P, tmp, dist * c, nb * c, t0)
            dist <<= 1
        self.label = "bruck copy out"
        self._copy(slot, (r + 1) * c, tmp, c, (P - 1 - r) * c)
        self._copy(slot, 0, tmp, (P - r) * c, r * c)

    def _copy(self, dst: str, dlo: int, src: str, slo: int, n: int) -> None:
        """``dst[dlo:dlo+n] = src[slo:slo+n]`` as one op (the executor offloads it when large)."""
        if n == 0 or self.dry:
            return
        out, inp = BufRef(dst, dlo, n), BufRef(src, slo, n)
        self._add([(dst, dlo, dlo + n, True), (src, slo, slo + n, False)],
                  lambda d: self.s.compute("copy", [inp], out, deps=d, label=self.label))

    def binomial_broadcast(self, slot: str, root: int) -> None:
        """Binomial tree rooted at ``root``; each segment is forwarded as soon as it arrives."""
        P = self.P
        vr = (self.rank - root) % P
        t0 = self.step(self.count, f"broadcast from {root}")
        mask = 1
        while mask < P:
            if vr & mask:
                self.recv((vr - mask + root) % P, slot, 0, self.count, t0)
                break
            mask <<= 1
        mask >>= 1
        while mask:
            if vr + mask < P:
                self.send((vr + mask + root) % P, slot, 0, self.count, t0)
            mask >>= 1

    def dissemination(self) -> None:
        """Rounds i = 0.. of empty messages to r + 2**i. Round i's send waits for the receives
        of *every* earlier round: it vouches that ranks r - 2**(i+1) + 1 .. r have all entered
        (the last round's receive alone would vouch for only part of that window). All
        receives are posted at entry."""
        P, r = self.P, self.rank
        heard = list(self.entry)
        dist = 1
        while dist < P:
            t = self.step(1, f"barrier {dist.bit_length() - 1}")
            snd = self.s.send((r + dist) % P, None, t, deps=heard, label=self.label)
            rcv = self.s.recv((r - dist) % P, None, t, deps=self.entry, label=self.label)
            self.mine += [snd, rcv]
            heard = [*heard, rcv]
            dist <<= 1
