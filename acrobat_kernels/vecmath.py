"""float32 ``exp`` and ``tanh`` that LLVM can vectorize, for the numba kernels.

numba lowers ``math.exp``/``math.tanh`` to calls into the C library, one element at a
time, and a call inside a loop stops LLVM's loop vectorizer. torch evaluates the same
functions with SIMD code, so a fused kernel built on libm calls loses to ten unfused
torch passes (about 4x slower for an LSTM cell tail). The functions here use only
arithmetic, selects and one bit cast, so after numba inlines them into a kernel the
whole per-element loop vectorizes (AVX2/AVX-512).

Accuracy, measured over the whole float32 range against float64 ``numpy.exp``/``tanh``:
``exp_f32`` within 1.2 ulp, ``tanh_f32`` within 2 ulp; inf, -inf and NaN behave as in
libm, and results below the normal range come out as denormals or zero.

float64 kernels keep libm: a float64 polynomial needs about twice the degree, and the
runtime's models are float32.

Importing this module imports numba; :mod:`acrobat_kernels.elementwise` does so only when
it compiles its first numba kernel.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

F32 = np.float32

# Adding and subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to the nearest
# integer, with plain IEEE arithmetic (fastmath is off, so it is not folded away).
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


@intrinsic
def _pow2_f32(typingctx, k):
    """2**k for a float32 ``k`` holding an integer in [-126, 127]: built from its bits."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        exponent = builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(exponent, ir.Constant(i32, 23)), ir.FloatType())

    return types.float32(types.float32), codegen


@njit(error_model="numpy", fastmath=False, inline="always")
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


@njit(error_model="numpy", fastmath=False, inline="always")
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
    a = abs(x)
    e = exp_f32(F32(-2.0) * a)
    far = (F32(1.0) - e) / (F32(1.0) + e)
    far = -far if x < F32(0.0) else far
    return near_zero if a < _TANH_SMALL else far
