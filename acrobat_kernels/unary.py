"""A vectorised float32 ``tanh`` for batched CPU tensors.

``torch.tanh`` in the CPU builds of torch we measure on evaluates float32 ``tanh`` one
element at a time: 2.2 ns per element, against 0.27 for ``torch.sigmoid`` (every
``ATEN_CPU_CAPABILITY`` alike). That is a third of an Elman step's kernel time at hidden
size 256. :func:`tanh` runs :func:`acrobat_kernels.vecmath.tanh_f32` (arithmetic and
selects only, so LLVM vectorises the loop) over the flat buffer instead: ~0.5 ns per
element, 3x faster at 64 x 256 and 4x at 512 x 256 (one thread).

Numerics: within 2 ulp of float64 ``tanh`` over the float32 range (``torch.tanh``: 1 ulp),
a difference of the same order as the one batching already makes by summing GEMMs in
another order. inf, -inf, NaN and signed zeros give what ``torch.tanh`` gives.

It runs only where it pays and where it is exactly a ``tanh``: float32, CPU, contiguous
or a column slice of a matrix (its rows spaced apart; the output is packed, as torch's),
at least :data:`MIN_NUMEL` elements, no ``out=``; anything else calls ``torch.tanh``.
With autograd recording, the backward is torch's own formula, ``grad * (1 - y * y)``, on
the saved output (differentiable again, for double backward). numba is imported and the
kernel compiled on first use (~0.9 s; then loaded from numba's disk cache, ~0.05 s).
"""

from __future__ import annotations

import torch

#: Fewest elements for which the numba kernel is used (one thread: 1.9 against 3.3 µs at
#: 1024 elements, even at ~256, where the ~1.5 µs call overhead dominates).
MIN_NUMEL = 1024

_kernel = None  # compiled on first use: ((address in, address out, n) -> None,
# (address in, address out, rows, columns, row stride of in) -> None, (address, n) -> None)


def _compile():
    global _kernel
    from acrobat_kernels.vecmath import tanh_kernels

    _kernel = tanh_kernels()
    return _kernel


_casts = None


def address_casts() -> tuple:
    """``(as_f32, as_i64)``: numba intrinsics turning an integer address into a float32 /
    int64 pointer (for ``numba.carray``), made once for every kernel module."""
    global _casts
    if _casts is None:
        from numba import types

        from acrobat_kernels.vecmath import pointer_cast

        _casts = tuple(pointer_cast(types.CPointer(t)) for t in (types.float32, types.int64))
    return _casts


def tanh_in_place():
    """The numba function ``kernel(address, n)``: ``tanh`` of ``n`` float32s at ``address``,
    in place; callable from other numba kernels (the linear kernel's ``tanh`` epilogue,
    acrobat_kernels/gemm.py)."""
    return (_kernel or _compile())[2]


def _forward(x: torch.Tensor) -> torch.Tensor:
    kernel, rows_kernel, _ = _kernel or _compile()
    out = torch.empty(x.shape, dtype=x.dtype)
    if x.is_contiguous():
        kernel(x.data_ptr(), out.data_ptr(), x.numel())
    else:  # rows of a wider matrix (usable)
        rows_kernel(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], x.stride(0))
    return out


class _Tanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = _forward(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


def usable(x) -> bool:
    """Whether :func:`tanh` runs the vectorised kernel on ``x`` (else ``torch.tanh``):
    contiguous, or a matrix whose rows are contiguous and spaced apart (a column slice
    of a wider matrix: an LSTM's gate ``u`` of ``gates.chunk(...)``)."""
    return (
        type(x) is torch.Tensor
        and x.dtype is torch.float32
        and x.is_cpu
        and x.numel() >= MIN_NUMEL
        and (
            x.is_contiguous()
            or (x.dim() == 2 and x.stride(1) == 1 and x.stride(0) >= x.shape[1])
        )
    )


def tanh(*args, **kwargs):
    """``torch.tanh(x)``, vectorised where :func:`usable`; other calls go to torch."""
    if len(args) != 1 or kwargs or not usable(args[0]):
        return torch.tanh(*args, **kwargs)
    x = args[0]
    if x.requires_grad and torch.is_grad_enabled():
        return _Tanh.apply(x)
    return _forward(x)
