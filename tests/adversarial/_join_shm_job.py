"""The state of a join through shared memory, for tests/adversarial/test_join_shm.py: a bare
solo partial allreduce on 4 ranks and a state of two uint32 arrays (``STATE_BYTES`` together)
that every member holds equal; every 5 calls the ranks flush and take back ready ranks
(:func:`asynccoll.comm.joining.admit_ready` with the state). Rank ``VICTIM`` SIGKILLs itself
at call 8 on its first start; restarted, it joins (:func:`~asynccoll.comm.joining.join_handle`,
receiving the state into arrays of zeros) and goes on at the members' call index. The restart
numbered ``DIE_IN`` (0: none) SIGKILLs itself mid-transfer: at ``DIE_AT=attach``, before it maps
the first donor's ring (the donors' segments exist, unmapped), or ``DIE_AT=chunk``, once it
copied the first chunk out of a ring, or ``DIE_AT=read``, once it read the first unit out of a
donor's memory (the path taken by default on one host; the rings with ``ASYNCCOLL_CMA=0``).
With ``NO_READ`` set, the restarted process's reads of the donors' memory are refused, as a
kernel whose Yama ``ptrace_scope`` forbids them refuses (the donors' fallback to the rings).
With ``WRONG_PID`` set, every member offers its parent's process id (the launcher's: another
process of the same user, as a pid from another pid namespace would name) for the joiner to
read its stripe in. With ``NO_ROOM`` set, no member can make a ring's segment
(as in a full tmpfs). The ring is taken from 1 MiB stripes (``ASYNCCOLL_JOIN_RING_MIN``;
128 MiB by default). A member prints whether each ring it closed is gone from the directory
when it did. The members call until the restarts they expect were
admitted (at least 40 calls). Each rank prints its world size and a hash of its state
at the end."""
import asyncio
import hashlib
import json
import os
import signal

import numpy as np

import asynccoll
from asynccoll import Solo
from asynccoll.comm import state_ring, state_send
from asynccoll.comm.joining import Joiners, admit_ready, join_handle

CALLS = 40
RESTART = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
VICTIM = int(os.environ.get("VICTIM", "2"))
DIE_IN = int(os.environ.get("DIE_IN", "0"))
N = int(os.environ.get("STATE_BYTES", str(48 << 20))) // 8


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_mid_transfer(where: str) -> None:
    ring = state_ring.Ring
    if where == "read":
        read, done = state_send.read_remote, []

        def reading(*args):  # a donor's marker and first unit read, then dead
            if len(done) == 2:
                die()
            read(*args)
            done.append(1)
        state_send.read_remote = reading
        return
    if where == "attach":
        def attach(*args):  # the first donor's ring is there, not mapped yet
            die()
        ring.attach = attach
        return
    receive = ring.receive

    async def dying(self, views, units, filled, freed, then):
        def freed_then_die(k):
            freed(k)
            die()
        await receive(self, views, units, filled, freed_then_die, then)

    ring.receive = dying


def report_ring_closes(rank: int) -> None:
    """A member prints, for each ring it closes, whether its file is gone by then (its own
    unlink, not the launcher's at the job's end)."""
    close = state_ring.Ring.close

    def closing(self):
        close(self)
        print(f"RING rank={rank} gone={not os.path.exists(self.seg.path)}", flush=True)

    state_ring.Ring.close = closing


def no_room_for_rings() -> None:
    """Every ring's segment fails as in a full tmpfs (the members' fallback to the network)."""
    class Full(state_ring.Segment):
        @classmethod
        def create(cls, path, nbytes):
            raise OSError(28, f"not enough shared memory for a {nbytes}-byte segment")

    state_ring.Segment = Full


def no_reads() -> None:
    """Every read of a donor's memory refused, as under Yama's ``ptrace_scope`` 1 or more."""
    def refused(pid, *args):
        raise PermissionError(1, f"reading process {pid}: Operation not permitted")

    state_send.read_remote = refused


async def main():
    # the ring for this test's 16 MiB stripes (default: 128 MiB; read once, by connect())
    os.environ["ASYNCCOLL_JOIN_RING_MIN"] = str(1 << 20)
    comm = await asynccoll.connect(collective_timeout=60)
    rank = comm.rank
    x = np.ones(4)
    h = comm.partial_allreduce(Solo(), like=x, name="state")
    watch = Joiners(comm.job, h.name)
    if RESTART:  # a model built afresh: its pages touched, its values not the members'
        state = [np.zeros(N, np.uint32), np.zeros(N, np.uint32)]
    else:
        state = [np.arange(N, dtype=np.uint32), np.arange(N, 0, -1, dtype=np.uint32)]
    # the members go on until the restarts they expect were admitted (every member sees the
    # same admissions: they are agreed), at least CALLS calls
    expected, admissions = (2 if DIE_IN else 1), 0
    i = 0
    if not RESTART:
        report_ring_closes(rank)
        if os.environ.get("WRONG_PID"):
            state_send._pid = os.getppid
        if os.environ.get("NO_ROOM"):
            no_room_for_rings()
    if RESTART:
        if os.environ.get("NO_READ"):
            no_reads()
        if RESTART == DIE_IN:
            die_mid_transfer(os.environ["DIE_AT"])
        meta = await join_handle(h, comm, state, timeout=60)
        i = int(meta["i"]) + 1
    while i < CALLS or (not RESTART and admissions < expected):
        if rank == VICTIM and not RESTART and i == 8:
            die()
        await asyncio.sleep(0.05)
        await h(x)
        if i % 5 == 4:
            await h.flush()
            admissions += len(await admit_ready(h, watch, state, meta={"i": i}, timeout=60))
        i += 1
    f = await h.flush()
    digest = hashlib.sha256(b"".join(a.tobytes() for a in state)).hexdigest()[:16]
    print("FINAL " + json.dumps({"rank": rank, "restarted": RESTART, "size": f.world_size,
                                 "digest": digest}), flush=True)
    await comm.close()

asyncio.run(main())
