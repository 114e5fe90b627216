"""A program that ends without closing its communicator exits cleanly.

Its progress thread used to be left running uvloop while the interpreter tore down the modules
that loop uses: 4 of 10 three-rank jobs had a rank die of SIGSEGV at exit. The progress engine
now stops its thread at interpreter exit (``asynccoll.comm.progress``, module doc).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import free_port

ROOT = str(Path(__file__).parents[2])

RANK = '''
import asyncio
import numpy as np
import asynccoll


async def main():
    comm = await asynccoll.connect(timeout=60, collective_timeout=20)  # never closed
    x = np.ones(1 << 12, np.float32)
    a = comm.partial_allreduce("solo", like=x, name="A")
    comm.partial_allreduce("majority", like=x, name="B")  # never called
    if comm.rank == 0:
        await a(x)  # an execution the others answer from their progress threads
    await comm.allreduce(x, out=x)
    await comm.barrier()


asyncio.run(main())
print("ended", flush=True)
'''


@pytest.mark.timeout(120)
def test_ending_without_close_exits_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    P = 3
    for job in range(5):  # the crash came in about 4 jobs of 10
        port = free_port()
        procs = [subprocess.Popen(
            [sys.executable, str(script)],
            env={**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_RANK": str(r),
                 "ASYNCCOLL_WORLD_SIZE": str(P), "ASYNCCOLL_STORE": f"127.0.0.1:{port}",
                 "ASYNCCOLL_TRANSPORT": "tcp", "ASYNCCOLL_SECRET": "exit-without-close-secret"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(P)]
        try:
            outs = [p.communicate(timeout=60) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
            assert p.returncode == 0, (job, r, p.returncode, err.decode(errors="replace")[-800:])
            assert out.decode().strip().endswith("ended"), (job, r, out)
