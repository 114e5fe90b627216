"""``asynccoll sim calibrate``: measure this machine's cost model and write a profile.

What is measured (about 10 s per transport on a 2-core machine):

* ``gamma``, the per-op CPU cost: the real executor runs a dense allreduce schedule of P = 8
  ranks over the in-process transport (no wire), and the time per op fired is the CPU an op
  costs (posting, matching, completion, the kernel call for a 4-byte reduction);
* ``reduce_bps``: ``np.add`` of two 16 MiB float32 arrays into one, bytes of output per second;
* ``alpha``, ``beta`` per transport (``tcp``; ``ucx`` when ucxx imports): two processes
  (spawned) connect through the rendezvous and time 4-byte and 4 MiB allreduces; P = 2
  recursive doubling is one exchange, so ``T(n) = alpha + 3 gamma + n beta + n / reduce_bps``
  on the path an allreduce takes, which gives ``alpha`` and ``beta``; measured twice, with
  the progress thread and inline, the difference is the call's thread hop (``call_overhead``).

Both link classes get the measured figures (every rank of this machine shares one host, so the
inter-host class is a stand-in until calibrated on two hosts). ``cores`` is the machine's CPU
count and ``ranks_per_host`` is left at 1: the simulation sets it to the number of ranks it
places on the host (``bench/sim_validate.py`` does).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any

import numpy as np

from .cost import LinkClass, Profile

__all__ = ["available_transports", "calibrate", "measure_gamma", "measure_reduce"]

_SECRET = "asynccoll-sim-calibration-secret-0123456789"


def measure_reduce(nbytes: int = 16 << 20, reps: int = 5) -> float:
    """Bytes of output per second of ``np.add`` into a preallocated array (median)."""
    n = nbytes // 4
    a, b, out = np.ones(n, np.float32), np.ones(n, np.float32), np.empty(n, np.float32)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        np.add(a, b, out=out)
        ts.append(time.perf_counter() - t)
    return float(nbytes / np.median(ts))


def measure_gamma(world_size: int = 8, executions: int = 30) -> float:
    """Seconds of CPU per op of the real executor (inproc, 4-byte allreduce; median of 3)."""
    from ..collectives import KERNELS
    from ..collectives.dense import allreduce, scratch_buffers
    from ..sched import Executor
    from ..transport.inproc import InprocFabric, InprocTransport

    scheds = [allreduce(r, world_size, 1, "float32") for r in range(world_size)]
    bufs = [{"data": np.zeros(1, np.float32), **scratch_buffers(s)} for s in scheds]
    ops = sum(len(s.ops) for s in scheds) * executions

    async def run(ts: list[InprocTransport], sched_id: int, n: int) -> None:
        exs = [Executor(s, t, b, sched_id=sched_id, kernels=KERNELS)
               for s, t, b in zip(scheds, ts, bufs, strict=True)]
        for _ in range(n):
            await asyncio.gather(*(ex.start() for ex in exs))

    async def go() -> float:
        # an in-process world (the engine's cost alone, no sockets)
        fabric = InprocFabric(f"calibrate-{time.monotonic_ns()}")
        ts = [InprocTransport(r, world_size, fabric=fabric) for r in range(world_size)]
        addrs = {r: await t.listen() for r, t in enumerate(ts)}
        try:
            for t in ts:
                await t.connect({r: a for r, a in addrs.items() if r != t.rank})
            await run(ts, 1, 2)
            t0 = time.perf_counter()
            await run(ts, 2, executions)
            return time.perf_counter() - t0
        finally:
            for t in ts:
                await t.close()

    return float(np.median([asyncio.run(go()) for _ in range(3)]) / ops)


def _child(rank: int, port: int, progress: str, transport: str, sizes: list[int],
           calls: int, q: Any) -> None:
    try:
        os.environ["ASYNCCOLL_SECRET"] = _SECRET
        import asynccoll

        async def main() -> dict[int, float]:
            comm = await asynccoll.connect(rank=rank, world_size=2, store=f"127.0.0.1:{port}",
                                           transport=transport, progress=progress,
                                           timeout=60)
            out: dict[int, float] = {}
            async with comm:
                for n in sizes:
                    x = np.ones(max(1, n // 4), np.float32)
                    ts = []
                    for i in range(calls + 3):
                        await comm.barrier(timeout=30)
                        t = time.perf_counter()
                        await comm.allreduce(x, out=x, timeout=30)
                        if i >= 3:
                            ts.append(time.perf_counter() - t)
                    out[n] = float(np.median(ts))
                await comm.barrier(timeout=30)
            return out

        q.put((rank, "ok", asyncio.run(main())))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def _pair(progress: str, transport: str, sizes: list[int], calls: int,
          timeout: float = 60.0) -> dict[int, float]:
    """Median allreduce time per size between two spawned processes (rank 0's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, port, progress, transport, sizes, calls, q),
                         daemon=True) for r in range(2)]
    try:
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < 2:
            try:
                rank, status, payload = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"calibration ranks did not report within {timeout} s") \
                    from None
            if status != "ok":
                raise RuntimeError(f"calibration rank {rank} failed:\n{payload}")
            got[rank] = payload
        return dict(got[0])
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def calibrate(transports: tuple[str, ...] = ("tcp",), *, calls: int = 60,
              large: int = 4 << 20, repeats: int = 3) -> dict[str, Profile]:
    """Measure (module doc) and return a profile per transport, named ``local-<transport>``;
    each transport's pair of processes is started ``repeats`` times and the medians' median
    kept. Raises ``RuntimeError`` when the measuring processes fail."""
    gamma = measure_gamma()
    rbps = measure_reduce()
    out: dict[str, Profile] = {}
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    for tr in transports:
        # wake-up latencies on a shared machine swing from minute to minute: the median of
        # ``repeats`` pairs of processes (each its own median of ``calls``)
        ins = [_pair("inline", tr, [4, large], calls) for _ in range(repeats)]
        ths = [_pair("thread", tr, [4], calls) for _ in range(repeats)]
        inline = {n: float(np.median([m[n] for m in ins])) for n in (4, large)}
        thread = {4: float(np.median([m[4] for m in ths]))}
        alpha = max(inline[4] - 3 * gamma, 1e-7)
        beta = max((inline[large] - inline[4] - large / rbps) / large, 1e-12)
        over = max(thread[4] - inline[4], 0.0)
        link = LinkClass(alpha, beta)
        out[tr] = Profile(
            name=f"local-{tr}", intra=link, inter=link, gamma=gamma, reduce_bps=rbps,
            ranks_per_host=1, cores=os.cpu_count() or 1, call_overhead=over,
            source=f"asynccoll sim calibrate on {socket.gethostname()} at {stamp}: {tr} "
                   f"between two processes (4 B and {large} B allreduces, the median of {repeats} "
                   f"runs' medians of {calls})",
            figures={"allreduce_p2_4B_inline_us": inline[4] * 1e6,
                     f"allreduce_p2_{large}B_inline_us": inline[large] * 1e6,
                     "allreduce_p2_4B_thread_us": thread[4] * 1e6,
                     "call_overhead_us": over * 1e6, "gamma_us": gamma * 1e6,
                     "reduce_GBps": rbps / 1e9})
    return out


def available_transports() -> tuple[str, ...]:
    """``tcp``, plus ``ucx`` when ucxx imports."""
    from importlib.util import find_spec

    return ("tcp", "ucx") if find_spec("ucxx") is not None else ("tcp",)
