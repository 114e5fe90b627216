"""Dense float32 sum allreduce: asynccoll over tcp, shared memory and ucx against Gloo and
Open MPI.

    python bench/allreduce.py [--quick] [--out FILE.json] [--plot FILE.png] [--P 2,4,8]
                              [--impls asynccoll-tcp,asynccoll-shm,asynccoll-ucx,gloo,mpi]
                              [--progress thread]

``asynccoll-tcp`` and ``asynccoll-ucx`` are the network paths (``ASYNCCOLL_SHM=0``, so the
default allreduce stays off shared memory); ``asynccoll-shm`` is ``algorithm="shm"`` (every
rank on this host; the data through shared memory, the wake-ups over tcp);
``asynccoll-shm-arena`` the same with arrays from ``comm.empty`` (in shared memory already, so
nothing is copied in: what the shared-memory path is built for). ``asynccoll-hier`` (P = 4,
root with ``ip netns``; skipped otherwise) runs the default allreduce across two network
namespaces of two ranks each, each namespace its own host: shared memory within a host, tcp
across the veth between the two (``bench/hier.py`` has the same world beside a flat tcp
one). ``--algorithm shm_one_shot``
or ``shm_two_shot`` forces one of the shared-memory algorithms for those rows (by default they
choose by size). ``asynccoll-partial-shm`` and ``asynccoll-partial-tcp`` time a call of a
persistent partial allreduce handle (``--partial-kind``, default ``majority``) whose data phase
goes through shared memory (``shm=True``) or over tcp (``shm=False``), the calls made at the
same moment on every rank (after a barrier) and the handle flushed after each size: the cost
of the partial machinery and its data phase with no skew to hide. ``--interleave
shm_one_shot,shm_two_shot,network`` (or ``partial-shm,partial-tcp``, ...) times several
asynccoll variants call by call in one world instead, so that their ratios see the same load
on a shared machine.

For each implementation and P (real processes on this host), each message size (4 B, 4 KiB,
1 MiB, 16 MiB, 64 MiB): warm-up calls, then timed calls, each preceded by a barrier; a call's
time is the slowest rank's (the collective is done when every rank is done). Rows carry the
median, min and max over calls (``time_us_*``) and the algorithm bandwidth
(``size / median time``). asynccoll chooses its algorithm by size and P (``--algorithm`` forces
one) and reduces in place (``out=x``) as Gloo and MPI do; ``--copy`` measures its default of
returning a new array. Peers run when importable (``pip install 'asynccoll[bench]'``);
otherwise the script says so on stderr. ``--quick`` keeps every case but runs fewer calls. On
a 2-core machine P > 2 oversubscribes the cores: compare ratios within one run, not absolute
times across machines.
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

from asynccoll import DataPath

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

SIZES = [4, 4 << 10, 1 << 20, 16 << 20, 64 << 20]
ALL_IMPLS = ("asynccoll-tcp", "asynccoll-shm", "asynccoll-shm-arena", "asynccoll-hier",
             "asynccoll-ucx", "gloo",
             "mpi", "asynccoll-partial-shm", "asynccoll-partial-tcp")


def calls_for(size: int, quick: bool) -> tuple[int, int]:
    """(warm-up calls, timed calls) for a message of ``size`` bytes. Large messages take 25
    and 10 timed calls (they took 8 and 5 before 2026-11-24: on this shared 2-core machine
    the median of 8 moved by 30 % from run to run)."""
    timed = 200 if size <= 4096 else 30 if size <= 1 << 20 else 25 if size <= 16 << 20 else 10
    if quick:
        timed = max(3, timed // 6)
    return (2 if size >= 16 << 20 else 5), timed


def _slowest(per_rank: list[list[float]]) -> list[float]:
    return [float(x) for x in np.max(np.array(per_rank), axis=0)]


# -- asynccoll -------------------------------------------------------------------------------
async def _asynccoll_rank(rank: int, P: int, port: int, transport: str, sizes: list[int],
                          quick: bool, progress: str, algorithm: str | None, copy: bool,
                          arena: bool = False,
                          partial: tuple[str, bool] | None = None) -> dict[int, list[float]]:
    import asynccoll

    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport=transport, timeout=120, progress=progress)
    out: dict[int, list[float]] = {}
    async with comm:
        for size in sizes:
            if arena:  # in shared memory already: reduced where it is, no copy in
                x = await comm.empty(size // 4, np.float32, timeout=120)
                x[...] = rank + 1
            else:
                x = np.full(size // 4, rank + 1, np.float32)
            warm, timed = calls_for(size, quick)
            times = []
            if partial is not None:  # a partial handle: (kind, through shared memory)
                h = comm.partial_allreduce(partial[0], like=x, name=f"bench-{size}",
                                           path=DataPath(shm=partial[1]))
            for i in range(warm + timed):
                x[...] = rank + 1  # in place overwrites x: refill it, outside the timed part
                await comm.barrier(timeout=120)
                t0 = time.perf_counter()
                if partial is not None:  # in place too (out=x; --copy: a fresh result)
                    y = (await h(x, timeout=300, out=None if copy else x)).value
                else:
                    y = await comm.allreduce(x, algorithm=algorithm, timeout=300,
                                             out=None if copy else x)
                dt = time.perf_counter() - t0
                if i >= warm:
                    times.append(dt)
            if partial is not None:
                await h.flush(timeout=300)
                await h.close()
                out[size] = times
                continue
            expect = P * (P + 1) / 2
            if y.size and not (y[0] == expect and y[-1] == expect):
                raise AssertionError(f"wrong allreduce result {y[0]} != {expect}")
            out[size] = times
        await comm.barrier(timeout=60)
    return out


def _asynccoll_child(rank: int, P: int, port: int, transport: str, sizes: list[int],
                     quick: bool, progress: str, algorithm: str | None, copy: bool,
                     arena: bool, partial: tuple[str, bool] | None, q: Any) -> None:
    try:
        os.environ["ASYNCCOLL_SECRET"] = SECRET
        res = asyncio.run(_asynccoll_rank(rank, P, port, transport, sizes, quick, progress,
                                          algorithm, copy, arena, partial))
        q.put((rank, "ok", res))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def run_asynccoll(transport: str, P: int, sizes: list[int], quick: bool, progress: str,
                  algorithm: str | None, copy: bool, arena: bool = False,
                  partial: tuple[str, bool] | None = None) -> dict[int, list[float]]:
    out = spawn_world(_asynccoll_child, P,
                      (free_port(), transport, sizes, quick, progress, algorithm, copy, arena,
                       partial), 1200)
    return {s: _slowest([o[s] for o in out]) for s in sizes}


# -- asynccoll, several variants interleaved call by call in one world ------------------------
#: the variants ``--interleave`` knows: dense allreduce algorithms, and partial handles
VARIANTS = ("shm_one_shot", "shm_two_shot", "shm", "network", "partial-shm", "partial-tcp")


async def _interleaved_rank(rank: int, P: int, port: int, sizes: list[int], quick: bool,
                            progress: str, variants: list[str],
                            kind: str) -> dict[str, dict[int, list[float]]]:
    """Each timed round calls every variant once, in turn (a barrier before each call), so
    that their ratios see the same load: the way to compare them on a shared machine."""
    import asynccoll

    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=120, progress=progress)
    out: dict[str, dict[int, list[float]]] = {v: {} for v in variants}
    async with comm:
        for size in sizes:
            x = np.full(size // 4, rank + 1, np.float32)
            hs = {v: comm.partial_allreduce(kind, like=x, name=f"bench-{v}-{size}",
                                            path=DataPath(shm=v == "partial-shm"))
                  for v in variants if v.startswith("partial")}
            warm, timed = calls_for(size, quick)
            for v in variants:
                out[v][size] = []
            for i in range(warm + timed):
                for v in variants:
                    x[...] = rank + 1
                    await comm.barrier(timeout=120)
                    t0 = time.perf_counter()
                    if v in hs:
                        await hs[v](x, timeout=300, out=x)
                    else:
                        await comm.allreduce(x, algorithm=None if v == "network" else v,
                                             timeout=300, out=x)
                    dt = time.perf_counter() - t0
                    if i >= warm:
                        out[v][size].append(dt)
                    if v not in hs and x[0] != P * (P + 1) / 2:
                        raise AssertionError(f"{v}: wrong allreduce result {x[0]}")
            for h in hs.values():
                await h.flush(timeout=300)
                await h.close()
        await comm.barrier(timeout=60)
    return out


def _interleaved_child(rank: int, P: int, port: int, sizes: list[int], quick: bool,
                       progress: str, variants: list[str], kind: str, q: Any) -> None:
    try:
        os.environ["ASYNCCOLL_SECRET"] = SECRET
        os.environ["ASYNCCOLL_SHM"] = "0"  # "network": the default stays off shared memory
        res = asyncio.run(_interleaved_rank(rank, P, port, sizes, quick, progress, variants,
                                            kind))
        q.put((rank, "ok", res))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def run_interleaved(P: int, sizes: list[int], quick: bool, progress: str, variants: list[str],
                    kind: str) -> dict[str, dict[int, list[float]]]:
    out = spawn_world(_interleaved_child, P,
                      (free_port(), sizes, quick, progress, variants, kind), 1200)
    return {v: {s: _slowest([o[v][s] for o in out]) for s in sizes} for v in variants}


# -- gloo ------------------------------------------------------------------------------------
def _gloo_child(rank: int, P: int, port: int, sizes: list[int], quick: bool, q: Any) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          GLOO_SOCKET_IFNAME="lo")
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=P)
        out: dict[int, list[float]] = {}
        for size in sizes:
            t = torch.full((size // 4,), float(rank + 1), dtype=torch.float32)
            warm, timed = calls_for(size, quick)
            times = []
            for i in range(warm + timed):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                dt = time.perf_counter() - t0
                if i >= warm:
                    times.append(dt)
            out[size] = times
        dist.barrier()
        dist.destroy_process_group()
        q.put((rank, "ok", out))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def run_gloo(P: int, sizes: list[int], quick: bool) -> dict[int, list[float]]:
    out = spawn_world(_gloo_child, P, (free_port(), sizes, quick), 1200)
    return {s: _slowest([o[s] for o in out]) for s in sizes}


# -- mpi -------------------------------------------------------------------------------------
def mpi_worker(out_path: str, sizes: list[int], quick: bool) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    res: dict[str, list[float]] = {}
    for size in sizes:
        x = np.full(size // 4, rank + 1, np.float32)
        warm, timed = calls_for(size, quick)
        times = []
        for i in range(warm + timed):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            dt = time.perf_counter() - t0
            if i >= warm:
                times.append(dt)
        res[str(size)] = times
    every = comm.gather(res, root=0)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(every, f)


def run_mpi_world(P: int, sizes: list[int], quick: bool) -> dict[int, list[float]]:
    every = run_mpi(__file__, P, [json.dumps(sizes), "1" if quick else "0"], 1200)
    return {s: _slowest([o[str(s)] for o in every]) for s in sizes}


# -- driver ----------------------------------------------------------------------------------
# -- asynccoll-hier: two "hosts" of network namespaces (bench/hier.py) -------------------------
def run_hier_rows(Ps: list[int], sizes: list[int], quick: bool) -> list[dict[str, Any]]:
    """Row ``asynccoll-hier`` at P = 4: two network namespaces of two ranks each, each its own
    host, the default allreduce (hierarchical: shared memory within each host, tcp across the
    veth between them; ``bench/hier.py``, whose flat tcp row this run's ``asynccoll-tcp`` is
    not: that one is on loopback). Needs root and ``ip netns``; skipped, saying why, otherwise
    and at other P."""
    import hier

    why = hier.netns_missing()
    if why or 4 not in Ps:
        print(f"allreduce: skipping asynccoll-hier: {why or 'P = 4 only (2 hosts x 2 ranks)'}",
              file=sys.stderr)
        return []
    t0 = time.time()
    res: dict[int, list[float]] = {}
    with hier.Hosts() as hosts:
        for size in sizes:  # each size with its own calls, as the other rows
            warm, timed = calls_for(size, quick)
            res.update(hier.run(hosts, "asynccoll-hier", [size], timed, warm, free_port()))
    print(f"allreduce: asynccoll-hier P=4 done in {time.time() - t0:.1f} s", file=sys.stderr)
    rows = rows_of("asynccoll-hier", 4, res)
    for r in rows:
        print(f"  {r['size']:>10} B  {r['time_us_median']:>12.1f} µs", file=sys.stderr)
    return rows


def rows_of(impl: str, P: int, res: dict[int, list[float]]) -> list[dict[str, Any]]:
    rows = []
    for size, times in res.items():
        us = [t * 1e6 for t in times]
        row = {"impl": impl, "P": P, "size": size, "calls": len(us), **stats("time_us", us)}
        row["algbw_gbps_median"] = size / (row["time_us_median"] * 1e-6) / 1e9
        rows.append(row)
    return rows


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """asynccoll's speed relative to each peer: peer time / asynccoll time (> 1: faster)."""
    t = {(r["impl"], r["P"], r["size"]): r["time_us_median"] for r in rows}
    out = {}
    for (impl, P, size), v in t.items():
        if not impl.startswith("asynccoll"):
            continue
        for peer in ("gloo", "mpi"):
            if (peer, P, size) in t:
                out[f"{impl}/{peer} P={P} {size}B"] = t[(peer, P, size)] / v
    return out


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ps = sorted({r["P"] for r in rows})
    fig, axes = plt.subplots(1, len(Ps), figsize=(5 * len(Ps), 4), squeeze=False)
    for ax, P in zip(axes[0], Ps, strict=True):
        for impl in ALL_IMPLS:
            rs = sorted((r for r in rows if r["P"] == P and r["impl"] == impl),
                        key=lambda r: r["size"])
            if not rs:
                continue
            ax.errorbar([r["size"] for r in rs], [r["time_us_median"] for r in rs],
                        yerr=[[r["time_us_median"] - r["time_us_min"] for r in rs],
                              [r["time_us_max"] - r["time_us_median"] for r in rs]],
                        marker="o", label=impl, capsize=2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("time per allreduce (µs)")
        ax.set_title(f"float32 sum allreduce, P = {P}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--mpi-worker"]:
        mpi_worker(argv[1], json.loads(argv[2]), argv[3] == "1")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/results/allreduce.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--P", default="2,4,8")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--impls", default=",".join(ALL_IMPLS))
    ap.add_argument("--progress", default="thread", choices=("thread", "inline"))
    ap.add_argument("--algorithm", default=None)
    ap.add_argument("--partial-kind", default="majority",
                    help="the kind of the asynccoll-partial-* rows")
    ap.add_argument("--interleave", default=None,
                    help="comma-separated asynccoll variants to time call by call in one "
                         f"world, rows asynccoll-VARIANT ({', '.join(VARIANTS)}); the "
                         "asynccoll entries of --impls are then skipped (--impls '' for none)")
    ap.add_argument("--copy", action="store_true",
                    help="asynccoll returns a new array (its default) instead of reducing in "
                         "place like the peers (out=x)")
    args = ap.parse_args(argv)
    Ps = [int(p) for p in args.P.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    impls = args.impls.split(",")
    rows: list[dict[str, Any]] = []
    if args.interleave:
        variants = args.interleave.split(",")
        bad = [v for v in variants if v not in VARIANTS]
        if bad:
            ap.error(f"unknown --interleave variant(s) {bad}; known: {', '.join(VARIANTS)}")
        impls = [i for i in impls if i and not i.startswith("asynccoll")]  # peers: --impls
        for P in Ps:
            t0 = time.time()
            got = run_interleaved(P, sizes, args.quick, args.progress, variants,
                                  args.partial_kind)
            for v, res in got.items():
                rows += rows_of(f"asynccoll-{v}", P, res)
            print(f"allreduce: interleaved {variants} P={P} done in {time.time() - t0:.1f} s",
                  file=sys.stderr)
            for r in rows[-len(sizes) * len(variants):]:
                print(f"  {r['impl']:>24} {r['size']:>10} B  {r['time_us_median']:>12.1f} µs",
                      file=sys.stderr)
    for impl in impls:
        if impl == "asynccoll-hier":
            rows += run_hier_rows(Ps, sizes, args.quick)
            continue
        need = {"asynccoll-tcp": None, "asynccoll-shm": None, "asynccoll-shm-arena": None,
                "asynccoll-ucx": "ucx", "asynccoll-partial-shm": None,
                "asynccoll-partial-tcp": None,
                "gloo": "gloo", "mpi": "mpi"}
        if impl not in need:
            ap.error(f"unknown impl {impl!r}; known: {', '.join(ALL_IMPLS)}")
        why = peer_missing(need[impl]) if need[impl] else None
        if why:
            print(f"allreduce: skipping {impl}: {why}", file=sys.stderr)
            continue
        for P in Ps:
            t0 = time.time()
            if impl.startswith("asynccoll-partial"):
                # the same handle either way; ASYNCCOLL_SHM=1 so that shm=True may be asked
                os.environ["ASYNCCOLL_SHM"] = "1"
                res = run_asynccoll("tcp", P, sizes, args.quick, args.progress, None, False,
                                    partial=(args.partial_kind, impl.endswith("shm")))
            elif impl.startswith("asynccoll"):
                # asynccoll-tcp and -ucx: the network path (ASYNCCOLL_SHM=0 keeps the default
                # allreduce off shared memory); asynccoll-shm: through shared memory, with the
                # wake-ups over tcp
                # (-arena: the arrays from comm.empty, in shared memory already)
                shm = impl.startswith("asynccoll-shm")
                os.environ["ASYNCCOLL_SHM"] = "1" if shm else "0"
                algo = args.algorithm
                if shm and not (algo or "").startswith("shm"):
                    algo = "shm"  # --algorithm shm_one_shot / shm_two_shot forces one
                res = run_asynccoll("tcp" if shm else impl.split("-")[1], P, sizes, args.quick,
                                    args.progress, algo, args.copy,
                                    arena=impl == "asynccoll-shm-arena")
            elif impl == "gloo":
                res = run_gloo(P, sizes, args.quick)
            else:
                res = run_mpi_world(P, sizes, args.quick)
            rows += rows_of(impl, P, res)
            print(f"allreduce: {impl} P={P} done in {time.time() - t0:.1f} s", file=sys.stderr)
            for r in rows[-len(sizes):]:
                print(f"  {r['size']:>10} B  {r['time_us_median']:>12.1f} µs", file=sys.stderr)
    params = {"P": Ps, "sizes": sizes, "impls": impls, "quick": args.quick,
              "progress": args.progress, "algorithm": args.algorithm,
              "partial_kind": args.partial_kind, "interleave": args.interleave,
              "in_place": not args.copy, "dtype": "float32",
              "op": "sum"}
    write_json(args.out, "allreduce", params, rows)
    rat = ratios(rows)
    for k, v in sorted(rat.items()):
        print(f"ratio {k}: {v:.2f}x", file=sys.stderr)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
