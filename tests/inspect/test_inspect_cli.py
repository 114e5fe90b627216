"""``asynccoll inspect schedule`` / ``kinds``: output, files, and errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asynccoll import Schedule
from asynccoll.cli import main
from asynccoll.inspect.kinds import available_kinds, build, call_builder, get_kind

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize(("argv", "message"), [
    (["nope", "--ranks", "4"], "unknown kind 'nope'; available kinds: "),
    (["example-doubling", "--ranks", "0"], "--ranks (P) must be >= 1, got 0"),
    (["example-doubling", "--ranks", "4", "--rank", "4"], "--rank must be in 0..3 for P=4"),
    (["example-doubling", "--ranks", "4", "--rank", "-1"], "--rank must be in 0..3"),
    (["example-doubling", "--ranks", "2", "--size", "0"], "--size must be >= 1"),
    (["example-doubling", "--ranks", "2", "--format", "png"], "needs --out"),
])
def test_bad_arguments_exit_2(argv: list[str], message: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "schedule", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    if "unknown kind" in message:
        for k in available_kinds():
            assert k in err


def test_unknown_algorithm_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "schedule", "allreduce", "--ranks", "4", "--algorithm",
                 "bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_formats_to_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for fmt in ("text", "dot", "json", "html", "png"):
        out = tmp_path / f"s.{fmt}"
        assert main(["inspect", "schedule", "example-quorum", "--ranks", "3", "--rank", "0",
                     "--format", fmt, "--out", str(out)]) == 0
        assert out.stat().st_size > 100
    assert Schedule.from_dict(json.loads((tmp_path / "s.json").read_text())) == build(
        "example-quorum", 0, 3)
    assert main(["inspect", "schedule", "example-doubling", "-P", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 of 2" in out
    assert "rank 1 of 2" in out
    assert "messages (2 matched" in out
    assert main(["inspect", "kinds"]) == 0
    assert "example-quorum" in capsys.readouterr().out


def test_call_builder_adapts_signatures() -> None:
    def b(rank: int, world_size: int, count: int, *, algorithm: str = "x") -> Schedule:
        s = Schedule(rank, world_size, f"{count}-{algorithm}")
        s.nop()
        return s

    assert call_builder(b, 0, 2, 64, "ring").name == "16-ring"

    def needs(rank: int, P: int, mystery: int) -> Schedule:
        raise AssertionError

    with pytest.raises(TypeError, match="'mystery'"):
        call_builder(needs, 0, 2, 64, None)
    with pytest.raises(ValueError, match="available kinds"):
        get_kind("solo-but-misspelt")


@pytest.mark.timeout(60)
def test_command_line_entry_point() -> None:
    r = subprocess.run([sys.executable, "-m", "asynccoll.cli", "inspect", "schedule", "nope",
                        "--ranks", "2"], capture_output=True, text=True, timeout=50, check=False)
    assert r.returncode == 2
    assert "available kinds" in r.stderr
