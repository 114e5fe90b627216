"""What one rank's execution waits for, from what that rank alone can see.

:func:`wait_status` reads an executor's current execution and says, in data and in one line,
what keeps it from completing: the ranks whose messages it waits for (the data phase), the
initiator it waits for (a partial collective not yet activated), or the arrivals a quorum
misses. A rank never names itself: a receive from this rank (the forced activation of a
partial schedule) is a means of activation, not a rank to wait for, and activation receives
from hypercube neighbours only relay whichever initiator starts the execution.

This is the local half of a hang explanation; :mod:`asynccoll.comm.stall` asks the other ranks
for theirs and follows the chain of waits to the rank(s) actually absent. Costs O(ops); it runs
only when something is explained (a stall, a timeout, a dump), never per message.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

from .schedule import Schedule

__all__ = ["Waiting", "activation_op", "diagnose", "follow_waits", "quorum_op", "wait_status"]


class Waiting(Protocol):
    """What :func:`wait_status` reads of an :class:`~asynccoll.sched.Executor`."""

    schedule: Schedule
    sched_id: int
    execution: int
    completed: int
    called: int
    initiators: Callable[[int], Collection[int]] | None

    @property
    def error(self) -> BaseException | None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def armed(self) -> bool: ...
    @property
    def started(self) -> bool: ...
    def progress(self) -> tuple[bytearray, list[float]]: ...


def activation_op(ex: Waiting) -> int | None:
    """The op whose completion means "this rank is activated" in a schedule with an
    activation front (the op labelled ``activated``, else the OR over most activation
    receives), or ``None`` for a schedule that starts only from inside (dense ones)."""
    ops = ex.schedule.ops
    act_recvs = {i for i, op in enumerate(ops)
                 if op.kind == "recv" and not op.deps and op.msg == "activation"}
    if not act_recvs:
        return None
    best, score = None, 0
    for i, op in enumerate(ops):
        if op.label == "activated":
            return i
        if op.k == 1 and len(op.deps) > 1:
            n = len(act_recvs.intersection(op.deps))
            if n > score:
                best, score = i, n
    return best


def quorum_op(ex: Waiting) -> int | None:
    """The threshold op (a no-op needing k > 1 of its dependencies) that counts a quorum's
    arrivals (activation receives from other ranks), or ``None``."""
    ops = ex.schedule.ops
    for i, op in enumerate(ops):
        if op.kind == "nop" and op.k > 1 and any(
                ops[d].kind == "recv" and not ops[d].deps and ops[d].msg == "activation"
                for d in op.deps):
            return i
    return None


def wait_status(ex: Waiting) -> dict[str, Any]:
    """What ``ex``'s current execution waits for, as a JSON-safe dict.

    Keys: ``sid``, ``name``, ``execution``, ``completed``, ``state`` (``failed``, ``closed``,
    ``idle`` (nothing armed), ``not called`` (armed, not called here nor activated),
    ``called`` (a call waits, not activated yet), ``started``, ``activated`` (from
    outside)), ``activated`` (bool), ``waits`` (ranks this rank waits for: the senders of its
    pending data receives, or a quorum's missing arrivals, or the initiators when known),
    ``sending`` (ranks its pending sends go to) and ``text``, one line that never names this
    rank as one it waits for.
    """
    s = ex.schedule
    me, e = s.rank, ex.execution
    out: dict[str, Any] = {"sid": ex.sched_id, "name": s.name or "schedule", "execution": e,
                           "completed": ex.completed, "activated": False, "waits": [],
                           "sending": []}
    if ex.error is not None:
        return {**out, "state": "failed", "text": f"failed: {ex.error}"}
    if ex.closed:
        return {**out, "state": "closed", "text": "closed"}
    fired, done = ex.progress()
    if not ex.armed:
        return {**out, "state": "idle",
                "text": f"execution {e} not started on this rank (last completed "
                        f"{ex.completed})"}
    ops = s.ops

    def is_done(i: int) -> bool:
        return done[i] == done[i]  # not NaN

    called = ex.started or ex.called == e
    act = activation_op(ex)
    if act is None:  # begins only from inside (dense), unless it has no start at all
        activated = ex.started or all(op.deps or op.kind == "recv" for op in ops)
        if not activated:
            return {**out, "state": "not called",
                    "text": f"execution {e}: armed, this rank has not called it"}
    else:
        activated = is_done(act)
    out["activated"] = activated
    if not activated:
        q = quorum_op(ex)
        if q is not None and not is_done(q):
            dq = ops[q].deps
            arrived = sorted({me if ops[d].kind != "recv" else ops[d].peer
                              for d in dq if is_done(d)})
            missing = sorted(set(range(s.world_size)) - set(arrived))
            text = (f"execution {e}: quorum {len(arrived)} of {s.world_size} arrived (needs "
                    f"{ops[q].k}): missing {missing}")
            waits = [r for r in missing if r != me]
        else:
            inits = None if ex.initiators is None else sorted(ex.initiators(e))
            if inits is None:
                text = f"execution {e}: not activated; waiting for its initiator(s) to start it"
                waits = []
            else:
                waits = [r for r in inits if r != me]
                who = (f"initiator {inits[0]}" if len(inits) == 1
                       else f"initiators {inits} (the first to call)")
                text = f"execution {e}: waiting for {who} of execution {e}"
                if me in inits and not ex.started:
                    text += " (this rank is one and has not called)"
        state = "called" if called else "not called"
        if not called:
            text += "; this rank has not called it"
        return {**out, "state": state, "waits": waits, "text": text}
    waits = sorted({op.peer for i, op in enumerate(ops)
                    if op.kind == "recv" and fired[i] and not is_done(i) and op.peer != me
                    and op.msg != "activation"})
    sending = sorted({op.peer for i, op in enumerate(ops)
                      if op.kind == "send" and fired[i] and not is_done(i) and op.peer != me
                      and op.msg != "activation"})
    state = "started" if ex.started else "activated"
    if waits:
        text = f"execution {e}: waiting for rank(s) {waits}"
    elif sending:
        text = f"execution {e}: sending to rank(s) {sending}"
    else:
        text = f"execution {e}: running local ops"
    return {**out, "state": state, "activated": True, "waits": waits, "sending": sending,
            "text": text}


def _entry(answer: list[dict[str, Any]] | None, sid: int) -> dict[str, Any] | None:
    for x in answer or ():
        if x.get("sid") == sid:
            return x
    return None


def diagnose(rank: int, local: Mapping[str, Any],
             answers: Mapping[int, list[dict[str, Any]] | None],
             last_heard: Callable[[int], str] | None = None) -> str:
    """One line: ``local``'s text, then :func:`follow_waits`'s absent ranks and chain."""
    absent, chain, unknown_initiator = follow_waits(rank, local, answers, last_heard)
    text = str(local["text"])
    if unknown_initiator and absent:
        # Every initiator that called would have started it (and activated this rank), so
        # the initiators are among the absent: the one, when only one is absent.
        e = local["execution"]
        text = (f"execution {e}: waiting for initiator {next(iter(absent))} of execution {e}"
                if len(absent) == 1 else
                f"execution {e}: waiting for its initiator(s), among rank(s) {sorted(absent)}")
    if absent:
        text += (f"; absent rank(s) {sorted(absent)}: "
                 + "; ".join(absent[r] for r in sorted(absent)))
    elif local.get("waits") or unknown_initiator:
        text += "; every awaited rank answered and has joined (a message in flight or lost)"
    if chain:
        text += " [" + "; ".join(chain) + "]"
    return text


def follow_waits(rank: int, local: Mapping[str, Any],
                 answers: Mapping[int, list[dict[str, Any]] | None],
                 last_heard: Callable[[int], str] | None = None,
                 ) -> tuple[dict[int, str], list[str], bool]:
    """The explanation of a wait of ``rank`` (its :func:`~asynccoll.sched.waits.wait_status`
    ``local``) from the other ranks' ``answers`` to a probe (``None``: did not answer).

    Follows the waits from ``rank``: an awaited rank that did not answer, has no such
    collective, or has not called the execution is **absent**; one that answers waiting is
    followed to the ranks it waits for. When ``rank`` waits to be activated by initiators it
    does not know, every rank that did not answer or has not called is a candidate. Returns
    ``({absent rank: why}, the chain of waits followed, whether the initiator was unknown)``.
    ``answers`` maps each other rank to its statuses (a list of :func:`wait_status` dicts;
    ``None``: did not answer); ranks missing from it are skipped.
    """
    sid, e, name = local["sid"], int(local["execution"]), local["name"]
    unknown_initiator = (not local.get("activated") and not local.get("waits")
                         and local.get("state") in ("called", "started"))
    todo = [r for r in answers] if unknown_initiator else list(local.get("waits") or [])
    absent: dict[int, str] = {}
    chain: list[str] = []
    seen = {rank}
    while todo:
        p = todo.pop(0)
        if p in seen:
            continue
        seen.add(p)
        if p not in answers:
            continue
        ans = answers[p]
        if ans is None:
            heard = "" if last_heard is None else f"; {last_heard(p)}"
            absent[p] = f"rank {p} not responding (stopped, blocked or gone{heard})"
            continue
        st = _entry(ans, sid)
        if st is None:
            doing = "; ".join(f"{x.get('name')} {x.get('text')}" for x in ans
                              if x.get("state") not in ("idle", "closed")) or "nothing"
            absent[p] = f"rank {p} has not created {name} (it is doing: {doing})"
            continue
        pe, pc = int(st.get("execution", -1)), int(st.get("completed", -1))
        if pc >= e:
            chain.append(f"rank {p} completed execution {e}")
            continue
        state = st.get("state")
        if pe <= e and state in ("idle", "not called"):
            behind = "" if pe == e else f" (it completed only up to execution {pc})"
            absent[p] = f"rank {p} has not called execution {e}{behind}"
            continue
        if state in ("failed", "closed"):
            absent[p] = f"rank {p} {state}: {st.get('text')}"
            continue
        if unknown_initiator and state == "called":
            continue  # waits for an activation too: not the initiator
        if pe < e:
            chain.append(f"rank {p} is still in execution {pe}: {st.get('text')}")
        else:
            chain.append(f"rank {p} {st.get('text')}")
        nxt = [int(r) for r in st.get("waits") or []]
        if not nxt and pe < e:
            absent[p] = f"rank {p} has not reached execution {e} ({st.get('text')})"
        todo.extend(nxt)
    return absent, chain, unknown_initiator
