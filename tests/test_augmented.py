"""Augmented assignments to accumulators (analysis.AUGMENTED, ops.augment).

``loss = 0`` then ``loss += criterion(out, target[t])`` in a loop is how the PyTorch
tutorials sum a sequence's loss. An augmented assignment is no assignment to runs and
scans, so each step's loss ran op by op and the loop could not be one node. Where the
local is only ever a number, a tensor the function makes, or such an update, and is
read only by value, ``acc += v`` is rewritten to ``acc = augment(acc, v, "+")``: the plain
op where it gives what the in-place one would. These tests hold it to eager (values,
gradients, dtypes, shapes, errors) and check what analysis leaves alone."""

from __future__ import annotations

import ast
import operator
import re
import textwrap

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import analysis, ops
from tests.helpers import check_grads, check_map, outlined_with

DIM = 6
VOCAB = 11


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.enc = nn.GRUCell(DIM, DIM)
        self.dec = nn.GRUCell(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB)


torch.manual_seed(0)
MODEL = Seq2Seq()


def tutorial(pair, m):
    """The PyTorch seq2seq tutorial's step, per pair: teacher forcing, the loss summed."""
    source, target = pair
    h = torch.zeros(DIM)
    for i in range(source.shape[0]):
        h = m.enc(m.emb(source[i]), h)
    loss = 0
    dec_in = torch.tensor(0)
    for di in range(target.shape[0]):
        h = m.dec(m.emb(dec_in), h)
        out = F.log_softmax(m.out(h), -1)
        loss += F.nll_loss(out[None], target[di][None])
        dec_in = target[di]
    return loss / target.shape[0]


def scaled(pair, m):
    """Every kind of update, on a tensor accumulator made here."""
    source, _ = pair
    acc = torch.ones(DIM)
    for x in m.emb(source):
        acc *= torch.sigmoid(x) + 0.5
        acc -= x * 0.1
        acc /= acc.abs().max() + 1
    total = 0.0
    total += acc.sum()
    return acc, total


def _pairs(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(VOCAB, (s,), generator=g), torch.randint(VOCAB, (t,), generator=g))
        for s, t in lengths
    ]


lengths = st.lists(st.tuples(st.integers(1, 7), st.integers(1, 7)), min_size=1, max_size=6)


@settings(max_examples=10, deadline=None)
@given(lengths=lengths, seed=st.integers(0, 999), which=st.sampled_from([tutorial, scaled]))
def test_accumulated_losses_give_the_eager_results(lengths, seed, which):
    f = acrobat.autobatch(which)
    with torch.no_grad():
        check_map(f, _pairs(lengths, seed), m=MODEL)


@settings(max_examples=5, deadline=None)
@given(lengths=lengths, seed=st.integers(0, 99))
def test_accumulated_losses_train(lengths, seed):
    check_grads(acrobat.autobatch(tutorial), _pairs(lengths, seed), MODEL, atol=1e-5, m=MODEL)


def test_the_tutorials_decoder_loop_is_one_node():
    """Its first step runs alone (``loss`` starts as the number 0), the others are one
    scan node per pair: the loss, the next input (``dec_in = target[di]``, handed on as
    a clone) and the state carried; before, every step's ops were nodes."""
    f = acrobat.autobatch(tutorial)
    data = _pairs([(4, 5), (3, 7), (6, 3)], 3)
    with torch.no_grad():
        stats = check_map(f, data, m=MODEL)
    scans = {k: v for k, v in stats.by_op.items() if k.startswith("scan:")}
    assert len(scans) == 2 and all(v == [1, 3] for v in scans.values()), stats.by_op
    assert stats.nodes <= 40, stats.by_op


def _accumulators(src: str) -> set:
    node = ast.parse(textwrap.dedent(src)).body[0]
    local = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return analysis._accumulators(node, local)


