"""Batched elementwise kernels that gather their operands themselves (gather fusion).

A batch of ``n`` instances runs the same small elementwise :class:`Program`, e.g. the
tail of an LSTM cell. Instance ``i`` reads its k-th operand from row ``idx_k[i]`` of a
2-D source tensor ``buf_k`` (rows of length ``F``, the flattened per-instance shape). The
unfused way gathers each operand with ``index_select`` and then runs one torch op per
node, a pass over memory each. Following ACRoBat section 5.2, the generated kernels
instead read ``buf_k[idx_k[i], j]`` directly and evaluate the whole program per element,
in registers, in one pass.

Pipeline, in the order the code below runs it:

1. ``OPS_TABLE``: one row per op: arity, torch implementation, numba and CUDA code
   templates, which arguments must be constants. Everything else reads this table.
2. :class:`Program`: the SSA program, validated and normalised on construction; it is
   hashable and is the cache key of compiled kernels.
3. :func:`run` checks the arguments and dispatches to a backend:

   - ``"torch"``: the reference, ``index_select`` then torch ops; autograd-capable.
   - ``"numba"``: CPU; :func:`numba_source` generates a module with an ``@njit`` row loop
     and a ``cfunc`` entry that reads every operand's address from a parameter block
     (a ctypes call instead of numba's dispatch of ~20 numpy arrays), compiled once per
     program and machine (numba's disk cache, :func:`cache_dir`).
   - ``"cuda"``: :func:`cuda_source` generates one ``extern "C" __global__`` kernel,
     compiled with ``cupy.RawKernel`` (needs cupy and a CUDA device).
   - ``"auto"``: numba for CPU tensors, cuda for CUDA tensors, torch when the chosen
     backend is unavailable or autograd needs the result.

Example::

    >>> import torch
    >>> from acrobat_kernels import Program, run
    >>> prog = Program(n_inputs=2, n_shared=1, outputs=(2,), ops=(
    ...     ("add", (("in", 0), ("sh", 0))),     # %0 = in0 + sh0
    ...     ("sigmoid", (("op", 0),)),           # %1 = sigmoid(%0)
    ...     ("mul", (("op", 1), ("in", 1))),     # %2 = %1 * in1
    ... ))
    >>> a, b, bias = torch.randn(10, 4), torch.randn(3, 4), torch.randn(4)
    >>> rows = torch.tensor([7, 2, 2])           # instance i reads row rows[i] of a
    >>> (out,) = run(prog, 3, 4, [(a, rows), (b, None)], [bias], backend="numba")
    >>> ref = torch.sigmoid(a[rows] + bias) * b
    >>> torch.allclose(out, ref)
    True

Compiling and caching: a program's module is written once to :func:`cache_dir` (one
folder per stamp of this package's sources) and imported from there, so numba's disk cache
serves its compiled code to every later process (compiling the LSTM tail takes ~1-2 s;
loading it ~0.05 s). Where no cache folder can be written, the module is executed from
its source and compiled in each process. ``cupy.RawKernel`` keeps its own on-disk cache of
CUDA binaries.

CPU speed: the fused kernel's per-element loop is vectorized by LLVM (AVX2/AVX-512)
because float32 ``exp``/``tanh``/``log``/``erf`` come from :mod:`acrobat_kernels.vecmath`
rather than libm calls (float64 kernels call libm and run scalar). Small batches run on the
calling thread; from ``PARALLEL_MIN_ELEMENTS`` elements on, the instances are split over
torch's own OpenMP team (:mod:`acrobat_kernels.parallel`: a team of the kernel's own would
compete with torch's spinning threads for the cores). The LSTM tail over 2000 x 256
elements, two threads: 1.35 ms (numba's dispatch and threads before: 2.84 ms; torch op
by op: 4.9 ms); over 8 x 256: 33 µs (41 µs before; torch 28 µs: the transcendental math
costs ~5 ns an element either way, and the call's checks and block ~15 µs).

Numerics: every intermediate is computed in the program's dtype (constants are rounded
to it first), as torch does, with IEEE semantics in numba (``fastmath=False``, no FMA
contraction; nvcc may contract to FMA); division by zero gives inf/nan, not an
exception. ``sigmoid`` uses the overflow-free form ``exp(-|x|)``; NaN propagates through
maximum/minimum/relu/clamp as in torch. Results agree with torch to a few float32 ulps
per op. One known difference: torch's float32 CPU ``gelu(+inf)`` is NaN, ours is inf
(torch's float64 result).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import math
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as TF

from acrobat_kernels import cuda_launch

__all__ = [
    "OPS",
    "OPS_TABLE",
    "PARALLEL_MIN_ELEMENTS",
    "OpDef",
    "Program",
    "available_backends",
    "cuda_source",
    "lstm_cell_tail",
    "numba_source",
    "run",
]


# --------------------------------------------------------------------------------------
# 1. The op table
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpDef:
    """Everything known about one op.

    ``torch`` takes tensors (constants arrive as 0-d tensors, except in ``const_args``
    positions, which arrive as Python floats). ``numba`` and ``cuda`` are assignment
    templates, one statement each, over ``{o}`` (the result's name), ``{a} {b} {c}``
    (the arguments) and the kernel constants ``ZERO ONE HALF RSQRT2``; a statement may
    define helper names ``{o}_x``. Math functions appear as ``{exp} {log} {sqrt} {tanh}
    {erf} {fabs}``, filled per backend and dtype (``_NUMBA_MATH``, ``_CUDA_MATH``).
    """

    arity: int
    torch: Callable
    numba: tuple[str, ...]
    cuda: tuple[str, ...]
    const_args: tuple[int, ...] = ()


def _compare(fn):
    return lambda a, b: fn(a, b).to(torch.promote_types(a.dtype, b.dtype))


def _unary(fn: str, torch_fn: Callable) -> OpDef:
    return OpDef(1, torch_fn, (f"{{o}} = {fn}({{a}})",), (f"{{o}} = {fn}({{a}})",))


def _binary(symbol: str, torch_fn: Callable) -> OpDef:
    template = f"{{o}} = {{a}} {symbol} {{b}}"
    return OpDef(2, torch_fn, (template,), (template,))


def _comparison(symbol: str, torch_fn: Callable) -> OpDef:
    return OpDef(
        2,
        _compare(torch_fn),
        (f"{{o}} = ONE if {{a}} {symbol} {{b}} else ZERO",),
        (f"{{o}} = ({{a}} {symbol} {{b}}) ? ONE : ZERO",),
    )


#: name -> :class:`OpDef`. Kernels, validation, the torch reference and the tests all
#: read this table; adding a row adds an op everywhere.
OPS_TABLE: dict[str, OpDef] = {
    "neg": OpDef(1, torch.neg, ("{o} = -{a}",), ("{o} = -{a}",)),
    "abs": _unary("{fabs}", torch.abs),
    "add": _binary("+", torch.add),
    "sub": _binary("-", torch.sub),
    "mul": _binary("*", torch.mul),
    "div": _binary("/", torch.div),
    # exp(-|x|) never overflows; x >= 0 gives 1/(1+e), x < 0 gives e/(1+e).
    "sigmoid": OpDef(
        1,
        torch.sigmoid,
        (
            "{o}_e = {exp}(-{fabs}({a}))",
            "{o}_r = ONE / (ONE + {o}_e)",
            "{o} = {o}_r if {a} >= ZERO else {o}_e * {o}_r",
        ),
        (
            "{o}_e = {exp}(-{fabs}({a}))",
            "{o}_r = ONE / (ONE + {o}_e)",
            "{o} = ({a} >= ZERO) ? {o}_r : {o}_e * {o}_r",
        ),
    ),
    "tanh": _unary("{tanh}", torch.tanh),
    # Written so that NaN falls through to the argument, as torch.relu does.
    "relu": OpDef(1, torch.relu, ("{o} = ZERO if {a} < ZERO else {a}",),
                  ("{o} = ({a} < ZERO) ? ZERO : {a}",)),
    "exp": _unary("{exp}", torch.exp),
    "log": _unary("{log}", torch.log),
    "sqrt": _unary("{sqrt}", torch.sqrt),
    "rsqrt": OpDef(1, torch.rsqrt, ("{o} = ONE / {sqrt}({a})",),
                   ("{o} = ONE / {sqrt}({a})",)),
    "square": OpDef(1, torch.square, ("{o} = {a} * {a}",), ("{o} = {a} * {a}",)),
    # torch.maximum/minimum return NaN if either side is NaN (fmax/fmin would not).
    "maximum": OpDef(
        2,
        torch.maximum,
        ("{o} = {a} if ({a} >= {b} or {a} != {a}) else {b}",),
        ("{o} = ({a} >= {b} || {a} != {a}) ? {a} : {b}",),
    ),
    "minimum": OpDef(
        2,
        torch.minimum,
        ("{o} = {a} if ({a} <= {b} or {a} != {a}) else {b}",),
        ("{o} = ({a} <= {b} || {a} != {a}) ? {a} : {b}",),
    ),
    # cond is a float; any nonzero value (NaN included) selects a.
    "where": OpDef(
        3,
        lambda cond, a, b: torch.where(cond != 0, a, b),
        ("{o} = {b} if {a} != ZERO else {c}",),
        ("{o} = ({a} != ZERO) ? {b} : {c}",),
    ),
    "gt": _comparison(">", torch.gt),
    "lt": _comparison("<", torch.lt),
    "ge": _comparison(">=", torch.ge),
    "le": _comparison("<=", torch.le),
    # The erf form, in the operation order of torch's CPU kernel.
    "gelu": OpDef(
        1,
        TF.gelu,
        ("{o} = ({a} * HALF) * (ONE + {erf}({a} * RSQRT2))",),
        ("{o} = ({a} * HALF) * (ONE + {erf}({a} * RSQRT2))",),
    ),
    # x / (1 + exp(-x)), as torch computes silu; exp overflow gives x / inf = -0.
    "silu": OpDef(1, TF.silu, ("{o} = {a} / (ONE + {exp}(-{a}))",),
                  ("{o} = {a} / (ONE + {exp}(-{a}))",)),
    "leaky_relu": OpDef(
        2,
        lambda x, alpha: TF.leaky_relu(x, alpha),
        ("{o} = {a} if {a} > ZERO else {a} * {b}",),
        ("{o} = ({a} > ZERO) ? {a} : {a} * {b}",),
        const_args=(1,),
    ),
    # min(max(x, lo), hi): hi wins when lo > hi, NaN passes through (torch.clamp).
    "clamp": OpDef(
        3,
        lambda x, lo, hi: torch.clamp(x, lo, hi),
        ("{o}_l = {b} if {a} < {b} else {a}", "{o} = {c} if {o}_l > {c} else {o}_l"),
        ("{o}_l = ({a} < {b}) ? {b} : {a}", "{o} = ({o}_l > {c}) ? {c} : {o}_l"),
        const_args=(1, 2),
    ),
}

#: The supported op names and their arity.
OPS: dict[str, int] = {name: row.arity for name, row in OPS_TABLE.items()}

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_REF_KINDS = ("in", "sh", "op")


# --------------------------------------------------------------------------------------
# 2. Programs
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Program:
    """A straight-line elementwise program over per-instance and shared operands.

    ``ops`` is in SSA order: ``ops[j] = (name, args)``, where each argument is a
    reference ``("in", k)`` (per-instance operand k), ``("sh", k)`` (shared operand k)
    or ``("op", m)`` with ``m < j`` (the result of ``ops[m]``), or a Python number (a
    constant, rounded to ``dtype``). ``outputs`` lists the ops whose results
    :func:`run` returns. Lists are accepted and normalised to tuples, so a Program is
    hashable; construction raises ``ValueError`` for anything malformed.

    >>> p = Program(1, 0, [("mul", [("in", 0), 2]), ("exp", [("op", 0)])], [1])
    >>> print(p)
    program(in0) -> (%1) float32:
      %0 = mul in0, 2.0
      %1 = exp %0
    """

    n_inputs: int
    n_shared: int
    ops: tuple[tuple[str, tuple], ...]
    outputs: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self):
        _validate_and_normalise(self)

    def __str__(self) -> str:
        params = [f"in{k}" for k in range(self.n_inputs)]
        params += [f"sh{k}" for k in range(self.n_shared)]
        outs = ", ".join(f"%{j}" for j in self.outputs)
        lines = [f"program({', '.join(params)}) -> ({outs}) {self.dtype}:"]
        for j, (name, args) in enumerate(self.ops):
            lines.append(f"  %{j} = {name} " + ", ".join(_ref_str(a) for a in args))
        return "\n".join(lines)


def _ref_str(arg) -> str:
    if isinstance(arg, float):
        return repr(arg)
    kind, k = arg
    return f"%{k}" if kind == "op" else f"{kind}{k}"


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _validate_and_normalise(p: Program) -> None:
    def fail(where: str, msg: str):
        raise ValueError(f"Program{where}: {msg}")

    if p.dtype not in _DTYPES:
        fail(".dtype", f"expected one of {sorted(_DTYPES)}, got {p.dtype!r}")
    for field in ("n_inputs", "n_shared"):
        value = getattr(p, field)
        if not isinstance(value, int) or value < 0:
            fail(f".{field}", f"expected a non-negative int, got {value!r}")
    if len(p.ops) == 0:
        fail(".ops", "a program needs at least one op")

    ops = []
    for j, op in enumerate(p.ops):
        where = f".ops[{j}]"
        if not (isinstance(op, (tuple, list)) and len(op) == 2):
            fail(where, f"expected (name, args), got {op!r}")
        name, args = op
        if name not in OPS_TABLE:
            fail(where, f"unknown op {name!r}; supported ops: {', '.join(sorted(OPS))}")
        row = OPS_TABLE[name]
        if not isinstance(args, (tuple, list)) or len(args) != row.arity:
            fail(where, f"{name} takes {row.arity} argument(s), got {args!r}")
        norm_args: list = []
        for pos, arg in enumerate(args):
            if _is_number(arg):
                norm_args.append(float(arg))
                continue
            if pos in row.const_args:
                fail(where, f"argument {pos} of {name} must be a number, got {arg!r}")
            if not (isinstance(arg, (tuple, list)) and len(arg) == 2 and arg[0] in _REF_KINDS
                    and isinstance(arg[1], int) and not isinstance(arg[1], bool)):
                fail(where, f"argument {pos} must be a number or ('in'|'sh'|'op', int), "
                            f"got {arg!r}")
            kind, k = arg
            limit = {"in": p.n_inputs, "sh": p.n_shared, "op": j}[kind]
            if not 0 <= k < limit:
                rule = {"in": f"the program has {p.n_inputs} input(s)",
                        "sh": f"the program has {p.n_shared} shared operand(s)",
                        "op": "an op can use only the results of ops before it (SSA order)"}
                fail(where, f"argument {pos} refers to ({kind!r}, {k}), but {rule[kind]}")
            norm_args.append((kind, k))
        ops.append((name, tuple(norm_args)))

    outputs = tuple(p.outputs)
    if not outputs:
        fail(".outputs", "a program needs at least one output")
    for j in outputs:
        if not (isinstance(j, int) and 0 <= j < len(ops)):
            fail(".outputs", f"{j!r} is not an index into ops (0..{len(ops) - 1})")
    object.__setattr__(p, "ops", tuple(ops))
    object.__setattr__(p, "outputs", outputs)


def _live_ops(p: Program) -> list[int]:
    """Indices of the ops the outputs depend on, in program order."""
    live = set(p.outputs)
    for j in range(len(p.ops) - 1, -1, -1):
        if j in live:
            live.update(a[1] for a in p.ops[j][1] if isinstance(a, tuple) and a[0] == "op")
    return sorted(live)


def _constants(p: Program) -> dict[float, int]:
    """Each distinct constant of the live ops -> its index (kernels bind ``c<index>``)."""
    consts: dict[float, int] = {}
    for j in _live_ops(p):
        for a in p.ops[j][1]:
            if isinstance(a, float) and a not in consts:
                consts[a] = len(consts)
    return consts


def _program_id(p: Program) -> str:
    return hashlib.sha1(repr(p).encode()).hexdigest()[:12]


def lstm_cell_tail(dtype: str = "float32") -> Program:
    """The elementwise tail of an LSTM cell, a ready-made example program.

    Inputs are the pre-activation gates ``i, f, u, o`` and the previous cell state
    ``c_prev``; outputs are ``c = sigmoid(i)*tanh(u) + sigmoid(f)*c_prev`` and
    ``h = sigmoid(o)*tanh(c)``.
    """
    i, f, u, o, c_prev = (("in", k) for k in range(5))
    ops = (
        ("sigmoid", (i,)),                   # 0
        ("tanh", (u,)),                      # 1
        ("mul", (("op", 0), ("op", 1))),     # 2
        ("sigmoid", (f,)),                   # 3
        ("mul", (("op", 3), c_prev)),        # 4
        ("add", (("op", 2), ("op", 4))),     # 5  c
        ("sigmoid", (o,)),                   # 6
        ("tanh", (("op", 5),)),              # 7
        ("mul", (("op", 6), ("op", 7))),     # 8  h
    )
    return Program(n_inputs=5, n_shared=0, ops=ops, outputs=(5, 8), dtype=dtype)


# --------------------------------------------------------------------------------------
# 3a. The torch backend (the reference)
# --------------------------------------------------------------------------------------


def _run_torch(p: Program, n: int, F: int, sources, shared) -> list[torch.Tensor]:
    dtype = _DTYPES[p.dtype]
    device = sources[0][0].device if sources else (shared[0].device if shared else None)
    inputs = [buf[:n] if idx is None else buf.index_select(0, idx) for buf, idx in sources]
    values: dict[int, torch.Tensor] = {}

    def operand(arg, pos: int, row: OpDef):
        if isinstance(arg, float):
            return arg if pos in row.const_args else torch.tensor(arg, dtype=dtype, device=device)
        kind, k = arg
        return inputs[k] if kind == "in" else shared[k] if kind == "sh" else values[k]

    for j in _live_ops(p):
        name, args = p.ops[j]
        row = OPS_TABLE[name]
        values[j] = row.torch(*(operand(a, pos, row) for pos, a in enumerate(args)))

    results, seen = [], set()
    for j in p.outputs:
        out = values[j]
        if tuple(out.shape) != (n, F):      # only shared operands and constants: broadcast
            out = out.expand(n, F).contiguous()
        elif j in seen:                     # each output is a distinct tensor
            out = out.clone()
        seen.add(j)
        results.append(out)
    return results


# --------------------------------------------------------------------------------------
# 3b. The numba backend (CPU)
# --------------------------------------------------------------------------------------

#: Below this many elements (n * F) the kernel runs on the calling thread: waking torch's
#: OpenMP team costs more than it saves. From here on the instances are split over it.
PARALLEL_MIN_ELEMENTS = 1 << 15

# float32 exp/tanh/log/erf come from vecmath (vectorizable, where libm calls are not);
# sqrt and abs are LLVM intrinsics, which vectorize by themselves.
_NUMBA_MATH = {
    "float32": {"exp": "exp_f32", "tanh": "tanh_f32", "log": "log_f32", "sqrt": "math.sqrt",
                "erf": "erf_f32", "fabs": "abs"},
    "float64": {"exp": "math.exp", "tanh": "math.tanh", "log": "math.log", "sqrt": "math.sqrt",
                "erf": "math.erf", "fabs": "abs"},
}

_KERNEL_CONSTANTS = {"ZERO": 0.0, "ONE": 1.0, "HALF": 0.5, "RSQRT2": 0.7071067811865476}


def _py_float(x: float) -> str:
    if math.isnan(x):
        return "math.nan"
    if math.isinf(x):
        return "math.inf" if x > 0 else "-math.inf"
    return repr(x)


def _operand_names(p: Program, consts: dict[float, int]):
    """Name of each argument inside a kernel: x<k> inputs, s<k> shared, v<j> ops, c<m>."""

    def name(arg) -> str:
        if isinstance(arg, float):
            return f"c{consts[arg]}"
        kind, k = arg
        return {"in": "x", "sh": "s", "op": "v"}[kind] + str(k)

    return name


def _used_operands(p: Program, kind: str) -> list[int]:
    used = {arg[1] for j in _live_ops(p) for arg in p.ops[j][1]
            if isinstance(arg, tuple) and arg[0] == kind}
    return sorted(used)


def numba_source(p: Program, cache: bool = False) -> str:
    """Python source of the numba module for ``p``: ``rows`` and ``entry``.

    ``rows(start, stop, ...)`` evaluates instances ``start..stop-1``: per instance it
    reads the row index of each input once, then runs the program over the ``F``
    elements in a loop that LLVM vectorizes. Its arguments: ``F, bad``, then per input
    ``buf, idx, use_idx, row_stride, rows`` (``buf`` flat, ``use_idx`` False reads row
    i), per shared operand its ``F`` values (a scalar is broadcast before the call, so
    every load has unit stride and the loop vectorizes), then one ``(n, F)`` output per
    program output. ``bad[0]`` is set when an index is out of range (that instance is
    skipped).

    ``entry(block)`` is a numba ``cfunc`` taking the address of a parameter block of
    int64s (:func:`_block_layout`): every operand as an address, so a call costs a
    ctypes call instead of numba's dispatch of ~20 numpy arrays (~35 µs). With the
    block's split flag set it runs the rows :func:`acrobat_kernels.loops.row_share` gives
    the calling thread of torch's OpenMP team (:func:`acrobat_kernels.parallel.launch`).
    ``cache``: the functions are compiled with numba's disk cache (the source is then a
    module file, :func:`_kernel_module`).
    """
    consts = _constants(p)
    name = _operand_names(p, consts)
    params = ["F", "bad"]
    for k in range(p.n_inputs):
        params += [f"buf{k}", f"idx{k}", f"use_idx{k}", f"stride{k}", f"rows{k}"]
    params += [f"sh{k}" for k in range(p.n_shared)]
    params += [f"out{m}" for m in range(len(p.outputs))]
    params_text = ", ".join(params)
    options = f"cache={cache}, error_model='numpy', fastmath={{'contract'}}, nogil=True"
    cast = "_as_f32" if p.dtype == "float32" else "_as_f64"

    lines = [f"# {line}" for line in str(p).splitlines()]
    lines += [
        "import math",
        "",
        "import numpy as np",
        "from numba import carray, cfunc, njit, types",
        "",
        "from acrobat_kernels.loops import _as_f32, _as_f64, _as_i64, row_share",
        "from acrobat_kernels.vecmath import erf_f32, exp_f32, log_f32, tanh_f32",
        "",
        f"DT = np.{p.dtype}",
        "",
        "",
        f"@njit({options})",
    ]
    inputs = _used_operands(p, "in")
    lines.append(f"def rows(start, stop, {params_text}):")
    for cname, value in _KERNEL_CONSTANTS.items():
        lines.append(f"    {cname} = DT({value!r})")
    for value, m in consts.items():
        lines.append(f"    c{m} = DT({_py_float(value)})")
    lines.append("    for i in range(start, stop):")
    lines.append("        ok = True")
    for k in inputs:
        lines.append(f"        r{k} = idx{k}[i] if use_idx{k} else i")
        lines.append(f"        if r{k} < 0 or r{k} >= rows{k}:")
        lines.append("            ok = False")
        # A row view indexed by the loop counter: LLVM sees unit-stride loads, not a
        # gather, which it could not prove for buf[r * stride + j].
        lines.append(f"        row{k} = buf{k}[r{k} * stride{k}:r{k} * stride{k} + F]")
    lines.append("        if not ok:")
    lines.append("            bad[0] = 1")
    lines.append("            continue")
    lines.append("        for j in range(F):")
    body = [f"x{k} = row{k}[j]" for k in inputs]
    body += [f"s{k} = sh{k}[j]" for k in _used_operands(p, "sh")]
    for j in _live_ops(p):
        op_name, args = p.ops[j]
        fmt = dict(zip("abc", (name(a) for a in args)), o=f"v{j}", **_NUMBA_MATH[p.dtype])
        body.extend(stmt.format(**fmt) for stmt in OPS_TABLE[op_name].numba)
    body += [f"out{m}[i, j] = v{j}" for m, j in enumerate(p.outputs)]
    lines.extend("            " + stmt for stmt in body)

    slots = _block_layout(p)
    lines += ["", "", f"@cfunc(types.void(types.intp), {options})", "def entry(block):"]
    lines.append(f"    p = carray(_as_i64(block), ({slots['size']},))")
    lines.append("    n, F = p[0], p[1]")
    lines.append("    r0, r1 = 0, n")
    lines.append("    if p[2]:  # split over torch's OpenMP team: this thread's rows")
    lines.append(f"        r0, r1 = row_share(n, p[{slots['thread']}], p[{slots['team']}])")
    lines.append("    if r1 <= r0:")
    lines.append("        return")
    lines.append("    bad = carray(_as_i64(p[3]), (1,))")
    call_args = ["F", "bad"]
    for k in range(p.n_inputs):
        s = slots["inputs"] + 4 * k  # address, index address (0: none), row stride, rows
        lines.append(f"    span{k} = max((p[{s + 3}] - 1) * p[{s + 2}] + F, 0)")
        lines.append(f"    buf{k} = carray({cast}(p[{s}]), (span{k},))")
        lines.append(f"    idx{k} = carray(_as_i64(p[{s + 1}]), (n if p[{s + 1}] != 0 else 0,))")
        call_args += [f"buf{k}", f"idx{k}", f"p[{s + 1}] != 0", f"p[{s + 2}]", f"p[{s + 3}]"]
    for k in range(p.n_shared):
        lines.append(f"    sh{k} = carray({cast}(p[{slots['shared'] + k}]), (F,))")
        call_args.append(f"sh{k}")
    for m in range(len(p.outputs)):
        lines.append(f"    out{m} = carray({cast}(p[{slots['outputs'] + m}]), (n, F))")
        call_args.append(f"out{m}")
    lines.append(f"    rows(r0, r1, {', '.join(call_args)})")
    return "\n".join(lines) + "\n"


def _block_layout(p: Program) -> dict:
    """Slots of a kernel's parameter block: ``n, F, split, &bad``; per input its address,
    its index's address (0: rows 0..n-1), its row stride and rows (4 slots each); each
    shared operand's address; each output's address; the addresses of
    ``omp_get_thread_num`` and ``omp_get_num_threads`` (read only with the split flag)."""
    inputs = 4
    shared = inputs + 4 * p.n_inputs
    outputs = shared + p.n_shared
    thread = outputs + len(p.outputs)
    return {"inputs": inputs, "shared": shared, "outputs": outputs, "thread": thread,
            "team": thread + 1, "size": thread + 2}


@functools.cache
def _numba():
    """The numba module, or None when it does not import (imported on first use)."""
    try:
        import numba
    except Exception:  # pragma: no cover - numba is a dependency, but be tolerant
        return None
    return numba


def cache_dir() -> str | None:
    """Where the generated kernel modules are written so that numba's disk cache serves
    them to later processes: ``$ACROBAT_CACHE_DIR``, else ``~/.cache/acrobat``, one folder
    per stamp of this package's sources (an edit of a kernel file or of this generator
    starts a new folder); None where it cannot be written (kernels are then compiled in
    every process)."""
    from acrobat_kernels import diskcache

    root = os.environ.get("ACROBAT_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "acrobat"
    )
    folder = os.path.join(root, "kernels-" + diskcache.sources_stamp()[:16])
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK) else None


def _kernel_module(p: Program) -> dict:
    """The namespace of ``p``'s generated module: imported from its file in
    :func:`cache_dir` (written once, atomically), where numba caches what it compiles;
    else executed from the source without the disk cache."""
    folder = cache_dir()
    if folder is None:
        namespace: dict = {"__name__": f"acrobat_kernels.generated.{_program_id(p)}"}
        exec(compile(numba_source(p), f"<acrobat_kernels {_program_id(p)}>", "exec"), namespace)
        return namespace
    name = f"ew_{_program_id(p)}"
    path = os.path.join(folder, name + ".py")
    source = numba_source(p, cache=True)
    try:
        with open(path) as f:
            current = f.read()
    except OSError:
        current = None
    if current != source:  # (rewritten only when missing or different: numba's cache is
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # keyed on its mtime)
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    module_name = f"acrobat_kernels.generated.{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # registered first: numba's cached code names its module, and imports it by that name
    # when it loads the code (in this process or a later one, before this returns)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)  # compiles or loads
    except BaseException:
        del sys.modules[module_name]
        raise
    return vars(module)


_numba_kernels: dict[Program, Any] = {}
_numba_lock = threading.Lock()


def _numba_kernel(p: Program):
    """The compiled ``entry`` cfunc of ``p`` (once per process; from numba's disk cache
    where :func:`cache_dir` is writable)."""
    kernel = _numba_kernels.get(p)
    if kernel is None:
        with _numba_lock:  # (the fusion compiles in a background thread)
            kernel = _numba_kernels.get(p)
            if kernel is None:
                kernel = _numba_kernels[p] = _kernel_module(p)["entry"]
    return kernel


@functools.cache
def _block_type(size: int):
    return ctypes.c_int64 * size


_direct_calls: dict[int, Any] = {}  # cfunc address -> its ctypes function


def _direct_call(address: int):
    """The ctypes function calling the kernel at ``address`` with its parameter block, on
    the calling thread alone (ctypes releases the GIL); made once per kernel."""
    fn = _direct_calls.get(address)
    if fn is None:
        fn = _direct_calls[address] = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(address)
    return fn


def _call(address: int, block) -> None:
    """The kernel at ``address`` on the calling thread alone."""
    _direct_call(address)(block)


def _run_numba(p: Program, n: int, F: int, sources, shared) -> list[torch.Tensor]:
    from acrobat_kernels import parallel

    kernel = _numba_kernel(p)
    threads = torch.get_num_threads()
    split = n * F >= PARALLEL_MIN_ELEMENTS and threads > 1 and parallel.available()
    bad = ctypes.c_int64(0)
    keep = []  # what the block points into, alive until the kernel returns
    ints = [n, F, split, ctypes.addressof(bad)]
    for buf, idx in sources:
        ints += [buf.data_ptr(), 0 if idx is None else idx.data_ptr(),
                 buf.stride(0) if len(buf) > 1 else F, len(buf)]  # fmt: skip
    for value in shared:
        vector = (value.expand(F) if value.numel() == 1 else value.reshape(F)).contiguous()
        keep.append(vector)
        ints.append(vector.data_ptr())
    outs = [torch.empty((n, F), dtype=_DTYPES[p.dtype]) for _ in p.outputs]
    ints += [out.data_ptr() for out in outs]
    ints += parallel.queries() if split else (0, 0)
    block = _block_type(len(ints))(*ints)
    if split:
        parallel.launch(kernel.address, block, threads)
    else:
        _call(kernel.address, block)
    del keep
    if bad.value:
        _raise_bad_index(sources)
    return outs


_NO_INDEX = ctypes.c_int64(0)  # the kernel's out-of-range flag, never set without indices


def cpu_caller(
    p: Program,
    shape: tuple,
    shared: Sequence[torch.Tensor] = (),
    layout: tuple | None = None,
    backend: str = "numba",
) -> Callable:
    """``call(n, *args) -> list of (n, F) outputs``: ``p``'s numba kernel on batched CPU
    operands, with nothing checked per call that the caller fixed once: a block's
    generated code (acrobat/codegen.py) knows every operand's per-instance ``shape``
    (``F`` elements), its dtype and that there are no index arrays; :func:`run`'s checks
    and general parameter block cost ~10 µs a call.

    ``layout[k] = (position, offset)``: input ``k`` is ``args[position]`` from its
    ``offset``-th column on (several inputs may be column ranges of one GEMM output: its
    chunks, one address and stride to read instead of one per chunk), or all of it
    where ``offset`` is None; ``layout`` None: input ``k`` is all of ``args[k]``. An
    argument read whole may have any layout that holds ``(n, *shape)`` (a 2-D view with
    unit inner stride is read in place, anything else is made one); one read by columns
    must be a 2-D ``(n, W)`` view with unit inner stride. ``shared``: the program's
    shared operands (0-d or ``F`` values), read at every call (a parameter updated in
    place is seen). Returns None instead of running when an argument is of another
    dtype, not on the CPU or not of a usable layout (the caller falls back to torch op
    by op). Compiles the kernel first if needed.
    ``backend="torch"``: the same calls run the torch reference (:func:`run`'s)."""
    from array import array

    from acrobat_kernels import parallel

    if backend == "torch":
        return _torch_caller(p, shape, shared, layout)
    address = _numba_kernel(p).address
    direct = _direct_call(address)
    dtype = _DTYPES[p.dtype]
    F = math.prod(shape)
    if layout is None:
        layout = tuple((k, None) for k in range(p.n_inputs))
    assert len(layout) == p.n_inputs
    by_columns = {pos for pos, offset in layout if offset is not None}
    layout = tuple((pos, (offset or 0) * dtype.itemsize) for pos, offset in layout)
    head = (F, 0, ctypes.addressof(_NO_INDEX))
    n_out = len(p.outputs)
    shared = tuple(shared)
    split_ok = parallel.available()
    queries = tuple(parallel.queries()) if split_ok else ()

    def call(n: int, *args: torch.Tensor):
        bases = []  # (address, row stride) per argument
        keep = []  # copies made here, alive until the kernel returns
        for pos, x in enumerate(args):
            if x.dtype is not dtype or x.dim() != 2 or x.stride(1) != 1 or x.shape[0] != n:
                if x.dtype is not dtype or not x.is_cpu or pos in by_columns:
                    return None
                x = x.expand(n, *shape).reshape(n, F)
                if x.stride(1) != 1:
                    x = x.contiguous()
                keep.append(x)
            elif not x.is_cpu:
                return None
            bases.append((x.data_ptr(), x.stride(0)))
        ints = array("q", (n, *head))
        for pos, offset in layout:
            base, stride = bases[pos]
            ints.extend((base + offset, 0, stride, n))
        for value in shared:
            if value.dim() != 1 or value.stride(0) != 1:
                value = value.expand(F).contiguous()
                keep.append(value)
            ints.append(value.data_ptr())
        outs = [torch.empty((n, F), dtype=dtype) for _ in range(n_out)]
        ints.extend([out.data_ptr() for out in outs])
        threads = torch.get_num_threads()
        if split_ok and threads > 1 and n * F >= PARALLEL_MIN_ELEMENTS:
            ints[2] = 1
            ints.extend(queries)
            parallel.launch(address, ints.buffer_info()[0], threads)
        else:
            ints.extend((0, 0))
            direct(ints.buffer_info()[0])
        return outs

    return call


def _torch_caller(p: Program, shape: tuple, shared, layout) -> Callable:
    """:func:`cpu_caller`'s calls, run by the torch reference backend."""
    F = math.prod(shape)
    dtype = _DTYPES[p.dtype]
    if layout is None:
        layout = tuple((k, None) for k in range(p.n_inputs))

    def call(n: int, *args: torch.Tensor):
        if any(x.dtype is not dtype for x in args):
            return None
        sources = []
        for pos, offset in layout:
            x = args[pos]
            if offset is None:
                x = x.expand(n, *shape).reshape(n, F)
            elif x.dim() != 2:
                return None
            else:
                x = x[:, offset : offset + F]
            sources.append((x, None))
        return _run_torch(p, n, F, sources, list(shared))

    return call


def _raise_bad_index(sources) -> None:
    for k, (buf, idx) in enumerate(sources):
        if idx is None:
            continue
        wrong = ((idx < 0) | (idx >= buf.shape[0])).nonzero()
        if len(wrong):
            i = int(wrong[0, 0])
            raise IndexError(
                f"sources[{k}]: idx[{i}] = {int(idx[i])} is out of range for a buf with "
                f"{buf.shape[0]} rows"
            )
    raise AssertionError("kernel reported an out-of-range index, but none was found")


# --------------------------------------------------------------------------------------
# 3c. The CUDA backend
# --------------------------------------------------------------------------------------

_CUDA_MATH = {
    "float32": {"exp": "expf", "log": "logf", "sqrt": "sqrtf", "tanh": "tanhf",
                "erf": "erff", "fabs": "fabsf"},
    "float64": {"exp": "exp", "log": "log", "sqrt": "sqrt", "tanh": "tanh",
                "erf": "erf", "fabs": "fabs"},
}
_CUDA_THREADS = 256


def _c_float(x: float) -> str:
    if math.isnan(x):
        return "(T)__longlong_as_double(0x7ff8000000000000LL)"
    if math.isinf(x):
        return ("" if x > 0 else "-") + "(T)__longlong_as_double(0x7ff0000000000000LL)"
    # A double literal cast to T rounds exactly as np.float32(x) and torch do.
    return f"(T){x!r}"


def _cuda_kernel_name(p: Program) -> str:
    return f"acrobat_ew_{_program_id(p)}"


def cuda_source(p: Program) -> str:
    """CUDA C++ source of one ``extern "C" __global__`` kernel for ``p``.

    Parameters: ``n, F``, per input ``buf, idx, row_stride, rows`` (``idx`` may be
    null: instance i then reads row i), per shared operand ``values, step``, then one
    output pointer per program output. A grid-stride loop covers the ``n * F``
    elements; an out-of-range index reads NaN instead of faulting. The source includes
    no headers, so NVRTC (cupy) and ``nvcc`` both compile it.
    """
    ctype = "float" if p.dtype == "float32" else "double"
    consts = _constants(p)
    name = _operand_names(p, consts)
    params = ["const long long n", "const long long F"]
    for k in range(p.n_inputs):
        params += [f"const {ctype}* __restrict__ buf{k}", f"const long long* __restrict__ idx{k}",
                   f"const long long stride{k}", f"const long long rows{k}"]
    for k in range(p.n_shared):
        params += [f"const {ctype}* __restrict__ sh{k}", f"const long long step{k}"]
    params += [f"{ctype}* __restrict__ out{m}" for m in range(len(p.outputs))]

    lines = [
        "// generated by acrobat_kernels for:\n// " + str(p).replace("\n", "\n// "),
        f'extern "C" __global__ void {_cuda_kernel_name(p)}(',
        "    " + ",\n    ".join(params),
        ") {",
        f"    typedef {ctype} T;",
    ]
    lines += [f"    const T {cname} = (T){value!r};" for cname, value in _KERNEL_CONSTANTS.items()]
    lines.append(f"    const T NOT_A_NUMBER = {_c_float(math.nan)};")
    lines += [f"    const T c{m} = {_c_float(value)};" for value, m in consts.items()]
    lines += [
        "    const long long total = n * F;",
        "    const long long step = (long long)blockDim.x * gridDim.x;",
        "    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;"
        " e += step) {",
        # 64-bit division is slow on GPUs; the branch is uniform across the grid.
        "        const long long i = total <= 0xffffffffLL ? (long long)((unsigned)e / (unsigned)F)"
        " : e / F;",
        "        const long long j = e - i * F;",
    ]
    for k in _used_operands(p, "in"):
        lines.append(f"        const long long r{k} = idx{k} ? idx{k}[i] : i;")
        lines.append(f"        const T x{k} = (r{k} >= 0 && r{k} < rows{k}) ? "
                     f"buf{k}[r{k} * stride{k} + j] : NOT_A_NUMBER;")
    for k in _used_operands(p, "sh"):
        lines.append(f"        const T s{k} = sh{k}[j * step{k}];")
    fmt_math = _CUDA_MATH[p.dtype]
    for j in _live_ops(p):
        op_name, args = p.ops[j]
        fmt = dict(zip("abc", (name(a) for a in args)), o=f"v{j}", **fmt_math)
        lines += [f"        const T {stmt.format(**fmt)};" for stmt in OPS_TABLE[op_name].cuda]
    for m, j in enumerate(p.outputs):
        lines.append(f"        out{m}[e] = v{j};")
    lines += ["    }", "}"]
    return "\n".join(lines) + "\n"


@functools.cache
def _cupy():
    """The cupy module, or None when it does not import (imported on first use)."""
    try:
        import cupy
    except Exception:
        return None
    return cupy


_cuda_kernels: dict[Program, Any] = {}


_streams: dict = {}  # torch stream handle -> cupy.cuda.ExternalStream


def cupy_stream(device: torch.device):
    """torch's current stream on ``device`` as cupy's (a kernel launched in it runs in
    order with torch's work), made once per stream; needs cupy."""
    handle = cuda_launch.raw_stream(device)
    stream = _streams.get(handle)
    if stream is None:
        with warnings.catch_warnings():  # (cupy 14 prefers Stream.from_external(protocol))
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = _streams[handle] = _cupy().cuda.ExternalStream(handle)
    return stream


#: Launch the generated kernels straight through the driver (cuda_launch.py: ~5 µs of
#: CPU a launch instead of cupy's ~15) where it can; else through cupy.
DRIVER_LAUNCH = True
_cuda_launchers: dict = {}  # (program, device index) -> cuda_launch.Launcher, or None


def _cuda_kernel(p: Program):
    kernel = _cuda_kernels.get(p)
    if kernel is None:
        kernel = _cuda_kernels[p] = _cupy().RawKernel(cuda_source(p), _cuda_kernel_name(p))
    return kernel


def _driver_launcher(p: Program, device: torch.device):
    """``p``'s kernel's driver launcher for ``device`` where it is the thread's current
    device (the driver launches in the current context), else None."""
    return cuda_launch.for_current_device(_cuda_launchers, p, device, _build_launcher, p)


def _build_launcher(index: int, p: Program):
    types = [_CTYPES[kind] for kind in _arg_kinds(p)]
    with _cupy().cuda.Device(index):  # (compiled and loaded for this device)
        return cuda_launch.launcher(_cuda_kernel(p).kernel, types)


def _arg_kinds(p: Program) -> str:
    """The kernel's parameters (cuda_source's order): ``u`` an address, ``i`` an int64."""
    return "ii" + "uuii" * p.n_inputs + "ui" * p.n_shared + "u" * len(p.outputs)


_CTYPES = {"u": ctypes.c_uint64, "i": ctypes.c_int64}  # (the driver's argument block)
_NP_TYPES = {"u": np.uint64, "i": np.int64}  # (cupy's)


def _run_cuda(p: Program, n: int, F: int, sources, shared) -> list[torch.Tensor]:
    if _cupy() is None or not torch.cuda.is_available():
        raise RuntimeError(
            "backend='cuda' needs cupy (pip install cupy-cuda12x) and a CUDA device; "
            "use backend='torch' or 'numba' on this machine"
        )
    tensors = [buf for buf, _ in sources] + list(shared)
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        raise ValueError("backend='cuda' needs every buf, idx and shared tensor on a CUDA device")
    return _launch_cuda(p, n, F, sources, shared, tensors[0].device)


def _launch_cuda(p: Program, n: int, F: int, sources, shared, device) -> list[torch.Tensor]:
    """The kernel's launch on checked arguments (n, F > 0; every tensor on ``device``)."""
    args: list = [n, F]
    for buf, idx in sources:
        args += [buf.data_ptr(), 0 if idx is None else idx.data_ptr(), buf.stride(0),
                 buf.shape[0]]  # fmt: skip
    for value in shared:
        args += [value.data_ptr(), 0 if value.numel() == 1 else 1]
    dtype = _DTYPES[p.dtype]
    outs = [torch.empty((n, F), dtype=dtype, device=device) for _ in p.outputs]
    args += [out.data_ptr() for out in outs]
    blocks = min(-(-n * F // _CUDA_THREADS), 65535)
    fast = _driver_launcher(p, device) if DRIVER_LAUNCH else None
    if fast is not None:
        fast(blocks, _CUDA_THREADS, cuda_launch.raw_stream(device), *args)
        return outs
    kernel = _cuda_kernel(p)
    typed = tuple(_NP_TYPES[kind](a) for kind, a in zip(_arg_kinds(p), args))
    with _cupy().cuda.Device(device.index), cupy_stream(device):
        kernel((blocks,), (_CUDA_THREADS,), typed)
    return outs


# --------------------------------------------------------------------------------------
# 4. Entry point
# --------------------------------------------------------------------------------------

_BACKENDS = {"torch": _run_torch, "numba": _run_numba, "cuda": _run_cuda}


def available_backends() -> list[str]:
    """The backends usable on this machine, e.g. ``["torch", "numba"]``."""
    found = ["torch"]
    if _numba() is not None:
        found.append("numba")
    if _cupy() is not None and torch.cuda.is_available():
        found.append("cuda")
    return found


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _check_args(p: Program, n: int, F: int, sources, shared):
    """Validate run()'s arguments; return (sources, shared) in the layout kernels need."""
    if not isinstance(p, Program):
        raise TypeError(f"expected a Program, got {type(p).__name__}")
    if not (isinstance(n, int) and n >= 0 and isinstance(F, int) and F >= 0):
        raise ValueError(f"n and F must be non-negative ints, got n={n!r}, F={F!r}")
    if len(sources) != p.n_inputs:
        raise ValueError(f"the program takes {p.n_inputs} per-instance source(s) "
                         f"(buf, idx), got {len(sources)}")
    if len(shared) != p.n_shared:
        raise ValueError(f"the program takes {p.n_shared} shared operand(s), got {len(shared)}")
    dtype = _DTYPES[p.dtype]

    checked_sources = []
    for k, source in enumerate(sources):
        if not (isinstance(source, (tuple, list)) and len(source) == 2):
            raise ValueError(f"sources[{k}]: expected a (buf, idx) pair, got {_describe(source)}")
        buf, idx = source
        if not isinstance(buf, torch.Tensor) or buf.dim() != 2:
            raise ValueError(f"sources[{k}]: buf must be a 2-D tensor (rows, F={F}), got "
                             f"{_describe(buf)}; "
                             "flatten each instance's operand into one row (buf.reshape(rows, -1))")
        if buf.shape[1] != F:
            raise ValueError(f"sources[{k}]: buf rows have length {buf.shape[1]}, expected F={F}")
        if buf.dtype != dtype:
            raise ValueError(f"sources[{k}]: buf has dtype {buf.dtype}, the program is {p.dtype}")
        if F > 1 and buf.stride(1) != 1:
            buf = buf.contiguous()
        if idx is None:
            if buf.shape[0] < n:
                raise ValueError(f"sources[{k}]: idx is None (rows 0..{n - 1}), but buf has "
                                 f"only {buf.shape[0]} rows")
        else:
            if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.shape[0] != n:
                raise ValueError(f"sources[{k}]: idx must be a 1-D tensor of length n={n}, "
                                 f"got {_describe(idx)}")
            if idx.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"sources[{k}]: idx must be int64, got {idx.dtype}")
            if idx.device != buf.device:
                raise ValueError(f"sources[{k}]: idx is on {idx.device}, buf on {buf.device}")
            if idx.dtype != torch.int64 or not idx.is_contiguous():
                idx = idx.to(torch.int64).contiguous()
        checked_sources.append((buf, idx))

    checked_shared = []
    for k, value in enumerate(shared):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"shared[{k}]: expected a tensor, got {_describe(value)}")
        if not (value.dim() == 0 or (value.dim() == 1 and value.shape[0] in (F, 1))):
            raise ValueError(f"shared[{k}]: expected a 0-d tensor or a 1-D tensor of length "
                             f"F={F}, got shape {tuple(value.shape)}; try value.reshape({F})")
        if value.dtype != dtype:
            raise ValueError(f"shared[{k}]: dtype {value.dtype}, the program is {p.dtype}")
        checked_shared.append(value if value.is_contiguous() else value.contiguous())

    devices = {t.device for t, _ in checked_sources} | {t.device for t in checked_shared}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return checked_sources, checked_shared


def _needs_grad(sources, shared) -> bool:
    return torch.is_grad_enabled() and any(
        t.requires_grad for t in [buf for buf, _ in sources] + list(shared)
    )


def run(
    program: Program,
    n: int,
    F: int,
    sources: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    shared: Sequence[torch.Tensor] = (),
    backend: str = "auto",
) -> list[torch.Tensor]:
    """Run ``program`` on a batch of ``n`` instances of ``F`` elements each.

    ``sources[k] = (buf, idx)`` supplies per-instance operand k: instance ``i`` reads
    row ``idx[i]`` of the 2-D tensor ``buf`` (rows of length ``F``, unit stride inside a
    row; any row stride, e.g. a column slice of a wider tensor, is read in place). ``idx``
    is an int64 tensor of length ``n``, or None for rows ``0..n-1``. ``shared[k]`` is a
    0-d tensor or a 1-D tensor of length ``F``, the same for every instance. Returns one
    new ``(n, F)`` tensor per program output.

    ``backend`` is ``"torch"``, ``"numba"``, ``"cuda"`` or ``"auto"`` (see the module
    docstring). Only ``"torch"`` records autograd; ``"auto"`` picks it when a
    gradient is needed, an explicit ``"numba"`` or ``"cuda"`` then raises.

    Raises ``ValueError`` for malformed arguments, ``IndexError`` for an out-of-range
    index (torch and numba backends), ``RuntimeError`` for an unavailable backend.
    """
    checked_sources, checked_shared = _check_args(program, n, F, sources, shared)
    if backend == "auto":
        backend = _auto_backend(checked_sources, checked_shared)
    elif backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of "
                         f"{['auto', *_BACKENDS]}")
    elif backend != "torch" and _needs_grad(checked_sources, checked_shared):
        raise ValueError(f"backend={backend!r} does not record autograd, but an operand "
                         "requires grad; use backend='torch' (or 'auto')")
    if n == 0 or F == 0:
        return [torch.empty((n, F), dtype=_DTYPES[program.dtype],
                            device=_device(checked_sources, checked_shared))
                for _ in program.outputs]
    if backend == "numba":
        if _numba() is None:
            raise RuntimeError("backend='numba' needs numba (pip install numba)")
        if _device(checked_sources, checked_shared).type != "cpu":
            raise ValueError("backend='numba' needs CPU tensors; use backend='cuda' or 'torch'")
    return _BACKENDS[backend](program, n, F, checked_sources, checked_shared)


