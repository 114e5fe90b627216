"""One simulated training loop: P ranks, ``steps`` calls each, under one policy.

:func:`simulate` drives a :class:`~asynccoll.sim.handle.SimPartial` (or a
:class:`~asynccoll.sim.handle.SimSync` for ``Sync()``) the way a training loop does: rank r
computes for ``compute[s, r]`` seconds, calls, and when the call returns computes the next
step (``barrier=True``: a dense barrier between steps, as ``bench/skew.py`` does); after its
last step it flushes (``flush=True``, partial policies), so every contribution ends in an
execution. The flush is collective and forces an execution per rank that reaches it while the
others still work (the runtime's rule), which at large P with skewed finishing times costs
more than the steps themselves; without it the contributions left in send buffers are
counted instead (:attr:`SimRun.leftover`), unless some calls could not complete without one
(they wait for ranks that finished: a majority's initiator, a quorum), in which case the
finished ranks flush when nothing else can happen, as a real run ends. It returns
a :class:`SimRun` with per-call arrays and the statistics a user compares policies by:

* ``steps_per_s``: steps over the time the slowest rank finished its last step (flush
  excluded);
* call latency (mean, median, p99): from a call to its return;
* NAP: per execution, how many ranks had fresh data in it (the ``fresh`` set of its result;
  executions a flush forced are left out), averaged;
* staleness: per call, the execution its data went into minus the round of the result the
  call returned (0: its own data is in its result; a call answered at once by rule 1 is at
  least 1), as a histogram;
* conservation: the ``count`` of every execution summed, plus the contributions still in send
  buffers when no flush ran, equals the number of calls.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..collectives.policy import Policy, as_policy, moved_arguments
from ..results import PartialResult
from .arrivals import ComputeModel
from .cost import Profile
from .dense import SimBarrier, SimSync
from .engine import SimulationError, SimWorld
from .handle import SimPartial

__all__ = ["SimRun", "simulate"]


@dataclass
class SimRun:
    """What :func:`simulate` measured (module doc); times in seconds of virtual time.
    ``policy``: the policy's text (``str(policy)``, which :func:`~asynccoll.as_policy` reads
    back)."""

    policy: str
    world_size: int
    steps: int
    makespan: float
    t_call: np.ndarray
    latency: np.ndarray
    included: np.ndarray
    rounds: np.ndarray
    staleness: np.ndarray
    executions: dict[int, tuple[int, int, bool]]
    calls: int
    deadlines: dict[int, float] = field(default_factory=dict)
    #: execution -> when its first snapshot was taken (partial policies)
    started_at: dict[int, float] = field(default_factory=dict)
    results: list[list[PartialResult]] | None = None
    flushes: dict[int, PartialResult] | None = None
    #: contributions still in the ranks' send buffers at the end (0 after a flush)
    leftover: int = 0
    wall_s: float = 0.0
    events: int = 0
    messages: int = 0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.makespan if self.makespan > 0 else float("inf")

    @property
    def nap(self) -> float:
        """Mean number of ranks with fresh data per execution (flushes left out)."""
        v = [f for _, f, fl in self.executions.values() if not fl]
        return float(np.mean(v)) if v else float("nan")

    def conserved(self) -> bool:
        """Every call's data is in exactly one execution or still in its rank's send buffer
        (the executions' counts and the leftovers sum to the number of calls)."""
        return sum(c for c, _, _ in self.executions.values()) + self.leftover == self.calls

    def staleness_hist(self) -> dict[int, int]:
        """Staleness -> number of calls."""
        vals, counts = np.unique(self.staleness, return_counts=True)
        return {int(v): int(c) for v, c in zip(vals, counts, strict=True)}

    def summary(self) -> dict[str, Any]:
        """The figures a table shows, JSON-safe."""
        lat = self.latency
        return {"policy": self.policy, "P": self.world_size, "steps": self.steps,
                "steps_per_s": self.steps_per_s, "makespan_s": self.makespan,
                "latency_mean_s": float(lat.mean()) if lat.size else float("nan"),
                "latency_median_s": float(np.median(lat)) if lat.size else float("nan"),
                "latency_p99_s": float(np.percentile(lat, 99)) if lat.size else float("nan"),
                "nap": self.nap, "included_frac": float(self.included.mean())
                if self.included.size else float("nan"),
                "staleness": self.staleness_hist(),
                "staleness_max": int(self.staleness.max()) if self.staleness.size else 0,
                "executions": len(self.executions), "conserved": self.conserved(),
                "wall_s": self.wall_s, "events": self.events, "messages": self.messages}


@moved_arguments(deadline="give Deadline(bounds=(lo, hi), mad_factor=..., window=...) as the "
                          "policy (the simulator no longer widens its default bounds: "
                          "'deadline:bounds=0.0001..10' is what deadline=None gave)")
def simulate(policy: Policy | str, world_size: int, steps: int, *, profile: Profile,
             compute: ComputeModel | np.ndarray, nbytes: int = 4, data: bool = False,
             values: Callable[[int, int], Any] | None = None, seed: int = 0,
             barrier: bool = False, flush: bool = False, accumulate: bool = False,
             keep_results: bool = False, algorithm: str | None = None,
             choices: int | None = None) -> SimRun:
    """Simulate ``steps`` steps of ``world_size`` ranks under ``policy`` (module doc).

    ``policy``: a policy value or its text (:func:`~asynccoll.as_policy`: ``"quorum:12"``);
    a ``Deadline()`` runs with its own bounds, as the runtime would. ``compute``: a model, or
    a ``(steps, P)`` array of seconds. ``nbytes``: the size of each call's float32 data
    (rounded up to whole elements). ``data``: move real data (then ``values(rank, step)``
    gives each call's array, default ones). ``seed``: the compute model's draws, and the
    initiator draws unless the policy gives its own seed. ``keep_results``: keep every result
    (per rank, in call order) and each rank's flush result in the returned run. ``choices``:
    for ``TwoChoice()``, draw that many initiators instead (a what-if). Raises ``ValueError``
    naming a bad argument; ``SimulationError`` if the simulation stalls.

    Python's cyclic garbage collector is off while it runs (and back on after): the events
    make no reference cycles, and its passes over the schedules' millions of objects cost
    about 5 % of a P = 1024 run.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _simulate(as_policy(policy), world_size, steps, profile, compute, nbytes, data,
                         values, seed, barrier, flush, accumulate, keep_results, algorithm,
                         choices)
    finally:
        if collecting:
            gc.enable()


def _simulate(policy: Policy, world_size: int, steps: int, profile: Profile,
              compute: ComputeModel | np.ndarray, nbytes: int, data: bool,
              values: Callable[[int, int], Any] | None, seed: int, barrier: bool, flush: bool,
              accumulate: bool, keep_results: bool, algorithm: str | None,
              choices: int | None) -> SimRun:
    P = world_size
    if policy.partial:
        policy.activation(P)  # ValueError naming the policy before any work
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes!r}")
    rng = np.random.default_rng(seed)
    comp = compute.sample(steps, P, rng) if isinstance(compute, ComputeModel) \
        else np.asarray(compute, float)
    if comp.shape != (steps, P):
        raise ValueError(f"compute must give (steps, P) = {(steps, P)} seconds, got shape "
                         f"{comp.shape}")
    # Python floats, not NumPy scalars: every virtual time derives from these, and NumPy
    # scalar arithmetic would cost ~10x a float's in each of the engine's per-op updates
    # (the values, hence the results, are the same IEEE doubles)
    secs: list[list[float]] = comp.tolist()
    count = -(-nbytes // 4)
    like = np.zeros(count, np.float32)
    world = SimWorld(P, profile)
    h: SimPartial | SimSync
    if not policy.partial:
        h = SimSync(world, like, data=data, algorithm=algorithm)
    else:
        h = SimPartial(world, policy, like, seed=seed, data=data, accumulate=accumulate,
                       algorithm=algorithm, choices=choices)
    bar = SimBarrier(world) if barrier else None
    ones = np.ones(count, np.float32)
    t_call = np.full((P, steps), np.nan)
    t_ret = np.full((P, steps), np.nan)
    rounds = np.full((P, steps), -1, np.int64)
    included = np.zeros((P, steps), bool)
    step = [0] * P
    results: list[list[PartialResult]] | None = [[] for _ in range(P)] if keep_results else None
    flushes: dict[int, PartialResult] = {}

    half = profile.call_overhead * profile.cpu_scale / 2
    # with the pool's wake-up figure a call wakes its progress thread, as a message does
    wakes = bool(world.wake_cpu)

    def do_call(r: int) -> None:
        s = step[r]
        t_call[r, s] = world.now
        x = (values(r, s) if values is not None else ones) if data else None
        if half or wakes:
            world.at(world.cpu(r, half, wake=True) if world.pooled else world.now + half,
                     h.call, r, x, returned)
        else:
            h.call(r, x, returned)

    def returned(res: PartialResult, r: int) -> None:
        step[r]
        if half:
            world.at(world.cpu(r, half) if world.pooled else world.now + half, came_back, res,
                     r)
            return
        came_back(res, r)

    def came_back(res: PartialResult, r: int) -> None:
        s = step[r]
        t_ret[r, s] = world.now
        rounds[r, s] = res.round
        included[r, s] = res.included
        if results is not None:
            results[r].append(res)
        step[r] = s + 1
        if s + 1 < steps:
            if bar is not None:
                bar.enter(r, next_step)
            else:
                world.at(world.now + secs[s + 1][r], do_call, r)
        elif flushing[0] and isinstance(h, SimPartial):
            h.flush(r, flushed)

    def next_step(r: int) -> None:
        world.at(world.now + secs[step[r]][r], do_call, r)

    def flushed(res: PartialResult, r: int) -> None:
        flushes[r] = res

    flushing = [flush]
    wall = time.perf_counter()
    for r in range(P):
        world.at(secs[0][r], do_call, r)
    world.run()
    if min(step) < steps and isinstance(h, SimPartial) and not flushing[0]:
        # calls wait for ranks that have finished (an initiator, a quorum): as at the end of
        # a real run, only a flush lets them complete
        flushing[0] = True
        for r in range(P):
            if step[r] >= steps:
                h.flush(r, flushed)
        world.run()
    wall = time.perf_counter() - wall
    if min(step) < steps:
        raise SimulationError(f"the simulation stalled: ranks "
                              f"{[r for r in range(P) if step[r] < steps][:16]} did not finish "
                              f"their {steps} steps (policy {policy})")
    if isinstance(h, SimPartial):
        execs = h.executions
        stale = h.staleness()
        calls = h.calls
        dls = dict(h.deadlines)
        started = dict(h.started_at)
        leftover = h.leftover()
    else:
        execs = {e: (P, P, False) for e in range(steps)}
        stale = np.zeros(P * steps, np.int64)
        calls = P * steps
        dls = {}
        started = {}
        leftover = 0
    return SimRun(str(policy), P, steps, float(np.nanmax(t_ret)), t_call.ravel(),
                  (t_ret - t_call).ravel(), included.ravel(), rounds.ravel(), stale, execs,
                  calls, dls, started, results, flushes if flush else None, leftover, wall,
                  world.events, world.messages)
