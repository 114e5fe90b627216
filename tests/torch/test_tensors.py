"""Torch tensors through every Communicator collective (asynccoll.comm.tensors), in one process.

CPU tensors of every floating dtype torch has (float16, bfloat16, float32, float64) round-trip
through every collective and come back as tensors of their dtype; non-contiguous tensors are
refused with an error naming the argument (no silent copy); ``op="avg"``; the blocking facade;
torch is not imported by code that never passes a tensor; CUDA tensors where CUDA exists.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from asynccoll import Accumulate, Majority, Quorum, Solo  # noqa: E402
from asynccoll.testing import local_world  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
P = 3


def _x(rank: int, dtype: Any) -> Any:
    return (torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)).to(dtype)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_every_collective_takes_and_returns_tensors(dtype: Any) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    total = base * (P * (P + 1) // 2)
    async with local_world(P, timeout=20) as comms:
        xs = [_x(r, dtype) for r in range(P)]

        async def each(fn: Any) -> list[Any]:
            return list(await asyncio.gather(*(fn(c, x) for c, x in zip(comms, xs,
                                                                          strict=True))))

        for res in await each(lambda c, x: c.allreduce(x)):
            assert isinstance(res, torch.Tensor)
            assert res.dtype == dtype
            assert res.shape == (3, 4)
            assert torch.equal(res.float(), total)
        for res in await each(lambda c, x: c.allreduce(x, op="avg")):
            assert res.dtype == dtype
            torch.testing.assert_close(res.float(), total / P, rtol=1e-2, atol=0)
        for res in await each(lambda c, x: c.broadcast(x, root=1)):
            assert res.dtype == dtype
            assert torch.equal(res, xs[1])
        for res in await each(lambda c, x: c.allgather(x)):
            assert res.dtype == dtype
            assert res.shape == (P, 3, 4)
            for r in range(P):
                assert torch.equal(res[r], xs[r])
        for r, res in enumerate(await each(lambda c, x: c.reduce_scatter(x))):
            assert res.dtype == dtype
            assert torch.equal(res.float(), total.reshape(-1)[4 * r:4 * r + 4])
        for res in await each(lambda c, x: c.solo_allreduce(x)):
            assert isinstance(res.value, torch.Tensor)
            assert res.value.dtype == dtype
        hs = [c.partial_allreduce(Majority(), like=xs[0], op="avg", accumulate=Accumulate.SUM,
                                  name="avg") for c in comms]
        rs = await asyncio.gather(*(h(x) for h, x in zip(hs, xs, strict=True)))
        fs = await asyncio.gather(*(h.flush() for h in hs))
        for r, f in zip(rs, fs, strict=True):
            assert r.value.dtype == dtype
            assert f.value.dtype == dtype
            # every rank's one gradient was averaged once: in r or left for the flush
            got = (r.value.float() * (r.count > 0)) + f.value.float()
            if r.count == P:
                torch.testing.assert_close(got, total / P, rtol=1e-2, atol=0)
        # in place: out=x writes the sum into x itself (bfloat16: through a float32 copy)
        outs = await each(lambda c, x: c.allreduce(x, out=x))
        for x, o in zip(xs, outs, strict=True):
            assert o is x
            assert torch.equal(x.float(), total)


@pytest.mark.timeout(30)
async def test_cpu_tensors_share_memory_and_grad_tensors_are_read() -> None:
    async with local_world(2, timeout=10) as comms:
        xs = [torch.ones(5, requires_grad=True), torch.ones(5, requires_grad=True)]
        res = await asyncio.gather(*(c.allreduce(x) for c, x in zip(comms, xs, strict=True)))
        assert torch.equal(res[0], torch.full((5,), 2.0))
        assert not res[0].requires_grad
        # a float32 result is a tensor over the array the collective wrote: no copy out
        ys = [torch.zeros(4), torch.ones(4)]
        got = await asyncio.gather(*(c.allreduce(y, out=y) for c, y in zip(comms, ys,
                                                                            strict=True)))
        assert got[0] is ys[0]
        assert torch.equal(ys[0], torch.ones(4))  # written through the tensor's own memory


@pytest.mark.timeout(30)
async def test_non_contiguous_tensors_are_refused_naming_the_argument() -> None:
    async with local_world(2, timeout=10) as comms:
        t = torch.zeros(4, 4).t()
        with pytest.raises(ValueError, match=r"^x must be a contiguous tensor.*x\.contiguous"):
            await comms[0].allreduce(t)
        with pytest.raises(ValueError, match=r"^x must be a contiguous tensor"):
            await comms[0].broadcast(t)
        with pytest.raises(ValueError, match=r"^out must be a contiguous tensor"):
            await comms[0].allreduce(torch.zeros(4, 4), out=torch.zeros(4, 4).t())
        with pytest.raises(ValueError, match=r"^like must be a contiguous tensor"):
            comms[0].partial_allreduce(Solo(), like=t)
        h = comms[0].partial_allreduce(Solo(), like=torch.zeros(4, 4), name="nc")
        with pytest.raises(ValueError, match=r"^x must be a contiguous tensor"):
            await h(t)


@pytest.mark.timeout(30)
async def test_avg_is_refused_for_integers() -> None:
    async with local_world(2, timeout=10) as comms:
        with pytest.raises(ValueError, match="op='avg' needs floating-point"):
            await comms[0].allreduce(torch.ones(3, dtype=torch.int64), op="avg")
        with pytest.raises(ValueError, match="op='avg' needs floating-point"):
            comms[0].partial_allreduce(Solo(), like=np.zeros(3, np.int32), op="avg")


@pytest.mark.timeout(30)
async def test_partial_avg_divides_by_contributions() -> None:
    async with local_world(3, timeout=10) as comms:
        hs = [c.partial_allreduce(Quorum(2), like=torch.zeros(2), op="avg", name="q")
              for c in comms]
        # ranks 0 and 1 make the quorum; rank 2's gradient waits for the next round
        a, _ = await asyncio.gather(hs[0](torch.full((2,), 1.0)), hs[1](torch.full((2,), 3.0)))
        assert a.count == 2
        assert torch.equal(a.value, torch.full((2,), 2.0))  # (1 + 3) / 2, not / 3
        c = await hs[2](torch.full((2,), 9.0))
        assert not c.included
        fs = await asyncio.gather(*(h.flush() for h in hs))
        assert fs[0].count == 1
        assert torch.equal(fs[0].value, torch.full((2,), 9.0))


@pytest.mark.timeout(30)
def test_blocking_facade_takes_tensors() -> None:
    import threading

    results: dict[int, Any] = {}

    async def main() -> None:
        async with local_world(2, timeout=10) as comms:
            def run(r: int) -> None:
                b = comms[r].blocking
                results[r] = (b.allreduce(torch.ones(3) * (r + 1), op="avg"),
                              b.partial_allreduce(Quorum(2), like=torch.zeros(3),
                                                  name="b")(torch.ones(3)))
            ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
            for t in ts:
                t.start()
            await asyncio.to_thread(lambda: [t.join(20) for t in ts])
            await asyncio.gather(*(c.partial_allreduce(Solo(), like=np.zeros(1), name="x")
                                   .flush() for c in comms))

    asyncio.run(main())
    for r in range(2):
        avg, res = results[r]
        assert torch.equal(avg, torch.full((3,), 1.5))
        assert isinstance(res.value, torch.Tensor)
        assert torch.equal(res.value, torch.full((3,), 2.0))


@pytest.mark.timeout(60)
def test_torch_is_not_imported_for_arrays() -> None:
    code = ("import asyncio, sys, numpy as np\n"
            "from asynccoll.testing import local_world\n"
            "async def main():\n"
            "    async with local_world(2, timeout=10) as cs:\n"
            "        await asyncio.gather(*(c.allreduce(np.ones(3), op='avg') for c in cs))\n"
            "        await asyncio.gather(*(c.solo_allreduce(np.ones(3)) for c in cs))\n"
            "asyncio.run(main())\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available here")
async def test_cuda_tensors_go_through_dlpack() -> None:
    pytest.importorskip("cupy", reason="CUDA tensors travel as CuPy arrays: install cupy")
    async with local_world(2, timeout=20) as comms:
        xs = [torch.ones(8, device="cuda") * (r + 1) for r in range(2)]
        res = await asyncio.gather(*(c.allreduce(x, op="avg") for c, x in zip(comms, xs,
                                                                               strict=True)))
        for r in res:
            assert r.device.type == "cuda"
            assert torch.equal(r.cpu(), torch.full((8,), 1.5))
        ps = await asyncio.gather(*(c.quorum_allreduce(x, 2) for c, x in zip(comms, xs,
                                                                              strict=True)))
        assert ps[0].value.device.type == "cuda"
