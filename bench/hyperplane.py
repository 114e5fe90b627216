"""Eager-SGD's hyperplane regression under load imbalance (eager-SGD Fig. 10) on this machine.

    python bench/hyperplane.py [--quick] [--out FILE.json] [--plot FILE.png] [--P 4,8]
                               [--step-ms 200] [--steps 30] [--lr 0.3] [--reps 1]

P real rank processes over ``tcp://127.0.0.1`` (started by the launcher; they share this
machine's cores). Step time c = a simulated accelerator time (a sleep; the machine has no GPU)
around the real NumPy gradient of a linear model; an injected delay D = 0.5c, 0.75c, 1.0c goes to
one seeded random rank per global step. For each P, D and mode (sync, solo, majority) it
measures throughput (global steps, i.e. rounds of the collective, per second of wall time; also
rank 0's own steps per second, ``local_steps_per_s``: with many ranks out of phase, solo runs
more rounds than any one rank runs steps, each with fewer contributors) and the validation MSE
against wall time; the final validation MSE is taken after ``finish()``
(every rank's contributions applied, parameters averaged). Rows carry the median, min and max
over ``--reps`` repetitions of the whole experiment. The paper's speedups of solo over sync at
these ratios were 1.50x, 1.75x and 2.01x (8 processes).

``--quick``: P = 4, c = 50 ms, 20 steps (under 60 s). Full: P = 4 and 8, c = 200 ms, 30 steps
(the paper's c was 400 ms: its 200/300/400 ms injections are 0.5c/0.75c/1.0c). The runtime's
own cost per round (a few ms: activation and allreduce between processes sharing 2 cores) is
part of every measured step, so a smaller c lowers the measured speedups.
There is no peer library to compare with here: the baseline of eager-SGD is synchronous SGD,
measured in the same run as ``mode = "sync"``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from asynccoll.demo import DemoConfig, plot, run_experiment, speedups

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import stats, write_json

MODES = ["sync", "solo", "majority"]
DELAYS = [0.5, 0.75, 1.0]
PAPER = {0.5: 1.50, 0.75: 1.75, 1.0: 2.01}
TARGET = {0.5: 1.45, 0.75: 1.65, 1.0: 1.9}


def _spread(name: str, vals: list[float]) -> dict[str, float]:
    """``name`` (the median, which the summary lines read) plus :func:`stats` of ``vals``."""
    return {name: statistics.median(vals), **stats(name, vals)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="P = 4, c = 50 ms, 20 steps (< 60 s)")
    p.add_argument("--out", help="write the JSON results here")
    p.add_argument("--plot", help="write a PNG plot (validation MSE vs wall time) here")
    p.add_argument("--P", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="world sizes (default 4,8; --quick 4)")
    p.add_argument("--step-ms", type=float, default=None, help="c in ms (default 200; quick 50)")
    p.add_argument("--steps", type=int, default=None, help="global steps per run (30; quick 20)")
    p.add_argument("--lr", type=float, default=0.3, help="learning rate")
    p.add_argument("--reps", type=int, default=1, help="repetitions of the whole experiment")
    p.add_argument("--dim", type=int, default=128)
    args = p.parse_args(argv)
    Ps = args.P or ([4] if args.quick else [4, 8])
    c = args.step_ms or (50.0 if args.quick else 200.0)
    steps = args.steps or (20 if args.quick else 30)
    print("hyperplane: no peer rows (the baseline is synchronous SGD, measured as mode=sync); "
          "the accelerator time per step is a sleep: this machine has no GPU", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    curves: list[dict[str, Any]] = []
    t_all = time.monotonic()
    for P in Ps:
        cfg = DemoConfig(ranks=P, steps=steps, delays=DELAYS, modes=MODES, dim=args.dim,
                         step_ms=c, lr=args.lr)
        reps = [run_experiment(cfg, show=False) for _ in range(args.reps)]
        for i, first in enumerate(reps[0]):
            runs = [rep[i] for rep in reps]
            row = {"mode": first["mode"], "P": P, "delay_ratio": first["delay_ratio"]}
            row.update(_spread("steps_per_s", [r["steps_per_s"] for r in runs]))
            row.update(_spread("local_steps_per_s", [r["local_steps_per_s"] for r in runs]))
            row.update(_spread("final_val_mse", [r["final_val_mse"] for r in runs]))
            row["mean_contributors"] = statistics.median(r["mean_contributors"] for r in runs)
            rows.append(row)
            curves.append({**{k: first[k] for k in ("mode", "delay_ratio", "steps_per_s")},
                           "P": P, "curve": first["curve"]})
        print(f"hyperplane: P={P} done at {time.monotonic() - t_all:.1f} s", file=sys.stderr)
    sp = speedups(rows)
    sync_mse = {(r["P"], r["delay_ratio"]): r["final_val_mse"] for r in rows
                if r["mode"] == "sync"}
    for r in rows:
        r["speedup_over_sync"] = sp.get((r["mode"], r["delay_ratio"]))
    # speedups() keys by (mode, ratio): recompute per P so that P=4 and P=8 do not mix.
    for P in Ps:
        sub = [r for r in rows if r["P"] == P]
        for (mode, ratio), s in speedups(sub).items():
            for r in sub:
                if (r["mode"], r["delay_ratio"]) == (mode, ratio):
                    r["speedup_over_sync"] = s
                    r["mse_vs_sync"] = r["final_val_mse"] / sync_mse[(P, ratio)]
    for r in rows:
        paper = f"  (paper {PAPER[r['delay_ratio']]:.2f}x, target {TARGET[r['delay_ratio']]}x)" \
            if r["mode"] == "solo" else ""
        print(f"P={r['P']} D={r['delay_ratio']:g}c {r['mode']:>8}: "
              f"{r['steps_per_s']:.2f} steps/s [{r['steps_per_s_min']:.2f}, "
              f"{r['steps_per_s_max']:.2f}] (rank 0 {r['local_steps_per_s']:.2f}), "
              f"speedup {r['speedup_over_sync']:.2f}x, "
              f"val MSE {r['final_val_mse']:.4f} ({r['mse_vs_sync']:.3f} of sync){paper}",
              file=sys.stderr)
    params = {"quick": args.quick, "P": Ps, "step_ms": c, "steps": steps, "delays": DELAYS,
              "modes": MODES, "reps": args.reps, "dim": args.dim, "lr": args.lr,
              "transport": "tcp"}
    if args.out:
        write_json(args.out, "hyperplane", params, rows, packages=("asynccoll", "uvloop"),
                   extra={"curves": curves})
    if args.plot:
        big = max(Ps)
        if not plot([cv for cv in curves if cv["P"] == big], args.plot,
                    f"hyperplane regression, P = {big}, c = {c:g} ms"):
            print("hyperplane: matplotlib is not installed; no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
