"""Rendering every available kind for P in {1, 2, 3, 8} in every format.

DOT must parse (pydot), JSON must round-trip through ``Schedule.from_dict``, the HTML page must
contain every op, the text must list every op; the global view must pair every send with a
receive for the synchronous collectives.
"""

from __future__ import annotations

import html
import json
import re

import pydot
import pytest

from asynccoll import Schedule
from asynccoll.inspect.kinds import algorithms, available_kinds, build, build_all
from asynccoll.inspect.render import (
    FORMATS,
    dep_class,
    layout,
    match_messages,
    op_bytes,
    render,
    render_dot,
    render_png,
)

# pydot's parser uses deprecated pyparsing names
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KINDS = sorted(available_kinds())
WORLDS = (1, 2, 3, 8)
SIZE = 256  # bytes: keeps segmentation trivial and the graphs small


def _html_data(page: str) -> dict[str, object]:
    m = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    assert m is not None
    data: dict[str, object] = json.loads(m.group(1).replace("<\\/", "</"))
    return data


#: larger graphs get the structural check; one of them is parsed in full by a slow test
PYDOT_MAX_NODES = 120


def _check_dot_structure(out: str, expect: set[str]) -> None:
    lines = out.splitlines()
    assert lines[0].startswith("digraph ")
    assert lines[-1] == "}"
    assert out.count("{") == out.count("}")
    nodes = set(re.findall(r"^ {4}(r\d+_\d+) \[label=", out, re.M))
    assert nodes == expect
    for a, b in re.findall(r"(r\d+_\d+) -> (r\d+_\d+) \[", out):
        assert a in expect
        assert b in expect


def _check(scheds: list[Schedule], fmt: str, out: str) -> None:
    if fmt == "json":
        d = json.loads(out)
        dicts = [d] if len(scheds) == 1 else d["schedules"]
        assert [Schedule.from_dict(x) for x in dicts] == scheds
    elif fmt == "dot":
        expect = {f"r{s.rank}_{i}" for s in scheds for i in range(len(s.ops))}
        if len(expect) > PYDOT_MAX_NODES:  # pydot's parser takes seconds here: see test below
            _check_dot_structure(out, expect)
            return
        graphs = pydot.graph_from_dot_data(out)
        assert graphs is not None
        assert len(graphs) == 1
        names = {n.get_name() for sub in graphs[0].get_subgraphs() for n in sub.get_nodes()}
        assert names == expect
    elif fmt == "html":
        assert out.startswith("<!DOCTYPE html>")
        assert "http://" not in out.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in out
        assert "<link" not in out
        assert " src=" not in out
        nodes = _html_data(out)["nodes"]
        assert isinstance(nodes, list)
        assert {n["key"] for n in nodes} == {f"r{s.rank}_{i}" for s in scheds
                                             for i in range(len(s.ops))}
        for s in scheds:
            for op in s.ops:  # every op is also in the plain table
                assert html.escape(op.describe(), quote=True) in out
    else:
        for s in scheds:
            assert f"rank {s.rank} of {s.world_size}, {len(s.ops)} ops" in out
            rows = [ln for ln in out.splitlines() if re.match(r"^│\s+\d+ │", ln)]
            assert len(rows) >= len(s.ops)


def test_every_collective_kind_is_available() -> None:
    """A kind whose builder fails to import would silently drop out of KINDS: pin the set."""
    assert set(KINDS) >= {"activation", "allgather", "allreduce", "barrier", "broadcast",
                          "majority", "quorum", "reduce_scatter", "solo", "sparse_allreduce",
                          "two_choice"}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_every_format(kind: str, world: int) -> None:
    everyone = build_all(kind, world, SIZE)
    assert [s.rank for s in everyone] == list(range(world))
    assert all(s.committed and s.world_size == world for s in everyone)
    last = build(kind, world - 1, world, SIZE)
    for fmt in FORMATS:
        _check(everyone, fmt, render(everyone, fmt, kind=kind))
        _check([last], fmt, render([last], fmt, kind=kind))


