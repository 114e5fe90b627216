"""Hang explanations name the rank(s) actually absent, never the waiting rank itself: the
stall warning (which asks the other ranks), the timeout that follows, and ``asynccoll inspect
pending`` over the snapshots, for majority, two-choice, quorum and a synchronous allreduce."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest

from asynccoll import CollectiveTimeoutError, Majority, Quorum, TwoChoice
from asynccoll.collectives.partial import initiators
from asynccoll.inspect.pending import explain
from asynccoll.inspect.tracefile import load_dir
from asynccoll.sched.waits import diagnose
from asynccoll.testing import local_world

MAJORITY_SEED = 1  # S(0) = {3} for P = 4
TWO_CHOICE_SEED = 3  # S(0) = {2, 3} for P = 4


def test_the_seeds_draw_the_ranks_the_tests_leave_out() -> None:
    assert initiators("majority", 0, 4, MAJORITY_SEED) == {3}
    assert initiators("two_choice", 0, 4, TWO_CHOICE_SEED) == {2, 3}


async def _stall(tmp: Path, kind: str, callers: list[int], caplog: pytest.LogCaptureFixture,
                 ) -> tuple[list[str], list[str]]:
    """Ranks ``callers`` call a ``kind`` collective of 4 ranks that cannot complete; returns
    their stall warnings and timeout messages."""
    x = np.ones(4)
    errors: list[str] = []
    async with local_world(4, stall_warn=0.2, trace=str(tmp)) as comms:
        if kind == "allreduce":
            calls = [comms[r].allreduce(x, timeout=0.8) for r in callers]
        else:
            policy = {"majority": Majority(seed=MAJORITY_SEED), "quorum": Quorum(3),
                      "two_choice": TwoChoice(seed=TWO_CHOICE_SEED)}.get(kind, kind)
            hs = [c.partial_allreduce(policy, like=x, name="h") for c in comms]
            calls = [hs[r](x, timeout=0.8) for r in callers]
        with caplog.at_level(logging.WARNING, logger="asynccoll.comm"):
            for res in await asyncio.gather(*calls, return_exceptions=True):
                assert isinstance(res, CollectiveTimeoutError), res
                errors.append(str(res))
            warns = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
        for c in comms:  # nothing will complete: no goodbyes to wait for
            await c.close(timeout=0)
    return warns, errors


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("kind", "callers", "absent", "says"), [
    ("majority", [0, 1, 2], [3], "waiting for initiator 3 of execution 0"),
    ("two_choice", [0, 1], [2, 3], "waiting for initiators [2, 3] (the first to call)"),
    ("quorum", [0, 1], [2, 3], "quorum 2 of 4 arrived (needs 3): missing [2, 3]"),
    ("allreduce", [0, 1, 2], [3], "waiting for rank(s)"),
])
async def test_every_kind_names_the_absent_ranks(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                 kind: str, callers: list[int],
                                                 absent: list[int], says: str) -> None:
    warns, errors = await _stall(tmp_path, kind, callers, caplog)
    assert {int(w.split(":")[0].split()[1]) for w in warns} == set(callers), warns
    for text in (*warns, *errors):
        assert f"absent rank(s) {absent}" in text, text
        assert says in text, text
        for r in callers:  # a waiting rank is never blamed, nor said to wait for itself
            assert f"rank {r} has not called" not in text
        assert "(waiting for rank" not in text.split("waiting on: ")[1].split(";")[0]
    (exp,) = [x for x in explain(load_dir(tmp_path)) if x.execution == 0]
    assert exp.culprits == absent, str(exp)


def test_diagnose_follows_the_chain_to_the_rank_that_does_not_answer() -> None:
    # rank 2 waits for rank 0, which waits for rank 1, which does not answer
    me = {"sid": 5, "name": "allreduce", "execution": 4, "completed": 3, "state": "started",
          "activated": True, "waits": [0], "text": "execution 4: waiting for rank(s) [0]"}
    r0 = {**me, "waits": [1], "text": "execution 4: waiting for rank(s) [1]"}
    r3 = {**me, "waits": [], "completed": 4, "execution": 5, "text": "done"}
    text = diagnose(2, me, {0: [r0], 1: None, 3: [r3]}, lambda p: f"last heard {p}")
    assert text.startswith("execution 4: waiting for rank(s) [0]; absent rank(s) [1]: rank 1 "
                           "not responding (stopped, blocked or gone; last heard 1)"), text
    assert "rank 0 execution 4: waiting for rank(s) [1]" in text
    # every awaited rank answered: nobody is blamed
    assert "every awaited rank answered" in diagnose(2, me, {0: [{**r0, "waits": [2]}]})
