"""A job for tests/adversarial/test_rejoin_mismatch.py: eager-SGD on 4 ranks, rank 2
SIGKILLs itself at step 10 (of 80) and is restarted; rank 1's digest of the state it admits
with is made wrong (``joining.digest`` wrapped on rank 1 only, as if its replica drifted).
Every rank must raise StateMismatchError: the joiner in its joining step, the members at
their next sync event (the digests' comparison goes on while they step:
``joining.admit_sent``). Each rank prints one line, ``MISMATCH rank=R restarted=K
syncs=S`` or ``NO-MISMATCH rank=R``, then leaves."""
import asyncio
import os
import signal

import numpy as np

import asynccoll
from asynccoll import EagerSGD, Solo
from asynccoll.comm import joining


async def main():
    restarted = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
    comm = await asynccoll.connect(collective_timeout=30)
    rank = comm.rank
    if rank == 1:
        real = joining.digest
        joining.digest = lambda state, parts=1: real(state, parts) ^ 1
    opt = EagerSGD(comm, np.zeros(1000, np.float32), 0.1, Solo(), momentum=0.5,
                   sync_every=4, timeout=30)
    target = np.linspace(-1, 1, 1000, dtype=np.float32)
    try:
        while opt.step_count < 80:
            if rank == 2 and not restarted and opt.step_count == 10:
                os.kill(os.getpid(), signal.SIGKILL)
            await opt.step((opt.params - target) * 0.5)
            await asyncio.sleep(0.08)
        await opt.finish()
    except joining.StateMismatchError as exc:
        print(f"MISMATCH rank={rank} restarted={restarted} syncs={opt.syncs}: {exc}",
              flush=True)
        os._exit(0)  # the others left too: no collective close
    print(f"NO-MISMATCH rank={rank}", flush=True)
    await comm.close()

asyncio.run(main())
