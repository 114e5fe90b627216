"""How a joiner's state moves (:mod:`.joining`, step 4): a member's stripe to the joiner by one
of three paths, which the member chooses (:func:`~.route.state_route`) and names in its first
frame (``PLAN``), and the joiner's side of each.

* **Read in place** (the joiner's host; cross-memory attach, :mod:`.cma`): the member's
  ``PLAN`` carries its process id, the addresses of its arrays and of a marker of random bytes
  (sent in the ``PLAN`` too, which the joiner reads first: a process id that names another
  process, as one from another pid namespace on a host that hashes the same would, finds no
  marker and is refused); the joiner then reads each unit of the stripe straight out of the
  member's arrays into its own (``process_vm_readv``: one copy, made by the kernel, on the
  joiner's executor threads, two units in flight per member), hashes it while it is still in
  the caches, and says ``DONE``. The member holds its state unchanged until then, and writes
  nothing anywhere: the joiner reads, bounded by its own arrays, at the addresses a member
  gave (a member is trusted with the state anyway; one that lies gets the joiner the wrong
  bytes, which the digest comparison then reports). The first read is the probe: where it is
  refused or fails (a kernel whose Yama ``ptrace_scope`` forbids it, a container's seccomp
  profile, no marker, ``ASYNCCOLL_CMA=0`` on either side), the joiner says ``NO`` (one warning
  per process) and the member sends a second ``PLAN`` and its stripe by one of the two other
  paths. A read that fails part-way says ``FAILED``: the joiner's join raises, and the
  member's admission goes on without it. Measured (docs/benchmarks.md, "join"): the path that
  copies each byte once, where the two others copy it twice (ring) or through the kernel's
  socket buffers: 1.6x either at 1 GiB on the 2-core machine, at 0.64x their CPU.
* **Ring** (the joiner's host, a stripe of ``ASYNCCOLL_JOIN_RING_MIN`` bytes or more): a ring
  of slots in a segment the member makes (:mod:`.state_ring`).
* **Network**: one frame per unit over the connection, into the receives the joiner posted
  before its ``GO``.

The joiner's ``GO`` says which it can take (its host, whether it takes shared memory and
whether it may read in place, and the random token that names the rings).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from ..errors import PeerLostError, TransportError
from ..transport.frames import Kind
from ..transport.matching import ignore_outcome
from .cma import address, cma_enabled, read_remote
from .route import READ, SHM, Switches, state_route
from .shm import host_hash
from .state_digest import INLINE_BYTES, Digest, pool, units
from .state_ring import Ring, Unit, chunks

__all__ = ["GO", "HEADER", "READY", "give", "go_frame", "take_all"]

log = logging.getLogger("asynccoll.comm")

# tags on a handle's joining channel
READY, HEADER, _STRIPE, GO, _PLAN, _FILLED, _FREED, _DONE = range(8)
_NOTHING = memoryview(b"")
_YES, _NO, _FAILED = b"\x01", b"\x00", b"\x02"  # a read in place's verdicts
_warned: set[str] = set()  # the one warning per process and kind
_pid = os.getpid  # the process a member offers to be read in (a test names another here)


def go_frame(token: int, switches: Switches) -> bytes:
    """The joiner's ``GO`` (module doc): its host, the rings' ``token``, what it takes."""
    out: bytes = msgpack.packb({"host": host_hash(), "token": token, "shm": switches.shm,
                                "read": switches.cma and cma_enabled()})
    return out


async def give(t: Any, sid: int, r: int, first: int, views: list[Any], mine: list[Unit],
               go: dict[str, Any] | None, switches: Switches) -> None:
    """A member's units ``mine`` of ``views`` (:func:`.state_digest.units`) to joiner ``r``
    once it said ``go`` (on the runtime's loop), by the path :func:`~.route.state_route`
    chooses from the joiner's host and ask, the stripe's size and this member's ``switches``
    (module doc); ``go`` None: a small stripe sent over the connection without waiting for it
    (:func:`.joining.admit_sent`). Returns once the joiner has the stripe (read in place,
    ring) or it is on the wire (network)."""
    nbytes = sum(hi - lo for _, lo, hi in mine)
    plan = 0  # the number of the PLAN frame this member sends next
    route = None
    if go is not None:
        host, shm = int(go.get("host", -1)), bool(go.get("shm"))
        route = state_route(switches, host_hash(), host, nbytes, shm, read=bool(go.get("read")))
        if route == READ:
            if await _lend(t, sid, r, views):
                return
            plan, route = 1, state_route(switches, host_hash(), host, nbytes, shm)
    ring = None
    if go is not None and route == SHM:
        try:
            ring = Ring.create(Ring.path(int(go["token"]), sid, t.rank, first), mine)
        except (OSError, ValueError) as exc:
            _warn_once("segment", f"rank {t.rank}: the state for joining rank {r} goes over "
                       f"the network: no shared-memory segment ({exc})")
    if ring is None:
        futs = [t.post_frame(r, int(Kind.DATA), sid, plan, _PLAN, msgpack.packb({}))]
        futs += [t.post_frame(r, int(Kind.DATA), sid, k, _STRIPE, views[j][lo:hi])
                 for k, (j, lo, hi) in enumerate(mine)]
        await asyncio.gather(*futs)
        return
    freed = [t.post_recv(r, sid, k, _FREED) for k in range(len(chunks(mine, ring.slot)))]
    try:
        await t.post_frame(r, int(Kind.DATA), sid, plan, _PLAN,
                           msgpack.packb({"slot": ring.slot, "slots": ring.slots}))
        await ring.send(views, mine, lambda k: t.post_frame(r, int(Kind.DATA), sid, k, _FILLED,
                                                            _NOTHING), freed)
    finally:
        for f in freed:
            f.cancel()
        ring.close()


async def _lend(t: Any, sid: int, r: int, views: list[Any]) -> bool:
    """The member's side of a read in place: ``PLAN`` with this process's id, the addresses
    of ``views`` and of a marker of random bytes (which the joiner reads first: a pid that
    names another process, as from another pid namespace on a host that looks the same, then
    reads no marker), then wait for the joiner's verdict (its ``DONE``): True when it read the
    whole stripe, False when it could not read (the member sends it another way). Raises
    :class:`~asynccoll.PeerLostError` naming the joiner when its read failed part-way (its
    join fails: the admission goes on without it)."""
    nonce = secrets.token_bytes(16)
    mark = np.frombuffer(nonce, np.uint8).copy()  # (alive until the verdict)
    verdict = t.post_recv(r, sid, 0, _DONE)
    try:
        await t.post_frame(r, int(Kind.DATA), sid, 0, _PLAN, msgpack.packb(
            {"pid": _pid(), "addrs": [address(v) for v in views],
             "mark": address(mark), "nonce": nonce}))
        got = bytes((await verdict).payload[:1])
    finally:
        verdict.cancel()
    if got == _FAILED:
        raise PeerLostError(r, "its read of this rank's stripe failed part-way")
    return got == _YES


async def _read(t: Any, sid: int, src: int, plan: dict[str, Any], views: list[Any],
                mine: list[Unit], sums: Digest, may: bool) -> bool:
    """The joiner's side of a read in place from donor ``src`` (module doc): its marker
    first, then its units ``mine`` out of its process into ``views``, each hashed into
    ``sums`` as it lands, then the verdict. False (and ``NO`` said) when this joiner may not
    read (``may``: what its ``GO`` said) or the first read is refused, fails or finds no
    marker; a read that fails later says so (``FAILED``) and raises
    :class:`~asynccoll.TransportError`."""
    pid, there = int(plan["pid"]), [int(a) for a in plan["addrs"]]
    if len(there) != len(views):
        raise ValueError(f"rank {src} offered {len(there)} arrays to read; the state has "
                         f"{len(views)}")
    here = [address(v) for v in views]

    def say(verdict: bytes) -> None:
        t.post_frame(src, int(Kind.DATA), sid, 0, _DONE, verdict
                     ).add_done_callback(ignore_outcome)

    def probe() -> None:  # the marker, then the first unit (on an executor thread)
        nonce = bytes(plan.get("nonce", b""))
        got = np.zeros(len(nonce), np.uint8)
        read_remote(pid, int(plan.get("mark", 0)), address(got), got.size)
        if not nonce or got.tobytes() != nonce:
            raise OSError(f"process {pid} does not hold rank {src}'s marker (another process "
                          "of that number: a separate pid namespace?)")
        one(mine[0])

    def one(u: Unit) -> None:  # on an executor thread (the read and the hash release the GIL)
        j, lo, hi = u
        read_remote(pid, there[j] + lo, here[j] + lo, hi - lo)
        sums.take(u)

    loop = asyncio.get_running_loop()
    try:
        if not may:
            raise RuntimeError("this rank did not offer to read (ASYNCCOLL_CMA=0)")
        await loop.run_in_executor(None, probe)
    except (OSError, RuntimeError) as exc:  # (ProcessLookupError too: an OSError)
        _warn_once("read", f"rank {t.rank}: cannot read the state out of rank {src}'s memory "
                   f"({exc}); it comes through a shared-memory ring or over the network")
        say(_NO)
        return False

    async def lane(us: Sequence[Unit]) -> None:
        for u in us:
            await loop.run_in_executor(None, one, u)

    try:
        await _all([lane(mine[1 + k::2]) for k in range(2)])
    except (OSError, RuntimeError) as exc:
        say(_FAILED)
        if isinstance(exc, ProcessLookupError):
            raise PeerLostError(src, f"its process {pid} is gone") from exc
        raise TransportError(f"rank {t.rank}: reading rank {src}'s stripe out of its memory "
                             f"failed part-way: {exc}") from exc
    say(_YES)
    return True


async def take_all(t: Any, sid: int, donors: list[int], first: int, views: list[Any],
                   token: int, sums: Digest, switches: Switches) -> dict[str, list[int]]:
    """The joiner's step 4 on the runtime's loop: post every receive (each donor's ``PLAN``
    and its units, into the state's arrays), then ``GO`` to every donor (:func:`go_frame`),
    then take each donor's part by the path its ``PLAN`` names (module doc), hashing each unit
    as soon as it is in. Returns the donors by path: ``{"read": [...], "ring": [...],
    "network": [...]}``."""
    d = len(donors)
    by: dict[str, list[int]] = {"read": [], "ring": [], "network": []}
    go = go_frame(token, switches)
    sizes = [int(v.size) for v in views]
    parts = [units(sizes, i, d) for i in range(d)]
    plans = [t.post_recv(src, sid, 0, _PLAN) for src in donors]
    frames = [[t.post_recv(src, sid, k, _STRIPE, views[j][lo:hi])
               for k, (j, lo, hi) in enumerate(parts[i])] for i, src in enumerate(donors)]
    for src in donors:
        t.post_frame(src, int(Kind.DATA), sid, 0, GO, go).add_done_callback(ignore_outcome)
    loop = asyncio.get_running_loop()

    async def hashed(f: asyncio.Future[Any], u: Unit) -> None:
        await f
        if u[2] - u[1] <= INLINE_BYTES:
            sums.take(u)  # (on the loop: a thread's hand-off would cost more)
        else:
            await loop.run_in_executor(pool(), sums.take, u)

    async def take(i: int, src: int) -> None:
        plan = msgpack.unpackb(bytes((await plans[i]).payload))
        if "pid" in plan:
            if await _read(t, sid, src, plan, views, parts[i], sums,
                           switches.cma and cma_enabled()):
                for f in frames[i]:
                    f.cancel()
                by["read"].append(src)
                return
            again = t.post_recv(src, sid, 1, _PLAN)  # (held by the matcher if it came)
            plans.append(again)
            plan = msgpack.unpackb(bytes((await again).payload))
        if not plan.get("slot"):
            await asyncio.gather(*(hashed(f, u) for f, u in zip(frames[i], parts[i],
                                                                strict=True)))
            by["network"].append(src)
            return
        for f in frames[i]:
            f.cancel()
        by["ring"].append(src)
        ring = Ring.attach(Ring.path(token, sid, src, first), int(plan["slot"]),
                           int(plan["slots"]))
        filled = [t.post_recv(src, sid, k, _FILLED)
                  for k in range(len(chunks(parts[i], ring.slot)))]

        def freed(k: int) -> None:
            t.post_frame(src, int(Kind.DATA), sid, k, _FREED, _NOTHING
                         ).add_done_callback(ignore_outcome)

        try:
            await ring.receive(views, parts[i], filled, freed, sums.take)
        finally:
            for f in filled:
                f.cancel()
            ring.close()

    try:
        await _all([take(i, src) for i, src in enumerate(donors)])
    finally:
        for f in (*plans, *(f for fs in frames for f in fs)):
            f.cancel()
    return {k: sorted(v) for k, v in by.items()}


async def _all(coros: list[Any]) -> None:
    """Await every one of ``coros`` (each ends, whatever the others do: their ``finally``
    clean up), then raise the first error."""
    for res in await asyncio.gather(*coros, return_exceptions=True):
        if isinstance(res, BaseException):
            raise res


def _warn_once(kind: str, text: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning("%s", text)

