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


def _share(rows, me, parts):  # pragma: no cover - compiled by numba
    """``(r0, r1)``: the rows thread ``me`` of ``parts`` takes, in whole blocks of the product
    loop (eight rows; four for fewer than 16, so that 8 to 15 rows still split): the whole
    blocks dealt out evenly, the first threads one more where they do not divide, the
    rows past the last whole block to the last thread (one of the fewest blocks); ``r0 ==
    r1`` for a thread left without rows. (Each thread's share rounded up to whole blocks
    gave the first thread up to seven rows more than half: 67 rows split 40 / 27.)"""
    block = 8 if rows >= 16 else 4
    full = rows // block
    base = full // parts
    extra = full - base * parts
    r0 = block * (me * base + min(me, extra))
    r1 = r0 + block * (base + (1 if me < extra else 0))
    if me == parts - 1:
        r1 = rows
    return min(r0, rows), min(r1, rows)


share = diskcache.compiled(lambda cache: njit(cache=cache), _share)


def _row_share(rows, thread_fn, team_fn):  # pragma: no cover - compiled by numba
    """:func:`_share` for the calling thread of torch's OpenMP team (``thread_fn``,
    ``team_fn``: the addresses of ``omp_get_thread_num`` and ``omp_get_num_threads``)."""
    return share(rows, _call_int(thread_fn), _call_int(team_fn))


row_share = diskcache.compiled(lambda cache: njit(cache=cache), _row_share)


def _linear_loop(xa, wa, ws, ca, c_rows, oa, m, k, n, os, xs):  # pragma: no cover - numba
    # out = x @ W.T (+ c) over the first k columns of x, whose rows are ``xs`` apart; out's
    # (and a per-row addend's) rows are ``os`` apart: a thread's block of columns
    x = carray(_as_f32(xa), (m, xs))
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


#: Columns per test of :func:`_width` (a multiple of the vector width: a row cut at a
#: chunk's edge adds its terms in the lanes the whole row's would).
ZERO_CHUNK = 32

#: Fewest rows a run at an end of ``x`` has to have to be cut from rows that are not
#: (one pass of the product loop over ``W``).
MIN_RUN = 8


def _width(x, r, k):  # pragma: no cover - compiled by numba
    """Columns of row ``r`` of ``x`` up to the end of its last chunk of ZERO_CHUNK that is
    not all zeros (0: the row is zero). Sums of ``abs``: NaN and infinities count."""
    end = k
    while end > 0:
        start = max(end - ZERO_CHUNK, 0)
        s = 0.0
        for t in range(start, end):
            s += abs(x[r, t])
        if s != 0.0:
            return end
        end = start
    return 0


width = diskcache.compiled(lambda cache: njit(cache=cache), _width)


def _zero_runs(xa, m, k):  # pragma: no cover - compiled by numba
    """``(b, kb, a, ka)``: rows ``0..b-1`` and ``a..m-1`` (b <= a) are runs at the ends of
    ``x`` whose nonzeros all lie in their first ``kb`` / ``ka`` columns, at most three
    quarters of ``k`` (a constant zero state gathered with the other rows: DRNN's first
    sibling's ``h_f = 0``, alone or joined after its ``h_a``); a run is empty where its
    end row is wide, or where it has fewer than MIN_RUN rows and other rows are wide.
    One chunk per end where no row is cut."""
    x = carray(_as_f32(xa), (m, k))
    limit = (3 * k) // 4
    a, ka = m, 0
    while a > 0:
        w = width(x, a - 1, k)
        if w > limit:
            break
        ka = max(ka, w)
        a -= 1
    b, kb = 0, 0
    while b < a:
        w = width(x, b, k)
        if w > limit:
            break
        kb = max(kb, w)
        b += 1
    if a > 0 and m - a < MIN_RUN:  # a short run beside wide rows: a pass over W more
        a, ka = m, 0
    if b < MIN_RUN and b < m:  # (for a few rows) saves less than it costs
        b, kb = 0, 0
    return b, kb, a, ka


zero_runs = diskcache.compiled(lambda cache: njit(cache=cache), _zero_runs)


def _linear_part(params):  # pragma: no cover - compiled by numba
    # gemm.py's parameters: x, W, W's row stride, c, c's rows, out, m, K, N, tanh?,
    # split by columns?, cut zero columns? (W finite); [14], [15]: the OpenMP queries
    # (parallel.params)
    p = carray(_as_i64(params), (16,))
    m, k, n, c_rows = p[6], p[7], p[8], p[4]
    b, kb, a, ka = 0, k, m, k
    if p[11]:  # rows whose last columns are zero: multiplied over their other columns
        b, kb, a, ka = zero_runs(p[0], m, k)
    me, parts = _call_int(p[14]), _call_int(p[15])
    turn = 0  # a part's rounded-up larger share of rows: the first thread's, then the last's
    for seg in range(3):  # rows 0..b-1, b..a-1, a..m-1, each split over the threads
        s0, s1, kk = (0, b, kb) if seg == 0 else ((b, a, k) if seg == 1 else (a, m, ka))
        if s1 <= s0:
            continue
        who = me if turn % 2 == 0 else parts - 1 - me
        turn += 1
        xa = p[0] + s0 * k * 4
        ca = p[3] + s0 * n * 4 if c_rows > 1 else p[3]
        if p[10]:  # by columns: this thread's rows of W (the same in every part), all of x
            j0, j1 = share(n, me, parts)
            if j1 > j0:
                cj = ca + j0 * 4 if c_rows > 0 else ca
                c_part = s1 - s0 if c_rows > 1 else c_rows
                oa = p[5] + (s0 * n + j0) * 4
                _linear(xa, p[1] + j0 * p[2] * 4, p[2], cj, c_part, oa, s1 - s0, kk, j1 - j0,
                        n, k)  # fmt: skip
                if p[9]:  # its tanh, over the thread's columns while they are in its cache
                    for r in range(s1 - s0):
                        _squash(oa + r * n * 4, j1 - j0)
            continue
        r0, r1 = share(s1 - s0, who, parts)  # this thread's rows
        if r1 > r0:
            cr = ca + r0 * n * 4 if c_rows > 1 else ca
            c_part = r1 - r0 if c_rows > 1 else c_rows
            oa = p[5] + (s0 + r0) * n * 4
            _linear(xa + r0 * k * 4, p[1], p[2], cr, c_part, oa, r1 - r0, kk, n, n, k)
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
        _linear = _jit(_linear_loop, 11)
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