def run_built(program: Program, n: int, F: int, sources, shared, backend: str = "auto"):
    """:func:`run` for a caller that builds its arguments (acrobat's fused regions): 2-D
    ``buf``s of rows of length ``F``, each ``idx`` None or a contiguous int64 tensor of
    length ``n`` on its ``buf``'s device, ``shared`` as :func:`run` takes them, no result
    needing a gradient (fused regions run without autograd). On a CUDA
    device with ``"auto"`` or ``"cuda"`` it launches the kernel without :func:`run`'s
    checks (~8 µs of CPU a call with five operands, where a launch costs ~5); anything
    else (another device or backend, a dtype other than the program's) goes to
    :func:`run`, which checks and raises as usual."""
    if n and F and backend in ("auto", "cuda") and sources and _cupy() is not None:
        device = sources[0][0].device
        dtype = _DTYPES[program.dtype]
        if device.type == "cuda":
            built = []
            for buf, idx in sources:
                if buf.dtype != dtype or buf.device != device:
                    break
                built.append((buf if F == 1 or buf.stride(1) == 1 else buf.contiguous(), idx))
            else:
                if all(v.dtype == dtype and v.device == device for v in shared):
                    shared = [v if v.is_contiguous() else v.contiguous() for v in shared]
                    return _launch_cuda(program, n, F, built, shared, device)
    return run(program, n, F, sources, shared, backend=backend)


def _device(sources, shared) -> torch.device:
    for t in [buf for buf, _ in sources] + list(shared):
        return t.device
    return torch.device("cpu")


def _auto_backend(sources, shared) -> str:
    if _needs_grad(sources, shared):
        return "torch"
    device = _device(sources, shared)
    if device.type == "cpu" and _numba() is not None:
        return "numba"
    if device.type == "cuda" and _cupy() is not None:
        return "cuda"
    return "torch"
