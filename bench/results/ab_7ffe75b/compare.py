"""Compare the A/B runs beside this file (or in $AB_DIR): new/base time per pair, median
[min-max]."""

from __future__ import annotations

import collections
import json
import os
import statistics as st
from typing import Any

HERE = os.environ.get("AB_DIR", os.path.dirname(os.path.abspath(__file__)))


def figures(bench: str, side: str, i: int) -> dict[tuple[Any, ...], float]:
    with open(f"{HERE}/{side}_{bench}_{i}.json") as f:
        rows = json.load(f)["rows"]
    if bench == "allreduce":
        return {(r["impl"], r["P"], r["size"]): r["time_us_median"] for r in rows}
    return {(r["impl"], r["P"]): r["latency_us_mean"] for r in rows}


def main() -> None:
    for bench in ("allreduce", "skew"):
        ratios: dict[tuple[Any, ...], list[float]] = collections.defaultdict(list)
        pairs = sorted(int(f.split("_")[-1].split(".")[0]) for f in os.listdir(HERE)
                       if f.startswith(f"new_{bench}_") and f.endswith(".json")
                       and os.path.exists(f"{HERE}/{f.replace('new_', 'base_')}"))
        for i in pairs:
            base, new = figures(bench, "base", i), figures(bench, "new", i)
            for k, b in base.items():
                if new.get(k) and b:
                    ratios[k].append(new[k] / b)
        print(f"== {bench}: new/base time per pair, median [min-max]")
        for k in sorted(ratios, key=str):
            r = ratios[k]
            print(f"{k!s:45s} {st.median(r):.2f} [{min(r):.2f}-{max(r):.2f}] n={len(r)}")


if __name__ == "__main__":
    main()
