"""PyTorch under stragglers: DDP + Gloo against DDP + ``partial_hook``, and
``DistributedOptimizer(Adam)`` sync against majority (issue: a DDP hook, any optimizer).

    python bench/torch_ddp.py [--quick] [--out FILE.json] [--plot FILE.png] [--P 4]
                              [--step-ms 40] [--steps 200] [--delays 0,0.5,1.0] [--reps 1]
                              [--impls ddp-gloo,ddp-solo,...]

Each case is one ``asynccoll run -n P`` job of ``examples/torch_ddp.py`` or
``examples/torch_adam.py`` (the same convolutional network, scikit-learn digits and seeds):

* ``ddp-gloo``: DDP with its default hook over a Gloo process group, the baseline a PyTorch
  user has today; ``ddp-sync``, ``ddp-solo``, ``ddp-majority``: DDP with asynccoll's hook
  (rounds averaged by contributions); ``ddp-solo-world``, ``ddp-majority-world``: the same
  with ``average="world"`` (each round's sum divided by P);
* ``adam-sync``, ``adam-majority``: ``DistributedOptimizer(torch.optim.Adam(...))``.

The accelerator is simulated by a sleep up to c (``--step-ms``; 2 CPU cores, no GPU), and on
every step one rank, drawn alike on all ranks, sleeps D = 0.5c or 1.0c more. Rank 0 keeps a
copy of its parameters every 2 steps and measures their test accuracy after the loop, so the
evaluation costs no rank any time in the timed loop. Rows: wall time, ms per step, final test
accuracy (after the collective ``finish``), and the wall time at which test accuracy first
reached the target: the final accuracy of ``ddp-gloo`` at the same D for the DDP rows, of
``adam-sync`` for the Adam rows; ``time_ratio``: that time over the baseline's own, the product
of ``step_time_ratio`` (ms per step over the baseline's) and ``steps_ratio`` (steps to the
target over the baseline's); ``floor_step_time_ratio``: the lowest step-time ratio the injection
allows a kind (:func:`step_floor`: the injected sleeps alone, over the baseline's step time).
D = 0 runs only Gloo, ``partial_hook("sync")`` and sync Adam, for the step-time comparison.
``--quick``: 60 steps, D = 0 and 1.0c. Medians and spread over ``--reps`` repetitions of each
case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import stats, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: impl -> (example, its options)
IMPLS: dict[str, tuple[str, list[str]]] = {
    "ddp-gloo": ("torch_ddp.py", ["--policy", "gloo"]),
    "ddp-sync": ("torch_ddp.py", ["--policy", "sync"]),
    "ddp-solo": ("torch_ddp.py", ["--policy", "solo"]),
    "ddp-majority": ("torch_ddp.py", ["--policy", "majority"]),
    "ddp-solo-world": ("torch_ddp.py", ["--policy", "solo", "--average", "world"]),
    "ddp-majority-world": ("torch_ddp.py", ["--policy", "majority", "--average", "world"]),
    "adam-sync": ("torch_adam.py", ["--policy", "sync"]),
    "adam-majority": ("torch_adam.py", ["--policy", "majority"]),
}
NO_DELAY = ("ddp-gloo", "ddp-sync", "adam-sync")


def run_case(impl: str, P: int, delay: float, args: argparse.Namespace,
             timeout: float = 300.0) -> dict[str, Any]:
    """One ``asynccoll run`` job; rank 0's JSON. The launcher (and with it every rank) is
    stopped by PID whatever happens."""
    script, opts = IMPLS[impl]
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    lr = ["--lr", str(args.lr)] if script == "torch_ddp.py" else []
    cmd = [sys.executable, "-m", "asynccoll.cli", "run", "-n", str(P),
           os.path.join(ROOT, "examples", script), *opts, *lr, "--steps", str(args.steps),
           "--step-ms", str(args.step_ms), "--delay", str(delay), "--json", path]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{impl} D={delay} failed:\n{out}\n{err}")
        with open(path) as f:
            res: dict[str, Any] = json.load(f)
        return res
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.unlink(path)


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The first time in ``curve`` (seconds, step, accuracy) with accuracy >= target."""
    return next((t for t, _, acc in curve if acc >= target - 1e-9), None)


def steps_to(curve: list[list[float]], target: float) -> int | None:
    """The first step in ``curve`` with accuracy >= target."""
    return next((int(s) for _, s, acc in curve if acc >= target - 1e-9), None)


