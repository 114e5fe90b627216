"""Every option of ``asynccoll demo``, ``inspect``, ``sim`` and ``run`` says what it does, and
the ones that take a fixed set of values list them (policies, the ``--compute`` syntax, modes;
for ``run``, what ``--max-restarts`` sets)."""

from __future__ import annotations

import argparse
import importlib

import pytest

from asynccoll.cli import SUBCOMMANDS, main


def _parsers(p: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(p.prog, p)]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sp in a.choices.values():
                out += _parsers(sp)
    return out


@pytest.mark.parametrize("cmd", ["demo", "inspect", "sim", "run"])
def test_every_option_has_help(cmd: str) -> None:
    p = argparse.ArgumentParser(prog=f"asynccoll {cmd}")
    importlib.import_module(SUBCOMMANDS[cmd][0]).configure(p)
    missing = [f"{prog} {a.option_strings or a.dest}" for prog, sp in _parsers(p)
               for a in sp._actions
               if not isinstance(a, argparse._SubParsersAction | argparse._HelpAction)
               and not a.help]
    assert not missing, missing


@pytest.mark.parametrize(("argv", "said"), [
    (["sim", "run", "--help"], ["two_choice", "quorum:K", "backup:B", "deadline",
                                "lognormal[:median=0.01,sigma=0.5]", "slow_group"]),
    (["sim", "replay", "--help"], ["two_choice", "quorum:K", "--tie", "tie"]),
    (["demo", "--help"], ["two_choice", "deadline", "sync"]),
    (["inspect", "trace", "--help"], ["--all", "hosts", "agree"]),
    (["run", "--help"], ["--max-restarts N", "ASYNCCOLL_RESTART=k", "ASYNCCOLL_MAX_FAILURES >= 1",
                         "--max-failures applies", "replacing a lost one"]),
])
def test_help_lists_the_values(argv: list[str], said: list[str],
                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for s in said:
        assert s in out, (s, out)
