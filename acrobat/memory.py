"""Keeping freed memory for the next mini-batch (config.HOLD_MEMORY).

A batched program allocates large temporaries: a gathered operand, a concatenation, a
GEMM's output, megabytes each at batch 64. glibc's malloc serves a request above its
mmap threshold (128 KiB at first, raised to the largest block freed so far) with a fresh
``mmap`` and gives it back to the system on ``free``; it also returns free memory at
the top of its heap once that exceeds twice the threshold. Either way the next
mini-batch's buffer of the same size is new memory, and every 4 KiB page of it faults on
first write. On the virtual machines this project runs on that cost dominated whole ops:
``torch.cat`` of two (1144, 512) float tensors took 9-10 ms inside a map and 0.3 ms with
its output reused (BiRNN large's output layer).

:func:`hold` tells malloc to serve requests up to 32 MiB from its heap and to keep what
is freed there, so the buffers of one mini-batch are the memory of the next: the role of
a caching allocator (PyTorch's CUDA allocator does this on GPUs; Intel's guidance for
CPU inference is to preload jemalloc or tcmalloc for the same reason). The process then
keeps its peak heap size instead of shrinking after each batch. It is process-wide, so
acrobat sets it once, at the first map, only where the C library is glibc, and
``ACROBAT_HOLD_MEMORY=0`` leaves malloc alone; :func:`release` restores glibc's defaults
and hands free memory back.
"""

from __future__ import annotations

import ctypes
import platform

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit systems
TRIM_THRESHOLD = 1 << 30  # free heap kept before any is returned
_DEFAULT_MMAP_THRESHOLD = 128 << 10
_DEFAULT_TRIM_THRESHOLD = 128 << 10

_libc = None
_held = False


def _glibc():
    global _libc
    if _libc is None:
        _libc = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                lib = ctypes.CDLL(None)
                lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                lib.malloc_trim.argtypes = [ctypes.c_size_t]
                _libc = lib
            except (OSError, AttributeError):  # pragma: no cover - not glibc after all
                pass
    return _libc


def held() -> bool:
    """Whether :func:`hold` is in effect."""
    return _held


def hold() -> bool:
    """Keep freed memory for reuse (see the module docstring); True if in effect."""
    global _held
    lib = _glibc()
    if not lib:
        return False
    if not _held:
        _held = bool(
            lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and lib.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        )
    return _held


def release() -> None:
    """glibc's default thresholds again, and the free heap handed back to the system."""
    global _held
    lib = _glibc()
    if not lib:
        return
    lib.mallopt(_M_MMAP_THRESHOLD, _DEFAULT_MMAP_THRESHOLD)
    lib.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
    lib.malloc_trim(0)
    _held = False
