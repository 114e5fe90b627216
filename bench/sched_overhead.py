"""Overhead of the schedule engine per op, on the in-process transport.

    python bench/sched_overhead.py [--quick] [--out FILE.json] [--plot FILE.png]

Cases (each an execution of a committed schedule, timed over many executions):

* ``chain``: 1,000 no-ops, each depending on the previous one (one rank);
* ``fan``: one source, 998 no-ops depending on it, one op depending on all of them (AND);
* ``recdbl16``: a recursive-doubling allreduce schedule (send, receive, sum per step) of 16
  ranks in one process over ``inproc://``, persistent executors, one float32 element, so that
  what is measured is the engine and the matching, not the arithmetic.

* ``bridge``: one round trip from the caller's loop to a progress thread and back, the cost a
  partial call pays on top of its execution unless rule 1 answers it on the caller's thread:
  ``asynccoll`` is :meth:`ProgressEngine.run <asynccoll.comm.progress.ProgressEngine.run>` of a
  coroutine that returns at once, ``run_coroutine_threadsafe`` is the standard library's bridge
  (``asyncio.run_coroutine_threadsafe`` awaited through ``asyncio.wrap_future``, what the engine
  used before), ``wakeups-raw`` the floor: one ``call_soon_threadsafe`` each way resolving a
  future, nothing else.

``us_per_op`` is the wall time of an execution (all ranks) divided by its number of ops.
Peers: the engine has no counterpart in MPI or Gloo; the ``asyncio-raw`` rows time what an
engine pays that resolves one asyncio future per op (from the previous one's callback), the
cost the executor avoids for ops that complete inline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from asynccoll import Executor, Schedule
from asynccoll.testing import inproc_world

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import bar_plot, stats, write_json

CHAIN_OPS = 1000
FAN_WIDTH = 998
RANKS = 16


def chain_schedule(n: int) -> Schedule:
    s = Schedule(0, 1, "chain")
    prev = s.nop()
    for _ in range(n - 1):
        prev = s.nop(deps=prev)
    s.final = prev
    return s.commit()


def fan_schedule(width: int) -> Schedule:
    s = Schedule(0, 1, "fan")
    src = s.nop()
    mid = [s.nop(deps=src) for _ in range(width)]
    s.final = s.nop(deps=mid)
    return s.commit()


def recdbl_schedule(rank: int, world: int) -> Schedule:
    s = Schedule(rank, world, "recdbl", {"x": 1, "tmp": 1})
    prev: list[int] = []
    dist, step = 1, 0
    while dist < world:
        peer = rank ^ dist
        snd = s.send(peer, "x", tag=step, deps=prev)
        rcv = s.recv(peer, "tmp", tag=step, deps=prev)
        prev = [s.compute("sum", ["x", "tmp"], "x", deps=[snd, rcv])]
        dist, step = dist * 2, step + 1
    return s.commit()


Runner = Callable[[int], Awaitable[None]]


async def _time(run: Runner, executions: int, reps: int) -> list[float]:
    await run(max(1, executions // 4))  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await run(executions)
        out.append(time.perf_counter() - t0)
    return out


async def bench_single(schedule: Schedule, executions: int, reps: int) -> list[float]:
    async with inproc_world(1) as (t,):
        ex = Executor(schedule, t, sched_id=1)

        async def run(k: int) -> None:
            for _ in range(k):
                await ex.start()

        times = await _time(run, executions, reps)
        ex.close()
        return times


async def bench_recdbl(executions: int, reps: int) -> tuple[list[float], int]:
    async with inproc_world(RANKS) as ts:
        scheds = [recdbl_schedule(r, RANKS) for r in range(RANKS)]
        bufs = [{"x": np.ones(1, np.float32), "tmp": np.zeros(1, np.float32)}
                for _ in range(RANKS)]
        exs = [Executor(s, t, b, sched_id=1, persistent=True)
               for s, t, b in zip(scheds, ts, bufs, strict=True)]

        async def run(k: int) -> None:
            for _ in range(k):
                for b in bufs:
                    b["x"][0] = 1.0  # keep the sums finite and exact
                await asyncio.gather(*(ex.start() for ex in exs))

        times = await _time(run, executions, reps)
        assert all(b["x"][0] == RANKS for b in bufs), "recursive doubling gave a wrong sum"
        for ex in exs:
            ex.close()
        return times, sum(len(s) for s in scheds)


async def bench_raw_chain(n: int, executions: int, reps: int) -> list[float]:
    loop = asyncio.get_running_loop()

    async def run(k: int) -> None:
        for _ in range(k):
            done: asyncio.Future[None] = loop.create_future()
            left = [n]

            def step(_f: object = None, done: asyncio.Future[None] = done,
                     left: list[int] = left) -> None:
                left[0] -= 1
                if left[0] == 0:
                    done.set_result(None)
                    return
                f: asyncio.Future[None] = loop.create_future()
                f.add_done_callback(step)
                f.set_result(None)

            step()
            await done

    return await _time(run, executions, reps)


async def bench_bridge(impl: str, calls: int, reps: int) -> list[float]:
    from asynccoll.comm.progress import ProgressEngine

    engine = ProgressEngine.thread(switch_interval=None)
    caller = asyncio.get_running_loop()

    async def nothing() -> int:
        return 1

    async def run(k: int) -> None:
        for _ in range(k):
            if impl == "asynccoll":
                await engine.run(nothing())
            elif impl == "run_coroutine_threadsafe":
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(nothing(),
                                                                           engine.loop))
            else:
                done = caller.create_future()
                engine.loop.call_soon_threadsafe(caller.call_soon_threadsafe, done.set_result, 1)
                await done

    try:
        return await _time(run, calls, reps)
    finally:
        engine.close()


def _row(case: str, impl: str, loop: str, ops: int, executions: int, times: list[float],
         **extra: Any) -> dict[str, Any]:
    per = [t / executions / ops * 1e6 for t in times]
    return {"case": case, "impl": impl, "loop": loop, "ops": ops, "executions": executions,
            "repeats": len(times), **extra, "us_per_op": statistics.median(per),
            **stats("us_per_op", per)}


async def measure(loop_name: str, quick: bool) -> list[dict[str, Any]]:
    reps = 7 if quick else 21
    single_execs = 20 if quick else 100
    recdbl_execs = 100 if quick else 500
    rows = []
    t = await bench_single(chain_schedule(CHAIN_OPS), single_execs, reps)
    rows.append(_row("chain", "asynccoll", loop_name, CHAIN_OPS, single_execs, t, P=1))
    fan = fan_schedule(FAN_WIDTH)
    t = await bench_single(fan, single_execs, reps)
    rows.append(_row("fan", "asynccoll", loop_name, len(fan), single_execs, t, P=1))
    t, ops = await bench_recdbl(recdbl_execs, reps)
    rows.append(_row("recdbl16", "asynccoll", loop_name, ops, recdbl_execs, t, P=RANKS))
    t = await bench_raw_chain(CHAIN_OPS, single_execs, reps)
    rows.append(_row("chain", "asyncio-raw", loop_name, CHAIN_OPS, single_execs, t, P=1))
    bridge_calls = 500 if quick else 2000
    for impl in ("asynccoll", "run_coroutine_threadsafe", "wakeups-raw"):
        t = await bench_bridge(impl, bridge_calls, reps)
        rows.append(_row("bridge", impl, loop_name, 1, bridge_calls, t, P=1))
    return rows


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    bar_plot(rows, "us_per_op", [f"{r['case']}\n{r['impl']}\n{r['loop']}" for r in rows], path,
             ylabel="µs per op (median, min-max)",
             title="schedule engine overhead per op (inproc)", target=10,
             target_label="target 10 µs/op")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    p.add_argument("--out", help="write the JSON results here")
    p.add_argument("--plot", help="write a bar chart (PNG) here")
    p.add_argument("--loop", choices=["asyncio", "uvloop", "both"], default="both",
                   help="event loop(s) to measure on (default: both when uvloop is installed)")
    args = p.parse_args(argv)
    loops = ["asyncio", "uvloop"] if args.loop == "both" else [args.loop]
    rows: list[dict[str, Any]] = []
    print("peers: MPI and Gloo have no schedule engine to compare with; the asyncio-raw rows "
          "time one future per op on the same loop", file=sys.stderr)
    for name in loops:
        if name == "uvloop":
            try:
                import uvloop
            except ImportError:
                print("uvloop is not installed: no uvloop rows", file=sys.stderr)
                continue
            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        else:
            runner = asyncio.Runner()
        with runner:
            rows += runner.run(measure(name, args.quick))
    params = {"quick": args.quick, "chain_ops": CHAIN_OPS, "fan_width": FAN_WIDTH,
              "ranks": RANKS, "loops": loops, "transport": "inproc"}
    for r in rows:
        print(f"{r['case']:>9} {r['impl']:>11} {r['loop']:>7} ops={r['ops']:>5}  "
              f"{r['us_per_op_median']:6.2f} µs/op (min {r['us_per_op_min']:.2f}, "
              f"max {r['us_per_op_max']:.2f})")
    if args.out:
        write_json(args.out, "sched_overhead", params, rows, packages=("asynccoll", "uvloop"))
    if args.plot:
        _plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
