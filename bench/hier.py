"""Hierarchical against flat allreduce across two "hosts" made of network namespaces.

    sudo python bench/hier.py [--quick] [--out FILE.json] [--plot FILE.png] [--sizes ...]

Two network namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2), two ranks in each,
each namespace its own host (``ASYNCCOLL_HOST_ID``): ``asynccoll-hier`` is the default
allreduce, which sums each host's data through shared memory, allreduces between the two host
leaders over tcp across the veth and hands the result back through shared memory;
``asynccoll-tcp`` is the flat allreduce over tcp among all four ranks (``ASYNCCOLL_SHM=0``).
float32 sum in place, each call after a barrier, a call's time is the slowest rank's; the two
modes alternate so both see the same noise. Needs root and ``ip netns`` (it says so and writes
nothing otherwise); the namespaces are removed at the end. The veth pair is not shaped: it is
as fast as loopback, so the comparison is of the bytes each mode moves through the kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import SECRET, stats, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [1 << 20, 16 << 20, 64 << 20]
IMPLS = ("asynccoll-tcp", "asynccoll-hier")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def netns_missing() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    probe = f"acc-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"'ip netns add' failed: {exc}"
    _ip("netns", "del", probe)
    return None


class Hosts:
    """Two namespaces joined by a veth pair; removed on exit."""

    def __init__(self) -> None:
        tag = os.getpid() % 10000
        self.ns = [f"acc-h1-{tag}", f"acc-h2-{tag}"]
        self.addr = ["10.77.0.1", "10.77.0.2"]

    def __enter__(self) -> Hosts:
        a, b = self.ns
        for ns in self.ns:
            _ip("netns", "add", ns)
        va, vb = f"accv1-{os.getpid() % 10000}", f"accv2-{os.getpid() % 10000}"
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, dev, ip in ((a, va, self.addr[0]), (b, vb, self.addr[1])):
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        return self

    def __exit__(self, *exc: Any) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def worker(out: str, sizes: list[int], calls: int, warm: int) -> None:
    import asyncio

    import numpy as np

    import asynccoll

    async def main() -> dict[str, list[float]]:
        comm = await asynccoll.connect(timeout=60, collective_timeout=120)
        res: dict[str, list[float]] = {}
        async with comm:
            for size in sizes:
                x = np.full(size // 4, comm.rank + 1, np.float32)
                times = []
                for i in range(warm + calls):
                    x[...] = comm.rank + 1
                    await comm.barrier()
                    t0 = time.perf_counter()
                    await comm.allreduce(x, out=x)
                    if i >= warm:
                        times.append(time.perf_counter() - t0)
                if x[0] != 10 or x[-1] != 10:
                    raise AssertionError(f"wrong sum {x[0]}")
                res[str(size)] = times
            await comm.barrier()
            await asyncio.sleep(0.2)
        return res

    data = asyncio.run(main())
    with open(out, "w") as f:
        json.dump(data, f)


def run(hosts: Hosts, impl: str, sizes: list[int], calls: int, warm: int,
        port: int) -> dict[int, list[float]]:
    with tempfile.TemporaryDirectory() as d:
        procs = []
        try:
            for rank in range(4):
                h = rank // 2
                env = {**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_RANK": str(rank),
                       "ASYNCCOLL_WORLD_SIZE": "4",
                       "ASYNCCOLL_STORE": f"{hosts.addr[0]}:{port}",
                       "ASYNCCOLL_SECRET": SECRET, "ASYNCCOLL_HOST_ID": f"bench-host-{h}",
                       "ASYNCCOLL_SHM": "0" if impl == "asynccoll-tcp" else "1",
                       "OMP_NUM_THREADS": "1"}
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", hosts.ns[h], sys.executable, __file__, "--worker",
                     f"{d}/rank{rank}.json", json.dumps(sizes), str(calls), str(warm)],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            for p in procs:
                out, _ = p.communicate(timeout=600)
                if p.returncode != 0:
                    raise RuntimeError(f"{impl}: a rank failed:\n{out}")
            every = [json.load(open(f"{d}/rank{r}.json")) for r in range(4)]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    return {s: [max(e[str(s)][i] for e in every) for i in range(calls)] for s in sizes}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1], json.loads(argv[2]), int(argv[3]), int(argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/results/hier.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per mode")
    args = ap.parse_args(argv)
    why = netns_missing()
    if why:
        print(f"hier: cannot run: {why}", file=sys.stderr)
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    calls, warm = (5, 2) if args.quick else (10, 3)
    per: dict[tuple[str, int], list[float]] = {}
    with Hosts() as hosts:
        for rnd in range(1 if args.quick else args.rounds):
            for impl in IMPLS:
                t0 = time.time()
                got = run(hosts, impl, sizes, calls, warm, 29500 + rnd * 2 + IMPLS.index(impl))
                for s, ts in got.items():
                    per.setdefault((impl, s), []).extend(ts)
                print(f"hier: round {rnd + 1} {impl} done in {time.time() - t0:.1f} s",
                      file=sys.stderr)
    rows = []
    for (impl, size), ts in per.items():
        us = [t * 1e6 for t in ts]
        rows.append({"impl": impl, "size": size, "calls": len(us), "P": 4, "hosts": 2,
                     **stats("time_us", us),
                     "algbw_gbps_median": size / (statistics.median(us) * 1e-6) / 1e9})
    ratios = {}
    for size in sizes:
        flat = next(r for r in rows if r["impl"] == "asynccoll-tcp" and r["size"] == size)
        hier = next(r for r in rows if r["impl"] == "asynccoll-hier" and r["size"] == size)
        ratios[f"hier/flat {size}B"] = flat["time_us_median"] / hier["time_us_median"]
    for r in sorted(rows, key=lambda r: (r["size"], r["impl"])):
        print(f"  {r['impl']:>15} {r['size']:>10} B  median {r['time_us_median'] / 1e3:8.2f} ms"
              f"  (min {r['time_us_min'] / 1e3:.2f}, max {r['time_us_max'] / 1e3:.2f})")
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}x faster")
    write_json(args.out, "hier", {"sizes": sizes, "quick": args.quick, "calls": calls,
                                  "ranks_per_host": [2, 2], "link": "veth, unshaped"},
               rows, extra={"ratios": ratios})
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    for impl in IMPLS:
        rs = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["size"])
        ax.errorbar([r["size"] for r in rs], [r["time_us_median"] / 1e3 for r in rs],
                    yerr=[[(r["time_us_median"] - r["time_us_min"]) / 1e3 for r in rs],
                          [(r["time_us_max"] - r["time_us_median"]) / 1e3 for r in rs]],
                    marker="o", capsize=2, label=impl)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("ms per allreduce (median, min-max)")
    ax.set_title("2 hosts (netns) x 2 ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
