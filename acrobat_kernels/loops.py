"""The CPU loops of gemm.py and recurrence.py, defined at module level so that numba's disk
cache serves them to every later process.

A kernel compiled inside a function closes over what it calls (the product loop, the
pointer casts), and numba keys a cached closure on the pickled closure variables, which
differ from process to process: such a kernel never hit the cache and added an entry to
it every process (TreeLSTM's first map paid ~1.6 s for the linear loop, BiRNN's ~3.3 s more
for the recurrence, every time). Here every kernel is a module-level function whose
callees are module globals, set before it is compiled; the thread-split entries (numba
``cfunc``s that torch's OpenMP team runs, acrobat_kernels/parallel.py) ask the OpenMP
runtime for their thread number through function addresses passed in their parameter
block (:func:`acrobat_kernels.parallel.params`) instead of addresses compiled in, so they
are cached too. The cache's stamp covers every file of this package
(acrobat_kernels/diskcache.py): an edit of any callee recompiles.

Importing this module imports numba and compiles nothing; :func:`linear_kernels` and
:func:`elman_kernels` compile (or load) on first use.
"""

from __future__ import annotations

from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

from acrobat_kernels import diskcache, parallel
from acrobat_kernels.vecmath import pointer_cast, tanh_f32

_as_f32 = pointer_cast(types.CPointer(types.float32))
_as_f64 = pointer_cast(types.CPointer(types.float64))  # (the generated elementwise kernels')
_as_i64 = pointer_cast(types.CPointer(types.int64))
_I = types.intp
_FAST = {"reassoc", "contract"}

# Set before the kernels that call them are compiled (numba reads a global when it
# compiles, and caches what it compiled).
_product = None  # gemm.rows_product()
_squash = None  # unary.tanh_in_place()
_linear = None  # the linear loop, njit
_elman = None  # the Elman loop, njit


@intrinsic
def _call_int(typingctx, address):
    """``f()`` for the C function ``int f(void)`` at ``address`` (an OpenMP query)."""

    def codegen(context, builder, signature, args):
        fn = builder.inttoptr(args[0], ir.FunctionType(ir.IntType(32), []).as_pointer())
        return builder.sext(builder.call(fn, []), ir.IntType(64))

    return types.int64(address), codegen


