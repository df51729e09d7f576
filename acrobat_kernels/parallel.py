"""numba kernels on torch's own OpenMP threads.

torch's CPU kernels run on an OpenMP thread team, whose idle threads spin for a while
after each parallel region. A numba kernel that splits its work over threads of its own
(numba's ``parallel=True``, a Python thread pool) then competes with those spinning
threads for the same cores: on this 2-core machine a row-split recurrence ran at one
thread's speed whenever a torch op had just run (32 -> 61 µs a step). Started through
``GOMP_parallel`` of the OpenMP runtime torch loaded, the kernel runs on torch's team
instead, which picks it up at once.

A kernel for :func:`launch` is a numba ``cfunc`` of signature ``void(intp)``: it gets the
address of its parameter block (int64s, :func:`params`), asks
:func:`acrobat_kernels.loops.row_share` (the runtime's thread number and team size, through
the addresses of the two OpenMP queries in the block) which rows are its own, and computes
those.

Only where torch uses GNU OpenMP (libgomp, the Linux wheels); elsewhere :func:`available`
is False and callers run their kernels on the calling thread alone.
"""

from __future__ import annotations

import ctypes

import torch

_omp = None  # (GOMP_parallel, omp_get_thread_num, omp_get_num_threads), or False


def _library():
    """The libgomp torch loaded (found among the process's mappings), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.GOMP_parallel  # noqa: B018 - the entry point must exist
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _load():
    global _omp, _queries
    if _omp is None:
        torch.get_num_threads()  # torch's OpenMP runtime is loaded with torch itself
        lib = _library()
        if lib is None:
            _omp = False
        else:
            start = lib.GOMP_parallel
            start.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
            start.restype = None
            tid, size = lib.omp_get_thread_num, lib.omp_get_num_threads
            for f in (tid, size):
                f.argtypes = []
                f.restype = ctypes.c_int
            _omp = (start, tid, size)
            _queries = tuple(ctypes.cast(f, ctypes.c_void_p).value or 0 for f in (tid, size))
            _setup_native(ctypes.cast(start, ctypes.c_void_p).value or 0)
    return _omp


def _setup_native(start: int) -> None:
    """Hand the OpenMP entry points to the C extension (:func:`run`), where it is built."""
    global _run
    try:
        from acrobat.tensor import _native
    except ImportError:  # (the kernels without acrobat)
        return
    if _native is not None and start and all(_queries):
        _native.setup_omp(start, *_queries)
        _run = _native.omp_run


def available() -> bool:
    """Whether :func:`launch` runs kernels on torch's OpenMP team."""
    return bool(_load())


#: A kernel's parameter block of 16 int64s (0.5 µs to make, against 2.3 for a torch tensor).
Params = ctypes.c_int64 * 16

#: The slots of a parameter block holding the addresses of ``omp_get_thread_num`` and
#: ``omp_get_num_threads`` (acrobat_kernels.loops.row_share calls them): passed at run
#: time, not compiled into the kernels, which numba can then cache on disk.
THREAD_SLOT, TEAM_SLOT = 14, 15

_queries = (0, 0)  # the two addresses, once loaded


def params(*ints: int):
    """A :data:`Params` block: ``ints`` (at most 14) first, the OpenMP queries last; only
    where :func:`available`."""
    return Params(*ints, *_PAD[len(ints) :], *_queries)


_PAD = (0,) * THREAD_SLOT


def queries() -> list[int]:
    """The addresses of ``omp_get_thread_num`` and ``omp_get_num_threads`` (a kernel's
    row split asks them, :func:`acrobat_kernels.loops.row_share`); only where
    :func:`available`."""
    return list(_queries)


def run(kernel_address: int, threads: int, *ints: int) -> None:
    """``launch(kernel_address, params(*ints), threads)``: through the C extension where
    it is built (no ctypes call, no Params array: ~2.5 µs less a kernel); only where
    :func:`available`."""
    if _run is not None:
        _run(kernel_address, threads, *ints)
    else:
        launch(kernel_address, params(*ints), threads)


_run = None  # acrobat._native.omp_run, once set up (_load)


def launch(kernel_address: int, block, threads: int) -> None:
    """Run the cfunc at ``kernel_address`` on ``threads`` threads of torch's team (the
    calling thread among them), given its parameter block (:func:`params`); only where
    :func:`available`. ctypes releases the GIL for the call."""
    _omp[0](kernel_address, block, threads, 0)  # type: ignore[index]
