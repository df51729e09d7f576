"""THE op table: one row per supported op.

A row says, for one op:
  * ``aliases``  - the torch callables that mean this op (``torch.add``, ``Tensor.__add__``,
                   ``F.linear``...); while ``f.map`` runs, a TorchFunctionMode routes calls
                   of these to :func:`graph.record`; ``methods`` are installed on LazyTensor.
  * shape rule   - by default the op evaluated on meta tensors, once per signature
                   (``graph.infer``); a row may record specially (``special``).
  * ``rule``     - the batched implementation: ``rule(node, xs, n) -> tuple of outputs``
                   where ``node`` is the batch's first node (its arguments are the template
                   every node of the batch shares), ``xs`` the per-instance operands stacked
                   along a new leading dimension of size ``n`` (in ``node.inputs`` order).
                   Real-tensor operands (parameters and values hoisted from them) are taken
                   from the template as they are: they are reused by the whole batch.
  * ``reused``   - which operands are normally parameters read once per batch (docs/stats;
                   the executor decides exactly, by taint: real tensor = reused).
  * ``kind``     - elementwise / shape / reduce / matmul / ... ; ``fusible`` marks ops a
                   generated kernel may fuse (elementwise and their gathers).

Rows without a fast rule use ``vmap_rule`` (torch.vmap of the op over the batch), which is
correct for every op torch can vmap; the fast rules exist for the ops hot in real models.
"""

from __future__ import annotations

import contextlib
import dis
import inspect
import math
import operator
import sys
import threading
import warnings
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from acrobat import choice, config, graph
from acrobat.errors import LazyValueError, ShapeError, UnsupportedOpError, user_frame, user_line
from acrobat.graph import LazyTensor, has_lazy, record, record_data, substitute
from acrobat.tensor import _native as _c_ext
from acrobat.tensor import index_tensor, stage_array, to_device, type_key
from acrobat_kernels import gemm, unary

Tensor = torch.Tensor


@dataclass(eq=False)
class Op:
    name: str
    rule: Callable
    kind: str = "generic"
    aliases: tuple = ()
    methods: tuple = ()
    reused: tuple = ()
    fusible: bool = False
    special: Callable | None = None  # custom recording: special(func, args, kwargs)
    launches: int = 1
    doc: str = ""
    source_args: frozenset = frozenset()  # operands a fused kernel reads in place
    row_args: frozenset = frozenset()  # operands read by address (acrobat/rows.py)
    joins: tuple = ()  # groups of operands gathered as one concatenation (executor._join)
    extra: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Op({self.name})"

    __hash__ = object.__hash__


TABLE: dict[str, Op] = {}  # name -> row
FUNCS: dict[Callable, Op] = {}  # torch callable -> row


def _add(op: Op) -> Op:
    assert op.name not in TABLE, op.name
    TABLE[op.name] = op
    for f in op.aliases:
        FUNCS[f] = op
    return op


def _expand_real(t, n: int):
    return t.expand(n, *t.shape)


# ---- generic rules -----------------------------------------------------------------


# torch.vmap runs ops without a batching rule (bilinear, ...) as a loop over the instances
# and says so once per call site; inside acrobat's batches that is an implementation
# detail the user cannot act on (acrobat.ops.TABLE documents which rows use vmap)
warnings.filterwarnings(
    "ignore", message="There is a performance drop because we have not yet implemented",
    category=UserWarning, module="acrobat.ops",
)  # fmt: skip


def vmap_rule(node, xs, n):
    """Fallback batching rule: vmap the user's call over the per-instance operands. A
    generic row's op (generic_op) runs instance by instance, its results stacked, where
    torch.vmap cannot batch it (no batching rule, a layout it refuses) and where autograd
    records it: torch.vmap's backward is not right for every op (select_scatter's source,
    unbatched or not, got 5x its gradient: bench/op_sweep.py --grad), the loop's is
    eager's own."""
    func, args, kwargs = node.func, node.args, node.kwargs or {}

    def one(*vals):
        it = iter(vals)
        return func(*substitute(args, it), **{k: substitute(v, it) for k, v in kwargs.items()})

    generic = node.op.extra.get("generic", False)
    # (a generic op given per-instance integers runs instance by instance: torch.vmap's
    # batching rules may check no index value, x.index_fill(0, i, v) with i out of range
    # was a silent no-op where eager raises; a known op with indices has its own rule)
    if not (
        generic
        and (
            (torch.is_grad_enabled() and _records_grad(xs, args, kwargs))
            or any(_integer_values(x) for x in xs)
        )
    ):
        try:
            out = torch.vmap(one, in_dims=0, randomness="different")(*xs)
            return (out,) if isinstance(out, Tensor) else tuple(out)
        except Exception:
            if not generic:
                raise
    rows = [one(*(x[i] for x in xs)) for i in range(n)]
    if isinstance(rows[0], Tensor):
        return (torch.stack(rows),)
    return tuple(torch.stack(parts) for parts in zip(*rows))


def _integer_values(x) -> bool:
    return isinstance(x, Tensor) and not (
        x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool
    )


def _records_grad(xs, args, kwargs) -> bool:
    """Whether an operand (batched, or a real tensor among the call's arguments) needs a
    gradient."""
    return any(
        isinstance(t, Tensor) and t.requires_grad for t in graph._tensors((xs, args, kwargs))
    )


def _align(a, it, n, out_nd, dtype=None):
    """Substitute a per-instance operand, viewed so it broadcasts like the unbatched one
    (a 0-dim one cast to ``dtype`` where given: :func:`promotion`)."""
    if type(a) is LazyTensor:
        x = next(it)
        k = len(a.shape)
        if k < out_nd:
            x = x.reshape(n, *(1,) * (out_nd - k), *a.shape)
        if dtype is not None and k == 0 and x.dtype != dtype:
            x = x.to(dtype)
        return x
    if type(a) is list or type(a) is tuple:
        return type(a)(_align(v, it, n, out_nd) for v in a)
    return a


# Keyword operands that take part in type promotion (others are options: alpha, value...)
_PROMOTED_KWARGS = frozenset({"input", "other", "exponent", "min", "max", "end", "weight",
                              "tensor1", "tensor2", "self"})  # fmt: skip
_REDUCED_FLOATS = (torch.float16, torch.bfloat16)


def promotion(func, args, kwargs) -> tuple | None:
    """How an elementwise op's per-instance 0-dim operands are cast for the batched call,
    ``(dtype, result dtype or None, position or keyword left as it is)``, or None when
    the batched call promotes as each instance's does.

    Type promotion ranks a 0-dim tensor below a dimensioned one of its category
    (``x_fp16 * t.sum()`` is fp16 for a float32 ``t``; ``i_int32 + n.sum()`` int32);
    batched, the instance's 0-dim operand is a column with dims, and would promote the
    batch to its own dtype. Cast to the instance's common dtype (what torch casts the
    operands to before computing), the batch computes what each instance does. Where
    torch reads a 0-dim second operand of ``mul``/``div`` of a reduced float as a float32
    number instead (its CPU scalar path; a CUDA 0-dim tensor is cast), the batch
    computes in float32 and casts the result, as the instance rounds once. ``where``'s
    condition takes no part."""
    skip = _WHERE_CONDITION.get(func)
    found = False
    for j, a in enumerate(args):
        if type(a) is LazyTensor and not a.shape and j != skip:
            found = True
            break
    if not found and kwargs:
        found = any(
            type(a) is LazyTensor and not a.shape and k != "condition" for k, a in kwargs.items()
        )
    if not found:
        return None
    operands = [a for j, a in enumerate(args) if j != skip]
    if kwargs:
        operands += [v for k, v in kwargs.items() if k in _PROMOTED_KWARGS]
    one = _promote(operands, False)
    if one is None or one == _promote(operands, True):
        return None
    if (
        one in _REDUCED_FLOATS
        and func in _OPMATH_SCALAR
        and len(args) >= 2
        and type(args[1]) is LazyTensor
        and not args[1].shape
        and not (kwargs and kwargs.get("rounding_mode") is not None)
        and (graph.RT is None or graph.RT.device.type == "cpu")  # (a CUDA 0-dim: cast)
    ):
        return torch.float32, one, skip
    return one, None, skip


def _promote(operands: list, batched: bool) -> torch.dtype | None:
    """torch's result type of ``operands`` (its ResultTypeState: dimensioned tensors, then
    0-dim tensors, then Python numbers, each class promoted on its own and the three
    combined by category), the lazy ones as one instance sees them or, ``batched``, as
    the batched call does (with dims)."""
    classes: list = [None, None, None]
    for a in operands:
        t = type(a)
        if t is LazyTensor:
            k, dtype = (0 if batched or a.shape else 1), a.dtype
        elif isinstance(a, Tensor):
            k, dtype = (0 if a.dim() else 1), a.dtype
        elif t is bool:
            k, dtype = 2, torch.bool
        elif t is int:
            k, dtype = 2, torch.int64
        elif t is float:
            k, dtype = 2, torch.get_default_dtype()
        elif t is complex:
            k, dtype = 2, _default_complex()
        else:
            continue
        c = classes[k]
        classes[k] = dtype if c is None else torch.promote_types(c, dtype)
    return _combine(classes[0], _combine(classes[1], classes[2]))


def _default_complex() -> torch.dtype:
    return torch.complex128 if torch.get_default_dtype() == torch.float64 else torch.complex64


def _combine(higher, lower):
    """torch's combine_categories: ``lower`` (a less dimensioned class) changes
    ``higher`` only where its category is above it."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    if higher.is_complex:
        return higher
    if lower.is_complex:  # (a float keeps its precision: complex of it)
        return _TO_COMPLEX.get(higher, lower) if higher.is_floating_point else lower
    if higher.is_floating_point:
        return higher
    if higher == torch.bool or lower.is_floating_point:
        return torch.promote_types(higher, lower)
    return higher


_TO_COMPLEX = {torch.float16: torch.complex32, torch.float32: torch.complex64,
               torch.float64: torch.complex128}  # fmt: skip


def batched_tanh(*args, **kwargs):
    """``torch.tanh`` of a batch: the vectorised kernel of :mod:`acrobat_kernels.unary`
    where it applies and ``config.FAST_TANH`` is on (torch's is scalar on our CPUs)."""
    if config.FAST_TANH:
        return unary.tanh(*args, **kwargs)
    return torch.tanh(*args, **kwargs)


def batched_linear(x, w, b=None):
    """``F.linear`` of a batch: torch's GEMM, or the kernel of :mod:`acrobat_kernels.gemm`
    where it applies and ``config.FAST_GEMM`` is on, chosen online per (rows bucket,
    weight shape, bias, threads) by timing both on the first real calls
    (``choice.CHOOSER``). Rows: of every leading dimension (a batch of sequences)."""
    if config.FAST_GEMM and _gemm_call is not None:  # (the decided common case, in C)
        out = _gemm_call(0, x, w, b)
        if out is not None:
            return F.linear(x, w, b) if type(out) is str else out
    if config.FAST_GEMM and gemm.usable_linear(x, w, b, grad_ok=True):
        rows = _gemm_rows(x)
        grad = gemm.records(x, w, b)  # (then the kernel's backward too: its own choice)
        key = ("linear", choice.bucket(rows), w.shape, b is None, torch.get_num_threads(), grad)
        return _gemm_chosen(
            key, lambda: gemm.run_linear(x, w, b), lambda: F.linear(x, w, b), rows
        )
    return F.linear(x, w, b)


def batched_addmm(y, x, w):
    """``torch.addmm(y, x, w.t())`` of a batch (a linear layer plus a batch operand), with
    the same choice as :func:`batched_linear`."""
    if config.FAST_GEMM and _gemm_call is not None:
        out = _gemm_call(2, x, w, y)
        if out is not None:
            return torch.addmm(y, x, w.t()) if type(out) is str else out
    if config.FAST_GEMM and gemm.usable_addmm(y, x, w, grad_ok=True):
        grad = gemm.records(x, w, y)
        key = ("addmm", choice.bucket(x.shape[0]), w.shape, torch.get_num_threads(), grad)
        return _gemm_chosen(
            key,
            lambda: gemm.run_addmm(y, x, w),
            lambda: torch.addmm(y, x, w.t()),
            x.shape[0],
        )
    return torch.addmm(y, x, w.t())


_GEMM_DECIDED: dict = {}  # choice key -> "kernel" | "torch", once choice.CHOOSER decided

#: ``_native.gemm_call(kind, x, W, c)``: the checks, the decided choice and the kernel's
#: call of the four functions here in one C call (~2 against ~6 µs a GEMM), where its
#: conditions hold (else None: the Python path below each, trials included).
_gemm_call = None
if _c_ext is not None and hasattr(_c_ext, "gemm_call"):
    _c_ext.setup_gemm(
        globals(), vars(gemm), gemm._finite, torch.empty, torch.get_num_threads,
        torch.is_grad_enabled, torch.float32, torch.Tensor, nn.Parameter,
    )  # fmt: skip
    _gemm_call = _c_ext.gemm_call


def batched_linear_tanh(x, w, b=None):
    """``tanh(F.linear(x, w, b))`` of a batch: the GEMM kernel with its ``tanh`` on each
    thread's rows as they are done (acrobat_kernels/gemm.py; 10-17% less than the two
    calls: 27 x 512 -> 256 32.3 -> 26.8 µs, 121 x 256 -> 256 64.9 -> 54.6), or torch's
    GEMM and the ``tanh`` apart, chosen online like :func:`batched_linear`. Where autograd
    records, the two ops (each with its backward)."""
    if config.FAST_GEMM and config.FAST_TANH and _gemm_call is not None:
        out = _gemm_call(1, x, w, b)
        if out is not None:
            return unary.tanh(F.linear(x, w, b)) if type(out) is str else out
    if config.FAST_GEMM and config.FAST_TANH and gemm.usable_linear(x, w, b):
        rows = _gemm_rows(x)
        key = ("linear_tanh", choice.bucket(rows), w.shape, b is None, torch.get_num_threads())
        return _gemm_chosen(
            key,
            lambda: gemm.run_linear_tanh(x, w, b),
            lambda: unary.tanh(F.linear(x, w, b)),
            rows,
        )
    return batched_tanh(batched_linear(x, w, b))


def batched_addmm_tanh(y, x, w):
    """``tanh(torch.addmm(y, x, w.t()))`` of a batch, like :func:`batched_linear_tanh`."""
    if config.FAST_GEMM and config.FAST_TANH and _gemm_call is not None:
        out = _gemm_call(3, x, w, y)
        if out is not None:
            return unary.tanh(torch.addmm(y, x, w.t())) if type(out) is str else out
    if config.FAST_GEMM and config.FAST_TANH and gemm.usable_addmm(y, x, w):
        key = ("addmm_tanh", choice.bucket(x.shape[0]), w.shape, torch.get_num_threads())
        return _gemm_chosen(
            key,
            lambda: gemm.run_addmm_tanh(y, x, w),
            lambda: unary.tanh(torch.addmm(y, x, w.t())),
            x.shape[0],
        )
    return batched_tanh(batched_addmm(y, x, w))


#: Most rows a table may have for :func:`batched_lookup_linear` to precompute its product.
LOOKUP_ROWS = 64
_LOOKUP_TABLES: OrderedDict = OrderedDict()  # (operands' addresses) -> (versions, operands, T)


def batched_lookup_linear(idx, table, w, b, start, stop, rest, options=None):
    """``linear(cat([embedding(idx, table), rest]), w, b)`` (the looked-up part at columns
    ``start:stop`` of ``w``, at either end) as ``T[idx] + rest @ w_rest.T`` with ``T =
    linear(table, w[:, start:stop], b)``: a product over the table's few rows (a
    parser's action embeddings), kept while the parameters are unchanged, instead of
    ``stop - start`` of the GEMM's columns for every row of every batch. Where autograd
    records, the ops as written (``options``: F.embedding's keyword arguments)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (table, w, b)):
        looked = F.embedding(idx, table, **(options or {}))
        parts = [looked, rest] if start == 0 else [rest, looked]
        return batched_linear(torch.cat(parts, 1), w, b)
    left = w[:, :start] if stop == w.shape[1] else w[:, stop:]
    key = (table.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), start, stop)
    versions = (table._version, w._version, None if b is None else b._version)
    entry = _LOOKUP_TABLES.get(key)
    if entry is None or entry[0] != versions or entry[1][0] is not table or entry[1][1] is not w:
        with torch.no_grad():
            product = F.linear(table, w[:, start:stop], b).contiguous()
        entry = _LOOKUP_TABLES[key] = (versions, (table, w, b), product)
        if len(_LOOKUP_TABLES) > 64:
            _LOOKUP_TABLES.popitem(last=False)
    return batched_addmm(entry[2].index_select(0, idx), rest, left)


def _gemm_rows(x) -> int:
    """The rows of a GEMM over ``x``: of every leading dimension (a batch of sequences)."""
    return x.shape[0] if x.dim() == 2 else x.numel() // max(x.shape[-1], 1)


def _gemm_chosen(key, kernel, torch_gemm, rows: int):
    """``kernel()`` or ``torch_gemm()``, as decided for ``key``; the next trial until then
    (trials timed per row: ``rows`` of this call)."""
    name = _GEMM_DECIDED.get(key)
    if name is not None:
        return kernel() if name == "kernel" else torch_gemm()
    out = choice.CHOOSER.run(key, {"kernel": kernel, "torch": torch_gemm}, work=rows)
    decided = choice.CHOOSER.decided.get(key)
    if decided is not None:
        _GEMM_DECIDED[key] = decided
    return out


def elementwise_rule(node, xs, n):
    out_nd = len(node.info.metas[0][0])
    it = iter(xs)
    # (0-dim per-instance operands cast to the instance's promotion, where it differs)
    cast, out, skip = promotion(node.func, node.args, node.kwargs) or _NO_PROMOTION
    args = [_align(a, it, n, out_nd, None if j == skip else cast) for j, a in enumerate(node.args)]
    func = BATCHED_FUNCS.get(node.func, node.func)
    if node.kwargs:
        # (a memory format is a layout for the instance's rank, channels_last for 4 dims:
        # the batch has one more, and its rows come out as views whatever its layout)
        kwargs = {
            k: _align(v, it, n, out_nd, None if k == "condition" else cast)
            for k, v in node.kwargs.items()
            if k != "memory_format"
        }
        y = func(*args, **kwargs)
    else:
        y = func(*args)
    return (y if out is None else y.to(out),)


_NO_PROMOTION = (None, None, None)  # promotion's (cast, result dtype, skip): nothing to do


def reshape_rule(node, xs, n):
    """View-like ops whose per-instance output shape is known: reshape the batch to it."""
    if type(_arg(node, 0, "input")) is not LazyTensor:
        return vmap_rule(node, xs, n)
    shape, dtype = node.info.metas[0]
    x = xs[0]
    if x.dtype != dtype:  # x.view(torch.int32): the same bits read as another dtype (it
        x = x.view(dtype)  # returned the float values, silently)
    return (x.reshape(n, *shape),)


def expand_rule(node, xs, n):
    if type(node.args[0]) is not LazyTensor or len(xs) != 1:
        return vmap_rule(node, xs, n)
    a = node.args[0]
    out_shape = tuple(node.info.metas[0][0])
    x = xs[0].reshape(n, *(1,) * (len(out_shape) - a.ndim), *a.shape)
    return (x.expand(n, *out_shape),)


def _dim(d, nd):
    """A per-instance dim (possibly negative) as the batched tensor's dim."""
    if d < 0:
        d += nd
    return d + 1


# ---- arguments by name ---------------------------------------------------------------


def _bind_kw(args, kwargs, pos, name, default=None):
    """An argument given positionally at ``pos`` or by keyword ``name``."""
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default) if kwargs else default


def _arg(node, pos, name, default=None):
    return _bind_kw(node.args, node.kwargs, pos, name, default)


def reduce_rule(node, xs, n):
    """sum/mean/amax/argmax/max/min/prod/logsumexp/all/any over a dim, dims or everything."""
    x = _arg(node, 0, "input")
    if type(x) is not LazyTensor or len(xs) != 1:
        return vmap_rule(node, xs, n)
    nd = x.ndim
    dim = _arg(node, 1, "dim")
    keepdim = _arg(node, 2, "keepdim", False)
    name = node.op.name
    kw = {}
    if node.kwargs and "dtype" in node.kwargs:
        kw["dtype"] = node.kwargs["dtype"]
    if isinstance(dim, (Tensor, LazyTensor)) or nd == 0:  # max(x, other) or a 0-d input
        return vmap_rule(node, xs, n)
    if dim is None:
        out = whole_rows(name, xs[0].reshape(n, -1), **kw)
        return (out.reshape(n, *node.info.metas[0][0]),)
    fn = getattr(torch, name)
    if isinstance(dim, (tuple, list)):  # (an empty one: every dim, as torch reads it)
        dim = tuple(_dim(d, nd) for d in dim) if dim else tuple(range(1, nd + 1))
    else:
        dim = _dim(dim, nd)
    out = fn(xs[0], dim, keepdim, **kw)
    return (out,) if isinstance(out, Tensor) else tuple(out)


def softmax_rule(node, xs, n):
    x = _arg(node, 0, "input")
    if type(x) is not LazyTensor or len(xs) != 1:
        return vmap_rule(node, xs, n)
    dim = _arg(node, 1, "dim")
    if dim is None:  # F.softmax's legacy implicit dim
        dim = 0 if x.ndim in (0, 1, 3) else 1
    if x.ndim == 0:
        return vmap_rule(node, xs, n)
    dtype = node.kwargs.get("dtype") if node.kwargs else None
    fn = torch.softmax if node.op.name == "softmax" else torch.log_softmax
    return (fn(xs[0], _dim(dim, x.ndim), dtype=dtype),)


def cat_rule(node, xs, n):
    tensors = node.args[0] if node.args else node.kwargs["tensors"]
    dim = _arg(node, 1, "dim", 0)
    first = next(t for t in tensors if type(t) is LazyTensor)
    nd = first.ndim
    if node.op.name == "stack":
        nd += 1
    it = iter(xs)
    parts = [next(it) if type(t) is LazyTensor else _expand_real(t, n) for t in tensors]
    fn = torch.stack if node.op.name == "stack" else torch.cat
    return (fn(parts, _dim(dim, nd)),)


def flat_parts(node) -> int:
    """For ``stack(parts, 0)`` / ``cat(parts, 0)`` of lazy parts of one shape and dtype:
    the number of parts, else 0. The executor then gathers all parts of all nodes as ONE column of
    n * parts rows and reshapes it, instead of one gather per part (a sentence's
    ``torch.stack(per_token_outputs)``: one index_select instead of one per token)."""
    if node.kwargs or not node.args or len(node.args) > 2:
        return 0
    dim = node.args[1] if len(node.args) == 2 else 0
    return _dim0_parts(node.args[0], dim, node.op.name == "stack")


def _dim0_parts(parts, dim, stack: bool) -> int:
    """The number of ``parts`` if ``stack``/``cat(parts, dim)`` joins lazy parts of one
    shape and dtype along the per-instance dim 0, else 0."""
    if type(parts) not in (list, tuple) or not parts or type(dim) is not int:
        return 0
    first = parts[0]
    if type(first) is not LazyTensor:
        return 0
    key = first.key  # shape and dtype
    for p in parts:
        if type(p) is not LazyTensor or p.key != key:
            return 0
    nd = len(first.shape) + stack
    if nd == 0 or (dim + nd if dim < 0 else dim) != 0:
        return 0
    return len(parts)


