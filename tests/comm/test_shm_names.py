"""Segment names (asynccoll.comm.shm): a public job tag, then a part nobody without the job's
token can compute; the cleanup by tag; a rank's SIGTERM handler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asynccoll.comm import shm

ROOT = str(Path(__file__).parents[2])


def test_a_name_is_the_tag_then_a_keyed_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm, "_ENV_TAG", "")
    a, b = shm.segment_path(5, 1, 0, 0), shm.segment_path(6, 1, 0, 0)
    tag = shm.job_tag(5)
    assert os.path.basename(a).startswith(shm.job_prefix(tag))
    assert tag != shm.job_tag(6)
    assert a == shm.segment_path(5, 1, 0, 0)  # every rank derives the same
    # Every other (schedule, rank, part) differs, and nothing of the inputs shows.
    names = {shm.segment_path(5, s, r, p) for s in range(4) for r in range(3)
             for p in (None, 0, 1)}
    assert len(names) == 36
    tail = os.path.basename(a)[len(shm.job_prefix(tag)):]
    assert len(tail) == 24
    assert "-" not in tail
    assert tail != os.path.basename(b)[-24:]
    monkeypatch.setattr(shm, "_ENV_TAG", "abc_1")  # the launcher's tag wins
    assert os.path.basename(shm.segment_path(5, 1, 0, 0)).startswith(
        f"asynccoll-{os.getuid()}-abc_1-")
    monkeypatch.setattr(shm, "_ENV_TAG", "a-b")
    with pytest.raises(ValueError, match="ASYNCCOLL_JOB_TAG"):
        shm.segment_path(5, 1, 0, 0)


def test_unlink_job_removes_that_job_only(tmp_path: Path) -> None:
    mine = [tmp_path / f"{shm.job_prefix('t1')}{i:024x}" for i in range(3)]
    others = [tmp_path / f"{shm.job_prefix('t10')}{0:024x}", tmp_path / "unrelated"]
    for p in (*mine, *others):
        p.write_bytes(b"x" * 5000)
    (tmp_path / f"{shm.job_prefix('t1')}dir").mkdir()  # not a segment: left alone
    files, held = shm.unlink_job("t1", str(tmp_path))
    assert files == 3
    assert held >= 3 * 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(p.name for p in others), f"{shm.job_prefix('t1')}dir"])
    assert shm.unlink_job("t1", str(tmp_path / "absent")) == (0, 0)


CHILD = r"""
import os, signal, sys, time
from asynccoll.comm import shm
if sys.argv[1] == "own":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
print(shm.install_cleanup(), flush=True)
seg = shm.Segment.create(shm.segment_path(1, 2, 0, 0), 1 << 20)
seg.array("u1", 1 << 20)[:] = 1
if sys.argv[1] == "fork":  # a forked child inherits the handler, not the segments
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(w, b"1")  # (a signal before the child's runtime is set up would be lost)
        time.sleep(60)
        os._exit(0)
    os.read(r, 1)
    os.kill(child, signal.SIGTERM)
    os.waitpid(child, 0)
    assert os.path.exists(seg.path)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("disposition", ["default", "own", "fork"])
def test_sigterm_unlinks_own_segments(tmp_path: Path, disposition: str) -> None:
    # With the default disposition the handler unlinks, then the process dies of SIGTERM as
    # before; an application's own handler is left alone (and its segments to the launcher).
    env = {**os.environ, "PYTHONPATH": ROOT, "ASYNCCOLL_SHM_DIR": str(tmp_path)}
    p = subprocess.Popen([sys.executable, "-c", CHILD, disposition], env=env,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        installed = p.stdout.readline().strip()
        assert p.stdout.readline().strip() == "ready"
        assert len(os.listdir(tmp_path)) == 1
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=30)
    finally:
        p.kill()
        p.wait()
    if disposition != "own":
        assert (installed, code, os.listdir(tmp_path)) == ("True", -signal.SIGTERM, [])
    else:
        assert (installed, code, len(os.listdir(tmp_path))) == ("False", 7, 1)
