"""Linear layers on the CPU: ``x @ W.T + c`` in one numba loop.

The loop walks ``W`` once per eight rows of ``x``, two rows of ``W`` at a time, keeping
the sixteen dot products in registers (LLVM vectorises the reduction over ``K``;
:func:`rows_product`). A batch at batch size 8 holds 1 to 8 rows (instances diverge: a
parser's SHIFT and REDUCE steps, loops of different lengths), and torch's CPU GEMM is
slow there. Larger products are split over torch's own OpenMP threads
(acrobat_kernels/parallel.py) from :data:`PARALLEL_WORK` multiply-adds, by rows of ``x``,
or below :data:`COLUMNS_BELOW` rows by rows of ``W`` (each thread streams its half of
``W`` instead of all of it: 24 x 512 -> 256 with its ``tanh`` 32.0 -> 26.3 µs, 24 x 768
-> 256 43.2 -> 34.9; StackRNN large b64 86.6 -> 79.9 ms, small b8 13.7 -> 13.2,
TreeLSTM small b8 2.61 -> 2.46, in-process A/B); there the loop
also beats the MKL GEMM of torch's CPU wheel on this AMD CPU, which reaches ~110 GFMA/s
on two threads against the loop's ~190-230. Measured (µs, a torch op run just before
each call, as in a flush; this kernel / torch on two threads): 4 x 512 -> 256 8.9 /
21.8, 8 x 256 -> 256 8.5 / 13.9, 64 x 256 -> 256 30.1 / 46.7, 16 x 512 -> 512 32.0 /
68.6, 64 x 512 -> 1280 233 / 448, 600 x 512 -> 1280 1923 / 3488, 1200 x 256 -> 768
1270 / 2096. Inside the models the gain depends on the shapes, on what else is in the
caches and on the CPU (MKL is faster on Intel CPUs), so the runtime chooses between this
kernel and torch online per shape and rows bucket (``acrobat.ops.batched_linear``); the
kernel is a candidate up to :data:`MAX_ROWS` rows.

Split over the threads, rows at either end of ``x`` whose last quarter or more of columns
are zero are multiplied over their other columns only (:data:`CUT_ZEROS`): a constant
zero state batched with real ones (a tree's first sibling's ``h_f = 0`` in DRNN's
joined ``[h; h_f]``, a recurrence's first step) costs no multiply-adds there. 83 x 1024 ->
512 with 40 such rows 579 -> 471 µs; DRNN large b64 spends 9-11% less in this kernel
(in-process alternation), small ones and StackRNN within noise.

Numerics: the sum over ``K`` is reassociated (vector lanes, fused multiply-adds), so
results differ from torch's in the last bits, as batched GEMMs already differ from the
eager loop's. No fast-math assumption about NaN or infinities is made.

It runs only where it is exactly that product: float32 CPU tensors, ``x`` of shape
(rows, K) (or (..., K) for a linear layer), contiguous, ``W`` of (N, K) with contiguous
rows (a column view of a wider ``W`` is fine), ``c`` a bias of shape (N,) or an addend
of shape (rows, N), contiguous; and not while autograd records (torch's GEMM then, so
gradients flow as before).
Anything else calls torch. numba is imported and the kernel (acrobat_kernels/loops.py)
compiled on first use, ~3 s with its thread-split entry, once: later processes load both
from numba's disk cache (acrobat_kernels/diskcache.py).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F

from acrobat_kernels import parallel, unary

#: Most rows a batch may have for the kernel (as far as measured: Berxit's 64 x 32 tokens).
MAX_ROWS = 4096

_F32 = torch.float32
_kernel = None  # (x, W, W's row stride, c, c's rows, out, rows, K, N) -> None


def _compile():
    """The linear loop and its thread-split entry (acrobat_kernels/loops.py), compiled or
    loaded from numba's disk cache."""
    global _kernel, _parallel
    from acrobat_kernels import loops

    _kernel, _parallel = loops.linear_kernels()
    return _kernel


#: Least multiply-adds (rows x K x N) for which a product is split over torch's OpenMP
#: threads (acrobat_kernels/parallel.py; ~1.5 µs to start). On this 2-core CPU, right
#: after a torch op, one thread / two: 5 x 256 -> 256 8.1 / 8.2 µs (0.33M), 8 x 256 ->
#: 256 9.1 / 8.0, 12 x 256 -> 256 13.0 / 10.6, 8 x 768 -> 256 18.8 / 14.8.
PARALLEL_WORK = 1 << 18