def _special_flat(func, args, kwargs):
    """``stack(parts)`` / ``cat(parts)`` along dim 0 of lazy parts of one shape and dtype:
    a "ragged" node whose signature leaves out the number of parts (config.RAGGED), so
    instances with different part counts (sentences of different lengths, trees of
    different sizes) batch together: one gathered column of all their parts, each result
    a view of its rows (executor._run_ragged). Anything else records as usual."""
    op = FUNCS[func]
    rt = graph.RT
    if not config.RAGGED or rt is None or rt.tracer is not None:
        return record(op, func, args, kwargs)
    parts = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    extra = len(kwargs) - ("tensors" in kwargs) - ("dim" in kwargs)
    stack = op.name == "stack"
    k = 0 if extra or len(args) > 2 else _dim0_parts(parts, dim, stack)
    if not k:
        return record(op, func, args, kwargs)
    first = parts[0]
    shape = first.shape
    key = first.key
    out_shape = (k, *shape) if stack else (k * shape[0], *shape[1:])
    ragged = RAGGED_STACK if stack else RAGGED_CAT
    info = _RAGGED_INFO.get((out_shape, first.dtype))
    if info is None:
        info = _RAGGED_INFO[(out_shape, first.dtype)] = graph.Info(
            ((torch.Size(out_shape), first.dtype),), True, None
        )
    node = graph.add_node(rt, ragged, func, args, kwargs, list(parts), info, (ragged, key))
    return graph.wrap_outputs(node, info)


_RAGGED_INFO: dict = {}  # (output shape, dtype) -> its Info


def ragged_rule(nodes: list, x: torch.Tensor) -> tuple:
    """The stack / cat results of ragged ``nodes`` from ``x``, the column of all their
    parts gathered in order: each a view of its own range of rows, with a leading batch
    dim of one (one ``split`` for the batch: 0.75 µs a node, against 2.7 for a slice,
    reshape and unsqueeze each)."""
    views = x.unsqueeze(0).split_with_sizes([len(nd.inputs) for nd in nodes], 1)
    if nodes[0].op is RAGGED_STACK:  # (1, parts, *shape): the result as it is
        return views
    return tuple(v.reshape(1, *nd.info.metas[0][0]) for v, nd in zip(views, nodes))


def flat_result(node, x, n):
    """``flat_parts``' gathered (n * parts, *shape) rows as the batched stack / cat."""
    return (x.reshape(n, *node.info.metas[0][0]),)


def split_rule(node, xs, n):
    """chunk / split / unbind / narrow / select / transpose / movedim style ops with dims."""
    x = _arg(node, 0, "input")
    if type(x) is not LazyTensor or len(xs) != 1:
        return vmap_rule(node, xs, n)
    nd = x.ndim
    name = node.op.name
    X = xs[0]
    if name == "chunk":
        out = X.chunk(_arg(node, 1, "chunks"), _dim(_arg(node, 2, "dim", 0), nd))
    elif name == "split":
        out = X.split(
            _arg(node, 1, "split_size_or_sections", None) or _arg(node, 1, "split_size"),
            _dim(_arg(node, 2, "dim", 0), nd),
        )
    elif name == "unbind":
        # each part contiguous (one copy of the batch): its rows are read by address, where
        # strided parts made a column of a loop's elements (for t in tokens) copy row by row
        d = _dim(_arg(node, 1, "dim", 0), nd)
        out = X.movedim(d, 0).contiguous().unbind(0) if X.shape[d] > 1 else X.unbind(d)
    elif name == "narrow":
        out = X.narrow(
            _dim(_arg(node, 1, "dim"), nd), _arg(node, 2, "start"), _arg(node, 3, "length")
        )
    elif name == "select":
        out = X.select(_dim(_arg(node, 1, "dim"), nd), _arg(node, 2, "index"))
    elif name == "transpose":
        out = X.transpose(_dim(_arg(node, 1, "dim0"), nd), _dim(_arg(node, 2, "dim1"), nd))
    elif name == "t":
        out = X.transpose(1, 2) if nd == 2 else X
    elif name == "permute":
        dims = node.args[1:] if len(node.args) > 1 else node.kwargs["dims"]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = dims[0]
        out = X.permute(0, *(_dim(d, nd) for d in dims))
    else:  # pragma: no cover - table and rule out of sync
        raise AssertionError(name)
    return (out,) if isinstance(out, Tensor) else tuple(out)


def _is_lazy(a):
    return type(a) is LazyTensor


def matmul_rule(node, xs, n):
    """x @ W with W reused is ONE GEMM over the batch; per-instance @ per-instance is a bmm."""
    if node.kwargs:  # torch.matmul(input=a, other=b): xs follow the keywords' order
        return vmap_rule(node, xs, n)
    a, b = node.args[0], node.args[1]
    la, lb = _is_lazy(a), _is_lazy(b)
    A = xs[0] if la else a
    B = (xs[1] if la else xs[0]) if lb else b
    if la and not lb and b.ndim <= 2:
        return (torch.matmul(A, B),)
    if lb and not la and a.ndim == 2:
        if b.ndim == 1:
            return (torch.matmul(B, a.t()),)
        if b.ndim == 2:
            # W @ X_i for a batch of matrices: torch.matmul folds this into one GEMM by
            # making X^T contiguous, a transposing copy of the whole batch; a bmm over
            # the broadcast W reads X in place (MV-RNN large b64: 260 -> 180 ms)
            return (torch.bmm(a.expand(n, *a.shape), B),)
        return (torch.matmul(a, B),)
    if lb and not la and a.ndim == 1 and b.ndim == 2:
        return (torch.matmul(a, B),)
    if la and lb:
        an, bn = a.ndim, b.ndim
        if an >= 2 and an == bn:
            return (torch.matmul(A, B),)
        # per-instance matrix x vector: bmm, or a broadcast multiply + sum (3-4x faster
        # than bmm on CPU at small sizes); chosen online per shape and batch bucket
        if an == 1 and bn == 2:
            return (
                _choose_mv(
                    ("vm", B.shape[1:], B.dtype, choice.bucket(n)),
                    B.device,
                    lambda: torch.matmul(A.unsqueeze(1), B).squeeze(1),
                    lambda: (A.unsqueeze(-1) * B).sum(-2),
                    work=n,
                ),
            )
        if an == 2 and bn == 1:
            return (
                _choose_mv(
                    ("mv", A.shape[1:], A.dtype, choice.bucket(n)),
                    A.device,
                    lambda: torch.matmul(A, B.unsqueeze(-1)).squeeze(-1),
                    lambda: (A * B.unsqueeze(-2)).sum(-1),
                    # A_i b_i as b_i^T A_i^T: MKL's batched row-vector product over the
                    # transposed view is 2-5x faster than either above on CPU (64 x 64
                    # matrices, 64 rows: 15 us against 28 and 74)
                    lambda: torch.bmm(B.unsqueeze(1), A.transpose(1, 2)).squeeze(1),
                    work=n,
                ),
            )
        if an == 1 and bn == 1:
            return ((A * B).sum(-1),)
    return vmap_rule(node, xs, n)


def _choose_mv(key, device, bmm, mulsum, transposed=None, work=None):
    if torch.is_grad_enabled():
        return bmm()  # one variant under autograd: the choice is about inference speed
    variants = {"bmm": bmm, "mulsum": mulsum}
    if transposed is not None:
        variants["bmm_t"] = transposed
    return choice.CHOOSER.run(key, variants, device, work=work)


def linear_operands(node):
    """``(x, W, bias)`` of a linear node whose input is per-instance and whose weight and
    bias are real (the batched-GEMM case), however they were passed; else None."""
    x, w = _arg(node, 0, "input"), _arg(node, 1, "weight")
    bias = _arg(node, 2, "bias")
    if _is_lazy(x) and not _is_lazy(w) and not _is_lazy(bias):
        return x, w, bias
    return None


class _DerivedWeights:
    """Weights derived from parameters (concatenated, stacked), made when first asked and
    again when one of them changes (its ``_version`` or its storage); no autograd."""

    __slots__ = ("key", "value")

    def __init__(self):
        self.key: tuple = ()
        self.value: tuple = ()

    def derived(self, tensors, make) -> tuple:
        key = tuple((t._version, t.data_ptr()) for t in tensors)
        if key != self.key:
            with torch.no_grad():
                self.value = make()
            self.key = key
        return self.value


class JoinedLinear(_DerivedWeights):
    """``linear(x, W_x, b_x) + linear(h, W_h, b_h)`` as one layer over ``[x, h]``:
    ``(cat([W_x, W_h], 1), b_x + b_h)`` (codegen's joined linears). Inference only: the
    result carries no autograd history."""

    __slots__ = ("weights", "biases")

    def __init__(self, weights: tuple, biases: tuple):
        super().__init__()
        self.weights = weights
        self.biases = tuple(b for b in biases if b is not None)

    def _make(self) -> tuple:
        w = _CAT_ORIGINAL([t.detach() for t in self.weights], 1)
        b = None
        for bias in self.biases:
            b = bias.detach().clone() if b is None else b + bias.detach()
        return w, b

    def __call__(self) -> tuple:
        return self.derived((*self.weights, *self.biases), self._make)


_CAT_ORIGINAL = torch.cat  # (as imported: see fast_functions)


class StackedLinear(_DerivedWeights):
    """Linear layers that read the same input, ``linear(x, W_1, b_1)``, ...,
    ``linear(x, W_k, b_k)`` (per-gate layers of a textbook LSTM cell), as one GEMM with the
    weights stacked, ``[W_1; ...; W_k]``, and each result a column view of its output
    (codegen's stacked linears). Where autograd records, the layers run one by one (their
    gradients as eager's) instead of stacking the weights on every batch. ``contiguous``:
    the members whose result leaves the program (copied: later gathers read rows)."""

    __slots__ = ("weights", "biases", "sizes", "contiguous")

    def __init__(self, weights: tuple, biases: tuple, contiguous: tuple):
        super().__init__()
        self.weights = weights
        self.biases = biases
        self.sizes = [w.shape[0] for w in weights]
        self.contiguous = contiguous

    def _make(self) -> tuple:
        w = _CAT_ORIGINAL([t.detach() for t in self.weights], 0)
        b = None
        if any(bias is not None for bias in self.biases):
            b = _CAT_ORIGINAL([
                bias.detach() if bias is not None else w.new_zeros(n)
                for bias, n in zip(self.biases, self.sizes)
            ])  # fmt: skip
        return w, b

    def _stacked(self) -> tuple:
        tensors = [t for t in (*self.weights, *self.biases) if t is not None]
        return self.derived(tensors, self._make)

    def __call__(self, x) -> tuple:
        if torch.is_grad_enabled() and (
            x.requires_grad
            or any(t is not None and t.requires_grad for t in (*self.weights, *self.biases))
        ):
            return tuple(batched_linear(x, w, b) for w, b in zip(self.weights, self.biases))
        parts = batched_linear(x, *self._stacked()).split_with_sizes(self.sizes, -1)
        return tuple(
            part.contiguous() if keep else part for part, keep in zip(parts, self.contiguous)
        )


def linear_rule(node, xs, n):
    operands = linear_operands(node)
    if operands is not None:
        return (batched_linear(xs[0], operands[1], operands[2]),)
    return vmap_rule(node, xs, n)


def check_range(index: Tensor, size: int, what: str) -> None:
    """Per-instance indices run as one call over the rows laid end to end (scatter_rule's
    offsets, torch.vmap's rule for a per-instance embedding table) reach another
    instance's rows where one is out of range: a silent wrong value, or a write into
    another instance's result. Raised here as eager raises it, so the executor names the
    instance (executor._explain_failure re-runs each alone)."""
    if index.numel() == 0:
        return
    lo, hi = torch.aminmax(index)
    if bool(lo < 0) or bool(hi >= size):
        bad = int(lo) if bool(lo < 0) else int(hi)
        raise IndexError(f"{what}: index {bad} is out of bounds for a dimension of size {size}")


def embedding_rule(node, xs, n):
    idx, w = node.args[0], _arg(node, 1, "weight")
    if _is_lazy(idx) and not _is_lazy(w):
        args = (xs[0],) + tuple(node.args[1:])
        kwargs = node.kwargs or {}
        if not _per_row_gradient(node.args, kwargs) and torch.is_grad_enabled():
            # scale_grad_by_freq counts an id's occurrences in the call: each instance's
            # own lookup (one call of all would count every instance's; session 45)
            rows = [F.embedding(x, *node.args[1:], **kwargs) for x in xs[0]]
            return (torch.stack(rows),)
        return (F.embedding(*args, **kwargs),)
    if _is_lazy(idx) and _is_lazy(w) and len(xs) == 2:  # a per-instance table: its rows
        check_range(xs[0], xs[1].shape[1], "embedding")  # lie end to end in vmap's call
    return vmap_rule(node, xs, n)


def layer_norm_rule(node, xs, n):
    if _is_lazy(node.args[0]) and len(xs) == 1:
        args = (xs[0],) + tuple(node.args[1:])
        return (F.layer_norm(*args, **(node.kwargs or {})),)
    return vmap_rule(node, xs, n)


def rnn_cell_rule(node, xs, n):
    """torch.lstm_cell & co. take (B, in): fold the batch into their batch dimension.
    Reused hidden states (a hoisted zeros state) are expanded to the batch."""
    if node.kwargs or len(node.args) < 2:  # operands by name: the generic rule
        return vmap_rule(node, xs, n)
    x, hx = node.args[0], node.args[1]
    if not _is_lazy(x) or any(_is_lazy(w) for w in node.args[2:]):
        return vmap_rule(node, xs, n)
    it = iter(xs)
    X = next(it)
    lead = X.shape[:-1]  # (n, *instance batch dims)

    def fold_state(h):
        H = next(it) if _is_lazy(h) else h.expand(n, *h.shape)
        return H.reshape(-1, H.shape[-1])

    if isinstance(hx, (tuple, list)):
        H = type(hx)(fold_state(h) for h in hx)
    else:
        H = fold_state(hx)
    out = node.func(X.reshape(-1, X.shape[-1]), H, *node.args[2:])
    if isinstance(out, Tensor):
        return (out.reshape(*lead, out.shape[-1]),)
    return tuple(o.reshape(*lead, o.shape[-1]) for o in out)


def getitem_rule(node, xs, n):
    base, idx = node.args
    idx_t = idx if isinstance(idx, tuple) else (idx,)
    if _is_lazy(base) and not has_lazy(idx_t) and _basic_or_adjacent(idx_t):
        return (xs[0][(slice(None), *idx_t)],)
    if not _is_lazy(base) and len(idx_t) == 1 and _is_lazy(idx_t[0]):
        return (base[xs[0]],)
    lazy_at = _lone_lazy_index(base, idx_t)
    if lazy_at is not None:  # W[:, i]: the batch's indices at d, their dims moved first
        index = idx_t[:lazy_at] + (xs[0],) + idx_t[lazy_at + 1 :]
        return (base[index].movedim(lazy_at, 0),)
    if _is_lazy(base) and len(idx_t) == 1 and _is_lazy(idx_t[0]) and idx_t[0].dtype != torch.bool:
        I = xs[1]
        rows = torch.arange(n, device=I.device).reshape(n, *(1,) * (I.ndim - 1))
        return (xs[0][rows, I],)
    return vmap_rule(node, xs, n)


def _lone_lazy_index(base, idx: tuple) -> int | None:
    """The position of the one lazy index tensor in ``idx`` indexing a real ``base``,
    every other entry a slice (then the per-instance dims replace dimension d); else None."""
    if _is_lazy(base):
        return None
    at = None
    for d, i in enumerate(idx):
        if _is_lazy(i) and i.dtype != torch.bool and at is None:
            at = d
        elif type(i) is not slice:
            return None
    return at


def _basic_or_adjacent(idx):
    """True if per-instance indexing stays in place after prepending a batch slice:
    basic indices, or advanced ones (lists/tensors) that are all adjacent."""
    adv = [i for i, v in enumerate(idx) if isinstance(v, (list, Tensor)) or type(v) is bool]
    return not adv or adv == list(range(adv[0], adv[0] + len(adv)))


def masked_fill_rule(node, xs, n):
    """masked_fill takes a 0-d value tensor only: a per-instance value batches as a where."""
    value = _arg(node, 2, "value")
    if not _is_lazy(value):
        return elementwise_rule(node, xs, n)
    if len(node.args) != 3:
        return vmap_rule(node, xs, n)
    x, mask = node.args[0], node.args[1]
    out_nd = len(node.info.metas[0][0])
    it = iter(xs)
    X, M, V = [_align(a, it, n, out_nd) for a in (x, mask, value)]
    return (torch.where(M, V.to(node.info.metas[0][1]), X),)


_INDEX_SELECT = torch.index_select  # (as imported: see fast_functions)


def index_select_rule(node, xs, n):
    """torch.vmap's index_select rule is wrong for a 0-d index (it keeps every row, torch
    2.x); a 0-d index selects exactly like a 1-element 1-d one, so batch it as that."""
    if node.func is _INDEX_SELECT or node.func is Tensor.index_select:
        x, dim, index = _arg(node, 0, "input"), _arg(node, 1, "dim"), _arg(node, 2, "index")
        if index.ndim == 0:
            lazy = {id(t): v for t, v in zip(node.inputs, xs)}
            X = lazy[id(x)] if _is_lazy(x) else x
            I = lazy[id(index)].reshape(n, 1) if _is_lazy(index) else index.reshape(1)
            dims = (0 if _is_lazy(x) else None, 0 if _is_lazy(index) else None)
            return (torch.vmap(lambda a, i: a.index_select(dim, i), in_dims=dims)(X, I),)
    return vmap_rule(node, xs, n)


def dropout_rule(node, xs, n):
    return elementwise_rule(node, xs, n)


# ---- data ops: per-node values, no operands ---------------------------------------------


# dtypes whose batch of Python values is packed by an ``array`` and shared with torch
# (torch.frombuffer): 24 masks of 3 floats 5.5 -> 3.7 µs, 24 ints 2.8 -> 0.9 µs. Not bool:
# an array of bytes would keep a 2 where torch.tensor makes True.
_ARRAY_CODES = {torch.float32: "f", torch.float64: "d", torch.int64: "q"}


def tensor_data_rule(nodes):
    shape, dtype = nodes[0].info.metas[0]
    device = nodes[0].rt.default_device  # (eager's torch.tensor(x) makes it there)
    code = _ARRAY_CODES.get(dtype)
    if code is not None:
        values = (
            chain.from_iterable([nd.data for nd in nodes]) if shape else [nd.data for nd in nodes]
        )
        try:
            packed = array(code, values)
        except (OverflowError, TypeError):  # torch.tensor's own conversion (and error)
            packed = None
        if packed:
            if device.type == "cuda":
                out = torch.empty(len(nodes), *shape, dtype=dtype, device=device)
                if stage_array(packed, out):
                    return (out,)
            out = torch.frombuffer(packed, dtype=dtype).view(len(nodes), *shape)
            return (out if device.type == "cpu" else to_device(out, device),)
    out = torch.tensor([nd.data for nd in nodes], dtype=dtype)
    return (out if device.type == "cpu" else to_device(out, device),)


def input_data_rule(nodes):
    return (torch.stack([nd.data for nd in nodes]),)


# ---- special recording -----------------------------------------------------------------


def _special_tensor(func, args, kwargs):
    """torch.tensor(data) inside an instance: a per-instance constant, batched by stacking
    the Python values of all instances into one tensor (depth 0)."""
    rt = graph.RT
    data = args[0] if args else kwargs.get("data")
    simple = not kwargs or set(kwargs) <= {"dtype"}
    if rt.tracer is None and len(args) == 1 and simple:
        made = value_data(data, kwargs.get("dtype"))
        if made is not None:
            return made
    if has_lazy(data):
        raise UnsupportedOpError(
            f"torch.tensor() of lazy tensors (at {user_line(3)}): use torch.stack / torch.cat"
        )
    if rt.tracer is not None or isinstance(data, Tensor) or kwargs.get("requires_grad"):
        return graph.hoist(func, args, kwargs)
    if kwargs.get("device") is None and rt.default_device.type != "cpu":
        kwargs = {**kwargs, "device": rt.default_device}  # (what torch's DeviceContext adds)
    with torch._C.DisableTorchFunction():
        value = func(*args, **kwargs)
    if value.device != rt.default_device or value.ndim > 1:
        return value  # nested lists: a real constant (rare; not batched)
    sig = (TENSOR, value.shape, value.dtype)
    return record_data(
        TENSOR, sig, data if value.ndim == 0 else list(data), value.shape, value.dtype
    )


def value_data(data, dtype=None):
    """``torch.tensor(data)`` inside an instance, outside a block trace, as a data node
    without building the tensor, for a Python number (``torch.tensor(word_id)``) or a flat
    list of them (a mask, a few ids); None for anything else."""
    kind = type(data)
    if kind in SCALAR_DTYPES:
        return scalar_data(data, dtype, deferred=kind is int)
    if (kind is list or kind is tuple) and data:
        kinds = frozenset(map(type, data))
        if kinds in _LIST_DTYPES:
            dtype = dtype or _LIST_DTYPES[kinds] or torch.get_default_dtype()
            shape = torch.Size([len(data)])
            return record_data(TENSOR, (TENSOR, shape, dtype), list(data), shape, dtype)
    return None


def scalar_data(value, dtype=None, deferred: bool = False):
    """``torch.tensor(value)`` of a Python number inside an instance, as a data node
    (``dtype`` None: torch's for the value's type); a ``deferred`` node is queued only
    if something reads it (graph.record_data)."""
    dtype = dtype or SCALAR_DTYPES[type(value)] or torch.get_default_dtype()
    return record_data(TENSOR, (TENSOR, _SCALAR, dtype), value, _SCALAR, dtype, deferred)


_SCALAR = torch.Size([])
# Python number types -> torch.tensor's dtype for them (None: the default float dtype)
SCALAR_DTYPES = {int: torch.int64, bool: torch.bool, float: None}
_LIST_DTYPES = {  # element types of a flat list -> torch.tensor's dtype (None: the default)
    frozenset({int}): torch.int64,
    frozenset({bool}): torch.bool,
    frozenset({float}): None,
    frozenset({int, float}): None,
}


def _row_lookup(idx, weight, max_norm, grad_options) -> bool:
    """Whether ``embedding(idx, weight)`` is the row lookup ``weight[i]`` of a deferred
    ``torch.tensor(i)``. Not with max_norm (it renormalises the table in place), nor with
    padding_idx / scale_grad_by_freq / sparse (``grad_options``: they change only the
    gradient) when a gradient is taken, nor inside a block trace."""
    rt = graph.RT
    return (
        rt is not None
        and type(idx) is LazyTensor
        and idx.node.depth == graph.DEFERRED
        and isinstance(weight, Tensor)
        and max_norm is None
        and not (grad_options and torch.is_grad_enabled() and weight.requires_grad)
        and rt.tracer is None
    )


# Ops whose batched rule maps row i of its operand to row i of its outputs as a view,
# for any number of rows (reshape_rule and split_rule ops with one operand).
ROW_VIEWS = frozenset(
    {"reshape", "view", "flatten", "unflatten", "squeeze", "unsqueeze", "chunk", "split",
     "unbind", "narrow", "select", "transpose", "t", "permute"}
)  # fmt: skip


def lookup_table(node) -> Tensor | None:
    """The real table W when ``node`` (an op node of a block trace) is the plain row
    lookup ``F.embedding(i, W)`` of a per-instance index: no max_norm (it renormalises
    the table in place) and none of the options that change only the gradient."""
    if node.op is not EMBEDDING or node.kwargs:
        return None
    idx, weight = node.args[:2]
    if type(idx) is not LazyTensor or not isinstance(weight, Tensor):
        return None
    max_norm, grad_options = _embedding_options(node.args, {})
    if max_norm is not None or grad_options:
        return None
    return weight


