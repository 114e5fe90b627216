"""What losing a rank costs: the survivors' agreement (``shrink``) and a partial collective's
recovery, and what ``survive=True`` costs while nobody is lost.

Cases, P ranks over loopback tcp in real processes, the last rank SIGKILLed mid-run:

* ``shrink``: a synchronous allreduce loop; the time from the ``PeerLostError`` to a working
  communicator of the survivors (``comm.shrink()``), per survivor;
* ``recover``: a solo partial allreduce loop (``survive=True``, 4 KiB, 2 ms of compute per
  step); the longest call on each survivor (the one the loss interrupts: detection, agreement,
  settling and rebuilding) against the median call;
* ``overhead``: the median solo call at 1 MiB with ``survive`` False and True, no loss.

No peer offers either: torch.distributed and Gloo stop at a lost rank, MPI without ULFM too;
the rows are asynccoll's alone. Writes the BENCH.md JSON and a bar plot.

    python bench/survival.py [--quick] [--P 4,8] [--repeat 3] [--out F.json] [--plot F.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _harness import SECRET, bar_plot, free_port, stats, write_json

ROOT = str(Path(__file__).resolve().parents[1])

RANK = """
import asyncio, json, os, signal, sys, time, numpy as np, asynccoll

async def main():
    case, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    survive = case != "overhead-off"
    comm = await asynccoll.connect(timeout=60, collective_timeout=60, survive=survive)
    P, victim = comm.size, comm.size - 1
    res = {}
    async with comm:
        if case == "shrink":
            x = np.ones(1024, np.float32)
            try:
                for step in range(10_000):
                    if comm.rank == victim and step == steps:
                        os.kill(os.getpid(), signal.SIGKILL)
                    await comm.allreduce(x)
            except asynccoll.PeerLostError:
                t0 = time.perf_counter()
                g = await comm.shrink()
                await g.barrier()
                res["shrink_s"] = time.perf_counter() - t0
                await g.close()
        else:
            n = (1 << 20) // 4 if case.startswith("overhead") else 1024
            x = np.ones(n, np.float32)
            h = comm.partial_allreduce("solo", like=x)
            calls = []
            for step in range(2 * steps):
                if case == "recover" and comm.rank == victim and step == steps:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.002)  # compute
                t0 = time.perf_counter()
                await h(x)
                calls.append(time.perf_counter() - t0)
            await h.flush()
            res["calls"] = calls
    with open(f"{out}/rank-{comm.rank}.json", "w") as f:
        json.dump(res, f)

asyncio.run(main())
"""


def run_job(case: str, P: int, steps: int) -> list[dict[str, Any]]:
    """One job of P processes; the survivors' reports (the victim is killed in 'shrink' and
    'recover')."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK)
        port = free_port()
        procs = []
        try:
            for r in range(P):
                env = {**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_RANK": str(r),
                       "ASYNCCOLL_WORLD_SIZE": str(P), "ASYNCCOLL_STORE": f"127.0.0.1:{port}",
                       "ASYNCCOLL_TRANSPORT": "tcp", "ASYNCCOLL_SECRET": SECRET,
                       "OMP_NUM_THREADS": "1"}
                procs.append(subprocess.Popen([sys.executable, str(script), case, tmp,
                                               str(steps)], env=env,
                                              stderr=subprocess.PIPE))
            errs = [p.communicate(timeout=120)[1].decode() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        killed = case in ("shrink", "recover")
        out = []
        for r in range(P - 1 if killed else P):
            if procs[r].returncode != 0:
                raise RuntimeError(f"{case} P={P} rank {r} failed:\n{errs[r][-3000:]}")
            out.append(json.loads((Path(tmp) / f"rank-{r}.json").read_text()))
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--P", default="4,8")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="bench/results/survival.json")
    ap.add_argument("--plot", default="bench/results/survival.png")
    a = ap.parse_args()
    Ps = [int(p) for p in a.P.split(",")]
    repeat, steps = (1, 10) if a.quick else (a.repeat, 40)
    rows: list[dict[str, Any]] = []
    for P in Ps:
        shrink_ms, worst_ms, median_ms = [], [], []
        for _ in range(repeat):
            shrink_ms += [1e3 * o["shrink_s"] for o in run_job("shrink", P, steps)]
            for o in run_job("recover", P, steps):
                c = np.asarray(o["calls"]) * 1e3
                worst_ms.append(float(c.max()))
                median_ms.append(float(np.median(c)))
        rows.append({"impl": "asynccoll", "case": "shrink", "P": P,
                     **stats("ms", shrink_ms)})
        rows.append({"impl": "asynccoll", "case": "recover (longest call)", "P": P,
                     **stats("ms", worst_ms)})
        rows.append({"impl": "asynccoll", "case": "recover (median call)", "P": P,
                     **stats("ms", median_ms)})
        for case in ("overhead-off", "overhead-on"):
            med = [float(np.median(o["calls"][2:])) * 1e3 for _ in range(repeat)
                   for o in run_job(case, P, steps)]
            rows.append({"impl": "asynccoll", "case": f"1 MiB solo call, survive="
                         f"{case.endswith('on')}", "P": P, **stats("ms", med)})
        for r in rows[-5:]:
            print(f"P={P:2d} {r['case']:<34} {r['ms_median']:8.2f} ms "
                  f"[{r['ms_min']:.2f}, {r['ms_max']:.2f}]", flush=True)
    write_json(a.out, "survival", {"P": Ps, "repeat": repeat, "steps": steps}, rows)
    bar_plot(rows, "ms", [f"P={r['P']}\n{r['case']}" for r in rows], a.plot,
             ylabel="ms (median, min-max)", title="Losing a rank: agreement and recovery")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    start = time.time()
    main()
    print(f"{time.time() - start:.0f} s", file=sys.stderr)