def _row_share(rows, thread_fn, team_fn):  # pragma: no cover - compiled by numba
    """``(r0, r1)``: the rows of a row-split kernel that the calling thread of torch's
    OpenMP team takes (``thread_fn``, ``team_fn``: the addresses of
    ``omp_get_thread_num`` and ``omp_get_num_threads``), in whole blocks of the product
    loop (eight rows; four for fewer than 16, so that 8 to 15 rows still split); ``r0 ==
    r1`` for a thread left without rows."""
    parts = _call_int(team_fn)
    block = 8 if rows >= 16 else 4
    per = ((rows + parts - 1) // parts + block - 1) // block * block
    r0 = min(_call_int(thread_fn) * per, rows)
    return r0, min(r0 + per, rows)


row_share = diskcache.compiled(lambda cache: njit(cache=cache), _row_share)


def _linear_loop(xa, wa, ws, ca, c_rows, oa, m, k, n, os):  # pragma: no cover - numba
    # out = x @ W.T (+ c); out's (and a per-row addend's) rows are ``os`` apart: a
    # thread's block of columns
    x = carray(_as_f32(xa), (m, k))
    w = carray(_as_f32(wa), ((n - 1) * ws + k,))  # row j starts at j * ws
    out = carray(_as_f32(oa), (m, os))[:, :n]
    c = carray(_as_f32(ca), (max(c_rows, 1), os))[:, :n]
    _product(x, w, ws, out, m, k, n)
    if c_rows == 1:  # the bias, or the addend of addmm
        for r in range(m):
            for j in range(n):
                out[r, j] += c[0, j]
    elif c_rows > 1:
        for r in range(m):
            for j in range(n):
                out[r, j] += c[r, j]


def _linear_part(params):  # pragma: no cover - compiled by numba
    # gemm.py's parameters: x, W, W's row stride, c, c's rows, out, m, K, N, tanh?,
    # split by columns?; [14], [15]: the OpenMP queries (parallel.params)
    p = carray(_as_i64(params), (16,))
    m, k, n, c_rows = p[6], p[7], p[8], p[4]
    if p[10]:  # by columns: this thread's rows of W, every row of x
        j0, j1 = row_share(n, p[14], p[15])
        if j1 > j0:
            ca = p[3] + j0 * 4 if c_rows > 0 else p[3]
            oa = p[5] + j0 * 4
            _linear(p[0], p[1] + j0 * p[2] * 4, p[2], ca, c_rows, oa, m, k, j1 - j0, n)
            if p[9]:  # its tanh, over the thread's columns while they are in its cache
                for r in range(m):
                    _squash(oa + r * n * 4, j1 - j0)
        return
    r0, r1 = row_share(m, p[14], p[15])  # this thread's rows
    if r1 > r0:
        ca = p[3] + r0 * n * 4 if c_rows > 1 else p[3]
        c_part = r1 - r0 if c_rows > 1 else c_rows
        oa = p[5] + r0 * n * 4
        _linear(p[0] + r0 * k * 4, p[1], p[2], ca, c_part, oa, r1 - r0, k, n, n)
        if p[9]:
            _squash(oa, (r1 - r0) * n)


def _elman_loop(  # pragma: no cover - compiled by numba
    ca, per_step, ha, wa, ws, ba, oa, fa, acta, offa, steps, rows, n, r0, r1
):
    # rows r0..r1-1 only: rows do not interact, so two calls on two threads can share
    active = carray(_as_i64(acta), (steps,))
    offsets = carray(_as_i64(offa), (steps,))
    total = offsets[steps - 1] + active[steps - 1]
    c = carray(_as_f32(ca), (total if per_step else rows, n))
    h0 = carray(_as_f32(ha), (rows, n))
    w = carray(_as_f32(wa), ((n - 1) * ws + n,))
    out = carray(_as_f32(oa), (total, n))
    final = carray(_as_f32(fa), (rows, n))
    bias = carray(_as_f32(ba), (n,))
    for t in range(steps):
        a = min(active[t], r1)
        if a <= r0:
            break
        o = offsets[t]
        prev = h0[r0:] if t == 0 else out[offsets[t - 1] + r0 :]
        step = out[o + r0 : o + a]
        _product(prev, w, ws, step, a - r0, n, n)
        for r in range(a - r0):
            cr = c[o + r0 + r] if per_step else c[r0 + r]
            sr = step[r]
            if ba != 0:
                for j in range(n):
                    sr[j] = tanh_f32((sr[j] + bias[j]) + cr[j])
            else:
                for j in range(n):
                    sr[j] = tanh_f32(sr[j] + cr[j])
        stop = max(min(active[t + 1], r1) if t + 1 < steps else 0, r0)
        for r in range(stop, a):  # rows whose last step this was
            final[r] = out[o + r]
    for r in range(max(active[0], r0), r1):  # rows that take no step keep h0
        final[r] = h0[r]


def _elman_part(params):  # pragma: no cover - compiled by numba
    # recurrence.py's 13 parameters; [14], [15]: the OpenMP queries (parallel.params)
    p = carray(_as_i64(params), (16,))
    rows = p[11]
    r0, r1 = row_share(rows, p[14], p[15])  # this thread's rows, for every step
    if r1 > r0:
        _elman(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10],
               rows, p[12], r0, r1)  # fmt: skip


def _jit(fn, n_args: int):
    return diskcache.compiled(
        lambda cache: njit(
            types.void(*[_I] * n_args), fastmath=_FAST, error_model="numpy", nogil=True,
            cache=cache,
        ),
        fn,
    )  # fmt: skip


#: The compiled thread-split entries (numba ``CFunc``s) by name: kept alive here, their
#: machine code must outlive every call through their address.
ENTRIES: dict = {}


def _entry(fn):
    """The thread-split entry ``void(intp)`` of ``fn``: its address, or 0 where torch's
    OpenMP team is not reachable (parallel.available)."""
    if not parallel.available():
        return 0
    made = diskcache.compiled(
        lambda cache: cfunc(types.void(_I), fastmath=_FAST, error_model="numpy", cache=cache),
        fn,
    )
    ENTRIES[fn.__name__] = made
    return made.address


_linear_kernels = None
_elman_kernels = None


def linear_kernels() -> tuple:
    """``(kernel, entry)``: the linear loop ``kernel(x, W, W's row stride, c, c's rows,
    out, m, K, N, out's row stride)`` over addresses (acrobat_kernels/gemm.py) and the
    address of its thread-split entry (0 where unavailable)."""
    global _linear_kernels, _product, _squash, _linear
    if _linear_kernels is None:
        from acrobat_kernels import gemm, unary

        _product, _squash = gemm.rows_product(), unary.tanh_in_place()
        _linear = _jit(_linear_loop, 10)
        _linear_kernels = (_linear, _entry(_linear_part))
    return _linear_kernels


def elman_kernels() -> tuple:
    """``(kernel, entry)``: the Elman loop of acrobat_kernels/recurrence.py and the address
    of its thread-split entry (0 where unavailable)."""
    global _elman_kernels, _product, _elman
    if _elman_kernels is None:
        from acrobat_kernels import gemm

        _product = gemm.rows_product()
        _elman = _jit(_elman_loop, 15)
        _elman_kernels = (_elman, _entry(_elman_part))
    return _elman_kernels
