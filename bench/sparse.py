"""Sparse allreduce time vs density (SparCML Fig. 3, right) on this machine.

    python bench/sparse.py [--quick] [--out FILE.json] [--plot FILE.png] [--P 4,8] [--N 16777216]
                           [--densities D,...] [--reps R] [--partial solo|majority|two_choice]

P real processes on one host over ``tcp://127.0.0.1`` (on a 2-core machine the P ranks share
two cores: times include that contention). Each rank holds ``k = density * N`` float32 values
at uniformly random indices. For each density we time SSAR_Recursive_double,
SSAR_Split_allgather, DSAR_Split_allgather and asynccoll's dense allreduce of the densified
vector, plus Gloo's dense allreduce (torch.distributed) when torch is importable. A repetition
starts after a barrier; its time is the slowest rank's; rows carry the median, min and max
over repetitions after one warm-up. ``--quick``: N = 1M and 3 repetitions; full: N = 16M, 5.

Through a Communicator, in two worlds (shared memory on, the default on one host, and
``ASYNCCOLL_SHM=0``): ``comm.sparse_allreduce`` and a persistent handle with
``ssar_split_allgather`` (rows ``ssar_split_allgather-shm``/``-comm-tcp`` and
``-handle-shm``/``-handle-tcp``), and with ``--partial KIND`` a sparse partial handle of that
kind (``partial-KIND-shm``/``-tcp``: a call's time to its result, its last round flushed after
the timed calls).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from importlib.util import find_spec
from typing import Any

import numpy as np

from asynccoll import DataPath

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import free_port, peer_missing, spawn_world, stats, write_json

SECRET = b"bench-sparse-secret-0123456789ab"
IMPLS = ["ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather", "dense"]
#: the rows through a Communicator (``comm.sparse_allreduce``, algorithm ssar_split_allgather):
#: its default on one host, through shared memory, and the same with ``ASYNCCOLL_SHM=0``; then
#: the same two worlds through a persistent handle (``comm.sparse_allreduce_handle``)
COMM_IMPLS = ["ssar_split_allgather-shm", "ssar_split_allgather-comm-tcp",
              "ssar_split_allgather-handle-shm", "ssar_split_allgather-handle-tcp"]
SPARSE_ROWS = [*IMPLS[:3], *COMM_IMPLS]
DENSITIES = [0.0001, 0.001, 0.00781, 0.03, 0.1]


def _data(rank: int, N: int, density: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([rank, int(density * 1e7), N])
    k = max(1, round(density * N))
    idx = np.sort(rng.choice(N, k, replace=False)).astype(np.int32)
    return idx, rng.standard_normal(k).astype(np.float32)


async def _worker_main(rank: int, P: int, N: int, reps: int, densities: list[float],
                       addr_q: Any, peers_q: Any, res_q: Any) -> None:
    from asynccoll.collectives.dense import allreduce, barrier, scratch_buffers
    from asynccoll.collectives.sparse import SparseVector
    from asynccoll.comm.sparse import SparseAllreduce
    from asynccoll.sched import Executor
    from asynccoll.transport.tcp import TcpTransport

    t = TcpTransport(rank, P, secret=SECRET)
    addr_q.put((rank, await t.listen("tcp://127.0.0.1:0")))
    peers = await asyncio.get_running_loop().run_in_executor(None, peers_q.get, True, 120)
    await t.connect({r: a for r, a in peers.items() if r != rank}, timeout=60)
    try:
        bar = Executor(barrier(rank, P), t, {}, sched_id=1)
        ds = allreduce(rank, P, N, np.float32)
        data = np.zeros(N, np.float32)
        dense = Executor(ds, t, {"data": data, **scratch_buffers(ds)}, sched_id=2)
        sid = 10
        # warm every connection and code path once before anything is timed
        idx, vals = _data(rank, N, densities[0])
        for impl in IMPLS[:3]:
            op = SparseAllreduce(t, N, np.float32, sched_id=sid, algorithm=impl)
            sid += 1
            await op.run(SparseVector(idx, vals, N), timeout=300)
            op.close()
        dense.start()
        await dense.wait(300)
        for d in densities:
            idx, vals = _data(rank, N, d)
            x = SparseVector(idx, vals, N)
            for impl in IMPLS:
                op = None
                if impl != "dense":
                    op = SparseAllreduce(t, N, np.float32, sched_id=sid, algorithm=impl)
                    sid += 1
                times = []
                for rep in range(reps + 1):
                    if op is None:
                        data.fill(0)
                        data[idx] = vals
                    bar.start()
                    await bar.wait(120)
                    t0 = time.perf_counter()
                    if op is None:
                        dense.start()
                        await dense.wait(300)
                    else:
                        await op.run(x, timeout=300)
                    if rep:
                        times.append(time.perf_counter() - t0)
                if op is not None:
                    op.close()
                res_q.put(("times", rank, impl, d, times))
    finally:
        await t.close()


def _worker(rank: int, P: int, N: int, reps: int, densities: list[float], addr_q: Any,
            peers_q: Any, res_q: Any) -> None:
    try:
        if find_spec("uvloop"):
            import uvloop

            uvloop.install()
        asyncio.run(_worker_main(rank, P, N, reps, densities, addr_q, peers_q, res_q))
        res_q.put(("done", rank, None, None, None))
    except BaseException:
        res_q.put(("error", rank, traceback.format_exc(), None, None))


def _gloo_worker(rank: int, P: int, N: int, reps: int, densities: list[float], port: int,
                 q: Any) -> None:
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=P)
        out: dict[float, list[float]] = {}
        for d in densities:
            idx, vals = _data(rank, N, d)
            x = torch.zeros(N, dtype=torch.float32)
            times = []
            for rep in range(reps + 1):
                x.zero_()
                x[torch.from_numpy(idx.astype(np.int64))] = torch.from_numpy(vals)
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                if rep:
                    times.append(time.perf_counter() - t0)
            out[d] = times
        dist.destroy_process_group()
        q.put((rank, "ok", out))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def _collect(procs: list[Any], res_q: Any, P: int, timeout: float
             ) -> dict[tuple[str, float], list[list[float]]]:
    got: dict[tuple[str, float], list[list[float]]] = {}
    done = 0
    deadline = time.monotonic() + timeout
    while done < P:
        try:
            kind, rank, a, b, c = res_q.get(timeout=max(1.0, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"workers did not finish within {timeout} s") from None
        if kind == "error":
            raise RuntimeError(f"rank {rank} failed:\n{a}")
        if kind == "done":
            done += 1
        else:
            got.setdefault((a, b), []).append(c)
    return got


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)


def run_ours(P: int, N: int, reps: int, densities: list[float]) -> dict[Any, Any]:
    ctx = mp.get_context("spawn")
    addr_q, res_q = ctx.Queue(), ctx.Queue()
    peer_qs = [ctx.Queue() for _ in range(P)]
    procs = [ctx.Process(target=_worker, args=(r, P, N, reps, densities, addr_q, peer_qs[r],
                                               res_q), daemon=True) for r in range(P)]
    try:
        for p in procs:
            p.start()
        addrs: dict[int, str] = {}
        deadline = time.monotonic() + 120
        while len(addrs) < P:
            try:
                r, a = addr_q.get(timeout=1)
            except queue.Empty:
                try:  # a worker that failed before listening says why on the result queue
                    _kind, rank, detail, _, _ = res_q.get_nowait()
                    raise RuntimeError(f"rank {rank} failed before listening:\n{detail}")
                except queue.Empty:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("workers did not start listening in 120 s") from None
                continue
            addrs[r] = a
        for q in peer_qs:
            q.put(addrs)
        return _collect(procs, res_q, P, 1800)
    finally:
        _kill(procs)


async def _comm_main(rank: int, P: int, port: int, N: int, reps: int,
                     densities: list[float], shm: bool, partial: str | None = None
                     ) -> dict[str, dict[float, list[float]]]:
    """Times by form (``comm``: ``comm.sparse_allreduce``; ``handle``: a persistent handle,
    made once per density; ``partial``: a partial handle of kind ``partial``, when given) and
    density."""
    import asynccoll

    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=120)
    out: dict[str, dict[float, list[float]]] = {"comm": {}, "handle": {}, "partial": {}}
    async with comm:
        for d in densities:
            idx, vals = _data(rank, N, d)
            x = asynccoll.SparseVector(idx, vals, N)
            h = comm.sparse_allreduce_handle(N, algorithm="ssar_split_allgather",
                                             name=f"bench-{d}")
            if h.shm != shm:
                raise AssertionError(f"the handle's shm is {h.shm}, the world's {shm}")
            for form in ("comm", "handle"):
                times = []
                for rep in range(reps + 1):
                    await comm.barrier(timeout=120)
                    t0 = time.perf_counter()
                    if form == "comm":
                        await comm.sparse_allreduce(x, algorithm="ssar_split_allgather",
                                                    timeout=300)
                    else:
                        await h(x, timeout=300)
                    if rep:
                        times.append(time.perf_counter() - t0)
                out[form][d] = times
            await h.close()
            if partial is not None:  # its sparse allreduce the split allgather, as above
                ph = comm.partial_allreduce(partial, like=x, name=f"bench-partial-{d}",
                                            path=DataPath(algorithm='ssar_split_allgather'))
                if (ph._segments is not None) != shm:
                    raise AssertionError(f"the partial handle's shm is not the world's {shm}")
                times = []
                for rep in range(reps + 1):
                    await comm.barrier(timeout=120)
                    t0 = time.perf_counter()
                    await ph(x, timeout=300)
                    if rep:
                        times.append(time.perf_counter() - t0)
                out["partial"][d] = times
                await ph.flush(timeout=300)
                await ph.close()
        await comm.barrier(timeout=120)
    return out


def _comm_worker(rank: int, P: int, port: int, N: int, reps: int, densities: list[float],
                 shm: bool, partial: str | None, q: Any) -> None:
    try:
        os.environ["ASYNCCOLL_SECRET"] = SECRET.decode()
        os.environ["ASYNCCOLL_SHM"] = "1" if shm else "0"
        if find_spec("uvloop"):
            import uvloop

            uvloop.install()
        q.put((rank, "ok", asyncio.run(_comm_main(rank, P, port, N, reps, densities, shm,
                                                  partial))))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def run_comm(P: int, N: int, reps: int, densities: list[float],
             partial: str | None = None) -> dict[Any, Any]:
    got: dict[Any, Any] = {}
    for shm, (comm_row, handle_row) in ((True, COMM_IMPLS[::2]), (False, COMM_IMPLS[1::2])):
        by_rank = spawn_world(_comm_worker, P, (free_port(), N, reps, densities, shm, partial),
                              1800)
        forms = [("comm", comm_row), ("handle", handle_row)]
        if partial is not None:
            forms.append(("partial", f"partial-{partial}-{'shm' if shm else 'tcp'}"))
        for form, impl in forms:
            got.update({(impl, d): [times[form][d] for times in by_rank] for d in densities})
    return got


def run_gloo(P: int, N: int, reps: int, densities: list[float]) -> dict[Any, Any]:
    by_rank = spawn_world(_gloo_worker, P, (N, reps, densities, free_port()), 1800)
    return {("gloo", d): [times[d] for times in by_rank] for d in densities}


def rows_of(got: dict[tuple[str, float], list[list[float]]], P: int, N: int
            ) -> list[dict[str, Any]]:
    rows = []
    order = [*IMPLS, *COMM_IMPLS, "gloo"]

    def rank_of(impl: str) -> int:  # the partial rows last
        return order.index(impl) if impl in order else len(order)

    for (impl, d), per_rank in sorted(got.items(), key=lambda kv: (rank_of(kv[0][0]), kv[0][0],
                                                                      kv[0][1])):
        slowest = [max(ts) * 1e3 for ts in zip(*per_rank, strict=True)]
        rows.append({"impl": impl, "P": P, "N": N, "density": d, **stats("time_ms", slowest),
                     "reps": len(slowest)})
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ps = sorted({r["P"] for r in rows})
    fig, axes = plt.subplots(1, len(Ps), figsize=(6 * len(Ps), 4.5), squeeze=False)
    for ax, P in zip(axes[0], Ps, strict=True):
        extra = sorted({r["impl"] for r in rows} - {*IMPLS, *COMM_IMPLS, "gloo"})
        for impl in [*IMPLS, *COMM_IMPLS, "gloo", *extra]:
            rs = sorted((r for r in rows if r["P"] == P and r["impl"] == impl),
                        key=lambda r: r["density"])
            if not rs:
                continue
            xs = [r["density"] * 100 for r in rs]
            ax.errorbar(xs, [r["time_ms_median"] for r in rs],
                        yerr=[[r["time_ms_median"] - r["time_ms_min"] for r in rs],
                              [r["time_ms_max"] - r["time_ms_median"] for r in rs]],
                        marker="o", capsize=3, label=impl,
                        # (more rows than the default colour cycle: the partial ones dashed)
                        linestyle="--" if impl.startswith("partial") else "-")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density per rank (%)")
        ax.set_ylabel("allreduce time (ms)")
        ax.set_title(f"P = {P}, N = {rows[0]['N']:,} float32, one host")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary(rows: list[dict[str, Any]], P: int, d: float) -> dict[str, Any]:
    """Best sparse algorithm at (P, d) and its speedup over the dense rows."""
    at = {r["impl"]: r["time_ms_median"] for r in rows if r["P"] == P and r["density"] == d}
    sparse = {k: v for k, v in at.items() if k in SPARSE_ROWS}
    if not sparse:
        return {}
    best = min(sparse, key=lambda k: sparse[k])
    out: dict[str, Any] = {"P": P, "density": d, "best": best, "best_ms": sparse[best]}
    for ref in ("dense", "gloo"):
        if ref in at:
            out[f"speedup_vs_{ref}"] = at[ref] / sparse[best]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="N = 1M, 3 repetitions (< 60 s)")
    p.add_argument("--out", help="write the JSON results here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--P", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8],
                   help="comma-separated world sizes (default 4,8)")
    p.add_argument("--N", type=int, help="vector length (default 16M, --quick 1M)")
    p.add_argument("--reps", type=int, help="timed repetitions (default 5, --quick 3)")
    p.add_argument("--densities", type=lambda s: [float(x) for x in s.split(",")],
                   default=DENSITIES, help="comma-separated fractions (default %(default)s)")
    p.add_argument("--partial", choices=["solo", "majority", "two_choice"],
                   help="also time a sparse partial handle of this kind (rows "
                        "partial-KIND-shm and partial-KIND-tcp, in the worlds of the "
                        "Communicator rows)")
    args = p.parse_args(argv)
    N = args.N or (1 << 20 if args.quick else 1 << 24)
    reps = args.reps or (3 if args.quick else 5)
    why = peer_missing("gloo")
    have_torch = why is None
    if why is not None:
        print(f"sparse: {why}; the gloo rows are absent", file=sys.stderr)
    print(f"sparse: {os.cpu_count()} CPUs; P ranks share them", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for P in args.P:
        t0 = time.monotonic()
        got = run_ours(P, N, reps, args.densities)
        got.update(run_comm(P, N, reps, args.densities, args.partial))
        if have_torch:
            got.update(run_gloo(P, N, reps, args.densities))
        new = rows_of(got, P, N)
        rows += new
        print(f"sparse: P={P} done in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        for r in new:
            print(f"  {r['impl']:22s} d={r['density'] * 100:7.3f} %  "
                  f"{r['time_ms_median']:9.2f} ms  [{r['time_ms_min']:.2f}, "
                  f"{r['time_ms_max']:.2f}]", file=sys.stderr)
    summaries = [summary(rows, P, d) for P in args.P for d in args.densities]
    for s in summaries:
        print(f"sparse: {json.dumps(s)}", file=sys.stderr)
    params = {"N": N, "P": args.P, "densities": args.densities, "reps": reps,
              "quick": args.quick, "partial": args.partial, "dtype": "float32",
              "transport": "tcp://127.0.0.1",
              "time": "slowest rank, from a barrier"}
    if args.out:
        write_json(args.out, "sparse", params, rows, packages=("uvloop", "torch", "msgpack"),
                   extra={"summary": summaries})
    if args.plot and rows:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
