"""The rendezvous: every rank in one process (fast), and real processes via ``asynccoll run``."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _helpers import free_low_port as free_port

from asynccoll import AuthenticationError
from asynccoll.buffers import dtype_to_wire
from asynccoll.launch import (
    JobSpec,
    RendezvousError,
    RendezvousTimeoutError,
    StoreServer,
    rendezvous,
    resolve,
)
from asynccoll.transport.base import Transport
from asynccoll.transport.frames import PROTOCOL_VERSION, Format, Header, Kind

SECRET = b"k" * 32
HERE = Path(__file__).parent
HAS_UCX = importlib.util.find_spec("ucxx") is not None


def specs(world: int, port: int, **kw: object) -> list[JobSpec]:
    return [resolve(r, world, ("127.0.0.1", port), environ={}, secret=SECRET, **kw)  # type: ignore[arg-type]
            for r in range(world)]


async def ring(ts: Sequence[Transport]) -> None:
    p = len(ts)
    outs = [np.full(1000, r, np.float32) for r in range(p)]
    ins = [np.empty(1000, np.float32) for _ in range(p)]
    futs: list[asyncio.Future[Any]] = []
    for r, t in enumerate(ts):
        h = Header(PROTOCOL_VERSION, int(Kind.DATA), 1, 0, 0, r, dtype_to_wire(outs[r].dtype),
                   outs[r].shape, int(Format.DENSE), outs[r].nbytes)
        futs.append(t.post_recv((r - 1) % p, 1, 0, 0, ins[r]))
        futs.append(t.post_send((r + 1) % p, h, outs[r]))
    await asyncio.wait_for(asyncio.gather(*futs), 10.0)
    for r in range(p):
        assert (ins[r] == (r - 1) % p).all()


@pytest.mark.timeout(30)
async def test_in_process_rendezvous_over_tcp_with_rank0_hosting_the_store() -> None:
    ss = specs(3, free_port())
    assert ss[0].host_store
    assert not ss[1].host_store
    ts = await asyncio.wait_for(
        asyncio.gather(*(rendezvous(s, timeout=15.0, generation=0) for s in ss)), 20.0)
    try:
        assert [t.scheme for t in ts] == ["tcp"] * 3
        assert all(t.address.startswith("tcp://127.0.0.1:") for t in ts)
        await ring(ts)
    finally:
        for t in ts:
            await t.close()
    # the store hosted by rank 0 has stopped
    assert ss[0].store is not None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", ss[0].store[1]), timeout=1.0).close()


@pytest.mark.timeout(30)
async def test_a_job_can_rendezvous_again_after_closing() -> None:
    # each call counts as the next generation of its rank at this store
    port = free_port()
    async with StoreServer("127.0.0.1", port, SECRET):  # a launcher's store outlives both
        ss = specs(2, port, host_store=False)
        for _ in range(2):
            ts = await asyncio.wait_for(
                asyncio.gather(*(rendezvous(s, timeout=10.0) for s in ss)), 15.0)
            try:
                await ring(ts)
            finally:
                for t in ts:
                    await t.close()


@pytest.mark.timeout(30)
async def test_in_process_rendezvous_over_inproc() -> None:
    ss = specs(3, free_port(), transport="inproc")
    ts = await asyncio.wait_for(
        asyncio.gather(*(rendezvous(s, timeout=15.0, generation=0) for s in ss)), 20.0)
    try:
        assert [t.scheme for t in ts] == ["inproc"] * 3
        await ring(ts)
    finally:
        for t in ts:
            await t.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
async def test_world_of_one_needs_no_store(transport: str) -> None:
    t = await rendezvous(resolve(0, 1, environ={}, secret=SECRET), transport=transport,
                         timeout=5.0)
    try:
        assert t.world_size == 1
        assert t.scheme == transport
    finally:
        await t.close()


@pytest.mark.timeout(30)
async def test_missing_rank_times_out_naming_it() -> None:
    ss = specs(3, free_port())
    with pytest.raises(RendezvousTimeoutError) as info:
        await asyncio.wait_for(asyncio.gather(rendezvous(ss[0], timeout=1.5, generation=0),
                                              rendezvous(ss[1], timeout=1.5, generation=0)), 10.0)
    assert info.value.missing == [2]
    assert "[2]" in str(info.value)


@pytest.mark.timeout(30)
async def test_duplicate_rank_and_world_mismatch_are_refused() -> None:
    port = free_port()
    async with StoreServer("127.0.0.1", port, SECRET) as server:
        a = resolve(1, 3, ("127.0.0.1", server.port), environ={}, secret=SECRET)
        b = resolve(2, 4, ("127.0.0.1", server.port), environ={}, secret=SECRET)
        # generation=0: as if from separate processes (one process counts its calls)
        first = asyncio.create_task(rendezvous(a, timeout=5.0, generation=0))
        await asyncio.sleep(0.3)
        with pytest.raises(RendezvousError, match="claimed by 2"):
            await rendezvous(a, timeout=5.0, generation=0)
        with pytest.raises(RendezvousError, match="world size 4"):
            await rendezvous(b, timeout=5.0, generation=0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first


@pytest.mark.timeout(30)
async def test_a_world_mismatch_fails_the_waiting_ranks_at_once() -> None:
    """Rank 1 waits for its peers; rank 2 arrives with another world size. Both fail within a
    second, naming the sizes as numbers, not at rank 1's 20 s timeout."""
    port = free_port()
    async with StoreServer("127.0.0.1", port, SECRET) as server:
        a = resolve(1, 3, ("127.0.0.1", server.port), environ={}, secret=SECRET)
        b = resolve(2, 4, ("127.0.0.1", server.port), environ={}, secret=SECRET)
        first = asyncio.create_task(rendezvous(a, timeout=20.0, generation=0))
        await asyncio.sleep(0.3)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(RendezvousError, match=r"world size 4 but the job's first rank has 3$"):
            await rendezvous(b, timeout=20.0, generation=0)
        with pytest.raises(RendezvousError, match="aborted: rank 2 has world size 4"):
            await first
        assert asyncio.get_running_loop().time() - t0 < 2.0


