"""A training job for tests/adversarial/test_rejoin.py: eager-SGD on 4 ranks; the ranks named in
VICTIMS SIGKILL themselves at step KILL_AT of N on their first start; under ``asynccoll run
--max-restarts`` they come back (ASYNCCOLL_RESTART) and join. With KILL_JOINING=s a first
restart SIGKILLs itself s seconds after it connected (while it joins). With CHURN=k, a rank
drawn from the step number SIGKILLs itself every CHURN_EVERY steps, k times (a restarted
process too, at steps after the one it joined at; with CHURN_DIR, once per step number; never
the last member, which the restarted ranks need to be taken back).
With OVERLAP=1 (and VICTIMS=2), losses overlap an admission: rank 3 SIGKILLs itself once rank
2's restart has connected, rank 2's restart learns that loss before it says it is ready, and
rank 1 SIGKILLs itself once rank 2 is taken back (a loss in the world rank 2 joined).
With MARK_DIR, a victim does not kill itself at KILL_AT: it touches MARK_DIR/at-RANK and waits
there for the test to SIGKILL its node (launcher and ranks; tests/launch/test_replacement_node.py).
With SYNC_EVERY=k the members sync every k steps; with KILL_IN_SYNC=1 a victim SIGKILLs itself
not at KILL_AT but as it enters its first sync event's parameter allreduce after it (the
survivors, in that allreduce, lose it inside the event's synchronous part).
With HOLD=k (tests/adversarial/test_grow.py) every rank trains past N until it trains with k
ranks (and 10 steps more), and a victim kills itself at the first step from KILL_AT on where it
does.
Every rank prints one FINAL line with its global step and a digest of its parameters."""
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


def _first_kill_at(step):
    """Whether no process killed itself at ``step`` before (with CHURN_DIR: a restarted process
    whose predecessor died at ``step`` may reach it again, having joined at an earlier global
    step; one kill per step number keeps the count of kills, and so of restarts, exact)."""
    d = os.environ.get("CHURN_DIR")
    if not d:
        return True
    try:
        os.close(os.open(os.path.join(d, f"kill-{step}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def optimizer(comm, w0):
    import inspect
    if "policy" not in inspect.signature(EagerSGD.__init__).parameters:  # before policies
        return EagerSGD(comm, w0, 0.1, POLICY, momentum=0.5,  # were values
                        quorum=3 if POLICY == "quorum" else None)
    from asynccoll import Majority, Quorum, Solo
    policy = {"solo": Solo(), "majority": Majority(), "quorum": Quorum(3)}[POLICY]
    every = os.environ.get("SYNC_EVERY")
    return EagerSGD(comm, w0, 0.1, policy, momentum=0.5,
                    sync_every=int(every) if every else None)


def die_in_sync_allreduce(opt):
    """Once past KILL_AT: SIGKILL this process as it enters the next sync event's allreduce
    (the one over the sync buffer; started, its part could reach the others before the kill:
    they would complete it and learn of the loss after the event)."""
    from asynccoll.comm.communicator import Communicator
    allreduce = Communicator.allreduce

    async def dying(self, x, *args, **kwargs):
        if x is opt._sync_buf and opt.step_count >= KILL_AT:
            print(f"rank {opt.comm.rank} dies in its sync event's allreduce", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return await allreduce(self, x, *args, **kwargs)

    Communicator.allreduce = dying


async def main():
    restarted = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
    comm = await asynccoll.connect()
    rank = comm.rank
    if restarted == 1 and os.environ.get("KILL_JOINING"):
        # killed again while it joins: after it said it is ready, before the state is in
        import threading
        delay = float(os.environ["KILL_JOINING"])
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    w0 = np.zeros(1000, np.float32)
    target = np.linspace(-1, 1, 1000, dtype=np.float32) * (rank + 1)
    opt = optimizer(comm, w0)
    in_sync = os.environ.get("KILL_IN_SYNC") == "1"
    if in_sync and rank in VICTIMS and not restarted:
        die_in_sync_allreduce(opt)
    t0 = time.time()
    joined = None
    churn = int(os.environ.get("CHURN", "0"))  # kills: one every CHURN_EVERY steps
    every = int(os.environ.get("CHURN_EVERY", "25"))
    first = None  # this process's first global step
    overlap = os.environ.get("OVERLAP") == "1"
    if overlap and restarted == 1 and rank == 2:
        # connected, not yet ready: learn a loss (rank 3's) before the members take it back
        learned, loop = asyncio.Event(), asyncio.get_running_loop()
        comm.in_runtime(lambda: comm.membership.listeners.append(
            lambda r: loop.call_soon_threadsafe(learned.set)))
        if comm.membership.gone:
            learned.set()
        await asyncio.wait_for(learned.wait(), 30)
        print(f"rank 2 learned {sorted(comm.membership.gone)} lost before it joined", flush=True)
    hold = int(os.environ.get("HOLD", "0"))  # (test_grow: a job grown to HOLD ranks)
    grew_at = None  # the first step trained with HOLD ranks: 10 more at least (a loss then is
    while opt.step_count < N or opt.world_size < hold or (  # recovered before they end)
            hold and (grew_at is None or opt.step_count < grew_at + 10)):
        if hold and grew_at is None and opt.world_size >= hold:
            grew_at = opt.step_count
        if overlap and not restarted:
            if rank == 3 and 2 in comm.membership.rejoined:  # rank 2's restart connected
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 1 and opt._comm_now().members == (0, 1, 2):  # 2 back, 3 not yet:
                os.kill(os.getpid(), signal.SIGKILL)  # a loss in the world 2 joined
        at = opt.step_count == KILL_AT if not hold else \
            opt.step_count >= KILL_AT and opt.world_size >= hold  # once the job grew
        if rank in VICTIMS and not restarted and at and not in_sync:
            if os.environ.get("MARK_DIR"):  # the test kills this rank's whole node
                mark = os.path.join(os.environ["MARK_DIR"], f"at-{rank}")
                os.close(os.open(mark, os.O_CREAT | os.O_WRONLY))
                await asyncio.sleep(3600)
            os.kill(os.getpid(), signal.SIGKILL)
        s = opt.step_count
        if churn and first is not None and s > first and s % every == 0 and s // every <= churn \
                and int(hashlib.sha256(f"{s}".encode()).hexdigest(), 16) % 4 == rank \
                and opt.world_size > 1 and _first_kill_at(s):
            print(f"CHURN kill rank {rank} at step {s}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        g = (opt.params - target) * 0.5
        info = await opt.step(g)
        if first is None:
            first = opt.step_count  # (a restarted process: the step it joined at)
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
