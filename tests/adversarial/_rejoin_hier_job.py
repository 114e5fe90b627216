"""Exact accounting through a join in the hierarchical partial handle, for
tests/adversarial/test_rejoin_hier.py: 4 ranks on two fake hosts ({0, 1}, {2, 3}:
``ASYNCCOLL_HOST_ID`` set from the rank before asynccoll is imported, so a restarted process is
on its old host) under ``asynccoll run --max-failures N --max-restarts M``; a solo hierarchical
handle with sum accumulation where rank r contributes ``1000**r`` per call. Every 5 calls the
ranks flush and take back ready ranks (:func:`asynccoll.comm.joining.admit_ready`, the flat
handles' protocol); they stop at such a boundary once they made ``CALLS`` calls and took back
``RESTARTS`` ranks (agreed: the same boundary on every rank, the joiner's included).
``KILLS`` (``RANK@CALL,...``) says which ranks SIGKILL themselves at which call on their first
start; restarted, a rank joins the handle (:func:`~asynccoll.comm.joining.join_handle`) and
goes on at the members' call index. Each rank
prints the sum of every value it was handed (flush included), its calls, the ranks its results
reported lost, each call's round, the final flush's round and world, and the handle's hosts."""
import asyncio
import json
import os
import signal

RANK = int(os.environ["ASYNCCOLL_RANK"])
os.environ["ASYNCCOLL_HOST_ID"] = f"host-{RANK // 2}"

import numpy as np  # noqa: E402

import asynccoll  # noqa: E402
from asynccoll import Accumulate, Solo  # noqa: E402
from asynccoll.comm.joining import Joiners, admit_ready, join_handle  # noqa: E402

CALLS, RESTARTS = 50, int(os.environ.get("RESTARTS", "0"))


def done(i, admitted):
    """Whether the ranks stop at the flush boundary after call ``i`` (every rank alike)."""
    return (i + 1 >= CALLS and admitted >= RESTARTS) or i > 40 * CALLS


async def main():
    restarted = int(os.environ.get("ASYNCCOLL_RESTART", "0"))
    kills = {tuple(int(v) for v in k.split("@")) for k in os.environ["KILLS"].split(",")}
    comm = await asynccoll.connect(collective_timeout=30)
    x = np.full(4, 1000.0 ** RANK)
    h = comm.hier_partial_allreduce(Solo(), x, accumulate=Accumulate.SUM, name="hier-count")
    watch = Joiners(comm.job, h.name)
    acc, lost, rounds = np.zeros(4), set(), []
    i, admitted, stop = 0, 0, False
    if restarted or comm.joined:  # taken back (in) at the members' boundary i: it stops
        meta = await join_handle(h, comm)  # there if they do
        # the ranks taken back with it too (new ranks of a job that grew come together)
        i, admitted = int(meta["i"]), int(meta["admitted"]) + h.world_size - int(meta["size"])
        stop = done(i, admitted)
        i += 1
    while not stop:
        if not restarted and (RANK, i) in kills:
            os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(0.02 * (1 + RANK % 2))
        res = await h(x)
        acc += res.value
        lost |= set(res.lost)
        rounds.append(res.round)
        if i % 5 == 4:  # a flush boundary: ready ranks are taken back
            f = await h.flush()
            acc += f.value
            lost |= set(f.lost)
            admitted += len(await admit_ready(h, watch, meta={"i": i, "admitted": admitted,
                                                              "size": h.world_size}))
            stop = done(i, admitted)
        i += 1
    f = await h.flush()
    acc += f.value
    print("COUNT " + json.dumps({"rank": RANK, "restarted": restarted, "calls": len(rounds),
                                 "acc": acc.tolist(), "size": f.world_size,
                                 "seen_lost": sorted(lost), "lost": sorted(f.lost),
                                 "rounds": rounds, "last": f.round, "hosts": h.hosts}),
          flush=True)
    await comm.close()

asyncio.run(main())
