"""Test accuracy of every policy of ``partial_hook`` and every policy and algorithm of
``DistributedOptimizer`` against DDP over Gloo, each with its default averaging, on
``examples/torch_ddp.py`` (4 ranks, one straggler per step), over several seeds.

    python examples/torch_accuracy.py --seeds 0,1,2 --reps 1 --out acc.json --plot acc.png

Each run is a fresh ``asynccoll run -n 4`` job of ``torch_ddp.py`` with its defaults (400
steps). The jobs are interleaved: repetition by repetition, seed by seed, every case once, the
cases' order rotated each round, so that the other jobs' load on a shared machine drifts over
all cases alike; a run already in ``--out`` is kept (resume).

**The metric** is rank 0's mean test accuracy over the curve's last ``--last`` points (10:
steps 382-400 at ``--eval-every 2``), each case against Gloo's run of the same seed, in points;
the accuracy after ``finish()`` is reported beside it (a last step that spoils the model shows
there). Why not the one final reading: on this data set it varies by several points even for
Gloo. At the 150 steps the example once ran, the network was still on the steep part of its
learning curve, where consecutive points (2 steps apart) differed by 4.7-6.0 points on average;
Gloo's run replicated in one process (``--noise``: each step the mean of the 4 ranks' batch
gradients, as DDP averages them) on 6 other orders of the same batches ended 2.8-4.8 points
apart (sd over the orders, seeds 0-2), so a policy that changed the trajectory at all landed
anywhere in that band. At 400 steps it is on its plateau: the final reading's sd over orders is
0.3-0.9 points, the mean over the last 10 points' 0.1-0.4 (``--noise 150,300,400``). The test
set (450 images, one image 0.22 points) is the same for every case of a seed, so it adds no
noise to the difference. A case **keeps accuracy** when its mean difference over the seeds is
at least -1 point; the spread printed beside it (the per-seed differences, and the run-to-run
standard deviation of one case and seed when ``--reps`` > 1) says how far that mean can be
trusted.

Prints a Markdown table; ``--plot`` draws every run's difference from Gloo (the band: one
point). Extra arguments after ``--`` go to torch_ddp.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = "ddp-gloo"
#: (label, torch_ddp.py arguments); quorum and deadline wait for 3 of 4 ranks
CASES = [(BASE, ["--policy", "gloo"])] + [
    (f"hook-{k.split(':')[0]}", ["--policy", k])
    for k in ("sync", "solo", "majority", "two_choice", "quorum:3", "deadline:3")] + [
    (f"opt-{m.split(':')[0]}", ["--optimizer", "--policy", m])
    for m in ("sync", "solo", "majority", "two_choice", "quorum:3", "deadline:3", "backup:1")] + [
    (f"opt-{a}", ["--algorithm", a]) for a in ("rna", "odsgd")]


def run(label: str, args: list[str], seed: int, rep: int, last: int,
        extra: list[str]) -> dict[str, Any]:
    """One job; its record: the metric, the accuracy after ``finish()``, the curve, the load."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-m", "asynccoll.cli", "run", "-n", "4",
               os.path.join(HERE, "torch_ddp.py"), *args, "--seed", str(seed), "--json", out,
               *extra]
        start, load0, t0 = datetime.datetime.now(datetime.UTC), os.getloadavg()[0], time.time()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=900)
        with open(out) as f:
            job = json.load(f)
    curve = [round(a, 4) for _, _, a in job["curve"]]
    return {"case": label, "seed": seed, "rep": rep, "metric": statistics.fmean(curve[-last:]),
            "after_finish": job["accuracy"], "curve": curve, "steps": job["steps"],
            "ms_per_step": 1000 * job["wall"] / job["steps"], "job_s": time.time() - t0,
            "start": start.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "load": [round(load0, 1), round(os.getloadavg()[0], 1)]}