def test_only_locals_nothing_else_can_hold_are_accumulators():
    assert _accumulators("""
        def f(xs, m):
            loss, acc, n = 0, torch.zeros(3), 0
            loss = 0
            acc = torch.zeros(3)
            n = 0
            for x in xs:
                loss += m.crit(x)
                acc *= x.sum()
                n += 1
            return loss / n + acc.sum()
    """) == set()  # (a tuple assignment binds them: not a number or a factory alone)
    assert _accumulators("""
        def f(xs, m):
            loss = 0
            acc = torch.zeros(3)
            for x in xs:
                loss += m.crit(x)
                acc -= x
            return loss, acc.sum()
    """) == {"loss", "acc"}
    for kept in [
        "snap = acc",  # an alias sees the update in eager
        "out.append(acc)",  # a list holding it
        "y = helper(acc)",  # code that could keep it
        "y = acc[0]",  # a view kept
        "acc = helper(x)",  # bound to a tensor the function did not make
        "acc = [1]",  # a list: += extends it in place
        "acc @= x",  # (not an update analysis rewrites)
    ]:
        src = f"""
            def f(x, out):
                acc = torch.zeros(3)
                {kept}
                acc += x
                return acc
        """
        assert _accumulators(src) == set(), kept
    assert _accumulators("def f(acc, x):\n    acc += x\n    return acc") == set()  # a parameter


CASES = [  # (accumulator, value, op): every path of ops.augment
    (torch.zeros(3), torch.ones(3), "+"),
    (torch.zeros(()), torch.ones((), dtype=torch.float64), "+"),  # 0-d: keeps float32
    (torch.zeros(3), torch.ones(3, dtype=torch.float64), "-"),  # in place: stays float32
    (torch.ones(3, dtype=torch.int64), 2, "*"),
    (torch.ones(3, dtype=torch.int64), 2, "/"),  # eager: Float can't be cast to Long
    (torch.ones(3, dtype=torch.int64), 0.5, "+"),  # likewise
    (torch.zeros(3), torch.ones(2, 3), "+"),  # eager: the result does not fit
    (torch.zeros(()), torch.ones(3), "+"),  # likewise
    (torch.zeros(2, 3), torch.ones(3), "/"),  # broadcast into it
    (0, torch.ones(3), "+"),  # a number: Python's x = x + v
    (1.5, 2, "*"),
]


_IN_PLACE = {"+": operator.iadd, "-": operator.isub, "*": operator.imul, "/": operator.itruediv}


@pytest.mark.parametrize("acc, value, op", CASES)
def test_augment_leaves_what_the_augmented_assignment_leaves(acc, value, op):
    def fresh():
        return acc.clone() if isinstance(acc, torch.Tensor) else acc

    try:
        want = _IN_PLACE[op](fresh(), value)  # acc op= value, as Python runs it
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=re.escape(str(e))):
            ops.augment(fresh(), value, op)
        return
    got = ops.augment(fresh(), value, op)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want)
    else:
        assert got == want


# ---- in-place method statements: ``h.mul_(0.9)``, ``acc.add_(v)`` ------------------------


def decayed(tokens, m):
    """A running state updated by in-place methods on lines of their own."""
    h = torch.zeros(DIM)
    for t in range(tokens.shape[0]):
        h.mul_(0.9)
        h.add_(torch.tanh(m.emb(tokens[t])))
        h.div_(1.5)  # (by a value autograd saves, eager's backward would raise)
    return h


def filled(tokens, m):
    """A buffer written by rows, then scaled in place: its item writes are rewritten too
    (the in-place statement makes no alias of it)."""
    out = torch.zeros(tokens.shape[0] + 1, DIM)
    out[1:] = m.emb(tokens)
    out[0] += out[1:].sum(0)
    out.mul_(0.5)
    out.sub_(1.0)
    return out.cumsum(0)


