"""Members that end while a restarted rank waits to be taken back, for
tests/adversarial/test_rejoin.py: a bare solo partial allreduce on 4 ranks; rank 2 SIGKILLs
itself at call 5 on its first start. Restarted, it says it is ready to join
(:func:`asynccoll.comm.joining.join_handle`, a 60 s timeout), prints how that ended and
raises what it raised. The
members call until they learn it is ready, then flush, print, and close without ever taking it
back (as a job whose last step came first)."""
import asyncio
import os
import signal
import time

import numpy as np

import asynccoll
from asynccoll import Solo
from asynccoll.comm.joining import Joiners, join_handle


async def main():
    restarted = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
    comm = await asynccoll.connect(collective_timeout=60)
    x = np.ones(4)
    h = comm.partial_allreduce(Solo(), like=x, name="late")
    if restarted:
        t0 = time.monotonic()
        try:
            await join_handle(h, comm, [np.zeros(8)], timeout=60)
            print("LATE joined", flush=True)
        except asynccoll.PeerLostError as exc:
            print(f"LATE gave up after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
            raise  # (as a training script would: the launcher ends the job without it)
    watch = Joiners(comm.job, h.name)
    i, deadline = 0, time.monotonic() + 60
    while not (h.communicator is not None and watch.waiting(h.communicator.members)):
        if comm.rank == 2 and i == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        if time.monotonic() > deadline:
            raise TimeoutError("rank 2's restart never said it was ready")
        await h(x)
        await asyncio.sleep(0.05)
        i += 1
    await h.flush()
    print(f"MEMBER {comm.rank} ends with rank 2's restart waiting", flush=True)
    await comm.close()

asyncio.run(main())
