"""CPU and wall per partial (solo) allreduce call over tcp, P ranks on this host.

    PYTHONPATH=<tree> python pcpu.py P SIZE_BYTES CALLS [profile_dir]
Prints per rank: wall per call (median), CPU s per call (process, all threads)."""
import asyncio
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import time

import numpy as np


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def csw():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw + r.ru_nivcsw

async def rank_main(rank, P, port, size, calls, prof):
    import asynccoll
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=120,
                                   progress=os.environ.get("PROG", "thread"))
    async with comm:
        x = np.full(size // 4, rank + 1, np.float32)
        try:
            h = comm.partial_allreduce(os.environ.get("KIND","solo"), like=x, name="b")
        except TypeError:
            h = comm.partial_allreduce(os.environ.get("KIND","solo"), like=x, name="b")
        walls = []
        for _ in range(int(os.environ.get("WARM", "20"))):
            await comm.barrier(timeout=60)
            await h(x, timeout=60, out=x)
        pr = None
        if prof:
            import cProfile
            pr = cProfile.Profile()
            pr.enable()
        c0, s0 = cpu(), csw()
        for _ in range(calls):
            x[...] = rank + 1
            await comm.barrier(timeout=60)
            t0 = time.perf_counter()
            await h(x, timeout=60, out=x)
            walls.append(time.perf_counter() - t0)
        c1, s1 = cpu(), csw()
        if rank in (0, P - 1):
            print(f"rank {rank} ctxsw/call {(s1 - s0) / calls:.1f}", file=sys.stderr)
        if pr:
            pr.disable()
            pr.dump_stats(f"{prof}/rank{rank}.prof")
        await h.flush(timeout=60)
        await h.close()
        await comm.barrier(timeout=60)
    return statistics.median(walls), (c1 - c0) / calls

def child(rank, P, port, size, calls, prof, q):
    import gc
    if os.environ.get("NOGC"):
        gc.disable()
    gcs = {"n": 0, "t": 0.0, "t0": 0.0}
    def cb(phase, info):
        if phase == "start":
            gcs["t0"] = time.perf_counter()
        else:
            gcs["n"] += 1
            gcs["t"] += time.perf_counter() - gcs["t0"]
    gc.callbacks.append(cb)
    if os.environ.get("GCSTAT") and rank == 0:
        import atexit
        atexit.register(lambda: print(f"rank0 gc {gcs['n']} collections "
                                      f"{gcs['t'] * 1e3:.1f} ms", file=sys.stderr))
    os.environ["ASYNCCOLL_SECRET"] = "x" * 32
    os.environ["ASYNCCOLL_SHM"] = "0"
    q.put((rank, asyncio.run(rank_main(rank, P, port, size, calls, prof))))

if __name__ == "__main__":
    P, size, calls = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    prof = sys.argv[4] if len(sys.argv) > 4 else ""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=child, args=(r, P, port, size, calls, prof, q)) for r in range(P)]
    for p in ps:
        p.start()
    res = dict(q.get(timeout=600) for _ in ps)
    for p in ps:
        p.join()
    w = [res[r][0] * 1e3 for r in range(P)]
    c = [res[r][1] * 1e3 for r in range(P)]
    print(f"wall ms/call {max(w):.2f} (ranks {[round(v,2) for v in w]}), cpu ms/call "
          f"sum {sum(c):.2f} (ranks {[round(v,2) for v in c]})")