_EMBEDDING_OPTIONS = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


def _embedding_option_values(args, kwargs) -> dict:
    """The options an ``F.embedding(input, weight, ...)`` call sets, by name."""
    options = dict(zip(_EMBEDDING_OPTIONS, args[2:]))
    options.update((k, kwargs[k]) for k in _EMBEDDING_OPTIONS if k in kwargs)
    return options


def _embedding_options(args, kwargs) -> tuple:
    """(max_norm, whether an option that changes only the gradient is set: padding_idx,
    scale_grad_by_freq, sparse) of an ``F.embedding(input, weight, ...)`` call."""
    options = _embedding_option_values(args, kwargs)
    grad_options = options.get("padding_idx") is not None or any(
        options.get(k) for k in ("scale_grad_by_freq", "sparse")
    )
    return options.get("max_norm"), grad_options


def _per_row_gradient(args, kwargs) -> bool:
    """Whether an ``F.embedding`` call's gradient is each looked-up row's alone, the same
    from one lookup of many instances' ids: not scaled by how often an id occurs in the
    call (``scale_grad_by_freq`` would count every instance's), not sparse."""
    options = _embedding_option_values(args, kwargs)
    return not options.get("scale_grad_by_freq") and not options.get("sparse")


def _special_embedding(func, args, kwargs):
    """F.embedding(torch.tensor(i), W): the constant was deferred, so this is the row
    lookup W[i] (op take): one node instead of two, one index_select per batch."""
    idx = args[0] if args else kwargs.get("input")
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    max_norm, grad_options = _embedding_options(args, kwargs)
    if _row_lookup(idx, weight, max_norm, grad_options):
        return _special_take(weight, idx.node.data)
    if has_lazy(args) or has_lazy(kwargs):
        return record(EMBEDDING, func, args, kwargs)
    return graph.hoist(func, args, kwargs)


def _special_take(base, index, along=None):
    """param[i] with a Python int i inside an instance: an embedding-style row lookup,
    batched into one index_select over all instances (the int is instance data).
    ``along``: ``(d, idx)`` for ``param[:, i]`` and the like (``idx`` the whole index,
    the int at position ``d``, every other entry a slice, :func:`_int_axis`): a lookup
    along dimension ``d`` of ``param[slices]``, batched over a moved-dimension view."""
    rt = graph.RT
    if along is None:
        key = id(base)
    else:  # (the int itself left out: every instance's lookup batches)
        d, idx = along
        key = (id(base), d, _slices_key(idx[:d]), _slices_key(idx[d + 1 :]))
    table = rt.take_tables.get(key)
    if table is None:  # once per table and map: tensor attributes dispatch to the mode
        with _NO_MODE():
            if along is None:
                size, row_shape, spec = base.shape[0], base.shape[1:], None
            else:
                spec = (d, idx[:d] + (slice(None),) + idx[d + 1 :])
                view = base[spec[1]]
                size, row_shape = view.shape[d], view.shape[:d] + view.shape[d + 1 :]
            table = (size, row_shape, base.dtype, (TAKE, key), spec)
        rt.take_tables[key] = table
        rt.hoist_keepalive.append(base)  # its id keys the signature
    size, row_shape, dtype, sig, spec = table
    _check_index(rt, index, size)
    node_out = record_data(TAKE, sig, index % size, row_shape, dtype)
    node_out.node.args = (base, spec)
    return node_out


def _int_axis(idx: tuple, ndim: int) -> int | None:
    """The position of the one Python int in an index tuple whose other entries are all
    slices of ints (``W[:, i]``, ``W[1:, i, :]``), within ``ndim`` dimensions; else None."""
    if len(idx) > ndim:
        return None
    axis = None
    for d, i in enumerate(idx):
        t = type(i)
        if t is int:
            if axis is not None:
                return None
            axis = d
        elif t is not slice or not all(
            v is None or type(v) is int for v in (i.start, i.stop, i.step)
        ):
            return None
    return axis


def _slices_key(idx: tuple) -> tuple:
    """A hashable key of a tuple of slices (slices hash from Python 3.12 on)."""
    return tuple((i.start, i.stop, i.step) for i in idx)


def _check_index(rt, index: int, size: int, dim: int = 0) -> None:
    """Raise eager's IndexError for a Python int out of dimension ``dim`` of ``size``,
    naming the instance and the user's line."""
    if not -size <= index < size:
        raise IndexError(f"{_out_of_bounds(index, dim, size)} ({_instance_at(rt, 4)})")


def _instance_at(rt, depth: int) -> str:
    """'instance i, at <the user's line>' for an eager error raised ``depth`` frames down."""
    inst = rt.fiber.instance if rt is not None and rt.fiber is not None else None
    return f"instance {inst}, at {user_line(depth)}"


def _out_of_bounds(index: int, dim: int, size: int) -> str:
    """Eager's words for an int index out of a dimension's range."""
    return f"index {index} is out of bounds for dimension {dim} with size {size}"


def take_rule(nodes):
    base, spec = nodes[0].args
    if spec is not None:  # along dimension d of base[slices] (_special_take's ``along``)
        d, idx = spec
        base = base[idx].movedim(d, 0)
    index = index_tensor([nd.data for nd in nodes], base.device)
    return (base.index_select(0, index),)


def _special_getitem(func, args, kwargs):
    base, idx = args
    lazy_base = type(base) is LazyTensor
    if not lazy_base and not has_lazy(idx):
        rt = graph.RT
        if rt.tracer is None and base.ndim >= 1 and base.dtype != torch.bool:
            if type(idx) is int:
                return _special_take(base, idx)
            if type(idx) is tuple:
                axis = _int_axis(idx, base.ndim)
                if axis is not None:
                    return _special_take(base, idx[axis], (axis, idx))
        return graph.hoist(func, args, kwargs)
    if lazy_base and base.node.op is INPUT and _basic_index(idx) and graph.RT.tracer is None:
        # a row (or slice) of a per-instance argument: the argument is a real tensor, so
        # the part is too; recorded as an input of its own, it batches with every other
        # such part of its shape whatever the argument's length and the index
        with torch._C.DisableTorchFunction():
            part = base.node.data[idx]
            shape, dtype = part.shape, part.dtype
            sig = (INPUT, shape, dtype, part.device)
        return record_data(INPUT, sig, part, shape, dtype)
    if lazy_base and type(idx) is LazyTensor and idx.dtype == torch.bool:
        return _mask_index(base, idx)
    if lazy_base and type(idx) is int and config.INT_PICKS and base.shape:
        rt = graph.RT
        if rt.tracer is None:  # (in a block's trace the int is part of its signature)
            return _pick(rt, func, base, idx)
    for i in idx if type(idx) is tuple else (idx,):
        if type(i) is LazyTensor and i.dtype == torch.bool:
            raise UnsupportedOpError(
                f"indexing with a per-instance boolean mask (at {user_line(3)}) gives a "
                "data-dependent shape, which cannot be batched: keep the shape with "
                "torch.where(mask, x, 0) or x.masked_fill(mask.logical_not(), 0), or read "
                "the mask with mask.tolist() and index with the positions"
            )
    return record(GETITEM, func, args, kwargs)


def _pick(rt, func, base, index: int):
    """``base[index]`` recorded as a PICK node: its signature leaves the int out, so the
    picks of every instance batch whatever their ints (config.INT_PICKS); the int is
    checked here, as eager checks it, and the batch reads each node's (executor)."""
    _check_index(rt, index, base.shape[0])
    # (RAGGED_ROWS: the rows' shape, not the leading size: picks from values of every
    # size batch together, executor._ragged_picks)
    sig = (PICK, (base.shape[1:], base.dtype)) if config.RAGGED_ROWS else (PICK, base.key)
    info = rt.sig_info.get(sig)
    if info is None:
        info = rt.sig_info[sig] = graph.infer(PICK, func, (base, 0), {}, rt)
    node = graph.add_node(rt, PICK, func, (base, index), {}, [base], info, sig)
    return graph.wrap_outputs(node, info)


def pick_rule(node, xs, n):
    """A batch of picks that share one int (executor._run_pick batches the others)."""
    return (xs[0][:, node.args[1]],)


def ragged_picks(nodes: list, values: list) -> Tensor:
    """Row ``k`` of node ``k``'s own value (``values``, of any leading sizes): one
    concatenation of all of them, one lookup at each one's offset + its int."""
    positions = []
    offset = 0
    for nd, v in zip(nodes, values):
        size = v.shape[0]
        positions.append(offset + nd.args[1] % size)
        offset += size
    x = torch.cat(values)
    return x.index_select(0, index_tensor(positions, x.device))


def picks(nodes: list, x: Tensor) -> Tensor:
    """Row ``k`` of ``x`` indexed by node ``k``'s int: ``x[:, i]`` (a view) where they all
    share one, else ``x[arange(n), idx]``."""
    ints = [nd.args[1] for nd in nodes]
    first = ints[0]
    if ints.count(first) == len(ints):
        return x[:, first]
    size = x.shape[1]
    idx = index_tensor([i % size for i in ints], x.device)
    return x[torch.arange(len(ints), device=x.device), idx]


def _basic_index(idx) -> bool:
    """An index of Python ints, slices of ints, None and Ellipsis only (basic indexing:
    a view, whose shape the index alone decides)."""
    for i in idx if type(idx) is tuple else (idx,):
        t = type(i)
        if t is slice:
            if not all(v is None or type(v) is int for v in (i.start, i.stop, i.step)):
                return False
        elif not (t is int or i is None or i is Ellipsis):
            return False
    return True


# ---- x[index] = value ------------------------------------------------------------------
# A buffer filled in a loop (``out = torch.zeros(n, h); out[t] = h``) or a mask updated
# after each choice (``mask[i] = -inf``) writes into part of a tensor. Inside a map the
# write is recorded out of place: ``put`` makes the new tensor and the target is rebound to
# it. analysis rewrites ``x[index] = value`` to ``x = put(x, index, value)`` where ``x`` is
# a local the function made itself (a factory, a clone) and never lends out (no alias, no
# view kept, not passed to code that could keep it): there the rebinding is exact. A lazy
# tensor nothing has read yet is also updated in place as written (``in_place``). The ints
# of an index are per-instance data, so instances at different positions still batch; a
# write into a put's own result that nothing else read runs into that buffer (PUT_INTO),
# so filling a buffer of n rows costs n row writes, not n copies of the buffer.


def _put(x, index, value):
    """``x[index] = value`` out of place (the ops' per-instance function: shape inference,
    and instance-by-instance reruns)."""
    y = x.clone()
    y[index] = value
    return y


def _real_put(x, index, value):
    """``_put`` of real tensors only, torch's own (a hoisted write: its copy is the result,
    not a tensor the instance made and then wrote into)."""
    with torch._C.DisableTorchFunction():
        return _put(x, index, value)


def put(x, index, value):
    """``x[index] = value`` as written by analysis for a local ``x`` the function owns:
    ``x = put(x, index, value)``. Outside a map (or on real tensors only, where the write
    is the instance's own or the same for all) it writes in place and returns ``x``."""
    rt = graph.RT
    if rt is None or rt.fiber is None or rt.thread != threading.get_ident():
        x[index] = value
        return x
    lazy = type(x) is LazyTensor or has_lazy(value) or has_lazy(index)
    if not lazy:
        if graph.buildable(rt, x):  # a constant being built (graph.construct)
            x[index] = value
            return x
        entries = index if type(index) is tuple else (index,)
        if rt.tracer is not None or not any(type(i) is int for i in entries):
            # a write the same for every instance that makes it: hoisted, one result
            return graph.hoist(_real_put, (x, index, value), {})
    return _special_put(_put, (x, index, value), {})


def put_item(value, x, index):
    """``x[index] = value`` as analysis rewrites it: ``x = put_item(value, x, index)`` (the
    arguments in the order Python evaluates the statement's parts)."""
    return put(x, index, value)


def keep_row(value):
    """A value a loop writes into a row of a buffer, kept for the write after the loop
    (``put_rows``; analysis.LOOP_ROW_WRITES): a lazy one as a handle of its own, so that
    a later in-place update of it (which rebinds the user's handle) does not reach the
    write, as it would not reach the row the put wrote at its step; a real tensor is
    copied."""
    if type(value) is LazyTensor:  # (a handle of its own: an update of value rebinds
        return LazyTensor(value.node, value.idx, value.shape, value.dtype, value.key)  # it)
    if isinstance(value, Tensor):
        return value.clone()
    return value


def put_rows(x, span: range, values: list, reverse: bool):
    """``for t in span: x[t] = v`` (``reversed(span)`` where ``reverse``) for the values
    ``v`` the loop kept (``keep_row``), written after it (analysis.LOOP_ROW_WRITES): where
    they are tensors of x's row shape, dtype and device, the rows the positions name once
    each: the stack of the values where they write every row of x (and x needs no
    gradient: nothing of it is left), else one write of them all; otherwise one write per
    value, in the loop's order, as eager makes them (and with eager's errors)."""
    positions = list(reversed(span) if reverse else span)
    if len(positions) != len(values):  # pragma: no cover - the loop has no break
        raise AssertionError("put_rows: a value for every position")
    if not values:
        return x
    if (type(x) is LazyTensor or isinstance(x, Tensor)) and x.ndim and _rows_of(x, values):
        size = x.shape[0]
        if all(type(p) is int and -size <= p < size for p in positions):
            at = [p % size for p in positions]
            if len(set(at)) == len(at):
                if len(at) == size and not x.requires_grad:
                    ordered: list = [None] * size
                    for p, v in zip(at, values):
                        ordered[p] = v
                    return torch.stack(ordered)
                return put(x, at, torch.stack(values))
    for p, v in zip(positions, values):
        x = put(x, p, v)
    return x


_AUGMENTED = {
    "+": (operator.add, operator.iadd),
    "-": (operator.sub, operator.isub),
    "*": (operator.mul, operator.imul),
    "/": (operator.truediv, operator.itruediv),
}


def augment(x, value, op: str):
    """``x op= value`` for a local nothing else holds (analysis.AUGMENTED): the plain op
    where its result is what the in-place one leaves in ``x`` (``x`` a tensor whose shape
    and dtype the result keeps), else the augmented op itself (a number: Python's
    ``x = x op value``; a tensor: the in-place update, or eager's error, as for a leaf
    that requires grad)."""
    plain, inplace = _AUGMENTED[op]
    if _rebindable_value(x) and _keeps(x, value, op):
        return plain(x, value)
    return inplace(x, value)


def _rebindable_value(x) -> bool:
    """Whether an update of ``x`` may be made out of place: a tensor (not a leaf that
    requires grad, which eager refuses to update in place)."""
    return type(x) is LazyTensor or (isinstance(x, Tensor) and not (x.requires_grad and x.is_leaf))


def update(x, method: str, *args, **kwargs):
    """``x.method(*args, **kwargs)`` written as a statement of its own (``h.mul_(0.9)``)
    on a local nothing else holds (analysis.AUGMENTED): the out-of-place form where its
    result is what the method leaves in ``x`` (a tensor of x's shape and dtype;
    ``zeros_like`` / ``full_like`` for ``zero_`` and a fill with a number), else the
    method itself on x, as written (eager's update or error). Returns x's new value."""
    if _rebindable_value(x):
        out = _updated(x, method, args, kwargs)
        if out is not None:
            return out
    getattr(x, method)(*args, **kwargs)
    return x


def is_lazy(a) -> bool:
    """Whether ``a`` is a lazy tensor (analysis.ITEM_UPDATES' test)."""
    return type(a) is LazyTensor


def update_item(x, index, value, op: str) -> None:
    """``x[index] op= value`` (``+ - * /``) as analysis rewrites it where ``x`` is no local
    the function owns (a layer's output, an argument: analysis.ITEM_UPDATES). Python runs
    it as ``t = x[index]; t op= value; x[index] = t``, and the in-place op on a lazy ``t``
    (a view of ``x``) could not be recorded. For a lazy ``x``:

    * a boolean mask over ``x``'s leading dims and a value that broadcasts against one
      selected entry (a number, a 0-dim tensor, a row): ``x`` becomes
      ``where(mask, x op value, x)``, which needs no value read (the masked entries'
      count) and batches as one elementwise op;
    * otherwise the item's plain op where it keeps the item's shape and dtype (else the
      in-place op as written: eager's error), written back with ``x[index] = t``.

    Either is refused where ``x`` may not be updated in place (``ops.in_place``: a view,
    an input, a value an op recorded before reads). Anything else is updated by the
    statement as written (analysis tests ``is_lazy`` first)."""
    mask = _mask_update(x, index, value, op)
    if mask is not None:
        in_place(
            TABLE["where"], torch.where, (mask, _AUGMENTED[op][0](x, value), x), {},
            f"x[mask] {op}= value", f"x = torch.where(mask, x {op} value, x)", target=x,
        )  # fmt: skip
        return
    x[index] = _updated_item(x, index, value, op)


def item_updated(x, index, value, op: str):
    """``x[index] op= value`` on a local the function owns whose index is no plain
    expression of names and numbers (a mask ``x[m > 0] += v``), as analysis rewrites it:
    ``x = item_updated(x, index, value, op)``, each part evaluated once. Owned, ``x`` may
    be rebound (a real constant ``torch.zeros(n)`` too): a boolean mask of its leading
    dims with a value that broadcasts against one entry gives ``where(mask, x op value,
    x)``, anything else the item's out-of-place op written back (``put``); an item's
    update that does not keep its dtype runs in place as written (eager's error)."""
    if type(x) is LazyTensor or isinstance(x, Tensor):
        mask = _mask_update(x, index, value, op)
        if mask is not None:
            return torch.where(mask, _AUGMENTED[op][0](x, value), x)  # type: ignore[arg-type]
    return put(x, index, _updated_item(x, index, value, op))


def _mask_update(x, index, value, op: str):
    """The mask of ``x[index] op= value`` as a where's (shaped to broadcast against
    ``x``), if ``index`` is a boolean mask of x's leading dims, ``value`` broadcasts
    against one masked entry and ``x op value`` keeps x's shape and dtype; else None."""
    mask = _leading_mask(x, index, value)
    return mask if mask is not None and _keeps(x, value, op) else None


def _updated_item(x, index, value, op: str):
    """What Python's ``x[index] op= value`` writes back: the item's plain op where that
    keeps the item's shape and dtype, else the in-place op on the item as written."""
    plain, inplace = _AUGMENTED[op]
    item = x[index]
    return plain(item, value) if _keeps(item, value, op) else inplace(item, value)


def _leading_mask(x, index, value):
    """``index`` shaped to broadcast against ``x`` if it is a boolean mask of ``x``'s
    leading dims and ``value`` broadcasts against one selected entry, else None."""
    if type(index) is not LazyTensor and not isinstance(index, Tensor):
        return None
    if index.dtype != torch.bool or index.ndim == 0 or index.ndim > x.ndim:
        return None
    if tuple(index.shape) != tuple(x.shape[: index.ndim]):
        return None
    entry = tuple(x.shape[index.ndim :])
    if type(value) not in (int, float, bool):
        if type(value) is not LazyTensor and not isinstance(value, Tensor):
            return None
        if value.ndim > len(entry):
            return None
        try:
            if tuple(torch.broadcast_shapes(tuple(value.shape), entry)) != entry:
                return None
        except RuntimeError:
            return None
    if index.ndim == x.ndim:
        return index
    return index.reshape(*index.shape, *(1,) * (x.ndim - index.ndim))


def _updated(x, method: str, args: tuple, kwargs: dict):
    if method in _RESETS:
        return _reset_value(x, method, args, kwargs)
    op = _METHOD_OPS.get(method)
    if op is not None and len(args) == 1 and not kwargs:  # (torch's promotion, no op run)
        return _AUGMENTED[op][0](x, args[0]) if _keeps(x, args[0], op) else None
    try:
        out = getattr(x, method[:-1])(*args, **kwargs)
    except Exception:  # (the method as written raises eager's error, or updates)
        return None
    if (type(out) is LazyTensor or isinstance(out, Tensor)) and (
        out.shape == x.shape and out.dtype == x.dtype
    ):
        return out
    return None


_METHOD_OPS = {"add_": "+", "sub_": "-", "mul_": "*", "div_": "/"}
_RESETS = ("zero_", "fill_")


def _reset_value(x, method: str, args: tuple, kwargs: dict):
    """What ``x.zero_()`` / ``x.fill_(number)`` leaves in ``x``: a constant of its shape
    and dtype (``zeros_like`` / ``full_like``, hoisted inside a map); None for anything
    else (a tensor fill value)."""
    if kwargs:
        return None
    if method == "zero_" and not args:
        return torch.zeros_like(x)
    if method == "fill_" and len(args) == 1 and type(args[0]) in (int, float, bool):
        return torch.full_like(x, args[0])
    return None


_RESULT_DTYPES: dict = {}  # (x dtype, x 0-d, value dtype or type, value 0-d) -> dtype


def _keeps(x, value, op: str) -> bool:
    """Whether ``x op value`` has x's shape and dtype (torch's promotion: computed once per
    kind of operands, on real empty tensors)."""
    shape, dtype = x.shape, x.dtype
    t = type(value)
    kind: Any
    if t is int or t is float:
        vshape: tuple = ()
        kind = t
    elif t is LazyTensor or isinstance(value, Tensor):
        vshape, kind = value.shape, value.dtype
    else:
        return False
    try:
        if tuple(torch.broadcast_shapes(shape, vshape)) != tuple(shape):
            return False
    except RuntimeError:
        return False
    key = (dtype, len(shape) == 0, kind, len(vshape) == 0)
    result = _RESULT_DTYPES.get(key)
    if result is None:
        with torch._C.DisableTorchFunction():
            a = torch.empty(() if key[1] else (1,), dtype=dtype)
            b = kind(1) if kind in (int, float) else torch.empty(() if key[3] else (1,), dtype=kind)
            result = _RESULT_DTYPES[key] = torch.result_type(a, b)
    if op == "/" and not (result.is_floating_point or result.is_complex):
        return False  # (true division of integers makes floats)
    return result == dtype


def _rows_of(x, values: list) -> bool:
    """Whether every value is a tensor of x's row shape, dtype and device (a lazy one's
    type key says its shape and dtype; the map's lazy tensors share one device)."""
    shape, dtype, device = x.shape, x.dtype, x.device  # (read once: a real tensor's
    row = shape[1:]  # attributes pass the map's torch function mode)
    key = type_key(row, dtype)
    lazy = None
    for v in values:
        if type(v) is LazyTensor:
            if v.key != key:
                return False
            lazy = v
        elif not (
            isinstance(v, Tensor) and v.shape == row and v.dtype == dtype and v.device == device
        ):
            return False
    return lazy is None or lazy.device == device


