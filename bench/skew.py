"""Skewed arrival (eager-SGD §7.1, Fig. 8/9): partial vs synchronous allreduce under linear skew.

    python bench/skew.py [--quick] [--out FILE.json] [--plot FILE.png] [--iters N] [--P 4,8,16]

P real processes on this host (rank r sleeps r x 1 ms before each call, a barrier between
iterations, a 4-byte float32 sum). For each implementation: the mean latency of a call over all
ranks and iterations (with the median, min and max of the per-iteration means), and the mean
number of active processes (NAP: the ranks whose fresh data is in an execution; P for the
synchronous ones). Implementations (rows' ``impl``):

* ``sync``: :meth:`asynccoll.Communicator.allreduce` over tcp;
* ``solo``, ``majority``, ``two_choice``, ``quorum`` (k = P/2): persistent partial allreduce
  handles over tcp;
* ``mpi``: mpi4py ``Allreduce`` under ``mpirun`` (when mpi4py and mpirun are there);
* ``gloo``: ``torch.distributed.all_reduce`` with the gloo backend (when torch imports).

The rank's sleep is a blocking ``time.sleep`` (the application computing); asynccoll's progress
thread answers activations meanwhile. ``--quick``: P in {4, 8}, 16 iterations. Every process the
benchmark starts is killed in ``finally``. On a 2-core machine P >= 4 processes oversubscribe
the cores: absolute times include scheduling delays; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (
    SECRET,
    free_port,
    peer_missing,
    run_mpi,
    spawn_world,
    stats,
    write_json,
)

SKEW = 1e-3  # seconds of sleep per rank (``--skew-ms``)
ASYNCCOLL_IMPLS = ("sync", "solo", "majority", "two_choice", "quorum")


def handle_name(impl: str) -> str:
    """The name of the partial handle of kind ``impl``: its initiator draws' seed comes from it
    (``bench/sim_validate.py`` draws the same ones)."""
    return f"skew-{impl}"


# -- asynccoll -------------------------------------------------------------------------------
async def asynccoll_rank(rank: int, P: int, port: int, iters: int, warmup: int,
                         impls: list[str], skew: float) -> dict[str, Any]:
    import asynccoll

    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=120)
    out: dict[str, Any] = {}
    async with comm:
        x = np.ones(1, np.float32)
        for impl in impls:
            if impl == "sync":
                def call() -> Any:
                    return comm.allreduce(x, timeout=60)
            else:
                q = max(1, P // 2) if impl == "quorum" else None
                h = comm.partial_allreduce(impl if q is None else f"{impl}:{q}", like=x,
                                           name=handle_name(impl))

                def call(h: Any = h) -> Any:
                    return h(x, timeout=60)
            lat: list[float] = []
            naps: dict[int, int] = {}
            for i in range(warmup + iters):
                await comm.barrier(timeout=60)
                # computing: it blocks this thread (deliberately), not the progress thread
                time.sleep(rank * skew)  # noqa: ASYNC251
                t0 = time.perf_counter()
                res = await call()
                dt = time.perf_counter() - t0
                if i >= warmup:
                    lat.append(dt)
                    if impl != "sync" and res.included:
                        naps[res.round] = len(res.fresh)
            if impl != "sync":
                await h.flush(timeout=60)
            out[impl] = {"lat": lat, "naps": naps}
        await comm.barrier(timeout=60)
        await asyncio.sleep(0.2)  # let peers read our last frames before we close
    return out


def asynccoll_child(rank: int, P: int, port: int, iters: int, warmup: int, impls: list[str],
                    skew: float, q: Any) -> None:
    try:
        os.environ["ASYNCCOLL_SECRET"] = SECRET
        q.put((rank, "ok", asyncio.run(asynccoll_rank(rank, P, port, iters, warmup, impls,
                                                      skew))))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def summarise(impl: str, P: int, lat_by_rank: list[list[float]], nap: float) -> dict[str, Any]:
    per_iter = np.mean(np.array(lat_by_rank), axis=0) * 1e6  # mean over ranks, per iteration
    # where the time goes: which ranks wait (rank r calls r x skew after the barrier)
    per_rank = [round(float(np.mean(v)) * 1e6, 1) for v in lat_by_rank]
    return {"impl": impl, "P": P, "iters": len(per_iter),
            "latency_us_mean": float(np.mean(per_iter)), **stats("latency_us", per_iter),
            "nap_mean": nap, "latency_us_mean_by_rank": per_rank}


def run_asynccoll(P: int, iters: int, warmup: int, skew: float) -> list[dict[str, Any]]:
    impls = list(ASYNCCOLL_IMPLS)
    out = spawn_world(asynccoll_child, P, (free_port(), iters, warmup, impls, skew), 600)
    rows = []
    for impl in impls:
        if impl == "sync":
            nap = float(P)
        else:
            naps: dict[int, int] = {}
            for o in out:
                naps.update(o[impl]["naps"])
            nap = float(np.mean(list(naps.values()))) if naps else float("nan")
        rows.append(summarise(impl, P, [o[impl]["lat"] for o in out], nap))
    return rows


# -- gloo ------------------------------------------------------------------------------------
def gloo_child(rank: int, P: int, port: int, iters: int, warmup: int, skew: float,
               q: Any) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          GLOO_SOCKET_IFNAME="lo")
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=P)
        t = torch.ones(1, dtype=torch.float32)
        lat = []
        for i in range(warmup + iters):
            dist.barrier()
            time.sleep(rank * skew)
            t0 = time.perf_counter()
            dist.all_reduce(t)
            dt = time.perf_counter() - t0
            if i >= warmup:
                lat.append(dt)
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, "ok", lat))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def run_gloo(P: int, iters: int, warmup: int, skew: float) -> list[dict[str, Any]]:
    out = spawn_world(gloo_child, P, (free_port(), iters, warmup, skew), 600)
    return [summarise("gloo", P, out, float(P))]


# -- mpi -------------------------------------------------------------------------------------
def run_mpi_world(P: int, iters: int, warmup: int, skew: float) -> list[dict[str, Any]]:
    lat_by_rank: list[list[float]] = run_mpi(__file__, P, [json.dumps([iters, warmup, skew])],
                                             600)
    return [summarise("mpi", P, lat_by_rank, float(P))]


def mpi_worker(iters: int, warmup: int, skew: float, out: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    x = np.ones(1, np.float32)
    y = np.empty_like(x)
    lat = []
    for i in range(warmup + iters):
        comm.Barrier()
        time.sleep(rank * skew)
        t0 = time.perf_counter()
        comm.Allreduce(x, y, op=MPI.SUM)
        dt = time.perf_counter() - t0
        if i >= warmup:
            lat.append(dt)
    every = comm.gather(lat, root=0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(every, f)


# -- driver ----------------------------------------------------------------------------------
def plot(rows: list[dict[str, Any]], path: str, skew: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ps = sorted({r["P"] for r in rows})
    impls = [i for i in (*ASYNCCOLL_IMPLS, "mpi", "gloo") if any(r["impl"] == i for r in rows)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        xs, lat, nap = [], [], []
        for j, P in enumerate(Ps):
            r = next((r for r in rows if r["impl"] == impl and r["P"] == P), None)
            if r is not None:
                xs.append(j + k * width)
                lat.append(r["latency_us_mean"] / 1e3)
                nap.append(r["nap_mean"])
        ax1.bar(xs, lat, width, label=impl)
        ax2.bar(xs, nap, width, label=impl)
    for ax in (ax1, ax2):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(Ps))], [f"P={P}" for P in Ps])
    ax1.set_ylabel("mean latency per call (ms)")
    ax1.set_yscale("log")
    ax2.set_ylabel("active processes per execution (NAP)")
    ax1.set_title(f"rank r sleeps r x {skew * 1e3:g} ms, 4 B float32 sum")
    ax2.set_title("mean number of active processes")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--mpi-worker"]:
        iters, warmup, skew = json.loads(argv[2])
        mpi_worker(iters, warmup, skew, argv[1])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="P in {4, 8}, 16 iterations")
    ap.add_argument("--out", help="write the JSON results here")
    ap.add_argument("--plot", help="write a bar chart here (PNG)")
    ap.add_argument("--iters", type=int, help="measured iterations (default 64, quick 16)")
    ap.add_argument("--P", help="comma-separated world sizes (default 4,8,16; quick 4,8)")
    ap.add_argument("--skew-ms", type=float, default=SKEW * 1e3,
                    help="rank r sleeps r x this many ms before each call (default 1)")
    ap.add_argument("--impls", help="comma-separated subset of sync,solo,majority,two_choice,"
                    "quorum,mpi,gloo (default all)")
    args = ap.parse_args(argv)
    Ps = [int(p) for p in args.P.split(",")] if args.P else ([4, 8] if args.quick
                                                             else [4, 8, 16])
    iters = args.iters or (16 if args.quick else 64)
    warmup = 3 if args.quick else 5
    missing = {peer: peer_missing(peer) for peer in ("mpi", "gloo")}
    for peer, why in missing.items():
        if why is not None:
            print(f"skew: {why}: no '{peer}' rows", file=sys.stderr)
    have_mpi, have_gloo = missing["mpi"] is None, missing["gloo"] is None
    if (os.cpu_count() or 1) < max(Ps):
        print(f"skew: {max(Ps)} processes on {os.cpu_count()} cores: oversubscribed, absolute "
              "times include scheduling delays; compare ratios", file=sys.stderr)
    skew = args.skew_ms / 1e3
    chosen = set(args.impls.split(",")) if args.impls else {*ASYNCCOLL_IMPLS, "mpi", "gloo"}
    rows: list[dict[str, Any]] = []
    for P in Ps:
        t0 = time.time()
        rows += [r for r in run_asynccoll(P, iters, warmup, skew) if r["impl"] in chosen]
        if have_mpi and "mpi" in chosen:
            rows += run_mpi_world(P, iters, warmup, skew)
        if have_gloo and "gloo" in chosen:
            rows += run_gloo(P, iters, warmup, skew)
        print(f"skew: P={P} done in {time.time() - t0:.1f} s", file=sys.stderr)
    for r in rows:
        print(f"{r['impl']:>11} P={r['P']:<3} latency mean {r['latency_us_mean']:10.1f} us  "
              f"(median {r['latency_us_median']:.1f}, min {r['latency_us_min']:.1f}, max "
              f"{r['latency_us_max']:.1f})  NAP {r['nap_mean']:.2f}")
    for P in Ps:
        by = {r["impl"]: r for r in rows if r["P"] == P}
        for peer in ("mpi", "gloo"):
            if peer in by:
                for impl in ("solo", "majority"):
                    ratio = by[peer]["latency_us_mean"] / by[impl]["latency_us_mean"]
                    print(f"P={P}: {impl} latency is {ratio:.1f}x lower than {peer}'s")
    params = {"P": Ps, "iters": iters, "warmup": warmup, "skew_s": skew, "bytes": 4,
              "transport": "tcp", "quick": args.quick,
              "median": "of per-iteration means over ranks"}
    if args.out:
        write_json(args.out, "skew", params, rows,
                   packages=("asynccoll", "uvloop", "mpi4py", "torch", "msgpack"))
    if args.plot:
        plot(rows, args.plot, skew)
    return 0


if __name__ == "__main__":
    sys.exit(main())