@pytest.mark.timeout(30)
async def test_rank0_reports_a_store_address_it_cannot_bind() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spec = resolve(0, 2, ("127.0.0.1", taken.getsockname()[1]), environ={}, secret=SECRET)
        with pytest.raises(RendezvousError, match="ASYNCCOLL_STORE"):
            await rendezvous(spec, timeout=5.0, generation=0)


@pytest.mark.timeout(30)
async def test_wrong_secret_fails_authentication() -> None:
    port = free_port()
    async with StoreServer("127.0.0.1", port, SECRET):
        bad = resolve(1, 2, ("127.0.0.1", port), environ={}, secret=b"w" * 32)
        with pytest.raises(AuthenticationError):
            await rendezvous(bad, timeout=5.0)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    p = subprocess.Popen([sys.executable, "-m", "asynccoll.cli", "run", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(HERE.parents[1])})
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", [
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(not HAS_UCX, reason="ucxx is not installed")),
])
def test_asynccoll_run_exchange(transport: str) -> None:
    res = _run(["-n", "3", "--transport", transport, str(HERE / "_exchange.py")], timeout=80)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in range(3):
        assert f"[{r}] rank {r} of 3 ok over {transport}" in res.stdout, res.stdout + res.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_inproc_across_processes_fails_at_once_naming_the_other_ranks(tmp_path: Path) -> None:
    """transport='inproc' connects the ranks of one process only: two processes that try are
    told so at once, not after the 60 s rendezvous timeout."""
    code = ("import asyncio, asynccoll\n"
            "async def main():\n"
            "    try:\n"
            "        await asynccoll.connect(transport='inproc', timeout=60)\n"
            "    except asynccoll.RendezvousError as exc:\n"
            "        print('refused:', exc)\n"
            "asyncio.run(main())\n")
    port = free_port()
    root = str(Path(__file__).parents[2])
    procs = [subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**os.environ, "PYTHONPATH": root, "ASYNCCOLL_RANK": str(r),
                        "ASYNCCOLL_WORLD_SIZE": "2", "ASYNCCOLL_STORE": f"127.0.0.1:{port}",
                        "ASYNCCOLL_SECRET": "a-test-secret-long-enough"}) for r in range(2)]
    try:
        outs = [p.communicate(timeout=30)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "refused: rank 0: transport 'inproc' connects ranks of one process only, and " \
        "ranks [1] run in other processes" in outs[0], outs[0]
    # rank 1 sees the same, or that rank 0 (which ran the store) gave up: at once either way
    assert "run in other processes" in outs[1] or "lost the connection to the store" in outs[1], \
        outs[1]
