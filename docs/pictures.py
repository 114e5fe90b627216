"""Draw every picture in docs/img from the current code (``make docs`` runs this).

    python docs/pictures.py [--out DIR] [--only NAME,NAME] [--list]

Schedule pictures are rendered by ``asynccoll inspect schedule`` from the builders as they are
now; the trace picture comes from a fresh traced run (a Communicator's solo allreduce over four
in-process ranks, four skewed calls per rank, then a flush) drawn by ``asynccoll inspect
trace --png``. Benchmark pictures are redrawn by each bench script's own ``plot`` from the
results the docs quote (``bench/results/*.json``): re-measuring takes minutes per script on a
shared machine, so it stays a separate, deliberate step (``python bench/NAME.py --out ...``).
Needs matplotlib (the ``plot`` or ``test`` extra). Exits non-zero naming what failed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from asynccoll import Solo

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"


def _inspect(*argv: str) -> None:
    from asynccoll.cli import main

    code = main(["inspect", *argv])
    if code:
        raise RuntimeError(f"asynccoll inspect {' '.join(argv)} exited with {code}")


def _schedule(kind: str, *extra: str) -> Callable[[Path], None]:
    return lambda out: _inspect("schedule", kind, "-P", "8", *extra, "-f", "png", "-o", str(out))


async def _traced_solo_run(directory: Path) -> None:
    import numpy as np

    from asynccoll.testing import local_world

    world, calls = 4, 4
    async with local_world(world, "inproc", trace=str(directory), timeout=20) as comms:
        like = np.zeros(1024, np.float32)
        handles = [c.partial_allreduce(Solo(), like=like) for c in comms]

        async def rank(r: int) -> None:
            for step in range(calls):
                await asyncio.sleep(0.003 * r * (step % 2))  # skew: some executions go partial
                await handles[r](np.full(1024, r + 1, np.float32))
            await handles[r].flush()

        await asyncio.wait_for(asyncio.gather(*(rank(r) for r in range(world))), 60)


def _trace(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "run-trace"  # the picture's title names the directory
        asyncio.run(_traced_solo_run(directory))
        _inspect("trace", str(directory), "--png", str(out))


def _bench_module(name: str) -> ModuleType:
    """``bench/NAME.py`` as a module (its ``main`` does not run); bench scripts import
    ``_harness`` from their own folder."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {BENCH / name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _results(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / f"{name}.json").read_text())
    return data


def _bench(script: str, results: str | None = None) -> Callable[[Path], None]:
    """Redraw ``bench/SCRIPT.py``'s plot from ``bench/results/RESULTS.json``."""

    def draw(out: Path) -> None:
        mod, res = _bench_module(script), _results(results or script)
        rows, params = res["rows"], res["params"]
        if script == "skew":
            mod.plot(rows, str(out), params["skew_s"])
        elif script == "hyperplane":
            big = max(params["P"])
            if not mod.plot([cv for cv in res["curves"] if cv["P"] == big], str(out),
                            f"hyperplane regression, P = {big}, c = {params['step_ms']:g} ms"):
                raise ImportError("matplotlib")
        elif script == "sched_overhead":
            mod._plot(rows, str(out))
        else:
            mod.plot(rows, str(out))

    return draw


#: file name in docs/img -> how it is drawn (the doc that shows it says the same command)
def _shm_leaks(out: Path) -> None:
    """docs/benchmarks.md's shm_leaks table as bars (``python bench/shm_leaks.py --trials 20``,
    2026-11-29: 0 bytes left in every trial; the trials where the launcher unlinked what the
    ranks' own cleanup left)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = ["plain", "CMA off", "comm.empty", "partial", "sparse\npartial", "mixed",
             "launcher\nSIGTERM", "launcher\nSIGKILL"]
    unlinked = [0, 0, 0, 1, 0, 2, 0, 0]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.bar(range(len(cases)), [20] * len(cases), color="#9ecae1",
           label="trials, 0 bytes left after exit")
    ax.bar(range(len(cases)), unlinked, color="#e6550d",
           label="trials where the launcher unlinked what the ranks left")
    ax.set_xticks(range(len(cases)), cases, fontsize=8)
    ax.set_ylabel("trials (of 20)")
    ax.set_ylim(0, 28)
    ax.set_title("bench/shm_leaks.py --trials 20: bytes left in shared memory, per case "
                 "(3 ranks)", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", ncol=2, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


PICTURES: dict[str, Callable[[Path], None]] = {
    "shm-leaks.png": _shm_leaks,
    "inspect-solo-p8-rank0.png": _schedule("solo", "--rank", "0"),
    "inspect-allreduce-p8.png": _schedule("allreduce", "--algorithm", "recursive_doubling"),
    "inspect-solo-trace.png": _trace,
    "bench-allreduce.png": _bench("allreduce"),
    "bench-allreduce-cma.png": _bench("allreduce", "allreduce_p4_cma_run4"),
    "bench-skew.png": _bench("skew"),
    "bench-hyperplane.png": _bench("hyperplane"),
    "bench-sparse.png": _bench("sparse"),
    "bench-p2p.png": _bench("p2p"),
    "p2p_tcp_full.png": _bench("p2p", "p2p_tcp_full"),
    "bench-sched_overhead.png": _bench("sched_overhead"),
    "bench-allreduce-shm.png": _bench("allreduce", "allreduce_p4_shm_hier"),
    "bench-sim_seeds.png": _bench("sim_seeds"),
    "bench-sim_validate.png": _bench("sim_validate"),
    "bench-wake.png": _bench("wake"),
    "bench-join.png": _bench("join"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "img"), help="folder to write into")
    p.add_argument("--only", default=None, help="comma-separated picture names (see --list)")
    p.add_argument("--list", action="store_true", help="list the pictures and exit")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(PICTURES))
        return 0
    names = list(PICTURES) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in PICTURES]
    if unknown:
        p.error(f"--only: unknown pictures {unknown}; known: {', '.join(PICTURES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in names:
        t0 = time.perf_counter()
        try:
            PICTURES[name](out / name)
        except Exception as exc:  # report every picture that failed, not only the first
            failed.append(name)
            print(f"docs/pictures.py: {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        print(f"{out / name} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