def _special_put(func, args, kwargs):
    """Record ``x[index] = value`` out of place (see the section comment)."""
    x, index, value = args
    rt = graph.RT
    tracing = rt.tracer is not None  # in a block's trace: the ints are part of its signature
    entries = index if type(index) is tuple else (index,)
    shape = x.shape
    converted = []
    dim, ints, masks = 0, 0, 0
    for k, i in enumerate(entries):
        t = type(i)
        if t is int:
            if not tracing:
                _check_index(rt, i, shape[dim] if dim < len(shape) else 0, dim)
            converted.append(i if tracing else scalar_data(i))
            ints += 1
        elif t is LazyTensor and i.dtype == torch.bool:
            masks += 1
            converted.append(i)
        elif t is LazyTensor and not i.dtype.is_floating_point and i.ndim == 0:
            converted.append(i)
            ints += 1
        elif t is slice and all(v is None or type(v) is int for v in (i.start, i.stop, i.step)):
            converted.append(i)
        elif isinstance(i, Tensor) and t is not LazyTensor and len(entries) == 1:
            converted.append(i)  # one real index (the same for every instance)
        elif t is list and len(entries) == 1 and i and all(type(j) is int for j in i):
            if tracing:
                converted.append(i)
                continue
            for j in i:  # (eager checks them all before it writes)
                _check_index(rt, j, shape[0] if shape else 0)
            converted.append(value_data(i))  # positions of this instance: data
        elif (
            t is LazyTensor
            and len(entries) == 1
            and i.ndim == 1
            and not i.dtype.is_floating_point
            and i.dtype != torch.bool
        ):
            converted.append(i)  # per-instance positions along dim 0
        elif i is Ellipsis and Ellipsis not in entries[:k]:
            converted.append(i)
            dim = len(shape) - (len(entries) - k - 1)  # (each entry after it takes a dim)
            continue
        else:
            raise UnsupportedOpError(
                f"x[index] = value with the index entry {i!r} (at {user_line(4)}) cannot be "
                "batched: use ints, slices and ..., a per-instance int scalar tensor, a list "
                "or tensor of positions alone, or one boolean mask; or build the tensor with "
                "torch.where / torch.stack"
            )
        dim += 1
    if masks and len(entries) == 1 and (type(value) is LazyTensor or isinstance(value, Tensor)):
        mask = _leading_mask(x, index, value)  # a tensor value for every masked entry:
        if value.dtype != x.dtype and math.prod(value.shape) != 1:
            raise RuntimeError(  # (eager casts only a value of one element)
                "Index put requires the source and destination dtypes match, got "
                f"{_type_name(x.dtype)} for the destination and {_type_name(value.dtype)} "
                f"for the source. ({_instance_at(rt, 4)})"
            )
        if mask is not None:  # eager broadcasts it to each, as where does
            return torch.where(mask, value if value.dtype == x.dtype else value.to(x.dtype), x)
        out = _entry_put(x, index, value)  # (or one value per masked entry)
        if out is not None:
            return out
    if masks and (len(entries) != 1 or has_lazy(value) or (
        isinstance(value, Tensor) and value.numel() != 1
    )):  # fmt: skip
        raise UnsupportedOpError(
            f"x[mask] = value (at {user_line(4)}) is batched for one boolean mask of x's "
            "leading dims and a value that broadcasts against one masked entry (a number, a "
            "0-dim tensor, a row) or has one such value per masked entry; write "
            "torch.where(mask, value, x)"
        )
    if tracing:
        return record(PUT, func, args, kwargs)
    index = tuple(converted) if type(index) is tuple else converted[0]
    node = x.node if type(x) is LazyTensor else None
    into = (
        node is not None
        and (node.op is PUT or node.op is PUT_INTO or node.op is RAGGED_PUT)
        and not node.used
        and id(node.outs) not in rt.shared
    )
    if (
        not into
        and config.RAGGED_ROWS
        and node is not None
        and type(index) is LazyTensor
        and index.ndim == 0
        and not kwargs
    ):
        return _ragged_put(rt, func, x, index, value)
    return record(PUT_INTO if into else PUT, func, (x, index, value), kwargs)


def _type_name(dtype: torch.dtype) -> str:
    """torch's C++ name of ``dtype`` (``Float``, ``Long``), as its errors write it."""
    with torch._C.DisableTorchFunction():
        return torch.empty(0, dtype=dtype).type().rsplit(".", 1)[-1].removesuffix("Tensor")


def _entry_put(x, mask: LazyTensor, value):
    """``x[mask] = value`` with one value per masked entry (``y[m] = y[m] * 2``): a tensor
    of (count, *e) or (1, *e), ``e`` broadcasting against one entry. The mask is read
    (the count is each instance's own, as ``y[m]`` reads it), and the write is
    ``where(mask, value.index_select(0, rank), x)``, ``rank`` each entry's place among
    the selected ones (the instance's data): a lookup and an elementwise op that batch
    across instances whatever their counts, gradients to ``x`` and ``value`` as eager's.
    A count ``value`` does not match raises eager's error. None: not such a write."""
    k = mask.ndim
    shape = tuple(x.shape)
    entry = shape[k:]
    vshape = tuple(value.shape)
    if k == 0 or k > len(shape) or tuple(mask.shape) != shape[:k] or not vshape:
        return None
    row = vshape[1:]
    if len(row) > len(entry):
        return None
    try:
        if tuple(torch.broadcast_shapes(row, entry)) != entry:
            return None
    except RuntimeError:
        return None
    v = value if value.dtype == x.dtype else value.to(x.dtype)
    ones = (1,) * (len(entry) - len(row))
    where_mask = mask.reshape((*mask.shape, *(1,) * len(entry)))
    if vshape[0] == 1:  # one value for every selected entry: eager broadcasts it
        return torch.where(where_mask, v.reshape((*ones, *row)), x)
    m = _demanded(mask, "x[mask] = value")
    with torch._C.DisableTorchFunction():
        flat = m.reshape(-1)
        count = int(flat.sum())
        if vshape[0] != count:
            raise RuntimeError(
                f"shape mismatch: value tensor of shape {list(vshape)} cannot be broadcast "
                f"to indexing result of shape {[count, *entry]} ({_instance_at(graph.RT, 5)})"
            )
        rank = (flat.cumsum(0) - 1).clamp_(min=0)
    if count == 0:
        return x  # (nothing selected: eager writes nothing)
    full = v.index_select(0, _read_data(rank, mask))
    return torch.where(where_mask, full.reshape((*mask.shape, *ones, *row)), x)


def _ragged_put(rt, func, x, index, value):
    """``x[i] = value`` at one per-instance int ``i`` of dim 0, recorded with a signature
    that leaves out x's leading size (RAGGED_ROWS): the writes into values of every size
    batch together (executor._run_ragged_put); each result is the node's own."""
    inputs = [x, index]
    v = graph.freeze(value, inputs)
    sig = (RAGGED_PUT, func, (x.shape[1:], x.dtype), index.key, v)
    key = (sig, x.shape)
    info = rt.sig_info.get(key)
    if info is None:  # (its shape and dtype: x's; meta checks the value broadcasts)
        info = rt.sig_info[key] = graph.infer(PUT, func, (x, index, value), {}, rt)
    node = graph.add_node(rt, RAGGED_PUT, func, (x, index, value), {}, inputs, info, sig)
    return graph.wrap_outputs(node, info)


def ragged_put_rule(xs: list, index: Tensor, V, lazy: bool) -> list | None:
    """Writes into per-node values ``xs`` (leading sizes differ) at the per-node ints
    ``index`` (n,), of ``V`` (the gathered values where ``lazy``, else one real value):
    one concatenated copy of all of them written at each one's offset + its int; the
    results are views of it, one per node with a leading dim of one. None where an index
    is out of its own value's range (the caller runs each node alone: torch's error)."""
    sizes = [x.shape[0] for x in xs]
    size = torch.tensor(sizes, device=index.device)
    if bool(((index < -size) | (index >= size)).any()):
        return None
    X = torch.cat(xs)
    at = size.cumsum(0) - size + torch.where(index < 0, index + size, index)
    X[at] = _aligned(V, X.ndim - 1) if lazy else V
    return list(X.unsqueeze(0).split_with_sizes(sizes, 1))


def _aligned(V, rank: int) -> Tensor:
    """A batch of per-instance values ``V`` (n, *vs) shaped to broadcast against a batch
    of targets of ``rank`` dims each (one instance's), as eager broadcasts one value."""
    vs = V.shape[1:]
    if len(vs) > rank:  # (leading ones, as eager strips them)
        vs = vs[len(vs) - rank :]
    return V.reshape(V.shape[0], *(1,) * (rank - len(vs)), *vs)


def put_rule(node, xs, n):
    """A batch of ``x[index] = value``: the rows of ``x`` (copied; PUT_INTO writes into
    them where they are its own contiguous rows), ints as a column of indices per entry."""
    x, index, value = node.args
    it = iter(xs)
    if type(x) is LazyTensor:
        X = next(it)
        if node.op is not PUT_INTO or not X.is_contiguous():
            X = X.clone()
    else:
        X = x.expand(n, *x.shape).clone()
    entries = index if type(index) is tuple else (index,)
    batched = [next(it) if type(i) is LazyTensor else i for i in entries]
    V = next(it) if type(value) is LazyTensor else value
    if any(type(i) is LazyTensor and i.dtype == torch.bool for i in entries):
        X[batched[0]] = V
        return (X,)
    if len(entries) == 1 and isinstance(entries[0], Tensor) and type(entries[0]) is not LazyTensor:
        rank = X[0, entries[0]].ndim
        X[:, entries[0]] = V if type(value) is not LazyTensor else _aligned(V, rank)
        return (X,)
    if len(entries) == 1 and type(entries[0]) is LazyTensor and len(entries[0].shape) == 1:
        rows = torch.arange(n, device=X.device)[:, None]  # (positions: each row its own)
        X[rows, batched[0]] = _aligned(V, X.ndim - 1) if type(value) is LazyTensor else V
        return (X,)
    lazy = [type(i) is LazyTensor for i in entries]
    if n == 1 and not any(e is Ellipsis for e in entries):  # (the executor's rerun of one instance)
        _put_bounds(X, entries, batched)
    if any(lazy):
        rows = torch.arange(n, device=X.device)
        bidx = (rows, *batched)
    else:
        bidx = (slice(None), *batched)
    rank = X.ndim - 1 - sum(lazy) - sum(type(i) is int for i in entries)
    if type(value) is LazyTensor:
        V = _aligned(V, rank)
    elif isinstance(V, Tensor) and V.ndim > rank:  # (leading ones, as eager strips them)
        V = V.reshape(V.shape[V.ndim - rank :])
    X[bidx] = V
    return (X,)


def _put_bounds(X: Tensor, entries: tuple, batched: list) -> None:
    """Raise eager's IndexError for a per-instance int index out of its dim's range in a
    batch of one (the executor reruns a failed batch node by node to name the instance;
    the batched write's own error counts the batch dim)."""
    d = 0
    for e, b in zip(entries, batched):
        if type(e) is LazyTensor and e.ndim == 0 and not e.dtype.is_floating_point:
            size = X.shape[d + 1]
            i = int(b.reshape(-1)[0])
            if not -size <= i < size:
                raise IndexError(_out_of_bounds(i, d, size))
        d += e is not None


def special_setitem(func, args, kwargs):
    """``x[index] = value`` where analysis did not rewrite it (``x`` an attribute, an
    argument, an alias): a lazy ``x`` nothing has read yet is updated as written (the
    write recorded out of place and ``x`` rebound, ``in_place``); a real tensor shared by
    the instances cannot take one instance's value."""
    x, index, value = args
    fix = (
        "keep the tensor in a local variable of the function that made it (acrobat "
        "rewrites x[i] = v there), or build it with torch.stack / torch.cat / torch.where"
    )
    if type(x) is LazyTensor:
        return in_place(PUT, _put, (x, index, value), {}, "x[index] = value", fix)
    raise UnsupportedOpError(
        f"x[index] = value writes per-instance values into a real tensor (at "
        f"{user_line(3)}), which every instance shares inside f.map (a constant made in "
        f"the instance is made once for all of them); {fix}"
    )


def _lazy_setitem(self, index, value):
    special_setitem(T.__setitem__, (self, index, value), {})


_DROPOUT = torch.dropout  # (as imported: see fast_functions)


def _special_dropout(func, args, kwargs):
    training = _bind_kw(args, kwargs, 2, "training", True)
    p = _bind_kw(args, kwargs, 1, "p", 0.5)
    if func is _DROPOUT:  # torch.dropout(input, p, train); Tensor has no dropout method
        training = _bind_kw(args, kwargs, 2, "train", True)
    if not training or p == 0:
        return args[0]
    return record(DROPOUT, func, args, kwargs)


# (the functions as imported: see fast_functions)
_LIKE_FACTORIES = {
    torch.zeros_like: torch.zeros,
    torch.ones_like: torch.ones,
    torch.empty_like: torch.empty,
    torch.full_like: torch.full,
}


def _special_like(func, args, kwargs):
    """zeros_like(x) & co. depend only on x's shape: a shared constant, made once."""
    x = args[0]
    rest = args[1:]
    kw = dict(kwargs)
    kw.setdefault("dtype", x.dtype)
    kw.setdefault("device", x.device)
    target = _LIKE_FACTORIES.get(func)
    if target is not None:
        return graph.hoist(target, (tuple(x.shape), *rest), kw)
    return record(TABLE["rand_like"], func, args, kwargs)


# ---- the table -------------------------------------------------------------------------

T = Tensor
_UNARY: dict[str, tuple] = {
    "neg": (torch.neg, T.neg, T.__neg__, torch.negative),
    "abs": (torch.abs, T.abs, T.__abs__),
    "sigmoid": (torch.sigmoid, T.sigmoid, F.sigmoid),
    "tanh": (torch.tanh, T.tanh, F.tanh),
    "relu": (torch.relu, T.relu, F.relu),
    "gelu": (F.gelu,),
    "silu": (F.silu,),
    "elu": (F.elu,),
    "leaky_relu": (F.leaky_relu,),
    "softplus": (F.softplus,),
    "exp": (torch.exp, T.exp),
    "log": (torch.log, T.log),
    "log1p": (torch.log1p, T.log1p),
    "sqrt": (torch.sqrt, T.sqrt),
    "rsqrt": (torch.rsqrt, T.rsqrt),
    "sin": (torch.sin, T.sin),
    "cos": (torch.cos, T.cos),
    "square": (torch.square, T.square),
    "reciprocal": (torch.reciprocal, T.reciprocal),
    "sign": (torch.sign, T.sign),
    "floor": (torch.floor, T.floor),
    "ceil": (torch.ceil, T.ceil),
    "round": (torch.round, T.round),
    "logical_not": (torch.logical_not, T.logical_not),
    "bitwise_not": (torch.bitwise_not, T.bitwise_not, T.__invert__),
    "erf": (torch.erf, T.erf),
    "atan": (torch.atan, T.atan, torch.arctan),
    "tan": (torch.tan, T.tan),
    "sinh": (torch.sinh, T.sinh),
    "cosh": (torch.cosh, T.cosh),
    "asinh": (torch.asinh, T.asinh),
    "expm1": (torch.expm1, T.expm1),
    "exp2": (torch.exp2, T.exp2),
    "log2": (torch.log2, T.log2),
    "log10": (torch.log10, T.log10),
    "trunc": (torch.trunc, T.trunc),
    "frac": (torch.frac, T.frac),
    "nan_to_num": (torch.nan_to_num, T.nan_to_num),
    "isnan": (torch.isnan, T.isnan),
    "isinf": (torch.isinf, T.isinf),
    "isfinite": (torch.isfinite, T.isfinite),
    "clamp": (torch.clamp, T.clamp, torch.clip, T.clip),
    "contiguous": (T.contiguous,),
    "clone": (torch.clone, T.clone),
    "detach": (torch.detach, T.detach),
    "to": (T.to,),
    "type_as": (T.type_as,),
    "float": (T.float,),
    "double": (T.double,),
    "long": (T.long,),
    "int": (T.int,),
    "bool": (T.bool,),
    "half": (T.half,),
}
# What a batch calls in place of the user's function (the same function, batched faster)
BATCHED_FUNCS: dict = dict.fromkeys(_UNARY["tanh"], batched_tanh)

_BINARY: dict[str, tuple] = {
    "add": (torch.add, T.add, T.__add__),
    "sub": (torch.sub, T.sub, T.__sub__, torch.subtract),
    "mul": (torch.mul, T.mul, T.__mul__, torch.multiply),
    "div": (torch.div, T.div, T.__truediv__, torch.true_divide, torch.divide),
    "floor_divide": (torch.floor_divide, T.__floordiv__),
    "remainder": (torch.remainder, T.__mod__, T.remainder),
    "pow": (torch.pow, T.pow, T.__pow__),
    "maximum": (torch.maximum, T.maximum),
    "minimum": (torch.minimum, T.minimum),
    "eq": (torch.eq, T.eq, T.__eq__),
    "ne": (torch.ne, T.ne, T.__ne__),
    "lt": (torch.lt, T.lt, T.__lt__),
    "le": (torch.le, T.le, T.__le__),
    "gt": (torch.gt, T.gt, T.__gt__),
    "ge": (torch.ge, T.ge, T.__ge__),
    "logical_and": (torch.logical_and, T.logical_and, T.__and__),
    "logical_or": (torch.logical_or, T.logical_or, T.__or__),
    "where": (torch.where, T.where),
    "lerp": (torch.lerp, T.lerp),
    "addcmul": (torch.addcmul, T.addcmul),
    "atan2": (torch.atan2, T.atan2, torch.arctan2),
    "hypot": (torch.hypot, T.hypot),
    "logaddexp": (torch.logaddexp, T.logaddexp),
}
# torch.mul / torch.div read a 0-dim second operand of a reduced float as a float32 number
_OPMATH_SCALAR = frozenset(_BINARY["mul"] + _BINARY["div"])
_WHERE_CONDITION = {torch.where: 0, T.where: 1}  # where's condition: no part in promotion
_name: str
_aliases: tuple
for _name, _aliases in {**_UNARY, **_BINARY}.items():
    _add(Op(_name, elementwise_rule, "elementwise", _aliases, fusible=True))


_NONZERO = torch.nonzero  # (captured at import: during a map torch's name is a stand-in)


def _special_where(func, args, kwargs):
    """``torch.where(condition)`` alone is ``torch.nonzero(condition, as_tuple=True)``,
    sized by the values: read, like ``nonzero`` (it was batched as the elementwise
    three-argument form once, silently wrong)."""
    if len(args) + len(kwargs) == 1:
        condition = args[0] if args else next(iter(kwargs.values()))
        return _special_sized(_NONZERO, (condition,), {"as_tuple": True})
    return record(TABLE["where"], func, args, kwargs)


TABLE["where"].special = _special_where

_add(
    Op(
        "masked_fill",
        masked_fill_rule,
        "elementwise",
        (torch.masked_fill, T.masked_fill),
        fusible=True,
        doc="a per-instance value tensor batches as torch.where",
    )
)
_add(
    Op(
        "dropout",
        dropout_rule,
        "elementwise",
        (F.dropout, torch.dropout, getattr(T, "dropout", F.dropout)),
        special=_special_dropout,
        fusible=True,
        doc="identity in eval mode; batched mask in training",
    )
)
_add(Op("rand_like", vmap_rule, "elementwise", (torch.rand_like, torch.randn_like)))


def multinomial_rule(node, xs, n):
    """``torch.multinomial`` of a batch: every instance's rows of probabilities drawn from
    at once (as eager draws per instance; the draws are not eager's: another stream)."""
    if len(xs) != 1 or type(node.args[0]) is not LazyTensor:
        return vmap_rule(node, xs, n)  # (a per-instance count or flag: instance by instance)
    p = xs[0]
    out = torch.multinomial(p.reshape(-1, p.shape[-1]), *node.args[1:], **node.kwargs)
    return (out.reshape(*p.shape[:-1], out.shape[-1]),)


def bernoulli_rule(node, xs, n):
    """``torch.bernoulli`` / ``torch.poisson`` of a batch: one draw per entry
    (elementwise, of the batch's probabilities or rates)."""
    if len(xs) != 1 or type(node.args[0]) is not LazyTensor:
        return vmap_rule(node, xs, n)
    draw = torch.poisson if node.op.name == "poisson" else torch.bernoulli
    return (draw(xs[0], *node.args[1:], **node.kwargs),)


def normal_rule(node, xs, n):
    """``torch.normal(mean, std)`` / ``torch.binomial(count, prob)`` of a batch, either
    operand per instance (or shared): one draw per entry (``Normal(mu, sigma).sample()``,
    ``Binomial(n, p).sample()``)."""
    it = iter(xs)
    a, b = (next(it) if type(v) is LazyTensor else v for v in node.args[:2])
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        a, b = torch.broadcast_tensors(a, b)
    draw = torch.binomial if node.op.name == "binomial" else torch.normal
    return (draw(a, b, *node.args[2:], **node.kwargs),)


for _name, _rule, _kind, _aliases, _doc in (
    ("multinomial", multinomial_rule, "shape", (torch.multinomial, T.multinomial),
     "samples of each instance's categorical rows (a sampling decoder's next token)"),
    ("normal", normal_rule, "elementwise", (torch.normal,),
     "a normal draw per entry of a per-instance mean or standard deviation"),
    ("bernoulli", bernoulli_rule, "elementwise", (torch.bernoulli, T.bernoulli),
     "a 0/1 draw per entry of per-instance probabilities"),
    ("poisson", bernoulli_rule, "elementwise", (torch.poisson,),
     "a Poisson draw per entry of per-instance rates (a count model's sample)"),
    ("binomial", normal_rule, "elementwise", (torch.binomial,),
     "a binomial draw per entry of per-instance counts or probabilities"),
):  # fmt: skip
    _add(Op(_name, _rule, _kind, _aliases, doc=_doc))


def _special_gumbel_softmax(func, args, kwargs):
    """``F.gumbel_softmax``, recorded as the ops it is made of (Jang et al., 2017): Gumbel
    noise drawn per instance (``-log`` of exponential draws into a new tensor:
    graph._draw), a softmax at temperature ``tau``, and with ``hard`` the one-hot of its
    argmax with the soft values' gradient (straight-through)."""
    bound = inspect.signature(_GUMBEL_SOFTMAX).bind(*args, **kwargs)
    bound.apply_defaults()
    logits, tau, hard, dim = (bound.arguments[k] for k in ("logits", "tau", "hard", "dim"))
    noise = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    gumbels = -noise.exponential_().log()
    soft = ((logits + gumbels) / tau).softmax(dim)
    if not hard:
        return soft
    index = soft.argmax(dim, keepdim=True)
    one_hot = torch.zeros_like(logits).scatter(dim, index, 1.0)
    return one_hot - soft.detach() + soft


def _special_pad_sequence(func, args, kwargs):
    """``nn.utils.rnn.pad_sequence`` of an instance's own sequences (a document's
    sentences), recorded as what it is: each padded to the longest along its first dim,
    then stacked (their lengths are known when recorded)."""
    bound = inspect.signature(_PAD_SEQUENCE).bind(*args, **kwargs)
    bound.apply_defaults()
    seqs = list(bound.arguments["sequences"])
    first = bound.arguments["batch_first"]
    value, side = bound.arguments["padding_value"], bound.arguments["padding_side"]
    if side not in ("left", "right"):
        raise ValueError(f"pad_sequence: padding_side must be 'left' or 'right', not {side!r}")
    longest = max(t.shape[0] for t in seqs)
    padded = []
    for t in seqs:
        extra = longest - t.shape[0]
        pads = [0, 0] * (len(t.shape) - 1) + ([extra, 0] if side == "left" else [0, extra])
        padded.append(F.pad(t, pads, value=value) if extra else t)
    return torch.stack(padded, 0 if first else 1)


_PAD_SEQUENCE = nn.utils.rnn.pad_sequence
_add(
    Op(
        "pad_sequence",
        vmap_rule,
        "shape",
        (torch._C._nn.pad_sequence,),  # (what nn.utils.rnn.pad_sequence calls)
        special=_special_pad_sequence,
        doc="recorded as its parts: each sequence padded to the longest, then stacked",
        extra={"decomposes": True},
    )
)
_GUMBEL_SOFTMAX = F.gumbel_softmax
_add(
    Op(
        "gumbel_softmax",
        vmap_rule,
        "reduce",
        (F.gumbel_softmax,),
        special=_special_gumbel_softmax,
        doc="recorded as its parts: per-instance Gumbel noise, softmax, straight-through",
        extra={"decomposes": True},
    )
)
# draws (shapes from the meta kernels; never hoisted, nor one run for equal operand rows)
graph.IMPURE_OPS.update(
    ["dropout", "rand_like", "multinomial", "bernoulli", "normal", "poisson", "binomial"]
)
graph.INDEX_OPS.update(["loss", "one_hot", "scatter", "embedding", "index_select", "take"])
_add(
    Op(
        "zeros_like",
        vmap_rule,
        "factory",
        (torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like),
        special=_special_like,
        doc="a shared constant of the operand's shape",
    )
)

