"""Property tests of the engine on random DAGs with random thresholds.

* one rank: random nop / compute / never-matched receive ops; the fired and completed sets equal
  a sequential fixpoint, every compute runs at most once per execution, and every op fired only
  after ``k`` of its dependencies had completed;
* several ranks over inproc with seeded random delays and reordering: a random global task graph
  is split into per-rank schedules (remote dependencies become send/recv pairs); persistent
  executors run several executions whose values are tagged by the execution; the results equal
  a sequential evaluation, so executions never mixed.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccoll import Executor, Schedule, register_kernel
from asynccoll.sched import BUILTIN_KERNELS
from asynccoll.testing import inproc_world

pytestmark = pytest.mark.timeout(90)

M = 2  # elements per value

#: (rank, task) -> how many times its compute kernel ran; reset per example
CALLS: Counter[tuple[int, int]] = Counter()


def _tally_sum(out: Any, inputs: Sequence[Any], params: Mapping[str, Any],
               msgs: Sequence[Any]) -> None:
    """``out = sum(inputs)`` and count the call: the probe for "fires at most once"."""
    CALLS[params["rank"], params["task"]] += 1
    if out is None:
        return
    if len(inputs) == 1:
        out[...] = inputs[0]
    else:
        np.add(inputs[0], inputs[1], out=out)
        for x in inputs[2:]:
            np.add(out, x, out=out)


#: the built-ins and the probe kernel, passed to commit and to the executors
KERNELS = BUILTIN_KERNELS.extended()
register_kernel(KERNELS, "test_tally_sum", _tally_sum)


def _check_threshold_order(s: Schedule, rec: dict[str, Any]) -> None:
    """Every fired op with dependencies fired no earlier than the k-th completion among them."""
    ops = rec["ops"]
    for i, op in enumerate(s.ops):
        fired = ops[i][1]
        if fired is None or not op.deps:
            continue
        done = [ops[d][2] for d in op.deps if ops[d][2] is not None and ops[d][2] <= fired]
        assert len(done) >= op.k, f"op {i} fired with {len(done)} of k={op.k} deps complete"


# -- one rank ---------------------------------------------------------------------------------

@dataclass
class Local:
    schedule: Schedule
    fired: list[bool]
    completed: list[bool]
    computes: list[int] = field(default_factory=list)


@st.composite
def local_dags(draw: st.DrawFn) -> Local:
    n = draw(st.integers(2, 24))
    s = Schedule(0, 1, "local", {"x": 1})
    fired: list[bool] = []
    completed: list[bool] = []
    computes: list[int] = []
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), unique=True, max_size=4)) if i else []
        k = draw(st.integers(1, len(deps))) if deps else 0
        kind = "nop" if i == 0 else draw(st.sampled_from(["nop", "compute", "compute", "recv"]))
        if kind == "nop":
            s.nop(deps=deps, k=k)
        elif kind == "compute":
            s.compute("test_tally_sum", (), None, deps=deps, k=k, rank=0, task=i)
            computes.append(i)
        else:  # a receive that never gets its message: it may fire (post) but never completes
            s.recv(0, None, tag=i, deps=deps, k=k)
        # the sequential fixpoint (ids are a topological order)
        f = not deps or sum(completed[d] for d in deps) >= k
        fired.append(f)
        completed.append(f and kind != "recv")
    s.final = s.nop(deps=[i for i in range(n) if completed[i]], label="final")
    return Local(s.commit(KERNELS), fired, completed, computes)


@settings(max_examples=150)
@given(local_dags(), st.booleans())
def test_single_rank_fires_the_fixpoint_once(dag: Local, persistent: bool) -> None:
    executions = 3

    async def main() -> list[dict[str, Any]]:
        async with inproc_world(1) as (t,):
            ex = Executor(dag.schedule, t, {"x": np.zeros(1)}, sched_id=3,
                          persistent=persistent, kernels=KERNELS)
            for e in range(executions):
                assert await asyncio.wait_for(ex.start(), 5) == e
                for i in dag.computes:
                    assert CALLS[0, i] == (e + 1 if dag.fired[i] else 0)
                # receives of the finished execution were retired, the next one's posted
                pending_sources = sum(1 for op in dag.schedule.ops
                                      if op.kind == "recv" and not op.deps)
                assert t.matcher.posted_count == (pending_sources if persistent else 0)
            ex.close()
            assert t.matcher.posted_count == 0
            return [ex.trace.record(e) for e in range(executions)]

    CALLS.clear()
    records = asyncio.run(main())
    final = dag.schedule.final
    for rec in records:
        fired = [op[1] is not None for op in rec["ops"]]
        completed = [op[2] is not None for op in rec["ops"]]
        assert fired[:final] == dag.fired
        assert completed[:final] == dag.completed
        assert fired[final]
        assert completed[final]
        assert rec["activation"] == "internal"
        _check_threshold_order(dag.schedule, rec)


# -- several ranks ----------------------------------------------------------------------------

@dataclass
class Global:
    world: int
    rank_of: list[int]
    deps: list[list[int]]
    k: list[int]
    seed: int
    delay: float


@st.composite
def global_dags(draw: st.DrawFn, and_only: bool) -> Global:
    world = draw(st.integers(2, 4))
    n = draw(st.integers(2, 12))
    rank_of = [draw(st.integers(0, world - 1)) for _ in range(n)]
    deps: list[list[int]] = []
    ks: list[int] = []
    for i in range(n):
        d = draw(st.lists(st.integers(0, i - 1), unique=True, max_size=3)) if i else []
        deps.append(d)
        ks.append(len(d) if and_only or not d else draw(st.integers(1, len(d))))
    return Global(world, rank_of, deps, ks, draw(st.integers(0, 2**16)),
                  draw(st.sampled_from([0.0, 0.0005, 0.002])))


def split(g: Global) -> list[Schedule]:
    """Per-rank schedules of the task graph; the final op of each waits for all of its ops."""
    P = g.world
    slots: list[dict[str, int]] = [{} for _ in range(P)]
    for t, r in enumerate(g.rank_of):
        slots[r][f"init{t}"] = M
        slots[r][f"val{t}"] = M
        for u in g.deps[t]:
            if g.rank_of[u] != r:
                slots[r][f"in{t}_{u}"] = M
    ss = [Schedule(r, P, f"split-{r}", slots[r]) for r in range(P)]
    op_of: dict[int, int] = {}
    for t, r in enumerate(g.rank_of):
        s = ss[r]
        dep_ops: list[int] = []
        inputs = [f"init{t}"]
        for u in g.deps[t]:
            ru = g.rank_of[u]
            if ru == r:
                dep_ops.append(op_of[u])
                inputs.append(f"val{u}")
            else:
                tag = t * 1000 + u
                ss[ru].send(r, f"val{u}", tag, deps=[op_of[u]])
                dep_ops.append(s.recv(ru, f"in{t}_{u}", tag))
                inputs.append(f"in{t}_{u}")
        op_of[t] = s.compute("test_tally_sum", inputs, f"val{t}", deps=dep_ops, k=g.k[t],
                             rank=r, task=t)
    for s in ss:
        s.final = s.nop(deps=range(len(s.ops)), label="final")
        s.commit(KERNELS)
    return ss


def init_value(t: int, e: int) -> np.ndarray:
    return np.array([t + 1 + 100 * e, -(t + 1) * (e + 1)], dtype=np.float64)


def reference(g: Global, e: int) -> list[np.ndarray]:
    vals: list[np.ndarray] = []
    for t in range(len(g.rank_of)):
        vals.append(init_value(t, e) + sum((vals[u] for u in g.deps[t]), np.zeros(M)))
    return vals


async def run_split(g: Global, executions: int) -> tuple[list[Schedule], list[Executor],
                                                         dict[tuple[int, int], np.ndarray]]:
    """Run ``executions`` executions of every rank's persistent schedule with random timing."""
    ss = split(g)
    results: dict[tuple[int, int], np.ndarray] = {}
    rng = random.Random(g.seed)
    async with inproc_world(g.world, delay=g.delay, seed=g.seed) as ts:
        bufs = [{name: np.zeros(M) for name in s.slots} for s in ss]
        for r in range(g.world):
            for t in (t for t, rr in enumerate(g.rank_of) if rr == r):
                bufs[r][f"init{t}"][:] = init_value(t, 0)
        exs: list[Executor] = []
        for r, s in enumerate(ss):
            mine = [t for t, rr in enumerate(g.rank_of) if rr == r]

            def on_complete(e: int, r: int = r, mine: list[int] = mine) -> None:
                for t in mine:  # results of e are read here, inputs of e+1 set here
                    assert CALLS[r, t] == e + 1, "a compute op fired twice or not at all"
                    results[e, t] = bufs[r][f"val{t}"].copy()
                    bufs[r][f"init{t}"][:] = init_value(t, e + 1)

            exs.append(Executor(s, ts[r], bufs[r], sched_id=9, persistent=True,
                                on_complete=on_complete, kernels=KERNELS))
        pauses = [[rng.random() * 2 * g.delay for _ in range(executions)]
                  for _ in range(g.world)]

        async def drive(r: int) -> None:
            ex = exs[r]
            # A rank whose ops all wait on messages completes executions without start().
            while ex.execution < executions:
                if pauses[r][ex.execution]:
                    await asyncio.sleep(pauses[r][ex.execution])
                    if ex.execution >= executions:
                        break
                await ex.start()

        await asyncio.wait_for(asyncio.gather(*(drive(r) for r in range(g.world))), 10)
        for t in ts:
            assert not t.matcher.errors, list(t.matcher.errors)
            assert t.matcher.held_count == 0
        for ex in exs:
            ex.close()
    return ss, exs, results


@settings(max_examples=60)
@given(global_dags(and_only=True))
def test_many_ranks_results_equal_sequential_reference(g: Global) -> None:
    executions = 4
    CALLS.clear()
    _, exs, results = asyncio.run(run_split(g, executions))
    for e in range(executions):
        ref = reference(g, e)
        for t in range(len(g.rank_of)):
            np.testing.assert_array_equal(results[e, t], ref[t], err_msg=f"exec {e} task {t}")
    for ex in exs:
        assert ex.completed == executions - 1


@settings(max_examples=60)
@given(global_dags(and_only=False))
def test_many_ranks_thresholds_fire_each_op_once(g: Global) -> None:
    executions = 3
    CALLS.clear()
    ss, exs, _ = asyncio.run(run_split(g, executions))
    for s, ex in zip(ss, exs, strict=True):
        for e in range(executions):
            rec = ex.trace.record(e)
            assert all(op[1] is not None and op[2] is not None for op in rec["ops"])
            _check_threshold_order(s, rec)
    assert all(CALLS[g.rank_of[t], t] == executions for t in range(len(g.rank_of)))
