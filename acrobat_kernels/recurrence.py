"""A whole Elman recurrence over a few rows in one numba call: ``h_t = tanh(c_t + W h_{t-1} + b)``.

A batched loop (acrobat/scan.py) runs its body once per step: for an Elman RNN that is a
GEMM and a ``tanh``, two kernel calls and the Python around them, ~12 µs a step at 8 rows
x 256, of which the arithmetic is ~6. When
the body is exactly that recurrence (its input projection ``c_t`` hoisted out of the
loop), :func:`run` makes every step of every row in one call: ``W`` stays in the cache
from step to step, and the steps' states are written where the loop's outputs live.

Rows are sorted by trip count, longest first (scan.looping): step ``t`` advances rows
``0..active[t]-1``, and a row that stops keeps its last state. Step ``t``'s states are
rows ``offsets[t]..offsets[t]+active[t]-1`` of one (sum(active), N) buffer, so the
loop's per-step outputs are views of it.

Numerics: the dot products are reassociated like gemm.py's and ``tanh`` is
:func:`acrobat_kernels.vecmath.tanh_f32` (2 ulp), so results differ from the step-by-step
loop's in the last bits; the order of the additions is the eager cell's,
``(W h + b) + c``. float32 CPU tensors only, no autograd (the caller checks; see
:func:`usable`).
"""

from __future__ import annotations

import torch

from acrobat_kernels import parallel

#: Most rows the kernel is used for: as far as measured. Per step, this kernel (rows split
#: over torch's two threads from PARALLEL_WORK) / torch's ``addmm`` + ``tanh``, µs: N=256:
#: 1 row 2.0 / 7.2, 8 rows 4.8 / 17.9, 64 rows 30.2 / 64.7, 256 rows 120 / 230; N=512: 8
#: rows 16.0 / 50.7, 64 rows 99 / 211, 256 rows 406 / 757 (MKL's GEMM on this AMD CPU
#: reaches ~110 GFMA/s on two threads, this loop ~190-230).
MAX_ROWS = 256

#: Least multiply-adds (row steps x N x N) for which the rows are split over torch's
#: OpenMP threads (acrobat_kernels/parallel.py).
PARALLEL_WORK = 1 << 20

_F32 = torch.float32
_kernel = None
_parallel = 0  # address of the row-split cfunc on torch's threads, where available


def _compile():
    """The Elman loop and its thread-split entry (acrobat_kernels/loops.py), compiled or
    loaded from numba's disk cache."""
    global _kernel, _parallel
    from acrobat_kernels import loops

    _kernel, _parallel = loops.elman_kernels()
    return _kernel


def _plain(t) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype is _F32 and t.is_cpu


def usable(h0, c, w, b) -> bool:
    """Whether :func:`run` computes the recurrence for these operands: float32 CPU, ``h0``
    (rows, N) with rows <= MAX_ROWS, ``W`` (N, N) with unit column stride (a column view
    of a wider ``W`` is fine), ``b`` None or (N,) contiguous, ``c`` (any rows, N)
    contiguous, none of them requiring a gradient while autograd records."""
    if not (_plain(h0) and _plain(c) and _plain(w)) or h0.dim() != 2 or w.dim() != 2:
        return False
    rows, n = h0.shape
    if rows > MAX_ROWS or w.shape != (n, n) or w.stride(1) != 1 or c.dim() != 2:
        return False
    if c.shape[1] != n or not c.is_contiguous():
        return False
    if b is not None and (not _plain(b) or b.shape != (n,) or not b.is_contiguous()):
        return False
    grads = h0.requires_grad or c.requires_grad or w.requires_grad
    return not (torch.is_grad_enabled() and (grads or (b is not None and b.requires_grad)))


def run(h0, c, w, b, active: list, offsets: list, per_step: bool):
    """(states, final): ``states`` (sum(active), N), step t's rows at ``offsets[t]``;
    ``final`` (rows, N), each row's state after its last step (``h0``'s row if it takes
    none). ``c`` holds step t's addend of row r at ``offsets[t] + r`` (``per_step``) or
    at ``r`` (the same every step). Only where :func:`usable`; ``active`` non-empty,
    non-increasing, ``active[0] <= rows``."""
    kernel = _kernel or _compile()
    h0 = h0.contiguous()
    rows, n = h0.shape
    steps = len(active)
    total = offsets[-1] + active[-1]
    if c.shape[0] < (total if per_step else active[0]) or active[0] > rows:
        raise ValueError(
            f"recurrence.run: {c.shape[0]} addend rows and {rows} states for steps of "
            f"{active[0]}..{active[-1]} rows ({total} row steps, per_step={per_step})"
        )
    meta = torch.tensor([active, offsets], dtype=torch.int64)
    out = torch.empty(total, n, dtype=_F32)
    final = torch.empty(rows, n, dtype=_F32)
    args = (
        c.data_ptr(), int(per_step), h0.data_ptr(), w.data_ptr(), w.stride(0),
        0 if b is None else b.data_ptr(), out.data_ptr(), final.data_ptr(),
        meta.data_ptr(), meta.data_ptr() + 8 * steps, steps, rows, n,
    )  # fmt: skip
    threads = torch.get_num_threads()
    if _parallel and threads > 1 and rows > 4 and sum(active) * n * n >= PARALLEL_WORK:
        parallel.run(_parallel, threads, *args)
    else:
        kernel(*args, 0, rows)
    return out, final
