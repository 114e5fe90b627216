"""Hierarchical against flat RNA under mixed heterogeneity (RNA §4 and §8.1's "M" setting).

    python bench/rna_hier.py [--quick] [--out FILE.json] [--plot FILE.png] [--steps 200]
                             [--step-ms 20] [--slow-ms 80] [--jitter-ms 10] [--reps 3]

P = 4 rank processes over ``tcp://127.0.0.1`` (spawned; they share this machine's cores) in
two groups, {0, 1} and {2, 3}. Every step each rank sleeps c (``--step-ms``, the simulated
accelerator time: the machine has no GPU) plus a seeded random jitter in [0, j) (the paper's
dynamic heterogeneity), and the second group sleeps a fixed D (``--slow-ms``) more (its
deterministic slowdown), around the real NumPy gradient of a least-squares problem (each rank
its own 128 x 64 block, columns scaled 1 to 0.1 so that it converges slowly enough for the
loss to tell the methods apart).

* ``flat``: ``RNA(comm, w, lr)`` (two-choice partial allreduce over all four ranks);
* ``hier``: ``RNA(comm, w, lr, groups=2)`` with the switch condition measured at run time
  (threshold 1, the paper's ``zeta > v``, checked every second; it starts flat), exchanges
  among the two leaders every 4 steps.

Both run with ``accumulate=True``. A run ends when rank 0 (fast group) has taken ``--steps``
steps; the others stop at their next step, then every rank calls ``finish()`` (which averages
the replicas). Measured per run: rank 0's steps per second (from a common start after a
barrier to its last step), every rank's step count, and the final relative excess loss
``(L(w) - L*) / (L(0) - L*)`` of the finished model on all ranks' data; rank 0 also samples
its replica's loss against wall time every 5 steps, for the plot and for the time to equal
loss: the time at which rank 0's replica first reached the highest excess any run's replica
ended with (so every run reached it); ``speedup_at_equal_loss`` is flat's time over hier's. The
two methods alternate, ``--reps`` times each; rows carry the median, min and max.
``--quick``: 60 steps, 2 repetitions (< 60 s).
There is no peer library here: the baseline is flat RNA, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import SECRET, free_port, spawn_world, stats, write_json

P = 4
DIM, ROWS = 64, 128
GROUPS = [[0, 1], [2, 3]]
IMPLS = ("flat", "hier")


class Problem:
    """Rank r's loss ``|A_r w - b_r|^2 / (2 ROWS)``; the job's loss is the mean over ranks."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.A = rng.standard_normal((P, ROWS, DIM)) * np.logspace(0, -1, DIM)
        self.b = self.A @ rng.standard_normal(DIM) + 0.1 * rng.standard_normal((P, ROWS))
        w_star = np.linalg.lstsq(self.A.reshape(-1, DIM), self.b.reshape(-1), rcond=None)[0]
        self.l_star = self.loss(w_star)
        self.l_zero = self.loss(np.zeros(DIM))

    def grad(self, r: int, w: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.A[r].T @ (self.A[r] @ w - self.b[r]) / ROWS
        return out

    def loss(self, w: np.ndarray) -> float:
        res = self.A @ w - self.b
        return float(np.mean(res * res) / 2)

    def excess(self, w: np.ndarray) -> float:
        return (self.loss(w) - self.l_star) / (self.l_zero - self.l_star)


async def rank_main(rank: int, port: int, impl: str, cfg: dict[str, Any],
                    stop: Any) -> dict[str, Any]:
    import asynccoll
    from asynccoll import TwoChoice
    from asynccoll.train import RNA

    comm = await asynccoll.connect(rank=rank, world_size=P, store=f"127.0.0.1:{port}",
                                   transport="tcp", timeout=120)
    prob = Problem(cfg["seed"])
    rng = np.random.default_rng((cfg["seed"], rank, cfg["rep"]))
    delay = cfg["step_s"] + (cfg["slow_s"] if rank >= 2 else 0.0)
    async with comm:
        w = np.zeros(DIM)
        kw: dict[str, Any] = {"groups": GROUPS, "threshold": 1.0, "check_interval": 1.0,
                              "exchange_every": 4} if impl == "hier" else {}
        opt = RNA(comm, w, cfg["lr"], policy=TwoChoice(seed=cfg["rep"]), accumulate=True, **kw)
        await comm.barrier(timeout=60)
        t0 = time.perf_counter()
        curve: list[tuple[float, int, float]] = []
        steps = 0
        hier_steps = 0
        while not stop.is_set():
            await asyncio.sleep(delay + rng.uniform(0, cfg["jitter_s"]))
            await opt.step(prob.grad(rank, opt.params))
            steps += 1
            hier_steps += opt.hierarchical
            if rank == 0:
                if steps % 5 == 0 or steps == cfg["steps"]:
                    curve.append((time.perf_counter() - t0, steps, prob.excess(opt.params)))
                if steps >= cfg["steps"]:
                    stop.set()
        wall = time.perf_counter() - t0
        await opt.finish()
        done = time.perf_counter() - t0
        return {"steps": steps, "wall_s": wall, "finish_s": done - wall, "curve": curve,
                "excess": prob.excess(opt.params), "hier_steps": hier_steps,
                "switches": getattr(opt, "switches", 0), "spread": getattr(opt, "spread", None)}


def child(rank: int, world: int, port: int, impl: str, cfg: dict[str, Any], stop: Any,
          q: Any) -> None:
    try:
        os.environ["ASYNCCOLL_SECRET"] = SECRET
        q.put((rank, "ok", asyncio.run(rank_main(rank, port, impl, cfg, stop))))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def run_once(impl: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import multiprocessing as mp

    stop = mp.get_context("spawn").Event()
    out: list[dict[str, Any]] = spawn_world(child, P, (free_port(), impl, cfg, stop), 240)
    return out


def time_to(curve: list[Any], target: float) -> float | None:
    """When rank 0's replica first reached ``target`` (None: never)."""
    return next((t for t, _, e in curve if e <= target), None)


def summarise(impl: str, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    sps = [r[0]["steps"] / r[0]["wall_s"] for r in runs]
    row: dict[str, Any] = {"impl": impl, "P": P, "transport": "tcp", "reps": len(runs)}
    row.update(stats("steps_per_s", sps))
    row.update(stats("final_excess", [r[0]["excess"] for r in runs]))
    row.update(stats("wall_s", [r[0]["wall_s"] for r in runs]))
    row.update(stats("slow_group_steps", [float(np.mean([x["steps"] for x in r[2:]]))
                                          for r in runs]))
    row.update(stats("hier_fraction", [r[0]["hier_steps"] / r[0]["steps"] for r in runs]))
    row["switches"] = [r[0]["switches"] for r in runs]
    row["spread_s"] = [r[0]["spread"] for r in runs]
    row["curve"] = runs[len(runs) // 2][0]["curve"]
    return row


def plot(rows: list[dict[str, Any]], path: str, cfg: dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(15, 4))
    for row in rows:
        t = [c[0] for c in row["curve"]]
        n = [c[1] for c in row["curve"]]
        e = [c[2] for c in row["curve"]]
        ax1.semilogy(t, e, marker=".", label=row["impl"])
        ax3.semilogy(n, e, marker=".", label=row["impl"])
    ax1.set_xlabel("wall time (s)")
    ax1.set_ylabel("relative excess loss, rank 0's replica")
    ax1.set_title(f"P = 4, group {{2, 3}} slower by {cfg['slow_s'] * 1e3:g} ms/step")
    ax3.set_xlabel("rank 0's steps")
    ax3.set_title("the same against steps")
    for ax in (ax1, ax3):
        ax.grid(alpha=0.3)
        ax.legend()
    med = [r["steps_per_s_median"] for r in rows]
    err = [[m - r["steps_per_s_min"] for m, r in zip(med, rows, strict=True)],
           [r["steps_per_s_max"] - m for m, r in zip(med, rows, strict=True)]]
    ax2.bar(range(len(rows)), med, yerr=err, capsize=4)
    ax2.set_xticks(range(len(rows)), [r["impl"] for r in rows])
    ax2.set_ylabel("rank 0 steps per second (1/s)")
    ax2.set_title(f"median, min-max of {rows[0]['reps']} runs")
    fig.tight_layout()
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="60 steps, 2 repetitions (< 60 s)")
    ap.add_argument("--out", default="bench/results/rna_hier.json",
                    help="write the JSON results here")
    ap.add_argument("--plot", default="bench/results/rna_hier.png",
                    help="write the plot (loss vs time, steps/s) here")
    ap.add_argument("--steps", type=int, help="rank 0's steps per run (200; quick 60)")
    ap.add_argument("--step-ms", type=float, default=20.0, help="c: every rank's step (ms)")
    ap.add_argument("--slow-ms", type=float, default=80.0,
                    help="D: the slow group's extra time per step (ms)")
    ap.add_argument("--jitter-ms", type=float, default=10.0,
                    help="random extra time per step and rank, uniform in [0, j) ms")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--reps", type=int, help="repetitions of each method (3; quick 2)")
    args = ap.parse_args(argv)
    steps = args.steps or (60 if args.quick else 200)
    reps = args.reps or (2 if args.quick else 3)
    print("rna_hier: no peer rows (the baseline is flat RNA, measured in the same run); the "
          "accelerator time per step is a sleep: this machine has no GPU", file=sys.stderr)
    base = {"steps": steps, "step_s": args.step_ms / 1e3, "slow_s": args.slow_ms / 1e3,
            "jitter_s": args.jitter_ms / 1e3, "lr": args.lr, "seed": 0}
    runs: dict[str, list[list[dict[str, Any]]]] = {i: [] for i in IMPLS}
    t_all = time.monotonic()
    for rep in range(reps):
        for impl in (IMPLS if rep % 2 == 0 else IMPLS[::-1]):
            out = run_once(impl, {**base, "rep": rep})
            runs[impl].append(out)
            print(f"rna_hier: rep {rep} {impl:>4}: rank 0 {out[0]['steps']} steps in "
                  f"{out[0]['wall_s']:.2f} s ({out[0]['steps'] / out[0]['wall_s']:.1f}/s), "
                  f"slow group {[o['steps'] for o in out[2:]]} steps, final excess "
                  f"{out[0]['excess']:.3g}, switches {out[0]['switches']}", file=sys.stderr)
    rows = [summarise(i, runs[i]) for i in IMPLS]
    ratio = [h[0]["steps"] / h[0]["wall_s"] / (f[0]["steps"] / f[0]["wall_s"])
             for h, f in zip(runs["hier"], runs["flat"], strict=True)]
    loss_ratio = [h[0]["excess"] / f[0]["excess"]
                  for h, f in zip(runs["hier"], runs["flat"], strict=True)]
    # Equal loss: the highest excess that rank 0's replica ended a run with (so every run
    # reached it), and the time at which each run's replica first reached it.
    target = max(x[0]["curve"][-1][2] for impl in IMPLS for x in runs[impl])
    for r, impl in zip(rows, IMPLS, strict=True):
        got = [time_to(x[0]["curve"], target) for x in runs[impl]]
        r["target_excess"] = target
        r["time_to_target_s"] = got
        if all(g is not None for g in got):
            r.update(stats("time_to_target_s", [float(g) for g in got if g is not None]))
    speed_eq = [f / h for f, h in zip(rows[0]["time_to_target_s"], rows[1]["time_to_target_s"],
                                      strict=True) if f is not None and h is not None]
    summary = {**stats("speedup_hier_over_flat", ratio),
               **(stats("speedup_at_equal_loss", speed_eq) if speed_eq else {}),
               **stats("excess_ratio_hier_over_flat", loss_ratio),
               "total_s": time.monotonic() - t_all}
    for r in rows:
        print(f"{r['impl']:>4}: {r['steps_per_s_median']:.2f} steps/s (min "
              f"{r['steps_per_s_min']:.2f}, max {r['steps_per_s_max']:.2f}), final excess "
              f"{r['final_excess_median']:.3g} (min {r['final_excess_min']:.3g}, max "
              f"{r['final_excess_max']:.3g}), slow group steps "
              f"{r['slow_group_steps_median']:.0f}, in hierarchy "
              f"{100 * r['hier_fraction_median']:.0f} % of rank 0's steps")
    print(f"hier/flat steps/s: {summary['speedup_hier_over_flat_median']:.2f}x (min "
          f"{summary['speedup_hier_over_flat_min']:.2f}, max "
          f"{summary['speedup_hier_over_flat_max']:.2f}); final excess ratio "
          f"{summary['excess_ratio_hier_over_flat_median']:.2f} (min "
          f"{summary['excess_ratio_hier_over_flat_min']:.2f}, max "
          f"{summary['excess_ratio_hier_over_flat_max']:.2f}); total "
          f"{summary['total_s']:.0f} s")
    if speed_eq:
        print(f"time to excess {target:.3g} (rank 0's replica): flat/hier "
              f"{summary['speedup_at_equal_loss_median']:.2f}x (min "
              f"{summary['speedup_at_equal_loss_min']:.2f}, max "
              f"{summary['speedup_at_equal_loss_max']:.2f})")
    params = {**base, "P": P, "groups": GROUPS, "reps": reps, "quick": args.quick,
              "dim": DIM, "rows_per_rank": ROWS, "accumulate": True,
              "hier": {"threshold": 1.0, "check_interval": 1.0, "exchange_every": 4}}
    if args.out:
        write_json(args.out, "rna_hier", params, rows, packages=("asynccoll", "uvloop"),
                   extra={"summary": summary})
    if args.plot:
        plot(rows, args.plot, base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