def reset(tokens, m):
    """A state reset in place when a value says so (``zero_``) and a mask filled in place
    before its item writes: both locals nothing else holds."""
    h = m.out.weight[:DIM].sum(0) * 0  # (a real tensor, not a factory: not rebound)
    c = torch.zeros(DIM)
    mask = torch.zeros(tokens.shape[0])
    mask.fill_(1.0)
    for t in range(tokens.shape[0]):
        x = m.emb(tokens[t])
        if float(x.sum()) > 0:
            c.zero_()
            mask[t] = 0.5
        c.add_(torch.tanh(x))
    return torch.cat([c + h, mask])


def masked(tokens, m):
    """Weights set by in-place methods with per-instance operands."""
    w = torch.zeros(tokens.shape[0])
    w.masked_fill_(tokens > VOCAB // 2, 1.0)
    w.clamp_(min=0.25)
    w.add_(m.emb(tokens).sum(1).sigmoid(), alpha=0.5)
    return (m.emb(tokens) * w[:, None]).sum(0)


def scattered(tokens, m):
    """Rows summed into a buffer by index (``index_add_``, as a graph's messages are)."""
    agg = torch.zeros(tokens.shape[0], DIM)
    agg.index_add_(0, tokens % tokens.shape[0], m.emb(tokens))
    agg.clip_(-1.0, 1.0)
    return agg


def detached_copy(tokens, m):
    """``x.clone().detach()`` (the copy torch's docs recommend) is a tensor the function
    owns: its augmented and item writes are rewritten (it was a block's output that may
    be a view, and ``y += 1`` raised)."""
    x = m.emb(tokens)
    y = x.clone().detach()
    y += 1
    y[0] = 0.0
    return x + y


def read_then_added(tokens, m):
    """Eager's ``doubled`` is read before the update: the rewrite must not change it."""
    acc = torch.zeros(DIM)
    doubled = acc * 2.0
    acc.add_(m.emb(tokens).sum(0))
    return doubled + acc


tokens = st.lists(st.integers(1, 7), min_size=1, max_size=6)


def _tokens(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (n,), generator=g) for n in lengths]


@settings(max_examples=10, deadline=None)
@given(
    lengths=tokens,
    seed=st.integers(0, 999),
    which=st.sampled_from(
        [decayed, filled, reset, masked, scattered, detached_copy, read_then_added]
    ),
)
def test_in_place_method_statements_give_the_eager_results(lengths, seed, which):
    with torch.no_grad():
        check_map(acrobat.autobatch(which), _tokens(lengths, seed), m=MODEL)


@settings(max_examples=4, deadline=None)
@given(
    lengths=tokens,
    seed=st.integers(0, 99),
    which=st.sampled_from([decayed, filled, reset, masked, scattered, detached_copy]),
)
def test_in_place_method_statements_train(lengths, seed, which):
    check_grads(acrobat.autobatch(which), _tokens(lengths, seed), MODEL, atol=1e-5, m=MODEL)


def test_in_place_method_statements_were_refused_without_the_rewrite():
    """``h = torch.zeros(n)`` is one constant for every instance inside a map: an in-place
    update of it with an instance's values cannot be recorded, and the buffer's item
    writes were not rewritten because of the method call on it."""
    data = _tokens([3, 5], 1)
    for fn in (decayed, reset, masked, scattered, detached_copy):  # (filled maps through
        # in_place alone now: its scale is an update of the put's result, x[i] = v)
        refused = pytest.raises(acrobat.AcrobatError)
        with outlined_with(fn, AUGMENTED=False), torch.no_grad(), refused:
            acrobat.autobatch(fn).map(data, m=MODEL)


def test_the_decayed_state_loop_is_a_scan():
    f = acrobat.autobatch(decayed)
    with torch.no_grad():
        stats = check_map(f, _tokens([4, 6, 2], 3), m=MODEL)
    assert any(k.startswith("scan:") for k in stats.by_op), stats.by_op


