"""Row gathers on the CPU as one ``memcpy`` per row.

The executor collects a batch operand whose rows are spread over one or several producer
batches (a parser's stack tops, the states of instances that left a loop at different
steps). In torch that is an ``index_select`` per source, a ``cat`` and a reordering
``index_select``: 14 µs for 64 rows of one source and 52 µs from several, one thread.
:func:`gather_rows` copies each row from its address instead, in one numba call whatever
the number of sources: 4 µs for 8 rows, 9 µs for 64 (256 floats each), the Python that
computes the addresses included.

Only for what a byte copy computes exactly: CPU tensors whose rows are contiguous, and
no autograd (the caller uses torch where gradients must flow). The kernel is compiled on
first use (~0.2 s once per process).
"""

from __future__ import annotations

from array import array

import torch

_kernel = None  # compiled on first use: (dst address, address array, n, row bytes) -> None


def _compile():
    global _kernel
    from numba import carray, njit, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from acrobat_kernels.unary import address_casts

    as_i64_ptr = address_casts()[1]

    @intrinsic
    def memcpy(typingctx, dst, src, nbytes):
        def codegen(context, builder, signature, args):
            byte_ptr = context.get_value_type(types.CPointer(types.uint8))
            d = builder.inttoptr(args[0], byte_ptr)
            s = builder.inttoptr(args[1], byte_ptr)
            cgutils.raw_memcpy(builder, d, s, args[2], 1)
            return context.get_dummy_value()

        return types.void(dst, src, nbytes), codegen

    @njit(types.void(types.intp, types.intp, types.intp, types.intp), nogil=True)
    def kernel(dst, addresses, n, nbytes):  # pragma: no cover - compiled by numba
        src = carray(as_i64_ptr(addresses), (n,))
        for i in range(n):
            memcpy(dst + i * nbytes, src[i], nbytes)

    _kernel = kernel
    return kernel


def gather_rows(addresses: array, shape: tuple, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """A new contiguous ``(len(addresses), *shape)`` tensor whose row ``i`` is the
    ``nbytes`` bytes at address ``addresses[i]`` (``nbytes``: the size of one ``shape``
    block of ``dtype``).

    The caller guarantees every address points into a live CPU tensor with that many
    contiguous bytes."""
    kernel = _kernel or _compile()
    n = len(addresses)
    out = torch.empty(n, *shape, dtype=dtype)
    kernel(out.data_ptr(), addresses.buffer_info()[0], n, nbytes)
    return out
