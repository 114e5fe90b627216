"""Where the single-copy allreduce's time goes: CPU per call, per rank, by part.

    python bench/cma_cpu.py [--P 4] [--size 16777216] [--calls 40] [--reps 3]
                            [--out FILE.json] [--plot FILE.png]

On a machine with fewer cores than ranks a collective is as fast as the CPU its ranks spend
allows: with P ranks on C cores a call cannot take less than (the CPU all ranks spend on it) /
C. This benchmark measures that CPU for the default allreduce at two-shot's sizes, which takes
the single-copy path of :mod:`asynccoll.comm.cma` (``algorithm="shm"``, arrays of the
caller's, in place), in P real processes on this host, calls back to back (no barrier):

* ``full``: per call and rank, the whole process's CPU (user and system, ``getrusage``), the
  reduce kernel's own CPU (``time.thread_time`` around it) and, inside it, the CPU of the
  ``process_vm_readv`` and ``process_vm_writev`` calls; and the call's wall time;
* ``control``: the same calls with the reduce kernel replaced by one that does nothing: the
  CPU of everything else (the call, the executor, the two rounds of messages).

Each case runs with the progress thread (the default) and ``progress="inline"``. Rows carry
the median, min and max over ``--reps`` worlds of the per-call figures (each a world's mean
over ``--calls`` calls, ranks summed for ``*_core_ms`` and averaged for ``*_rank_ms``), and
``floor_ms``: the summed CPU over the cores, what a call would take were every core busy all
the time (``os.cpu_count()`` cores, or the ranks if fewer).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import time
import traceback
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import SECRET, bar_plot, free_port, spawn_world, stats, write_json


async def _rank(rank: int, P: int, port: int, size: int, calls: int, mode: str,
                progress: str) -> dict[str, float]:
    import asynccoll
    from asynccoll.comm import cma

    spent = {"kernel": 0.0, "read": 0.0, "write": 0.0}
    reduce_kernel, read, write = cma._k_reduce, cma.read_remote, cma.write_remote

    def timed_read(*a: Any) -> None:
        t = time.thread_time()
        read(*a)
        spent["read"] += time.thread_time() - t

    def timed_write(*a: Any) -> None:
        t = time.thread_time()
        write(*a)
        spent["write"] += time.thread_time() - t

    def kernel(out: Any, inputs: Any, params: Any, msgs: Any) -> None:
        t = time.thread_time()
        if mode == "full":
            reduce_kernel(out, inputs, params, msgs)
        spent["kernel"] += time.thread_time() - t

    # the module's globals: what _k_reduce calls, and the kernel the communicator registers
    cma.read_remote, cma.write_remote = timed_read, timed_write  # type: ignore[assignment]
    cma.CMA_OWN_KERNELS["cma_reduce"] = kernel
    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=120, progress=progress)
    async with comm:
        x = np.full(size // 4, rank + 1, np.float32)
        for _ in range(5):
            await comm.allreduce(x, algorithm="shm", timeout=120, out=x)
        await comm.barrier(timeout=120)
        for k in spent:
            spent[k] = 0.0
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(calls):
            await comm.allreduce(x, algorithm="shm", timeout=120, out=x)
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        await comm.barrier(timeout=120)
        if mode == "full":
            expect = P * (P + 1) / 2 * P ** (5 + calls - 1)  # sums of sums: exact powers
            if not np.isclose(float(x[0]), expect, rtol=1e-3):
                raise AssertionError(f"wrong result {x[0]} != {expect}")
    return {"cpu": (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / calls,
            "sys": (r1.ru_stime - r0.ru_stime) / calls, "wall": (t1 - t0) / calls,
            **{k: v / calls for k, v in spent.items()}}


def _child(rank: int, P: int, port: int, size: int, calls: int, mode: str, progress: str,
           q: Any) -> None:
    try:
        os.environ["ASYNCCOLL_SECRET"] = SECRET
        os.environ.setdefault("ASYNCCOLL_CMA", "1")
        q.put((rank, "ok", asyncio.run(_rank(rank, P, port, size, calls, mode, progress))))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--P", type=int, default=4)
    ap.add_argument("--size", type=int, default=16 << 20, help="bytes (float32)")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="bench/results/cma_cpu.json")
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    cores = min(os.cpu_count() or 1, a.P)
    rows: list[dict[str, Any]] = []
    for mode in ("full", "control"):
        for progress in ("thread", "inline"):
            worlds = []
            for _ in range(a.reps):
                worlds.append(spawn_world(_child, a.P, (free_port(), a.size, a.calls, mode,
                                                        progress), 600))
            row: dict[str, Any] = {"case": f"{mode}-{progress}", "mode": mode,
                                   "progress": progress, "P": a.P, "size": a.size}
            ms = 1e3
            row.update(stats("cpu_core_ms", [sum(r["cpu"] for r in w) * ms for w in worlds]))
            row.update(stats("sys_core_ms", [sum(r["sys"] for r in w) * ms for w in worlds]))
            row.update(stats("wall_ms", [float(np.mean([r["wall"] for r in w])) * ms
                                         for w in worlds]))
            row.update(stats("floor_ms", [sum(r["cpu"] for r in w) * ms / cores
                                          for w in worlds]))
            for part in ("kernel", "read", "write"):
                row.update(stats(f"{part}_rank_ms", [float(np.mean([r[part] for r in w])) * ms
                                                     for w in worlds]))
            rows.append(row)
            print(f"{row['case']:15s} CPU {row['cpu_core_ms_median']:6.2f} core-ms per call "
                  f"(sys {row['sys_core_ms_median']:5.2f}), wall {row['wall_ms_median']:5.2f} "
                  f"ms, floor {row['floor_ms_median']:5.2f} ms; per rank: kernel "
                  f"{row['kernel_rank_ms_median']:.2f} ms (read {row['read_rank_ms_median']:.2f}"
                  f", write {row['write_rank_ms_median']:.2f})", file=sys.stderr)
    write_json(a.out, "cma_cpu", {"P": a.P, "size": a.size, "calls": a.calls, "reps": a.reps,
                                  "cores": cores}, rows)
    if a.plot:
        bar_plot(rows, "cpu_core_ms", [r["case"] for r in rows], a.plot,
                 ylabel="CPU per call, all ranks (core-ms)",
                 title=f"single-copy allreduce, P = {a.P}, {a.size >> 20} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
