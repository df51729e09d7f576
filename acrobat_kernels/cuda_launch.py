"""Launching a compiled CUDA kernel for a few microseconds of the CPU's time.

A gather on a GPU is a small kernel, and a map makes hundreds of them (a parser's stack
tops, every round). Through cupy a launch costs ~10-15 µs of Python: the device
context entered and left, torch's current stream looked up (``torch.cuda.current_stream``
alone ~3 µs), every argument converted (on an H100's host: a 64-row gather 16.1 µs of
CPU through cupy, 10.0 through the driver, ~2 of them the output's allocation). Here
the kernel's ``CUfunction`` (cupy compiled and loaded it) goes to the driver's
``cuLaunchKernel`` through ctypes, its argument block preallocated: a launch is the
argument values written into that block and one foreign call, on torch's current
stream read as a raw handle.

The call holds the GIL (``ctypes.PyDLL``): the argument block is shared, and the driver
copies it during the call. Used only where the kernel's device is the thread's current
one (its context is the one the driver launches in); elsewhere callers launch through
cupy as before.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_driver: Any = None  # libcuda's cuLaunchKernel, once loaded; False if it cannot be


def _launch_fn():
    global _driver
    if _driver is None:
        try:
            lib = ctypes.PyDLL("libcuda.so.1")  # (PyDLL: called with the GIL held)
            fn = lib.cuLaunchKernel
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
            _driver = fn
        except (OSError, AttributeError):
            _driver = False
    return _driver or None


def raw_stream(device: torch.device) -> int:
    """The handle of torch's current stream on ``device`` (``torch.cuda.current_stream``
    without building a Stream object: 0.2 µs instead of ~3)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return get(index)
    return torch.cuda.current_stream(index).cuda_stream


class Launcher:
    """One kernel launched straight through the driver. ``arg_types``: the ctypes types
    of its parameters, in order (pointers as ``c_uint64``)."""

    def __init__(self, function, arg_types: list):
        fn = _launch_fn()
        if fn is None:
            raise OSError("libcuda.so.1 with cuLaunchKernel could not be loaded")
        self._launch = fn
        self._function = function  # (kept alive: it holds the loaded module)
        # a cupy RawKernel's loaded cupy.cuda.function.Function holds the CUfunction
        self._ptr = ctypes.c_void_p(int(getattr(function, "kernel", function).ptr))
        self._values = [t() for t in arg_types]
        self._params = (ctypes.c_void_p * len(arg_types))(
            *[ctypes.addressof(v) for v in self._values]
        )

    def __call__(self, grid: int, block: int, stream: int, *args) -> None:
        """Launch a ``grid`` x ``block`` grid (one dimension) on ``stream`` with ``args``."""
        for slot, value in zip(self._values, args):
            slot.value = value
        rc = self._launch(self._ptr, grid, 1, 1, block, 1, 1, 0, stream, self._params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernel failed with CUresult {rc}")


def launcher(function, arg_types: list) -> Launcher | None:
    """A :class:`Launcher` of a cupy ``RawKernel`` (or ``Function``), or None where the
    driver's launch is not available (no libcuda, a cupy without ``Function.ptr``)."""
    try:
        return Launcher(function, arg_types)
    except (OSError, AttributeError, TypeError):
        return None


def for_current_device(cache: dict, key, device: torch.device, build, *args):
    """``build(index, *args)``'s launcher(s) for ``key`` on ``device``, made once and kept in
    ``cache``, where ``device`` is the thread's current device (the driver launches in
    the current context), else None. ``build`` compiles and loads in that device's
    context; a None it returns is kept too (no driver: the caller launches through cupy)."""
    index = device.index
    if index is None or index != torch.cuda.current_device():
        return None
    found = cache.get((key, index), False)
    if found is False:
        found = cache[(key, index)] = build(index, *args)
    return found

