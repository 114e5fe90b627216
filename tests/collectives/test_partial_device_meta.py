"""The partial snapshot writes the meta vector, which lives on the host, into the work buffer,
which lives on the device for CuPy data. CuPy refuses ``device[...] = host_array`` ("non-scalar
numpy.ndarray cannot be used for fill"): the first GPU run (an H200, 2026-11-29) failed every
partial call of a CUDA tensor there. A stand-in module named ``cupy``, whose arrays refuse host
arrays as CuPy's do, checks the fix on a machine without a GPU; ``make gpu-check`` checks it
with CuPy itself.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest

from asynccoll.buffers import host_to_like, is_cupy
from asynccoll.collectives.partial import PARTIAL_KERNELS, STATE_LEN, meta_len, packs_meta


class _DeviceArray(np.ndarray):  # type: ignore[type-arg]
    """A host array that takes no host array in an assignment, as a CuPy array."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if type(value) is np.ndarray and value.ndim:
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        super().__setitem__(key, value)


_DeviceArray.__module__ = "cupy._core.core"


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("cupy")
    mod.asarray = lambda a: np.array(a).view(_DeviceArray)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", mod)


def test_host_to_like_moves_a_host_array_to_the_device_and_leaves_host_data_alone(
        fake_cupy: None) -> None:
    dev = np.zeros(4, np.float32).view(_DeviceArray)
    host = np.arange(3, dtype=np.int64)
    assert is_cupy(dev)
    moved = host_to_like(host, dev)
    assert is_cupy(moved)
    assert moved.tolist() == [0, 1, 2]
    assert host_to_like(host, np.zeros(4)) is host  # NumPy data: no copy


@pytest.mark.parametrize("P", [2, 5])
def test_the_snapshot_packs_the_host_meta_into_a_device_work_buffer(fake_cupy: None,
                                                                     P: int) -> None:
    n = 6
    assert packs_meta(np.float32, "sum", P)
    m = meta_len(P)
    acc = np.full(n, 3.0, np.float32).view(_DeviceArray)
    data = np.zeros(n + m, np.float32).view(_DeviceArray)
    meta = np.zeros(m, np.int64)
    state = np.zeros(STATE_LEN, np.int64)
    state[0] = 2  # COUNT: two calls in this snapshot
    params = {"count": n, "op": "sum", "packed": True, "rank": 1, "world_size": P, "sig": 7}
    PARTIAL_KERNELS["partial_snapshot"](None, [acc, data, meta, state], params, [])
    assert data[:n].tolist() == [3.0] * n  # the send buffer moved into the work buffer
    assert acc.tolist() == [0.0] * n  # and reset to the sum's identity
    assert data[n:].tolist() == meta.astype(np.float32).tolist()  # the meta rides behind
    assert meta[1] == 2  # this rank's count, in its slot
