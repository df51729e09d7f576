"""float32 ``exp``, ``tanh``, ``log`` and ``erf`` that LLVM can vectorize, for numba kernels.

numba lowers ``math.exp``, ``math.tanh`` etc. to calls into the C library, one element at
a time, and a call inside a loop stops LLVM's loop vectorizer. torch evaluates the same
functions with SIMD code, so a fused kernel built on libm calls loses to ten unfused
torch passes (about 4x slower for an LSTM cell tail). The functions here use only
arithmetic, selects and bit casts, and are inlined into the kernel by numba
(``inline="always"``), so the whole per-element loop vectorizes (AVX2/AVX-512).

Accuracy, measured over the float32 range against float64 libm: ``exp_f32`` within
1.2 ulp, ``tanh_f32``, ``log_f32`` and ``erf_f32`` within about 2.5 ulp; inf, -inf, NaN,
zeros and denormals behave as in libm. The polynomial coefficients are least-squares
fits of the relative error on Chebyshev nodes (numpy, float64), made for this module.

float64 kernels keep libm: a float64 polynomial needs about twice the degree, and the
runtime's models are float32.

Importing this module imports numba; :mod:`acrobat_kernels.elementwise` does so only when
it compiles its first numba kernel.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from acrobat_kernels import diskcache

F32 = np.float32

#: numba's fastmath flags of every kernel built on these functions: fused multiply-adds
#: only (``a * b + c`` rounded once: the polynomials take half the instructions, ~1.5x
#: faster kernels, and are as accurate or more). No reassociation, which could fold the
#: rounding below away, and no assumptions about NaN, infinities or signed zeros.
_CONTRACT = {"contract"}

# Adding and subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to the nearest
# integer, with plain IEEE arithmetic (no reassociation is allowed, so it is not folded).
_ROUNDER = F32(12582912.0)

# Cody-Waite split of ln 2: LN2_HI has 9 significant bits, so k * LN2_HI is exact for
# the |k| <= 151 that occur here.
_LOG2E = F32(1.4426950408889634)
_LN2_HI = F32(0.693359375)
_LN2_LO = F32(-2.12194440e-4)

# tanh(x) = x + x * u * P(u), u = x*x, for |x| < _TANH_SMALL. P is a least-squares fit of
# (tanh(x)/x - 1)/u on Chebyshev nodes, weighted for relative error (max 0.77 ulp).
_TANH_SMALL = F32(0.625)
_TANH_P = tuple(F32(c) for c in (
    -0.33333281279109583,
    0.1333143161004856,
    -0.053739143911890275,
    0.020637818509370374,
    -0.00570399251201333,
))


# erf(x) = x * P(u), u = x*x, for |x| < 1 (max 2.2 ulp).
_ERF_P = tuple(F32(c) for c in (
    1.1283791211670153,
    -0.37612319789478627,
    0.112801305031135,
    -0.02670995334602992,
    0.004916025534026841,
    -0.0005625397982168268,
))
# erf(x) = 1 - exp(-x*x) * Q(1/x) for 1 <= x, fitted on [1, 4] (max 1.3 ulp). Past 4 the
# product is below 2e-8 (Q stays bounded for 1/x in (0, 1/4]), so the result rounds to 1.
_ERF_Q = tuple(F32(c) for c in (
    0.00033560270994433173,
    0.557938346769195,
    0.04987010464193106,
    -0.502415288412597,
    0.5694933028716013,
    -0.3475894582467523,
    0.11689795199681877,
    -0.016946940309012982,
))

_INF = F32(np.inf)
_NAN = F32(np.nan)
_SMALLEST_NORMAL = F32(1.1754943508222875e-38)
_TWO_POW_23 = F32(8388608.0)


@intrinsic
def _pow2_f32(typingctx, k):
    """2**k for a float32 ``k`` holding an integer in [-126, 127]: built from its bits."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        exponent = builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(exponent, ir.Constant(i32, 23)), ir.FloatType())

    return types.float32(types.float32), codegen


