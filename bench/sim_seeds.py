"""The seed papers' straggler experiments in the simulator, at their scale and at P = 1024.

    python bench/sim_seeds.py [--quick] [--out FILE.json] [--plot FILE.png] [--profile aries]

Three experiments, each run through :func:`asynccoll.sim.simulate` (the real schedules in
virtual time, the shipped ``aries`` profile unless ``--profile`` says otherwise), with the
papers' numbers beside ours in every row (``paper_*``):

* **eager-SGD Fig. 9** (§7.1): P = 32, 64 iterations, rank r computes r ms before each call,
  a barrier between iterations, 4-byte sum; mean call latency of ``sync``, ``solo`` and
  ``majority`` over all ranks and iterations, and NAP. Paper: solo 53.32x and majority 2.46x
  lower mean latency than MPI_Allreduce; NAP about 1 and 16.
* **RNA Fig. 10** (§8.4): P = 100, 100 iterations, each rank computes U(10, 50) ms per
  iteration, a barrier between iterations; the response time of an iteration is from the
  barrier to the start of its execution (the first probe to arrive), for 1 (``majority``),
  2 (``two_choice``), 3 and 4 drawn initiators (a simulator what-if: ``choices``). Paper:
  median 28 ms with one choice, 12 ms with two (2.4x), more choices do not help.
* **Backup workers** (the "Revisiting distributed synchronous SGD" paper, Fig. 4/6):
  N + b = 100 workers, compute 1.4 s plus a Pareto tail (scale 0.1 s, shape 1.5) per step,
  no barrier; step time (makespan over steps) against b for ``quorum:N``. Paper: most mean
  times to collect k gradients lie between 1.4 and 1.8 s except the final few; N = 96, b = 4
  converges fastest (its Fig. 6 weighs step time against gradient quality; we report the step
  time half of that trade-off).

Then the same at P = 1024 (fewer steps: every rank of a quorum sends P - 1 arrival messages,
O(P^2) simulated messages per execution). ``--quick`` runs fewer iterations everywhere. The
virtual times do not depend on this machine; the ``wall_s`` of each row does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import write_json

from asynccoll.sim import LinearSkew, Pareto, Uniform, builtin_profile, simulate

PAPER_FIG9 = {"solo_speedup": 53.32, "majority_speedup": 2.46, "solo_nap": 1.0,
              "majority_nap": 16.0}
PAPER_FIG10 = {"median_ms_1": 28.0, "median_ms_2": 12.0, "speedup_2": 2.4}
PAPER_BACKUP = {"mean_collect_s": "1.4-1.8 for most k", "best": "N=96, b=4 (Fig. 6)"}


def fig9(P: int, iters: int, profile: Any, skew: float) -> list[dict[str, Any]]:
    rows = []
    base = None
    for pol in ("sync", "solo", "majority"):
        t = time.perf_counter()
        run = simulate(pol, P, iters, profile=profile, compute=LinearSkew(skew), barrier=True,
                       nbytes=4)
        s = run.summary()
        lat = s["latency_mean_s"]
        base = lat if pol == "sync" else base
        assert base is not None
        rows.append({"experiment": "eager-sgd-fig9", "P": P, "impl": pol, "iters": iters,
                     "skew_ms": skew * 1e3, "latency_us_mean": lat * 1e6,
                     "speedup_vs_sync": base / lat if lat > 0 else float("inf"),
                     "nap_mean": s["nap"], "executions": s["executions"],
                     "paper_speedup": {"sync": 1.0, "solo": PAPER_FIG9["solo_speedup"],
                                       "majority": PAPER_FIG9["majority_speedup"]}[pol],
                     "paper_nap": {"sync": float(P), "solo": PAPER_FIG9["solo_nap"],
                                   "majority": P / 2}[pol],
                     "wall_s": time.perf_counter() - t})
    return rows


def fig10(P: int, iters: int, profile: Any, seed: int = 1) -> list[dict[str, Any]]:
    rows = []
    model = Uniform(0.010, 0.050)
    comp = model.sample(iters, P, np.random.default_rng(seed))
    for q in (1, 2, 3, 4):
        pol = "majority" if q == 1 else "two_choice"
        t = time.perf_counter()
        run = simulate(pol, P, iters, profile=profile, compute=comp, barrier=True, seed=seed,
                       choices=None if q <= 2 else q)
        tc = run.t_call.reshape(P, iters)
        start = np.nanmin(tc - comp.T, axis=0)  # each iteration's barrier exit
        rounds = run.rounds.reshape(P, iters)
        resp = []
        for s in range(iters):
            inc = rounds[:, s][run.included.reshape(P, iters)[:, s]]
            if inc.size and int(inc[0]) in run.started_at:
                resp.append(run.started_at[int(inc[0])] - start[s])
        r = np.asarray(resp) * 1e3
        rows.append({"experiment": "rna-fig10", "P": P, "impl": f"{q} choice(s)", "choices": q,
                     "iters": iters, "response_ms_median": float(np.median(r)),
                     "response_ms_p5": float(np.percentile(r, 5)),
                     "response_ms_p95": float(np.percentile(r, 95)),
                     "latency_us_mean": run.summary()["latency_mean_s"] * 1e6,
                     "nap_mean": run.nap,
                     "paper_response_ms_median": {1: PAPER_FIG10["median_ms_1"],
                                                  2: PAPER_FIG10["median_ms_2"]}.get(q),
                     "wall_s": time.perf_counter() - t})
    m1 = rows[0]["response_ms_median"]
    for row in rows:
        row["speedup_vs_1"] = m1 / row["response_ms_median"]
    return rows


def backup(P: int, steps: int, bs: list[int], profile: Any, seed: int = 2,
           ) -> list[dict[str, Any]]:
    rows = []
    comp = Pareto(1.4, 0.1, 1.5).sample(steps, P, np.random.default_rng(seed))
    for b in bs:
        t = time.perf_counter()
        run = simulate(f"backup:{b}", P, steps, profile=profile, compute=comp, seed=seed)
        s = run.summary()
        rows.append({"experiment": "backup-workers", "P": P, "impl": f"N={P - b}, b={b}",
                     "b": b, "steps": steps, "step_time_s": 1 / s["steps_per_s"],
                     "latency_s_mean": s["latency_mean_s"], "nap_mean": s["nap"],
                     "staleness_max": s["staleness_max"],
                     "paper": PAPER_BACKUP if P == 100 else None,
                     "wall_s": time.perf_counter() - t})
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ps = sorted({r["P"] for r in rows if r["experiment"] == "eager-sgd-fig9"})
    fig, axes = plt.subplots(len(Ps), 3, figsize=(15, 4 * len(Ps)), squeeze=False)
    for i, P in enumerate(Ps):
        f9 = [r for r in rows if r["experiment"] == "eager-sgd-fig9" and r["P"] == P]
        ax = axes[i, 0]
        x = np.arange(len(f9))
        ax.bar(x - 0.2, [r["speedup_vs_sync"] for r in f9], 0.4, label="simulated")
        ax.bar(x + 0.2, [r["paper_speedup"] for r in f9], 0.4, label="paper (P = 32)")
        ax.set_yscale("log")
        ax.set_xticks(x, [f"{r['impl']}\nNAP {r['nap_mean']:.1f}" for r in f9])
        ax.set_ylabel("mean latency of sync / policy")
        ax.set_title(f"eager-SGD Fig. 9 at P = {P}")
        ax.legend()
        f10 = [r for r in rows if r["experiment"] == "rna-fig10"
               and r["P"] == (100 if P == 32 else P)]
        ax = axes[i, 1]
        q = [r["choices"] for r in f10]
        ax.errorbar(q, [r["response_ms_median"] for r in f10],
                    yerr=[[r["response_ms_median"] - r["response_ms_p5"] for r in f10],
                          [r["response_ms_p95"] - r["response_ms_median"] for r in f10]],
                    marker="o", capsize=3, label="simulated (median, p5-p95)")
        ax.plot([1, 2], [PAPER_FIG10["median_ms_1"], PAPER_FIG10["median_ms_2"]], "x--",
                label="paper medians (P = 100)")
        ax.set_xlabel("choices (drawn initiators)")
        ax.set_ylabel("response time (ms)")
        ax.set_title(f"RNA Fig. 10 at P = {f10[0]['P'] if f10 else '-'}")
        ax.legend()
        bw = [r for r in rows if r["experiment"] == "backup-workers"
              and r["P"] == (100 if P == 32 else P)]
        ax = axes[i, 2]
        ax.plot([r["b"] for r in bw], [r["step_time_s"] for r in bw], "o-")
        ax.set_xlabel("backup workers b")
        ax.set_ylabel("step time (s, simulated)")
        ax.set_title(f"backup workers, N + b = {bw[0]['P'] if bw else '-'} "
                     "(paper: best b = 4 of 100)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def show(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Print ``rows`` (to stderr, as they come) and return them."""
    for r in rows:
        keys = [k for k in ("speedup_vs_sync", "nap_mean", "response_ms_median",
                            "speedup_vs_1", "step_time_s") if k in r]
        print(f"{r['experiment']:16s} P={r['P']:5d} {r['impl']:16s} "
              + " ".join(f"{k}={r[k]:.3g}" for k in keys) + f" wall={r['wall_s']:.1f}s",
              file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/results/sim_seeds.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--profile", default="aries")
    ap.add_argument("--no-1024", action="store_true", help="only the papers' scale")
    a = ap.parse_args()
    prof = builtin_profile(a.profile)
    q = a.quick
    rows: list[dict[str, Any]] = []
    rows += show(fig9(32, 16 if q else 64, prof, 1e-3))
    rows += show(fig10(100, 30 if q else 100, prof))
    rows += show(backup(100, 20 if q else 60, [0, 1, 2, 4, 6, 10, 20], prof))
    if not a.no_1024:
        # the same total skew (32 ms) spread over 1024 ranks
        rows += show(fig9(1024, 1 if q else 2, prof, 32e-3 / 1024))
        rows += show(fig10(1024, 5 if q else 20, prof))
        rows += show(backup(1024, 2 if q else 3, [0, 10, 40], prof))
    write_json(a.out, "sim_seeds", {"profile": prof.name, "quick": q,
                                     "profile_source": prof.source}, rows)
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