for _name, _aliases in {
    "reshape": (torch.reshape, T.reshape),
    "view": (T.view,),
    "view_as": (T.view_as,),
    "reshape_as": (T.reshape_as,),
    "flatten": (torch.flatten, T.flatten),
    "unflatten": (torch.unflatten, T.unflatten),
    "squeeze": (torch.squeeze, T.squeeze),
    "unsqueeze": (torch.unsqueeze, T.unsqueeze),
}.items():
    _add(Op(_name, reshape_rule, "shape", _aliases))
_add(Op("expand", expand_rule, "shape", (T.expand, T.expand_as)))

def _special_whole(func, args, kwargs):
    """``x.max()`` / ``torch.sum(x)`` ... of one lazy ``x`` over all its elements: a WHOLE
    node whose signature leaves out ``x``'s shape (RAGGED_ROWS), so the reductions of
    values of different sizes batch together (executor.run_batch). Anything else (dims,
    kwargs, an empty or 0-d x, a block's trace) records as usual."""
    op = FUNCS[func]
    rt = graph.RT
    x = args[0] if args else None
    if (
        kwargs
        or len(args) != 1
        or type(x) is not LazyTensor
        or op.name not in _WHOLE
        or not config.RAGGED_ROWS
        or rt is None
        or rt.tracer is not None
        or x.ndim == 0
        or x.shape.numel() == 0
    ):
        return record(op, func, args, kwargs)
    whole = _WHOLE[op.name]
    sig = (whole, func, x.dtype)
    info = rt.sig_info.get(sig)
    if info is None:
        info = rt.sig_info[sig] = graph.infer(op, func, args, kwargs, rt)
    return graph.wrap_outputs(graph.add_node(rt, whole, func, args, {}, [x], info, sig), info)


def whole_rule(nodes: list, values: list) -> Tensor:
    """The whole reductions of ``nodes`` over their values (each its own shape): flattened,
    padded to the longest with the reduction's neutral element, reduced along dim 1."""
    name = nodes[0].op.name
    flat = [v.reshape(-1) for v in values]
    fill = neutral_value(NEUTRAL[name], flat[0].dtype)
    X = torch.nn.utils.rnn.pad_sequence(flat, batch_first=True, padding_value=fill)
    return whole_padded(name, X, values)


def whole_padded(name: str, X: Tensor, values: list) -> Tensor:
    """The whole reduction ``name`` of each row of ``X``, the flattened ``values`` (tensors
    or LazyTensors: their sizes divide a mean) padded with its neutral element."""
    if name == "mean":
        sizes = [math.prod(v.shape) for v in values]
        return X.sum(1) / torch.tensor(sizes, dtype=X.dtype, device=X.device)
    return whole_rows(name, X)


def whole_rows(name: str, X: Tensor, **kw) -> Tensor:
    """The whole reduction ``name`` of each row of the matrix ``X``."""
    fn = torch.amax if name == "max" else torch.amin if name == "min" else getattr(torch, name)
    return fn(X, 1, **kw)


# per reduction (and softmax), its neutral element: what a pad holds so that it changes
# nothing (whole reductions here, padded programs in acrobat/padding.py)
NEUTRAL = {
    "sum": "zero", "mean": "zero", "any": "zero", "prod": "one", "all": "one",
    "amax": "low", "max": "low", "argmax": "low", "logsumexp": "low", "softmax": "low",
    "log_softmax": "low", "amin": "high", "min": "high", "argmin": "high",
}  # fmt: skip


def neutral_value(neutral: str, dtype: torch.dtype):
    """The neutral element ``neutral`` ("zero", "one", "low", "high") of ``dtype``."""
    if dtype is torch.bool:
        return neutral in ("one", "high")
    if dtype.is_floating_point or dtype.is_complex:
        return {"zero": 0.0, "one": 1.0, "low": -math.inf, "high": math.inf}[neutral]
    info = torch.iinfo(dtype)
    return {"zero": 0, "one": 1, "low": info.min, "high": info.max}[neutral]


# the whole reductions' op rows (named as the reduction in the stats)
_WHOLE = {
    name: Op(name, whole_rule, "whole", doc=f"{name} of a whole value of any shape")
    for name in ("sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin",
                 "all", "any")
}  # fmt: skip


for _name, _aliases in {
    "sum": (torch.sum, T.sum),
    "mean": (torch.mean, T.mean),
    "prod": (torch.prod, T.prod),
    "amax": (torch.amax, T.amax),
    "amin": (torch.amin, T.amin),
    "max": (torch.max, T.max),
    "min": (torch.min, T.min),
    "argmax": (torch.argmax, T.argmax),
    "argmin": (torch.argmin, T.argmin),
    "logsumexp": (torch.logsumexp, T.logsumexp),
    "all": (torch.all, T.all),
    "any": (torch.any, T.any),
}.items():
    _add(Op(_name, reduce_rule, "reduce", _aliases, special=_special_whole))

for _name, _reduce in (("is_all_true", torch.all), ("is_any_true", torch.any)):
    # torch.distributions' argument checks: recorded as the reduction they are
    _add(
        Op(
            _name,
            reduce_rule,
            "reduce",
            (getattr(torch, "_" + _name),),
            special=lambda func, args, kwargs, _r=_reduce: record(FUNCS[_r], _r, args, kwargs),
            doc=f"torch._{_name}(x): {_reduce.__name__}(x), as torch.distributions checks",
        )
    )
_add(Op("softmax", softmax_rule, "reduce", (torch.softmax, T.softmax, F.softmax)))
_add(Op("log_softmax", softmax_rule, "reduce", (torch.log_softmax, T.log_softmax, F.log_softmax)))
_add(
    Op("cat", cat_rule, "shape", (torch.cat, torch.concat, torch.concatenate),
       extra={"flat": flat_parts})
)  # fmt: skip
_add(Op("stack", cat_rule, "shape", (torch.stack,), extra={"flat": flat_parts}))
TABLE["cat"].special = TABLE["stack"].special = _special_flat
# The nodes _special_flat records: the part count is per node, not in the signature.
RAGGED_STACK = Op("stack", ragged_rule, "ragged", doc="stack of any number of parts")
RAGGED_CAT = Op("cat", ragged_rule, "ragged", doc="cat of any number of parts")
for _name, _aliases in {
    "chunk": (torch.chunk, T.chunk),
    "split": (torch.split, T.split),
    "unbind": (torch.unbind, T.unbind),
    "narrow": (torch.narrow, T.narrow),
    "select": (torch.select, T.select),
    "transpose": (torch.transpose, T.transpose, torch.swapaxes, T.swapaxes),
    "t": (torch.t, T.t),
    "permute": (torch.permute, T.permute),
}.items():
    _add(Op(_name, split_rule, "shape", _aliases))


def _special_select_narrow(func, args, kwargs):
    """``select(x, dim, i)`` / ``narrow(x, dim, i, length)`` with a per-instance 0-d index
    tensor ``i`` (torch accepts one where an int goes): the shape is the same for every
    instance, the rows differ, so they record as a row pick (``x[..., i]``) and an
    ``index_select`` of ``arange(length) + i`` (torch's vmap has no rule for the tensor
    forms). With ints, as usual."""
    name = FUNCS[func].name  # (func is the original: see fast_functions)
    x = _bind_kw(args, kwargs, 0, "input")
    dim = _bind_kw(args, kwargs, 1, "dim")
    start = _bind_kw(args, kwargs, 2, "index" if name == "select" else "start")
    if type(start) is not LazyTensor or type(dim) is not int:
        return record(TABLE[name], func, args, kwargs)
    if not graph.index_like(start):
        raise UnsupportedOpError(
            f"torch.{name} given a per-instance index of shape {tuple(start.shape)} and "
            f"dtype {start.dtype} (at {user_line(2)}): it takes a 0-d integer tensor"
        )
    ndim = len(x.shape)
    d = dim + ndim if dim < 0 else dim
    if name == "select":
        return x[(slice(None),) * d + (start,)]
    length = _bind_kw(args, kwargs, 3, "length")
    return x.index_select(d, torch.arange(length, device=x.device) + start)


TABLE["select"].special = TABLE["narrow"].special = _special_select_narrow

# Rows batched by the vmap fallback: ops plain per-instance code uses (legacy TreeLSTM code's
# ``.repeat``, normalisations, more activations), correct for whatever torch can vmap.
for _name, _aliases in {
    "repeat": (T.repeat,),
    "tile": (torch.tile, T.tile),
    "flip": (torch.flip, T.flip),
    "roll": (torch.roll, T.roll),
    "tril": (torch.tril, T.tril),
    "triu": (torch.triu, T.triu),
    "cumsum": (torch.cumsum, T.cumsum),
    "cumprod": (torch.cumprod, T.cumprod),
    "outer": (torch.outer, T.outer),
    "norm": (torch.norm, T.norm, torch.linalg.vector_norm),
    "normalize": (F.normalize,),
    "cosine_similarity": (F.cosine_similarity, torch.cosine_similarity),
    "hardtanh": (F.hardtanh, F.relu6),
    "selu": (torch.selu, F.selu, F.celu, torch.celu),
    "mish": (F.mish, F.hardswish, F.hardsigmoid, F.softsign),
    # ... and orderings, spreads, matrix parts, padding, scatters, and the losses a
    # training step computes per instance (a tree's per-node sentiment loss)
    "topk": (torch.topk, T.topk),
    "sort": (torch.sort, T.sort, torch.argsort, T.argsort),
    "kthvalue": (torch.kthvalue, T.kthvalue, torch.median, T.median),
    "std": (torch.std, T.std, torch.var, T.var),
    "diag": (torch.diag, T.diag, torch.trace, T.trace),
    "diagonal": (torch.diagonal, T.diagonal),
    "pad": (F.pad,),
    "one_hot": (F.one_hot,),
    "scatter": (
        torch.scatter, T.scatter, torch.scatter_add, T.scatter_add, torch.index_add, T.index_add
    ),
    "loss": (
        F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
        F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.kl_div,
    ),
    # convolutions and pooling over one instance's channels (a word's characters, a
    # node's image), unbatched as eager gets them
    "conv": (F.conv1d, F.conv2d),
    "pool": (
        F.max_pool1d, F.max_pool2d, F.avg_pool1d, F.avg_pool2d, F.adaptive_avg_pool1d,
        F.adaptive_avg_pool2d, F.adaptive_max_pool1d, F.max_pool1d_with_indices,
        F.max_pool2d_with_indices, F.adaptive_max_pool1d_with_indices,
    ),
    "prelu": (F.prelu, F.glu),
    "pairwise_distance": (F.pairwise_distance,),
    # resampling of one instance's own batch, (N, C, *spatial) as F.interpolate takes it
    "interpolate": (F.interpolate,),
    # bags of one instance's own (B, L) ids (nn.EmbeddingBag given ids[None])
    "embedding_bag": (F.embedding_bag,),
    # normalisations of one instance's channels with fixed statistics (an eval-mode
    # nn.BatchNorm*) or its own (group, instance, and batch norm without running stats)
    "batch_norm": (F.batch_norm,),
    "group_norm": (F.group_norm, F.instance_norm),
    "repeat_interleave": (torch.repeat_interleave, T.repeat_interleave),
    "float_power": (torch.float_power, T.float_power),
    "movedim": (torch.movedim, T.movedim, torch.moveaxis, T.moveaxis),
    "cdist": (torch.cdist,),
    "diff": (torch.diff, T.diff),
    "isclose": (torch.isclose, T.isclose),
    "cummax": (torch.cummax, T.cummax, torch.cummin, T.cummin),
    # Python answers read from values (a suspension): whether two tensors are equal
    "equal": (torch.equal, T.equal, torch.allclose, T.allclose),
    # sizes set by values: each instance's value is read first (a suspension), the op runs
    # on it and its result re-enters as the instance's data (_special_sized)
    "nonzero": (torch.nonzero, T.nonzero, torch.argwhere, T.argwhere),
    "unique": (torch.unique, T.unique, torch.unique_consecutive, T.unique_consecutive),
    "bincount": (torch.bincount, T.bincount),
    "masked_select": (torch.masked_select, T.masked_select),
    "attention": (F.scaled_dot_product_attention, F.multi_head_attention_forward),
}.items():  # fmt: skip
    _add(Op(_name, vmap_rule, "vmap", _aliases, doc="batched by torch.vmap"))


_SCATTERS = {
    torch.index_add: ("index_add", "source"),
    T.index_add: ("index_add", "source"),
    torch.scatter_add: ("scatter_add", "src"),
    T.scatter_add: ("scatter_add", "src"),
    torch.scatter: ("scatter", "src"),
    T.scatter: ("scatter", "src"),
}


def scatter_rule(node, xs, n):
    """``index_add`` / ``scatter_add`` / ``scatter`` along a dim: the rows flattened into
    one call, each row's indices offset by the start of its row's block, instead of
    torch.vmap's (20 graphs' messages summed into their nodes: 274 -> 33 us). Anything
    else (a scalar value, a reduce, an index smaller than its source) goes to vmap."""
    found = _SCATTERS.get(node.func)
    args, kwargs = node.args, node.kwargs or {}
    if found is None or len(args) + len(kwargs) != 4 or not set(kwargs) <= {"index", found[1]}:
        return vmap_rule(node, xs, n)
    method, src_name = found
    it = iter(xs)
    args = substitute(args, it)
    kwargs = {k: substitute(v, it) for k, v in kwargs.items()}
    names = ("input", "dim", "index", src_name)
    lazy = [type(_arg(node, k, name)) is LazyTensor for k, name in enumerate(names)]
    base, dim, index, src = (_bind_kw(args, kwargs, k, name) for k, name in enumerate(names))
    if type(dim) is not int or not isinstance(src, Tensor):
        return vmap_rule(node, xs, n)
    rank = len(node.info.metas[0][0])
    d = dim + rank if dim < 0 else dim
    base, index, src = (
        t if is_lazy else t.expand(n, *t.shape)
        for t, is_lazy in zip((base, index, src), (lazy[0], lazy[2], lazy[3]))
    )
    if method != "index_add" and index.shape != src.shape:
        return vmap_rule(node, xs, n)
    base = base.movedim(d + 1, 1)
    src = src.movedim(d + 1, 1)
    if method != "index_add":
        index = index.movedim(d + 1, 1)
    rows, size = base.shape[0], base.shape[1]
    check_range(index, size, method)
    starts = torch.arange(rows, device=index.device, dtype=index.dtype) * size
    flat_index = (index + starts.view(rows, *(1,) * (index.ndim - 1))).reshape(
        -1, *index.shape[2:]
    )
    flat = getattr(base.reshape(rows * size, *base.shape[2:]), method)(
        0, flat_index, src.reshape(-1, *src.shape[2:])
    )
    return (flat.reshape(rows, size, *base.shape[2:]).movedim(1, d + 1),)


_SIGNATURES: dict = {}  # function -> its inspect.Signature (_bind_batched)


def _bind_batched(node, xs) -> inspect.BoundArguments | None:
    """``node``'s call with its lazy operands replaced by their batched values ``xs``,
    bound to its function's parameters by name; None where they do not bind."""
    sig = _SIGNATURES.get(node.func)
    if sig is None:
        sig = _SIGNATURES[node.func] = inspect.signature(node.func)
    it = iter(xs)
    args = substitute(node.args, it)
    kwargs = {k: substitute(v, it) for k, v in (node.kwargs or {}).items()}
    try:
        return sig.bind(*args, **kwargs)
    except TypeError:
        return None


def loss_rule(node, xs, n):
    """``cross_entropy`` / ``nll_loss`` of one instance's (rows, classes) scores and class
    targets: every instance's rows flattened into one call with ``reduction="none"``,
    reduced per instance as torch does (a weighted mean over the weights of the counted
    targets). torch.vmap cannot run a weighted mean with label smoothing (its
    ``masked_select``); other losses and forms go to vmap."""
    func = node.func
    if func not in (F.cross_entropy, F.nll_loss):
        return vmap_rule(node, xs, n)
    bound = _bind_batched(node, xs)
    if bound is None:
        return vmap_rule(node, xs, n)
    bound.apply_defaults()
    kw = dict(bound.arguments)
    x, target = kw.pop("input"), kw.pop("target")
    lazy_x = type(_arg(node, 0, "input")) is LazyTensor
    lazy_t = type(_arg(node, 1, "target")) is LazyTensor
    reduction = kw.pop("reduction")
    if (
        not lazy_x
        or kw.get("size_average") is not None
        or kw.get("reduce") is not None
        or reduction not in ("mean", "sum", "none")
        or x.ndim != 3
        or target.dtype.is_floating_point
        or target.ndim != (2 if lazy_t else 1)
        or isinstance(kw.get("weight"), LazyTensor)
    ):
        return vmap_rule(node, xs, n)
    rows = x.shape[1]
    if not lazy_t:
        target = target.expand(n, rows)
    per = func(x.reshape(n * rows, -1), target.reshape(-1), reduction="none", **kw).view(n, rows)
    if reduction == "none":
        return (per,)
    total = per.sum(1)
    if reduction == "sum":
        return (total,)
    counted = target != kw.get("ignore_index", -100)
    weight = kw.get("weight")
    if weight is None:
        return (total / counted.sum(1),)
    w = weight[torch.where(counted, target, 0)]
    return (total / torch.where(counted, w, 0.0).sum(1),)


def interpolate_rule(node, xs, n):
    """``F.interpolate`` of one instance's (N, C, *spatial) input: the rows' batches
    flattened into one call (its sizes and scales are every row's), else vmap."""
    x = node.args[0] if node.args else node.kwargs.get("input")
    if type(x) is not LazyTensor or len(xs) != 1 or x.ndim < 3:
        return vmap_rule(node, xs, n)
    args, kwargs = node.args[1:], dict(node.kwargs or {})
    kwargs.pop("input", None)
    out = node.func(xs[0].reshape(n * x.shape[0], *x.shape[1:]), *args, **kwargs)
    return (out.reshape(n, x.shape[0], *out.shape[1:]),)


def embedding_bag_rule(node, xs, n):
    """``F.embedding_bag`` of one instance's (B, L) ids (no offsets): the rows' bags
    flattened into one call, per-sample weights alike; else vmap."""
    x = _arg(node, 0, "input")
    if type(x) is not LazyTensor or x.ndim != 2 or type(_arg(node, 1, "weight")) is LazyTensor:
        return vmap_rule(node, xs, n)
    bound = _bind_batched(node, xs)
    if bound is None:
        return vmap_rule(node, xs, n)
    kw = bound.arguments
    if kw.get("offsets") is not None:
        return vmap_rule(node, xs, n)
    kw["input"] = kw["input"].reshape(n * x.shape[0], x.shape[1])
    weights = kw.get("per_sample_weights")
    if weights is not None:
        weights = weights if weights.ndim == 3 else weights.expand(n, *weights.shape)
        kw["per_sample_weights"] = weights.reshape(n * x.shape[0], x.shape[1])
    out = node.func(**kw)
    return (out.reshape(n, x.shape[0], *out.shape[1:]),)


_POOLS_2D = frozenset(
    {F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.max_pool2d_with_indices}
)


def pool_rule(node, xs, n):
    """A pool of one instance's unbatched ``(C, L)`` (``(C, H, W)``) input: the rows are
    the pool's batch, one call; of a batch of its own (``(N, C, L)``, a sentence given as
    ``h[None]``): the rows' batches flattened into one. (torch.vmap runs some pools,
    adaptive max pooling among them, through a slow per-row fallback.)"""
    x = node.args[0] if node.args else None
    spatial = 2 if node.func in _POOLS_2D else 1
    if type(x) is not LazyTensor or len(xs) != 1 or x.ndim not in (spatial + 1, spatial + 2):
        return vmap_rule(node, xs, n)
    flat = xs[0] if x.ndim == spatial + 1 else xs[0].reshape(n * x.shape[0], *x.shape[1:])
    out = node.func(flat, *node.args[1:], **(node.kwargs or {}))
    outs = out if isinstance(out, tuple) else (out,)
    if x.ndim == spatial + 2:
        outs = tuple(o.reshape(n, x.shape[0], *o.shape[1:]) for o in outs)
    return tuple(outs)


_CONV1D = F.conv1d  # (the original: rules run while a map's stand-ins are in torch's namespaces)


def conv_rule(node, xs, n):
    """``F.conv1d`` / ``conv2d`` of one instance's unbatched ``(C, *spatial)`` input by
    shared weights: the rows are the convolution's batch, one call; of a batch of its own
    (``(N, C, *spatial)``): the rows' batches flattened into one. Per-instance weights or
    bias (a hypernetwork's): vmap."""
    x = _arg(node, 0, "input")
    spatial = 1 if node.func is _CONV1D else 2
    if (
        type(x) is not LazyTensor
        or len(xs) != 1
        or x.ndim not in (spatial + 1, spatial + 2)
        or any(type(a) is LazyTensor for a in (_arg(node, 1, "weight"), _arg(node, 2, "bias")))
    ):
        return vmap_rule(node, xs, n)
    flat = xs[0] if x.ndim == spatial + 1 else xs[0].reshape(n * x.shape[0], *x.shape[1:])
    args, kwargs = node.args, dict(node.kwargs or {})
    if args:
        args = (flat, *args[1:])
    else:
        kwargs["input"] = flat
    out = node.func(*args, **kwargs)
    return (out if x.ndim == spatial + 1 else out.reshape(n, x.shape[0], *out.shape[1:]),)


TABLE["pool"].rule = pool_rule
TABLE["conv"].doc = "shared weights: the instances are the call's batch; per-instance: torch.vmap"
TABLE["pool"].doc = "the instances are the call's batch (a pool's own batch flattened)"
TABLE["conv"].rule = conv_rule
TABLE["scatter"].rule = scatter_rule
TABLE["loss"].rule = loss_rule
TABLE["interpolate"].rule = interpolate_rule
TABLE["embedding_bag"].rule = embedding_bag_rule


def _special_one_hot(func, args, kwargs):
    """``F.one_hot(t)`` sizes its result by the largest value: refused; with
    ``num_classes`` a vmap batch."""
    if _bind_kw(args, kwargs, 1, "num_classes", -1) < 0:
        raise UnsupportedOpError(
            f"F.one_hot of a lazy tensor without num_classes (at {user_line(2)}): the "
            "result's size would depend on the values; pass num_classes"
        )
    return record(TABLE["one_hot"], func, args, kwargs)


TABLE["one_hot"].special = _special_one_hot


def one_hot_rule(node, xs, n):
    """``F.one_hot`` of the whole batch in one call (it maps every entry alike). Not
    torch.vmap's rule, whose one_hot checks no value: a class out of range made a row of
    zeros where eager raises; this call raises eager's error, and the executor names the
    instance (executor._explain_failure)."""
    classes = _bind_kw(node.args, node.kwargs or {}, 1, "num_classes", -1)
    if not _is_lazy(_arg(node, 0, "input")) or type(classes) is not int:
        return vmap_rule(node, xs, n)
    return (F.one_hot(xs[0], classes),)


TABLE["one_hot"].rule = one_hot_rule


