"""A rank of a test job: rendezvous, then a ring exchange and an all-to-all of arrays.

Run under ``asynccoll run`` (or any launcher that sets the rank variables). Exits 0 and prints
``rank R of P ok over SCHEME`` when every array arrived intact; any failure raises.
Argument: the number of float64 elements per message (default 100000).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import numpy as np

from asynccoll.buffers import dtype_to_wire
from asynccoll.launch import StoreClient, rendezvous, resolve
from asynccoll.transport.frames import PROTOCOL_VERSION, Format, Header, Kind


def header(src: int, tag: int, a: np.ndarray) -> Header:
    return Header(PROTOCOL_VERSION, int(Kind.DATA), 7, 0, tag, src, dtype_to_wire(a.dtype),
                  a.shape, int(Format.DENSE), a.nbytes)


async def main(n: int) -> None:
    spec = resolve()
    t = await asyncio.wait_for(rendezvous(spec, timeout=40.0), 45.0)
    r, p = spec.rank, spec.world_size
    try:
        mine = np.arange(n, dtype=np.float64) + 1000.0 * r
        # ring: send to r+1, receive from r-1
        got = np.empty(n, np.float64)
        rf = t.post_recv((r - 1) % p, 7, 0, 1, got)
        sf = t.post_send((r + 1) % p, header(r, 1, mine), mine)
        await asyncio.wait_for(asyncio.gather(rf, sf), 20.0)
        np.testing.assert_array_equal(got, np.arange(n) + 1000.0 * ((r - 1) % p))
        # all-to-all: every pair, both directions at once
        outs = {q: np.full(n, r * 100 + q, np.int32) for q in range(p) if q != r}
        ins = {q: np.empty(n, np.int32) for q in range(p) if q != r}
        futs: list[asyncio.Future[Any]] = [t.post_recv(q, 7, 0, 2, ins[q]) for q in ins]
        futs += [t.post_send(q, header(r, 2, a), a) for q, a in outs.items()]
        await asyncio.wait_for(asyncio.gather(*futs), 20.0)
        for q, a in ins.items():
            assert (a == q * 100 + r).all(), f"rank {r}: bad data from rank {q}"
        print(f"rank {r} of {p} ok over {t.scheme} at {t.address}", flush=True)
        # Close only once every rank has received everything: a transport's send completes
        # when its buffer may be reused, not when the peer has the bytes. The launcher's store
        # outlives the rendezvous, so it serves as the barrier.
        assert spec.store is not None
        async with await StoreClient.connect(*spec.store, spec.secret, timeout=20.0) as store:
            if await store.add("test/done", 1) == p:
                await store.set("test/all", b"1")
            await store.wait(["test/all"], 20.0)
    finally:
        await t.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000))
