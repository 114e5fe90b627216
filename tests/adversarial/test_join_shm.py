"""A joiner's state on its host (asynccoll.comm.state_send: read in place out of the members'
memory; asynccoll.comm.state_ring: through rings in shared memory), with real processes.

Four ranks under ``asynccoll run --max-failures 1 --max-restarts N`` with a private segment
directory (``ASYNCCOLL_SHM_DIR``: a fresh directory on the same tmpfs as ``/dev/shm``, so that
what is left can be counted exactly). Rank 2 SIGKILLs itself, the launcher restarts it and it
joins a bare partial handle with 48 MiB of state (``_join_shm_job.py``): every donor is on its
host, so by default the joiner reads each one's stripe straight out of its memory (the first
test), and with ``ASYNCCOLL_CMA=0`` (the others, but the refused read's) each hands its
stripe over through a ring in shared memory. Asserted: the launcher
exits 0, the joiner says its state came from all three members through shared memory, every
rank ends with the same world size and the same state bytes, and nothing is left in the
segment directory, each donor's ring gone when it closed it (not only once the launcher
unlinked the job's files at its end). Then the restarted process SIGKILLs itself mid-transfer
(before it maps the first ring, with the donors' segments made; or after copying the first
chunk out; or after reading the first unit out of a member), the members go on without it
(they say so), its next restart joins, and still nothing is left. Members that cannot make a
segment (a full tmpfs) send over the network, each saying so in one warning; a joiner whose
reads are refused (as under Yama), or whose members name another process to read in (its
marker is not there), says so once and takes the members' rings.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("_join_shm_job.py")
ROOT = str(Path(__file__).parents[2])

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _run(restarts: int, cma: bool = False, **extra: str) -> tuple[int, str, list[str]]:
    extra.setdefault("ASYNCCOLL_CMA", "1" if cma else "0")
    with tempfile.TemporaryDirectory(prefix="join-shm-test-", dir="/dev/shm") as shm_dir:
        env = dict(os.environ, PYTHONPATH=ROOT, ASYNCCOLL_SHM_DIR=shm_dir, VICTIM="2",
                   ASYNCCOLL_SHM="1", **extra)
        p = subprocess.run([sys.executable, "-m", "asynccoll.cli", "run", "-n", "4",
                            "--max-failures", "1", "--max-restarts", str(restarts), str(JOB)],
                           capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
        return p.returncode, p.stdout + p.stderr, os.listdir(shm_dir)


def _finals(out: str) -> dict[int, dict[str, int | str]]:
    rows = [json.loads(ln.split("FINAL ", 1)[1]) for ln in out.splitlines() if "FINAL {" in ln]
    return {r["rank"]: r for r in rows}


def _joined_through_shm(out: str, shm: str = "0, 1, 3", tcp: str = "", read: str = ""
                        ) -> list[str]:
    return re.findall(rf"rank 2: joined partial allreduce 'state'.*from ranks \[{shm}\] "
                      rf"through shared memory, from \[{tcp}\] over the network; read in "
                      rf"place from \[{read}\]\)", out)


def _ends_equal(out: str, left: list[str], restarts: int | None = 1) -> None:
    """Every rank ended in the world of 4 with the same state bytes (rank 2 after ``restarts``
    restarts; None: not asserted), and nothing is left in the segment directory."""
    finals = _finals(out)
    assert sorted(finals) == [0, 1, 2, 3], out[-3000:]
    if restarts is not None:
        assert finals[2]["restarted"] == restarts, finals
    assert {r["size"] for r in finals.values()} == {4}, finals
    assert len({r["digest"] for r in finals.values()}) == 1, finals  # equal to the bit
    assert left == [], left


@pytest.mark.timeout(170)
def test_a_restarted_rank_reads_its_state_out_of_the_members_memory() -> None:
    code, out, left = _run(1, cma=True)
    assert code == 0, out[-4000:]
    assert _joined_through_shm(out, read="0, 1, 3"), out[-4000:]
    assert "RING rank=" not in out, out[-4000:]  # no ring made
    _ends_equal(out, left)


@pytest.mark.timeout(170)
def test_a_joiner_whose_reads_are_refused_says_so_once_and_takes_the_rings() -> None:
    code, out, left = _run(1, cma=True, NO_READ="1")
    assert code == 0, out[-4000:]
    assert _joined_through_shm(out), out[-4000:]  # every donor through its ring instead
    assert len(re.findall(r"rank 2: cannot read the state out of rank \d's memory \(\[Errno 1\] "
                          r"reading process \d+: Operation not permitted\)", out)) == 1, \
        out[-4000:]
    assert re.findall(r"RING rank=\d gone=(\w+)", out) == ["True"] * 3, out[-4000:]
    _ends_equal(out, left, None)


@pytest.mark.timeout(170)
def test_a_member_that_names_another_process_is_not_read_and_sends_through_its_ring() -> None:
    code, out, left = _run(1, cma=True, WRONG_PID="1")
    assert code == 0, out[-4000:]
    assert _joined_through_shm(out), out[-4000:]  # through the rings, nothing read in place
    assert len(re.findall(r"rank 2: cannot read the state out of rank \d's memory \(", out)) \
        == 1, out[-4000:]
    _ends_equal(out, left)


@pytest.mark.timeout(170)
def test_a_restarted_rank_receives_its_state_through_shared_memory_and_leaves_nothing() -> None:
    code, out, left = _run(1)
    assert code == 0, out[-4000:]
    assert _joined_through_shm(out), out[-4000:]
    assert re.findall(r"RING rank=\d gone=(\w+)", out) == ["True"] * 3, out[-4000:]
    _ends_equal(out, left)


@pytest.mark.timeout(170)
@pytest.mark.parametrize("where", ["attach", "chunk", "read"])
def test_a_joiner_killed_mid_transfer_leaves_nothing_and_the_members_go_on(where: str) -> None:
    read = where == "read"
    code, out, left = _run(2, cma=read, DIE_IN="1", DIE_AT=where)
    assert code == 0, out[-4000:]
    assert re.search(r"rank\(s\) \[2\] lost while joining partial allreduce 'state'", out), \
        out[-4000:]
    # the second restart joined
    assert _joined_through_shm(out, read="0, 1, 3" if read else ""), out[-4000:]
    closes = re.findall(r"RING rank=\d gone=(\w+)", out)
    if read:
        assert closes == [], closes  # no ring made
    else:
        assert len(closes) >= 4, out[-4000:]  # a ring at the failed admission at least, 3 after
        assert set(closes) == {"True"}, closes  # unlinked by the donor, not by the job's end
    _ends_equal(out, left, 2)


@pytest.mark.timeout(170)
def test_members_that_cannot_make_a_segment_send_over_the_network_and_say_so_once() -> None:
    code, out, left = _run(1, NO_ROOM="1")
    assert code == 0, out[-4000:]
    assert _joined_through_shm(out, shm="", tcp="0, 1, 3"), out[-4000:]
    warned = re.findall(r"\[(\d)\].*goes over the network: no shared-memory segment", out)
    assert sorted(warned) == ["0", "1", "3"], out[-4000:]  # one line per member process
    _ends_equal(out, left, None)
