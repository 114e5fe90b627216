"""The deadline kind's pure parts: the adaptation function, the arguments, the encoding of
arrivals, late calls and expired deadlines in the meta vector, and the schedule."""

from __future__ import annotations

import numpy as np
import pytest

from asynccoll.collectives import KERNELS
from asynccoll.collectives.partial import (
    ARRIVAL_MOD,
    ARRIVED,
    COUNT,
    DEFAULT_DEADLINE,
    DSIG,
    EXPIRED,
    FRESH,
    LATE,
    LATE_BASE,
    STATE_LEN,
    DeadlineConfig,
    arrival_spread,
    arrival_stamp,
    build_partial_allreduce,
    check_deadline,
    check_kind,
    deadline_signature,
    decode_arrivals,
    decode_expired,
    decode_late,
    encode_stamp,
    first_stamp,
    initiators,
    late_offset,
    meta_len,
    next_deadline,
    packs_meta,
    signature_sum,
)
from asynccoll.inspect.kinds import build


def test_next_deadline_is_median_plus_m_mads_within_bounds() -> None:
    spreads = [0.010, 0.030, 0.020, 0.012, 0.500]
    med = float(np.median(spreads))
    mad = float(np.median(np.abs(np.array(spreads) - med)))
    assert next_deadline(spreads, 2.0, 0.0, 10.0) == pytest.approx(med + 2 * mad)
    assert next_deadline(spreads, 0.0, 0.0, 10.0) == pytest.approx(med)
    assert next_deadline(spreads, 2.0, 0.1, 10.0) == 0.1  # lo
    assert next_deadline(spreads, 100.0, 0.0, 0.2) == 0.2  # hi
    assert next_deadline([], 3.0, 0.01, 0.7) == 0.7  # no history: the most patient
    with pytest.raises(ValueError, match="m must"):
        next_deadline(spreads, -1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="lo"):
        next_deadline(spreads, 1.0, 0.5, 0.1)
    # a pure function: the same spreads give the same deadline, bit for bit
    assert next_deadline(list(spreads), 2.0, 0.0, 10.0) == next_deadline(spreads, 2.0, 0.0, 10.0)


def test_next_deadline_adapts_up_and_down_over_a_window() -> None:
    window: list[float] = []
    ds = []
    for s in [0.002] * 8 + [0.3] * 8 + [0.002] * 8:
        window = [*window, s][-8:]
        ds.append(next_deadline(window, 3.0, 0.01, 1.0))
    assert ds[7] == 0.01  # tight arrivals: down to lo
    assert ds[15] == pytest.approx(0.3)  # spread out: up to the spread
    assert max(ds[8:16]) <= 1.0
    assert ds[23] == 0.01  # tight again: back down


def test_check_deadline_defaults_and_fixed_deadline() -> None:
    c = check_deadline("deadline", None, None, None)
    assert c is not None
    assert (c.lo, c.hi) == DEFAULT_DEADLINE
    assert c.m > 0
    assert c.window >= 1
    assert check_deadline("deadline", 0.25, 0, 4) == DeadlineConfig(0.25, 0.25, 0.0, 4)
    assert check_deadline("deadline", (0.0, 1), 1.5, 2) == DeadlineConfig(0.0, 1.0, 1.5, 2)
    assert check_deadline("quorum", None, None, None) is None


@pytest.mark.parametrize(("args", "name"), [
    (((0.5, 0.1), None, None), "deadline"),
    (((-0.1, 0.1), None, None), "deadline"),
    (((0.1, float("inf")), None, None), "deadline"),
    (((0.1, 0.2, 0.3), None, None), "deadline"),
    (("1s", None, None), "deadline"),
    ((None, -1.0, None), "mad_factor"),
    ((None, float("nan"), None), "mad_factor"),
    ((None, None, 0), "deadline_window"),
    ((None, None, 2.5), "deadline_window"),
])
def test_check_deadline_names_the_bad_argument(args: tuple[object, ...], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        check_deadline("deadline", *args)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["deadline", "mad_factor", "deadline_window"])
def test_deadline_arguments_only_for_the_deadline_kind(name: str) -> None:
    args: dict[str, object] = {"deadline": None, "mad_factor": None, "deadline_window": None}
    args[name] = 1
    with pytest.raises(ValueError, match=name):
        check_deadline("quorum", *args.values())  # type: ignore[arg-type]


def test_check_kind_deadline_quorum() -> None:
    assert check_kind("deadline", 5, None) == 5  # default: every rank
    assert check_kind("deadline", 5, 3) == 3
    for k in (0, 6, -1):
        with pytest.raises(ValueError, match="quorum"):
            check_kind("deadline", 5, k)
    with pytest.raises(ValueError, match="quorum"):
        check_kind("deadline", 5, 2.5)  # type: ignore[arg-type]
    assert initiators("deadline", 3, 4) == frozenset(range(4))


