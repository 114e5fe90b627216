"""The DDP communication hook on CUDA tensors (they travel as CuPy arrays): ``partial_hook
("sync")`` matches DDP's own reduction and a solo hook leaves every replica equal after
``finish``. Runs where CUDA and CuPy are (``make gpu-check``); skips elsewhere."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available here"),
    pytest.mark.multiprocess,
]
P = 2


@pytest.mark.timeout(240)
def test_partial_hook_on_cuda_tensors() -> None:
    pytest.importorskip("cupy", reason="CUDA tensors travel as CuPy arrays: install cupy")
    from _cuda_ranks import cuda_ddp_main
    from _helpers import free_port, spawn_world
    from _torch_ranks import sync_child

    out: list[dict[str, Any]] = spawn_world(sync_child, P, (cuda_ddp_main, free_port()), 200)
    for r, o in enumerate(out):
        assert o["sync_device"].startswith("cuda"), (r, o["sync_device"])
        np.testing.assert_allclose(o["sync"], o["default"], rtol=1e-12, atol=1e-12)
        assert o["sync"] == out[0]["sync"], r
        assert o["solo"] == out[0]["solo"], r  # replicas equal after finish
