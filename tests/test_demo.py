"""``asynccoll demo --quick`` end to end: real rank processes, table, JSON and plot."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asynccoll.cli import main
from asynccoll.demo import DemoConfig, speedups


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_demo_quick_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "asynccoll.cli", "demo", "--quick", "--ranks", "3",
         "--steps", "6", "--delays", "0.5,1.0", "--out", str(out)],
        capture_output=True, text=True, timeout=80, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "speedup over sync" in proc.stdout
    assert "no GPU" in proc.stdout
    doc = json.loads((out / "demo.json").read_text())
    assert doc["bench"] == "demo"
    assert doc["params"]["ranks"] == 3
    rows = doc["rows"]
    assert {(r["mode"], r["delay_ratio"]) for r in rows} == {
        (m, d) for m in ("sync", "solo", "majority") for d in (0.5, 1.0)}
    for r in rows:
        assert r["P"] == 3
        assert r["rounds"] >= 6
        assert r["steps_per_s"] > 0
        assert r["curve"]
        assert r["final_val_mse"] < r["curve"][0][2]
        assert 1.0 <= r["mean_contributors"] <= 3.0
        if r["mode"] == "sync":
            assert r["mean_contributors"] == 3.0
    assert speedups(rows)[("sync", 0.5)] == 1.0
    assert (out / "demo.png").stat().st_size > 1000


def test_demo_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--modes", "sync,fast", "--quick"]) == 2
    assert "modes" in capsys.readouterr().out
    with pytest.raises(ValueError, match="steps"):
        DemoConfig(steps=1).check()


def _launch(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", *args],
                          capture_output=True, text=True, timeout=100,
                          cwd=Path(__file__).resolve().parents[1])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(110)
def test_hyperplane_example_runs_under_the_launcher() -> None:
    proc = _launch(["-n", "3", "examples/hyperplane.py", "--steps", "12", "--step-ms", "10",
                    "--dim", "32"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no GPU" in proc.stdout
    assert "final validation MSE" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("torch") is None
                    or importlib.util.find_spec("sklearn") is None,
                    reason="the torch extra (torch, scikit-learn) is not installed")
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(110)
def test_torch_digits_example_runs_under_the_launcher() -> None:
    proc = _launch(["-n", "2", "examples/torch_digits.py", "--steps", "30", "--step-ms", "5"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"sync: \d+ steps in", out)
    assert re.search(r"majority: \d+ steps in", out)
    acc = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "steps in" in line]
    assert len(acc) == 2
    assert min(acc) > 0.5  # well above chance (0.1) after 30 steps
