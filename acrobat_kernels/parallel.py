"""numba kernels on torch's own OpenMP threads.

torch's CPU kernels run on an OpenMP thread team, whose idle threads spin for a while
after each parallel region. A numba kernel that splits its work over threads of its own
(numba's ``parallel=True``, a Python thread pool) then competes with those spinning
threads for the same cores: on this 2-core machine a row-split recurrence ran at one
thread's speed whenever a torch op had just run (32 -> 61 µs a step). Started through
``GOMP_parallel`` of the OpenMP runtime torch loaded, the kernel runs on torch's team
instead, which picks it up at once.

A kernel for :func:`launch` is a numba ``cfunc`` of signature ``void(intp)``: it gets the
address of its parameter block (int64s), asks :func:`row_share` (the runtime's thread
number and team size) which rows are its own, and computes those.

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
    global _omp
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
    return _omp


def available() -> bool:
    """Whether :func:`launch` runs kernels on torch's OpenMP team."""
    return bool(_load())


_share = None  # the compiled row_share


def row_share():
    """The numba function ``share(rows) -> (r0, r1)``: the rows of a row-split kernel that
    the calling thread of torch's team takes, in whole blocks of
    :func:`acrobat_kernels.gemm.rows_product` (eight rows; four for fewer than 16, so
    that 8 to 15 rows still split); ``r0 == r1`` for a thread left without rows. Callable
    from the cfuncs :func:`launch` runs (it asks the runtime's thread number and team
    size); only where :func:`available`."""
    global _share
    if _share is not None:
        return _share
    omp = _load()
    if not omp:
        raise RuntimeError("torch's OpenMP runtime (libgomp) was not found")
    from numba import njit

    thread, team = omp[1], omp[2]

    @njit(cache=False)  # (holds this process's OpenMP function addresses)
    def share(rows):  # pragma: no cover - compiled by numba
        parts = team()
        block = 8 if rows >= 16 else 4
        per = ((rows + parts - 1) // parts + block - 1) // block * block
        r0 = min(thread() * per, rows)
        return r0, min(r0 + per, rows)

    _share = share
    return share


#: A kernel's parameter block: ``Params(*ints)`` (0.5 µs, against 2.3 for a torch tensor).
Params = ctypes.c_int64 * 16


def launch(kernel_address: int, params, threads: int) -> None:
    """Run the cfunc at ``kernel_address`` on ``threads`` threads of torch's team (the
    calling thread among them), given the address of its parameter block or a
    :data:`Params`; only where :func:`available`. ctypes releases the GIL for the call."""
    _omp[0](kernel_address, params, threads, 0)  # type: ignore[index]
