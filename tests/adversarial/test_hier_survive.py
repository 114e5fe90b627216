"""The hierarchical partial handle goes on without a lost rank (``survive=True``).

4 real processes over loopback tcp, two "hosts" of two ranks each ({0, 1}, {2, 3}, made with
``ASYNCCOLL_HOST_ID``), ``connect(survive=True)`` as ``asynccoll run --max-failures`` gives it;
ranks SIGKILL themselves in the middle of solo calls: a non-leader (3), a leader (2, so rank 3
leads its host from then on), or a whole host (2 and 3). The survivors finish every call and
flush, without an error.

* **Exact accounting**: rank r contributes ``1000**r`` per call with ``Accumulate.SUM``, so the
  sum of every value a survivor was handed spells, digit group by digit group, how many
  contributions of each rank were counted: every survivor's own calls exactly once (rank 3's
  too when its leader died: the host's sums the leader held are contributed again by the new
  leader), a dead rank's no more than it made, the same counts on every survivor.
* **What results say**: ``lost`` names the killed ranks (the communicator's numbering) and
  ``world_size`` the ranks left, on every survivor, by the end; no result names a rank it
  reports lost among its contributors, and ``world_size`` is always 4 minus ``len(lost)``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import run_killed_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RANK = """
import asyncio, json, os, signal, sys, numpy as np
r = int(os.environ["ASYNCCOLL_RANK"])
os.environ["ASYNCCOLL_HOST_ID"] = f"host-{r // 2}"
import asynccoll

async def main():
    out, kill, mode = sys.argv[1], [int(k) for k in sys.argv[2].split(",")], sys.argv[3]
    comm = await asynccoll.connect(timeout=60, collective_timeout=20, survive=True)
    x = np.full(4, 1000.0 ** comm.rank)
    acc_kind = "latest" if mode == "latest" else "sum"
    if mode == "blocking":
        h = comm.blocking.hier_partial_allreduce(asynccoll.Solo(), x, accumulate=acc_kind)
    else:
        h = comm.hier_partial_allreduce(asynccoll.Solo(), x, accumulate=acc_kind)
    acc, calls, seen = np.zeros(4), 0, []
    async with comm:
        for step in range(60):
            if comm.rank in kill and step == 20:
                os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep(0.002 * (comm.rank + 1))
            if mode == "blocking":
                res = await asyncio.to_thread(h, x, 20)
            else:
                res = await h(x, timeout=20)
            calls += 1
            acc += res.value
            seen.append((sorted(res.lost), res.world_size, sorted(res.contributors)))
        f = await (asyncio.to_thread(h.flush, 20) if mode == "blocking" else h.flush(20))
        acc += f.value
        seen.append((sorted(f.lost), f.world_size, sorted(f.contributors)))
    with open(f"{out}/rank-{comm.rank}.json", "w") as fh:
        json.dump({"acc": acc.tolist(), "calls": calls, "seen": seen}, fh)

asyncio.run(main())
"""


def _counted(acc: list[float]) -> list[int]:
    """How many contributions of each rank a sum of ``1000**r`` contributions holds (one
    digit group per rank); every element of ``acc`` must hold the same sum."""
    assert len(set(acc)) == 1, acc
    return [int(acc[0]) // 1000 ** q % 1000 for q in range(4)]


def _check_reports(got: dict[int, dict], killed: set[int]) -> None:
    for o in got.values():
        lost, world, _ = o["seen"][-1]
        assert lost == sorted(killed), o["seen"][-1]
        assert world == 4 - len(killed)
        for lost, world, contributors in o["seen"]:
            assert world == 4 - len(lost)
            assert not set(lost) & set(contributors), (lost, contributors)
            assert set(lost) <= killed


def _check(got: dict[int, dict], killed: set[int]) -> None:
    _check_reports(got, killed)
    first = _counted(next(iter(got.values()))["acc"])
    calls = {q: o["calls"] for q, o in got.items()}
    assert {q: first[q] for q in got} == calls, (first, calls)  # each survivor's, once
    assert all(first[q] <= 20 for q in killed), first  # the dead: at most what it made
    for r, o in got.items():
        assert _counted(o["acc"]) == first, f"rank {r} disagrees on what was counted"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kill", "mode"), [("3", "await"), ("2", "await"), ("2,3", "await"),
                                            ("2", "blocking")],
                         ids=["non-leader", "leader", "whole-host", "leader-blocking"])
def test_the_survivors_go_on_with_exact_accounting(tmp_path: Path, kill: str,
                                                   mode: str) -> None:
    got = run_killed_job(tmp_path, RANK, 4, [str(tmp_path), kill, mode], kill, timeout=50)
    _check(got, {int(k) for k in kill.split(",")})


@pytest.mark.timeout(60)
def test_latest_goes_on_and_reports_the_loss(tmp_path: Path) -> None:
    # Accumulate.LATEST (the default): superseded results are dropped, so no accounting to
    # check; the survivors finish and every result reports the loss alike
    got = run_killed_job(tmp_path, RANK, 4, [str(tmp_path), "2", "latest"], "2", timeout=50)
    _check_reports(got, {2})
