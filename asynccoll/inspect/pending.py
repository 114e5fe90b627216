"""Explain a hang: which ops of which ranks wait, and on whom.

Two sources of evidence:

- **traces** (:func:`explain`): the ``pending`` snapshots ranks wrote into a trace directory when
  a collective timed out or on ``SIGUSR1``, plus their schedules and completed executions;
- **live executors** (:func:`explain_executors`): executors of this process, e.g. the ranks of an
  in-process world, or those a :class:`~asynccoll.sched.LiveOps` tracks.

For the stuck execution of each collective, every pending receive is followed to the peer's
matching send; a rank that is waited on and has not joined the execution (no snapshot, never
armed, or armed but never started from inside and not activated from outside) is named as a
**culprit**. Recording snapshots and dumping live executors on a signal are the engine's job
(:mod:`asynccoll.sched.tracefile`, :mod:`asynccoll.sched.live`); a Communicator installs the
``SIGUSR1`` handler (``asynccoll inspect pending DIR --pid PID`` sends the signal).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..sched import Executor, Schedule
from ..sched.tracefile import pending_snapshot
from ..sched.waits import follow_waits
from .graph import match_messages
from .tracefile import RankTrace

__all__ = ["Explanation", "explain", "explain_executors", "render_explanations"]


# -- the analysis ----------------------------------------------------------------------------
@dataclass
class Explanation:
    """Why execution ``execution`` of collective ``sched_id`` has not completed."""

    sched_id: int
    name: str
    execution: int
    culprits: list[int]
    waits: dict[int, list[int]]  # rank -> ranks it waits on
    lines: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(self.lines)


def _rows(snap: Mapping[str, Any] | None) -> list[list[Any]]:
    rec = (snap or {}).get("record") or {}
    rows: list[list[Any]] = rec.get("ops") or []
    return rows


def _state(s: Schedule | None, snap: Mapping[str, Any] | None, done: bool) -> str:
    """completed | absent (no snapshot) | not armed | started | not started | activated."""
    if done:
        return "completed"
    if snap is None:
        return "absent"
    rec = snap.get("record")
    if rec is None:
        return "not armed"
    status = snap.get("status")
    if isinstance(status, Mapping) and status.get("state") not in (None, "idle"):
        return str(status["state"])  # what the rank saw of itself: called, not called, ...
    if rec.get("started") is not None:
        return "started"
    rows = _rows(snap)
    if s is not None and any(s.ops[i].deps and rows[i][2] is not None
                             for i in range(min(len(rows), len(s.ops)))):
        return "activated"  # ops past the sources ran: activated from outside
    return "not started"


def _blockers(s: Schedule, rows: list[list[Any]], j: int) -> tuple[bool, set[int]]:
    """Why op ``j`` has not fired: (an unfired start source, i.e. the rank has not called; the
    peers whose messages incomplete source receives upstream of ``j`` wait for)."""
    need_start, peers = False, set()
    seen: set[int] = set()
    stack = [j]
    while stack:
        i = stack.pop()
        if i in seen or i >= len(rows):
            continue
        seen.add(i)
        op = s.ops[i]
        if rows[i][2] is not None:
            continue
        if not op.deps:
            if op.kind == "recv":
                peers.add(op.peer)
            elif rows[i][1] is None:
                need_start = True
            continue
        if op.kind == "recv" and rows[i][1] is not None:
            peers.add(op.peer)
            continue
        stack.extend(op.deps)
    return need_start, peers


def _explain_one(sid: int, name: str, e: int, world: int, scheds: Mapping[int, Schedule],
                 snaps: Mapping[int, Mapping[str, Any] | None],
                 done: Mapping[int, set[int]]) -> Explanation:
    edges, _ = match_messages([scheds[r] for r in sorted(scheds)])
    send_of = {(m.dst, m.dst_op): m for m in edges}
    recv_of = {(m.src, m.src_op): m for m in edges}
    state = {r: _state(scheds.get(r), snaps.get(r), e in done.get(r, set()))
             for r in range(world)}
    lines = [f"{name} (sched_id {sid}) execution {e}: "
             + ", ".join(f"rank {r} {state[r]}" for r in range(world))]
    waits: dict[int, set[int]] = {}
    culprits: set[int] = set()
    for r in range(world):
        snap = snaps.get(r)
        if snap is None or state[r] == "completed" or snap.get("record") is None:
            continue
        s = scheds.get(r)
        for _, i, desc in snap.get("pending", []):
            op = s.ops[i] if s is not None and 0 <= i < len(s.ops) else None
            if op is None or op.kind not in ("send", "recv"):
                lines.append(f"  rank {r}: {desc}")
                continue
            peer, pst = op.peer, state[op.peer]
            if peer == r or op.msg == "activation" or (
                    not op.deps and state[r] in ("called", "not called")):
                lines.append(f"  rank {r}: {desc}")  # a way to be activated, not a wait
                continue
            if op.kind == "send":
                m = recv_of.get((r, i))
                where = "" if m is None else f"receive op {m.dst_op} of "
                lines.append(f"  rank {r}: {desc}: {where}rank {peer}, which is {pst}")
                continue
            m = send_of.get((r, i))
            if pst in ("absent", "not armed"):
                why = (f"rank {peer} left no trace of execution {e}" if pst == "absent"
                       else f"rank {peer} never joined execution {e}")
                culprits.add(peer)
                waits.setdefault(r, set()).add(peer)
            elif pst == "completed":
                why = f"rank {peer} completed execution {e}; message lost or mismatched"
            elif m is None:
                why = f"no matching send in rank {peer}'s schedule"
                waits.setdefault(r, set()).add(peer)
            elif _fired(snaps, peer, m.src_op):
                why = f"rank {peer}'s send op {m.src_op} is in flight"
            else:
                waits.setdefault(r, set()).add(peer)
                ps = scheds.get(peer)
                need_start, upstream = (_blockers(ps, _rows(snaps.get(peer)), m.src_op)
                                        if ps is not None else (False, set()))
                if need_start and pst == "called":
                    why = (f"rank {peer}'s send op {m.src_op} has not fired: rank {peer} "
                           f"called execution {e} and waits to be activated")
                elif need_start:
                    culprits.add(peer)
                    why = (f"rank {peer}'s send op {m.src_op} waits for rank {peer} to call "
                           f"execution {e}: rank {peer} has not called (never started) it")
                else:
                    why = (f"rank {peer}'s send op {m.src_op} has not fired yet"
                           + (f"; rank {peer} waits on rank(s) {sorted(upstream)}"
                              if upstream else ""))
            lines.append(f"  rank {r}: {desc}: {why}")
    statuses = _statuses(sid, e, world, snaps, done)
    if statuses is not None:
        # Every rank said what it waits for: follow the waits (as a live stall warning does)
        # instead of guessing from the schedules, which cannot tell a rank that called and
        # waits for its initiator from one that never called.
        culprits = set()
        for r, st in statuses.items():
            if st is None or st[0].get("completed", -1) >= e:
                continue
            absent, _, _ = follow_waits(r, st[0], statuses)
            culprits.update(absent)
    if culprits:
        lines.append(f"  => waiting on rank(s) {sorted(culprits)}, which never joined "
                     f"execution {e}")
    elif waits:
        lines.append("  => every awaited rank has joined; a dependency cycle or lost message")
    return Explanation(sid, name, e, sorted(culprits),
                       {r: sorted(p) for r, p in waits.items()}, lines)


def _statuses(sid: int, e: int, world: int, snaps: Mapping[int, Mapping[str, Any] | None],
              done: Mapping[int, set[int]]) -> dict[int, list[dict[str, Any]] | None] | None:
    """Each rank's status of execution ``e`` as a probe would answer (``None``: left no
    snapshot), or ``None`` when some snapshot predates statuses."""
    out: dict[int, list[dict[str, Any]] | None] = {}
    for r in range(world):
        snap = snaps.get(r)
        if e in done.get(r, set()):
            out[r] = [{"sid": sid, "execution": e + 1, "completed": e, "state": "completed",
                       "waits": [], "text": f"completed execution {e}"}]
        elif snap is None:
            out[r] = None
        elif not isinstance(snap.get("status"), Mapping):
            return None
        else:
            out[r] = [dict(snap["status"])]
    return out


def _fired(snaps: Mapping[int, Mapping[str, Any] | None], r: int, i: int) -> bool:
    rows = _rows(snaps.get(r))
    return i < len(rows) and rows[i][1] is not None


def explain(traces: Mapping[int, RankTrace]) -> list[Explanation]:
    """Explain every collective that some rank recorded as pending, from a trace directory.

    The stuck execution of a collective is the lowest execution with a pending snapshot; each
    rank's latest snapshot of that execution is used. Ranks with no file are ``absent``.
    """
    out = []
    world = max((rt.world_size for rt in traces.values()), default=0)
    sids = sorted({sid for rt in traces.values() for sid in rt.pending})
    for sid in sids:
        e = min(int(p["execution"]) for rt in traces.values() for p in rt.pending.get(sid, []))
        scheds: dict[int, Schedule] = {}
        name = f"sched {sid}"
        for r, rt in traces.items():
            s = rt.schedule(sid)
            if s is not None:
                scheds[r] = s
                rec = rt.schedules[sid]
                name = str(rec.get("collective") or rec.get("name") or name)
        snaps: dict[int, Mapping[str, Any] | None] = {}
        done: dict[int, set[int]] = {}
        for r, rt in traces.items():
            done[r] = {int(x["execution"]) for x in rt.executions.get(sid, [])}
            mine = [p for p in rt.pending.get(sid, []) if int(p["execution"]) == e]
            snaps[r] = mine[-1] if mine else None
        out.append(_explain_one(sid, name, e, world, scheds, snaps, done))
    return out


def explain_executors(executors: Iterable[Executor]) -> list[Explanation]:
    """Explain the current executions of executors of one process (e.g. an inproc world).

    Executors are grouped by ``sched_id``; a rank without an executor counts as absent.
    """
    groups: dict[int, list[Executor]] = {}
    for ex in executors:
        groups.setdefault(ex.sched_id, []).append(ex)
    out = []
    for sid, exs in sorted(groups.items()):
        world = exs[0].schedule.world_size
        e = min(ex.execution for ex in exs if not ex.test()) if any(
            not ex.test() for ex in exs) else min(ex.execution for ex in exs)
        scheds = {ex.schedule.rank: ex.schedule for ex in exs}
        snaps: dict[int, Mapping[str, Any] | None] = {
            ex.schedule.rank: pending_snapshot(ex) for ex in exs if ex.execution == e}
        done = {ex.schedule.rank: set(range(ex.completed + 1)) for ex in exs}
        out.append(_explain_one(sid, exs[0].schedule.name or f"sched {sid}", e, world, scheds,
                                snaps, done))
    return out


def render_explanations(exps: Iterable[Explanation]) -> str:
    """Text of every explanation (or a line saying nothing is pending)."""
    parts = [str(x) for x in exps]
    return ("\n".join(parts) if parts else "no pending snapshots: nothing appears stuck") + "\n"
