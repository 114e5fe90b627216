"""Exact accounting through a join, for tests/adversarial/test_rejoin.py: a bare solo partial
allreduce (sum accumulation) on 4 ranks where rank r contributes 1000**r per call; every 5 calls
the ranks flush and take back ready ranks (asynccoll.comm.joining.admit_ready). Rank 2 SIGKILLs
itself at call 8 on its first start; restarted, it joins the handle (join_handle) and goes on at
the members' call index. Each rank prints the sum of every result it received and its calls."""
import asyncio
import json
import os
import signal

import numpy as np

import asynccoll
from asynccoll import Accumulate, Solo
from asynccoll.comm.joining import Joiners, admit_ready, join_handle

CALLS = 60


async def main():
    restarted = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
    comm = await asynccoll.connect()
    rank = comm.rank
    x = np.full(4, 1000.0 ** rank)
    h = comm.partial_allreduce(Solo(), like=x, accumulate=Accumulate.SUM, name="count")
    watch = Joiners(comm.job, h.name)
    acc = np.zeros(4)
    calls, i = 0, 0
    if restarted:
        meta = await join_handle(h, comm)
        i = int(meta["i"]) + 1
    while i < CALLS:
        if rank == 2 and not restarted and i == 8:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(0.05 * (1 + rank % 2))
        r = await h(x)
        calls += 1
        acc += r.value
        if i % 5 == 4:
            f = await h.flush()
            acc += f.value
            await admit_ready(h, watch, meta={"i": i})
        i += 1
    f = await h.flush()
    acc += f.value
    print("COUNT " + json.dumps({"rank": rank, "restarted": restarted, "calls": calls,
                                 "acc": acc.tolist(), "size": f.world_size,
                                 "lost": sorted(f.lost)}), flush=True)
    await comm.close()

asyncio.run(main())