def test_which_method_statements_are_updates():
    assert _accumulators("""
        def f(xs, m):
            h = torch.zeros(3)
            for x in xs:
                h.mul_(0.5)
                h.add_(x)
                h.clamp_(min=0)
                h.t_()  # not an update analysis rewrites, but it makes no alias either
            return h
    """) == {"h"}
    assert _accumulators("""
        def f(x):
            acc = x.clone().detach()
            acc += 1
            return acc
    """) == {"acc"}
    for kept in [
        "y = acc.add_(x)",  # its result is acc itself: an alias
        "acc.add_(x).mul_(2)",  # likewise
    ]:
        src = f"""
            def f(x):
                acc = torch.zeros(3)
                {kept}
                acc += x
                return acc
        """
        assert _accumulators(src) == set(), kept


UPDATES = [  # (tensor, method, args, kwargs): ops.update's paths, errors included
    (torch.zeros(3), "add_", (torch.ones(3),), {}),
    (torch.zeros(3), "add_", (torch.ones(3),), {"alpha": 2}),
    (torch.ones(3, dtype=torch.int64), "mul_", (0.5,), {}),  # eager: Float can't be cast to Long
    (torch.zeros(()), "sub_", (torch.ones(3),), {}),  # eager: the result does not fit
    (0, "add_", (torch.ones(3),), {}),  # a number has no add_: eager's AttributeError
    (torch.ones(2, 3), "zero_", (), {}),
    (torch.ones(2, dtype=torch.int64), "fill_", (2.7,), {}),  # cast as fill_ casts it
    (torch.ones(2, dtype=torch.uint8), "fill_", (300,), {}),  # eager: overflow
    (torch.ones(2), "fill_", (torch.tensor(3.0),), {}),  # a tensor value: the method itself
    (torch.ones(2).requires_grad_(), "mul_", (1.0,), {}),  # eager: a leaf that requires grad
    (torch.ones(2).requires_grad_(), "zero_", (), {}),  # likewise
    (torch.randn(4), "clamp_", (), {"min": -0.5, "max": 0.5}),
    (torch.randn(2, 3), "masked_fill_", (torch.tensor([True, False, True]), 0.0), {}),
    (torch.randn(3), "masked_fill_", (torch.ones(2, 3, dtype=torch.bool), 0.0), {}),  # too big
    (torch.ones(3, dtype=torch.int64), "exp_", (), {}),  # eager: Float can't be cast to Long
    (torch.randn(3, 3), "tril_", (), {}),
    (torch.randn(3), "masked_fill_", (torch.ones(3), 0.0), {}),  # eager: a float mask
    (torch.zeros(3, 2), "index_add_", (0, torch.tensor([0, 0, 2]), torch.ones(3, 2)), {}),
    (torch.zeros(3), "scatter_add_", (0, torch.tensor([1, 1]), torch.ones(2)), {}),
]


@pytest.mark.parametrize("acc, method, args, kwargs", UPDATES)
def test_update_leaves_what_the_method_leaves(acc, method, args, kwargs):
    def fresh():
        if not isinstance(acc, torch.Tensor):
            return acc
        return acc.detach().clone().requires_grad_(acc.requires_grad)

    assert method in ops.UPDATE_METHODS
    try:
        want = fresh()
        getattr(want, method)(*args, **kwargs)
    except (RuntimeError, AttributeError) as e:
        with pytest.raises(type(e), match=re.escape(str(e))):
            ops.update(fresh(), method, *args, **kwargs)
        return
    got = ops.update(fresh(), method, *args, **kwargs)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.detach(), want.detach())


def test_which_in_place_methods_are_updates():
    assert {"add_", "mul_", "clamp_", "masked_fill_", "index_add_", "zero_", "fill_"} <= (
        ops.UPDATE_METHODS
    )
    # draws, views of the storage and copies keep their own paths
    assert not {"bernoulli_", "normal_", "t_", "squeeze_", "copy_", "resize_"} & ops.UPDATE_METHODS
