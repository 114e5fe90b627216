"""The built-in kernels and the kernel registry."""

from __future__ import annotations

import numpy as np
import pytest

from asynccoll import register_kernel
from asynccoll.sched import KERNELS


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
    with pytest.raises(ValueError, match="'sum' is already registered"):
        register_kernel("sum", KERNELS["max"])
    fn = KERNELS["copy"]
    assert register_kernel("test_alias_copy", fn) is fn
    assert register_kernel("test_alias_copy", fn, replace=True) is fn
