"""``asynccoll inspect pending DIR --pid PID`` against a live, hung process: the signal makes it
dump its pending ops into its trace files, and the explanation names the rank that never
called."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from pathlib import Path
from typing import Any

import pytest

from asynccoll.cli import main


def _mark_ready(directory: str) -> None:
    Path(directory, "ready").write_text("1")


def _child(directory: str, errors: Any) -> None:
    """Two in-process ranks; rank 0 calls, rank 1 never does; wait to be signalled."""
    try:
        import asyncio

        from asynccoll import Executor
        from asynccoll.inspect.kinds import build_all
        from asynccoll.inspect.pending import install_signal_handler, register_executor
        from asynccoll.inspect.tracefile import TraceWriter
        from asynccoll.testing import inproc_world

        devnull = open(os.devnull, "w")

        async def hang() -> None:
            scheds = build_all("example-doubling", 2, 64)
            ws = [TraceWriter(directory, r, 2) for r in range(2)]
            async with inproc_world(2) as ts:
                import numpy as np

                exs = [Executor(s, ts[r], {k: np.zeros(16, np.float32) for k in s.slots},
                                sched_id=9, trace_sink=ws[r].add_schedule(s, 9))
                       for r, s in enumerate(scheds)]
                for ex, w in zip(exs, ws, strict=True):
                    register_executor(ex, w)
                exs[0].start()
                install_signal_handler(stream=devnull)
                _mark_ready(directory)
                await asyncio.sleep(60)  # killed by the parent long before

        asyncio.run(hang())
    except BaseException:
        errors.put(traceback.format_exc())


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_pending_pid_signals_a_live_process(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    proc = ctx.Process(target=_child, args=(str(tmp_path), errors), daemon=True)
    proc.start()
    try:
        ready = tmp_path / "ready"
        proc.join(0)  # the child needs a few seconds to import and build (spawn)
        for _ in range(600):
            if ready.exists() or not proc.is_alive():
                break
            proc.join(0.1)
        assert ready.exists(), errors.get(timeout=5) if not errors.empty() else "child not ready"
        assert proc.pid is not None
        assert main(["inspect", "pending", str(tmp_path), "--pid", str(proc.pid),
                     "--wait", "20"]) == 0
        out = capsys.readouterr().out
        assert "waiting on rank(s) [1]" in out, out
        assert "rank 1 never joined execution 0" in out
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
    assert errors.empty(), errors.get()
