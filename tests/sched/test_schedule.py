"""Schedules as data: building, validation on commit, and the dict/JSON round trip."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynccoll import BufRef, Executor, Op, Schedule, ScheduleError, SlotSpec
from asynccoll.testing import inproc_world

pytestmark = pytest.mark.timeout(60)

def _two_rank() -> Schedule:
    s = Schedule(0, 2, "t", {"x": 4, "tmp": SlotSpec(4, "float32")})
    a = s.send(1, "x", tag=3)
    b = s.recv(1, "tmp", tag=3)
    s.compute("sum", ["x", "tmp"], "x", deps=[a, b])
    return s


def test_builder_returns_ids_and_defaults_to_and() -> None:
    s = _two_rank()
    assert [op.kind for op in s.ops] == ["send", "recv", "compute"]
    assert s.ops[2].deps == (0, 1)
    assert s.ops[2].k == 2  # AND by default
    assert s.nop(deps=[0, 1], k=1) == 3
    assert s.ops[3].k == 1


def test_commit_adds_final_nop_over_sinks_and_freezes() -> None:
    s = Schedule(0, 1)
    a = s.nop()
    b = s.nop(deps=a)
    c = s.nop(deps=a)
    s.commit()
    assert s.final == 3
    final = s.ops[s.final]
    assert final.kind == "nop"
    assert final.deps == (b, c)
    assert final.k == 2
    assert s.committed
    assert s.commit() is s  # idempotent
    with pytest.raises(ScheduleError, match="committed"):
        s.nop()


def test_explicit_final_is_kept() -> None:
    s = Schedule(0, 1)
    a = s.nop()
    s.nop(deps=a)
    s.final = a
    s.commit()
    assert s.final == a
    assert len(s) == 2


def _bad(build: Any) -> str:
    """Build with ``build(s)``, commit, return the ScheduleError's message."""
    s = Schedule(0, 2, "bad", {"x": 4})
    build(s)
    with pytest.raises(ScheduleError) as info:
        s.commit()
    return str(info.value)


def test_cycle_names_an_op_on_it() -> None:
    def build(s: Schedule) -> None:
        s.nop()  # 0
        s.nop(deps=[2])  # 1
        s.nop(deps=[1])  # 2
        s.final = 0

    msg = _bad(build)
    assert "cycle" in msg
    assert ("op 1 " in msg or "op 2 " in msg)


def test_self_dependency_is_a_cycle() -> None:
    msg = _bad(lambda s: s.nop(deps=[0]))
    assert "op 0 " in msg
    assert "cycle" in msg


@pytest.mark.parametrize("peer", [-1, 2, 7])
def test_peer_out_of_range(peer: int) -> None:
    msg = _bad(lambda s: s.send(peer, "x"))
    assert msg.startswith("op 0 send(")
    assert f"peer {peer} outside 0..1" in msg


def test_undeclared_buffer() -> None:
    msg = _bad(lambda s: s.recv(1, "nope"))
    assert msg.startswith("op 0 recv(")
    assert "'nope' is not declared" in msg


def test_slice_past_declared_slot() -> None:
    msg = _bad(lambda s: s.send(1, BufRef("x", 2, 3)))
    assert msg.startswith("op 0 ")
    assert "runs past slot 'x'" in msg


def test_k_greater_than_n() -> None:
    def build(s: Schedule) -> None:
        a = s.nop()
        b = s.nop()
        s.nop(deps=[a, b], k=3)

    msg = _bad(build)
    assert msg.startswith("op 2 nop(")
    assert "k=3 outside 1..2" in msg


def test_negative_k() -> None:
    def build(s: Schedule) -> None:
        s.nop(deps=[s.nop()], k=-1)

    assert "op 1 " in _bad(build)


def test_k_without_deps() -> None:
    msg = _bad(lambda s: s.nop(k=1))
    assert msg.startswith("op 0 ")
    assert "no dependencies" in msg


def test_k_zero_with_deps_from_dict() -> None:
    # The builder reads k=0 as AND; a dict (e.g. a hand-written file) can still say k=0.
    s = Schedule(0, 1)
    s.nop()
    d = s.to_dict()
    d["ops"].append({"kind": "nop", "deps": [0], "k": 0})
    with pytest.raises(ScheduleError, match=r"op 1 nop\(\): threshold k=0 outside 1\.\.1"):
        Schedule.from_dict(d).commit()


def test_unknown_kernel() -> None:
    msg = _bad(lambda s: s.compute("no-such-kernel", ["x"], "x"))
    assert msg.startswith("op 0 compute(")
    assert "unknown kernel 'no-such-kernel'" in msg


def test_dependency_out_of_range_and_duplicates() -> None:
    assert "dependency 9 is not an op id" in _bad(lambda s: s.nop(deps=[9]))

    def dup(s: Schedule) -> None:
        a = s.nop()
        s.nop(deps=[a, a])

    assert "op 1 " in _bad(dup)
    assert "duplicate" in _bad(dup)


