"""Helpers for the inspect tests: traced runs of real executors over inproc."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from asynccoll import Executor, Schedule
from asynccoll.inspect.kinds import build_all
from asynccoll.sched import TraceWriter
from asynccoll.testing import inproc_world


def buffers_for(s: Schedule, fill: float = 1.0) -> dict[str, Any]:
    """An array for every slot of ``s`` (its declared size and dtype, float32 by default)."""
    return {name: np.full(spec.count if spec.count is not None else 64, fill,
                          spec.dtype or "float32") for name, spec in s.slots.items()}


async def traced_run(directory: Path, scheds: Sequence[Schedule], executions: int, *,
                     starters: Callable[[int], Sequence[int]] | None = None,
                     extra: Callable[[int, int], dict[str, Any]] | None = None,
                     sched_id: int = 7, meta: dict[str, Any] | None = None,
                     timeout: float = 10.0) -> list[Executor]:
    """Run ``executions`` executions of persistent executors tracing into ``directory``.

    ``starters(e)``: the ranks that start execution e from inside (default: all);
    ``extra(rank, e)``: what a rank records in ``Trace.extra`` when e completes.
    """
    world = len(scheds)
    writers = [TraceWriter(directory, r, world) for r in range(world)]
    exs: list[Executor] = []
    try:
        async with inproc_world(world) as ts:
            for r, s in enumerate(scheds):
                def done(e: int, r: int = r) -> None:
                    if extra is not None:
                        ex = exs[r]
                        ex.trace.extra[e % ex.trace.capacity].update(extra(r, e))

                sink = writers[r].add_schedule(s, sched_id, collective=s.name, **(meta or {}))
                exs.append(Executor(s, ts[r], buffers_for(s, r + 1.0), sched_id=sched_id,
                                    persistent=True, on_complete=done, trace_sink=sink))
            for e in range(executions):
                futs = [ex.current for ex in exs]
                for r in (starters(e) if starters is not None else range(world)):
                    exs[r].start()
                await asyncio.wait_for(asyncio.gather(*futs), timeout)
            for ex in exs:
                ex.close()
    finally:
        for w in writers:
            w.close()
    return exs


def run_kind(directory: Path, kind: str, world: int, executions: int = 2,
             size: int = 64, **kw: Any) -> list[Executor]:
    """Build ``kind`` for every rank and :func:`traced_run` it."""
    return asyncio.run(traced_run(directory, build_all(kind, world, size), executions, **kw))
