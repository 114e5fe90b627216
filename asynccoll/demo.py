"""``asynccoll demo``: eager-SGD's hyperplane regression (§7.2.1) under injected load imbalance.

The demo starts ``--ranks`` local ranks as real processes (the launcher's runner API, TCP on
loopback). Every rank runs, for each delay ratio and each mode (``sync``, ``solo``,
``majority``, ...), the same training job: a linear model on ``y = a . x + noise`` with real
NumPy gradients on its own shard, a simulated accelerator time ``c`` per step (a sleep: the
machine this was built for has 2 CPU cores and no GPU, and four ranks' real compute would only
fight over them), and an extra delay ``D = ratio * c`` injected into one rank per global step,
drawn by a seeded generator that every rank evaluates identically. A rank working on global step
``e`` (one past the last round it applied) sleeps ``D`` when it is ``e``'s drawn rank, so each
round has exactly one straggler, as in the paper's experiment.

Each run lasts ``--steps`` global steps (rounds of the collective); throughput is rounds per
second of wall time on rank 0, validation MSE is measured on a held-out set as training goes.
The parent shows a progress bar per run, prints a table (steps/s, speedup over sync, final
validation MSE, mean contributors), and writes ``demo.json`` and ``demo.png`` (validation MSE
against wall time) to ``--out``. ``bench/hyperplane.py`` runs the same experiment
(:func:`run_experiment`).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["DemoConfig", "configure", "run", "run_experiment"]

_PROGRESS = b"@@progress "
#: the policies the demo compares, by the text it takes (``quorum:K`` would need P)
MODES = ("sync", "solo", "majority", "two_choice", "deadline")


@dataclass
class DemoConfig:
    """One experiment: every (delay ratio, mode) pair is one run of ``steps`` global steps."""

    ranks: int = 4
    steps: int = 40
    delays: list[float] = field(default_factory=lambda: [0.5, 0.75, 1.0])
    modes: list[str] = field(default_factory=lambda: ["sync", "solo", "majority"])
    dim: int = 128
    batch: int = 128
    step_ms: float = 100.0
    lr: float = 0.2
    noise: float = 1.0
    seed: int = 0
    transport: str = "tcp"
    accumulate: bool = True

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        if self.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}")
        if self.steps < 2:
            raise ValueError(f"steps must be >= 2, got {self.steps}")
        if not self.delays or any(d < 0 for d in self.delays):
            raise ValueError(f"delays must be ratios >= 0, got {self.delays}")
        bad = [m for m in self.modes if m not in MODES]
        if not self.modes or bad:
            raise ValueError(f"modes must be among {list(MODES)}, got {self.modes}")
        if self.dim < 1 or self.batch < 1 or self.step_ms < 0:
            raise ValueError("dim and batch must be >= 1 and step_ms >= 0")


def _data(cfg: DemoConfig, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """This rank's training shard and the shared validation set (same seed on every rank)."""
    rng = np.random.default_rng(cfg.seed)
    a = rng.standard_normal(cfg.dim + 1)
    n_val = 1024
    n = cfg.batch * 8  # per rank: 8 batches, cycled
    X = rng.standard_normal((cfg.ranks * n + n_val, cfg.dim + 1))
    X[:, -1] = 1.0  # the bias column
    y = X @ a + cfg.noise * rng.standard_normal(len(X))
    lo = rank * n
    return X[lo:lo + n], y[lo:lo + n], X[-n_val:], y[-n_val:]


def _straggler(seed: int, step: int, ranks: int) -> int:
    """The rank delayed at global step ``step``: a pure function, equal on every rank."""
    return int(np.random.default_rng((seed, 7919, step)).integers(ranks))


async def _train(comm: Any, cfg: DemoConfig, mode: str, ratio: float, index: int
                 ) -> dict[str, Any]:
    import dataclasses

    from .collectives.policy import Majority, TwoChoice, as_policy
    from .train import EagerSGD

    X, y, Xv, yv = _data(cfg, comm.rank)
    w = np.zeros(cfg.dim + 1)
    policy = as_policy(mode)
    if isinstance(policy, (Majority, TwoChoice)):  # the draws differ between demos
        policy = dataclasses.replace(policy, seed=cfg.seed + index)
    opt = EagerSGD(comm, w, cfg.lr, policy, accumulate=cfg.accumulate, name=f"demo-{index}")
    c = cfg.step_ms / 1000.0
    nb = len(X) // cfg.batch
    curve: list[tuple[float, int, float]] = []
    contributors: list[int] = []
    last = -1
    local = 0
    await comm.barrier()
    t0 = time.perf_counter()
    t_end = t0
    while last < cfg.steps - 1:
        t_step = time.perf_counter()
        b = local % nb
        xb, yb = X[b * cfg.batch:(b + 1) * cfg.batch], y[b * cfg.batch:(b + 1) * cfg.batch]
        g = xb.T @ (xb @ w - yb) / cfg.batch  # real gradient of the half MSE
        pause = c - (time.perf_counter() - t_step)  # the rest of the accelerator's time
        if _straggler(cfg.seed, last + 1, comm.size) == comm.rank:
            pause += ratio * c
        if pause > 0:
            await asyncio.sleep(pause)
        info = await opt.step(g)
        local += 1
        contributors.append(len(info.contributors))
        last = max(last, info.round)
        t_end = time.perf_counter()
        if comm.rank == 0:
            r = Xv @ w - yv
            curve.append((t_end - t0, last, float(r @ r) / len(r)))
            print(f"@@progress {index} {min(last + 1, cfg.steps)} {cfg.steps}", flush=True)
    await opt.finish()
    r = Xv @ w - yv
    wall = t_end - t0
    return {"mode": mode, "delay_ratio": ratio, "P": comm.size, "rounds": last + 1,
            "local_steps": local, "wall_s": wall, "steps_per_s": (last + 1) / wall,
            "local_steps_per_s": local / wall,
            "final_val_mse": float(r @ r) / len(r),
            "mean_contributors": float(np.mean(contributors)) if contributors else 0.0,
            "curve": curve}


