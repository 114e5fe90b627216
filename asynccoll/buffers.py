"""Array backends: view buffers as bytes, allocate like another array, reduce in place.

NumPy arrays are always supported; CuPy arrays where CuPy is installed (imported lazily, so a
machine without a GPU never pays for it). Every function here works on contiguous arrays only
and raises ``ValueError`` naming the argument otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "ALLOWED_DTYPES",
    "REDUCE_OPS",
    "as_bytes",
    "check_array",
    "dtype_from_wire",
    "dtype_to_wire",
    "empty_like",
    "host_to_like",
    "is_cupy",
    "reduce_into",
]

#: dtypes that may appear in a frame header (by NumPy's ``dtype.str``, little-endian forms).
ALLOWED_DTYPES: frozenset[str] = frozenset(
    np.dtype(t).newbyteorder("<").str if np.dtype(t).itemsize > 1 else np.dtype(t).str
    for t in (
        "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
) | {"|u1", "|i1", "|b1", ""}

#: element-wise reductions by name: ``fn(a, b, out=...)``.
REDUCE_OPS: dict[str, Callable[..., Any]] = {
    "sum": np.add,
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
}


def is_cupy(a: Any) -> bool:
    """True when ``a`` is a CuPy array (checked without importing CuPy)."""
    return type(a).__module__.startswith("cupy")


def check_out(out: Any, x: Any, *, copy: bool = True) -> Any:
    """A collective's ``out=`` for data ``x``: a contiguous writable array of ``x``'s shape
    and dtype (``ValueError`` naming ``out`` else), holding ``x`` unless it is ``x`` or not
    ``copy``; returns it flat."""
    check_array(out, "out", writable=True)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must have x's shape {x.shape} and dtype {x.dtype}, got "
                         f"{out.shape} and {out.dtype}")
    if copy and out is not x:
        out[...] = x
    return out.reshape(-1)


def check_array(a: Any, name: str = "array", *, writable: bool = False) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``a`` is a contiguous array
    (NumPy arrays also in native byte order: the wire carries native values; and writable
    when ``writable``: an array a result is written into)."""
    if isinstance(a, np.ndarray):
        if writable and not a.flags.writeable:
            raise ValueError(f"{name} must be writable (got a read-only array)")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (got strides {a.strides})")
        if not a.dtype.isnative:
            raise ValueError(f"{name} must be in native byte order (got dtype {a.dtype.str}; "
                             f"convert with {name}.astype({name}.dtype.newbyteorder('=')))")
        return
    if is_cupy(a):
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (got a non-contiguous CuPy array)")
        return
    raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(a).__name__}")


def as_bytes(a: Any, name: str = "buffer", *, writable: bool = False) -> memoryview:
    """A flat byte view of a contiguous host array or buffer, sharing its memory (no copy).

    Raises ``ValueError`` naming ``name`` for a non-contiguous array, or a read-only buffer
    when ``writable``.
    """
    if isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        return a.reshape(-1).view(np.uint8).data
    # A flat byte view already (what the engine precomputes for every send): as it is, no new
    # view per message.
    m = a if type(a) is memoryview else memoryview(a)
    if writable and m.readonly:
        raise ValueError(f"{name} must be writable")
    return m.cast("B") if m.format != "B" or m.ndim != 1 else m


def empty_like(a: Any, count: int | None = None) -> Any:
    """A new 1-D array of ``a``'s backend and dtype with ``count`` elements (default ``a.size``)."""
    n = a.size if count is None else count
    if is_cupy(a):
        import cupy

        return cupy.empty(n, dtype=a.dtype)
    return np.empty(n, dtype=a.dtype)


def host_to_like(a: np.ndarray[Any, Any], like: Any) -> Any:
    """``a`` (a host array) where ``like`` lives: a device copy for a CuPy ``like``, else ``a``
    itself. NumPy and CuPy do not mix in an assignment (``cupy_array[:] = numpy_array`` raises
    for any but a scalar), so a kernel that writes a host vector into a device buffer goes
    through this."""
    if is_cupy(like):
        import cupy

        return cupy.asarray(a)
    return a


def reduce_into(op: str, out: Any, other: Any) -> None:
    """``out = op(out, other)`` in place, for NumPy or CuPy arrays of equal shape."""
    try:
        fn = REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; expected one of {sorted(REDUCE_OPS)}") from None
    if is_cupy(out):
        import cupy

        fn = getattr(cupy, fn.__name__)
    if out.dtype == np.bool_ and op == "sum":
        fn = np.logical_or
    fn(out, other, out=out)


def dtype_to_wire(dt: np.dtype[Any]) -> str:
    """The header string of a dtype (little-endian ``dtype.str``)."""
    s: str = dt.str if dt.itemsize == 1 else dt.newbyteorder("<").str
    return s


def dtype_from_wire(s: str) -> np.dtype[Any]:
    """The dtype a header names; ``ValueError`` unless it is on :data:`ALLOWED_DTYPES`."""
    if s not in ALLOWED_DTYPES:
        raise ValueError(f"dtype {s!r} is not allowed on the wire")
    return np.dtype(s or "u1")


assert sys.byteorder == "little", "asynccoll assumes a little-endian host"
