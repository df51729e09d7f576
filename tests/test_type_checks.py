"""``isinstance(x, torch.Tensor)`` and ``torch.is_tensor(x)`` in instance code see a lazy
tensor as the tensor it stands for (acrobat.analysis TYPE_CHECKS): a tree whose leaves
are tensors, told from its lists that way, maps as it runs eagerly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import analysis, config
from tests.helpers import TreeNet, assert_close_tree

H = 8

Net = TreeNet  # hidden H


def _tree(depth: int, gen: torch.Generator):
    if depth == 0 or torch.rand(1, generator=gen).item() < 0.3:
        return torch.randn(H, generator=gen)
    return [_tree(depth - 1, gen) for _ in range(int(torch.randint(1, 4, (1,), generator=gen)))]


@acrobat.autobatch
def encode(t, model: Net):
    if isinstance(t, torch.Tensor):
        return torch.relu(model.leaf(t))
    kids = [encode(c, model) for c in t]
    total = kids[0]
    for k in kids[1:]:
        total = total + k
    return torch.tanh(model.mix(torch.cat([total, kids[-1]])))


@acrobat.autobatch
def encode_is_tensor(t, model: Net):
    if torch.is_tensor(t):
        return torch.relu(model.leaf(t))
    kids = [encode_is_tensor(c, model) for c in t]
    return torch.stack(kids).sum(0)


@acrobat.autobatch
def encode_comprehension(t, model: Net):
    """The checks inside comprehensions (code objects of their own)."""
    leaves = [torch.relu(model.leaf(c)) for c in t if isinstance(c, torch.Tensor)]
    inner = [encode_comprehension(c, model) for c in t if not torch.is_tensor(c)]
    return torch.stack(leaves + inner).sum(0)


def _nested(depth: int, gen: torch.Generator) -> list:
    """A tree whose root is a list (encode_comprehension takes lists)."""
    kids = [_tree(depth - 1, gen) for _ in range(int(torch.randint(1, 4, (1,), generator=gen)))]
    return [k if torch.is_tensor(k) else _nested(depth - 1, gen) if depth > 1 else k for k in kids]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 6))
def test_trees_with_tensor_leaves_map_as_eager(seed, batch):
    gen = torch.Generator().manual_seed(seed)
    trees = [_tree(3, gen) for _ in range(batch)]
    model = Net()
    with torch.no_grad():
        lists = [_nested(3, gen) for _ in range(batch)]
        got = encode_comprehension.map(lists, model=model)
        assert_close_tree(got, [encode_comprehension.eager(t, model=model) for t in lists])
        for fn in (encode, encode_is_tensor):
            assert_close_tree(fn.map(trees, model=model), [fn.eager(t, model=model) for t in trees])


@acrobat.autobatch
def kinds(x: torch.Tensor):
    y = x * 2  # a lazy tensor computed in the instance
    flags = [
        isinstance(y, torch.Tensor),
        isinstance(y, (list, torch.Tensor)),
        isinstance(y, torch.Tensor | None),
        isinstance(y, object),
        isinstance(y, nn.Parameter),  # a computed tensor is no parameter, eagerly either
        isinstance(y, (int, list)),
        isinstance([y], torch.Tensor),
        isinstance(3, int),
        torch.is_tensor(y),
        torch.is_tensor([y]),
    ]
    return y, flags


def test_isinstance_answers_what_eager_answers():
    xs = [torch.randn(3) for _ in range(3)]
    got = kinds.map(xs)
    want = [kinds.eager(x) for x in xs]
    assert [flags for _, flags in got] == [flags for _, flags in want]
    assert want[0][1] == [True, True, True, True, False, False, False, True, True, False]


def _my_check(obj, classes):
    return "mine"


@acrobat.autobatch
def shadowed(x: torch.Tensor):
    isinstance = _my_check  # the name is the user's: their function is the one called
    y = x + 1
    return y, isinstance(y, torch.Tensor)


def test_a_shadowed_isinstance_is_the_one_called():
    got = shadowed.map([torch.ones(2)])
    assert got[0][1] == "mine" == shadowed.eager(torch.ones(2))[1]


def test_the_checks_are_off_with_the_flag_and_isinstance_is_no_block_builtin(monkeypatch):
    def cell(x):
        return x * int(isinstance(x, torch.Tensor))

    assert not analysis.straight_line(cell)  # a block's trace would answer False
    gen = torch.Generator().manual_seed(0)
    trees = [[torch.randn(H, generator=gen)] * 2]
    model = Net()

    @acrobat.autobatch
    def leaves(t, model):
        if isinstance(t, torch.Tensor):
            return model.leaf(t)
        return torch.stack([leaves(c, model) for c in t]).sum(0)

    monkeypatch.setattr(analysis, "TYPE_CHECKS", False)
    monkeypatch.setattr(config, "AUTO_REGIONS", True)
    with pytest.raises(TypeError, match="iteration over a 0-d tensor"):
        leaves.map(trees, model=model)  # the lazy leaf taken for a list, as before

