"""Type promotion with per-instance 0-dim operands (ops.promotion).

torch ranks a 0-dim tensor below a dimensioned one of its category: ``x_fp16 * t.sum()``
is float16 for a float32 ``t``, ``i_int32 + n.sum()`` int32. Batched, the instance's
0-dim operand is a column with dims and used to promote the whole batch to its own
dtype: the map returned float32 / int64 where eager returns float16 / int32, and every
op after it computed in the wrong dtype. These tests hold every elementwise op that
promotes to eager, bit for bit, on both paths (op by op and inside an outlined block, of
one size or padded), and the gradients through the cast."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import ops
from acrobat.graph import LazyTensor
from tests.helpers import check_grads, check_map

# (x, s) -> the op; s is the instance's 0-dim tensor
OPS = {
    "mul": lambda x, s: x * s,
    "rmul": lambda x, s: s * x,
    "div": lambda x, s: x / s,
    "rdiv": lambda x, s: s / x,
    "add": lambda x, s: x + s,
    "rsub": lambda x, s: s - x,
    "add_alpha": lambda x, s: torch.add(x, s, alpha=2),
    "maximum": lambda x, s: torch.maximum(x, s),
    "minimum": lambda x, s: torch.minimum(s, x),
    "where": lambda x, s: torch.where(x > 2, x, s),
    "clamp": lambda x, s: torch.clamp(x, max=s),
    "pow": lambda x, s: x**s,
    "lt": lambda x, s: x < s,
    "eq": lambda x, s: x == s,
    "addcmul": lambda x, s: torch.addcmul(x, x, s),
    "floor_divide": lambda x, s: x // s,
}
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]


def _values(shape, dtype, g) -> torch.Tensor:
    """Positive values (no division by zero, no NaN from pow), exact in ``dtype``."""
    if dtype.is_floating_point:
        return (1 + 2 * torch.rand(shape, generator=g)).to(dtype)
    return torch.randint(1, 6, shape, generator=g).to(dtype)


@given(
    op=st.sampled_from(sorted(OPS)),
    x_dtype=st.sampled_from(DTYPES),
    s_dtype=st.sampled_from(DTYPES),
    ragged=st.booleans(),
    blocks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_zero_dim_operand_promotes_as_eager(op, x_dtype, s_dtype, ragged, blocks, seed):
    fn = OPS[op]

    def body(x, y):
        return fn(x, y.sum()) * 1  # (an op after it: computed in the dtype eager has)

    g = torch.Generator().manual_seed(seed)
    xs = [_values((3 + (i % 3 if ragged else 0),), x_dtype, g) for i in range(5)]
    ys = [_values((2,), s_dtype, g) for _ in range(5)]
    try:
        for x, y in zip(xs, ys):
            body(x, y)
    except RuntimeError:  # (combinations torch refuses: the map raises them as well)
        assume(False)
    f = acrobat.autobatch(body)
    with acrobat.config.override(AUTO_BLOCKS=blocks):
        got = f.map(xs, ys)
    want = [body(x, y) for x, y in zip(xs, ys)]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype, f"{op} instance {i}: {a.dtype} != {b.dtype}"
        assert torch.equal(a, b), f"{op} instance {i}: {a} != {b}"


def test_the_reported_cases():
    """The two cases that showed it: a half-precision activation scaled by a float32
    sum, an int32 index shifted by an int64 count."""

    @acrobat.autobatch
    def scaled(x, y):
        return x * y.sum()

    @acrobat.autobatch
    def shifted(i, n):
        return i + n.sum()

    xs = [torch.randn(3).half() for _ in range(4)]
    ys = [torch.rand(2) for _ in range(4)]
    assert [t.dtype for t in scaled.map(xs, ys)] == [torch.float16] * 4
    assert [t.dtype for t in shifted.map([torch.arange(3, dtype=torch.int32)] * 4,
                                         [torch.arange(2)] * 4)] == [torch.int32] * 4  # fmt: skip


@pytest.mark.parametrize(
    "func, args, cast, out",
    [
        # a dimensioned float16 and a float32 0-dim: float16, except mul/div's second
        # operand, which torch reads as a float32 number (one rounding, at the end)
        (torch.add, ("x16", "s32"), torch.float16, None),
        (torch.mul, ("x16", "s32"), torch.float32, torch.float16),
        (torch.mul, ("s32", "x16"), torch.float16, None),
        (torch.div, ("x16", "s32"), torch.float32, torch.float16),
        # same dtypes, or the 0-dim one of a higher category: nothing to do
        (torch.mul, ("x32", "s32"), None, None),
        (torch.mul, ("i32", "s32"), None, None),
        (torch.add, ("i32", "n64"), torch.int32, None),
        # where's condition takes no part
        (torch.where, ("c", "x16", "s32"), torch.float16, None),
    ],
)
def test_promotion_table(func, args, cast, out):
    shapes = {
        "x16": ((3,), torch.float16),
        "x32": ((3,), torch.float32),
        "i32": ((3,), torch.int32),
        "s32": ((), torch.float32),
        "n64": ((), torch.int64),
        "c": ((3,), torch.bool),
    }
    operands = [LazyTensor(None, 0, torch.Size(shapes[a][0]), shapes[a][1]) for a in args]
    pr = ops.promotion(func, operands, {})
    if cast is None:
        assert pr is None
    else:
        assert pr is not None and pr[:2] == (cast, out)


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, dtype=torch.float64))


def test_gradients_through_the_cast():
    """A float64 parameter's 0-dim product scales a float32 activation: eager computes in
    float32 (the 0-dim operand cast), the gradient flows back to float64."""
    m = _Scale()

    @acrobat.autobatch
    def scaled(pair, m):
        x, y = pair
        return torch.tanh(x) * (m.w * y).sum()

    pairs = [(torch.randn(3), torch.randn(2, dtype=torch.float64)) for _ in range(4)]
    assert scaled.map(pairs, m=m)[0].dtype == torch.float32
    check_map(scaled, pairs, m=m)
    check_grads(scaled, pairs, m, m=m)
