"""Allreduce of CuPy arrays (device memory) on one GPU host: asynccoll over tcp (staged through
host memory) and over ucx (device memory handed to UCX), synchronous and partial (solo).

    python bench/gpu_allreduce.py [--P 2,4] [--sizes 1M,64M] [--calls N] [--out F.json]

P rank processes share this host's GPU 0 (one GPU was what the device machine had; NCCL
refuses two ranks on one GPU, so it is not a peer here). Each rank: a float32 CuPy array of
``size`` bytes, a barrier before each call, the slowest rank's median over ``--calls`` timed
calls (3 warm-up). The peers in the same run: one host round trip of ``size`` bytes
(``cupy.asnumpy`` then ``cupy.asarray``: what staging through the host costs a rank once) and
one device-to-device copy. Needs cupy and a CUDA device; ucx rows need ucxx.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import SECRET, free_port, spawn_world, write_json

SIZES = {"1M": 1 << 20, "16M": 16 << 20, "64M": 64 << 20}


async def _rank(rank: int, P: int, port: int, transport: str, sizes: list[int],
                calls: int) -> dict[str, dict[int, list[float]]]:
    import cupy

    import asynccoll

    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport=transport, timeout=120)
    out: dict[str, dict[int, list[float]]] = {"sync": {}, "solo": {}}
    async with comm:
        for size in sizes:
            x = cupy.full(size // 4, rank + 1, cupy.float32)
            h = comm.partial_allreduce("solo", like=x, name=f"gpu-{size}")
            for kind in ("sync", "solo"):
                times = []
                for i in range(3 + calls):
                    await comm.barrier(timeout=120)
                    t0 = time.perf_counter()
                    if kind == "sync":
                        y = await comm.allreduce(x, timeout=300)
                    else:
                        y = (await h(x, timeout=300)).value
                    cupy.cuda.Device().synchronize()
                    if i >= 3:
                        times.append(time.perf_counter() - t0)
                if kind == "sync" and float(y[0]) != P * (P + 1) / 2:
                    raise AssertionError(f"wrong sum {float(y[0])}")
                out[kind][size] = times
            await h.flush(timeout=300)
            await h.close()
        await comm.barrier(timeout=60)
    return out


def _child(rank: int, P: int, port: int, transport: str, sizes: list[int], calls: int,
           q: Any) -> None:
    try:
        os.environ["ASYNCCOLL_SECRET"] = SECRET
        q.put((rank, "ok", asyncio.run(_rank(rank, P, port, transport, sizes, calls))))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def _peers(sizes: list[int]) -> list[dict[str, Any]]:
    import cupy

    rows = []
    for size in sizes:
        x = cupy.ones(size // 4, cupy.float32)
        y = cupy.empty_like(x)
        for name in ("host round trip", "device copy"):
            ts = []
            for _ in range(13):
                t0 = time.perf_counter()
                if name == "device copy":
                    y[...] = x
                else:
                    cupy.asarray(cupy.asnumpy(x))
                cupy.cuda.Device().synchronize()
                ts.append(time.perf_counter() - t0)
            rows.append({"impl": name, "size": size, "time_ms_median":
                         statistics.median(ts[3:]) * 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--P", default="2,4")
    ap.add_argument("--sizes", default="1M,64M")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--transports", default="tcp,ucx")
    ap.add_argument("--out", default="bench/results/gpu_allreduce.json")
    args = ap.parse_args()
    sizes = [SIZES[s] for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = _peers(sizes)
    for P in (int(p) for p in args.P.split(",")):
        for transport in args.transports.split(","):
            try:
                per_rank = spawn_world(_child, P, (free_port(), transport, sizes, args.calls),
                                       600)
            except RuntimeError as exc:
                rows.append({"impl": f"asynccoll-{transport}", "P": P, "error": str(exc)[-800:]})
                print(f"P={P} {transport}: failed: {str(exc)[-300:]}", flush=True)
                continue
            for kind in ("sync", "solo"):
                for size in sizes:
                    slowest = [max(r[kind][size][i] for r in per_rank)
                               for i in range(args.calls)]
                    ms = statistics.median(slowest) * 1e3
                    rows.append({"impl": f"asynccoll-{transport}-{kind}", "P": P, "size": size,
                                 "time_ms_median": ms, "time_ms_min": min(slowest) * 1e3,
                                 "time_ms_max": max(slowest) * 1e3,
                                 "algbw_GBps": size / ms / 1e6})
    for r in rows:
        print(r, flush=True)
    write_json(args.out, "gpu_allreduce", vars(args), rows,
               packages=("asynccoll", "cupy-cuda13x", "ucxx-cu13", "torch"))


if __name__ == "__main__":
    main()
