"""The route's pure decisions (asynccoll.comm.route): the environment switches read once, and
how a member sends its stripe of a joiner's state (a shared-memory ring or the connection)."""

from __future__ import annotations

import pytest

from asynccoll.comm.route import NETWORK, RING_MIN, SHM, Switches, state_route

HERE, ELSEWHERE = 11, 12


def test_switches_from_the_environment() -> None:
    assert Switches.from_env({}) == Switches(shm=True, cma=True, ring_min=RING_MIN)
    got = Switches.from_env({"ASYNCCOLL_SHM": "0", "ASYNCCOLL_CMA": " 0 ",
                             "ASYNCCOLL_JOIN_RING_MIN": "1048576"})
    assert got == Switches(shm=False, cma=False, ring_min=1 << 20)
    assert Switches.from_env({"ASYNCCOLL_JOIN_RING_MIN": " "}).ring_min == RING_MIN


@pytest.mark.parametrize("text", ["-1", "1MiB", "1e6"])
def test_a_bad_ring_threshold_is_refused_naming_the_variable(text: str) -> None:
    with pytest.raises(ValueError, match="ASYNCCOLL_JOIN_RING_MIN"):
        Switches.from_env({"ASYNCCOLL_JOIN_RING_MIN": text})


def test_a_large_stripe_to_a_joiner_on_this_host_that_asked_takes_the_ring() -> None:
    on = Switches()
    assert state_route(on, HERE, HERE, RING_MIN, True) == SHM
    assert state_route(on, HERE, HERE, 8 * RING_MIN, True) == SHM


@pytest.mark.parametrize(("switches", "joiner", "nbytes", "asked"), [
    (Switches(), HERE, RING_MIN - 1, True),  # too small: the ring's set-up costs more
    (Switches(), ELSEWHERE, RING_MIN, True),  # another host
    (Switches(), HERE, RING_MIN, False),  # the joiner asked for none (its ASYNCCOLL_SHM=0)
    (Switches(shm=False), HERE, RING_MIN, True),  # this member's ASYNCCOLL_SHM=0
    (Switches(ring_min=0), HERE, 0, True),  # an empty stripe has nothing to put in a ring
])
def test_otherwise_the_stripe_goes_over_the_connection(switches: Switches, joiner: int,
                                                       nbytes: int, asked: bool) -> None:
    assert state_route(switches, HERE, joiner, nbytes, asked) == NETWORK


def test_the_threshold_is_the_switches_own() -> None:
    low = Switches(ring_min=1 << 20)
    assert state_route(low, HERE, HERE, 1 << 20, True) == SHM
    assert state_route(low, HERE, HERE, (1 << 20) - 1, True) == NETWORK
