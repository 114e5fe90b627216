"""CPU an idle communicator costs: no busy polling.

    python bench/idle_cpu.py [--seconds 10] [--repeats 3] [--out FILE.json] [--plot FILE.png]

Two ranks connected over real loopback (``tcp``, and ``ucx`` when ucxx is installed), each
with its progress thread (``asynccoll.testing.local_world``, one process), and a persistent
solo allreduce handle made and used once, so that receives are posted; then nothing happens
for ``--seconds``. The process's CPU time over that window (``time.process_time``, every
thread) divided by the window is the cost, in percent of one core. Peer in the same run:
``asyncio-raw``, a plain event loop in a thread with one connected socket pair, the floor
of an idle loop. Target (issue 12): under 1 % of a core.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

from asynccoll import Solo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import bar_plot, stats, write_json


async def _idle_asynccoll(transport: str, seconds: float) -> float:
    from asynccoll.testing import local_world

    async with local_world(2, transport, timeout=30) as comms:
        hs = [c.partial_allreduce(Solo(), like=np.zeros(4, np.float32)) for c in comms]
        await asyncio.gather(*(h(np.ones(4, np.float32)) for h in hs))
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.sleep(seconds)
        used = time.process_time() - c0
        wall = time.perf_counter() - t0
        await asyncio.gather(*(h.flush() for h in hs))
    return 100.0 * used / wall


def _idle_raw(seconds: float) -> float:
    loop = asyncio.new_event_loop()
    a, b = socket.socketpair()
    loop.add_reader(a.fileno(), a.recv, 1)
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    t0, c0 = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    used = time.process_time() - c0
    wall = time.perf_counter() - t0
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)
    loop.close()
    a.close()
    b.close()
    return 100.0 * used / wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    impls = ["asynccoll-tcp"] + (["asynccoll-ucx"] if importlib.util.find_spec("ucxx") else [])
    impls.append("asyncio-raw")
    per: dict[str, list[float]] = {i: [] for i in impls}
    for _ in range(args.repeats):  # alternate, so every impl sees the same noise
        for impl in impls:
            if impl == "asyncio-raw":
                pct = _idle_raw(args.seconds)
            else:
                pct = asyncio.run(_idle_asynccoll(impl.split("-")[1], args.seconds))
            per[impl].append(pct)
            print(f"{impl:>14}: {pct:.3f} % of a core over {args.seconds} s", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for impl, vals in per.items():
        rows.append({"impl": impl, "seconds": args.seconds, "repeats": len(vals),
                     **stats("cpu_pct", vals)})
        print(f"{impl:>14}: median {statistics.median(vals):.3f} % of a core "
              f"(min {min(vals):.3f}, max {max(vals):.3f}); target < 1 %")
    if args.out:
        write_json(args.out, "idle_cpu", {"seconds": args.seconds, "repeats": args.repeats},
                   rows, packages=("asynccoll", "uvloop", "ucxx-cu12"))
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    bar_plot(rows, "cpu_pct", [r["impl"] for r in rows], path,
             ylabel="% of one core, idle (median, min-max)", title="an idle communicator",
             target=1.0, target_label="target 1 %")


if __name__ == "__main__":
    sys.exit(main())