def _special_norm_stats(func, args, kwargs):
    """``F.batch_norm`` in training mode (``F.instance_norm`` with input statistics)
    given running statistics updates them in place, instance after instance in the eager
    loop: refused. Fixed statistics (eval mode) or none: a vmap batch."""
    if func is F.group_norm:  # (no running statistics)
        return record(TABLE["group_norm"], func, args, kwargs)
    stats = _bind_kw(args, kwargs, 1, "running_mean")
    if func is F.batch_norm:
        updates, op = _bind_kw(args, kwargs, 5, "training", False), TABLE["batch_norm"]
    else:  # F.instance_norm
        updates, op = _bind_kw(args, kwargs, 5, "use_input_stats", True), TABLE["group_norm"]
    if updates and stats is not None:
        raise UnsupportedOpError(
            f"{func.__name__} in training mode with running statistics on a lazy tensor (at "
            f"{user_line(2)}): the eager loop updates the running statistics once per "
            "instance, in order; call model.eval() for inference, or use "
            "track_running_stats=False (or nn.LayerNorm / nn.GroupNorm) in training"
        )
    return record(op, func, args, kwargs)


def _real_tensor(data, dtype, device):
    with torch._C.DisableTorchFunction():  # (a method's special runs with the mode on)
        return torch.tensor(data, dtype=dtype, device=device)


def _special_repeat_interleave(func, args, kwargs):
    """``repeat_interleave`` sized by per-instance repeats would size its result by their
    values: refused (a number, or a tensor shared by every instance, is a vmap batch)."""
    repeats = _bind_kw(args, kwargs, 1, "repeats")
    if type(repeats) is LazyTensor and repeats.node.op is TABLE["tensor"]:
        # torch.tensor([...]) made in the instance: its values are known, as eager's are
        # (hoisted: every instance with the same repeats shares one tensor, and one batch)
        known = graph.hoist(
            _real_tensor, (repeats.node.data, repeats.dtype, graph.RT.default_device), {}
        )
        if len(args) > 1:
            args = (args[0], known, *args[2:])
        else:
            kwargs = {**kwargs, "repeats": known}
        repeats = known
    if type(repeats) is LazyTensor:
        raise UnsupportedOpError(
            f"repeat_interleave with per-instance repeats (at {user_line(2)}): the result's "
            "size would depend on their values; read them first (repeats.tolist())"
        )
    return record(TABLE["repeat_interleave"], func, args, kwargs)


# ---- ops whose result's size is set by values ----------------------------------------------
# ``x.nonzero()``, ``torch.unique(t)``, ``x.masked_select(m)``, ``x[mask]``: each instance's
# result has a size of its own. The instance reads the values the size depends on (a value
# demand: it suspends, and all instances' reads batch as any read does), the op runs on
# them as eager runs it, and the result enters the graph as the instance's data, like a
# tensor argument of map (its later ops batch by shape). Gradients flow where eager's do:
# masked_select and mask indexing read only the mask and keep ``x`` in the graph (a row
# lookup by the positions); nonzero, unique and bincount have none.


def _demanded(t: LazyTensor, what: str):
    """``t``'s value for an op sized by it, on the map's device: the instance suspends
    until it is computed, as at any read. Called from the recording mode's handler (a
    torch function written in Python reaches the mode so), the mode is off for the whole
    thread while the handler runs: it is put back for the time the other fibers run."""
    from acrobat.fibers import RecordMode, demand

    rt = graph.RT
    if rt is not None and rt.tracer is not None:
        raise LazyValueError(f"{what} reads values (at {user_line(4)}): not inside a block")
    if (
        rt is None
        or rt.fiber is None
        or rt.mode is None
        or not torch._C._is_torch_function_enabled()
    ):
        raise UnsupportedOpError(  # (torch's own evaluation: shape inference, a rule)
            f"{what} of a per-instance tensor sizes its result by the values (at "
            f"{user_line(4)}), which cannot be read here; read them first (x.tolist())"
        )
    handler = not isinstance(torch.overrides._get_current_function_mode(), RecordMode)
    if handler:
        torch._C._push_on_torch_function_stack(rt.mode)
    try:
        value = demand(t)
    finally:
        if handler:
            torch._C._pop_torch_function_stack()
    with torch._C.DisableTorchFunction():
        return value.to(t.device) if value.device != t.device else value


def _as_instance_data(value):
    """A real per-instance result re-entered as the instance's data (an input node)."""
    if isinstance(value, tuple):
        return type(value)(_as_instance_data(v) for v in value)
    if not isinstance(value, Tensor):
        return value
    with torch._C.DisableTorchFunction():
        shape, dtype, device = value.shape, value.dtype, value.device
    return record_data(INPUT, (INPUT, shape, dtype, device), value, shape, dtype)


def _special_sized(func, args, kwargs):
    """nonzero / argwhere / unique / bincount of a per-instance tensor (see above)."""
    name = getattr(func, "__name__", "op")
    real_args = tuple(_demanded(a, name) if type(a) is LazyTensor else a for a in args)
    real_kwargs = {}
    for k, v in kwargs.items():
        if type(v) is LazyTensor and torch.is_grad_enabled():
            raise UnsupportedOpError(  # (bincount's weights: read, they would lose it)
                f"{name}(..., {k}=) of a per-instance tensor with gradients on (at "
                f"{user_line(3)}): acrobat reads its values, which would drop a gradient "
                "(eager's has no derivative for it either); under torch.no_grad() it batches"
            )
        real_kwargs[k] = _demanded(v, name) if type(v) is LazyTensor else v
    with torch._C.DisableTorchFunction():
        out = func(*real_args, **real_kwargs)
    return _as_instance_data(out)


def _special_masked_select(func, args, kwargs):
    """``x.masked_select(mask)``: the mask is read, ``x`` stays in the graph (its gradient
    flows as eager's): the broadcast ``x`` flattened, looked up at the mask's positions."""
    x = _bind_kw(args, kwargs, 0, "input")
    mask = source = _bind_kw(args, kwargs, 1, "mask")
    if type(mask) is LazyTensor:
        mask = _demanded(mask, "masked_select")
    if type(x) is not LazyTensor:  # a real x, a per-instance mask: the result is data
        with torch._C.DisableTorchFunction():
            return _as_instance_data(torch.masked_select(x, mask))
    with torch._C.DisableTorchFunction():
        shape = torch.broadcast_shapes(tuple(x.shape), tuple(mask.shape))
        mask = mask.expand(shape)
    return _rows_where(x.expand(shape).reshape(-1), mask, source)


def _mask_index(x: LazyTensor, mask: LazyTensor):
    """``x[mask]`` by a per-instance boolean mask: the mask is read (its positions size the
    result), ``x`` stays in the graph: its leading dims flattened, looked up there."""
    k = len(mask.shape)
    if tuple(mask.shape) != tuple(x.shape[:k]):
        raise IndexError(
            f"the shape of the mask {list(mask.shape)} does not match the shape of the "
            f"indexed tensor {list(x.shape)} (at {user_line(3)})"
        )
    return _rows_where(x.reshape(-1, *x.shape[k:]), _demanded(mask, "x[mask]"), mask)


def _rows_where(rows: LazyTensor, mask: Tensor, source=None):
    """The rows of ``rows`` where the (read) ``mask``, flattened, is true: a lookup by the
    instance's positions, which enter as its data (``rows`` keeps its gradient). ``source``:
    the lazy tensor ``mask`` was read from, if any (``graph.Runtime.read_from``)."""
    with torch._C.DisableTorchFunction():
        positions = mask.reshape(-1).nonzero().reshape(-1)
    return rows.index_select(0, _read_data(positions, source))


def _read_data(value: Tensor, source):
    """``value`` (computed from the read value of the lazy ``source``, or None) as the
    instance's data; the data node remembers ``source`` for ops._readers_within."""
    data = _as_instance_data(value)
    if type(source) is LazyTensor and type(data) is LazyTensor:
        rt = graph.RT
        if rt is not None:
            rt.read_from[id(data.node)] = (data.node, source)
    return data


_ALLCLOSE = (torch.allclose, T.allclose)  # (captured at import: during a map torch's names
# are the stand-ins; the handler and the stand-ins pass the originals)


def _special_equal(func, args, kwargs):
    """``torch.equal(a, b)`` / ``torch.allclose(a, b, ...)`` of per-instance tensors: a
    Python bool, read from the elementwise comparison (the instance suspends, as at
    ``bool(t)``); ``equal`` of different shapes is False without a read, as eager's."""
    a, b = args[0], args[1]
    name = "allclose" if func in _ALLCLOSE else "equal"
    with torch._C.DisableTorchFunction():
        if name == "equal" and tuple(a.shape) != tuple(b.shape):
            return False
    if name == "equal":
        same = (a == b).all()
    else:
        same = torch.isclose(a, b, *args[2:], **kwargs).all()
    if type(same) is not LazyTensor:
        return bool(same)
    return bool(_demanded(same, name))


TABLE["equal"].special = _special_equal
_MOVEDIM = torch.movedim  # (torch.vmap has no rule for moveaxis, its alias)
TABLE["movedim"].special = lambda func, args, kwargs: record(
    TABLE["movedim"], _MOVEDIM, args, kwargs
)
TABLE["nonzero"].special = TABLE["unique"].special = _special_sized
TABLE["bincount"].special = _special_sized
TABLE["masked_select"].special = _special_masked_select

TABLE["batch_norm"].special = TABLE["group_norm"].special = _special_norm_stats
TABLE["repeat_interleave"].special = _special_repeat_interleave


def _special_attention(func, args, kwargs):
    """``F.multi_head_attention_forward(..., need_weights=False)`` returns ``(out, None)``
    (nn.TransformerEncoderLayer asks so): recorded with the weights, which are dropped."""
    op = TABLE["attention"]
    if func is not F.multi_head_attention_forward or _bind_kw(
        args, kwargs, 15, "need_weights", True
    ):
        return record(op, func, args, kwargs)
    if len(args) > 15:
        args = (*args[:15], True, *args[16:])
    else:
        kwargs = {**kwargs, "need_weights": True}
    out, _ = record(op, func, args, kwargs)
    return out, None


TABLE["attention"].special = _special_attention

_add(
    Op(
        "matmul",
        matmul_rule,
        "matmul",
        (
            torch.matmul,
            T.matmul,
            T.__matmul__,
            torch.mm,
            T.mm,
            torch.bmm,
            T.bmm,
            torch.mv,
            T.mv,
            torch.dot,
            T.dot,
        ),
        reused=("other",),
        doc="x @ W with W reused is one GEMM over the batch",
    )
)
_add(
    Op(
        "linear",
        linear_rule,
        "matmul",
        (F.linear,),
        reused=("weight", "bias"),
        doc="one GEMM over the batch reading the reused weight once",
    )
)
_add(
    Op(
        "addmm",
        vmap_rule,
        "matmul",
        (torch.addmm, T.addmm, torch.baddbmm, torch.einsum, F.bilinear),
    )
)
LINEAR = TABLE["linear"]
EMBEDDING = _add(
    Op("embedding", embedding_rule, "gather", (F.embedding,), reused=("weight",),
       special=_special_embedding)
)  # fmt: skip
_add(
    Op(
        "index_select",
        index_select_rule,
        "gather",
        (torch.index_select, T.index_select, torch.gather, T.gather),
    )
)
_add(Op("layer_norm", layer_norm_rule, "norm", (F.layer_norm,), reused=("weight", "bias")))
_add(
    Op(
        "rnn_cell",
        rnn_cell_rule,
        "cell",
        (torch.lstm_cell, torch.gru_cell, torch.rnn_tanh_cell, torch.rnn_relu_cell),
        reused=("w_ih", "w_hh", "b_ih", "b_hh"),
        doc="nn.LSTMCell/GRUCell/RNNCell: one fused cell call over the batch",
    )
)
GETITEM = _add(
    Op(
        "getitem",
        getitem_rule,
        "shape",
        (T.__getitem__,),
        special=_special_getitem,
        doc="basic & advanced indexing; param[int] is a batched row lookup",
    )
)
PICK = _add(
    Op(
        "pick",
        pick_rule,
        "shape",
        doc="x[i] with a per-instance Python int i: one batch whatever the ints",
    )
)
PUT = _add(
    Op(
        "put",
        put_rule,
        "shape",
        special=_special_put,
        doc="x[index] = value out of place (analysis rewrites a local's writes to it)",
        extra={"pure": False},
    )
)
PUT_INTO = _add(
    Op(
        "put_into",
        put_rule,
        "shape",
        doc="x[index] = value into the rows of a put's result nothing else reads",
        extra={"pure": False},
    )
)
# (not a row of the table: what _special_put records where RAGGED_ROWS applies)
RAGGED_PUT = Op(
    "put", put_rule, "ragged_put", doc="x[i] = value at a per-instance int, x of any size"
)
DROPOUT = TABLE["dropout"]
TENSOR = _add(
    Op(
        "tensor",
        tensor_data_rule,
        "data",
        (torch.tensor, torch.as_tensor),
        special=_special_tensor,
        doc="a per-instance constant from Python values",
    )
)
INPUT = _add(Op("input", input_data_rule, "data", (), doc="a per-instance tensor argument of map"))
TAKE = _add(
    Op(
        "take",
        take_rule,
        "data",
        (),
        reused=("base",),
        doc="param[i] with a per-instance Python int: one index_select",
    )
)

# Shared constants: made once per map call, whatever instance asks (hoisting).
HOISTED_FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
    torch.arange,
    torch.eye,
    torch.linspace,
    torch.zeros_like,
    torch.ones_like,
    torch.full_like,
}

# Tensor properties that make a new tensor object per access (``W.T``): hoisted so every
# instance reads the same shared object (its identity is what signatures compare).
HOISTED_GETTERS = {
    vars(torch._C.TensorBase)[name].__get__ for name in ("T", "mT", "H", "mH", "real")
}

# Ops whose rule reads every node (data ops); the rest read the first node as template.
DATA_OPS = {TENSOR, INPUT, TAKE}


# ---- LazyTensor methods and operators, from the table ------------------------------------


def _method(op, func):
    special = op.special
    if special is not None:

        def m(self, *args, **kwargs):
            return special(func, (self, *args), kwargs)
    else:

        def m(self, *args, **kwargs):
            return record(op, func, (self, *args), kwargs)

    m.__name__ = getattr(func, "__name__", op.name)
    return m


# ---- ops without a row: torch.vmap, generically --------------------------------------------
# A torch function or Tensor method with no row of its own (``torch.fmod``, ``torch.cross``,
# ``F.softmin``, ``x.acos()``...) records as a batch run by torch.vmap (``vmap_rule``),
# where it is a pure op of torch's: a native function (torch._C's functions, a Tensor
# method of the same name) or a function of torch.nn.functional, torch.special,
# torch.linalg, torch.fft or torch.functional; not an in-place update, not a random draw
# (a batch would draw other numbers than the eager loop), not one whose result's shape
# depends on its operands' values (checked when it is recorded: graph.infer runs it on
# ones and on other values). Its shape is inferred as any op's; padding declines it
# (an unknown op of a ragged value); bench/op_sweep.py checks every OpInfo of torch's
# against eager. config.GENERIC_VMAP off: such calls raise UnsupportedOpError, as before.

_GENERIC_NAMESPACES = (torch, F, torch.special, torch.linalg, torch.fft)
_NATIVE = frozenset(n for n in dir(torch._C._VariableFunctions) if not n.startswith("_"))
# Tensor methods that are ops but not torch functions: conversions, windows, reductions
_TENSOR_ONLY = frozenset(
    {"byte", "char", "short", "bfloat16", "cfloat", "cdouble", "chalf", "unfold",
     "sum_to_size", "expand_as", "view_as", "reshape_as", "type_as", "new_zeros",
     "new_ones", "new_full"}
)  # fmt: skip
_PUBLIC: dict = {}  # id(a public function of a torch namespace) -> its public name
_RANDOM_WORDS = ("rand", "normal", "bernoulli", "poisson", "binomial", "multinomial", "dropout",
                 "rrelu", "gumbel", "uniform", "exponential", "cauchy", "geometric", "random",
                 "seed", "fractional", "lowrank", "rng")  # fmt: skip
# not ops on values: storage, devices, autograd, printing, sizes, Python conversions
_NOT_OPS = frozenset(
    {"backward", "register_hook", "retain_grad", "data_ptr", "storage", "untyped_storage",
     "numpy", "tolist", "item", "pin_memory", "share_memory_", "record_stream", "cuda",
     "cpu", "to", "type", "is_pinned", "is_shared", "element_size", "nbytes", "dim",
     "size", "stride", "numel", "nelement", "ndimension", "get_device", "is_contiguous",
     "contiguous", "requires_grad_", "detach", "clone", "resize_", "set_", "empty_like",
     "new_empty", "new_empty_strided", "empty_strided", "as_strided", "as_strided_copy",
     "data", "grad", "is_leaf", "save", "load", "manual_seed", "set_printoptions",
     "result_type", "can_cast", "promote_types", "is_tensor", "is_storage",
     "is_nonzero", "is_same_size", "equal", "allclose", "unsafe_chunk", "unsafe_split",
     "unsafe_split_with_sizes", "as_strided_scatter"}
)  # fmt: skip
# settings and state, never ops: torch.set_rng_state(t) would set the generator when the
# shape inference runs it
_NOT_OP_PREFIXES = ("set_", "get_", "is_", "are_", "use_", "init_", "compile")
GENERIC: dict = {}  # func -> its generic Op, or None where it is not one

# torch functions that ask a tensor about its metadata: answered from the lazy tensor's
# (``torch.is_floating_point(x)``: torch.masked's reductions ask), no node recorded
QUERIES: dict = {
    torch.is_floating_point: lambda t: t.dtype.is_floating_point,
    torch.is_complex: lambda t: t.dtype.is_complex,
    torch.numel: lambda t: math.prod(t.shape),
    torch.is_same_size: lambda a, b: tuple(a.shape) == tuple(b.shape),
    torch.is_nonzero: lambda t: bool(t),  # (a value read, as bool(t))
}


def generic_op(func) -> Op | None:
    """The generic vmap row of ``func`` (made on first use), or None: see above."""
    if not config.GENERIC_VMAP:
        return None
    try:
        return GENERIC[func]
    except KeyError:
        pass
    except TypeError:  # (unhashable)
        return None
    op = None
    if not _PUBLIC:
        for ns in _GENERIC_NAMESPACES:
            for key, value in vars(ns).items():
                if not key.startswith("_") and callable(value) and not isinstance(value, type):
                    _PUBLIC.setdefault(id(value), key)
    owner = getattr(func, "__objclass__", None)
    if owner is torch._C.TensorBase:  # a method: native, or one of the Tensor-only ops
        name = getattr(func, "__name__", "")
        public = name in _NATIVE or name in _TENSOR_ONLY
    else:  # a function: by the name a torch namespace gives it (F.threshold's is _threshold)
        name = _PUBLIC.get(id(func), "")
        public = bool(name)
    if (
        public
        and not (name.endswith("_") and not name.endswith("__"))
        and not name.startswith(_NOT_OP_PREFIXES)
        and name not in _NOT_OPS
        and not any(w in name for w in _RANDOM_WORDS)
    ):
        op = Op(f"vmap:{name}", vmap_rule, "vmap", (func,), doc="batched by torch.vmap")
        op.extra["generic"] = True
    GENERIC[func] = op
    return op


def generic_method(name: str):
    """LazyTensor's method ``name`` where torch.Tensor's has no row but a generic one
    (installed on the class for later calls), or None."""
    func = getattr(torch.Tensor, name, None)
    op = generic_op(func) if func is not None else None
    if op is None:
        return None
    m = _method(op, func)
    setattr(LazyTensor, name, m)
    return m


def _reflected(op, func):
    def m(self, other):
        return record(op, func, (other, self), {})

    return m


_BITWISE_OPERATORS = [  # (operator, reflected, in place, symbol, function)
    ("__xor__", "__rxor__", "__ixor__", "^", torch.bitwise_xor),
    ("__lshift__", "__rlshift__", "__ilshift__", "<<", torch.bitwise_left_shift),
    ("__rshift__", "__rrshift__", "__irshift__", ">>", torch.bitwise_right_shift),
]


def _through(func, reflected: bool):
    """An operator of LazyTensor that calls ``func`` (the recording mode records it)."""
    if reflected:
        return lambda self, other: func(other, self)
    return lambda self, other: func(self, other)


def _positive(self):
    """``+x``: ``x`` itself, as eager's ``torch.positive`` returns it (a bool refused)."""
    if self.dtype == torch.bool:
        raise RuntimeError("The `+` operator, on a bool tensor is not supported.")
    return self


def _install_methods():
    names = {}
    for func, op in FUNCS.items():
        owner = getattr(func, "__objclass__", None)
        name = getattr(func, "__name__", None)
        if (
            owner is torch._C.TensorBase
            or owner is Tensor
            or getattr(func, "__qualname__", "").startswith("Tensor.")  # Python methods
            or func
            in (
                T.__getitem__,
                T.__matmul__,
            )
        ):
            if name and not hasattr(LazyTensor, name):
                names[name] = (op, func)
        elif name and isinstance(func, type(T.add)):
            names.setdefault(name, (op, func))
    for name, (op, func) in names.items():
        if name in LazyTensor.__dict__:
            continue
        setattr(LazyTensor, name, _method(op, func))
    # operators whose Tensor implementation is a Python wrapper in torch/_tensor.py
    for name, opname, func in [
        ("__add__", "add", torch.add),
        ("__sub__", "sub", torch.sub),
        ("__mul__", "mul", torch.mul),
        ("__truediv__", "div", torch.div),
        ("__matmul__", "matmul", torch.matmul),
        ("__pow__", "pow", torch.pow),
        ("__neg__", "neg", torch.neg),
        ("__abs__", "abs", torch.abs),
        ("__lt__", "lt", torch.lt),
        ("__le__", "le", torch.le),
        ("__gt__", "gt", torch.gt),
        ("__ge__", "ge", torch.ge),
        ("__eq__", "eq", torch.eq),
        ("__ne__", "ne", torch.ne),
        ("__floordiv__", "floor_divide", torch.floor_divide),
        ("__mod__", "remainder", torch.remainder),
        ("__and__", "logical_and", T.__and__),  # bitwise, as in torch (ints stay ints)
        ("__or__", "logical_or", T.__or__),
        ("__getitem__", "getitem", T.__getitem__),
    ]:
        setattr(LazyTensor, name, _method(TABLE[opname], func))
    for name, opname, func in [
        ("__radd__", "add", torch.add),
        ("__rsub__", "sub", torch.sub),
        ("__rmul__", "mul", torch.mul),
        ("__rtruediv__", "div", torch.div),
        ("__rmatmul__", "matmul", torch.matmul),
        ("__rpow__", "pow", torch.pow),
        ("__rfloordiv__", "floor_divide", torch.floor_divide),
        ("__rmod__", "remainder", torch.remainder),
        ("__rand__", "logical_and", torch.bitwise_and),
        ("__ror__", "logical_or", torch.bitwise_or),
    ]:
        setattr(LazyTensor, name, _reflected(TABLE[opname], func))
    # the bitwise operators of torch's generic ops (no row of their own): through the
    # recording mode, as the functions are, so they follow config.GENERIC_VMAP
    for name, rname, _, _, func in _BITWISE_OPERATORS:  # (in place: _install_in_place)
        setattr(LazyTensor, name, _through(func, False))
        setattr(LazyTensor, rname, _through(func, True))
    LazyTensor.__pos__ = _positive
    LazyTensor.__hash__ = object.__hash__

    def T_prop(self):
        return self.permute(*reversed(range(self.ndim))) if self.ndim > 2 else self.t()

    LazyTensor.T = property(T_prop)
    LazyTensor.mT = property(lambda self: self.transpose(-2, -1))
    # conjugate transposes (the conjugate is the tensor itself where it is real)
    LazyTensor.mH = property(lambda self: self.mT.conj() if self.dtype.is_complex else self.mT)
    LazyTensor.H = property(lambda self: self.T.conj() if self.dtype.is_complex else self.T)
    LazyTensor.unbind = _method(TABLE["unbind"], torch.unbind)