@intrinsic
def _split_f32(typingctx, x):
    """(m, e) with x = m * 2**e, m in [1, 2), for a positive normal float32 ``x``."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        mantissa_bits = builder.or_(builder.and_(bits, ir.Constant(i32, 0x007FFFFF)),
                                    ir.Constant(i32, 0x3F800000))
        mantissa = builder.bitcast(mantissa_bits, ir.FloatType())
        exponent = builder.sub(builder.lshr(bits, ir.Constant(i32, 23)), ir.Constant(i32, 127))
        exponent = builder.sitofp(exponent, ir.FloatType())
        return context.make_tuple(builder, signature.return_type, (mantissa, exponent))

    return types.UniTuple(types.float32, 2)(types.float32), codegen


@njit(error_model="numpy", fastmath=_CONTRACT, inline="always")
def exp_f32(x):
    """exp(x) in float32: x = k ln2 + r, |r| <= ln2/2, exp(r) by its degree-7 Taylor
    polynomial (truncation error 7e-9 relative), times 2**k."""
    is_nan = x != x
    y = F32(0.0) if is_nan else x  # keep NaN out of the float->int conversion below
    y = F32(89.0) if y > F32(89.0) else y  # exp(89) overflows to inf anyway
    y = F32(-104.0) if y < F32(-104.0) else y  # exp(-104) underflows to 0 anyway
    k = (y * _LOG2E + _ROUNDER) - _ROUNDER
    r = (y - k * _LN2_HI) - k * _LN2_LO
    p = F32(1.0 / 5040.0)
    p = p * r + F32(1.0 / 720.0)
    p = p * r + F32(1.0 / 120.0)
    p = p * r + F32(1.0 / 24.0)
    p = p * r + F32(1.0 / 6.0)
    p = p * r + F32(0.5)
    p = p * r + F32(1.0)
    p = p * r + F32(1.0)
    # k lies in [-150, 129]; scale in two halves so each power of two is a normal float.
    k_half = (k * F32(0.5) + _ROUNDER) - _ROUNDER
    result = (p * _pow2_f32(k_half)) * _pow2_f32(k - k_half)
    return x if is_nan else result


@njit(error_model="numpy", fastmath=_CONTRACT, inline="always")
def tanh_f32(x):
    """tanh(x) in float32: an odd polynomial near 0, (1 - e)/(1 + e) with e = exp(-2|x|)
    elsewhere (no cancellation there: e <= 0.29). Both are computed, one is selected,
    so the loop stays branch-free."""
    u = x * x
    p = _TANH_P[4]
    p = p * u + _TANH_P[3]
    p = p * u + _TANH_P[2]
    p = p * u + _TANH_P[1]
    p = p * u + _TANH_P[0]
    near_zero = x + x * (u * p)
    near_zero = x if u == F32(0.0) else near_zero  # keeps -0.0 (x * (u * p) is +0 there)
    a = abs(x)
    e = exp_f32(F32(-2.0) * a)
    far = (F32(1.0) - e) / (F32(1.0) + e)
    far = -far if x < F32(0.0) else far
    return near_zero if a < _TANH_SMALL else far


@njit(error_model="numpy", fastmath=_CONTRACT, inline="always")
def log_f32(x):
    """log(x) in float32: x = m * 2**e with m in [sqrt(1/2), sqrt(2)), then
    log(m) = 2 atanh(s), s = (m - 1)/(m + 1), |s| <= 0.172, by its series to s**9
    (truncation error 2e-9 relative); m - 1 is exact, so log stays accurate near 1."""
    tiny = x < _SMALLEST_NORMAL
    y = x * _TWO_POW_23 if tiny else x  # denormals: scale into the normal range
    y = F32(1.0) if not y > F32(0.0) else y  # keep 0, negatives and NaN out of the split
    m, e = _split_f32(y)
    big = m > F32(1.4142135623730951)
    m = m * F32(0.5) if big else m
    e = e + F32(1.0) if big else e
    e = e - F32(23.0) if tiny else e
    s = (m - F32(1.0)) / (m + F32(1.0))
    s2 = s * s
    p = F32(1.0 / 9.0)
    p = p * s2 + F32(1.0 / 7.0)
    p = p * s2 + F32(1.0 / 5.0)
    p = p * s2 + F32(1.0 / 3.0)
    log_m = F32(2.0) * s + F32(2.0) * s * (s2 * p)
    result = e * _LN2_HI + (log_m + e * _LN2_LO)
    result = -_INF if x == F32(0.0) else result
    result = _NAN if x < F32(0.0) else result
    return x if not x < _INF else result  # inf stays inf, NaN stays NaN


@njit(error_model="numpy", fastmath=_CONTRACT, inline="always")
def erf_f32(x):
    """erf(x) in float32: an odd polynomial for |x| < 1, 1 - exp(-x*x) * Q(1/|x|)
    beyond, both computed and one selected."""
    u = x * x
    p = _ERF_P[5]
    p = p * u + _ERF_P[4]
    p = p * u + _ERF_P[3]
    p = p * u + _ERF_P[2]
    p = p * u + _ERF_P[1]
    p = p * u + _ERF_P[0]
    near_zero = x * p
    a = abs(x)
    t = F32(1.0) / a
    q = _ERF_Q[7]
    q = q * t + _ERF_Q[6]
    q = q * t + _ERF_Q[5]
    q = q * t + _ERF_Q[4]
    q = q * t + _ERF_Q[3]
    q = q * t + _ERF_Q[2]
    q = q * t + _ERF_Q[1]
    q = q * t + _ERF_Q[0]
    far = F32(1.0) - exp_f32(-u) * q
    far = -far if x < F32(0.0) else far
    return near_zero if a < F32(1.0) else far


# ---- whole-buffer tanh kernels (acrobat_kernels/unary.py), cached on disk ------------
# Module-level functions without closures, so numba's cache key (their bytecode and the
# package's stamp, acrobat_kernels/diskcache.py) is the same in every process. Compiled
# from the cache, the three load in ~0.05 s instead of ~0.9 s of compiling in every
# process (the first map).


def pointer_cast(ptr_type):
    """An intrinsic turning an integer address into a ``ptr_type`` (numba has no builtin),
    for ``numba.carray`` over an address (acrobat_kernels.unary.address_casts)."""

    @intrinsic
    def as_ptr(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(ptr_type))

        return ptr_type(address), codegen

    return as_ptr


_as_f32 = pointer_cast(types.CPointer(types.float32))


def _tanh_buffer(src, dst, n):  # pragma: no cover - compiled by numba
    x = carray(_as_f32(src), (n,))
    y = carray(_as_f32(dst), (n,))
    for i in range(n):
        y[i] = tanh_f32(x[i])


def _tanh_rows(src, dst, rows, cols, stride):  # pragma: no cover - compiled by numba
    # rows spaced ``stride`` elements apart in x (a column slice), packed in y
    x = carray(_as_f32(src), ((rows - 1) * stride + cols,))
    y = carray(_as_f32(dst), (rows * cols,))
    for r in range(rows):
        xr = x[r * stride : r * stride + cols]
        yr = y[r * cols : r * cols + cols]
        for j in range(cols):
            yr[j] = tanh_f32(xr[j])


def _tanh_in_place(address, n):  # pragma: no cover - compiled by numba
    # one pointer: with two equal ones LLVM's runtime overlap check picks its scalar
    # loop (13x slower)
    y = carray(_as_f32(address), (n,))
    for i in range(n):
        y[i] = tanh_f32(y[i])


def tanh_kernels() -> tuple:
    """``(buffer(src, dst, n), rows(src, dst, rows, cols, stride), in_place(address, n))``:
    float32 ``tanh`` over addresses, compiled (or loaded from numba's cache beside this
    file, else its user-wide cache directory; not cached where neither can be written)."""
    i = types.intp
    return tuple(
        diskcache.compiled(
            lambda cache, sig=sig: njit(
                sig, cache=cache, error_model="numpy", fastmath=_CONTRACT, nogil=True
            ),
            fn,
        )
        for fn, sig in (
            (_tanh_buffer, types.void(i, i, i)),
            (_tanh_rows, types.void(i, i, i, i, i)),
            (_tanh_in_place, types.void(i, i)),
        )
    )
