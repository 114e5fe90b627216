"""A collective defined differently on some ranks: the error names the ranks that differ."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asynccoll import ExecutionError
from asynccoll.collectives.agreement import disagreement, odd_ranks
from asynccoll.testing import local_world


def test_odd_ranks_are_those_outside_the_largest_group() -> None:
    assert odd_ranks([5, 5, 5, 5]) == []
    assert odd_ranks([5, 5, 7, 5]) == [2]
    assert odd_ranks([7, 5, 5, 5]) == [0]
    assert odd_ranks([5, 6, 7, 5]) == [1, 2]
    assert odd_ranks([5, 7]) == [1]  # a tie: the side of the lower rank is the reference


def test_the_message_names_the_rank_and_this_ranks_definition() -> None:
    msg = disagreement(0, "allreduce", [5, 5, 7, 5], {"kind": "allreduce", "count": 8,
                                                      "slot": "data"})
    assert "rank 2 differs from the others" in msg, msg
    assert "the allreduce" in msg, msg  # not "a allreduce"
    assert "count=8" in msg, msg
    assert "slot" not in msg, msg
    assert "as ranks [0, 1, 3] do" in msg, msg


@pytest.mark.timeout(60)
async def test_a_shape_that_differs_on_one_rank_is_named_on_every_rank() -> None:
    async with local_world(4, timeout=20) as comms:
        async def call(r: int) -> BaseException | None:
            x = np.ones(12 if r == 2 else 8, np.float32)
            try:
                await comms[r].allreduce(x)
            except ExecutionError as exc:
                return exc
            return None

        outs = await asyncio.wait_for(asyncio.gather(*(call(r) for r in range(4))), 40)
    for r, o in enumerate(outs):
        assert isinstance(o, ExecutionError), (r, o)
        assert "rank 2 differs from the others" in str(o), (r, o)
