"""Exact accounting through a join in a sparse partial handle, for
tests/adversarial/test_rejoin_sparse.py: a solo partial allreduce of SparseVectors (sum
accumulation, ``POLICY``; ``SHM=1``: the split allgather, through shared memory until the
loss, else over the network) on 4 ranks under ``asynccoll run --max-failures 1
--max-restarts 1``. Rank r sends ``1000**r`` at index 0 (shared by every rank) and at its own
index ``1 + r``; every 5 calls the ranks flush and take back ready ranks
(:func:`asynccoll.comm.joining.admit_ready`); they stop at such a boundary once they made
``CALLS`` calls and took rank 2 back (agreed: the same boundary on every rank). Rank 2 SIGKILLs
itself at call 8 on its first start; restarted, it joins the handle
(:func:`~asynccoll.comm.joining.join_handle`) and goes on at the members' call index. Each
rank prints the dense sum of every result it received (flush included), its calls, the ranks
its results reported lost, the last result's world, and how many segments were in
``ASYNCCOLL_SHM_DIR`` once its handle was made. With ``WANT=k`` (tests/adversarial/test_grow.py)
nobody is killed, a process given a vacant rank joins as a restarted one does, and the ranks
stop once their handle spans k ranks (instead of once rank 2 is back)."""
import asyncio
import json
import os
import signal

import numpy as np

import asynccoll
from asynccoll import Accumulate, SparseVector
from asynccoll.comm.joining import Joiners, admit_ready, join_handle

CALLS, N = 60, 16
WANT = int(os.environ.get("WANT", "0"))


class Tally:
    """The dense sum of every result taken, and the ranks they reported lost."""

    def __init__(self):
        self.acc, self.lost = np.zeros(N), set()

    def take(self, res):
        v = res.value
        self.acc += v.to_dense() if isinstance(v, SparseVector) else v
        self.lost |= set(res.lost)
        return res


def done(i, back):
    """Whether the ranks stop at the flush boundary after call ``i`` (every rank alike)."""
    return (i + 1 >= CALLS and back) or i > 40 * CALLS


async def main():
    restarted = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
    comm = await asynccoll.connect()
    rank = comm.rank
    like = SparseVector(np.empty(0, np.int32), np.empty(0, np.float64), N)
    h = comm.partial_allreduce(os.environ.get("POLICY", "solo"), like,
                               accumulate=Accumulate.SUM, name="sparse-count",
                               path=asynccoll.DataPath(algorithm="ssar_split_allgather")
                               if os.environ.get("SHM") == "1"
                               else asynccoll.DataPath(shm=False))
    watch = Joiners(comm.job, h.name)
    segs = len(os.listdir(os.environ["ASYNCCOLL_SHM_DIR"]))  # this rank's, made at creation
    x = SparseVector(np.array([0, 1 + rank], np.int32), np.full(2, 1000.0 ** rank), N)
    tally, calls, i, back, stop = Tally(), 0, 0, False, False
    if restarted or comm.joined:  # taken back at the members' boundary i: it stops there if
        i = int((await join_handle(h, comm))["i"])  # they do
        back = h.world_size >= WANT
        stop = done(i, back)
        i += 1
    while not stop:
        if (rank, restarted, i) == (2, 0, 8) and not WANT:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(0.05 * (1 + rank % 2))
        tally.take(await h(x))
        calls += 1
        if i % 5 == 4:  # a flush boundary: ready ranks are taken back
            tally.take(await h.flush())
            back = bool(await admit_ready(h, watch, meta={"i": i})) or back
            if WANT:
                back = h.world_size >= WANT
            stop = done(i, back)
        i += 1
    f = tally.take(await h.flush())
    print("COUNT " + json.dumps({"rank": rank, "restarted": restarted, "calls": calls,
                                 "acc": tally.acc.tolist(), "size": f.world_size,
                                 "seen_lost": sorted(tally.lost), "lost": sorted(f.lost),
                                 "segments": segs}), flush=True)
    await comm.close()

asyncio.run(main())
