"""The batched GEMM of the BLAS torch links, over pointer lists.

MKL's ``cblas_sgemm_batch``/``cblas_dgemm_batch`` take one address per matrix, so a batch
of products can read each instance's operand where its producer wrote it, with no gather
copy first (acrobat/rows.py). torch's own ``bmm`` runs on the same MKL routine over a
strided batch, which is why reading through pointers costs the same per product: MV-RNN's
``W_M @ [A; B]`` over 254 scattered 64 x 64 matrices, 1350 us by pointers against 1480 us
for the two gathers and the ``bmm`` (this 2-core CPU, two threads).

Found by name in ``libtorch_cpu`` (x86 builds link MKL statically and export its CBLAS
symbols); a torch without MKL (OpenBLAS, Accelerate, ...) has none, and the executor then
gathers as before.
"""

from __future__ import annotations

import ctypes
import os


def _libraries():
    import torch

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = os.path.join(lib, name)
        if os.path.exists(path):
            yield path
    yield None  # the symbols the process already has


def gemm_batch_addresses() -> tuple[int, int] | None:
    """Addresses of ``cblas_sgemm_batch`` and ``cblas_dgemm_batch``, or None."""
    for path in _libraries():
        try:
            lib = ctypes.CDLL(path)
            s, d = lib.cblas_sgemm_batch, lib.cblas_dgemm_batch
        except (OSError, AttributeError):
            continue
        s_at = ctypes.cast(s, ctypes.c_void_p).value
        d_at = ctypes.cast(d, ctypes.c_void_p).value
        if s_at and d_at:
            return s_at, d_at
    return None
