"""Traces of Communicator runs: solo and majority allreduce over inproc and tcp, and a
deliberately hung collective explained by name.

These need the Communicator to trace (``local_world(..., trace=DIR)`` / ``connect(trace=DIR)``,
writing with :class:`asynccoll.inspect.tracefile.TraceWriter`, recording ``contributors`` in
``Trace.extra``, and writing a ``pending`` snapshot of a timed-out executor *before* closing
it). Until ``local_world`` accepts ``trace`` they skip, saying so. Their logic was checked
against real PartialResults with a tracing stand-in for the Communicator's side.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from test_inspect_trace import validate_trace_events

from asynccoll import CollectiveTimeoutError
from asynccoll.collectives.partial import initiators
from asynccoll.inspect.pending import explain
from asynccoll.inspect.perfetto import perfetto_json
from asynccoll.inspect.summary import summarize
from asynccoll.inspect.tracefile import load_dir
from asynccoll.results import PartialResult
from asynccoll.testing import local_world


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["inproc", "tcp"])
@pytest.mark.parametrize("kind", ["solo", "majority"])
async def test_traced_partial_run(tmp_path: Path, kind: str, transport: str) -> None:
    world, steps = 4, 6
    results: dict[int, list[PartialResult]] = {r: [] for r in range(world)}
    async with local_world(world, transport, trace=str(tmp_path),  # type: ignore[call-arg]
                           timeout=20) as comms:
        like = np.zeros(8, np.float32)
        handles = [c.partial_allreduce(kind, like=like) for c in comms]

        async def worker(r: int) -> None:
            for step in range(steps):
                await asyncio.sleep(0.003 * r * (step % 2))  # skew: some rounds are partial
                results[r].append(await handles[r](np.full(8, r + 1, np.float32)))
            results[r].append(await handles[r].flush())

        await asyncio.wait_for(asyncio.gather(*(worker(r) for r in range(world))), 60)
    traces = load_dir(tmp_path)
    (summ,) = [s for s in summarize(traces) if kind in s.name]
    by_round = {d.execution: d for d in summ.executions}
    assert sum(summ.nap.values()) == len(summ.executions) > 0
    for r, rs in results.items():
        for res in rs:
            assert by_round[res.round].contributors == sorted(res.contributors), (r, res.round)
    seed = handles[0].seed
    for d in summ.executions:  # who started it: within S(e), unless a flush forced it
        flushed = any(x.get("flushed") for x in d.extra.values())
        assert d.initiators, d.execution
        if not flushed:
            assert set(d.initiators) <= initiators(kind, d.execution, world, seed), d.execution
    validate_trace_events(json.loads(perfetto_json(traces)))


@pytest.mark.timeout(60)
async def test_hung_collective_names_the_missing_rank(tmp_path: Path) -> None:
    async with local_world(3, "inproc", trace=str(tmp_path)) as comms:  # type: ignore[call-arg]
        x = np.ones(4, np.float32)
        outcomes = await asyncio.wait_for(asyncio.gather(
            comms[0].allreduce(x, timeout=0.5), comms[1].allreduce(x, timeout=0.5),
            return_exceptions=True), 30)
        assert all(isinstance(o, CollectiveTimeoutError) for o in outcomes), outcomes
        assert any("rank 2" in str(o) for o in outcomes), outcomes
    exps = explain(load_dir(tmp_path))
    assert [e.culprits for e in exps] == [[2]], "\n".join(map(str, exps))