_parallel = 0  # address of the row-split cfunc on torch's threads, where available

#: Products of fewer rows than this are split over the threads by W's rows (each thread
#: reads its part of W and all of x) instead of x's: with few rows the loop streams W
#: from memory, and a split by x's rows made every thread stream all of it.
COLUMNS_BELOW = 64


_product = None  # the compiled rows_product


def rows_product():
    """The numba function ``product(x, w, ws, out, m, k, n)``: ``out[:m] = x[:m] @ W.T``
    for ``x`` (m, k) and ``W``'s n rows of k elements, row j at ``w[j * ws]`` (a flat
    array). It walks ``W`` once per eight rows of ``x``; the rows past the last eight go in
    one more pass of eight (6 or 7 left) or of four (2-5 left: four, then a single row),
    the rows missing from a pass repeating its last row, their sums not stored (before,
    four, then one at a time: 7 rows walked ``W`` four times); two rows of ``W`` at a time,
    keeping the 16 dot products in registers: each load of ``x`` feeds two multiply-adds
    (against one with a row of ``W`` at a time: 600 x 512 -> 1280 178 -> 207 GFMA/s, 120 x
    256 -> 256 132 -> 162, 8 x 256 -> 256 49 -> 75, right after a torch op). Compiled on
    first use; callable from other numba kernels (acrobat_kernels/recurrence.py)."""
    global _product
    if _product is not None:
        return _product
    import numpy as np

    def product(x, w, ws, out, m, k, n):  # pragma: no cover - compiled by numba
        zero = np.float32(0.0)
        m0 = 0
        while m - m0 >= 6:  # up to eight rows per pass over W (the last pass: 6 to 8 rows,
            last = m - 1  # the missing ones repeating the last row, their sums not stored)
            x0, x1, x2, x3 = x[m0], x[m0 + 1], x[m0 + 2], x[m0 + 3]
            x4, x5 = x[m0 + 4], x[m0 + 5]
            x6, x7 = x[min(m0 + 6, last)], x[min(m0 + 7, last)]
            rows = min(m - m0, 8)
            for jp in range(n // 2):  # two rows of W at a time: each x load feeds two FMAs
                j = 2 * jp
                wj = w[j * ws : j * ws + k]
                wl = w[(j + 1) * ws : (j + 1) * ws + k]
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero
                b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = zero
                for t in range(k):
                    wt = wj[t]
                    vt = wl[t]
                    y0, y1, y2, y3 = x0[t], x1[t], x2[t], x3[t]
                    y4, y5, y6, y7 = x4[t], x5[t], x6[t], x7[t]
                    a0 += wt * y0
                    a1 += wt * y1
                    a2 += wt * y2
                    a3 += wt * y3
                    a4 += wt * y4
                    a5 += wt * y5
                    a6 += wt * y6
                    a7 += wt * y7
                    b0 += vt * y0
                    b1 += vt * y1
                    b2 += vt * y2
                    b3 += vt * y3
                    b4 += vt * y4
                    b5 += vt * y5
                    b6 += vt * y6
                    b7 += vt * y7
                out[m0, j], out[m0, j + 1] = a0, b0
                out[m0 + 1, j], out[m0 + 1, j + 1] = a1, b1
                out[m0 + 2, j], out[m0 + 2, j + 1] = a2, b2
                out[m0 + 3, j], out[m0 + 3, j + 1] = a3, b3
                out[m0 + 4, j], out[m0 + 4, j + 1] = a4, b4
                out[m0 + 5, j], out[m0 + 5, j + 1] = a5, b5
                if rows > 6:
                    out[m0 + 6, j], out[m0 + 6, j + 1] = a6, b6
                if rows > 7:
                    out[m0 + 7, j], out[m0 + 7, j + 1] = a7, b7
            for j in range(n - n % 2, n):  # an odd last row of W
                wj = w[j * ws : j * ws + k]
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero
                for t in range(k):
                    wt = wj[t]
                    a0 += wt * x0[t]
                    a1 += wt * x1[t]
                    a2 += wt * x2[t]
                    a3 += wt * x3[t]
                    a4 += wt * x4[t]
                    a5 += wt * x5[t]
                    a6 += wt * x6[t]
                    a7 += wt * x7[t]
                out[m0, j] = a0
                out[m0 + 1, j] = a1
                out[m0 + 2, j] = a2
                out[m0 + 3, j] = a3
                out[m0 + 4, j] = a4
                out[m0 + 5, j] = a5
                if rows > 6:
                    out[m0 + 6, j] = a6
                if rows > 7:
                    out[m0 + 7, j] = a7
            m0 += rows
        if m - m0 >= 2:  # the last 2 to 5 rows: four (or fewer: missing ones repeat the
            rows = min(m - m0, 4)  # last row) in one pass, a fifth alone
            last = m0 + rows - 1
            x0, x1 = x[m0], x[m0 + 1]
            x2, x3 = x[min(m0 + 2, last)], x[min(m0 + 3, last)]
            for jp in range(n // 2):  # two rows of W at a time
                j = 2 * jp
                wj = w[j * ws : j * ws + k]
                wl = w[(j + 1) * ws : (j + 1) * ws + k]
                a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = zero
                for t in range(k):
                    wt = wj[t]
                    vt = wl[t]
                    y0, y1, y2, y3 = x0[t], x1[t], x2[t], x3[t]
                    a0 += wt * y0
                    a1 += wt * y1
                    a2 += wt * y2
                    a3 += wt * y3
                    b0 += vt * y0
                    b1 += vt * y1
                    b2 += vt * y2
                    b3 += vt * y3
                out[m0, j], out[m0, j + 1] = a0, b0
                out[m0 + 1, j], out[m0 + 1, j + 1] = a1, b1
                if rows > 2:
                    out[m0 + 2, j], out[m0 + 2, j + 1] = a2, b2
                if rows > 3:
                    out[m0 + 3, j], out[m0 + 3, j + 1] = a3, b3
            for j in range(n - n % 2, n):  # an odd last row of W
                wj = w[j * ws : j * ws + k]
                a0 = a1 = a2 = a3 = zero
                for t in range(k):
                    wt = wj[t]
                    a0 += wt * x0[t]
                    a1 += wt * x1[t]
                    a2 += wt * x2[t]
                    a3 += wt * x3[t]
                out[m0, j] = a0
                out[m0 + 1, j] = a1
                if rows > 2:
                    out[m0 + 2, j] = a2
                if rows > 3:
                    out[m0 + 3, j] = a3
            m0 += rows
        for r in range(m0, m):  # a last single row (1 or 5 left)
            xr = x[r]
            for jp in range(n // 2):  # two rows of W at a time
                j = 2 * jp
                wj = w[j * ws : j * ws + k]
                wl = w[(j + 1) * ws : (j + 1) * ws + k]
                a = b = zero
                for t in range(k):
                    y = xr[t]
                    a += wj[t] * y
                    b += wl[t] * y
                out[r, j], out[r, j + 1] = a, b
            for j in range(n - n % 2, n):  # an odd last row of W
                wj = w[j * ws : j * ws + k]
                a = zero
                for t in range(k):
                    a += wj[t] * xr[t]
                out[r, j] = a

    _product = _jit(product, fastmath={"reassoc", "contract"}, error_model="numpy", nogil=True)
    return _product


def _jit(fn, *signature, **options):
    """``numba.njit`` with numba's on-disk cache (acrobat_kernels/diskcache.py: stamped
    with every file of this package), so a later process loads the machine code instead
    of compiling it again; without the cache where no location can be written."""
    from numba import njit

    from acrobat_kernels import diskcache

    return diskcache.compiled(lambda cache: njit(*signature, cache=cache, **options), fn)


_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _plain(t: torch.Tensor) -> bool:
    return t.dtype is _F32 and t.is_cpu and t.is_contiguous()  # (is_cpu: 50 ns, device.type 240)


def _usable(x, w, c, c_shape, any_rank: bool = False, grad_ok: bool = False) -> bool:
    if type(x) not in _TENSORS or type(w) not in _TENSORS:
        return False
    if (x.dim() != 2 and not (any_rank and x.dim() > 2)) or w.dim() != 2:
        return False
    if x.shape[-1] != w.shape[1] or x.numel() > MAX_ROWS * max(x.shape[-1], 1):
        return False
    # W's rows may be spaced (column views of a wider W: hoisting's cut of cat([x, h]))
    if not _plain(x) or w.dtype is not _F32 or not w.is_cpu or w.stride(1) != 1:
        return False
    if c is not None and (type(c) not in _TENSORS or c.shape != c_shape or not _plain(c)):
        return False
    if not grad_ok and records(x, w, c):
        return False
    return x.numel() > 0 and w.shape[0] > 0


def records(x, w, c) -> bool:
    """Whether autograd records a product of these operands."""
    return torch.is_grad_enabled() and (
        x.requires_grad or w.requires_grad or (c is not None and c.requires_grad)
    )


class _Product(torch.autograd.Function):
    """``x @ w.T + c`` (c: None, a bias (N,) with ``c_rows`` 1, or an addend (rows, N))
    by the kernel, with a backward by the kernel too: ``grad_x = grad @ W`` and
    ``grad_W = grad.T @ x`` are the same product over transposed copies of the
    operands (``O(rows (N + K))`` copies for ``O(rows N K)`` work). Whether each runs
    by the kernel or by torch is chosen online like the forward (``choice.CHOOSER``,
    keys ``"linear_grad_x"`` and ``"linear_grad_w"``); under ``create_graph`` the
    backward is torch's ops, differentiable again."""

    @staticmethod
    def forward(ctx, x, w, c, c_rows):
        ctx.save_for_backward(x, w)
        ctx.bias = c is not None and c.dim() == 1
        return _run(x, w, c, c_rows)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        need_x, need_w, need_c, _ = ctx.needs_input_grad
        gc = None
        if need_c:
            gc = grad.sum(0) if ctx.bias else grad
        if not (need_x or need_w):
            return None, None, gc, None
        if torch.is_grad_enabled() or grad.dtype is not _F32 or not grad.is_cpu:
            return grad @ w if need_x else None, grad.t() @ x if need_w else None, gc, None
        from acrobat import choice  # (acrobat imports this module: not at import time)

        g = grad.contiguous()
        rows, threads = choice.bucket(x.shape[0]), torch.get_num_threads()
        gx = gw = None
        if need_x:  # grad @ W: the product with W's transpose
            gx = choice.CHOOSER.run(
                ("linear_grad_x", rows, w.shape, threads),
                {"kernel": lambda: _run(g, transposed(w), None, 0), "torch": lambda: g @ w},
                work=x.shape[0],
            )
        if need_w:  # grad.T @ x: a product over the rows
            gw = choice.CHOOSER.run(
                ("linear_grad_w", rows, w.shape, threads),
                {
                    "kernel": lambda: _run(g.t().contiguous(), x.t().contiguous(), None, 0),
                    "torch": lambda: g.t() @ x,
                },
                work=x.shape[0],
            )
        return gx, gw, gc, None


#: Transposed copies of weights kept for backward passes, at most this many bytes.
TRANSPOSED_BYTES = 64 << 20

_transposed: OrderedDict = OrderedDict()  # (address, shape, strides) -> (W, version, W.T)


def transposed(w: torch.Tensor) -> torch.Tensor:
    """``w.t().contiguous()``, kept while ``w`` is unchanged: every backward of a step
    multiplies by the same weights (a 256 x 1024 transpose costs ~96 µs here, the product
    of 64 rows with it ~95). An entry holds ``w`` itself, so no other tensor can take its
    memory while the entry lives; an in-place update (an optimizer step) bumps
    ``w._version`` and the next call copies again. Least recently used entries go past
    :data:`TRANSPOSED_BYTES`."""
    key = (w.data_ptr(), tuple(w.shape), w.stride())
    entry = _transposed.get(key)
    if entry is not None and entry[1] == w._version and entry[0].dtype == w.dtype:
        _transposed.move_to_end(key)
        return entry[2]
    with torch.no_grad():
        wt = w.detach().t().contiguous()
    _transposed[key] = (w.detach(), w._version, wt)
    total = sum(e[2].nbytes for e in _transposed.values())
    while total > TRANSPOSED_BYTES and len(_transposed) > 1:
        _, (_, _, old) = _transposed.popitem(last=False)
        total -= old.nbytes
    return wt


def _multiply(x, w, c, c_rows) -> torch.Tensor:
    """``_run``, through :class:`_Product` where autograd records it."""
    if records(x, w, c):
        return _Product.apply(x, w, c, c_rows)
    return _run(x, w, c, c_rows)


#: Rows of ``x`` at either end of a batch whose last quarter or more of columns are zero
#: (a zero state gathered with the others' real ones) are multiplied over their other
#: columns only, in the thread-split products (acrobat_kernels/loops.py ``_zero_runs``).
CUT_ZEROS = True

_FINITE: dict = {}  # id(W's base) -> (the base, its _version, whether all of it is finite)


def _finite(w: torch.Tensor) -> bool:
    """Whether ``W`` holds no infinity or NaN (then rows of ``x`` that end in zeros are
    multiplied over their other columns only: the product over zeros adds +0.0, as the
    kernel's sums start from it). Checked over the tensor ``W`` is a view of (a layer's
    weight: the column views hoisting makes of it share one check), once per version.
    (Checked per view, the first map's ~0.3 ms checks fell into the online choice's
    trials of the kernel: StackRNN's ``addmm`` went to torch, 0.8x.)"""
    base = w._base if w._base is not None else w
    hit = _FINITE.get(id(base))
    version = base._version
    if hit is not None and hit[0] is base and hit[1] == version:
        return hit[2]
    if len(_FINITE) >= 64:  # (entries hold their tensor: bounded)
        _FINITE.clear()
    ok = bool(torch.isfinite(base).all())
    _FINITE[id(base)] = (base, version, ok)
    return ok


def _run(x, w, c, c_rows, act: int = 0) -> torch.Tensor:
    """The product by the kernel (``act`` 1: its ``tanh``, :func:`unary.tanh`'s, too)."""
    kernel = _kernel or _compile()
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=_F32)
    ca = c.data_ptr() if c is not None else out.data_ptr()  # not read when c_rows == 0
    args = (x.data_ptr(), w.data_ptr(), w.stride(0), ca, c_rows, out.data_ptr(), m, k, n)
    threads = torch.get_num_threads()
    split = None  # over torch's threads: 1 by columns (rows of W), 0 by rows of x
    if _parallel and threads > 1 and m * k * n >= PARALLEL_WORK:
        if m < COLUMNS_BELOW and n >= 16 * threads:
            split = 1
        elif m > 4:
            split = 0
    if split is not None:
        cut = CUT_ZEROS and _finite(w)  # (a zero times an infinity is NaN: not cut then)
        parallel.run(_parallel, threads, *args, act, split, cut)
    else:
        kernel(*args, n, k)
        if act:
            unary.tanh_in_place()(args[5], m * n)
    return out


def usable_linear(x, w, b, grad_ok: bool = False) -> bool:
    """Whether :func:`run_linear` computes ``F.linear(x, w, b)`` (see the module doc); ``x``
    may have several leading dimensions (a batch of sequences: their rows). With
    ``grad_ok``, also where autograd records it (the kernel's backward, :class:`_Product`)."""
    shape = (w.shape[0],) if type(w) in _TENSORS else None
    return _usable(x, w, b, shape, any_rank=True, grad_ok=grad_ok)


def usable_addmm(y, x, w, grad_ok: bool = False) -> bool:
    """Whether :func:`run_addmm` computes ``torch.addmm(y, x, w.t())`` (``grad_ok``: as for
    :func:`usable_linear`)."""
    shape = (x.shape[0], w.shape[0]) if type(w) in _TENSORS and x.dim() == 2 else None
    return _usable(x, w, y, shape, grad_ok=grad_ok)


def run_linear(x, w, b):
    """``F.linear(x, w, b)`` by the kernel; only where :func:`usable_linear`."""
    if x.dim() == 2:
        return _multiply(x, w, b, 0 if b is None else 1)
    out = _multiply(x.reshape(-1, x.shape[-1]), w, b, 0 if b is None else 1)
    return out.reshape(*x.shape[:-1], w.shape[0])


def run_addmm(y, x, w):
    """``torch.addmm(y, x, w.t())`` by the kernel; only where :func:`usable_addmm`."""
    return _multiply(x, w, y, x.shape[0])


def run_linear_tanh(x, w, b):
    """``tanh(F.linear(x, w, b))`` by the kernel, the ``tanh`` on each thread's rows as
    they are done (one pass fewer over the output, split over the threads with the
    product); only where :func:`usable_linear` without autograd recording."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    out = _run(rows, w, b, 0 if b is None else 1, act=1)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], w.shape[0])


def run_addmm_tanh(y, x, w):
    """``tanh(torch.addmm(y, x, w.t()))`` by the kernel, like :func:`run_linear_tanh`; only
    where :func:`usable_addmm` without autograd recording."""
    return _run(x, w, y, x.shape[0], act=1)


def linear(x, w, b=None):
    """``F.linear(x, w, b)``: the kernel where usable, else torch."""
    return run_linear(x, w, b) if usable_linear(x, w, b) else F.linear(x, w, b)


def addmm(y, x, w):
    """``torch.addmm(y, x, w.t())``: the kernel where usable, else torch."""
    return run_addmm(y, x, w) if usable_addmm(y, x, w) else torch.addmm(y, x, w.t())
