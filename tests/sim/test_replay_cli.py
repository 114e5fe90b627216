"""``asynccoll sim replay`` on a trace recorded here (4 ranks over tcp), and the other
``asynccoll sim`` subcommands."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from asynccoll import Majority
from asynccoll.cli import main
from asynccoll.inspect.tracefile import load_dir
from asynccoll.sim import BUILTIN_PROFILES, Profile
from asynccoll.sim.cost import LinkClass, SharedCores
from asynccoll.sim.replay import compute_times, recommend
from asynccoll.testing import local_world


async def _record(directory: Path) -> None:
    async with local_world(4, "tcp", trace=str(directory), timeout=30) as comms:
        hs = [c.partial_allreduce(Majority(), like=np.zeros(8, np.float32), name="grads")
              for c in comms]

        async def rank(r: int) -> None:
            for _ in range(8):
                await asyncio.sleep(0.003 * r)  # rank r computes 3r ms per step
                await hs[r](np.ones(8, np.float32), timeout=20)
            await hs[r].flush(timeout=20)

        await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(4))), 60)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("trace")
    asyncio.run(_record(d))
    return d


@pytest.mark.timeout(90)
def test_compute_times_follow_the_recorded_skew(trace_dir: Path) -> None:
    times, _, info = compute_times(load_dir(trace_dir))
    assert times.shape[1] == 4
    assert info["nbytes"] == 32
    med = np.median(times, axis=0)
    # rank 3 computes 9 ms a step, rank 0 nothing: the order survives the recording
    assert med[3] > med[0] + 0.004, med


@pytest.mark.timeout(90)
def test_replay_cli_prints_every_policy_and_recommends(trace_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       ) -> None:
    out_json = tmp_path / "replay.json"
    plot = tmp_path / "replay.png"
    code = main(["sim", "replay", str(trace_dir), "--policies",
                 "sync,solo,majority,two_choice,quorum:3,backup:1,deadline",
                 "--recommend", "--max-staleness", "1", "--json", str(out_json),
                 "--plot", str(plot)])
    assert code == 0
    text = capsys.readouterr().out
    for name in ("sync", "solo", "majority", "two_choice", "quorum:3", "backup:1",
                 "deadline", "recommended:"):
        assert name in text
    d = json.loads(out_json.read_text())
    assert next(r["policy"] for r in d["rows"]) == "sync"
    assert all(r["conserved"] for r in d["rows"])
    assert plot.stat().st_size > 0
    best = recommend(d["rows"], 1)
    assert best is not None
    assert d["recommended"] == best["policy"]


@pytest.mark.timeout(90)
def test_replay_scaled_up(trace_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "replay", str(trace_dir), "--policies", "solo,majority",
                 "--scale-to", "64", "--steps", "4"]) == 0
    assert "at P = 64" in " ".join(capsys.readouterr().out.split())


def test_replay_rejects_bad_policy(trace_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "replay", str(trace_dir), "--policies", "quorum"]) == 2
    assert "quorum needs one number" in capsys.readouterr().err


def test_profiles_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for p in BUILTIN_PROFILES.values():
        assert p.source
        path = tmp_path / f"{p.name}.json"
        p.save(path)
        assert Profile.load(path) == p
    assert main(["sim", "profiles"]) == 0
    assert "source:" in capsys.readouterr().out


def test_run_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "run", "--policy", "majority", "-P", "32", "--steps", "5",
                 "--compute", "linear:skew=0.001"]) == 0
    assert json.loads(capsys.readouterr().out)["conserved"] is True


def test_run_places_ranks_on_a_calibrated_host(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # a calibrated profile (one rank per host) placed 8 to a 2-core host: the pool prices them
    link = LinkClass(80e-6, 1 / 3e9)
    prof = Profile("local-tcp", link, link, gamma=5e-6, reduce_bps=10e9, cores=2,
                   call_overhead=50e-6,
                   shared=SharedCores(150e-6, 1 / 2e9, 200e-6, 4, msg_cpu=150e-6,
                                      byte_cpu=1 / 2e9))
    path = tmp_path / "p.json"
    prof.save(path)
    args = ["sim", "run", "--policy", "sync", "-P", "8", "--steps", "3", "--compute",
            "constant:t=0.001", "--profile", str(path)]
    assert main(args) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main([*args, "--ranks-per-host", "8"]) == 0
    shared = json.loads(capsys.readouterr().out)
    # eight ranks on two cores are slower than eight ranks with a host each
    assert shared["latency_mean_s"] > 1.5 * alone["latency_mean_s"]
    with pytest.raises(SystemExit):
        main([*args, "--ranks-per-host", "0"])


def _row(policy: str, sps: float, included: float, stale: dict[int, int]) -> dict[str, object]:
    return {"policy": policy, "steps_per_s": sps, "included_frac": included,
            "staleness": stale, "latency_mean_s": 0.01, "latency_p99_s": 0.02, "nap": 4.0}


def test_recommend_calls_a_difference_within_the_tolerance_a_tie() -> None:
    """A 0.005 % lead in steps/s does not make solo the recommendation over sync: the two tie,
    and of tied policies the one that includes the most fresh data is named."""
    from asynccoll.sim.replay import recommendation

    rows = [_row("sync", 100.0, 1.0, {0: 40}), _row("solo", 100.005, 0.8, {0: 30, 1: 10}),
            _row("majority", 90.0, 0.9, {0: 40})]
    best, tied = recommendation(rows, 1)
    assert best is not None
    assert best["policy"] == "sync"
    assert [r["policy"] for r in tied] == ["solo", "sync"]
    # without a tolerance the fastest wins, as before
    assert recommend(rows, 1, tie=0.0)["policy"] == "solo"  # type: ignore[index]
    # a clear lead is not a tie
    rows[1]["steps_per_s"] = 150.0
    assert recommend(rows, 1)["policy"] == "solo"  # type: ignore[index]
    with pytest.raises(ValueError, match="tie"):
        recommendation(rows, 1, tie=-0.1)


@pytest.mark.timeout(30)
def test_replay_cli_says_when_policies_tie(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import asynccoll.sim.replay as replay_mod

    rows = [_row("sync", 100.0, 1.0, {0: 40}), _row("solo", 100.005, 0.8, {0: 30, 1: 10})]
    meta = {"trace": "t", "collective": "x", "recorded_P": 4, "P": 4, "steps": 40,
            "nbytes": 4, "profile": "aries"}
    monkeypatch.setattr(replay_mod, "replay", lambda *a, **k: (rows, meta))
    assert main(["sim", "replay", "unused", "--recommend"]) == 0
    out = capsys.readouterr().out
    assert "recommended: sync" in out, out
    assert "tied within 2% of the best steps/s: solo (100.00), sync (100.00)" in out, out
    assert main(["sim", "replay", "unused", "--recommend", "--tie", "0"]) == 0
    out = capsys.readouterr().out
    assert "recommended: solo" in out, out
    assert "tied" not in out, out
