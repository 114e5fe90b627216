"""The hierarchical partial handle after a lost rank: every rank of every host raises.

4 real processes over loopback tcp, two "hosts" of two ranks each ({0, 1}, {2, 3}, made with
``ASYNCCOLL_HOST_ID``); one rank SIGKILLs itself in the middle of solo calls. Before, the host
that lost nobody went on among itself and returned sums without the other host, with
``lost=[]``, for as long as 30 s. Now every survivor's call raises
:class:`~asynccoll.PeerLostError` naming the killed rank (in the communicator's numbering)
within 2 s, whether the killed rank was a leader or not, and no call returns after that.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import run_killed_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RANK = """
import asyncio, json, os, signal, sys, time, numpy as np
r = int(os.environ["ASYNCCOLL_RANK"])
os.environ["ASYNCCOLL_HOST_ID"] = f"host-{r // 2}"
import asynccoll

async def main():
    out, victim, blocking = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "blocking"
    comm = await asynccoll.connect(timeout=30)
    h = comm.hier_partial_allreduce(asynccoll.Solo(), np.zeros(8), accumulate="sum")
    results, error, t_err, calls_after = [], None, None, 0
    async with comm:
        for step in range(400):
            if comm.rank == victim and step == 20:
                with open(f"{out}/killed", "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep(0.002)
            try:
                if blocking:
                    res = await asyncio.to_thread(h.blocking, np.full(8, 1.0), 10)
                else:
                    res = await h(np.full(8, 1.0), timeout=10)
            except asynccoll.PeerLostError as exc:
                if error is None:
                    error, t_err = (exc.rank, str(exc)), time.time()
                else:
                    calls_after += 1
                if calls_after >= 3:
                    break
                continue
            except Exception as exc:
                error, t_err = ("other", repr(exc)), time.time()
                break
            if error is not None:
                calls_after = -1000  # a result after the error: must not happen
                break
            results.append((time.time(), sorted(res.contributors), res.world_size,
                            sorted(res.lost)))
    with open(f"{out}/rank-{comm.rank}.json", "w") as f:
        json.dump({"results": results, "error": error, "t_err": t_err,
                   "calls_after": calls_after}, f)

asyncio.run(main())
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("victim", "mode"), [(3, "await"), (2, "await"), (0, "blocking")])
def test_every_rank_of_every_host_raises_naming_the_lost_rank(
        tmp_path: Path, victim: int, mode: str) -> None:
    # a non-leader, the other host's leader, and the first host's leader (blocking twin)
    out = run_killed_job(tmp_path, RANK, 4, [str(tmp_path), str(victim), mode], str(victim))
    killed = float((tmp_path / "killed").read_text())
    for r, rep in out.items():
        assert rep["error"] is not None, f"rank {r} never raised"
        assert rep["error"][0] == victim, f"rank {r}: {rep['error']}"
        assert rep["t_err"] - killed < 2.0, f"rank {r} raised {rep['t_err'] - killed:.2f} s late"
        assert rep["calls_after"] == 3, f"rank {r}: a later call did not raise: {rep}"
        assert len(rep["results"]) >= 10  # the handle worked before the loss
        for t, _contributors, world, lost in rep["results"]:
            assert world == 4
            assert lost == []
            # after the kill no result comes that was made in the world before it, but for
            # the time the loss takes to be learned
            assert t - killed < 0.5, f"rank {r}: a result {t - killed:.2f} s after the kill"
