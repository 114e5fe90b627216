"""The built-in kernels and the kernel registry."""

from __future__ import annotations

import numpy as np
import pytest

from asynccoll import register_kernel
from asynccoll.sched import BUILTIN_KERNELS

KERNELS = BUILTIN_KERNELS


@pytest.mark.parametrize(("name", "expect"), [
    ("sum", [6, 9]), ("prod", [6, 24]), ("min", [1, 2]), ("max", [3, 4])])
def test_reductions_over_several_inputs(name: str, expect: list[int]) -> None:
    a, b, c = np.array([1, 2]), np.array([2, 3]), np.array([3, 4])
    out = np.zeros(2, np.int64)
    KERNELS[name](out, [a, b, c], {}, [])
    assert out.tolist() == expect
    out2 = np.zeros(2, np.int64)
    KERNELS["reduce"](out2, [a, b, c], {"op": name}, [])
    assert out2.tolist() == expect


def test_one_input_accumulates_into_out() -> None:
    out = np.array([1.0, 2.0])
    KERNELS["sum"](out, [np.array([10.0, 10.0])], {}, [])
    assert out.tolist() == [11.0, 12.0]


def test_output_may_alias_an_input() -> None:
    x = np.array([1, 2], np.int32)
    KERNELS["sum"](x, [x, np.array([5, 5], np.int32)], {}, [])
    assert x.tolist() == [6, 7]


def test_bool_reductions_are_logical() -> None:
    a, b = np.array([True, False, False]), np.array([True, True, False])
    out = np.zeros(3, bool)
    KERNELS["sum"](out, [a, b], {}, [])
    assert out.tolist() == [True, True, False]
    KERNELS["prod"](out, [a, b], {}, [])
    assert out.tolist() == [True, False, False]


def test_copy_and_zero() -> None:
    out = np.ones(3)
    KERNELS["copy"](out, [np.array([4.0, 5.0, 6.0])], {}, [])
    assert out.tolist() == [4.0, 5.0, 6.0]
    KERNELS["zero"](out, [], {}, [])
    assert not out.any()


def test_register_refuses_to_shadow_unless_asked() -> None:
    mine = KERNELS.extended()  # a registry of one's own: the shared ones are frozen
    with pytest.raises(ValueError, match="'sum' is already registered"):
        register_kernel(mine, "sum", KERNELS["max"])
    fn = KERNELS["copy"]
    assert register_kernel(mine, "test_alias_copy", fn) is fn
    assert register_kernel(mine, "test_alias_copy", fn, replace=True) is fn


def test_shared_registries_are_frozen_and_extended_copies_are_not() -> None:
    with pytest.raises(TypeError, match="frozen"):
        register_kernel(BUILTIN_KERNELS, "mine", KERNELS["copy"])
    mine = BUILTIN_KERNELS.extended({"mine": KERNELS["copy"]})
    assert not mine.frozen
    assert "mine" in mine
    assert "mine" not in BUILTIN_KERNELS
    assert mine.register("more", KERNELS["zero"]) is KERNELS["zero"]
    with pytest.raises(ValueError, match="'sum' is already registered"):
        BUILTIN_KERNELS.extended({"sum": KERNELS["max"]})
    assert BUILTIN_KERNELS.extended({"sum": KERNELS["max"]}, replace=True)["sum"] \
        is KERNELS["max"]
    assert BUILTIN_KERNELS.extended(BUILTIN_KERNELS) == BUILTIN_KERNELS  # same kernels: fine
    with pytest.raises(TypeError, match="KernelRegistry"):
        register_kernel({}, "x", KERNELS["copy"])  # type: ignore[arg-type]


def test_importing_registers_nothing() -> None:
    """Kernel registries are values: the collectives' one is built from their modules' values,
    and importing them adds nothing to the built-ins."""
    from asynccoll.collectives import KERNELS as ALL
    from asynccoll.collectives import PARTIAL_KERNELS, SPARSE_KERNELS, SPARSE_PARTIAL_KERNELS

    assert sorted(BUILTIN_KERNELS) == ["copy", "max", "min", "prod", "reduce", "sum", "zero"]
    assert ALL.frozen
    assert set(ALL) == set(PARTIAL_KERNELS) | set(SPARSE_KERNELS) | set(SPARSE_PARTIAL_KERNELS)
    assert {"partial_snapshot", "partial_sparse_snapshot", "sparse.merge"} <= set(ALL)
