"""``asynccoll sim calibrate``: measure this machine's cost model and write a profile.

What is measured (about 30 s per transport on a 2-core machine):

* ``gamma``, the per-op CPU cost: the real executor runs a dense allreduce schedule of P = 8
  ranks over the in-process transport (no wire), and the time per op fired is the CPU an op
  costs (posting, matching, completion, the kernel call for a 4-byte reduction);
* ``reduce_bps``: ``np.add`` of two 16 MiB float32 arrays into one, bytes of output per second;
* ``alpha``, ``beta`` per transport (``tcp``; ``ucx`` when ucxx imports): two processes
  (spawned, ``ASYNCCOLL_SHM=0`` so that the allreduces take the transport, not shared memory,
  as ``bench/allreduce.py``'s ``asynccoll-tcp`` does) connect through the rendezvous and time
  4-byte and 4 MiB allreduces; P = 2
  recursive doubling is one exchange, so ``T(n) = alpha + 3 gamma + n beta + n / reduce_bps``
  on the path an allreduce takes, which gives ``alpha`` and ``beta`` (from 2 MiB the pair's
  allreduce is two rounds of 1 MiB segments, so the 4 MiB call's ``beta`` is an average over
  that path: it prices the profile's dedicated links, the pool is fitted apart); measured
  twice, with the progress thread and inline, the difference is the call's thread hop
  (``call_overhead``); and at :data:`SHAPE_SIZES` too, inline, each one message of the whole
  vector: ``(T(n) - T(4) - n / reduce_bps) / n`` by size is the profile's ``byte_shape``
  (:func:`byte_shape`; the cost per byte is not the same at every size, :mod:`.cost`);
* the **time-shared cores'** figures (:class:`~asynccoll.sim.cost.SharedCores`): a world of
  ``2 * cores`` processes (each core time-shared by two ranks, every wake-up a context switch)
  runs back-to-back barriers and back-to-back large allreduces; ``alpha`` is the intra-host
  latency that makes the simulated barrier of that world as slow as the real one, then
  ``beta`` the per-byte cost that does the same for the allreduce (:func:`fit_shared`; the
  simulator's own schedules and scaling, so only the link's two figures are fitted); and
  ``exit_gap`` the median spread of the ranks' exits from a barrier there (two waves of
  ``cores`` ranks: one gap); and the **pool's** figures from the same two periods
  (:func:`fit_pool`): the CPU per message and per byte at the receiver that make the
  simulated world, its cores a pool, take what the real one took;
* the pool's **wake-up figure** in the same world: its first four ranks pass an empty message
  around a ring (:func:`_ring`), back to back and with rank 0 idling :data:`RING_GAP` before
  each pass, so that rank 0's call and the receipts at ranks 1-3 each wake a rank idle that
  long (back to back none idles past :data:`~asynccoll.sim.cost.WAKE_FROM`); :func:`fit_wake`
  finds the extra CPU per wake-up at a long-idle rank that makes the simulated ring slow down
  by as much as the real one did (:attr:`~asynccoll.sim.cost.Profile.wake_cpu`).

Both link classes get the measured figures (every rank of this machine shares one host, so the
inter-host class is a stand-in until calibrated on two hosts). ``cores`` is the number of cores
this process may run on and ``ranks_per_host`` is left at 1: the simulation places the ranks
with :meth:`~asynccoll.sim.cost.Profile.placed` (``bench/sim_validate.py`` does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from ..sched import Schedule
from .cost import LinkClass, Profile, SharedCores

__all__ = ["RING_GAP", "RING_RANKS", "SHAPE_SIZES", "available_transports", "byte_shape",
           "calibrate", "fit_pool", "fit_shared", "fit_wake", "measure_gamma", "measure_reduce"]

_SECRET = "asynccoll-sim-calibration-secret-0123456789"

#: the allreduce sizes (bytes) the two-process pair also times for the profile's
#: ``byte_shape``, beside the 4-byte and the large one: at P = 2 each is one exchange of the
#: whole vector (from 2 MiB the pair's allreduce sends 1 MiB segments in two rounds: the 4 MiB
#: one fires 10 ops and adds 2 MiB, not what one message costs); a P = 4 or 8 allreduce of 1 MiB
#: sends 128-512 KiB, a 4 MiB one at P = 4 (the pool's fit) 1 MiB
SHAPE_SIZES = (1 << 16, 1 << 18, 1 << 19, 1 << 20)

#: seconds rank 0 idles before each pass of the ring that measures the wake-up figure: its call
#: and ranks 1-3 then come after more than :data:`~asynccoll.sim.cost.WAKE_FULL` of idling
RING_GAP = 4e-3
#: the ranks the ring passes through (the first ones of the time-shared world)
RING_RANKS = 4


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


def _child_env() -> None:
    """A calibration rank's environment: the job's secret, and ``ASYNCCOLL_SHM=0`` so that the
    allreduces take the transport being measured (on one host the default allreduce would take
    shared memory from 128 KiB up: until 2026-11-24 the large allreduces were measured so)."""
    os.environ["ASYNCCOLL_SECRET"] = _SECRET
    os.environ["ASYNCCOLL_SHM"] = "0"


def _child(rank: int, port: int, progress: str, transport: str, sizes: list[int],
           calls: int, q: Any) -> None:
    try:
        _child_env()
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
        got = _reports(q, 2, timeout)
        return dict(got[0])
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _ring(rank: int, world: int, ranks: int = RING_RANKS) -> Schedule:
    """One pass of an empty message around the first ``ranks`` ranks (all of them in a smaller
    world): rank 0 sends to 1, each passes it on once it came, and rank 0's pass ends when it
    comes back; the other ranks have nothing to do (``bench/wake.py`` passes it through all).
    With four, back to back each rank waits only for the others' three hops (under
    :data:`~asynccoll.sim.cost.WAKE_FROM` here); after rank 0 idled :data:`RING_GAP`, ranks 1
    to 3 have idled longer than :data:`~asynccoll.sim.cost.WAKE_FULL` when it reaches them."""
    n = min(ranks, world)
    s = Schedule(rank, world, name="calibration.ring")
    if rank >= n:
        s.final = s.nop(label="final")
    elif rank == 0:
        out = s.send(1, None, label="ring")
        back = s.recv(n - 1, None, label="ring")
        s.final = s.nop(deps=[out, back], label="final")
    else:
        got = s.recv(rank - 1, None, label="ring")
        s.final = s.send((rank + 1) % n, None, deps=[got], label="ring")
    return s.commit()


def _world_child(rank: int, world: int, port: int, transport: str, barriers: int,
                 large: int, calls: int, rings: int, q: Any) -> None:
    try:
        _child_env()
        import asynccoll

        async def main() -> tuple[list[float], list[float], dict[float, list[float]]]:
            comm = await asynccoll.connect(rank=rank, world_size=world,
                                           store=f"127.0.0.1:{port}", transport=transport,
                                           timeout=60)
            x = np.ones(large // 4, np.float32)
            bar, big = [], []
            ring: dict[float, list[float]] = {}
            async with comm:
                for i in range(barriers + 5):
                    await comm.barrier(timeout=30)
                    if i >= 5:
                        bar.append(time.perf_counter())  # one clock for the host's processes
                for i in range(calls + 2):
                    await comm.allreduce(x, out=x, timeout=60)
                    if i >= 1:
                        big.append(time.perf_counter())
                await comm.barrier(timeout=30)
                for gap in (0.0, RING_GAP):
                    ts = ring[gap] = []
                    for i in range(rings + 3):
                        if rank == 0 and gap:
                            await asyncio.sleep(gap)  # every rank idles meanwhile
                        t = time.perf_counter()
                        await comm._run(comm._dense_call(("calibration.ring",),
                                                         lambda: _ring(rank, world), None, 30))
                        if i >= 3:
                            ts.append(time.perf_counter() - t)
                await comm.barrier(timeout=30)
            return bar, big, ring

        q.put((rank, "ok", asyncio.run(main())))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def _shared_world(world: int, transport: str, barriers: int, large: int, calls: int,
                  rings: int = 30, timeout: float = 120.0) -> tuple[float, ...]:
    """``world`` spawned processes on this host run back-to-back barriers, then back-to-back
    ``large``-byte allreduces, then ``rings`` passes around a ring back to back and as many
    with rank 0 idling :data:`RING_GAP` before each. Returns the median period of each of the
    first two (the last rank's exit to its next exit), the median spread of the ranks' exits
    from a barrier, and rank 0's median pass back to back and after the gap."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_world_child,
                         args=(r, world, port, transport, barriers, large, calls, rings, q),
                         daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        got = _reports(q, world, timeout)
        bar = np.array([got[r][0] for r in range(world)])
        big = np.array([got[r][1] for r in range(world)])
        ring = got[0][2]
        return (float(np.median(np.diff(bar.max(0)))), float(np.median(np.diff(big.max(0)))),
                float(np.median(bar.max(0) - bar.min(0))), float(np.median(ring[0.0])),
                float(np.median(ring[RING_GAP])))
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _sim_barrier_period(prof: Profile, n: int = 20) -> float:
    """The simulated period of back-to-back barriers of ``prof``'s ranks (one host)."""
    from .dense import SimBarrier
    from .engine import SimWorld

    world = SimWorld(prof.ranks_per_host, prof)
    bar = SimBarrier(world)
    left = [n] * prof.ranks_per_host
    exits: list[float] = []

    def out(r: int) -> None:
        if r == 0:
            exits.append(world.now)
        left[r] -= 1
        if left[r]:
            bar.enter(r, out)

    for r in range(prof.ranks_per_host):
        bar.enter(r, out)
    world.run()
    return float(np.median(np.diff(exits)))


def _sim_allreduce_period(prof: Profile, nbytes: int, n: int = 6) -> float:
    """The simulated period of back-to-back ``nbytes`` allreduces of ``prof``'s ranks."""
    from .arrivals import Constant
    from .run import simulate

    run = simulate("sync", prof.ranks_per_host, n, profile=prof, compute=Constant(0.0),
                   nbytes=nbytes)
    return run.makespan / n


def fit_shared(prof: Profile, world: int, barrier_s: float, large_s: float, large: int,
               exit_gap: float) -> SharedCores:
    """The :class:`SharedCores` whose ``alpha`` and ``beta`` make the simulated world of
    ``world`` ranks on one host (placed by ``prof.placed``) take ``barrier_s`` per barrier
    and ``large_s`` per ``large``-byte allreduce, back to back: ``alpha`` from the barrier (no
    bytes), then ``beta`` from the allreduce, each by the secant method (the periods grow
    with them, piecewise linearly)."""
    def placed(a: float, b: float) -> Profile:
        return prof.with_(shared=SharedCores(a, b, exit_gap, world)).placed(world, "shared")

    alpha, beta = _fit_world(placed, barrier_s, large_s, large, 1e-12)
    return SharedCores(alpha, beta, exit_gap, world)


def fit_pool(prof: Profile, world: int, barrier_s: float, large_s: float,
             large: int) -> tuple[float, float]:
    """The pool's figures (:mod:`.cost`): ``(msg_cpu, byte_cpu)``, the CPU seconds per message
    and per byte at its receiver that make the simulated world of ``world`` ranks on one host
    (``prof``'s cores as a pool, no intra-host delay) take ``barrier_s`` per barrier and
    ``large_s`` per ``large``-byte allreduce, back to back; as :func:`fit_shared`, each by the
    secant method on the simulator itself. With ``prof.byte_shape`` the per-byte figure is that
    of the shape's largest messages (:meth:`~.cost.Profile.byte_factor` scales the others):
    it belongs to that shape."""
    def pooled(m: float, b: float) -> Profile:
        return prof.with_(ranks_per_host=world, shared=None, pool=True, msg_cpu=m,
                          intra=LinkClass(0.0, b))

    return _fit_world(pooled, barrier_s, large_s, large, 1e-13)


def _sim_ring_pass(prof: Profile, gap: float, n: int = 12) -> float:
    """The simulated median time of rank 0's pass around :func:`_ring` (its call, from entry
    to return) among ``prof``'s ranks on one host, rank 0 idling ``gap`` seconds before each
    pass; every call pays the call overhead, as the real one does."""
    from .engine import SimExecutor, SimWorld

    P = prof.ranks_per_host
    world = SimWorld(P, prof)
    half = prof.call_overhead * prof.cpu_scale / 2
    left = [n] * P
    began = [0.0]
    passes: list[float] = []

    def call(r: int) -> None:
        if r == 0:
            began[0] = world.now
        # the call wakes the rank's progress thread, as a message does (run.simulate's calls)
        world.at(world.cpu(r, half, wake=True), exs[r].start)

    def done(r: int, _e: int) -> None:
        world.at(world.cpu(r, half), returned, r)

    def returned(r: int) -> None:
        if r == 0:
            passes.append(world.now - began[0])
        left[r] -= 1
        if left[r]:
            world.at(world.now + (gap if r == 0 else 0.0), call, r)

    exs = [SimExecutor(world, _ring(r, P), sched_id=7, on_complete=functools.partial(done, r))
           for r in range(P)]
    for r in range(P):
        world.at(gap if r == 0 else 0.0, call, r)
    world.run()
    return float(np.median(passes[2:]))


def fit_wake(prof: Profile, ring_s: float, ring_gap_s: float) -> float:
    """The pool's wake-up figure (:attr:`~asynccoll.sim.cost.Profile.wake_cpu`): the extra
    CPU seconds per message at a long-idle receiver that make the simulated ring of ``prof``
    (a pooled profile, its ranks on one host) take as much longer after :data:`RING_GAP` of
    idling as the real one took (``ring_gap_s`` against ``ring_s`` back to back), by
    bisection on the simulator itself (the simulated difference grows with the figure: back
    to back no rank of the ring idles long enough to pay it). 0 when the real ring did not
    slow down more than the simulated one does without it, or a time is not finite."""
    def extra(w: float) -> float:
        p = prof.with_(wake_cpu=w)
        return _sim_ring_pass(p, RING_GAP) - _sim_ring_pass(p, 0.0)

    target = ring_gap_s - ring_s
    if not (math.isfinite(target) and target > extra(0.0)):
        return 0.0
    lo, hi = 0.0, 1e-4
    while extra(hi) < target:
        lo, hi = hi, 2 * hi
        if hi > 1.0:
            raise RuntimeError(f"the ring slowed down by {target * 1e6:.0f} us after idling, "
                               "more than any wake-up figure up to 1 s explains")
    for _ in range(40):
        mid = (lo + hi) / 2
        if extra(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _fit_world(model: Callable[[float, float], Profile], barrier_s: float, large_s: float,
               large: int, byte_lo: float) -> tuple[float, float]:
    """The per-message and per-byte figures ``(x, y)`` that make ``model(x, y)``'s simulated
    world take ``barrier_s`` per barrier (``x``, no bytes) and then ``large_s`` per
    ``large``-byte allreduce (``y``, at least ``byte_lo``), back to back."""
    x = _solve(lambda m: _sim_barrier_period(model(m, 0.0)), barrier_s, 1e-6, 1e-3, 1e-7)
    y = _solve(lambda b: _sim_allreduce_period(model(x, b), large), large_s, 1e-12, 1e-9,
               byte_lo)
    return x, y


def _solve(f: Callable[[float], float], target: float, x0: float, x1: float,
           lo: float) -> float:
    """``x >= lo`` with ``f(x) = target`` for an increasing ``f`` (secant steps)."""
    f0, f1 = f(x0), f(x1)
    for _ in range(12):
        if f1 == f0:
            break
        x2 = max(x1 + (target - f1) * (x1 - x0) / (f1 - f0), lo)
        x0, f0, x1 = x1, f1, x2
        f1 = f(x1)
        if abs(f1 - target) <= 1e-6 * target or x1 == x0:
            break
    return x1


def byte_shape(times: dict[int, float], reduce_bps: float) -> tuple[tuple[int, float], ...]:
    """The profile's ``byte_shape`` from the two-process pair's median allreduce ``times`` by
    size (bytes; the 4-byte call among them): per size n above 4 whose P = 2 allreduce is one
    exchange of n bytes (its schedule sends one message of n bytes, as the 4-byte call does:
    the same ops), ``(T(n) - T(4) - n / reduce_bps) / n``, at least 1e-12 s per byte. Sizes
    the pair's allreduce sends in segments are left out (their extra ops and rounds are not
    the bytes' cost)."""
    from ..collectives.dense import allreduce
    from .engine import _compiled

    out: dict[int, float] = {}
    for n in sorted(times):
        if n <= 4:
            continue
        s = allreduce(0, 2, max(1, n // 4), "float32")
        nb = _compiled(s).nbytes
        if [nb[i] for i, op in enumerate(s.ops) if op.kind == "send"] == [n]:
            out[n] = max((times[n] - times[4] - n / reduce_bps) / n, 1e-12)
    return tuple(sorted(out.items()))


def calibrate(transports: tuple[str, ...] = ("tcp",), *, calls: int = 60,
              large: int = 4 << 20, repeats: int = 5, shared: bool = True) -> dict[str, Profile]:
    """Measure (module doc) and return a profile per transport, named ``local-<transport>``;
    each transport's pair of processes is started ``repeats`` times per configuration and the
    medians' median kept; ``shared``: also measure the time-shared cores (module doc).
    Raises ``RuntimeError`` when the measuring processes fail."""
    gamma = measure_gamma()
    rbps = measure_reduce()
    out: dict[str, Profile] = {}
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")

    def med(runs: list[dict[int, float]], n: int) -> float:
        return float(np.median([m[n] for m in runs]))

    cores = _cores()
    for tr in transports:
        # wake-up latencies on a shared machine swing from minute to minute: the median of
        # ``repeats`` pairs of processes (each its own median of ``calls``), the
        # configurations interleaved so that a busy minute touches them alike. Five, not
        # three (2026-11-24): two of three thread-mode pairs once took 387 µs per 4-byte call
        # where the others took 131-138, and the call overhead came out at 302 µs instead of
        # 45-53; the median of five tolerates two such pairs
        ins, ths, worlds = [], [], []
        sizes = sorted({4, *SHAPE_SIZES, large})
        for _ in range(repeats):
            ins.append(_pair("inline", tr, sizes, calls))
            ths.append(_pair("thread", tr, [4], calls))
            if shared:
                worlds.append(_shared_world(2 * cores, tr, 4 * calls, large, calls // 6 + 2))
        inline = {n: med(ins, n) for n in sizes}
        thread = {4: med(ths, 4)}
        alpha = max(inline[4] - 3 * gamma, 1e-7)
        beta = max((inline[large] - inline[4] - large / rbps) / large, 1e-12)
        over = max(thread[4] - inline[4], 0.0)
        link = LinkClass(alpha, beta)
        figures: dict[str, Any] = {
            "allreduce_p2_4B_inline_us": inline[4] * 1e6,
            f"allreduce_p2_{large}B_inline_us": inline[large] * 1e6,
            "allreduce_p2_4B_thread_us": thread[4] * 1e6, "call_overhead_us": over * 1e6,
            "gamma_us": gamma * 1e6, "reduce_GBps": rbps / 1e9,
            **{f"allreduce_p2_{n}B_inline_us": inline[n] * 1e6 for n in SHAPE_SIZES}}
        shape = byte_shape(inline, rbps)
        figures["byte_shape_GBps"] = {str(m): 1e-9 / b for m, b in shape}
        prof = Profile(
            name=f"local-{tr}", intra=link, inter=link, gamma=gamma, reduce_bps=rbps,
            ranks_per_host=1, cores=cores, call_overhead=over, byte_shape=shape,
            source=f"asynccoll sim calibrate on {socket.gethostname()} at {stamp}: {tr} "
                   f"between two processes (4 B and {large} B allreduces, the median of {repeats} "
                   f"runs' medians of {calls}; per byte by message size at "
                   f"{', '.join(f'{n >> 10} KiB' for n in SHAPE_SIZES)})"
                   + (f"; {2 * cores} ranks time-sharing {cores} cores" if shared else ""),
            figures=figures)
        if shared:
            n = 2 * cores
            bar_s, big_s, gap, ring_s, ring_gap_s = (float(np.median([w[i] for w in worlds]))
                                                     for i in range(5))
            sh = fit_shared(prof, n, bar_s, big_s, large, gap)
            msg_cpu, byte_cpu = fit_pool(prof, n, bar_s, big_s, large)
            wake = fit_wake(prof.with_(ranks_per_host=n, shared=None, pool=True,
                                       msg_cpu=msg_cpu, intra=LinkClass(0.0, byte_cpu)),
                            ring_s, ring_gap_s)
            sh = dataclasses.replace(sh, msg_cpu=msg_cpu, byte_cpu=byte_cpu, wake_cpu=wake)
            figures.update({f"shared_p{n}_barrier_us": bar_s * 1e6,
                            f"shared_p{n}_allreduce_{large}B_us": big_s * 1e6,
                            f"shared_p{n}_exit_spread_us": gap * 1e6,
                            "shared_alpha_us": sh.alpha * 1e6,
                            "shared_beta_GBps": 1e-9 / sh.beta,
                            "pool_msg_cpu_us": msg_cpu * 1e6,
                            "pool_byte_cpu_GBps": 1e-9 / byte_cpu,
                            f"shared_p{n}_ring_us": ring_s * 1e6,
                            f"shared_p{n}_ring_after_{RING_GAP * 1e3:g}ms_us": ring_gap_s * 1e6,
                            "pool_wake_cpu_us": wake * 1e6})
            prof = prof.with_(shared=sh)
        out[tr] = prof
    return out


def _cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def available_transports() -> tuple[str, ...]:
    """``tcp``, plus ``ucx`` when ucxx imports."""
    from importlib.util import find_spec

    return ("tcp", "ucx") if find_spec("ucxx") is not None else ("tcp",)


def _reports(q: Any, n: int, timeout: float) -> dict[int, Any]:
    """The payloads of ``n`` calibration ranks, by rank, from their ``(rank, status, payload)``
    reports on ``q``; ``RuntimeError`` when one failed or they did not all report in time."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(got) < n:
        try:
            rank, status, payload = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(f"calibration ranks did not report within {timeout} s") from None
        if status != "ok":
            raise RuntimeError(f"calibration rank {rank} failed:\n{payload}")
        got[rank] = payload
    return got
