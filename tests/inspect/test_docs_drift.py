"""docs/inspect.md and docs/diagnosis.md against the current code: the commands and options
they show exist, the schedules they describe are what the builders build, and the schedule
ids they show are the ids the runtime gives (so a change that makes them wrong fails here)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from asynccoll.comm.partial import stable_id
from asynccoll.inspect.cli import configure
from asynccoll.inspect.kinds import build

DOCS = Path(__file__).parents[2] / "docs"
INSPECT = (DOCS / "inspect.md").read_text()
DIAGNOSIS = (DOCS / "diagnosis.md").read_text()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    configure(p)
    return p


def test_every_command_and_option_shown_exists() -> None:
    p = _parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    synopsis = INSPECT.split("```")[1]
    shown = set(re.findall(r"asynccoll inspect (\w+)", synopsis))
    assert shown == set(sub.choices), "docs/inspect.md's synopsis lists other commands"
    for cmd, sp in sub.choices.items():
        opts = {o for a in sp._actions for o in a.option_strings if o.startswith("--")}
        line = " ".join(x for x in synopsis.split("asynccoll inspect ")[1:]
                        if x.startswith(cmd))
        for opt in re.findall(r"--[\w-]+", line):
            assert opt in opts, f"{cmd} {opt} in docs/inspect.md is not an option"


def test_the_solo_schedule_described_is_the_one_built() -> None:
    s = build("solo", 0, 8, 4096)
    (act,) = [op for op in s.ops if op.label == "activated"]
    assert "`activated [1/5]`" in INSPECT
    assert (act.k, len(act.deps)) == (1, 5)
    kinds = {s.ops[d].label or s.ops[d].kind for d in act.deps}
    assert {"internal start", "forced activation", "activation in"} <= kinds
    assert any(s.ops[d].kind == "recv" and s.ops[d].msg == "data" for d in act.deps), \
        "the doc says the first data message activates too"
    snaps = [op for op in s.ops if op.kind == "compute" and op.kernel == "partial_snapshot"]
    assert len(snaps) == 1
    assert "metadata appended" in INSPECT
    assert snaps[0].params["packed"], "float32 sums carry the metadata in the data allreduce"


def test_schedule_ids_shown_are_the_runtimes() -> None:
    shown = {int(x) for x in re.findall(r"sched_id (\d{6,})", INSPECT + DIAGNOSIS)}
    assert shown, "the docs show the 64-bit ids of named handles"
    names = {stable_id(n, 0): n for n in ("grads", "h", "q")}
    assert shown <= set(names), f"ids not of handles named {sorted(names.values())}: " \
        f"{sorted(shown - set(names))}"
    assert all(i >= 1 << 62 for i in shown)
