"""Validation: the simulator's predictions of ``bench/skew.py`` and ``bench/allreduce.py`` at
P = 4 and 8 on this machine, against their measurements.

    python bench/sim_validate.py [--quick] [--out FILE.json] [--plot FILE.png]
                                 [--profile PROFILE.json] [--measure]
                                 [--skew-json F] [--allreduce-json F]

1. The profile: ``--profile`` (a calibrated JSON), or a fresh ``asynccoll sim calibrate`` (tcp,
   about 15 s). All P ranks share this host: ``profile.placed(P)``, so with P above the
   machine's cores every CPU cost is scaled by P / cores and the intra-host link is priced
   with the time-shared cores' figures (:mod:`asynccoll.sim.cost`).
2. The measurements: ``--measure`` runs ``bench/skew.py --quick --P 4,8`` (asynccoll's kinds) and
   ``bench/allreduce.py --quick --P 4,8 --impls asynccoll-tcp`` now (about a minute on two
   cores), else the JSON files given (default ``bench/results/skew.json`` and
   ``bench/results/allreduce.json``, the last full runs).
3. The predictions, the same experiments in the simulator: skew: rank r computes r ms, a
   barrier between iterations, a 4-byte float32 sum, the mean call latency over ranks and
   iterations, for ``sync``, ``solo``, ``majority``, ``two_choice`` and ``quorum`` (k = P/2);
   allreduce: a barrier before each call, the call's time is the slowest rank's, median over
   calls, for 4 B, 4 KiB and 1 MiB (``asynccoll-tcp``). After every barrier the ranks leave
   in waves (:meth:`Profile.exit_offsets`), added to their compute times.

Each row has ``measured_us``, ``predicted_us`` and ``error`` (predicted / measured - 1), and
``predicted_scaled_us`` / ``error_scaled``: the scaled model alone (no time-shared figures, no
waves), for comparison; the target is |error| <= 25 %. The plot draws predicted against
measured on log axes with the +-25 % band.
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
from _harness import write_json

from asynccoll.sim import LinearSkew, Profile, simulate

HERE = os.path.dirname(os.path.abspath(__file__))
SKEW_IMPLS = ("sync", "solo", "majority", "two_choice", "quorum")
SIZES = (4, 4096, 1 << 20)


def measured(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], str]:
    if not args.measure:
        with open(args.skew_json) as f:
            skew = json.load(f)
        with open(args.allreduce_json) as f:
            ar = json.load(f)
        return skew, ar, f"stored: {args.skew_json} ({skew['env'].get('date')}), " \
                         f"{args.allreduce_json} ({ar['env'].get('date')})"
    tmp = tempfile.mkdtemp(prefix="sim-validate-")
    sk, al = os.path.join(tmp, "skew.json"), os.path.join(tmp, "allreduce.json")
    subprocess.run([sys.executable, os.path.join(HERE, "skew.py"), "--quick", "--P", "4,8",
                    "--impls", ",".join(SKEW_IMPLS), "--out", sk], check=True, timeout=600)
    subprocess.run([sys.executable, os.path.join(HERE, "allreduce.py"), "--quick", "--P",
                    "4,8", "--impls", "asynccoll-tcp", "--out", al], check=True, timeout=600)
    with open(sk) as f:
        skew = json.load(f)
    with open(al) as f:
        ar = json.load(f)
    return skew, ar, "measured now (--measure: bench/skew.py and bench/allreduce.py --quick)"


def _compute(prof: Profile, base: np.ndarray, seed: int) -> np.ndarray:
    """``base`` (steps x P seconds after each barrier) plus when each rank leaves the barrier
    (:meth:`Profile.exit_offsets`: the ranks time-sharing the cores leave it in waves)."""
    return base + prof.exit_offsets(base.shape[0], base.shape[1],
                                    np.random.default_rng(seed + 1000))


def predict_skew(prof: Profile, P: int, impl: str, iters: int, skew_s: float,
                 scaled: bool = False) -> float:
    """Mean call latency of ``bench/skew.py`` (``scaled``: the model without the time-shared
    cores' figures and waves, as before they were measured)."""
    pol = f"quorum:{max(1, P // 2)}" if impl == "quorum" else impl
    pp = prof.with_(shared=None, ranks_per_host=P) if scaled else prof.placed(P)
    base = LinearSkew(skew_s).sample(iters, P, np.random.default_rng(1))
    run = simulate(pol, P, iters, profile=pp, compute=_compute(pp, base, 1), barrier=True,
                   nbytes=4, seed=1)
    return float(run.latency.mean())


def predict_allreduce(prof: Profile, P: int, size: int, calls: int,
                      scaled: bool = False) -> float:
    """``bench/allreduce.py``'s statistic: per call the slowest rank's time from its exit of
    the barrier before the call, median over calls."""
    pp = prof.with_(shared=None, ranks_per_host=P) if scaled else prof.placed(P)
    run = simulate("sync", P, calls, profile=pp,
                   compute=_compute(pp, np.zeros((calls, P)), 0), barrier=True, nbytes=size)
    return float(np.median(run.latency.reshape(P, calls).max(axis=0)))


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    for bench, marker in (("skew", "o"), ("allreduce", "s")):
        rs = [r for r in rows if r["bench_case"] == bench]
        ax.scatter([r["measured_us"] for r in rs], [r["predicted_us"] for r in rs],
                   marker=marker, label=bench)
        for r in rs:
            ax.annotate(f"{r['impl']} P={r['P']}" + (f" {r['size']}B" if "size" in r else ""),
                        (r["measured_us"], r["predicted_us"]), fontsize=6)
    lo = min(min(r["measured_us"], r["predicted_us"]) for r in rows) / 1.5
    hi = max(max(r["measured_us"], r["predicted_us"]) for r in rows) * 1.5
    xs = np.geomspace(lo, hi, 10)
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs * 0.75, xs * 1.25, color="grey", alpha=0.2, label="+-25 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured latency (us)")
    ax.set_ylabel("simulated latency (us)")
    ax.set_title("simulator vs this machine (tcp, calibrated profile)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/results/sim_validate.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--profile", default=None, help="calibrated profile JSON (default: "
                                                    "calibrate now)")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--skew-json", default=os.path.join(HERE, "results", "skew.json"))
    ap.add_argument("--allreduce-json", default=os.path.join(HERE, "results",
                                                             "allreduce.json"))
    a = ap.parse_args()
    if a.profile:
        prof = Profile.load(a.profile)
    else:
        from asynccoll.sim.calibrate import calibrate

        prof = calibrate(("tcp",), calls=30 if a.quick else 60)["tcp"]
    skew, ar, source = measured(a)
    rows: list[dict[str, Any]] = []
    iters = 16 if a.quick else int(skew["params"].get("iters", 64))
    skew_s = float(skew["params"].get("skew_s", 1e-3))
    for row in skew["rows"]:
        if row["P"] not in (4, 8) or row["impl"] not in SKEW_IMPLS:
            continue
        pred = predict_skew(prof, row["P"], row["impl"], iters, skew_s) * 1e6
        old = predict_skew(prof, row["P"], row["impl"], iters, skew_s, scaled=True) * 1e6
        meas = float(row["latency_us_mean"])
        rows.append({"bench_case": "skew", "impl": row["impl"], "P": row["P"],
                     "measured_us": meas, "measured_us_min": row.get("latency_us_min"),
                     "measured_us_max": row.get("latency_us_max"), "predicted_us": pred,
                     "error": pred / meas - 1, "predicted_scaled_us": old,
                     "error_scaled": old / meas - 1})
    for row in ar["rows"]:
        if row["impl"] != "asynccoll-tcp" or row["P"] not in (4, 8) or row["size"] not in SIZES:
            continue
        calls = 10 if a.quick else 30
        pred = predict_allreduce(prof, row["P"], row["size"], calls) * 1e6
        old = predict_allreduce(prof, row["P"], row["size"], calls, scaled=True) * 1e6
        meas = float(row["time_us_median"])
        rows.append({"bench_case": "allreduce", "impl": "asynccoll-tcp", "P": row["P"],
                     "size": row["size"], "measured_us": meas,
                     "measured_us_min": row.get("time_us_min"),
                     "measured_us_max": row.get("time_us_max"), "predicted_us": pred,
                     "error": pred / meas - 1, "predicted_scaled_us": old,
                     "error_scaled": old / meas - 1})
    within = sum(abs(r["error"]) <= 0.25 for r in rows)
    for r in rows:
        print(f"{r['bench_case']:9s} {r['impl']:13s} P={r['P']} {r.get('size', ''):>8} "
              f"measured {r['measured_us']:9.0f} us  predicted {r['predicted_us']:9.0f} us  "
              f"error {r['error']:+.0%}  (scaled model alone {r['error_scaled']:+.0%})",
              file=sys.stderr)
    within_old = sum(abs(r["error_scaled"]) <= 0.25 for r in rows)
    print(f"{within}/{len(rows)} within 25 % ({within_old} with the scaled model alone)",
          file=sys.stderr)
    write_json(a.out, "sim_validate", {"quick": a.quick, "measured": source,
                                        "profile": prof.to_json()}, rows,
               extra={"summary": {"within_25pct": within, "rows": len(rows),
                                  "within_25pct_scaled_model": within_old,
                                  "abs_error_median": float(np.median(
                                      [abs(r["error"]) for r in rows]))}})
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