ALGOS = [(k, a) for k in KINDS for a in algorithms(k)]


@pytest.mark.parametrize(("kind", "algorithm"), ALGOS)
def test_algorithm_variants(kind: str, algorithm: str) -> None:
    for world in (3, 8):
        scheds = build_all(kind, world, SIZE, algorithm)
        _check(scheds, "json", render(scheds, "json"))
        _check([scheds[-1]], "dot", render([scheds[-1]], "dot"))
        if kind == "allreduce":
            assert match_messages(scheds)[1] == []


SYNC = [k for k in KINDS if k in ("allreduce", "broadcast", "allgather", "reduce_scatter",
                                  "barrier", "example-doubling")]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", SYNC)
def test_global_view_pairs_every_message(kind: str, world: int) -> None:
    scheds = build_all(kind, world, SIZE)
    edges, unmatched = match_messages(scheds)
    assert unmatched == []
    n_send = sum(op.kind == "send" for s in scheds for op in s.ops)
    assert len(edges) == n_send
    for e in edges:
        snd, rcv = scheds[e.src].ops[e.src_op], scheds[e.dst].ops[e.dst_op]
        assert (snd.kind, rcv.kind, snd.peer, rcv.peer, snd.tag) == ("send", "recv", e.dst,
                                                                    e.src, rcv.tag)
        assert op_bytes(scheds[e.src], snd) == op_bytes(scheds[e.dst], rcv)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_large_global_dot_parses() -> None:
    kind = "solo" if "solo" in KINDS else "example-doubling"
    scheds = build_all(kind, 8, SIZE)
    graphs = pydot.graph_from_dot_data(render_dot(scheds))
    assert graphs is not None
    names = {n.get_name() for sub in graphs[0].get_subgraphs() for n in sub.get_nodes()}
    assert names == {f"r{s.rank}_{i}" for s in scheds for i in range(len(s.ops))}
    assert len(graphs[0].get_edges()) == len(match_messages(scheds)[0])


def test_thresholds_drawn_distinctly() -> None:
    s = build("example-quorum", 0, 6, 64)  # rank 0: a 3-of-5 gate
    r1 = build("example-quorum", 1, 6, 64)  # rank 1: an OR
    assert {dep_class(op) for op in s.ops} >= {"k-of-n", "none"}
    assert "or" in {dep_class(op) for op in r1.ops}
    dot = render_dot([s, r1])
    assert 'style=dotted, label="3/5"' in dot
    assert 'style=dashed, label="OR"' in dot
    assert "\\n#" in dot  # DOT line breaks, not escaped backslashes
    assert "\\\\n" not in dot
    assert re.search(r"r0_\d+ -> r0_\d+ \[style=solid\]", render_dot(
        [build("example-doubling", 0, 4, 64)]))
    text = render([s, r1], "text")
    assert "3-of-5(" in text
    assert "OR(" in text


def test_layout_respects_dependencies() -> None:
    scheds = build_all("example-doubling", 8, 64)
    lay = layout(scheds)
    for s in scheds:
        y0, y1 = lay.bands[s.rank]
        for i, op in enumerate(s.ops):
            x, y = lay.pos[(s.rank, i)]
            assert y0 <= y < y1
            for d in op.deps:
                assert lay.pos[(s.rank, d)][0] < x


def test_unknown_format_lists_valid() -> None:
    with pytest.raises(ValueError, match="valid formats: text, dot, json, html"):
        render([build("example-doubling", 0, 2)], "svg")


def test_png(tmp_path: object) -> None:
    pytest.importorskip("matplotlib", reason="PNG output needs matplotlib (the plot extra)")
    from pathlib import Path

    out = Path(str(tmp_path)) / "dag.png"
    render_png(build_all("example-doubling", 3, 64), str(out), title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 2000
