"""Ops without a row of their own batch by torch.vmap (``ops.generic_op``,
``config.GENERIC_VMAP``): a pure torch function or Tensor method on per-instance tensors
equals the eager loop, inside blocks too, with gradients; random draws, in-place updates
and results sized by values stay refused. (tests/test_op_sweep.py runs every OpInfo.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import ops
from tests.helpers import check_grads, check_map

torch.manual_seed(0)
LIN = nn.Linear(4, 4)


def generic_calls(x):
    """Functions and methods no row of the op table names."""
    h = torch.tanh(LIN(x))
    return (
        torch.fmod(h, 0.3),
        F.softmin(h, -1),
        torch.fft.rfft(h).abs(),
        h.acos(),
        torch.special.ndtr(h),
        torch.logcumsumexp(h, 0),
        torch.cross(h[..., :3], x[..., :3], dim=-1),
        h.unfold(-1, 2, 1).sum(-1),
        F.threshold(h, 0.1, -1.0),
        h.mH.sum(-1) + h.H.sum(-1),  # (conjugate transposes: of a real tensor, the transpose)
    )


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.integers(0, 2**16))
def test_functions_and_methods_without_a_row_equal_eager(n, rows, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, 4, generator=g) for _ in range(n)]
    f = acrobat.autobatch(generic_calls)
    with torch.no_grad():
        stats = check_map(f, xs)
    assert any(name.startswith("vmap:") for name in stats.by_op) or any(
        name.startswith("block") for name in stats.by_op
    ), stats.by_op


def test_generic_ops_record_as_one_batch_each_and_train():
    xs = [torch.randn(3, 4) for _ in range(5)]

    @acrobat.autobatch
    def f(x):
        return torch.special.erfcx(torch.fmod(LIN(x), 0.7)).sum(0)

    with torch.no_grad(), acrobat.config.override(AUTO_BLOCKS=False):  # (op by op)
        stats = check_map(f, xs)
    assert stats.by_op["vmap:fmod"][0] == 1 and stats.by_op["vmap:erfcx"][0] == 1
    check_grads(f, xs, LIN, atol=1e-5)  # (and in an automatic block)


def test_a_generic_op_vmap_cannot_batch_runs_instance_by_instance(monkeypatch):
    """torch.vmap refusing an op (no batching rule for a form): each instance runs alone
    and the results are stacked."""
    real = torch.vmap

    def refusing(fn, *args, **kwargs):
        batched = real(fn, *args, **kwargs)

        def call(*xs):
            cells = fn.__closure__ or ()
            if any(getattr(c.cell_contents, "__name__", "") == "fmod" for c in cells):
                raise RuntimeError("Batching rule not implemented")
            return batched(*xs)

        return call

    monkeypatch.setattr(torch, "vmap", refusing)

    @acrobat.autobatch
    def f(x):
        return torch.fmod(x * 2, 0.3) + 1

    with torch.no_grad(), acrobat.config.override(AUTO_BLOCKS=False):
        stats = check_map(f, [torch.randn(4) for _ in range(3)])
    assert stats.by_op["vmap:fmod"][0] == 1


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda x: torch.rrelu(x, training=True), "cannot batch"),  # a random draw
        (lambda x: torch.tensor_split(x * 1, (x > 0).nonzero()[:, 0][:1]), "depends on"),
        (lambda x: torch.histogramdd(x * 1, bins=2), "not tensors"),
    ],
    ids=["random", "split by values", "not tensors"],
)
def test_what_cannot_batch_generically_is_refused(fn, message):
    f = acrobat.autobatch(fn)
    xs = [torch.randn(5, 2) for _ in range(3)]
    with pytest.raises(acrobat.UnsupportedOpError, match=message):
        f.map(xs)


def test_the_generic_rows_leave_out_updates_draws_and_non_ops():
    assert ops.generic_op(torch.fmod) is not None
    assert ops.generic_op(torch.Tensor.acos) is not None
    for func in (torch.Tensor.add_, torch.poisson, torch.binomial, torch.Tensor.data_ptr,
                 torch.Tensor.numpy, torch.Tensor.backward, F.rrelu, F.fractional_max_pool2d,
                 torch.as_strided, torch.set_rng_state, torch.save, torch.svd_lowrank):
        assert ops.generic_op(func) is None, func
    with acrobat.config.override(GENERIC_VMAP=False):
        assert ops.generic_op(torch.fmod) is None


def test_generic_ops_train_through_eagers_own_backward():
    """torch.vmap's backward of select_scatter with a shared source sums the wrong slice
    (5x the gradient, torch 2.13): where autograd records, a generic row runs instance
    by instance, so every gradient is eager's."""
    torch.manual_seed(3)
    src = nn.Parameter(torch.randn(5, 5))
    xs = [torch.randn(5, 5, 5) for _ in range(3)]

    @acrobat.autobatch
    def f(x):
        return torch.select_scatter(x * 2, src, 1, 2) * 3

    src.grad = None
    torch.stack([o.sum() * (i + 1) for i, o in enumerate(f.map(xs))]).sum().backward()
    got = src.grad.clone()
    src.grad = None
    torch.stack([f.eager(x).sum() * (i + 1) for i, x in enumerate(xs)]).sum().backward()
    torch.testing.assert_close(got, src.grad)


def test_metadata_questions_are_answered_from_the_lazy_tensor():
    """torch.is_floating_point / torch.numel of a per-instance tensor (torch.masked's
    reductions ask): answered from its dtype and shape, as eager answers."""

    @acrobat.autobatch
    def f(x):
        h = x * 1
        flag = float(torch.is_floating_point(h)) + float(torch.is_complex(h))
        return h.sum() + flag + torch.numel(h)

    with torch.no_grad():
        check_map(f, [torch.randn(n, 2) for n in (1, 3, 3)])


def _attribute_probe(x):
    h = x * 2
    found = (
        hasattr(h, "apply_"),  # a Tensor method no rule batches: refused, an AttributeError
        getattr(h, "not_a_tensor_method", "default"),
        hasattr(h, "_not_there"),
    )
    try:
        h.apply_(abs)
    except acrobat.UnsupportedOpError as error:
        message = str(error)
    return h.absolute() + h.arctan2(x), found, message  # (generic rows, bound on first use)


def test_tensor_attributes_without_a_row_are_class_attributes_not_getattr():
    # no __getattr__: CPython's specialized loads apply to lazy tensors' attributes
    from acrobat.tensor import LazyTensor, TensorAttribute

    assert not hasattr(LazyTensor, "__getattr__")
    assert isinstance(vars(LazyTensor).get("apply_"), TensorAttribute)
    assert not hasattr(LazyTensor, "apply_")  # (at class level: no such attribute)
    xs = [torch.randn(3) for _ in range(3)]
    got = acrobat.autobatch(_attribute_probe).map(xs)
    for (value, found, message), x in zip(got, xs):
        torch.testing.assert_close(value, (x * 2).absolute() + (x * 2).arctan2(x))
        assert found == (False, "default", False)
        assert "Tensor.apply_" in message and "_attribute_probe" in message
    assert not isinstance(vars(LazyTensor).get("absolute"), TensorAttribute)  # installed
