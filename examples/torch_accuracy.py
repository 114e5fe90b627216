"""Final test accuracy of every policy of ``partial_hook`` and every policy and algorithm of
``DistributedOptimizer`` against DDP over Gloo, each with its default averaging, on
``examples/torch_ddp.py`` (4 ranks, one straggler per step), over several seeds.

    python examples/torch_accuracy.py --seeds 0,1,2 --out accuracy.json

Each case is a fresh ``asynccoll run -n 4`` job; rank 0's final accuracy (after ``finish()``)
is collected. Prints, per case, the median (min-max) over the seeds and the difference of each
seed from Gloo's run with the same seed. Extra arguments after ``--`` go to torch_ddp.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
#: (label, torch_ddp.py arguments); quorum and deadline wait for 3 of 4 ranks
CASES = [("ddp-gloo", ["--policy", "gloo"])] + [
    (f"hook-{k.split(':')[0]}", ["--policy", k])
    for k in ("majority", "solo", "two_choice", "quorum:3", "deadline:3", "sync")] + [
    (f"opt-{m.split(':')[0]}", ["--optimizer", "--policy", m])
    for m in ("majority", "solo", "two_choice", "quorum:3", "deadline:3", "backup:1", "sync")] + [
    (f"opt-{a}", ["--algorithm", a]) for a in ("rna", "odsgd")]


def run(args: list[str], seed: int, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-m", "asynccoll.cli", "run", "-n", "4",
               os.path.join(HERE, "torch_ddp.py"), *args, "--seed", str(seed), "--json", out,
               *extra]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=600)
        with open(out) as f:
            return float(json.load(f)["accuracy"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--cases", default=None, help="comma-separated labels (default: all)")
    p.add_argument("--out", default=None, help="JSON of every run")
    p.add_argument("extra", nargs="*", help="after --: arguments for torch_ddp.py")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    cases = CASES if a.cases is None else [c for c in CASES if c[0] in a.cases.split(",")]
    results: dict[str, list[float]] = {}
    if a.out and os.path.exists(a.out):  # resume: the runs already written are kept
        with open(a.out) as f:
            results = json.load(f)["accuracy"]
    for label, args in cases:
        got = results.setdefault(label, [])
        for s in seeds[len(got):]:
            got.append(run(args, s, a.extra))
            if a.out:
                with open(a.out, "w") as f:
                    json.dump({"seeds": seeds, "extra": a.extra, "accuracy": results}, f,
                              indent=1)
        print(f"{label:>16}: {' '.join(f'{v:.3f}' for v in got)}", flush=True)
    base = results.get("ddp-gloo")
    print("\n| case | final accuracy, median (min-max) | minus Gloo's, per seed |")
    print("|---|---|---|")
    for label, vals in results.items():
        diff = "" if base is None else " ".join(f"{v - b:+.3f}" for v, b in zip(vals, base,
                                                                             strict=True))
        print(f"| {label} | {statistics.median(vals):.3f} ({min(vals):.3f}-{max(vals):.3f}) "
              f"| {diff} |")


if __name__ == "__main__":
    main()