def test_stamp_encoding_round_trips_exactly_in_float32() -> None:
    P = 5
    t = 1234.5
    first = arrival_stamp(t)
    stamps = np.zeros(P, np.int64)
    stamps[0] = encode_stamp(True, first, False, 0)
    stamps[1] = encode_stamp(True, arrival_stamp(t + 0.003), True, 0)  # its deadline expired
    stamps[2] = encode_stamp(False, 0, False, late_offset(arrival_stamp(t + 0.25), first))
    stamps[3] = encode_stamp(False, 0, False, 0)
    stamps[4] = encode_stamp(False, 0, False, late_offset(arrival_stamp(t + 8.0), first))
    assert stamps.max() < 2 ** 25
    # carried in float32 data (as packed meta) the values survive the sum exactly
    assert packs_meta(np.float32, "sum", P)
    summed = np.zeros(P, np.float32)
    for r in range(P):
        one = np.zeros(P, np.int64)
        one[r] = stamps[r]
        summed += one.astype(np.float32)
    back = np.rint(summed).astype(np.int64)
    assert back.tolist() == stamps.tolist()
    arr = decode_arrivals(back)
    assert set(arr) == {0, 1}
    assert arr[1] == pytest.approx(0.003, abs=2e-6)
    assert decode_expired(back) == frozenset({1})
    late = decode_late(back)
    assert set(late) == {2, 4}
    assert late[2] == pytest.approx(0.25, abs=3e-6)
    assert late[4] == pytest.approx(8.0, abs=3e-6)
    # wrap-around of the microsecond clock
    assert late_offset(5, ARRIVAL_MOD - 5) == 5 + 1
    assert encode_stamp(False, 0, False, late_offset(ARRIVAL_MOD, 1)) <= LATE_BASE + ARRIVAL_MOD


def test_arrival_spread_is_the_kth_known_arrival() -> None:
    P = 4
    meta = np.zeros(meta_len(P), np.int64)
    s = meta[2 * P + 2:3 * P + 2]
    base = arrival_stamp(50.0)
    s[0] = encode_stamp(True, base, False, 0)
    s[1] = encode_stamp(True, arrival_stamp(50.010), True, 0)
    s[3] = encode_stamp(False, 0, False, late_offset(arrival_stamp(50.300), base))
    assert arrival_spread(meta, P, 1) == 0.0
    assert arrival_spread(meta, P, 2) == pytest.approx(0.010, abs=2e-6)
    assert arrival_spread(meta, P, 3) == pytest.approx(0.300, abs=3e-6)
    assert arrival_spread(meta, P, 4) == pytest.approx(0.300, abs=3e-6)  # fewer known: last
    assert arrival_spread(np.zeros(meta_len(P), np.int64), P, 2) is None
    assert first_stamp(s) == base
    s[0] = 0
    assert first_stamp(s) == arrival_stamp(50.010)  # the expired bit is not part of it
    assert first_stamp(np.zeros(P, np.int64)) == 0


def test_snapshot_writes_expired_late_and_the_deadline_signature() -> None:
    P = 3
    meta = np.zeros(meta_len(P), np.int64)
    state = np.zeros(STATE_LEN, np.int64)
    params = {"rank": 1, "world_size": P, "op": "sum", "sig": 9, "count": 2, "packed": False}
    acc, data = np.ones(2), np.zeros(2)
    dsig = deadline_signature(DeadlineConfig(0.01, 1.0, 3.0, 16))
    assert 0 < dsig < 1 << 16
    state[DSIG] = dsig
    state[COUNT], state[FRESH], state[ARRIVED], state[EXPIRED] = 1, 1, 77, 1
    state[LATE] = 5  # a fresh call wins the slot; the late report is dropped
    KERNELS["partial_snapshot"](None, [acc, data, meta, state], params, [])
    assert signature_sum(meta, P) == 9 ^ dsig  # one rank's: its own signature
    assert max(meta[2 * P], meta[3 * P + 2]) < 256  # a byte per slot
    assert meta[2 * P + 2 + 1] == 77 + ARRIVAL_MOD
    assert (state[EXPIRED], state[LATE], state[FRESH]) == (0, 0, 0)
    assert state[DSIG] == dsig  # not per execution
    state[LATE] = 5
    KERNELS["partial_snapshot"](None, [acc, data, meta, state], params, [])
    assert meta[2 * P + 2 + 1] == LATE_BASE + 10
    assert decode_late(meta[2 * P + 2:3 * P + 2]) == {1: pytest.approx(8e-6)}


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
def test_schedule_is_the_quorums(P: int) -> None:
    for k in {1, (P + 1) // 2, P}:
        for rank in range(P):
            d = build_partial_allreduce(rank, P, 6, np.float32, kind="deadline", quorum=k)
            q = build_partial_allreduce(rank, P, 6, np.float32, kind="quorum", quorum=k)
            assert [(o.kind, o.peer, o.tag, o.k, o.deps) for o in d.ops] == \
                [(o.kind, o.peer, o.tag, o.k, o.deps) for o in q.ops]
            assert d.meta["partial"]["quorum"] == k
    s = build_partial_allreduce(0, P, 6, np.float32, kind="deadline")
    assert s.meta["partial"]["quorum"] == P  # default: every rank
    with pytest.raises(ValueError, match="quorum"):
        build_partial_allreduce(0, P, 6, np.float32, kind="deadline", quorum=P + 1)


def test_inspect_knows_the_kind() -> None:
    s = build("deadline", 0, 4, 64)
    assert any(op.label == "quorum 3 of 4" for op in s.ops)
