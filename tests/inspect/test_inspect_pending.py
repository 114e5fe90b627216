"""Explaining hangs: a collective one rank never calls is explained naming that rank, from
trace snapshots and from live executors; the live-op registry (:class:`asynccoll.sched.LiveOps`)
and its signal dump."""

from __future__ import annotations

import asyncio
import gc
import io
import os
import signal
import threading
from pathlib import Path

import pytest
from inspect_helpers import buffers_for

from asynccoll import CollectiveTimeoutError, Executor
from asynccoll.cli import main
from asynccoll.inspect.kinds import available_kinds, build_all
from asynccoll.inspect.pending import explain, explain_executors, render_explanations
from asynccoll.inspect.tracefile import load_dir
from asynccoll.sched import LiveOps, TraceWriter
from asynccoll.sched.tracefile import trace_path
from asynccoll.testing import inproc_world

HUNG = [k for k in ("example-doubling", "allreduce") if k in available_kinds()]


async def _hang(tmp: Path, kind: str, world: int, missing: int, *, persistent: bool,
                drop_file: bool = False) -> list[Executor]:
    """Every rank but ``missing`` calls; wait for a timeout; every rank writes a snapshot."""
    scheds = build_all(kind, world, 64)
    writers = [TraceWriter(tmp, r, world) for r in range(world)]
    async with inproc_world(world) as ts:
        exs = [Executor(s, ts[r], buffers_for(s), sched_id=3, persistent=persistent,
                        trace_sink=writers[r].add_schedule(s, 3, collective=kind))
               for r, s in enumerate(scheds)]
        for r, ex in enumerate(exs):
            if r != missing:
                ex.start()
        with pytest.raises(CollectiveTimeoutError) as info:
            await exs[(missing + 1) % world].wait(timeout=0.2)
        assert info.value.pending  # the error lists what its rank waits on
        for r, ex in enumerate(exs):
            writers[r].write_pending(ex, reason="timeout")
            writers[r].close()
        live = explain_executors(exs)
        for ex in exs:
            ex.close()
    if drop_file:
        trace_path(tmp, missing).unlink()
    return live  # type: ignore[return-value]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("kind", HUNG)
async def test_hung_collective_names_missing_rank(tmp_path: Path, kind: str,
                                                  persistent: bool) -> None:
    for world, missing in ((3, 2), (4, 1)):
        d = tmp_path / f"{world}"
        live = await _hang(d, kind, world, missing, persistent=persistent)
        (exp,) = explain(load_dir(d))
        assert exp.culprits == [missing], str(exp)
        assert exp.execution == 0
        assert exp.sched_id == 3
        state = "has not called (never started)" if persistent else "never joined"
        assert f"rank {missing} {state}" in str(exp), str(exp)
        assert any(missing in peers for peers in exp.waits.values())
        (lexp,) = live
        assert lexp.culprits == [missing], str(lexp)


@pytest.mark.timeout(30)
async def test_dead_rank_without_trace_file(tmp_path: Path) -> None:
    await _hang(tmp_path, "example-doubling", 3, 2, persistent=False, drop_file=True)
    (exp,) = explain(load_dir(tmp_path))
    assert exp.culprits == [2]
    assert "rank 2 left no trace of execution 0" in str(exp)


@pytest.mark.timeout(30)
async def test_cli_pending(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await _hang(tmp_path, "example-doubling", 3, 2, persistent=False)
    assert main(["inspect", "pending", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "waiting on rank(s) [2]" in out
    assert "rank 0: op" in out
    assert render_explanations([]).startswith("no pending snapshots")


@pytest.mark.timeout(30)
async def test_registry_dump_and_signal(tmp_path: Path) -> None:
    scheds = build_all("example-doubling", 2, 64)
    w = TraceWriter(tmp_path, 0, 2)
    live = LiveOps()
    dump_pending, live_executors = live.dump, live.executors
    async with inproc_world(2) as ts:
        exs = [Executor(s, ts[r], buffers_for(s), sched_id=5) for r, s in enumerate(scheds)]
        live.add(exs[0], w)
        live.add(exs[1])
        try:
            exs[0].start()
            await asyncio.sleep(0.01)  # let rank 0's send be delivered
            text = dump_pending()
            assert "rank 0 example-doubling (sched_id 5) execution 0: pending" in text
            assert "waiting for rank 1" in text
            assert "rank 1 example-doubling (sched_id 5) execution 0: nothing pending" in text
            assert load_dir(tmp_path)[0].pending[5][0]["reason"] == "dump"
            stream = io.StringIO()
            handler = live.install_signal_handler(signal.SIGUSR1, stream=stream,
                                                  loop=asyncio.get_running_loop())
            try:
                os.kill(os.getpid(), signal.SIGUSR1)
                await asyncio.sleep(0)  # the handler schedules the dump on this loop
                assert "waiting for rank 1" in stream.getvalue()
            finally:
                handler.restore()
            fut0 = exs[0].current  # before rank 1 starts: it may complete synchronously
            await asyncio.wait_for(asyncio.gather(fut0, exs[1].start()), 5)
            assert "nothing pending" in dump_pending(write_traces=False).splitlines()[0]
        finally:
            live.discard(exs[0])
            for ex in exs:
                ex.close()
            w.close()
    assert exs[1] in live_executors()
    assert exs[0] not in live_executors()
    ident = id(exs[1])
    del exs, ex, fut0
    gc.collect()
    assert ident not in {id(x) for x in live_executors()}  # weakly held: gone with its executor


def test_signal_handlers_chain_and_restore() -> None:
    """Several owners in one process all dump; closing restores the handler found at install,
    even when they close out of order."""
    before = signal.getsignal(signal.SIGUSR1)
    streams = [io.StringIO(), io.StringIO()]
    lives = [LiveOps(), LiveOps()]
    first = lives[0].install_signal_handler(stream=streams[0])
    second = lives[1].install_signal_handler(stream=streams[1])
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # no loop: each dumps in the handler
        assert [s.getvalue() for s in streams] == ["no live executors\n"] * 2
        first.restore()  # out of order: the second stays installed, forwarding
        second.restore()
        assert signal.getsignal(signal.SIGUSR1) == before
    finally:
        first.restore()
        second.restore()
        signal.signal(signal.SIGUSR1, before)


def test_restore_off_the_main_thread_takes_effect_at_the_next_signal() -> None:
    """A blocking close runs on the progress thread, where handlers cannot be installed: the
    handler then stops dumping, and the next signal puts back (and goes to) the previous one."""
    seen: list[int] = []

    def prev(sig: int, frame: object) -> None:
        seen.append(sig)

    before = signal.signal(signal.SIGUSR1, prev)
    try:
        stream = io.StringIO()
        handler = LiveOps().install_signal_handler(stream=stream)
        t = threading.Thread(target=handler.restore)
        t.start()
        t.join(5)
        assert signal.getsignal(signal.SIGUSR1) is not prev  # still installed, inactive
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
        assert stream.getvalue() == ""
        assert signal.getsignal(signal.SIGUSR1) is prev  # put back at that signal
    finally:
        signal.signal(signal.SIGUSR1, before)
