"""Self-contained HTML pages: a schedule's DAG and a traced run's timeline.

Each page is one file with its data as inline JSON and a small inline script that draws SVG; it
loads nothing from the network. Clicking an op shows all its fields. Every op is also listed in a
plain HTML table (readable without scripts, and searchable with the browser's find).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..sched import Schedule
from .graph import (
    EDGE_STYLE,
    KIND_COLOR,
    dep_class,
    escape,
    layout,
    match_messages,
    op_fields,
    op_label,
)

__all__ = ["schedule_html", "timeline_html"]

_CSS = """
body{font-family:Helvetica,Arial,sans-serif;margin:0;display:flex;height:100vh}
#main{flex:1;overflow:auto;border-right:1px solid #ccc}
#side{width:360px;overflow:auto;padding:8px;font-size:12px;background:#fafafa}
pre{white-space:pre-wrap;font-size:11px}
svg text{font-size:11px;pointer-events:none}
svg text.dep-rule{font-size:7px;font-weight:bold;fill:#444}
.op{cursor:pointer}.op:hover{stroke:#000;stroke-width:2}
.sel{stroke:#d00!important;stroke-width:3!important}
table{border-collapse:collapse;font-size:11px}td,th{border:1px solid #ddd;padding:1px 4px}
h1{font-size:15px;margin:4px 0}
.key{margin-left:12px;font-size:12px;white-space:nowrap}
.key i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px}
.key b.line{display:inline-block;width:18px;border-top:1px solid #222;margin-right:4px;
vertical-align:3px;opacity:.6}
"""

_GRAPH_JS = r"""
const D = JSON.parse(document.getElementById('data').textContent);
const NS = 'http://www.w3.org/2000/svg', SX = 150, SY = 30, PX = 130, PY = 30;
const svg = document.createElementNS(NS, 'svg');
const W = PX * 2 + D.width * SX, H = PY * 2 + D.height * SY;
svg.setAttribute('viewBox', `0 0 ${W} ${H}`);
svg.setAttribute('id', 'dag');
// Fit the whole DAG into the window on open (no scrolling); the zoom buttons go from there.
const MAIN = document.getElementById('main');
const last = MAIN.lastElementChild;  // the title and the legend above the DAG
const top0 = last ? last.getBoundingClientRect().bottom - MAIN.getBoundingClientRect().top : 0;
let scale = Math.min(1, ((MAIN.clientWidth || window.innerWidth || 1100) - 16) / W,
                     Math.max(120, (MAIN.clientHeight || window.innerHeight || 800) - top0 - 24)
                     / H);
function fit() { svg.setAttribute('width', W * scale); svg.setAttribute('height', H * scale); }
fit();
document.getElementById('zin').onclick = () => { scale *= 1.5; fit(); };
document.getElementById('zout').onclick = () => { scale /= 1.5; fit(); };
const defs = document.createElementNS(NS, 'defs');
defs.innerHTML = '<marker id="arr" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" ' +
  'markerHeight="6" orient="auto"><path d="M0,0L10,5L0,10z" fill="#555"/></marker>';
svg.appendChild(defs);
function el(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  (parent || svg).appendChild(e); return e;
}
const X = x => PX + x * SX, Y = y => PY + y * SY;
for (const b of D.bands) {
  el('rect', {x: 4, y: Y(b.y0) - 16, width: PX + D.width * SX, height: (b.y1 - b.y0) * SY + 6,
              fill: '#f3f3f3', stroke: '#aaa', rx: 6});
  el('text', {x: 10, y: Y(b.y0) + 4}).textContent = 'rank ' + b.rank;
}
const pos = {};
for (const n of D.nodes) pos[n.key] = [X(n.x), Y(n.y)];
for (const e of D.edges) {
  const [x1, y1] = pos[e.from], [x2, y2] = pos[e.to];
  el('line', {x1: x1 + 55, y1: y1, x2: x2 - 55, y2: y2, stroke: '#555', 'stroke-dasharray': e.dash,
              'marker-end': 'url(#arr)', class: 'dep ' + e.cls});
}
for (const m of D.msgs) {
  const [x1, y1] = pos[m.from], [x2, y2] = pos[m.to];
  const d = `M${x1 + 55},${y1} Q${(x1 + x2) / 2 + 90},${(y1 + y2) / 2} ${x2 + 55},${y2}`;
  el('path', {d: d, fill: 'none',
              stroke: m.activation ? '#c0392b' : '#222', 'stroke-opacity': 0.55,
              'stroke-width': 1.5, 'marker-end': 'url(#arr)', class: 'msg'});
}
let selected = null;
for (const n of D.nodes) {
  const [x, y] = pos[n.key];
  const r = el('rect', {x: x - 55, y: y - 11, width: 110, height: 22, rx: 5, fill: n.color,
                        stroke: n.final ? '#000' : '#fff', class: 'op', 'data-key': n.key});
  el('text', {x: x, y: y + 4, 'text-anchor': 'middle'}).textContent = n.label;
  // an op's dependency rule once, above its box, not on each incoming edge (they overlap)
  if (n.dep) el('text', {x: x - 53, y: y - 12, class: 'dep-rule'}).textContent = n.dep;
  el('title', {}, r).textContent = n.fields.describe + (n.fields.bytes === null ? '' :
    ', ' + n.fields.bytes + ' bytes') + ', deps ' + n.fields.deps_class;
  r.addEventListener('click', () => {
    if (selected) selected.classList.remove('sel');
    r.classList.add('sel'); selected = r;
    document.getElementById('fields').textContent = JSON.stringify(n.fields, null, 1);
  });
}
document.getElementById('main').appendChild(svg);
"""

_TIMELINE_JS = r"""
const D = JSON.parse(document.getElementById('data').textContent);
const NS = 'http://www.w3.org/2000/svg', LH = 26, PX = 90, PY = 30;
// Fit the whole run into the window on open: from the first slice to the last end.
const T0 = D.slices.reduce((m, s) => Math.min(m, s.ts), Infinity) || 0;
const T1 = Math.max(D.span, T0 + 1);
const MAIN = document.getElementById('main');
let scale = Math.max(200, (MAIN.clientWidth || window.innerWidth || 1100) - 2 * PX - 20)
  / (T1 - T0);
function el(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  parent.appendChild(e); return e;
}
function draw() {
  const old = document.getElementById('tl'); if (old) old.remove();
  const svg = document.createElementNS(NS, 'svg'); svg.setAttribute('id', 'tl');
  const W = PX * 2 + (T1 - T0) * scale;
  svg.setAttribute('width', W);
  svg.setAttribute('height', PY * 2 + D.rows.length * LH);
  const X = t => PX + (t - T0) * scale, Y = r => PY + r * LH;
  D.rows.forEach((name, r) => {
    el('rect', {x: 0, y: Y(r), width: W, height: LH - 2,
                fill: r % 2 ? '#f7f7f7' : '#fff'}, svg);
    el('text', {x: 4, y: Y(r) + 16}, svg).textContent = name;
  });
  // a tick every 1, 2 or 5 x 10^k µs, at least 90 px apart
  let tick = Math.pow(10, Math.floor(Math.log10(Math.max(90 / scale, 1e-3))));
  for (const m of [1, 2, 5, 10]) if (m * tick * scale >= 90) { tick *= m; break; }
  for (let t = Math.ceil(T0 / tick) * tick; t <= T1; t += tick)
    el('text', {x: X(t), y: 14, fill: '#666'}, svg).textContent = (t / 1000).toFixed(
      tick >= 1000 ? 0 : tick >= 100 ? 1 : tick >= 10 ? 2 : 3) + ' ms';
  let selected = null;
  for (const s of D.slices) {
    const r = el('rect', {x: X(s.ts), y: Y(s.row) + 3, width: Math.max(1.5, s.dur * scale),
                          height: LH - 8, fill: s.color, class: 'op'}, svg);
    el('title', {}, r).textContent = s.name;
    r.addEventListener('click', () => {
      if (selected) selected.classList.remove('sel');
      r.classList.add('sel'); selected = r;
      document.getElementById('fields').textContent = JSON.stringify(s.fields, null, 1);
    });
  }
  for (const f of D.flows)
    el('line', {x1: X(f.t0), y1: Y(f.r0) + LH / 2, x2: X(f.t1), y2: Y(f.r1) + LH / 2,
                stroke: '#222', 'stroke-opacity': 0.5}, svg);
  document.getElementById('main').appendChild(svg);
}
document.getElementById('zin').onclick = () => { scale *= 2; draw(); };
document.getElementById('zout').onclick = () => { scale /= 2; draw(); };
draw();
"""


def _page(title: str, data: Any, script: str, side_extra: str, body_extra: str) -> str:
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return (
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
        f"<div id=\"main\"><h1>{escape(title)}</h1>{body_extra}</div>"
        "<div id=\"side\"><b>click an op to see its fields</b><pre id=\"fields\"></pre>"
        f"{side_extra}</div>"
        f"<script type=\"application/json\" id=\"data\">{blob}</script>"
        f"<script>{script}</script></body></html>\n")


def schedule_html(schedules: Sequence[Schedule], title: str = "") -> str:
    """The DAG page of one rank (one schedule) or of every rank (the global view)."""
    lay = layout(schedules)
    nodes: list[dict[str, Any]] = []
    edges: list[dict[str, Any]] = []
    rows: list[str] = []
    for s in schedules:
        for i, op in enumerate(s.ops):
            x, y = lay.pos[(s.rank, i)]
            f = op_fields(s, i)
            nodes.append({"key": f"r{s.rank}_{i}", "x": x, "y": y, "label": f"#{i} "
                          + op_label(op), "color": KIND_COLOR[op.kind], "final": i == s.final,
                          "fields": f})
            cls = dep_class(op)
            nodes[-1]["dep"] = (f"{op.k} of {len(op.deps)}" if cls == "k-of-n" else
                                f"OR of {len(op.deps)}" if cls == "or" else "")
            for d in op.deps:
                edges.append({"from": f"r{s.rank}_{d}", "to": f"r{s.rank}_{i}", "cls": cls,
                              "dash": EDGE_STYLE[cls][1]})
            rows.append(f"<tr><td>{s.rank}</td><td>{i}</td><td>{escape(op.describe())}</td>"
                        f"<td>{escape(str(f['bytes']))}</td><td>{cls} {op.k}/"
                        f"{len(op.deps)}: {escape(str(list(op.deps)))}</td></tr>")
    msgs = [{"from": f"r{e.src}_{e.src_op}", "to": f"r{e.dst}_{e.dst_op}",
             "activation": e.msg == "activation"}
            for e in (match_messages(schedules)[0] if len(schedules) > 1 else [])]
    data = {"nodes": nodes, "edges": edges, "msgs": msgs, "width": lay.width,
            "height": lay.height + 1,
            "bands": [{"rank": r, "y0": a, "y1": b} for r, (a, b) in lay.bands.items()]}
    s0 = schedules[0]
    head = (f"{title or s0.name or 'schedule'}: P={s0.world_size}, "
            + (f"rank {s0.rank}" if len(schedules) == 1 else f"{len(schedules)} ranks"))
    legend = ("<p><button id=\"zin\">zoom in</button> <button id=\"zout\">zoom out</button> "
              "edges: solid = AND (all of), dashed = OR (any of: \"OR of n\" above the op), "
              "dotted = any k of n (\"k of n\" above the op); curved = messages (red: "
              "activation). Colours: send blue, recv green, compute orange, nop grey; black "
              "border = the final op.</p>")
    table = ("<details><summary>all ops</summary><table><tr><th>rank</th><th>op</th>"
             "<th>what</th><th>bytes</th><th>deps</th></tr>" + "".join(rows)
             + "</table></details>")
    return _page(head, data, _GRAPH_JS, table, legend)


def timeline_html(title: str, rows: Sequence[str], slices: Sequence[dict[str, Any]],
                  flows: Sequence[dict[str, Any]], span_us: float,
                  legend: Mapping[str, str] | None = None) -> str:
    """A timeline page: ``rows`` names each track; a slice has ``row, ts, dur`` (µs from the
    run's start), ``name``, ``color`` and ``fields``; a flow joins ``(r0, t0)`` to ``(r1, t1)``;
    ``legend`` maps what a colour means to the colour (shown above the timeline).
    On open the page fits the whole run (first slice to last end) into the window's width;
    the zoom buttons halve or double the scale from there."""
    data = {"rows": list(rows), "slices": list(slices), "flows": list(flows),
            "span": span_us}
    table = ("<details><summary>all slices</summary><table><tr><th>track</th><th>op</th>"
             "<th>start µs</th><th>µs</th></tr>"
             + "".join(f"<tr><td>{escape(rows[s['row']])}</td><td>{escape(s['name'])}</td>"
                       f"<td>{s['ts']:.1f}</td><td>{s['dur']:.1f}</td></tr>" for s in slices)
             + "</table></details>")
    keys = "".join(f"<span class=\"key\"><i style=\"background:{escape(c)}\"></i>"
                   f"{escape(k)}</span>" for k, c in (legend or {}).items())
    buttons = ("<p><button id=\"zin\">zoom in</button> <button id=\"zout\">zoom out</button> "
               f"<span id=\"legend\">{keys}<span class=\"key\"><b class=\"line\"></b>"
               "message from a send to its matching receive</span></span></p>")
    return _page(title, data, _TIMELINE_JS, table, buttons)