async def _worker(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank of the demo: every run in order; rank 0's rows (others return [])."""
    from .launch import connect

    cfg = DemoConfig(**spec["config"])
    comm = await connect(collective_timeout=120.0)
    async with comm:
        rows = []
        for i, (ratio, mode) in enumerate(spec["runs"]):
            rows.append(await _train(comm, cfg, mode, ratio, i))
        # Peers closing their connections after the barrier is the expected end, not news.
        logging.getLogger("asynccoll.transport").setLevel(logging.ERROR)
        await comm.barrier()
        return rows if comm.rank == 0 else []


def _worker_main(path: str) -> int:
    with open(path) as f:
        spec = json.load(f)
    rows = asyncio.run(_worker(spec))
    if rows:
        with open(spec["result"], "w") as f:
            json.dump(rows, f)
    return 0


class _Sink(io.BytesIO):
    """Where the launcher writes the ranks' output: progress lines feed ``on_progress``."""

    def __init__(self, on_progress: Callable[[int, int, int], None],
                 echo: Callable[[str], None]) -> None:
        super().__init__()
        self._on_progress = on_progress
        self._echo = echo

    def write(self, data: Any) -> int:
        for line in bytes(data).splitlines():
            i = line.find(_PROGRESS)
            if i >= 0:
                run_i, done, total = (int(v) for v in line[i + len(_PROGRESS):].split())
                self._on_progress(run_i, done, total)
            elif line.strip():
                self._echo(line.decode(errors="replace"))
        return len(data)


def run_experiment(cfg: DemoConfig, *, show: bool = True) -> list[dict[str, Any]]:
    """Launch ``cfg.ranks`` processes, run every (delay, mode) pair; return rank 0's rows.

    Rows: mode, delay_ratio, P, rounds, local_steps, wall_s, steps_per_s (rounds per second),
    local_steps_per_s (rank 0's own steps per second), final_val_mse, mean_contributors, curve
    ([seconds, round, validation MSE] per step of rank 0). Raises ``RuntimeError`` when a rank
    fails (its output has been shown). Every rank process is stopped before this returns.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from .launch.runner import LaunchConfig, launch

    cfg.check()
    runs = [(ratio, mode) for ratio in cfg.delays for mode in cfg.modes]
    with tempfile.TemporaryDirectory(prefix="asynccoll-demo-") as tmp:
        spec_path, result = os.path.join(tmp, "spec.json"), os.path.join(tmp, "rows.json")
        with open(spec_path, "w") as f:
            json.dump({"config": asdict(cfg), "runs": runs, "result": result}, f)
        lc = LaunchConfig(nproc=cfg.ranks, argv=[sys.executable, "-m", "asynccoll.demo",
                                                 spec_path],
                          secret=secrets.token_hex(16).encode(), transport=cfg.transport,
                          grace=2.0)
        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), disable=not show,
                      transient=False) as progress:
            tasks = [progress.add_task(f"{mode:>8}  D = {ratio:g}c", total=cfg.steps)
                     for ratio, mode in runs]

            def on_progress(i: int, done: int, total: int) -> None:
                progress.update(tasks[i], completed=done, total=total)

            def echo(text: str) -> None:
                if show:
                    progress.console.print(text, markup=False, highlight=False)

            sink = _Sink(on_progress, echo)
            code = asyncio.run(launch(lc, stdout=sink, stderr=_Sink(on_progress, echo)))
        if code != 0:
            raise RuntimeError(f"a demo rank failed with exit code {code}")
        with open(result) as f:
            rows: list[dict[str, Any]] = json.load(f)
    return rows


def speedups(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, float], float]:
    """steps/s of each (mode, delay ratio) over sync's at the same ratio (when measured)."""
    sync = {r["delay_ratio"]: r["steps_per_s"] for r in rows if r["mode"] == "sync"}
    return {(r["mode"], r["delay_ratio"]): r["steps_per_s"] / sync[r["delay_ratio"]]
            for r in rows if r["delay_ratio"] in sync}


def plot(rows: Sequence[dict[str, Any]], path: str, title: str) -> bool:
    """Validation MSE against wall time, one panel per delay ratio; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ratios = sorted({r["delay_ratio"] for r in rows})
    fig, axes = plt.subplots(1, len(ratios), figsize=(4.2 * len(ratios), 3.6), squeeze=False)
    for ax, ratio in zip(axes[0], ratios, strict=True):
        for r in rows:
            if r["delay_ratio"] == ratio and r["curve"]:
                t, _, mse = zip(*r["curve"], strict=True)
                ax.plot(t, mse, label=f"{r['mode']} ({r['steps_per_s']:.2f} steps/s)")
        ax.set_yscale("log")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("validation MSE")
        ax.set_title(f"injected delay D = {ratio:g}c")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def environment() -> dict[str, Any]:
    """Versions and machine facts for result files."""
    import platform
    from importlib import metadata

    from . import __version__

    try:
        uvloop = metadata.version("uvloop")
    except metadata.PackageNotFoundError:
        uvloop = None
    return {"python": platform.python_version(), "numpy": np.__version__,
            "asynccoll": __version__, "cpus": os.cpu_count(), "platform": platform.platform(),
            "transport versions": {"tcp": "asyncio" + (f" + uvloop {uvloop}" if uvloop else "")}}


def configure(p: argparse.ArgumentParser) -> None:
    """The ``asynccoll demo`` options."""
    def floats(s: str) -> list[float]:
        return [float(v) for v in s.split(",") if v]

    p.add_argument("--ranks", type=int, default=4, help="local ranks (processes)")
    p.add_argument("--steps", type=int, default=None, help="global steps per run (default 40)")
    p.add_argument("--delays", type=floats, default=[0.5, 0.75, 1.0],
                   help="injected delay D as fractions of the step time c")
    p.add_argument("--modes", type=lambda s: s.split(","), default=["sync", "solo", "majority"],
                   help="comma-separated modes to run, each at every delay: sync (synchronous "
                        "SGD), solo, majority, two_choice, deadline (eager-SGD's partial "
                        "allreduce kinds; docs/partial.md) (default: sync,solo,majority)")
    p.add_argument("--step-ms", type=float, default=None,
                   help="simulated accelerator time c per step in ms (default 100)")
    p.add_argument("--dim", type=int, default=128, help="hyperplane dimension")
    p.add_argument("--quick", action="store_true", help="tiny run (a few seconds)")
    p.add_argument("--out", default="demo-out", help="directory for demo.json and demo.png")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the data and of the delayed rank per step (default: 0)")


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 on success, 2 on bad options, 1 when a rank failed."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    steps = args.steps if args.steps is not None else (8 if args.quick else 40)
    step_ms = args.step_ms if args.step_ms is not None else (20.0 if args.quick else 100.0)
    cfg = DemoConfig(ranks=args.ranks, steps=steps, delays=args.delays, modes=args.modes,
                     dim=args.dim, step_ms=step_ms, seed=args.seed)
    try:
        cfg.check()
    except ValueError as e:
        console.print(f"asynccoll demo: {e}", markup=False)
        return 2
    console.print(f"Hyperplane regression (eager-SGD §7.2.1), {cfg.ranks} ranks over TCP, "
                  f"dimension {cfg.dim}, {cfg.steps} steps per run. This machine has "
                  f"{os.cpu_count()} CPU cores and no GPU: the accelerator's time per step is "
                  f"simulated as a sleep of c = {cfg.step_ms:g} ms around real NumPy "
                  f"gradients; one rank per step is delayed by D.", markup=False)
    try:
        rows = run_experiment(cfg)
    except RuntimeError as e:
        console.print(f"asynccoll demo: {e}", markup=False)
        return 1
    sp = speedups(rows)
    table = Table(title="eager-SGD vs synchronous SGD")
    for col in ("delay D", "mode", "steps/s", "speedup over sync", "final val MSE",
                "mean contributors"):
        table.add_column(col, justify="right")
    for r in rows:
        s = sp.get((r["mode"], r["delay_ratio"]))
        table.add_row(f"{r['delay_ratio']:g}c", r["mode"], f"{r['steps_per_s']:.2f}",
                      "-" if s is None else f"{s:.2f}x", f"{r['final_val_mse']:.3f}",
                      f"{r['mean_contributors']:.2f}")
    console.print(table)
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "demo.json")
    with open(out_json, "w") as f:
        json.dump({"bench": "demo", "params": asdict(cfg), "env": environment(),
                   "rows": rows}, f, indent=1)
    png = os.path.join(args.out, "demo.png")
    if plot(rows, png, f"hyperplane regression, P = {cfg.ranks}, c = {cfg.step_ms:g} ms"):
        console.print(f"wrote {out_json} and {png}", markup=False)
    else:
        console.print(f"wrote {out_json} (no plot: matplotlib is not installed; "
                      "pip install 'asynccoll[plot]')", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