_install_methods()


# ---- in-place updates -------------------------------------------------------------------
# ``x += y``, ``x.add_(y)``, ``torch.relu_(x)``, ``F.relu(x, inplace=True)`` (``nn.ReLU(
# inplace=True)``): a LazyTensor is a handle on a node's output, so the update is recorded
# as the out-of-place op on a new handle of the old value, and ``x`` is rebound to the
# result. Every Python reference to ``x`` then reads the new value, as every reference to
# the eager tensor would. That is exact when nothing else can see the old value change:
# no node recorded so far reads ``x`` (``node.used``: a consumer holds ``x`` itself and
# would read the new value), and ``x`` is no view of another tensor and shares no object
# with other instances (a map's input, a hoisted ``torch.zeros(n)``). Anything else is
# refused with the out-of-place spelling to write; before, ``inplace=True`` was passed to
# the batched kernel, which updated whatever buffer it was given (a copy: the update was
# lost; a view of the producer's output: read by consumers recorded before it).

# ops that may return their operand itself (or a view of it) in eager; the conversions
# make a new tensor when they change the dtype
_ALIASING = frozenset({"contiguous", "detach", "diagonal"})
_CONVERSIONS = frozenset({"to", "type_as", "float", "double", "long", "int", "bool", "half"})
# op kinds whose eager results are new tensors, and other such ops
_FRESH_KINDS = frozenset({"elementwise", "reduce", "matmul", "gather", "norm", "cell", "vmap"})
_FRESH_NAMES = frozenset({"cat", "stack", "tensor", "take"})


def keeps_operands(op) -> bool:
    """Whether a computed node of ``op`` keeps its operands (executor.execute lets the
    others go): :func:`_fresh` follows a write's target and reads a conversion's operand
    dtype after they ran."""
    return op is PUT or op is PUT_INTO or op is RAGGED_PUT or op.name in _CONVERSIONS


def _fresh(node, idx: int) -> bool:
    """Whether output ``idx`` of ``node`` is, in eager, a tensor of its own (no view or
    alias of an operand, not an input of the map, not shared by instances)."""
    while (
        (node.op is PUT or node.op is PUT_INTO or node.op is RAGGED_PUT)
        and node.inputs
        and node.inputs[0].node is not node
    ):
        target = node.inputs[0]  # x[i] = v recorded as x = put(x, i, v): in eager x is
        node, idx = target.node, target.idx  # still the tensor it was
    op = node.op
    if op.kind == "block":  # the traced program's own output node
        trace = getattr(op.rule, "__self__", None)
        outs = getattr(trace, "out_lazies", None)
        if outs is None or idx >= len(outs):
            return False
        out = outs[idx]  # (one returned twice is one handle: block._finish_call)
        return _fresh(out.node, out.idx)
    if op.name in _FRESH_NAMES:
        return True
    if op.name in _CONVERSIONS:
        inputs = node.inputs
        return bool(inputs) and inputs[0].dtype != node.info.metas[idx][1]
    return op.kind in _FRESH_KINDS and op.name not in _ALIASING


_ARG0 = object()  # in_place's default target: its first argument


def _swap(a, x, old):
    """``a`` with the handle ``x`` (by identity) replaced by ``old``."""
    if a is x:
        return old
    t = type(a)
    if t is tuple or t is list:
        return t([_swap(v, x, old) for v in a])
    return a


# ``acc = torch.zeros(n)`` then ``acc += h`` (an accumulator): inside a map the zeros are
# hoisted, one real tensor that other instances may share and that cannot hold one
# instance's sum. Python's augmented assignment stores the operator's result back into its
# target (``acc = acc.__iadd__(h)``), so the update is recorded out of place and the target
# rebound to the lazy result; the constant stays as it was. That is exact when nothing else
# holds the constant: no other instance (they share the cached tensor), no recorded or
# hoisted op (they hold their operands), no other variable, list or attribute (an alias
# sees the update in eager). ``sys.getrefcount`` counts those holders: the update is taken
# where it counts exactly the references of a probe constant updated the same way in the
# same map (the target's, the operator's path's and the hoisting cache's). An in-place
# method (``acc.add_(h)``), whose result Python stores nowhere, is refused as before.

_NB_INPLACE = frozenset(
    i for i, (name, _) in enumerate(getattr(dis, "_nb_ops", ())) if name.startswith("NB_INPLACE")
)
_PROBING = threading.local()  # .on while the probe's update runs
_BASELINE: list = [None, 0]  # [id of the map's Runtime, the probe's count]


class _Probed(Exception):
    def __init__(self, count: int):
        self.count = count


def _augmenting(frame) -> bool:
    """Whether the user's ``frame`` stands at an augmented assignment's operator."""
    code, i = frame.f_code.co_code, frame.f_lasti
    if not 0 <= i < len(code) - 1:
        return False
    name = dis.opname[code[i]]
    if name == "BINARY_OP":  # Python 3.11+
        return code[i + 1] in _NB_INPLACE
    return name.startswith("INPLACE_")  # 3.10


def _probe(y) -> None:
    """``t += y`` on a new hoisted constant held by one local, as the user's target is
    (a NaN fill: a key no other call matches)."""
    from acrobat.fibers import RecordMode  # (the handler runs with the map's mode off)

    t = graph.hoist(torch.full, ((1,), float("nan")), {})
    with RecordMode():
        t += y


def _baseline(rt, y) -> int:
    """The references ``in_place`` counts on a hoisted constant that only the target of
    an augmented assignment holds, in this map (measured on :func:`_probe`)."""
    if _BASELINE[0] != id(rt):
        _BASELINE[:] = [id(rt), -1]  # (a probe that does not reach in_place: no count)
        _PROBING.on = True
        try:
            _probe(y)
        except _Probed as probed:
            _BASELINE[1] = probed.count
        except Exception:  # pragma: no cover - the refusal stands
            pass
        finally:
            _PROBING.on = False
    return _BASELINE[1]


def _constant_update(rt, x, count: int, y) -> str | None:
    """None where ``x op= y`` (``count``: references to ``x`` in ``in_place``) may be
    recorded out of place with the target rebound (see the section comment), else why not
    (the error's explanation)."""
    generic = (
        "the tensor is not per-instance (a parameter, or a constant made inside the map, "
        "such as torch.zeros(n), which is one tensor for every instance)"
    )
    if rt is None or rt.fiber is None or type(y) is not LazyTensor:
        return generic
    key = rt.factory_keys.get(id(x))
    if key is None or rt.hoisted.get(key) is not x or id(x) in rt.built:
        return generic  # not a constant made by a factory in this map, as made
    made = getattr(key[0], "__name__", "a factory")
    if rt.tracer is not None:
        return f"a block updates a constant it made with {made}(...) in place"
    frame = user_frame(sys._getframe(3))
    if frame is None or not _augmenting(frame):
        return (
            f"the tensor is a constant made with {made}(...) inside the map, one tensor "
            "that instances share; an augmented assignment (acc += h) rebinds its target "
            "to the new value, an in-place method cannot"
        )
    # (the arguments the hoisting cache keeps alive hold it where an op read it: that
    # op's result is cached, the constant not changed)
    held = sum(1 for t in graph._tensors(rt.hoist_keepalive) if t is x)
    if count != _baseline(rt, y) + held:
        return (
            f"the tensor is a constant made with {made}(...) inside the map, and something "
            "else holds it: another instance that made the same constant and still has it "
            "(instances share such constants), another name for it (snap = acc), or an "
            "op that read it; the update would not reach those"
        )
    return None


def in_place(op, func, args: tuple, kwargs: dict, what: str, fix: str, target=_ARG0):
    """Record ``what`` (an update of ``target``, by default ``args[0]``, with the result of
    ``func``, its out-of-place form; ``inplace`` / ``out`` already dropped from ``kwargs``)
    and rebind ``target``: see the section comment. ``fix``: the out-of-place statement
    the errors suggest."""
    x = args[0] if target is _ARG0 else target
    if type(x) is not LazyTensor:
        count = sys.getrefcount(x)
        if getattr(_PROBING, "on", False):
            raise _Probed(count)
        rt = graph.RT
        y = args[1] if target is _ARG0 and len(args) == 2 and not kwargs else None
        problem = _constant_update(rt, x, count, y)
        if problem is not None:
            raise UnsupportedOpError(
                f"{what} on a real tensor with per-instance operands (at {user_line(3)}): "
                f"{problem}; write it out of place: {fix}"
            )
        assert rt is not None  # (_constant_update: a map's fiber)
        # the op reads a copy, shared by every instance's update of this constant (they
        # batch), so that the constant's count stays the instances' own references
        key = ("augmented", rt.factory_keys[id(x)])
        copy = rt.hoisted.get(key)
        if copy is None:
            copy = rt.hoisted[key] = x.clone()
        out = record(op, func, (copy, y), kwargs)
        _fits(out, x, what, user_line(3))
        return out
    line = user_line(3)
    old = LazyTensor(x.node, x.idx, x.shape, x.dtype, x.key)
    _rebindable(x, what, fix, line, (args, kwargs), old)
    args = _swap(args, x, old)
    kwargs = {k: _swap(v, x, old) for k, v in kwargs.items()}
    special = op.special
    out = special(func, args, kwargs) if special is not None else record(op, func, args, kwargs)
    _fits(out, x, what, line)
    x.rebind(out.node, out.idx)
    return x


def _rebindable(x, what: str, fix: str, line: str, operands=(), old=None) -> None:
    """Raise where the lazy ``x`` may not be rebound to the result of an update of it
    (:func:`in_place`): a block's argument, a value an op recorded before reads (unless
    every such op computes the update's own ``operands``, then given ``old``, the old
    value's handle: :func:`_readers_within`), an input or shared constant, a possible
    view of another tensor."""
    node = x.node
    problem = None
    if node.op.name == "arg":  # a block's placeholder, while the block is traced
        raise LazyValueError(
            f"{what} updates an argument of a block in place (at {line}): a block must "
            "not change its inputs; return the new value instead"
        )  # (an automatic block then records the function op by op, where it is exact)
    if graph.readers(node, x.idx) and not (
        old is not None and (_readers_within(x, operands, old) or _pending_holders(x, old))
    ):
        problem = "an op recorded before it reads that tensor and must see the old value"
    elif node.op.name == "input":
        problem = (
            "the tensor is an input of the map or a constant shared by every instance "
            "(torch.zeros(n) inside a map is one tensor for all instances)"
        )
    elif not _fresh(node, x.idx):
        problem = f"the tensor may be a view of another one (made by {node.op.name})"
    if problem is not None:
        raise UnsupportedOpError(
            f"{what} on a lazy tensor (at {line}) cannot be recorded: {problem}; write it "
            f"out of place: {fix}"
        )


#: Most recorded nodes :func:`_readers_within` looks through for the readers of a value.
READERS_WALK = 64


def _readers_within(x, operands, old) -> bool:
    """Whether every operand of a recorded node that reads ``x``'s value (``node.used``
    counts them) belongs to a node the update's own ``operands`` are computed from
    (``x /= x.std()``, ``x[x < 0] = 0``: eager computed those from the old value before
    the update). If so, those holding ``x`` itself are given ``old`` in its place, so they
    keep reading the old value once ``x`` is rebound, and the update may be recorded."""
    rt = graph.RT
    if rt is None or rt.tracer is not None:
        return False
    target, idx = x.node, x.idx
    stack = [t for t in graph._tensors(operands) if type(t) is LazyTensor and t is not x]
    seen: set[int] = set()
    holders = []  # (node, position in its inputs) of the operands that are x itself
    count = 0
    while stack:
        nd = stack.pop().node
        if nd is target or id(nd) in seen:
            continue  # (computed readers count too: a value read flushed them)
        seen.add(id(nd))
        if len(seen) > READERS_WALK:
            return False
        source = rt.read_from.get(id(nd))
        if source is not None and source[0] is nd:  # x[mask]'s positions: the mask's read
            stack.append(source[1])
        for i, t in enumerate(nd.inputs):
            if t.node is target:
                if t.idx == idx:
                    count += 1
                    if t is x:
                        holders.append((nd, i))
            else:
                stack.append(t)
    if count != graph.readers(target, idx):
        return False  # (an op elsewhere reads it)
    for nd, i in holders:
        _give_old(nd, i, x, old)
    return True


def _give_old(nd, i: int, x, old) -> None:
    """Make ``nd``, whose input ``i`` is the handle ``x``, read ``old`` there (and in its
    call's arguments) instead: it keeps the value ``x`` had when it was recorded."""
    inputs = list(nd.inputs)  # (a tuple where the C path recorded it)
    inputs[i] = old
    nd.inputs = type(nd.inputs)(inputs)
    nd.args = _swap(nd.args, x, old)
    if nd.kwargs:
        nd.kwargs = {k: _swap(v, x, old) for k, v in nd.kwargs.items()}


#: Most pending nodes :func:`_pending_holders` looks through for the holders of a value.
PENDING_SCAN = 20_000


def _pending_holders(x, old) -> bool:
    """Give ``old`` (the old value's handle) in place of ``x`` to every node not yet
    computed that holds ``x`` itself (``z = h * 2; h += 1``; ``if h.sum() > 0: h += 1``,
    where the read computed the sum). A computed node has read its operands already, and
    a node that reads the old value through another handle (another output's, a copy)
    keeps reading it, so the update may be recorded: True. False where the map's pending
    nodes are more than PENDING_SCAN or a block is being traced (refused as before)."""
    rt = graph.RT
    if rt is None or rt.tracer is not None:
        return False
    buckets = rt.buckets.values()
    if sum(len(nodes) for nodes in buckets) > PENDING_SCAN:
        return False
    for nodes in buckets:
        for nd in nodes:
            for i, t in enumerate(nd.inputs):
                if t is x:
                    _give_old(nd, i, x, old)
    return True


# ``x.zero_()``, ``x.fill_(v)``, ``x.copy_(src)``: updates whose new value does not read x.
# Where in_place could rebind x, it is rebound to the new value: the fills to the constant
# ``torch.full_like(x, v)`` (one for every instance, as the map's factories are), the copy
# to src's own value where src is a lazy tensor of x's shape and dtype (lazy updates
# rebind, never write, so x and src stay apart as in eager). Anything else (a tensor fill
# value, a copy that broadcasts or casts, a real source, inside a block's trace) raises.


def _refused_reset(what: str, line: str, fix: str):
    return UnsupportedOpError(
        f"this in-place update is not supported inside f.map (at {line}): {what} of a lazy "
        f"tensor is recorded only as a fill with a number or a copy of a lazy tensor of its "
        f"shape and dtype; build the new tensor instead ({fix})"
    )


def _lazy_reset(method: str, what: str, fix: str):
    """``x.zero_()`` / ``x.fill_(v)`` of a lazy ``x`` (see above)."""

    def reset(self, *args, **kwargs):
        line = user_line(2)
        rt = graph.RT
        value = None
        if rt is not None and rt.tracer is None:
            value = _reset_value(self, method, args, kwargs)
        if value is None:
            raise _refused_reset(what, line, fix)
        _rebindable(self, what, fix, line)
        return _rebind(rt, self, value)

    reset.__name__ = method
    return reset


def _lazy_copy(self, src, non_blocking=False):
    line, fix = user_line(2), "x = src.clone(), torch.cat, torch.where"
    rt = graph.RT
    if (
        type(src) is not LazyTensor
        or src.shape != self.shape
        or src.dtype != self.dtype
        or rt is None
        or rt.tracer is not None
    ):
        raise _refused_reset("x.copy_(src)", line, fix)
    _rebindable(self, "x.copy_(src)", fix, line)
    self.rebind(src.node, src.idx)
    return self


def _rebind(rt, x, value):
    """Rebind the lazy ``x`` to the real tensor ``value`` (a constant of the map)."""
    from acrobat.executor import constant

    out = constant(rt, value)
    x.rebind(out.node, out.idx)
    return x


for _name, _reset in (
    ("fill_", _lazy_reset("fill_", "x.fill_(v)", "x = torch.full_like(x, v) or torch.where(...)")),
    ("zero_", _lazy_reset("zero_", "x.zero_()", "x = torch.zeros_like(x)")),
    ("copy_", _lazy_copy),
):
    setattr(LazyTensor, _name, _reset)


def _fits(out, x, what: str, line: str) -> None:
    """An in-place update keeps its tensor's shape and dtype: ``out`` must fit ``x``."""
    if type(out) is not LazyTensor or out.shape != x.shape or out.dtype != x.dtype:
        shape = getattr(out, "shape", None)
        dtype = getattr(out, "dtype", None)
        raise ShapeError(
            f"{what} (at {line}): the result ({tuple(shape) if shape is not None else out!r}, "
            f"{dtype}) does not fit the updated tensor ({tuple(x.shape)}, {x.dtype}); an "
            "in-place update keeps its tensor's shape and dtype"
        )


def out_kwarg(op, func, args: tuple, kwargs: dict):
    """``torch.add(a, b, out=y)``: the result written into ``y``, an in-place update of
    ``y`` (recorded as ``y = torch.add(a, b)`` where that is exact, as above)."""
    target = kwargs["out"]
    kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    name = getattr(func, "__name__", op.name)
    fix = f"y = {name}(...) without out="
    return in_place(op, func, args, kwargs, f"{name}(..., out=y)", fix, target)


def inplace_kwarg(op, func, args: tuple, kwargs: dict):
    """``F.relu(x, inplace=True)`` and the other functions with an ``inplace`` flag."""
    kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
    name = getattr(func, "__name__", op.name)
    fix = f"x = {name}(x, ...) without inplace=True"
    return in_place(op, func, args, kwargs, f"{name}(..., inplace=True)", fix)


#: torch's in-place functions (torch.relu_, F.leaky_relu_, ...) -> (op, out-of-place form)
INPLACE_FUNCS: dict = {}


def _in_place_method(name: str, op, func):
    what, fix = f"x.{name}(...)", f"x = x.{name[:-1]}(...)"

    def m(self, *args, **kwargs):
        return in_place(op, func, (self, *args), kwargs, what, fix)

    m.__name__ = name
    return m


def _in_place_operator(symbol: str, op, func):
    def m(self, other):
        return in_place(op, func, (self, other), {}, f"x {symbol}= y", f"x = x {symbol} y")

    return m


def _install_in_place():
    for name, op in TABLE.items():
        if op.kind not in ("elementwise", "vmap") or name in _ALIASING or name in _CONVERSIONS:
            continue
        if name in ("dropout", "rand_like", "where"):  # no in-place form to mirror
            continue
        method, inplace_method = getattr(T, name, None), getattr(T, name + "_", None)
        if method in FUNCS and inplace_method is not None:
            setattr(LazyTensor, name + "_", _in_place_method(name + "_", op, method))
            INPLACE_FUNCS[inplace_method] = (op, method)  # real.add_(lazy): refused clearly
        for owner in (torch, F):
            fn, inplace_fn = getattr(owner, name, None), getattr(owner, name + "_", None)
            if fn in FUNCS and inplace_fn is not None and inplace_fn not in FUNCS:
                INPLACE_FUNCS.setdefault(inplace_fn, (op, fn))
    for dunder, symbol, name, func in [
        ("__iadd__", "+", "add", torch.add),
        ("__isub__", "-", "sub", torch.sub),
        ("__imul__", "*", "mul", torch.mul),
        ("__itruediv__", "/", "div", torch.div),
        ("__ipow__", "**", "pow", torch.pow),
        ("__ifloordiv__", "//", "floor_divide", torch.floor_divide),
        ("__imod__", "%", "remainder", torch.remainder),
    ]:
        setattr(LazyTensor, dunder, _in_place_operator(symbol, TABLE[name], func))
        INPLACE_FUNCS[getattr(T, dunder)] = (TABLE[name], func)
    for dunder, symbol, name, func in [  # (bitwise on ints, logical on bools, as torch's)
        ("__iand__", "&", "logical_and", T.__and__),
        ("__ior__", "|", "logical_or", T.__or__),
    ]:
        setattr(LazyTensor, dunder, _in_place_operator(symbol, TABLE[name], func))
    for _, _, dunder, symbol, func in _BITWISE_OPERATORS:
        setattr(LazyTensor, dunder, _in_place_generic(symbol, func))


def _in_place_generic(symbol: str, func):
    """``x op= y`` of an operator of torch's generic ops (see _BITWISE_OPERATORS)."""

    def m(self, other):
        op = generic_op(func)
        if op is None:
            raise _unsupported_generic(func, symbol)
        return in_place(op, func, (self, other), {}, f"x {symbol}= y", f"x = x {symbol} y")

    return m


def _unsupported_generic(func, symbol: str) -> UnsupportedOpError:
    return UnsupportedOpError(
        f"x {symbol}= y (torch.{func.__name__}, at {user_line(3)}) is batched by torch.vmap, "
        "which config.GENERIC_VMAP switched off"
    )


_install_in_place()

# In-place methods whose update analysis may make out of place (see update): those of the
# ops acrobat batches (their out-of-place form is the op), the resets, not the draws
# (bernoulli_) and not those that change x's view of its storage (t_, squeeze_...).
UPDATE_METHODS = frozenset(
    {"zero_", "fill_"}
    | {
        name + "_"
        for name in chain(TABLE, (getattr(f, "__name__", "") for f in FUNCS))
        if getattr(Tensor, name, None) is not None and getattr(Tensor, name + "_", None) is not None
    }
    - {"bernoulli_", "detach_", "squeeze_", "unsqueeze_", "t_", "transpose_", "swapaxes_"}
    - {"swapdims_", "as_strided_", "resize_", "set_"}
)
LazyTensor.__setitem__ = _lazy_setitem  # type: ignore[index]  # x[i] = v: special_setitem


def supported_names() -> list[str]:
    names = set(TABLE)
    for f in FUNCS:
        n = getattr(f, "__name__", None)
        if n:
            names.add(n)
    return sorted(names)


# ---- fast paths for the commonest modules ---------------------------------------------
# nn.Embedding.forward calls F.embedding, a Python function that reaches the RecordMode
# through torch.overrides.handle_torch_function (argument scanning in Python): ~6 us per
# word lookup, most of a tree leaf's recording. While a map runs, the two commonest
# modules get a forward that records a lazy input directly; real inputs (other threads,
# parameter-only math) take the original forward.

_NO_MODE = torch._C.DisableTorchFunction
_ORIGINAL_FORWARD: dict[type, Callable] = {
    nn.Linear: nn.Linear.forward,
    nn.Embedding: nn.Embedding.forward,
    nn.Sequential: nn.Sequential.forward,
    nn.LSTM: nn.LSTM.forward,
    nn.GRU: nn.GRU.forward,
    nn.RNN: nn.RNN.forward,
}


def _param(module, cls, name: str):
    """``module.<name>`` for a parameter of an exact ``cls`` (nn.Linear, nn.Embedding):
    read from its ``_parameters`` (0.07 µs), where the attribute goes through
    ``Module.__getattr__`` after a failed lookup that formats an AttributeError (0.46
    µs). A subclass (a parametrization's, with a property) reads the attribute."""
    params = module._parameters
    if type(module) is cls and name in params:
        return params[name]
    return getattr(module, name)


_F_LINEAR, _F_EMBEDDING = F.linear, F.embedding  # (as imported: see fast_functions)


def _linear_forward(self, input):
    if type(input) is LazyTensor:
        weight, bias = _param(self, nn.Linear, "weight"), _param(self, nn.Linear, "bias")
        with _NO_MODE():  # as inside the mode's handler: real tensors' attributes are plain
            return record(LINEAR, _F_LINEAR, (input, weight, bias), {})
    return _ORIGINAL_FORWARD[nn.Linear](self, input)


