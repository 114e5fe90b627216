"""A training job for tests/adversarial/test_rejoin.py: eager-SGD on 4 ranks; the ranks named in
VICTIMS SIGKILL themselves at step KILL_AT of N on their first start; under ``asynccoll run
--max-restarts`` they come back (ASYNCCOLL_RESTART) and join. Every rank prints one FINAL line
with its global step and a digest of its parameters."""
import asyncio
import hashlib
import os
import signal
import time

import numpy as np

import asynccoll
from asynccoll import EagerSGD

N, KILL_AT = int(os.environ.get("N", 60)), int(os.environ.get("KILL_AT", 10))
VICTIMS = [int(v) for v in os.environ.get("VICTIMS", "2").split(",")]
POLICY = os.environ.get("POLICY", "solo")


def optimizer(comm, w0):
    import inspect
    if "policy" not in inspect.signature(EagerSGD.__init__).parameters:  # before policies
        return EagerSGD(comm, w0, 0.1, POLICY, momentum=0.5,  # were values
                        quorum=3 if POLICY == "quorum" else None)
    from asynccoll import Majority, Quorum, Solo
    policy = {"solo": Solo(), "majority": Majority(), "quorum": Quorum(3)}[POLICY]
    return EagerSGD(comm, w0, 0.1, policy, momentum=0.5)


async def main():
    restarted = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
    comm = await asynccoll.connect()
    rank = comm.rank
    w0 = np.zeros(1000, np.float32)
    target = np.linspace(-1, 1, 1000, dtype=np.float32) * (rank + 1)
    opt = optimizer(comm, w0)
    t0 = time.time()
    joined = None
    while opt.step_count < N:
        if rank in VICTIMS and not restarted and opt.step_count == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        g = (opt.params - target) * 0.5
        info = await opt.step(g)
        if info.joined:
            joined = opt.step_count
            print(f"rank {rank} joined at step {joined}", flush=True)
        await asyncio.sleep(float(os.environ.get("STEP_S", 0.08)) * (1 + rank % 2))
    await opt.finish()
    d = hashlib.sha256(opt.params.tobytes()).hexdigest()[:16]
    print(f"FINAL rank={rank} steps={opt.step_count} digest={d} restarted={restarted} "
          f"t={time.time() - t0:.2f}", flush=True)
    await comm.close()

asyncio.run(main())
