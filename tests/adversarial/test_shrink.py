"""SIGKILL ranks of a synchronous allreduce: the survivors get ``PeerLostError``, agree on who
is lost with ``comm.shrink()`` (the same set on every survivor, also when two ranks die at
once, the agreement's first coordinator among them, or when a survivor comes to the agreement
late) and go on with a working communicator of the survivors.

Real processes over loopback tcp, started without the launcher (which would stop the job at
the first loss).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import run_killed_job

ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RANK = """
import asyncio, json, os, signal, sys, time, numpy as np, asynccoll

async def main():
    out, kill, slow = sys.argv[1], [int(k) for k in sys.argv[2].split(",")], int(sys.argv[3])
    comm = await asynccoll.connect(timeout=60, collective_timeout=30)
    res = {}
    async with comm:
        x = np.ones(1000, np.float64)
        try:
            for step in range(10_000):
                if comm.rank in kill and step == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                await comm.allreduce(x)
        except asynccoll.PeerLostError as exc:
            # a victim whose step-2 allreduce fails on the other victim's loss before it
            # reaches its own kill still dies as planned (the test's losses, not fewer)
            if comm.rank in kill:
                os.kill(os.getpid(), signal.SIGKILL)
            res["caught"] = exc.rank
        try:
            await comm.allreduce(x)
        except asynccoll.PeerLostError:
            res["still_raises"] = True
        if comm.rank == slow:
            await asyncio.sleep(1.5)  # a survivor that comes to the agreement late
        g = await comm.shrink()
        res["same_again"] = (await comm.shrink()) is g
        s = await g.allreduce(np.full(3, comm.rank + 1.0))
        h = g.partial_allreduce(asynccoll.Majority(), like=s, accumulate="sum")
        acc = (await h(s)).value + (await h.flush()).value
        res.update(size=g.size, rank=g.rank, sum=s.tolist(), members=list(g.members),
                   partial=acc.tolist())
        await g.close()
    with open(f"{out}/rank-{comm.rank}.json", "w") as f:
        json.dump(res, f)

asyncio.run(main())
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kill", ["2", "0,3"], ids=["one", "two-with-coordinator"])
def test_survivors_agree_and_shrink(tmp_path: Path, kill: str) -> None:
    P = 5
    got = run_killed_job(tmp_path, RANK, P, [str(tmp_path), kill, "1"], kill)
    killed = {int(k) for k in kill.split(",")}
    survivors = sorted(got)
    want_sum = float(sum(r + 1 for r in survivors))
    for r, o in got.items():
        assert o["caught"] in killed, (r, o)
        assert o["still_raises"], (r, o)
        assert o["same_again"], (r, o)
        assert o["members"] == survivors, (r, o)
        assert o["rank"] == survivors.index(r)
        assert o["size"] == len(survivors)
        assert o["sum"] == [want_sum] * 3
        # each survivor contributed its sum once: the partial allreduce conserves it
        assert o["partial"] == [want_sum * len(survivors)] * 3