def _embedding_forward(self, input):
    if type(input) is LazyTensor:
        weight = _param(self, nn.Embedding, "weight")
        grad_options = _grad_options(self)
        if not grad_options and _row_lookup(input, weight, self.max_norm, False):
            # reads no tensor attribute (they dispatch to the mode): no DisableTorchFunction
            return _special_take(weight, input.node.data)  # emb(torch.tensor(i))
        with _NO_MODE():  # weight.requires_grad dispatches to the mode
            if grad_options and _row_lookup(input, weight, self.max_norm, grad_options):
                return _special_take(weight, input.node.data)
            args = (input, weight, self.padding_idx, self.max_norm, self.norm_type,
                    self.scale_grad_by_freq, self.sparse)  # fmt: skip
            return _special_embedding(_F_EMBEDDING, args, {})
    return _ORIGINAL_FORWARD[nn.Embedding](self, input)


#: Module types an ``nn.Sequential`` may hold to run as one block: their forward is ops of
#: the table on their input, deterministic, without state (Dropout: in eval mode only;
#: activations with ``inplace=True`` are not).
_PURE_LAYERS = (
    nn.Linear, nn.Identity, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.LeakyReLU,
    nn.ELU, nn.Softplus, nn.LayerNorm, nn.Softmax, nn.LogSoftmax, nn.Dropout,
)  # fmt: skip


def _pure_sequence(seq) -> bool:
    for m in seq._modules.values():
        t = type(m)
        if t is nn.Sequential:
            if not _pure_sequence(m):
                return False
        elif (
            t not in _PURE_LAYERS
            or not _hookless(m)
            or getattr(m, "inplace", False)
            or (t is nn.Dropout and m.training and m.p > 0)
        ):
            return False
    return True


def sequential(layers: tuple, x):
    """What ``nn.Sequential.forward`` does: each layer on the previous one's output. (Given
    the layers, not the Sequential: the trace is keyed by them, so a Sequential changed
    between calls, a layer appended or replaced, is traced anew.)"""
    for layer in layers:
        x = layer(x)
    return x


_SEQUENTIAL = None  # the block of sequential(), made on first use (acrobat.block imports this)


def _sequential_forward(self, input):
    """``nn.Sequential`` while a map runs: a lazy input through layers that are all pure
    (:data:`_PURE_LAYERS`, nested Sequentials, no hooks) is ONE block node per call (an MLP
    head of three layers: one node, not three); anything else, and inside a block's trace,
    the layers one by one."""
    global _SEQUENTIAL
    rt = graph.RT
    if (
        type(input) is LazyTensor
        and rt is not None
        and rt.tracer is None
        and config.SEQUENTIAL_BLOCKS
        and _pure_sequence(self)
    ):
        if _SEQUENTIAL is None:
            from acrobat.block import Block

            _SEQUENTIAL = Block(sequential)
        return _SEQUENTIAL(tuple(self._modules.values()), input)
    return _ORIGINAL_FORWARD[nn.Sequential](self, input)


def _sequence_forward(self, input, hx=None):
    """``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` while a map runs, on one lazy sequence (T, D)
    (or a batch of one, (1, T, D) / (T, 1, D)), with or without an initial state (lazy
    or real, of the one sequence's state shape): a SEQUENCES node whose signature leaves
    out T, so the sequences of every instance, of any lengths, run as ONE packed call of
    the module (:func:`sequences_rule`); inside a block's trace, where the batch's
    sequences share a length, a SEQUENCE_BATCH op. Anything else goes to the module's own
    forward."""
    form = _sequence_form(self, input)
    rt = graph.RT
    states = _initial_states(self, form, input, hx) if form is not None else None
    if states is None or rt is None or not config.PACKED_SEQUENCES:
        return _ORIGINAL_FORWARD[type(self)](self, input, hx)
    if rt.tracer is not None:  # inside a block's trace: T is the trace's, a plain batch
        outs = record(SEQUENCE_BATCH, run_sequence_module, (self, input, *states), {})
        return (outs[0], (outs[1], outs[2])) if type(self) is nn.LSTM else tuple(outs)
    info = _sequence_info(self, form, _length(form, input.shape), input.dtype)
    spec = tuple(None if type(h) is LazyTensor else h for h in states)  # real ones: shared
    sig = (SEQUENCES, self, form, input.shape[-1], input.dtype, spec)
    inputs = [input, *(h for h in states if type(h) is LazyTensor)]
    node = graph.add_node(rt, SEQUENCES, None, (self, form, spec), {}, inputs, info, sig)
    outs = graph.wrap_outputs(node, info)
    if type(self) is nn.LSTM:
        return outs[0], (outs[1], outs[2])
    return outs[0], outs[1]


def _initial_states(module, form: str, x, hx) -> tuple | None:
    """The initial states as a tuple ((), (h0,) or (h0, c0)), each a lazy or real tensor
    of one sequence's state shape and the input's dtype; None for anything else."""
    if hx is None:
        return ()
    lstm = type(module) is nn.LSTM
    states = tuple(hx) if lstm and isinstance(hx, (tuple, list)) else (hx,)
    if len(states) != (2 if lstm else 1):
        return None
    metas = _sequence_info(module, form, 1, x.dtype).metas[1:]
    for h, (shape, dtype) in zip(states, metas):
        if not (type(h) is LazyTensor or isinstance(h, torch.Tensor)) or h.dtype != dtype:
            return None
        with torch._C.DisableTorchFunction():
            if tuple(h.shape) != tuple(shape):
                return None
            if type(h) is not LazyTensor and h.requires_grad:  # type: ignore[union-attr]
                return None
    return states


def _sequence_form(module, x) -> str | None:
    """How a lazy input holds its one sequence: "unbatched" (T, D), "batch_first" (1, T,
    D) or "seq_first" (T, 1, D); None for anything acrobat leaves to the module."""
    if type(x) is not LazyTensor or type(module) not in _SEQUENCE_MODULES:
        return None
    if not _hookless(module) or x.dtype != module.weight_ih_l0.dtype:
        return None
    shape = x.shape
    if len(shape) == 2:
        form = "unbatched"
    elif len(shape) == 3 and shape[0 if module.batch_first else 1] == 1:
        form = "batch_first" if module.batch_first else "seq_first"
    else:
        return None
    return form if shape[-1] == module.input_size and _length(form, shape) > 0 else None


def _length(form: str, shape) -> int:
    """The length T of the one sequence in an input of this form and shape."""
    return shape[1] if form == "batch_first" else shape[0]


_SEQUENCE_INFO: dict = {}  # (module configuration, form, T, dtype) -> its Info


def _sequence_info(module, form: str, length: int, dtype) -> graph.Info:
    key = (  # the module's configuration (an id could be a dead module's, reused)
        type(module), module.hidden_size, module.num_layers, module.bidirectional,
        getattr(module, "proj_size", 0), form, length, dtype,
    )  # fmt: skip
    info = _SEQUENCE_INFO.get(key)
    if info is None:
        dirs = 2 if module.bidirectional else 1
        proj = getattr(module, "proj_size", 0) or 0
        h_out = proj or module.hidden_size
        feature = dirs * h_out
        out = {
            "unbatched": (length, feature),
            "batch_first": (1, length, feature),
            "seq_first": (length, 1, feature),
        }[form]
        state = [module.num_layers * dirs, h_out]
        cell = [module.num_layers * dirs, module.hidden_size]
        if form != "unbatched":  # (layers * directions, 1, size)
            state.insert(1, 1)
            cell.insert(1, 1)
        metas = [(torch.Size(out), dtype), (torch.Size(state), dtype)]
        if type(module) is nn.LSTM:
            metas.append((torch.Size(cell), dtype))
        info = _SEQUENCE_INFO[key] = graph.Info(tuple(metas), False, None)
        if len(_SEQUENCE_INFO) > 4096:
            _SEQUENCE_INFO.clear()
    return info


def sequences_rule(nodes: list, xs: list) -> list:
    """Outputs of SEQUENCES ``nodes`` (one module) from their inputs ``xs`` (per node: its
    sequence and its lazy initial states, if any): the sequences all
    packed (``pack_sequence``, any lengths, any order) into one call of the module's own
    forward, then each node's output rows and final states, with a leading batch dim of
    one (each node is a batch of its own for its consumers, as ragged nodes are)."""
    module, form, spec = nodes[0].args
    seqs = [v[0] if form == "unbatched" else v[0].reshape(-1, v[0].shape[-1]) for v in xs]
    packed = nn.utils.rnn.pack_sequence(seqs, enforce_sorted=False)
    lazy = [torch.stack(states) for states in zip(*(v[1:] for v in xs))]
    hx = _batched_hx(spec, lazy, len(nodes))
    forward = _ORIGINAL_FORWARD[type(module)]
    out, state = forward(module, packed, hx)  # (hx in the nodes' order: the module sorts it)
    padded, lengths = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
    states = state if type(module) is nn.LSTM else (state,)
    results = []
    for i, nd in enumerate(nodes):
        shapes = [m[0] for m in nd.info.metas]
        row = padded[i, : int(lengths[i])].reshape(1, *shapes[0])
        finals = [s[:, i].reshape(1, *shape) for s, shape in zip(states, shapes[1:])]
        results.append((row, *finals))
    return results


def run_sequence_module(module, x, *states):
    """``module(x, states)`` by its own forward, flat: (output, h_n[, c_n]) (the op
    SEQUENCE_BATCH records; its shape rule)."""
    hx = None if not states else states if type(module) is nn.LSTM else states[0]
    out, state = _ORIGINAL_FORWARD[type(module)](module, x, hx)
    return (out, *state) if type(module) is nn.LSTM else (out, state)


def _batched_hx(spec: tuple, lazy: list, n: int) -> object:
    """The module's hx for a batch of n sequences: ``spec`` the initial states (None for
    a lazy one, else the real tensor every instance shares), ``lazy`` the lazy ones batched
    ((n, *one sequence's state shape) each, in order); (layers * dirs, n, size) each, a
    tuple for an LSTM; None without initial states."""
    if not spec:
        return None
    it = iter(lazy)
    hx = []
    for real in spec:
        h = next(it) if real is None else real.expand(n, *real.shape)
        hx.append(h.reshape(n, h.shape[1], h.shape[-1]).transpose(0, 1).contiguous())
    return tuple(hx) if len(hx) == 2 else hx[0]


def sequence_batch_rule(node, xs, n):
    """SEQUENCE_BATCH over a batch of n sequences of one length: the module's own forward
    on them as its batch, the final states moved to the batch's leading dim."""
    module, x, *states = node.args
    X = xs[0].reshape(n, _length(_sequence_form(module, x), x.shape), x.shape[-1])
    if not module.batch_first:
        X = X.transpose(0, 1)
    spec = tuple(None if type(h) is LazyTensor else h for h in states)
    out, state = _ORIGINAL_FORWARD[type(module)](module, X, _batched_hx(spec, xs[1:], n))
    if not module.batch_first:
        out = out.transpose(0, 1)
    states = state if type(module) is nn.LSTM else (state,)
    metas = node.info.metas
    results = [out.reshape(n, *metas[0][0])]
    results += [s.transpose(0, 1).reshape(n, *m[0]) for s, m in zip(states, metas[1:])]
    return tuple(results)


SEQUENCE_BATCH = _add(
    Op(
        "sequence_batch",
        sequence_batch_rule,
        "sequences-in-a-block",
        (),
        doc="nn.LSTM/GRU/RNN inside a block's trace: the batch's sequences share a length",
    )
)
SEQUENCES = _add(
    Op(
        "sequences",
        sequences_rule,
        "sequences",
        (),
        doc="nn.LSTM/GRU/RNN over per-instance sequences of any lengths: one packed call",
    )
)
_SEQUENCE_MODULES = (nn.LSTM, nn.GRU, nn.RNN)


FAST_CALL = True  # with FAST_MODULES: also Module.__call__ (measured separately)
_FAST_FORWARD = {
    nn.Linear: _linear_forward,
    nn.Embedding: _embedding_forward,
    nn.Sequential: _sequential_forward,
    nn.LSTM: _sequence_forward,
    nn.GRU: _sequence_forward,
    nn.RNN: _sequence_forward,
}
_MODULE_CALL = nn.Module.__call__
_mm = torch.nn.modules.module


def _fast_call(self, *args, **kwargs):
    """``Module.__call__`` of the fast-path classes while a map runs: one lazy input, no
    hooks anywhere, not compiled: straight to ``forward`` (what ``_call_impl`` does then,
    without its two frames and checks: a word lookup 4.8 -> ~3.7 µs); else the original."""
    if len(args) == 1 and type(args[0]) is LazyTensor and not kwargs and _hookless(self):
        return self.forward(args[0])
    return _MODULE_CALL(self, *args, **kwargs)


def _grad_options(embedding: nn.Embedding) -> bool:
    """Whether an ``nn.Embedding`` sets an option that changes only the gradient
    (padding_idx, scale_grad_by_freq, sparse; ``_embedding_options`` for a call's)."""
    return embedding.padding_idx is not None or embedding.scale_grad_by_freq or embedding.sparse


def _hookless(module) -> bool:
    """No hook of any kind (the module's or global) and not compiled: ``module(x)`` is
    ``module.forward(x)``."""
    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or module._compiled_call_impl is not None
        or _mm._global_forward_hooks
        or _mm._global_forward_pre_hooks
        or _mm._global_backward_hooks
        or _mm._global_backward_pre_hooks
    )


def lookup_call(module, tensor, value):
    """``module(tensor(value))``: what instance code's ``emb(torch.tensor(i))`` becomes
    where analysis rewrites a function (``analysis.LOOKUP_CALLS``). For a plain
    ``nn.Embedding`` and a Python int inside a map, it records the row lookup those two
    calls record (the same take node), without the deferred ``torch.tensor`` through the
    mode's handler and ``Module.__call__`` (a word lookup inside a map 4.6 -> 2.5 µs).
    Anything else, an embedding with a gradient option included, is called as written."""
    if type(value) is int and tensor is torch.tensor and type(module) is nn.Embedding:
        rt = graph.RT
        if (
            rt is not None
            and rt.tracer is None
            and config.FAST_MODULES
            and module.max_norm is None
            and not _grad_options(module)
            and _hookless(module)
        ):
            return _special_take(_param(module, nn.Embedding, "weight"), value)
    return module(tensor(value))


def factory_call(func, size):
    """``func(size)``: what instance code's ``torch.zeros(n)`` (or ``torch.ones(n)``) becomes
    where analysis rewrites a function (``analysis.FACTORY_CALLS``). Inside a map such a
    constant is hoisted: made once, on the first call, and shared by every instance. Later
    calls with an int read it from the map's hoisting cache here instead of entering the
    recording mode's handler (1.6 -> ~0.3 µs a call); the first call, calls inside a block
    trace, from another thread or with anything but an int go through ``func`` as written."""
    if type(size) is int:
        rt = graph.RT
        if rt is not None and rt.fiber is not None and rt.tracer is None:
            hit = rt.hoisted.get((func, (size,), ()))  # graph.hoist's key for func(int)
            if hit is not None and rt.thread == threading.get_ident():
                if rt.fresh:  # (graph._hoisted_hit: another instance has it now)
                    rt.fresh.pop(id(hit), None)
                return hit
    return func(size)


factory_call_py = factory_call
if _c_ext is not None:  # the cache hit in C (_native.factory_call), else this
    _c_ext.setup_factory(factory_call_py)
    factory_call = _c_ext.factory_call


# ---- torch.distributions' checks of a sample ------------------------------------------
# ``Categorical(logits=...).log_prob(a)`` checks that ``a`` is a torch.Tensor first; a
# lazy tensor is not one (see tensor.py), so a policy's log-probability of its own sampled
# action raised inside a map. While a map runs, the check takes a lazy value as the
# tensor it stands for: the same checks of its shape against the distribution's, and of
# its values against the support (a value read, as eager reads it to raise).

_VALIDATE_SAMPLE = torch.distributions.Distribution._validate_sample


def _validate_sample(self, value):
    if type(value) is not LazyTensor:
        return _VALIDATE_SAMPLE(self, value)
    event = tuple(self._event_shape)
    shape = tuple(value.shape)
    if event and shape[len(shape) - len(event) :] != event:
        raise ValueError(
            f"The right-most size of value must match event_shape: {value.shape} vs "
            f"{self._event_shape}."
        )
    batch = tuple(self._batch_shape)
    rest = shape[: len(shape) - len(event)]
    try:
        torch.broadcast_shapes(rest[len(rest) - min(len(rest), len(batch)) :], batch)
    except RuntimeError as exc:
        raise ValueError(
            f"Value is not broadcastable with batch_shape+event_shape: {value.shape} vs "
            f"{self._batch_shape + self._event_shape}."
        ) from exc
    support = self.support
    if support is not None and not bool(torch.all(support.check(value))):
        raise ValueError(
            f"Expected value argument ({type(value).__name__} of shape {tuple(value.shape)}) "
            f"to be within the support ({support!r}) of the distribution {self!r}"
        )


def distribution_checks(on: bool) -> None:
    """Install (or remove) the lazy-aware sample check for the duration of a map."""
    torch.distributions.Distribution._validate_sample = (  # type: ignore[method-assign]
        _validate_sample if on else _VALIDATE_SAMPLE
    )


# ---- shortcuts of torch functions -------------------------------------------------------
# torch.tanh(h) on a lazy tensor costs ~0.9 us in torch's dispatch to the Python
# TorchFunctionMode before its handler runs; h.tanh() (a LazyTensor method) does not pay
# it. While a map runs, fast_functions() puts a stand-in in the torch namespaces for each
# function of the table: lazy arguments on the map's thread are recorded as the mode
# would record them (fibers.RecordMode is the specification), anything else calls the
# torch function itself. Code in acrobat that compares or records a torch function while
# a map runs must therefore name the original, captured at import (as below), never
# ``torch.<name>`` looked up at run time.

_SHORTCUT_NAMESPACES = (torch, F, torch.special, torch.linalg)
_BUILTIN = type(torch.tanh)  # the functions torch implements in C (its dispatch as called)


def _shortcut_py(op, func):
    """The Python stand-in (without acrobat._native): the same steps as ``Shortcut``."""
    special = op.special

    def shortcut(*args, **kwargs):
        if "out" in kwargs:  # written into a tensor: the mode's handler (ops.out_kwarg)
            return func(*args, **kwargs)
        if has_lazy(args) or (kwargs and has_lazy(kwargs)):
            rt = graph.RT
            if rt is not None and rt.thread == threading.get_ident():
                if special is not None:
                    return special(func, args, kwargs)
                return record(op, func, args, kwargs)
        return func(*args, **kwargs)

    for name in ("__name__", "__qualname__", "__module__", "__doc__"):
        value = getattr(func, name, None)
        if isinstance(value, str):
            setattr(shortcut, name, value)
    shortcut.__wrapped__ = func  # type: ignore[attr-defined]
    return shortcut


#: stand-in -> the torch function it stands for (RecordMode reads it: a torch function
#: written in Python dispatches to the mode under its module-level name, the stand-in)
SHORTCUT_ORIGINALS: dict = {}
_SHORTCUTS: list[tuple] = []  # (namespace, name, stand-in, original); made on first use


def _make_shortcuts() -> list[tuple]:
    from acrobat.tensor import _native

    made: dict = {}
    for ns in _SHORTCUT_NAMESPACES:
        for name, func in list(vars(ns).items()):
            if type(func) is not _BUILTIN:
                continue  # a torch function written in Python reaches the mode with its
                # arguments as its handle_torch_function passes them, which its rule reads
            try:
                op = FUNCS.get(func)
            except TypeError:  # unhashable
                continue
            if op is None or op.kind == "data" or op.name == "getitem":
                continue  # (the mode's handler takes those even without lazy arguments)
            if func in HOISTED_FACTORIES or func in HOISTED_GETTERS:
                continue
            stand_in = made.get(func)
            if stand_in is None:
                if _native is not None:
                    stand_in = _native.Shortcut(func, op, op.special)
                else:
                    stand_in = _shortcut_py(op, func)
                made[func] = stand_in
                SHORTCUT_ORIGINALS[stand_in] = func
            _SHORTCUTS.append((ns, name, stand_in, func))
    return _SHORTCUTS


_STAND_INS: dict = {}  # original -> its (namespace, name, stand-in) entries; made on first use
#: The originals with a stand-in (RecordMode notes those that reach it: MISSED).
SHORTCUT_FUNCS: frozenset = frozenset()
#: Torch functions with a stand-in that reached the mode's handler while a map ran (not
#: in place): the map's Autobatched learns them and puts their stand-ins in from then on.
MISSED: set = set()
_count = [0]  # maps running with stand-ins in place (one per thread at most)
_in_place: dict = {}  # (id(namespace), name) -> (namespace, name, original): what is put in
_install_lock = threading.Lock()


def stand_in_funcs() -> frozenset:
    """The torch functions that have a stand-in (made on first use)."""
    global SHORTCUT_FUNCS
    if not _STAND_INS:
        for ns, name, stand_in, func in _SHORTCUTS or _make_shortcuts():
            _STAND_INS.setdefault(func, []).append((ns, name, stand_in))
        SHORTCUT_FUNCS = frozenset(_STAND_INS)
    return SHORTCUT_FUNCS


@contextlib.contextmanager
def fast_functions(wanted=None):
    """The stand-ins of the torch functions ``wanted`` (all of them: None) in the torch
    namespaces for the duration of a map (``config.FAST_FUNCTIONS``). A map puts in only
    those its function has been seen to call (``Autobatched`` learns them from
    :data:`MISSED`): ~180 attributes set and reset around every map cost ~30-60 µs."""
    if not config.FAST_FUNCTIONS:
        yield
        return
    with _install_lock:
        every = stand_in_funcs()  # (also what RecordMode notes as missed)
        funcs = every if wanted is None else wanted
        for func in funcs:
            for ns, name, stand_in in _STAND_INS[func]:
                key = (id(ns), name)
                if key not in _in_place:
                    setattr(ns, name, stand_in)
                    _in_place[key] = (ns, name, func)
        _count[0] += 1
    try:
        yield
    finally:
        with _install_lock:
            _count[0] -= 1
            if _count[0] == 0:
                for ns, name, func in _in_place.values():
                    setattr(ns, name, func)
                _in_place.clear()


@contextlib.contextmanager
def fast_modules():
    """Install the fast forwards for the duration of a map (``config.FAST_MODULES``)."""
    from acrobat import config

    if not config.FAST_MODULES:
        yield
        return
    for cls, fwd in _FAST_FORWARD.items():
        cls.forward = fwd  # type: ignore[method-assign]
        if FAST_CALL:
            cls.__call__ = _fast_call  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, fwd in _ORIGINAL_FORWARD.items():
            cls.forward = fwd  # type: ignore[method-assign]
            if "__call__" in vars(cls):
                del cls.__call__


def install_tensor_attributes() -> None:
    """A tensor.TensorAttribute on LazyTensor for every public torch.Tensor attribute it
    has nothing for yet (run last, once every method with a row is installed)."""
    from acrobat.tensor import TensorAttribute

    for name in dir(torch.Tensor):
        if name[:1] != "_" and not hasattr(LazyTensor, name):
            setattr(LazyTensor, name, TensorAttribute(name))


install_tensor_attributes()


__all__ = [
    "DATA_OPS",
    "FUNCS",
    "HOISTED_FACTORIES",
    "HOISTED_GETTERS",
    "RAGGED_CAT",
    "RAGGED_STACK",
    "TABLE",
    "Op",
    "supported_names",
]
