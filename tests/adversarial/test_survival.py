"""Partial collectives that survive a lost rank (``Communicator.survive``).

SIGKILL one (or two) of 4 ranks in the middle of partial allreduces: the survivors agree on who
is lost, rebuild their schedules for the smaller world and go on, without an error.

* **Exact accounting**: rank r contributes ``1000**r`` per call, so the sum of every result a
  survivor received (``accumulate="sum"``) spells, digit group by digit group, how many
  contributions of each rank were counted: every survivor's own calls exactly once, the dead
  rank's no more than it made, and the same counts on every survivor.
* **Training**: eager-SGD with solo, majority and quorum, and backup workers, keep training on
  3 ranks after rank 3 dies; with ``accumulate=True`` (and no parameter averaging at the end)
  the survivors' replicas are equal to the bit, and training converges.

Real processes over loopback tcp, started without the launcher.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import run_killed_job

ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RANK = """
import asyncio, json, os, signal, sys, time, numpy as np, asynccoll
sys.path.insert(0, sys.argv[4])
from _train_problem import Problem

async def handle(comm, kind, kill, out):
    x = np.full(4, 1000.0 ** comm.rank)
    h = comm.partial_allreduce(asynccoll.Quorum(2) if kind == "quorum" else kind, like=x,
                               accumulate="sum")
    acc = np.zeros(4)
    calls, lost, sizes = 0, set(), set()
    for step in range(24):
        if comm.rank in kill and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(0.002 * (comm.rank + 1))
        r = await h(x)
        calls += 1
        acc += r.value
        lost |= set(r.lost)
        sizes.add(r.world_size)
    f = await h.flush()
    acc += f.value
    lost |= set(f.lost)
    return {"acc": acc.tolist(), "calls": calls, "lost": sorted(lost),
            "final_size": f.world_size, "sizes": sorted(sizes)}

async def train(comm, kind, kill, out):
    prob = Problem(3)
    if kind == "backup":
        opt = asynccoll.train.BackupSGD(comm, prob.w0.copy(), 0.05, backups=1)
    else:
        opt = asynccoll.train.EagerSGD(comm, prob.w0.copy(), 0.05,
                                       asynccoll.Quorum(2) if kind == "quorum" else kind,
                                       accumulate=True)
    for step in range(40):
        if comm.rank in kill and step == 6:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(0.002 * (comm.rank + 1))
        await opt.step(prob.grad(comm.rank, opt.params))
    await opt.finish(average=False)
    return {"w": opt.params.tolist(), "excess": prob.excess(opt.params),
            "size": opt.world_size}

async def main():
    out, what, kill = sys.argv[1], sys.argv[2], [int(k) for k in sys.argv[3].split(",")]
    test, kind = what.split(":")
    comm = await asynccoll.connect(timeout=60, collective_timeout=30, survive=True)
    async with comm:
        res = await (handle if test == "handle" else train)(comm, kind, kill, out)
    with open(f"{out}/rank-{comm.rank}.json", "w") as f:
        json.dump(res, f)

asyncio.run(main())
"""


def _run(tmp_path: Path, what: str, kill: str, P: int = 4) -> dict[int, Any]:
    return run_killed_job(tmp_path, RANK, P,
                          [str(tmp_path), what, kill, str(Path(ROOT) / "tests" / "train")],
                          kill)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["solo", "majority", "quorum"])
@pytest.mark.parametrize("kill", ["3", "1,2"], ids=["one", "two"])
def test_contributions_are_counted_exactly_once(tmp_path: Path, kind: str, kill: str) -> None:
    got = _run(tmp_path, f"handle:{kind}", kill)
    killed = {int(k) for k in kill.split(",")}
    counts = None
    for r, o in got.items():
        acc = np.array(o["acc"])
        assert (acc == acc[0]).all()
        total = int(acc[0])
        n = [(total // 1000 ** q) % 1000 for q in range(4)]
        assert n[r] == o["calls"] + 0, (r, n, o)  # its own: each exactly once
        for q in got:
            assert n[q] == got[q]["calls"], (r, q, n)  # every survivor's, exactly once
        for q in killed:
            assert n[q] <= 5, (r, q, n)  # the dead: at most what it made
        counts = counts or n
        assert n == counts, "the survivors disagree on what was counted"
        assert o["lost"] == sorted(killed), o
        assert o["final_size"] == len(got)
        assert len(got) in o["sizes"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["solo", "majority", "quorum", "backup"])
def test_eager_sgd_trains_on_without_the_lost_rank(tmp_path: Path, kind: str) -> None:
    got = _run(tmp_path, f"train:{kind}", "3")
    ws = [np.array(o["w"]) for o in got.values()]
    for w in ws[1:]:  # replicas equal to the bit after a survived loss (JSON keeps float64)
        assert w.tobytes() == ws[0].tobytes()
    for o in got.values():
        assert o["size"] == 3
        assert o["excess"] < 0.2, o["excess"]
