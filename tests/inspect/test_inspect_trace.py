"""Traces written by real executor runs over inproc: the file format, the summary, the
Chrome trace-event export (validated against the format) and the HTML timeline."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from inspect_helpers import traced_run

from asynccoll.cli import main
from asynccoll.errors import TraceFormatError
from asynccoll.inspect.kinds import build_all
from asynccoll.inspect.perfetto import perfetto_json, timeline_page
from asynccoll.inspect.render import match_messages
from asynccoll.inspect.summary import execution_detail, render_execution, summarize
from asynccoll.inspect.tracefile import load_dir
from asynccoll.sched import TraceWriter
from asynccoll.sched.tracefile import trace_path


def validate_trace_events(doc: dict[str, Any]) -> dict[str, int]:
    """Check the Chrome trace-event format; return counts by phase. Raises AssertionError."""
    evs = doc["traceEvents"]
    assert isinstance(evs, list)
    assert evs
    slices: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    flows: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for ev in evs:
        assert isinstance(ev["name"], str), ev
        assert ev["ph"] in ("X", "s", "f", "M"), ev
        assert isinstance(ev["pid"], int), ev
        assert isinstance(ev["tid"], int), ev
        assert isinstance(ev["ts"], (int, float)), ev
        assert ev["ts"] >= 0, ev
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], (int, float)), ev
            assert ev["dur"] >= 0, ev
            slices[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"]))
        elif ev["ph"] in ("s", "f"):
            assert isinstance(ev["id"], int), ev
            assert ev["cat"], ev
            assert ev["ph"] not in flows[ev["id"]], f"two {ev['ph']} events with id {ev['id']}"
            flows[ev["id"]][ev["ph"]] = ev
        else:
            assert isinstance(ev["args"]["name" if "name" in ev["name"] else "sort_index"],
                              (str, int))
    # small, stable thread ids: each names one track (a table in otherData), the same on
    # every rank, and fits in 32 bits (Perfetto keeps ids as int32/doubles)
    tracks = {int(k): v for k, v in doc["otherData"]["tracks"].items()}
    assert sorted(tracks) == list(range(1, len(tracks) + 1))
    assert len(set(tracks.values())) == len(tracks)
    named = {(ev["pid"], ev["tid"]): ev["args"]["name"] for ev in evs
             if ev["ph"] == "M" and ev["name"] == "thread_name"}
    for (pid, tid), name in named.items():
        assert 0 < tid < 2 ** 31, (pid, tid)
        assert tracks[tid] == name, (pid, tid, name)
    assert {k for k in slices} <= set(named), "a slice on a track without a name"
    for track, iv in slices.items():  # op lanes never overlap (only executions may)
        if not tracks[track[1]].endswith(" executions"):
            iv.sort()
            assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(iv)), track

    def inside(ev: dict[str, Any]) -> bool:
        return any(a - 1e-6 <= ev["ts"] <= b + 1e-6 for a, b in slices[(ev["pid"], ev["tid"])])

    for fid, pair in flows.items():
        assert set(pair) == {"s", "f"}, f"flow {fid} is not a matched s/f pair"
        assert pair["f"]["bp"] == "e"
        assert inside(pair["s"]), fid
        assert inside(pair["f"]), fid
        assert pair["f"]["ts"] >= pair["s"]["ts"] - 1e-6
    return {"X": sum(len(v) for v in slices.values()), "flows": len(flows)}


@pytest.mark.timeout(30)
async def test_trace_files_summary_and_perfetto(tmp_path: Path) -> None:
    world, n_exec = 4, 3
    scheds = build_all("example-doubling", world, 64)

    def extra(r: int, e: int) -> dict[str, Any]:
        return {"initiator": e % world, "contributors": list(range(world - e % 2)),
                "missed": e % 2}

    await traced_run(tmp_path, scheds, n_exec, extra=extra, meta={"kind": "demo"})
    assert sorted(p.name for p in list(tmp_path.iterdir())) == [  # noqa: ASYNC240
        f"rank-{r}.jsonl" for r in range(world)]
    lines = [json.loads(x) for x in trace_path(tmp_path, 2).read_text().splitlines()]
    assert [x["type"] for x in lines] == ["header", "schedule"] + ["execution"] * n_exec
    assert lines[1]["schedule"] == scheds[2].to_dict()
    assert lines[1]["kind"] == "demo"
    assert [x["execution"] for x in lines[2:]] == list(range(n_exec))
    assert all(len(x["ops_us"]) == len(scheds[2].ops) for x in lines[2:])
    assert all(min(min(row) for row in x["ops_us"]) >= 0 for x in lines[2:])  # all done

    traces = load_dir(tmp_path)
    (summ,) = summarize(traces)
    assert summ.sched_id == 7
    assert summ.ranks == list(range(world))
    assert [d.execution for d in summ.executions] == list(range(n_exec))
    # every rank started each execution itself; the recorded initiator is who was allowed
    assert summ.initiators == Counter(dict.fromkeys(range(world), n_exec))
    assert [d.allowed for d in summ.executions] == [[0], [1], [2]]
    assert summ.nap == Counter({4: 2, 3: 1})
    assert summ.executions[1].contributors == [0, 1, 2]
    assert summ.latency_us["n"] == world * n_exec
    assert summ.latency_us["p50"] > 0
    assert summ.staleness["max"] == 1.0
    # every rank sent 64 bytes per doubling step (P=4: 2 steps)
    d0 = execution_detail(traces, 0)[0]
    assert d0.sent == dict.fromkeys(range(world), 128)
    assert d0.received == d0.sent
    assert "contributors [0, 1, 2, 3]" in render_execution([d0])

    doc = json.loads(perfetto_json(traces))
    counts = validate_trace_events(doc)
    n_msgs = len(match_messages(scheds)[0])
    assert counts["flows"] == n_msgs * n_exec
    assert counts["X"] == n_exec * (world + sum(len(s.ops) for s in scheds))

    page = timeline_page(traces)
    assert page.count('"name":"rank ') == counts["X"]


@pytest.mark.timeout(30)
async def test_external_activation_initiators(tmp_path: Path) -> None:
    world = 5
    await traced_run(tmp_path, build_all("activation", world), 3, starters=lambda e: [e + 1])
    (summ,) = summarize(load_dir(tmp_path))
    assert [d.initiators for d in summ.executions] == [[1], [2], [3]]
    assert all(d.activation[3] == "external" for d in summ.executions[:2])
    validate_trace_events(json.loads(perfetto_json(load_dir(tmp_path))))


@pytest.mark.timeout(60)
async def test_dense_allreduce_trace(tmp_path: Path) -> None:
    for world in (3, 8):
        d = tmp_path / str(world)
        scheds = build_all("allreduce", world, 1024)
        await traced_run(d, scheds, 2)
        counts = validate_trace_events(json.loads(perfetto_json(load_dir(d))))
        assert counts["flows"] == 2 * len(match_messages(scheds)[0]) > 0


@pytest.mark.timeout(30)
async def test_cli_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    await traced_run(tmp_path, build_all("example-doubling", 3, 64), 2,
                     extra=lambda r, e: {"contributors": [0, 1, 2]})
    pf, ht = tmp_path / "p.json", tmp_path / "t.html"
    assert main(["inspect", "trace", str(tmp_path), "--perfetto", str(pf), "--html",
                 str(ht)]) == 0
    out = capsys.readouterr().out
    assert "executions" in out
    assert re.search(r"3: 2 \(100%\)", out), out
    validate_trace_events(json.loads(pf.read_text()))
    assert ht.read_text().startswith("<!DOCTYPE html>")
    assert main(["inspect", "trace", str(tmp_path), "--execution", "1"]) == 0
    assert "execution 1" in capsys.readouterr().out
    assert main(["inspect", "trace", str(tmp_path), "--execution", "9"]) == 2
    assert "no rank recorded execution 9" in capsys.readouterr().err
    assert main(["inspect", "trace", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_trace_files(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no rank-"):
        load_dir(tmp_path)
    (tmp_path / "rank-0.jsonl").write_text('{"type": "header", "format": "other"}\n')
    with pytest.raises(TraceFormatError, match="not an asynccoll trace"):
        load_dir(tmp_path)
    with TraceWriter(tmp_path, 0, 1) as w:
        w.write({"type": "execution", "sched_id": 1, "execution": 0, "ops": []})
    with open(tmp_path / "rank-0.jsonl", "a") as f:
        f.write('{"type": "execution", "sched')  # a writer killed mid-line
    assert load_dir(tmp_path)[0].executions[1][0]["execution"] == 0
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1"):
        TraceWriter(tmp_path, 2, 2)
    TraceWriter(tmp_path, 2, 3).close()  # a leftover of a run with P=3
    with pytest.raises(TraceFormatError, match=r"mixes runs of world sizes \[1, 3\]"):
        load_dir(tmp_path)
