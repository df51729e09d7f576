"""Operands read where they lie: batched matrix products over per-instance addresses.

A batch's operand column is normally gathered: every instance's value copied into one
contiguous tensor (executor.gather), because torch's batched ops read strided batches.
For a matrix product the copy can go: MKL's batched GEMM (acrobat_kernels/blas.py) takes
one address per matrix, so each instance's operand is read in the producer's output where
it was written. MV-RNN gathers two 64 x 64 matrices per phrase for ``W_M @ [A; B]`` and
``B a``, ``A b``; read in place, a level of 254 phrases costs the products alone (the
products cost the same through pointers as torch's ``bmm`` on gathered copies, which runs
the same MKL routine).

Which operands: ``codegen.row_operands`` picks the block inputs that only matrix products
read (``W @ X``, ``X @ W``, ``X @ v``, ``v @ X``, ``X @ Y``, and ``W @ cat([A, B])``);
the executor then passes a :class:`Rows` (their addresses) for them where every row can
be read by address, and a gathered tensor otherwise; the generated code calls
:func:`matmul` / :func:`matmul_sum`, which take either. Inference only (no autograd through
addresses): under autograd the generated code runs the ops' own batched rules.
"""

from __future__ import annotations

import math
from array import array

import torch

from acrobat import config
from acrobat.tensor import _native

# Block inputs smaller than this (elements per instance) are gathered: the copy is cheap
# and torch's bmm of tiny matrices does not go through MKL's batch.
MIN_NUMEL = 64

_DOUBLE = {torch.float32: 0, torch.float64: 1}
_ready: bool | None = None  # None: not looked for yet


class Rows:
    """One operand column in place: each instance's matrix or vector (``shape``,
    ``dtype``, contiguous) at its address, ``addresses`` holding one int64 per instance."""

    __slots__ = ("addresses", "shape", "dtype")
    device = torch.device("cpu")  # (addresses are read on the CPU only)

    def __init__(self, addresses: array, shape: torch.Size, dtype: torch.dtype):
        self.addresses = addresses
        self.shape = shape
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"Rows({len(self.addresses)} x {tuple(self.shape)}, {self.dtype})"


def available() -> bool:
    """Whether products over addresses can run here: the C extension is built, the BLAS
    torch links has a batched GEMM, and it passed a check against torch once."""
    global _ready
    if _ready is None:
        _ready = False
        if _native is not None:
            from acrobat_kernels import blas

            found = blas.gemm_batch_addresses()
            if found is not None:
                _native.set_gemm_batch(*found)
                _ready = _self_check()
    return _ready and config.ROW_OPERANDS


def _self_check() -> bool:
    """Each product form on a small batch against torch, in both precisions."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for dtype in _DOUBLE:
            w = torch.randn(3, 4, generator=gen, dtype=dtype)
            x = torch.randn(5, 4, 2, generator=gen, dtype=dtype)
            u = torch.randn(5, 4, generator=gen, dtype=dtype)
            v = torch.randn(5, 2, generator=gen, dtype=dtype)
            try:
                got = [
                    matmul_sum([(w, True, x, False), (w[:, :2], True, x[:, :2], False)], 5),
                    matmul(x, False, v, False, 5),
                    matmul(u, False, x, False, 5),
                ]
            except Exception:  # any failure: not usable, gather instead
                return False
            want = [
                w @ x + w[:, :2] @ x[:, :2],
                (x @ v.unsqueeze(2)).squeeze(2),
                (u.unsqueeze(1) @ x).squeeze(1),
            ]
            if not all(torch.allclose(g, e, rtol=1e-4, atol=1e-4) for g, e in zip(got, want)):
                return False
    return True


def usable(*xs) -> bool:
    """Whether the products may run over addresses on these per-instance operands now:
    no autograd recording, and each a :class:`Rows` or a CPU tensor."""
    if torch.is_grad_enabled():
        return False
    return all(type(x) is Rows or x.device.type == "cpu" for x in xs)


def rows_of(ts: list, slots: list, bases: dict) -> Rows | None:
    """The addresses of LazyTensors ``ts`` (computed; ``slots`` and ``bases`` as in
    executor.gather), or None where a source cannot be read by address."""
    t0 = ts[0]
    shape, dtype = t0.shape, t0.dtype
    addresses = array("q", bytes(8 * len(ts)))
    nbytes = shape.numel() * dtype.itemsize
    if type(ts) is not list:
        ts = list(ts)
    if _native.row_addresses(addresses.buffer_info()[0], slots, bases, nbytes, ts, shape, dtype):
        return Rows(addresses, shape, dtype)
    return None


def _operand(x, shared: bool):
    """(base, step, ld, per-instance shape, dtype, keep) of a product's operand: step -1
    means base is the address of an address list, 0 one matrix for every instance."""
    if type(x) is Rows:
        return x.addresses.buffer_info()[0], -1, x.shape[-1], x.shape, x.dtype, x
    if shared:  # one 2-D tensor for every instance (a column slice of a weight is fine)
        if x.stride(-1) != 1:
            x = x.contiguous()
        return x.data_ptr(), 0, x.stride(0), x.shape, x.dtype, x
    if x.stride(-1) != 1 or (x.dim() == 3 and x.stride(1) < x.shape[2]):
        x = x.contiguous()
    ld = x.stride(1) if x.dim() == 3 else x.shape[-1]
    return x.data_ptr(), x.stride(0) * x.element_size(), ld, x.shape[1:], x.dtype, x


def _product(x, x_shared, y, y_shared, n, out=None):
    """Per instance ``x_i @ y_i`` into ``out`` (added to it) or a new tensor."""
    ab, astep, lda, ashape, dtype, keep_a = _operand(x, x_shared)
    bb, bstep, ldb, bshape, _, keep_b = _operand(y, y_shared)
    if len(ashape) == 2 and len(bshape) == 2:  # (m, k) @ (k, p)
        (m, k), p = ashape, bshape[1]
        shape, args = (m, p), (False, False, m, p, k, ab, astep, lda, bb, bstep, ldb)
    elif len(ashape) == 2:  # (m, k) @ (k,): as y^T x^T, MKL's fast row-vector form
        m, k = ashape
        shape, args = (m,), (False, True, 1, m, k, bb, bstep, k, ab, astep, lda)
    else:  # (k,) @ (k, p)
        k, p = ashape[0], bshape[1]
        shape, args = (p,), (False, False, 1, p, k, ab, astep, k, bb, bstep, ldb)
    beta = 0.0
    if out is None:
        out = torch.empty(n, *shape, dtype=dtype)
    else:
        beta = 1.0
    step = math.prod(shape) * out.element_size()
    _native.gemm_batch(_DOUBLE[dtype], *args, beta, out.data_ptr(), step, shape[-1], n)
    del keep_a, keep_b  # (alive until MKL has read them)
    return out


def matmul(x, x_shared: bool, y, y_shared: bool, n: int) -> torch.Tensor:
    """Per instance ``x_i @ y_i`` for a batch of ``n``: each operand a :class:`Rows`, a
    batched tensor (``n`` first), or with ``*_shared`` one 2-D tensor for every instance."""
    return _product(x, x_shared, y, y_shared, n)


def matmul_sum(terms: list, n: int) -> torch.Tensor:
    """``sum(x_i @ y_i for (x, x_shared, y, y_shared) in terms)``, each as in
    :func:`matmul`, accumulated in one output."""
    x, xs, y, ys = terms[0]
    out = _product(x, xs, y, ys, n)
    for x, xs, y, ys in terms[1:]:
        _product(x, xs, y, ys, n, out)
    return out