def schedule(cases: list[tuple[str, list[str]]], seeds: list[int],
             reps: int) -> list[tuple[str, list[str], int, int]]:
    """Repetition by repetition, seed by seed, every case once, rotated each round."""
    order = []
    for rep in range(reps):
        for i, seed in enumerate(seeds):
            k = (rep * len(seeds) + i) % len(cases)
            order += [(label, args, seed, rep) for label, args in cases[k:] + cases[:k]]
    return order


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: the mean over seeds of (its mean over repetitions minus Gloo's), the per-seed
    differences, the run-to-run sd and the same difference after ``finish()``, in points."""
    def by_seed(case: str, key: str) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for r in runs:
            if r["case"] == case:
                out.setdefault(r["seed"], []).append(100 * r[key])
        return out

    rows = []
    base = {k: {s: statistics.fmean(v) for s, v in by_seed(BASE, k).items()}
            for k in ("metric", "after_finish")}
    for case in dict.fromkeys(r["case"] for r in runs):
        row: dict[str, Any] = {"case": case}
        for key in ("metric", "after_finish"):
            seeds = by_seed(case, key)
            shared = [s for s in seeds if s in base[key]]
            diff = [statistics.fmean(seeds[s]) - base[key][s] for s in shared]
            row[key] = statistics.fmean(statistics.fmean(v) for v in seeds.values())
            row[key + "_minus_gloo"] = statistics.fmean(diff) if diff else None
            row[key + "_per_seed"] = diff
            if key == "metric":
                within = [x - statistics.fmean(v) for v in seeds.values() for x in v]
                dof = sum(len(v) - 1 for v in seeds.values())
                row["run_sd"] = (sum(x * x for x in within) / dof) ** 0.5 if dof else None
                row["runs"] = sum(len(v) for v in seeds.values())
        d = row["metric_minus_gloo"]
        row["keeps_accuracy"] = None if d is None else d >= -1.0
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | runs | mean of last points | minus Gloo (points) | per seed | run-to-run sd "
             "| after finish() minus Gloo |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        def pts(v: float | None) -> str:
            return "" if v is None else f"{v:+.1f}"
        sd = "" if r["run_sd"] is None else f"{r['run_sd']:.1f}"
        lines.append(f"| {r['case']} | {r['runs']} | {r['metric'] / 100:.3f} | "
                     f"{pts(r['metric_minus_gloo'])} | "
                     f"{' '.join(pts(v) for v in r['metric_per_seed'])} | {sd} | "
                     f"{pts(r['after_finish_minus_gloo'])} |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], rows: list[dict[str, Any]], path: str, last: int) -> None:
    """Every run's difference from Gloo's run of its seed: the metric and after ``finish()``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [r["case"] for r in rows]
    seeds = sorted({r["seed"] for r in runs})
    base = {(r["seed"], k): 100 * r[k] for r in runs if r["case"] == BASE
            for k in ("metric", "after_finish")}
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.42 * len(cases) + 1.6), sharey=True)
    for ax, key, title in ((axes[0], "metric", f"mean test accuracy over the last {last} points"),
                           (axes[1], "after_finish", "one reading after finish()")):
        ax.axvspan(-1, 1, color="0.9", label="within one point")
        ax.axvline(0, color="0.5", lw=0.8)
        for j, seed in enumerate(seeds):
            pts = [(100 * r[key] - base[(seed, key)], cases.index(r["case"]) + 0.15 * (j - 1))
                   for r in runs if r["seed"] == seed and (seed, key) in base]
            ax.scatter([x for x, _ in pts], [y for _, y in pts], s=16, label=f"seed {seed}",
                       color=f"C{j}", zorder=3)
        means = [r[key + "_minus_gloo"] for r in rows]
        ax.scatter([m for m in means if m is not None],
                   [i for i, m in enumerate(means) if m is not None], marker="|", s=300,
                   color="k", label="mean over seeds", zorder=4)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("minus DDP over Gloo, same seed (points of test accuracy)")
        ax.grid(axis="x", color="0.85", lw=0.5)
    axes[0].set_yticks(range(len(cases)), cases)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle("examples/torch_ddp.py, 4 ranks, one straggler per step: each kind's default "
                 "averaging against DDP over Gloo", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)


