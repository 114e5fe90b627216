"""The route's pure decisions (asynccoll.comm.route): the environment switches read once, and
how a member sends its stripe of a joiner's state (read in place by the joiner, a shared-memory
ring, or the connection)."""

from __future__ import annotations

import pytest

from asynccoll.comm.route import NETWORK, READ, RING_MIN, SHM, Switches, state_route

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


def test_a_stripe_to_a_joiner_on_this_host_that_may_read_is_read_in_place_at_any_size() -> None:
    on = Switches()
    for nbytes in (1, RING_MIN - 1, 8 * RING_MIN):
        assert state_route(on, HERE, HERE, nbytes, True, read=True) == READ


@pytest.mark.parametrize(("switches", "joiner", "nbytes", "asked", "want"), [
    (Switches(cma=False), HERE, RING_MIN, True, SHM),  # this member's ASYNCCOLL_CMA=0: a ring
    (Switches(cma=False), HERE, 1 << 20, True, NETWORK),  # ... and under its threshold
    (Switches(), ELSEWHERE, RING_MIN, True, NETWORK),  # another host reads nothing here
    (Switches(), HERE, RING_MIN, False, NETWORK),  # the joiner asked for no shared memory
    (Switches(shm=False), HERE, RING_MIN, True, NETWORK),  # nor did this member
    (Switches(), HERE, 0, True, NETWORK),  # an empty stripe
])
def test_a_read_in_place_needs_both_sides_on_one_host(switches: Switches, joiner: int,
                                                      nbytes: int, asked: bool,
                                                      want: str) -> None:
    assert state_route(switches, HERE, joiner, nbytes, asked, read=True) == want
