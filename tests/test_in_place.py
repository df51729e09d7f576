"""In-place updates inside f.map (ops.in_place): ``x += y``, ``x.add_(y)``,
``torch.relu_(x)``, ``F.relu(x, inplace=True)`` and ``nn.ReLU(inplace=True)`` equal eager
where the update can be recorded exactly (a fresh result nothing recorded reads yet), and
are refused with the out-of-place spelling where it cannot (before, ``inplace=True`` was
passed to the batched kernel and the map returned the old values, silently)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import acrobat

# (name, update of y by x): each keeps y's shape and dtype
UPDATES = {
    "iadd": lambda y, x: y.__iadd__(x),
    "isub-number": lambda y, x: y.__isub__(0.5),
    "imul": lambda y, x: y.__imul__(x),
    "itruediv": lambda y, x: y.__itruediv__(x.abs() + 1),
    "ipow": lambda y, x: y.__ipow__(2),
    "add_-alpha": lambda y, x: y.add_(x, alpha=-2),
    "mul_": lambda y, x: y.mul_(x),
    "clamp_": lambda y, x: y.clamp_(min=-0.25, max=0.5),
    "relu_-method": lambda y, x: y.relu_(),
    "tanh_-method": lambda y, x: y.tanh_(),
    "sigmoid_-function": lambda y, x: torch.sigmoid_(y),
    "relu_-function": lambda y, x: torch.relu_(y),
    "masked_fill_": lambda y, x: y.masked_fill_(x > 0, 0.0),
    "relu-inplace": lambda y, x: F.relu(y, inplace=True),
    "leaky_relu-inplace": lambda y, x: F.leaky_relu(y, 0.1, inplace=True),
    "leaky_relu_": lambda y, x: F.leaky_relu_(y, 0.3),
    "hardtanh-inplace": lambda y, x: F.hardtanh(y, -0.5, 0.5, inplace=True),
    "elu-inplace": lambda y, x: F.elu(y, inplace=True),
    "ReLU-module": lambda y, x: nn.ReLU(inplace=True)(y),
    "dropout-eval": lambda y, x: F.dropout(y, 0.5, training=False, inplace=True),
    "add-out": lambda y, x: torch.add(y, x, out=y),
    "tanh-out": lambda y, x: torch.tanh(y, out=y),
    "mul-out-alpha": lambda y, x: torch.sub(x, y, alpha=0.5, out=y),
}


@given(
    steps=st.lists(st.sampled_from(sorted(UPDATES)), min_size=1, max_size=5),
    n=st.integers(1, 6),
    keep_result=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_in_place_updates_equal_eager(steps, n, keep_result, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(5, generator=g) for _ in range(n)]
    lin = nn.Linear(5, 5)

    @acrobat.autobatch
    def f(x):
        y = lin(x) * 2  # a fresh tensor
        results = []
        for step in steps:
            out = UPDATES[step](y, x)
            if keep_result:  # (a value read: no recorded op reads y, the next update can)
                assert out is y  # eager returns the updated tensor itself
                results.append(out.tolist())  # its value at this point
        return y, results

    with torch.no_grad():
        got = f.map(xs)
        want = [f.eager(x) for x in xs]
    for (y, rs), (ey, ers) in zip(got, want):
        torch.testing.assert_close(y, ey)
        assert len(rs) == len(ers)
        for a, b in zip(rs, ers):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b))


def test_an_update_whose_result_is_dropped_shows_in_the_tensor():
    """The case that was silently wrong: the result of F.relu(y, inplace=True) unused."""

    @acrobat.autobatch
    def f(x):
        y = x * 2
        F.relu(y, inplace=True)
        y += 1
        return y

    xs = [torch.randn(4) for _ in range(3)]
    for a, b in zip(f.map(xs), [f.eager(x) for x in xs]):
        torch.testing.assert_close(a, b)


def test_aliases_see_the_update_and_earlier_values_do_not():
    @acrobat.autobatch
    def f(x):
        y = x + 1
        alias = y
        before = y.sum()  # a reduction: no node reads y itself afterwards...
        return alias, before

    @acrobat.autobatch
    def g(x):
        y = x + 1
        alias = [y]
        y.mul_(3)
        return alias[0], y

    xs = [torch.randn(4) for _ in range(3)]
    for fn in (f, g):
        for a, b in zip(fn.map(xs), [fn.eager(x) for x in xs]):
            torch.testing.assert_close(a, b)


def test_in_place_inside_blocks_and_modules():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 3))

    def cell(lin, x):  # straight-line: an automatic block, the update in its trace
        y = lin(x)
        y = F.relu(y, inplace=True)
        return y * 2

    def arg_cell(lin, x, h):  # updates its argument: the block falls back to op by op
        h = F.relu(h, inplace=True)
        return lin(x) + h

    lin = nn.Linear(4, 4)

    @acrobat.autobatch
    def f(x):
        h = lin(x) - 0.2
        return seq(x), cell(lin, x) + cell(lin, x * 2), arg_cell(lin, x, h)

    xs = [torch.randn(4) for _ in range(5)]
    with torch.no_grad():
        got = f.map(xs)
        want = [f.eager(x) for x in xs]
    for outs, refs in zip(got, want):
        for a, b in zip(outs, refs):
            torch.testing.assert_close(a, b)


def test_explicit_block_updating_its_argument_is_refused():
    @acrobat.block
    def cell(h):
        h.relu_()
        return h * 2

    @acrobat.autobatch
    def f(x):
        return cell(x * 1)

    with pytest.raises(acrobat.LazyValueError, match="must not change its inputs"):
        f.map([torch.randn(3), torch.randn(3)])


def test_training_through_in_place_updates():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    act = nn.ReLU(inplace=True)

    @acrobat.autobatch
    def f(x):
        y = lin(x)
        y += x
        act(y)  # (eager: after the add, whose backward does not need its output)
        return (y * y).sum()

    xs = [torch.randn(4) for _ in range(4)]
    loss = torch.stack(f.map(xs)).sum()
    grads = torch.autograd.grad(loss, [lin.weight, lin.bias])
    ref = torch.stack([f.eager(x) for x in xs]).sum()
    ref_grads = torch.autograd.grad(ref, [lin.weight, lin.bias])
    torch.testing.assert_close(loss, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


# what cannot be recorded exactly: refused, naming the line and the fix; the next map works
REFUSED = {
    "read-before": (lambda x: (lambda y: (y + 1, y.add_(1)))(x * 2), "must see the old value"),
    "input": (lambda x: x.add_(1), "input of the map"),
    "view": (lambda x: F.relu((x * 2)[1:], inplace=True), "view"),
    "shared-constant": (lambda x: torch.zeros(3).add_(x), "real tensor"),
    "shape": (lambda x: (x * 2).__iadd__(torch.ones(2, 3)), "keeps its tensor's shape"),
    "dtype": (lambda x: (x > 0).long().__iadd__(x), "keeps its tensor's shape and dtype"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_updates_that_cannot_be_recorded_are_refused(case):
    update, message = REFUSED[case]

    @acrobat.autobatch
    def f(x):
        return update(x)

    xs = [torch.randn(3), torch.randn(3)]
    with pytest.raises(acrobat.AcrobatError, match=message) as err:
        f.map(xs)
    assert f'"{case}": (lambda x:' in str(err.value)  # the user's line: the update

    @acrobat.autobatch
    def ok(x):
        y = x * 2
        y += 1
        return y

    for a, b in zip(ok.map(xs), [ok.eager(x) for x in xs]):
        torch.testing.assert_close(a, b)


def test_out_writes_into_a_fresh_tensor():
    """``torch.f(..., out=z)`` writes the result into ``z`` (a tensor the instance made):
    it was batched with ``out=`` given to the batched kernel, and the map returned ``z``'s
    old values, silently."""

    @acrobat.autobatch
    def f(x):
        z = x * 0
        r = torch.tanh(x * 2, out=z)
        assert r is z
        return z, torch.mul(x, 3, out=x * 1)

    xs = [torch.randn(4) for _ in range(3)]
    for got, want in zip(f.map(xs), [f.eager(x) for x in xs]):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "update, message",
    [
        (lambda x: torch.add(x, 1, out=torch.zeros(3)), "real tensor"),
        (lambda x: (lambda z: (z + 1, torch.add(x, 1, out=z)))(x * 2), "must see the old value"),
        (lambda x: torch.add(x, torch.ones(2, 3), out=x * 1), "keeps its tensor's shape"),
    ],
)
def test_out_that_cannot_be_recorded_is_refused(update, message):
    @acrobat.autobatch
    def f(x):
        return update(x)

    with pytest.raises(acrobat.AcrobatError, match=message):
        f.map([torch.randn(3), torch.randn(3)])


def test_parts_and_fills_stay_refused():
    @acrobat.autobatch
    def f(x):
        y = x * 2
        y[0] = 1.0
        return y

    with pytest.raises(acrobat.UnsupportedOpError, match="x\\[i\\] = v"):
        f.map([torch.randn(3)])
