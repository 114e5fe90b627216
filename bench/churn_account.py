"""Exact accounting under churn (issue 32): a rank killed and restarted every few seconds, a
bare solo partial handle counting every contribution.

    python bench/churn_account.py [--calls N] [--every K] [--runs R] [--out F.json] [--plot F.png]

P = 4 real rank processes under ``asynccoll run -n 4 --max-restarts 1000`` over loopback tcp
run ``tests/adversarial/_rejoin_count_job.py`` with ``CHURN_DIR``: rank r contributes 1000**r
per call to a solo handle with sum accumulation (``Accumulate.SUM``: nothing a call brings is
dropped while its rank lives); every 5 calls the ranks flush and take back restarted ranks
(``admit_ready``); every ``--every`` calls one of ranks 1-3, drawn from the call index,
SIGKILLs itself (it first writes how many calls it made), the launcher restarts it and it
joins the handle at the members' call index. Rank 0 is never killed, so the sum of every result
it received (every call's and every flush's) is the job's whole account: its base-1000 digit r
is how many of rank r's calls were counted.

Per rank r, each run records the calls its processes made (``made``: the dead processes' and
the last one's), the calls counted at rank 0 (``counted``) and the difference (``lost``: the
contributions that died with a killed process before any execution took them). Exact
accounting means: rank 0's own digit equals its calls; for every other rank
``final_calls <= counted <= made`` (the last process's calls every one, a dead process's at
most once each); every final process counts its own calls exactly once in what it received
since it joined; the final results say 4 ranks and nobody lost. ``exact`` is true when all
hold. The default, 700 calls with a kill chance every 20, makes about 20 kills in 2-3 minutes
on the 2-core machine.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import bar_plot, stats, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "adversarial", "_rejoin_count_job.py")
P = 4


def digits(v: float) -> list[int]:
    """The base-1000 digits of a rank-0 sum: calls counted per rank."""
    n = round(v)
    return [(n // 1000 ** r) % 1000 for r in range(P)]


def run_once(calls: int, every: int, timeout: float) -> dict[str, Any]:
    """One job; its account (the module doc), the launcher's exit code and output tail."""
    with tempfile.TemporaryDirectory(prefix="churn-") as d:
        env = dict(os.environ, CHURN_DIR=d, CALLS=str(calls), CHURN_EVERY=str(every),
                   PYTHONPATH=ROOT, ASYNCCOLL_TIMEOUT="60")
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", str(P),
                            "--max-restarts", "1000", JOB], capture_output=True, text=True,
                           timeout=timeout, env=env, cwd=ROOT)
        wall = time.monotonic() - t0
        out = p.stdout + p.stderr
        dead: dict[int, list[int]] = {r: [] for r in range(P)}
        for f in glob.glob(os.path.join(d, "dead-*")):
            rank = int(os.path.basename(f).split("-")[1])
            with open(f) as fh:
                dead[rank].append(int(fh.read()))
    rows = {r["rank"]: r for r in (json.loads(line.split("COUNT ", 1)[1])
                                    for line in out.splitlines() if "COUNT {" in line)}
    rec: dict[str, Any] = {"calls": calls, "every": every, "code": p.returncode,
                           "wall_s": wall, "kills": out.count("CHURN kill"),
                           "joins": len(re.findall(r"JOINED rank \d at call", out))}
    if p.returncode != 0 or sorted(rows) != list(range(P)):
        rec.update(exact=False, tail=out[-4000:])
        return rec
    seen = digits(rows[0]["acc"][0])
    per_rank = []
    for r in range(P):
        final = rows[r]
        made = final["calls"] + sum(dead[r])
        per_rank.append({"rank": r, "deaths": len(dead[r]), "final_calls": final["calls"],
                         "made": made, "counted": seen[r], "lost": made - seen[r],
                         "own_exact": digits(final["acc"][0])[r] == final["calls"],
                         "size": final["size"], "reported_lost": final["lost"]})
    rec["ranks"] = per_rank
    rec["exact"] = (seen[0] == rows[0]["calls"] and all(
        x["final_calls"] <= x["counted"] <= x["made"] and x["own_exact"] and x["size"] == P
        and x["reported_lost"] == [] for x in per_rank))
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=700, help="calls per rank (default 700)")
    ap.add_argument("--every", type=int, default=20, help="a kill chance every K calls")
    ap.add_argument("--runs", type=int, default=1, help="jobs, one after the other")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    ap.add_argument("--out", default="bench/results/churn_account.json")
    ap.add_argument("--plot", help="a bar chart of the kills and joins per run (PNG)")
    args = ap.parse_args()
    if args.calls >= 1000:
        ap.error("--calls must stay below 1000 (the account's base-1000 digits)")
    runs = []
    for i in range(args.runs):
        rec = run_once(args.calls, args.every, args.timeout)
        runs.append(rec)
        print(f"run {i + 1}: exit {rec['code']}, {rec['kills']} kills, {rec['joins']} joins, "
              f"exact {rec['exact']}, {rec['wall_s']:.0f} s", flush=True)
        for x in rec.get("ranks", []):
            print(f"  rank {x['rank']}: {x['deaths']} deaths, made {x['made']}, counted "
                  f"{x['counted']}, lost {x['lost']}", flush=True)
    summary = {**stats("kills", [r["kills"] for r in runs]),
               **stats("wall_s", [r["wall_s"] for r in runs]),
               "all_exact": all(r["exact"] for r in runs)}
    write_json(args.out, "churn_account", vars(args), runs, extra={"summary": summary})
    if args.plot:
        bar_plot([{"label": f"run {i + 1}", **stats("kills", [r["kills"]])}
                  for i, r in enumerate(runs)], "kills", [f"run {i + 1}" for i in
                                                          range(len(runs))], args.plot,
                 ylabel="kills (each restarted and joined)", title="churn with exact accounting")
    sys.exit(0 if summary["all_exact"] else 1)


if __name__ == "__main__":
    main()