def test_payload_from_must_be_a_compute_dependency() -> None:
    def build(s: Schedule) -> None:
        c = s.compute("zero", [], "x")
        s.send(1, None, payload_from=c)  # not a dependency

    assert "op 1 send(" in _bad(build)


def test_unknown_message_kind() -> None:
    assert "op 0 " in _bad(lambda s: s.send(1, "x", msg="gossip"))


async def test_uncommitted_schedule_rejected_by_executor() -> None:
    s = Schedule(0, 1, "raw")
    s.nop()
    async with inproc_world(1) as ts:
        with pytest.raises(ScheduleError, match="'raw' must be committed"):
            Executor(s, ts[0], sched_id=1)


def test_bad_constructor_arguments_name_the_argument() -> None:
    with pytest.raises(ValueError, match="world_size"):
        Schedule(0, 0)
    with pytest.raises(ValueError, match="rank"):
        Schedule(2, 2)


def test_from_dict_rejects_foreign_dicts() -> None:
    with pytest.raises(ScheduleError, match="not a schedule"):
        Schedule.from_dict({"format": "other"})
    d = Schedule(0, 1).to_dict()
    d["ops"] = [{"kind": "nop", "colour": "red"}]
    with pytest.raises(ScheduleError, match="colour"):
        Schedule.from_dict(d)


def test_describe() -> None:
    s = _two_rank()
    assert s.ops[0].describe() == "send(peer=1, tag=3, buf=x)"
    assert s.ops[2].describe() == "compute(sum, in=x,tmp, out=x)"
    assert Op("recv", peer=0, buf=BufRef("x", 1, 2), msg="activation").describe() == \
        "recv(peer=0, tag=0, activation, buf=x[1:3])"


def _json_roundtrip(s: Schedule) -> Schedule:
    return Schedule.from_dict(json.loads(json.dumps(s.to_dict())))


def test_roundtrip_committed_and_uncommitted() -> None:
    s = _two_rank()
    s.meta["algorithm"] = {"name": "x", "steps": [1, 2]}
    u = _json_roundtrip(s)
    assert u == s
    assert not u.committed
    s.commit()
    c = _json_roundtrip(s)
    assert c == s
    assert c.committed
    assert c.final == s.final
    assert c.ops == s.ops
    assert c.slots == s.slots


_names = st.sampled_from(["send", "recv", "tmp0", "tmp1"])
_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**31), 2**31),
                          st.text(max_size=5), st.floats(allow_nan=False, allow_infinity=False))
#: keyword arguments of the op builders, which a params key must not shadow
_RESERVED = {"kind", "peer", "buf", "tag", "deps", "k", "msg", "label", "recvs", "inputs",
             "output", "kernel", "payload_from"}
_params = st.dictionaries(st.text(min_size=1, max_size=4).filter(lambda k: k not in _RESERVED),
                          st.one_of(_json_scalars, st.lists(_json_scalars, max_size=3)),
                          max_size=2)


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    """Valid random schedules of every op kind (sizes kept small)."""
    world = draw(st.integers(1, 8))
    rank = draw(st.integers(0, world - 1))
    s = Schedule(rank, world, draw(st.text(max_size=6)),
                 {"send": SlotSpec(16, "float32"), "recv": 16, "tmp0": None, "tmp1": None})
    n = draw(st.integers(1, 12))
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), unique=True, max_size=3)) if i else []
        k = draw(st.integers(1, len(deps))) if deps else 0
        ref = BufRef(draw(_names), draw(st.integers(0, 4)),
                     draw(st.one_of(st.none(), st.integers(0, 8))))
        kind = draw(st.sampled_from(["send", "recv", "compute", "nop"]))
        if kind in ("send", "recv"):
            getattr(s, kind)(draw(st.integers(0, world - 1)), ref, draw(st.integers(0, 99)),
                             deps=deps, k=k, msg=draw(st.sampled_from(["data", "activation"])),
                             label=draw(st.text(max_size=3)), **draw(_params))
        elif kind == "compute":
            s.compute(draw(st.sampled_from(["sum", "max", "copy", "zero"])), [ref], ref,
                      deps=deps, k=k, recvs=[j for j in deps if s.ops[j].kind == "recv"],
                      **draw(_params))
        else:
            s.nop(deps=deps, k=k)
    if draw(st.booleans()):
        s.meta["note"] = draw(st.text(max_size=8))
    if draw(st.booleans()):
        s.commit()
    return s


@settings(max_examples=60)
@given(schedules())
def test_roundtrip_random_schedules(s: Schedule) -> None:
    back = _json_roundtrip(s)
    assert back == s
    assert back.ops == s.ops
    assert back.to_dict() == s.to_dict()
    assert back.committed == s.committed
    if not back.committed:  # what commits one way commits the other, with the same final op
        s.commit()
        back.commit()
        assert back == s
