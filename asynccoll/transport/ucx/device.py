"""Device (CuPy) memory as the matcher and UCX see it; CuPy is never imported here."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...buffers import is_cupy

__all__ = ["DeviceView", "byte_view", "target"]


class DeviceView:
    """A byte view of a CuPy array that the matcher can slice and fill like a memoryview.

    Held (early) frames are kept in host memory; filling a device view from them copies host to
    device once.
    """

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __len__(self) -> int:
        return int(self.array.nbytes)

    def __getitem__(self, index: slice) -> DeviceView:
        return DeviceView(self.array[index])

    def __setitem__(self, index: slice, data: Any) -> None:
        if is_cupy(data):
            self.array[index] = data
        else:
            self.array[index].set(np.frombuffer(data, np.uint8))

    @property
    def __cuda_array_interface__(self) -> Any:
        return self.array.__cuda_array_interface__


def byte_view(array: Any, name: str) -> Any:
    """The flat ``uint8`` view of a CuPy array (no copy); ``ValueError`` naming ``name`` unless
    it is C-contiguous."""
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return array.reshape(-1).view(np.uint8)


def target(view: Any) -> Any:
    """The object UCX reads or writes for a slot view (the CuPy array behind a device view)."""
    return view.array if isinstance(view, DeviceView) else view