def replica(seed: int, steps: int, order: int, lr: float = 0.1, P: int = 4,
            batch: int = 32) -> list[float]:
    """Gloo's run of ``torch_ddp.py`` in one process (each step the mean of the P ranks' batch
    gradients, as DDP averages them; no stragglers, which a synchronous run does not feel):
    its test accuracy every 2 steps. ``order`` seeds the batches (``seed``: the job's own)."""
    import torch
    from torch_ddp import convnet, digits

    torch.set_num_threads(1)
    Xtr, ytr, Xte, yte = digits(seed)
    model = convnet(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    shards = [torch.arange(r, len(Xtr), P) for r in range(P)]
    gens = [torch.Generator().manual_seed(order + 1 + r) for r in range(P)]
    curve = []
    for s in range(steps):
        opt.zero_grad()
        for shard, gen in zip(shards, gens, strict=True):
            idx = shard[torch.randint(len(shard), (batch,), generator=gen)]
            (torch.nn.functional.cross_entropy(model(Xtr[idx]), ytr[idx]) / P).backward()
        opt.step()
        if s % 2 == 1:
            with torch.no_grad():
                curve.append(float((model(Xte).argmax(1) == yte).float().mean()))
    return curve


def noise(seeds: list[int], steps: list[int], last: int, orders: int = 6) -> dict[str, Any]:
    """How much a reading moves when only the trajectory changes: Gloo's replica, per seed, on
    ``orders`` other orders of the batches; per step count, the sd over orders (points) of the
    final reading and of the mean of the last ``last`` points, and the mean change between
    consecutive points over the last 50 steps."""
    out: dict[str, Any] = {"orders": orders, "seeds": seeds, "rows": []}
    curves = {(seed, o): replica(seed, max(steps), 100 + o) for seed in seeds
              for o in range(orders)}
    for n in steps:
        for seed in seeds:
            cs = [curves[(seed, o)][:n // 2] for o in range(orders)]
            out["rows"].append({
                "steps": n, "seed": seed,
                "final_sd": 100 * statistics.stdev(c[-1] for c in cs),
                "last_sd": 100 * statistics.stdev(statistics.fmean(c[-last:]) for c in cs),
                "last_mean": statistics.fmean(statistics.fmean(c[-last:]) for c in cs),
                "step_change": 100 * statistics.fmean(abs(c[i] - c[i - 1]) for c in cs
                                                      for i in range(len(c) - 24, len(c)))})
            r = out["rows"][-1]
            print(f"{n} steps, seed {seed}: final reading sd {r['final_sd']:.1f} points, mean of "
                  f"last {last} sd {r['last_sd']:.1f} (mean {r['last_mean']:.3f}), "
                  f"consecutive points {r['step_change']:.1f} apart", flush=True)
    return out


def dump(doc: dict[str, Any], path: str) -> None:
    """The JSON with one run (and one summary row) per line."""
    parts = []
    for k, v in doc.items():
        body = json.dumps(v) if not isinstance(v, list) or not v else \
            "[\n  " + ",\n  ".join(json.dumps(x) for x in v) + "\n ]"
        parts.append(f" {json.dumps(k)}: {body}")
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(parts) + "\n}\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of torch_ddp.py")
    p.add_argument("--reps", type=int, default=1, help="runs of each case and seed")
    p.add_argument("--last", type=int, default=10,
                   help="the metric averages the curve's last LAST points (default 10)")
    p.add_argument("--cases", default=None, help="comma-separated labels (default: all)")
    p.add_argument("--out", default=None, help="JSON of every run (kept runs are not rerun)")
    p.add_argument("--plot", default=None, help="PNG of every run's difference from Gloo")
    p.add_argument("--noise", default=None, metavar="STEPS",
                   help="instead: Gloo's one-process replica on 6 other batch orders per seed, "
                        "at these comma-separated step counts (e.g. 150,400); into --out")
    p.add_argument("extra", nargs="*", help="after --: arguments for torch_ddp.py")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    cases = CASES if a.cases is None else [c for c in CASES if c[0] in a.cases.split(",")]
    doc: dict[str, Any] = {"runs": []}
    if a.out and os.path.exists(a.out):
        with open(a.out) as f:
            doc = json.load(f)
    if a.noise is not None:
        doc["noise"] = noise(seeds, [int(n) for n in a.noise.split(",")], a.last)
        if a.out:
            dump(doc, a.out)
        return
    runs: list[dict[str, Any]] = doc.setdefault("runs", [])
    done = {(r["case"], r["seed"], r["rep"]) for r in runs}
    for label, args, seed, rep in schedule(cases, seeds, a.reps):
        if (label, seed, rep) in done:
            continue
        r = run(label, args, seed, rep, a.last, a.extra)
        runs.append(r)
        print(f"{r['start']} {label:>15} seed {seed} rep {rep}: last {a.last} "
              f"{r['metric']:.3f}, after finish {r['after_finish']:.3f}, load {r['load']}",
              flush=True)
        if a.out:
            doc = {"last": a.last, "extra": a.extra, "summary": summary(runs), "runs": runs,
                   **{k: v for k, v in doc.items() if k not in ("last", "extra", "summary",
                                                               "runs")}}
            dump(doc, a.out)
    rows = summary(runs)
    print(table(rows))
    if a.plot:
        plot(runs, rows, a.plot, a.last)


if __name__ == "__main__":
    main()
