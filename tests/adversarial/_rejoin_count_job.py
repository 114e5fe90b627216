"""Exact accounting through a join, for tests/adversarial/test_rejoin.py: a bare solo partial
allreduce (sum accumulation) on 4 ranks where rank r contributes 1000**r per call; every 5 calls
the ranks flush and take back ready ranks (asynccoll.comm.joining.admit_ready). Rank 2 SIGKILLs
itself at call 8 on its first start; restarted, it joins the handle (join_handle) and goes on at
the members' call index. Each rank prints the sum of every result it received and its calls.

With CHURN_DIR (churn): no kill at call 8; instead, every CHURN_EVERY calls one of ranks 1-3,
drawn from the call index, SIGKILLs itself (once per call index: a marker file in CHURN_DIR), a
restarted process too, for CALLS calls; before it dies it writes its calls to
CHURN_DIR/dead-RANK-RESTART. Rank 0 is never killed: the sum of every result it received is the
job's whole account.

For tests/adversarial/test_grow.py: VICTIM=-1 kills nobody, HOLD=k makes every rank call on past
CALLS until its handle spans k ranks, and a process given a vacant rank (``comm.joined`` on its
first start) joins as a restarted one does."""
import asyncio
import json
import os
import signal

import numpy as np

import asynccoll
from asynccoll import Accumulate, Solo
from asynccoll.comm.joining import Joiners, admit_ready, join_handle

CALLS = int(os.environ.get("CALLS", "60"))
CHURN_DIR = os.environ.get("CHURN_DIR")
EVERY = int(os.environ.get("CHURN_EVERY", "20"))
VICTIM = int(os.environ.get("VICTIM", "2"))
HOLD = int(os.environ.get("HOLD", "0"))


def _dies_at(rank, i):
    """Whether ``rank`` kills itself at call ``i`` (once per call index across processes)."""
    if CHURN_DIR is None:
        return False
    if i % EVERY != EVERY // 2 or i > CALLS - 3 * EVERY or rank != 1 + (i * 7919) % 3:
        return False
    try:
        os.close(os.open(os.path.join(CHURN_DIR, f"kill-{i}"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _record_death(rank, restarted, calls):
    """How many calls this process made, for the account (bench/churn_account.py)."""
    with open(os.path.join(CHURN_DIR, f"dead-{rank}-{restarted}"), "w") as f:
        f.write(str(calls))


async def main():
    restarted = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
    comm = await asynccoll.connect()
    rank = comm.rank
    x = np.full(4, 1000.0 ** rank)
    h = comm.partial_allreduce(Solo(), like=x, accumulate=Accumulate.SUM, name="count")
    watch = Joiners(comm.job, h.name)
    acc = np.zeros(4)
    calls, i = 0, 0
    if restarted or comm.joined:
        meta = await join_handle(h, comm)
        i = int(meta["i"]) + 1
        print(f"JOINED rank {rank} at call {i}", flush=True)
    while i < CALLS or h.world_size < HOLD:
        if (rank == VICTIM and not restarted and i == 8 and CHURN_DIR is None) or _dies_at(rank, i):
            if CHURN_DIR is not None:
                _record_death(rank, restarted, calls)
            print(f"CHURN kill rank {rank} at call {i}", flush=True)
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
