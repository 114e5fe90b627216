"""The partial-allreduce schedule builder: initiator sets, validation, identities, structure."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from asynccoll.collectives.partial import (
    ARRIVAL_MOD,
    ARRIVED,
    COUNT,
    FRESH,
    PLANNED,
    SNAPSHOTS,
    STATE_LEN,
    arrival_stamp,
    build_partial_allreduce,
    check_kind,
    decode_arrivals,
    identity,
    initiators,
    meta_len,
    packs_meta,
)
from asynccoll.collectives.partial import PARTIAL_KERNELS as KERNELS
from asynccoll.sched import Schedule


@pytest.mark.parametrize("P", [1, 2, 3, 7, 16])
def test_initiator_sets(P: int) -> None:
    for e in range(200):
        assert initiators("solo", e, P) == frozenset(range(P))
        assert initiators("quorum", e, P) == frozenset(range(P))
        (m,) = initiators("majority", e, P, seed=5)
        assert 0 <= m < P
        two = initiators("two_choice", e, P, seed=5)
        assert len(two) == min(2, P)
        assert all(0 <= r < P for r in two)
        # a pure function: the same on every rank, every time
        assert initiators("two_choice", e, P, seed=5) == two


def test_majority_draw_is_uniform_and_seeded() -> None:
    P, n = 8, 4000
    counts = collections.Counter(next(iter(initiators("majority", e, P, seed=1)))
                                 for e in range(n))
    assert set(counts) == set(range(P))
    assert max(counts.values()) - min(counts.values()) < 0.25 * n / P
    a = [initiators("majority", e, P, seed=1) for e in range(50)]
    b = [initiators("majority", e, P, seed=2) for e in range(50)]
    assert a != b


def test_two_choice_pairs_are_uniform() -> None:
    P, n = 5, 6000
    counts = collections.Counter(initiators("two_choice", e, P, seed=3) for e in range(n))
    assert len(counts) == P * (P - 1) // 2
    expect = n / len(counts)
    assert all(abs(c - expect) < 0.25 * expect for c in counts.values())


def test_check_kind_errors() -> None:
    assert check_kind("solo", 4, None) is None
    assert check_kind("quorum", 4, 3) == 3
    with pytest.raises(ValueError, match="kind"):
        check_kind("bogus", 4, None)
    for bad in (0, 5, -1, None, 2.5, True):
        with pytest.raises(ValueError, match="quorum"):
            check_kind("quorum", 4, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="quorum"):
        check_kind("solo", 4, 2)


def test_identity() -> None:
    assert identity("sum", "float32") == 0
    assert identity("prod", "int32") == 1
    assert identity("min", "float64") == np.inf
    assert identity("max", "float64") == -np.inf
    assert identity("min", "int8") == 127
    assert identity("max", "uint16") == 0
    assert identity("sum", "bool") is False
    assert identity("prod", "bool") is True
    with pytest.raises(ValueError, match="op"):
        identity("mean", "float32")


@pytest.mark.parametrize(("kind", "quorum"), [("solo", None), ("majority", None),
                                         ("two_choice", None), ("quorum", 2)])
@pytest.mark.parametrize("P", [1, 3, 4])
def test_schedule_structure(kind: str, quorum: int | None, P: int) -> None:
    for r in range(P):
        q = None if quorum is None else min(quorum, P)
        s = build_partial_allreduce(r, P, 10, "float32", kind=kind, quorum=q)
        assert s.committed
        starts = [i for i, op in enumerate(s.ops) if not op.deps and op.kind != "recv"]
        assert len(starts) == 1  # the internal start is the only start source
        # the final op must not depend on the start: external activation completes without it
        anc: set[int] = set()
        stack = [s.final]
        while stack:
            i = stack.pop()
            assert i is not None
            for d in s.ops[i].deps:
                if d not in anc:
                    anc.add(d)
                    stack.append(d)
        snap = next(i for i, op in enumerate(s.ops) if op.kind == "compute"
                    and op.kernel == "partial_snapshot")
        assert snap in anc
        activated = s.ops[snap].deps[0]
        assert s.ops[activated].k == 1
        if kind == "quorum":
            kop = next(op for op in s.ops if op.label.startswith("quorum"))
            assert kop.k == q
            assert len(kop.deps) == P
        assert Schedule.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(("kind", "quorum"), [("solo", None), ("majority", None), ("quorum", 3)])
def test_final_reachable_without_internal_start(kind: str, quorum: int | None) -> None:
    # Fire everything that can fire when the internal start never does and every receive
    # arrives: the final op must complete (external activation needs no call on this rank).
    s = build_partial_allreduce(1, 4, 8, "float64", kind=kind, quorum=quorum)
    start = next(i for i, op in enumerate(s.ops) if op.label == "internal start")
    done = {i for i, op in enumerate(s.ops) if not op.deps and i != start}
    changed = True
    while changed:
        changed = False
        for i, op in enumerate(s.ops):
            if i not in done and i != start and op.deps \
                    and sum(d in done for d in op.deps) >= op.k:
                done.add(i)
                changed = True
    assert s.final in done
    # and the arrival sends (quorum) are not needed by it
    arrivals = {i for i, op in enumerate(s.ops) if op.label == "arrival out"}
    assert not arrivals & done


def test_snapshot_kernel() -> None:
    acc = np.array([1.0, 2.0, 3.0])
    data = np.zeros(3)
    meta = np.zeros(meta_len(3), np.int64)
    state = np.zeros(STATE_LEN, np.int64)
    state[COUNT], state[FRESH], state[ARRIVED], state[PLANNED] = 2, 1, 77, 1
    KERNELS["partial_snapshot"](None, [acc, data, meta, state],
                                {"rank": 1, "world_size": 3, "op": "max", "sig": 0x1209, "count": 3,
                                 "packed": False}, [])
    assert data.tolist() == [1.0, 2.0, 3.0]
    assert (acc == -np.inf).all()
    # counts, fresh flags, the signature's low byte, flushing, stamps (rank 1's arrival), the
    # signature's high byte and the planned flushes
    assert meta.tolist() == [0, 2, 0, 0, 1, 0, 0x09, 0, 0, 77, 0, 0x12, 1]
    assert state[COUNT] == 0
    assert state[FRESH] == 0
    assert state[SNAPSHOTS] == 1
    assert state[PLANNED] == 1  # (until this rank's flush begins)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="op"):
        build_partial_allreduce(0, 2, 4, "float32", op="avg")
    with pytest.raises(ValueError, match="algorithm"):
        build_partial_allreduce(0, 2, 4, "float32", algorithm="tree")
    with pytest.raises(ValueError, match="quorum"):
        build_partial_allreduce(0, 2, 4, "float32", kind="quorum", quorum=3)


def test_packed_snapshot_and_choice() -> None:
    assert packs_meta("float32", "sum", 16)
    assert packs_meta("int64", "sum", 1000)
    assert packs_meta("float32", "sum", 1024)  # the signature's bytes sum to P * 255 at most
    assert packs_meta("float32", "sum", 1 << 16)
    assert not packs_meta("float32", "sum", (1 << 16) + 1)  # P * 255 would exceed 2**24
    assert not packs_meta("float64", "max", 4)
    assert not packs_meta("int16", "sum", 4)
    s = build_partial_allreduce(0, 4, 5, "float32")
    assert s.slots["data"].count == 5 + meta_len(4)
    assert not any(name.startswith("meta_") for name in s.slots)
    s = build_partial_allreduce(0, 4, 5, "float32", op="max")
    assert s.slots["data"].count == 5
    acc = np.array([1.0, 2.0], np.float32)
    data = np.zeros(2 + meta_len(2), np.float32)
    meta = np.zeros(meta_len(2), np.int64)
    state = np.zeros(STATE_LEN, np.int64)
    state[COUNT] = 3
    KERNELS["partial_snapshot"](None, [acc, data, meta, state],
                                {"rank": 0, "world_size": 2, "op": "sum", "sig": 0x307, "count": 2,
                                 "packed": True}, [])
    # no call waiting: no arrival
    assert data.tolist() == [1.0, 2.0, 3, 0, 0, 0, 7, 0, 0, 0, 3, 0]
    assert acc.tolist() == [0.0, 0.0]


def test_arrivals_are_decoded_relative_to_the_first_and_across_the_wrap() -> None:
    t = 1_700_000_000.0
    stamps = np.zeros(4, np.int64)
    stamps[0] = arrival_stamp(t + 0.020)
    stamps[2] = arrival_stamp(t)
    stamps[3] = arrival_stamp(t + 0.0505)
    got = decode_arrivals(stamps)
    assert set(got) == {0, 2, 3}
    assert got[2] == 0.0
    assert abs(got[0] - 0.020) < 2e-6
    assert abs(got[3] - 0.0505) < 2e-6
    # a wrap of the microsecond counter between two arrivals does not reorder them
    wrap = np.array([ARRIVAL_MOD - 5, 0, 10], np.int64)  # stamps 5 us before and 10 us after
    assert decode_arrivals(wrap) == {0: 0.0, 2: 15e-6}
    assert decode_arrivals(np.zeros(3, np.int64)) == {}
