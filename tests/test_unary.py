"""The vectorised float32 tanh that batches call (acrobat_kernels.unary), against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import acrobat
from acrobat import config
from acrobat_kernels import unary


def ulps(got: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|got - tanh(x)| in float32 ulps of the exact (float64) result."""
    exact = torch.tanh(x.double())
    # 2**(e - 24) for exact = m * 2**e, m in [0.5, 1): float64 arithmetic, so the result
    # does not depend on whether a library set flush-to-zero (np.spacing would)
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 24)
    return (got.double() - exact).abs() / ulp


def test_tanh_is_within_2_ulp_and_keeps_special_values():
    x = torch.cat(
        [
            torch.linspace(-12, 12, 400_001),
            torch.from_numpy(np.geomspace(1e-45, 3e38, 20_001).astype(np.float32)),
            -torch.from_numpy(np.geomspace(1e-45, 3e38, 20_001).astype(np.float32)),
            torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-30, -1e-38]),
        ]
    )
    assert unary.usable(x)
    got = unary.tanh(x)
    want = torch.tanh(x)
    finite = torch.isfinite(x) & (x.abs() > 1.2e-38)
    assert ulps(got[finite], x[finite]).max() <= 2.0
    # Special values and denormals: exactly torch's, signed zeros included.
    special = ~finite
    assert torch.equal(got[special].isnan(), want[special].isnan())
    keep = special & ~want.isnan()
    assert torch.equal(got[keep], want[keep])
    assert torch.equal(torch.signbit(got[keep]), torch.signbit(want[keep]))


@given(
    rows=st.integers(1, 40),
    cols=st.sampled_from([1, 7, 64, 256]),
    scale=st.sampled_from([1e-3, 1.0, 4.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_tanh_matches_torch_on_random_batches(rows, cols, scale, seed):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scale
    got = unary.tanh(x)
    assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()
    assert ulps(got, x).max() <= 2.0


@given(
    rows=st.integers(1, 40),
    cols=st.sampled_from([32, 64, 256]),
    parts=st.integers(2, 5),
    seed=st.integers(0, 2**16),
)
def test_tanh_of_a_column_slice_reads_its_spaced_rows(rows, cols, parts, seed):
    """``u`` of ``gates.chunk(parts, dim=1)``: rows ``parts * cols`` elements apart."""
    gates = torch.randn(rows, parts * cols, generator=torch.Generator().manual_seed(seed)) * 3
    before = gates.clone()
    for u in gates.chunk(parts, dim=1):
        if u.numel() < unary.MIN_NUMEL:
            assert not unary.usable(u)
            continue
        assert unary.usable(u) and not u.is_contiguous()
        got = unary.tanh(u)
        assert got.shape == u.shape and got.is_contiguous()
        assert ulps(got, u).max() <= 2.0
    assert torch.equal(gates, before)  # the input is only read


def test_tanh_defers_to_torch_where_the_kernel_does_not_apply():
    big = torch.randn(64, 256)
    cases = [
        big.double(),  # float64
        big.t(),  # columns strided
        torch.randn(8, 64, 256)[:, :, :128],  # rows spaced in more than two dimensions
        torch.randn(8),  # too small to pay
        big.to(torch.bfloat16),
    ]
    for x in cases:
        assert not unary.usable(x)
        assert torch.equal(unary.tanh(x), torch.tanh(x))
    out = torch.empty(64, 256)
    assert unary.tanh(big, out=out) is out  # out= is torch's
    assert torch.equal(out, torch.tanh(big))


def test_tanh_gradients_match_torch_including_double_backward():
    x = (torch.randn(32, 64, dtype=torch.float32) * 2).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y = unary.tanh(x)
    assert y.grad_fn is not None
    (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
    (g_ref,) = torch.autograd.grad(torch.tanh(x_ref).pow(2).sum(), x_ref, create_graph=True)
    torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-5)
    (gg,) = torch.autograd.grad(g.sum(), x)
    (gg_ref,) = torch.autograd.grad(g_ref.sum(), x_ref)
    torch.testing.assert_close(gg, gg_ref, atol=1e-5, rtol=1e-4)


def _cell(x, h, w):
    return torch.tanh(w @ torch.cat([x, h]))


@acrobat.autobatch
def _rnn(xs, w):
    h = torch.zeros(w.shape[0])
    for x in xs:
        h = _cell(x, h, w)
    return h


@pytest.mark.parametrize("auto_blocks", [True, False])  # generated block code / op rules
@pytest.mark.parametrize("fast", [True, False])
def test_batched_tanh_is_used_by_maps_and_matches_eager(fast, auto_blocks, monkeypatch):
    calls = []
    forward = unary._forward
    monkeypatch.setattr(unary, "_forward", lambda x: calls.append(x.shape) or forward(x))
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen) * 0.3
    inputs = [list(torch.randn(n, 32, generator=gen)) for n in (3, 5, 4) * 8]
    with config.override(FAST_TANH=fast, AUTO_BLOCKS=auto_blocks):
        got = _rnn.map(inputs, w=w)
    want = [_rnn.eager(x, w=w) for x in inputs]
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
    assert bool(calls) == fast  # 24 rows x 64 = 1536 elements: the kernel runs when on


def test_tanh_takes_torch_tanh_calling_conventions():
    x = torch.randn(64, 32)
    assert torch.equal(unary.tanh(input=x), torch.tanh(x))
    with pytest.raises(TypeError):
        unary.tanh()