def step_floor(P: int, c_s: float, delay_s: float, impl: str) -> float | None:
    """The mean time per step of a rank that the injection alone imposes, were the backward
    pass, the optimizer and the communication free: every step sleeps ``c_s``, every rank is
    the straggler on 1/P of the steps (solo waits for no one else), and majority also waits
    whenever its one drawn initiator is the straggler, another 1/P of the steps (less the
    1/P**2 where both are the rank itself). Over the baseline's step time this bounds the time
    ratio from below, unless the kind needs fewer steps than the baseline to reach the
    target."""
    if "solo" in impl:
        return c_s + delay_s / P
    if "majority" in impl:
        return c_s + delay_s * (2 / P - 1 / P**2)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--P", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=40.0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=0.2, help="SGD rate of the DDP runs")
    p.add_argument("--delays", default=None, help="D in units of c, comma-separated")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of "
                   + ", ".join(IMPLS))
    args = p.parse_args()
    impls = args.impls.split(",")
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        p.error(f"unknown --impls {unknown}; choose from {list(IMPLS)}")
    if args.steps is None:
        args.steps = 60 if args.quick else 200
    delays = [float(d) for d in (args.delays or ("0,1.0" if args.quick else "0,0.5,1.0"))
              .split(",")]
    runs: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for d in delays:
            for impl in impls:
                if d == 0 and impl not in NO_DELAY:
                    continue
                res = run_case(impl, args.P, d, args)
                runs.setdefault((impl, d), []).append(res)
                print(f"rep {rep} D={d:.2f}c {impl:>14}: {res['wall']:.2f} s, "
                      f"{res['wall'] / res['steps'] * 1000:.1f} ms/step, final accuracy "
                      f"{res['accuracy']:.3f}", file=sys.stderr, flush=True)
    rows = []
    for (impl, d), rs in runs.items():
        base_impl = "adam-sync" if impl.startswith("adam") else "ddp-gloo"
        row: dict[str, Any] = {"impl": impl, "P": args.P, "delay_c": d,
                               "step_ms_c": args.step_ms, "steps": args.steps,
                               "baseline": base_impl}
        row |= stats("wall_s", [r["wall"] for r in rs])
        row |= stats("ms_per_step", [r["wall"] / r["steps"] * 1000 for r in rs])
        row |= stats("accuracy", [r["accuracy"] for r in rs])
        ratios, times, step_ratios, steps_ratios = [], [], [], []
        for i, r in enumerate(rs):
            base = runs.get((base_impl, d), [None])[min(i, len(runs.get((base_impl, d), [])) - 1)]
            if base is None:
                continue
            tb = time_to(base["curve"], base["accuracy"])
            ti = time_to(r["curve"], base["accuracy"])
            step_ratios.append(r["wall"] / r["steps"] / (base["wall"] / base["steps"]))
            if ti is not None:
                times.append(ti)
                if tb:
                    ratios.append(ti / tb)
                    si = steps_to(r["curve"], base["accuracy"])
                    sb = steps_to(base["curve"], base["accuracy"])
                    if si is not None and sb:
                        steps_ratios.append(si / sb)
        if times:
            row |= stats("time_to_target_s", times)
        if ratios:
            row |= stats("time_ratio", ratios)
        # time_ratio = step_time_ratio x steps_ratio (to the target), up to the curve's grain
        row |= stats("step_time_ratio", step_ratios)
        if steps_ratios:
            row |= stats("steps_ratio", steps_ratios)
        floor = step_floor(args.P, args.step_ms / 1000, d * args.step_ms / 1000, impl)
        if floor is not None and d > 0 and (base_impl, d) in runs:
            row["floor_step_time_ratio"] = floor / float(np.median(
                [b["wall"] / b["steps"] for b in runs[(base_impl, d)]]))
        row["reached_target"] = f"{len(times)}/{len(rs)}"
        row["curve"] = rs[0]["curve"]
        rows.append(row)
    for row in rows:
        print(f"D={row['delay_c']:.2f}c {row['impl']:>14}: {row['ms_per_step_median']:.1f} "
              f"ms/step, accuracy {row['accuracy_median']:.3f}, time ratio "
              f"{row.get('time_ratio_median', float('nan')):.2f} = step time "
              f"{row['step_time_ratio_median']:.2f} x steps "
              f"{row.get('steps_ratio_median', float('nan')):.2f} (floor of the step time "
              f"{row.get('floor_step_time_ratio', float('nan')):.2f}; {row['reached_target']} "
              f"reached {row['baseline']}'s final accuracy)")
    params = {"P": args.P, "step_ms": args.step_ms, "steps": args.steps, "delays": delays,
              "reps": args.reps, "quick": args.quick, "lr": args.lr}
    if args.out:
        write_json(args.out, "torch_ddp", params, rows)
    if args.plot:
        plot(rows, max(delays), args.plot)


def plot(rows: list[dict[str, Any]], delay: float, path: str) -> None:
    """Test accuracy against wall time at D = ``delay``: DDP cases left, Adam right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, prefix in zip(axes, ("ddp", "adam"), strict=True):
        for row in rows:
            if row["delay_c"] == delay and row["impl"].startswith(prefix):
                t = [c[0] for c in row["curve"]]
                a = [c[2] for c in row["curve"]]
                ax.plot(t, a, marker=".", label=row["impl"])
        ax.set_xlabel("wall time (s)")
        ax.set_title(f"{prefix.upper()}, P = {rows[0]['P']}, one straggler per step, "
                     f"D = {delay:g}c")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend()
    axes[0].set_ylabel("test accuracy (rank 0)")
    fig.tight_layout()
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
