"""Row gathers on a GPU as one kernel that reads each row from its address.

A batch operand whose rows are spread over several producer batches (a parser's stack
tops, the children of tree nodes made at different depths) is, in torch, a view or an
``index_select`` per source, a ``cat`` and a reordering ``index_select``: on a GPU each
is a launch and ~10-20 µs of the CPU's time, which the GPU run spends waiting on. Here
the rows' device addresses go up in one copy (the caller's page-locked ring,
``acrobat.tensor.IndexRing``) and one kernel copies every row, whatever the number of
sources: the CPU path's C copy by address, on the device.

Only for what a byte copy computes exactly: contiguous rows, no autograd (the caller
keeps torch where gradients flow). Compiled by NVRTC through cupy on first use; the
source compiles with ``nvcc -ptx`` in the tests on machines without a GPU.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from acrobat_kernels import cuda_launch, elementwise

_KERNEL = r"""
extern "C" __global__ void acrobat_gather_{name}(
        const unsigned long long* __restrict__ addresses, {T}* __restrict__ out,
        long long n, long long width) {{
    long long total = n * width;
    long long step = (long long)gridDim.x * blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += step) {{
        long long i = k / width;
        out[k] = ((const {T}*)addresses[i])[k - i * width];
    }}
}}
"""

#: Rows copied as 4-byte words where their size allows, else byte by byte.
SOURCE = "".join(_KERNEL.format(name=name, T=T) for name, T in
                 [("words", "unsigned int"), ("bytes", "unsigned char")])  # fmt: skip

KERNELS = ("acrobat_gather_words", "acrobat_gather_bytes")
_THREADS = 256
_MAX_BLOCKS = 4096

_module: Any = None  # cupy.RawModule, compiled on first use
_launchers: dict = {}  # ("gather", device index) -> (words, bytes) Launchers, or None

#: Launch through the driver (acrobat_kernels/cuda_launch.py) where it can; else cupy's.
DRIVER_LAUNCH = True


def available() -> bool:
    """Whether cupy can run the kernel here (installed, with a CUDA device)."""
    return elementwise._cupy() is not None and torch.cuda.is_available()


def _kernels():
    global _module
    if _module is None:
        _module = elementwise._cupy().RawModule(code=SOURCE, name_expressions=KERNELS)
    return _module.get_function(KERNELS[0]), _module.get_function(KERNELS[1])


def _driver_launchers(device: torch.device):
    """The two kernels' driver launchers for ``device`` where it is the thread's current
    device (the driver launches in the current context), else None."""
    return cuda_launch.for_current_device(_launchers, "gather", device, _build_launchers)


def _build_launchers(index: int):
    u64, i64 = ctypes.c_uint64, ctypes.c_int64
    with elementwise._cupy().cuda.Device(index):
        pair = [cuda_launch.launcher(f, [u64, u64, i64, i64]) for f in _kernels()]
    return tuple(pair) if None not in pair else None


def gather_rows(
    addresses: torch.Tensor, shape: tuple, dtype: torch.dtype, nbytes: int
) -> torch.Tensor:
    """A new contiguous ``(len(addresses), *shape)`` tensor on ``addresses``' device
    whose row ``i`` is the ``nbytes`` bytes at device address ``addresses[i]`` (an int64
    tensor on that device). The caller guarantees every address points into a live
    tensor on that device with that many contiguous bytes."""
    device = addresses.device
    n = addresses.shape[0]
    out = torch.empty(n, *shape, dtype=dtype, device=device)
    # 4-byte words where the rows allow (they start at multiples of nbytes from
    # 256-byte-aligned bases), else bytes
    which, width = (0, nbytes // 4) if nbytes % 4 == 0 else (1, nbytes)
    total = n * width
    if total == 0:
        return out
    blocks = min(-(-total // _THREADS), _MAX_BLOCKS)
    fast = _driver_launchers(device) if DRIVER_LAUNCH else None
    if fast is not None:
        stream = cuda_launch.raw_stream(device)
        fast[which](blocks, _THREADS, stream, addresses.data_ptr(), out.data_ptr(), n, width)
        return out
    cupy = elementwise._cupy()
    kernel = _kernels()[which]
    args = (np.uint64(addresses.data_ptr()), np.uint64(out.data_ptr()), np.int64(n),
            np.int64(width))  # fmt: skip
    with cupy.cuda.Device(device.index), elementwise.cupy_stream(device):
        kernel((blocks,), (_THREADS,), args)
    return out
