"""Waking an idle rank: what a hop costs after the ranks idled (the simulator's wake-up figure).

    python bench/wake.py [--quick] [--out FILE.json] [--plot FILE.png] [--P 2,4,8]
                         [--gaps-ms 0,0.3,1,3] [--passes N] [--rounds N]

P processes on this host pass an empty message around a ring (rank 0 to 1, ..., P - 1 back
to 0), ``--passes`` times per world, rank 0 idling a gap before each pass, so that every rank
the message reaches has idled about that long; the time of rank 0's pass (from the send to the
message's return, the gap not included) over P is the cost of a hop. ``asynccoll`` passes it
with a schedule (every rank's call, send and receive through the runtime, progress thread and
tcp); ``asyncio-raw`` (the peer) with one byte over plain asyncio streams on loopback. What the
gap adds per hop is the wake-up of an idle rank: a property of the machine (the raw peer pays
it too), which ``asynccoll sim calibrate`` measures for the simulator's pool of cores
(``Profile.wake_cpu``; docs/sim.md, "Waking an idle rank").

Each row: ``impl``, ``P``, ``gap_ms``, ``pass_us_median`` / ``_min`` / ``_max`` over the
``--rounds`` worlds (each world's value the median of its passes after three warm-up passes),
``hop_us_median`` and ``extra_per_hop_us`` (against the same impl and P back to back).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import free_port, spawn_world, write_json

from asynccoll.sim.calibrate import _ring

SECRET = "asynccoll-bench-wake-secret-0123456789abcdef"
WARMUP = 3


async def _asynccoll_rank(rank: int, P: int, port: int, gaps: list[float],
                          passes: int) -> dict[float, list[float]]:
    import asynccoll

    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=60)
    out: dict[float, list[float]] = {}
    async with comm:
        for gap in gaps:
            ts = out[gap] = []
            for i in range(passes + WARMUP):
                if rank == 0 and gap:
                    await asyncio.sleep(gap)  # every rank idles meanwhile
                t = time.perf_counter()
                await comm._run(comm._dense_call(("bench.wake.ring",),
                                                 lambda: _ring(rank, P, P), None, 30))
                if i >= WARMUP:
                    ts.append(time.perf_counter() - t)
            await comm.barrier(timeout=30)
    return out


async def _raw_rank(rank: int, P: int, port: int, gaps: list[float],
                    passes: int) -> dict[float, list[float]]:
    """The peer: a ring of plain asyncio TCP streams on ports ``port + r``, one byte a pass."""
    got: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def accepted(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await got.put((r, w))

    server = await asyncio.start_server(accepted, "127.0.0.1", port + rank)
    nxt = (rank + 1) % P
    for _ in range(600):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port + nxt)
            break
        except OSError:
            await asyncio.sleep(0.05)
    else:
        raise RuntimeError(f"rank {rank}: no listener on port {port + nxt}")
    reader, back = await got.get()
    out: dict[float, list[float]] = {}
    try:
        for gap in gaps:
            ts = out[gap] = []
            for i in range(passes + WARMUP):
                if rank == 0:
                    if gap:
                        await asyncio.sleep(gap)
                    t = time.perf_counter()
                    writer.write(b"x")
                    await reader.readexactly(1)
                    if i >= WARMUP:
                        ts.append(time.perf_counter() - t)
                else:
                    await reader.readexactly(1)
                    writer.write(b"x")
    finally:
        writer.close()
        back.close()
        server.close()
    return out


def _child(rank: int, P: int, impl: str, port: int, gaps: list[float], passes: int,
           q: Any) -> None:
    try:
        os.environ["ASYNCCOLL_SECRET"] = SECRET
        fn = _asynccoll_rank if impl == "asynccoll" else _raw_rank
        q.put((rank, "ok", asyncio.run(fn(rank, P, port, gaps, passes))))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def _port(impl: str, P: int) -> int:
    """A free port, and for the raw ring P consecutive ones from it (retried until free)."""
    import socket

    for _ in range(50):
        base = free_port()
        if impl == "asynccoll":
            return base
        try:
            socks = []
            for r in range(P):
                s = socket.socket()
                s.bind(("127.0.0.1", base + r))
                socks.append(s)
            for s in socks:
                s.close()
            return base
        except OSError:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {P} consecutive free ports")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/results/wake.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--P", default="2,4,8")
    ap.add_argument("--gaps-ms", default="0,0.3,1,3")
    ap.add_argument("--passes", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    Ps = [int(p) for p in a.P.split(",") if p]
    gaps = [float(g) * 1e-3 for g in a.gaps_ms.split(",") if g]
    if any(p < 2 for p in Ps) or any(g < 0 for g in gaps) or a.passes < 1 or a.rounds < 1:
        ap.error("--P needs values >= 2, --gaps-ms values >= 0, --passes and --rounds >= 1")
    if 0.0 not in gaps:
        gaps.insert(0, 0.0)  # the back-to-back reference
    passes, rounds = (10, 1) if a.quick else (a.passes, a.rounds)
    rows: list[dict[str, Any]] = []
    for impl in ("asynccoll", "asyncio-raw"):
        for P in Ps:
            per: dict[float, list[float]] = {g: [] for g in gaps}
            for _ in range(rounds):
                out = spawn_world(_child, P, (impl, _port(impl, P), gaps, passes), 300)
                for g in gaps:
                    per[g].append(float(np.median(out[0][g])))
            base = float(np.median(per[0.0]))
            for g in gaps:
                v = np.array(per[g]) * 1e6
                med = float(np.median(v))
                rows.append({"impl": impl, "P": P, "gap_ms": g * 1e3,
                             "pass_us_median": med, "pass_us_min": float(v.min()),
                             "pass_us_max": float(v.max()), "hop_us_median": med / P,
                             "extra_per_hop_us": (med - base * 1e6) / P})
                print(f"{impl:12s} P={P} after {g * 1e3:4.1f} ms idle: pass {med:7.0f} us "
                      f"({v.min():.0f}-{v.max():.0f}), {med / P:5.0f} us per hop, "
                      f"{(med - base * 1e6) / P:+5.0f} us per hop against back to back",
                      file=sys.stderr)
    write_json(a.out, "wake", {"quick": a.quick, "P": Ps, "gaps_ms": [g * 1e3 for g in gaps],
                               "passes": passes, "rounds": rounds, "warmup": WARMUP}, rows)
    if a.plot:
        plot(rows, a.plot)
    return 0


def plot(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for impl, style in (("asynccoll", "-o"), ("asyncio-raw", "--s")):
        for P in sorted({r["P"] for r in rows}):
            rs = sorted((r for r in rows if r["impl"] == impl and r["P"] == P),
                        key=lambda r: r["gap_ms"])
            if rs:
                ax.plot([r["gap_ms"] for r in rs], [r["hop_us_median"] for r in rs], style,
                        label=f"{impl}, P = {P}")
    ax.set_xlabel("idle before each pass (ms)")
    ax.set_ylabel("one hop of the ring (µs, median)")
    ax.set_title("Waking an idle rank: a ring of processes on this host")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
