"""Automatic coarsening of the user's nn.Module methods (config.AUTO_METHODS): a cell written
as a module's ``forward`` or as a model method records ONE node per call, as a plain
function does, and every map equals the eager loop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import analysis, config
from tests.helpers import check_grads, check_map

H = 6


class Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Linear(H, H)
        self.right = nn.Linear(H, H)

    def forward(self, l, r):
        return torch.tanh(self.left(l) + self.right(r))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, H)
        self.cell = Cell()
        self.scale = 0.5

    def combine(self, l, r):  # a straight-line method, called by name
        return torch.sigmoid(self.cell.left(l) - self.cell.right(r)) * self.scale

    def leaf(self, word):  # control flow: searched and outlined, not a block
        if word % 2:
            return self.emb(torch.tensor(word)).tanh()
        return self.emb(torch.tensor(word))

    def unused(self, x):  # named nowhere in the reachable code
        return x * 2


def encode(tree, model, use_method):
    if isinstance(tree, int):
        return model.leaf(tree)
    l = encode(tree[0], model, use_method)
    r = encode(tree[1], model, use_method)
    return model.combine(l, r) if use_method else model.cell(l, r)


@acrobat.autobatch
def through_forward(tree, model):
    return encode(tree, model, False)


@acrobat.autobatch
def through_method(tree, model):
    return encode(tree, model, True)


def internal_nodes(tree) -> int:
    return 0 if isinstance(tree, int) else 1 + internal_nodes(tree[0]) + internal_nodes(tree[1])


trees = st.recursive(st.integers(0, 9), lambda t: st.tuples(t, t), max_leaves=12)
MODEL = Encoder()


def test_discovery_takes_forward_and_the_methods_the_code_names():
    classes = analysis.module_classes({"model": MODEL, "other": [3, {"m": nn.Linear(2, 2)}]})
    assert set(classes) == {Encoder, Cell}  # torch's own modules are not the user's
    found, control = analysis._reachable(through_method, classes)
    assert {f.__qualname__ for f in found} == {"Cell.forward", "Encoder.combine"}
    assert "Encoder.leaf" in {f.__qualname__ for f in control}
    assert Encoder.unused not in found + control


@settings(max_examples=20, deadline=None)
@given(batch=st.lists(trees, min_size=1, max_size=6))
def test_module_forward_and_methods_match_eager_with_one_node_per_call(batch):
    calls = sum(internal_nodes(t) for t in batch)
    with torch.no_grad():
        for fn, name in (
            (through_forward, "block:Cell.forward"),
            (through_method, "block:Encoder.combine"),
        ):
            stats = check_map(fn, batch, model=MODEL)
            assert stats.by_op.get(name, [0, 0])[1] == calls


def test_switched_off_the_ops_are_recorded_one_by_one():
    batch = [((1, 2), (3, (4, 5))), (6, 7)]
    with torch.no_grad():
        on = check_map(through_forward, batch, model=MODEL)
        with config.override(AUTO_METHODS=False):
            off = check_map(through_forward, batch, model=MODEL)
    assert "block:Cell.forward" in on.by_op and "block:Cell.forward" not in off.by_op
    assert off.nodes > on.nodes


def test_gradients_through_method_blocks_equal_eager():
    batch = [((1, 2), (3, (4, 5))), (6, (7, 8)), 9]
    model = Encoder()
    for fn, name in ((through_forward, "Cell.forward"), (through_method, "Encoder.combine")):
        stats = check_grads(fn, batch, model, model=model)
        assert f"block:{name}" in stats.by_op


def test_hooks_still_run_once_per_call_and_the_code_is_restored():
    seen = []
    handle = MODEL.cell.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    original = Cell.forward.__code__
    try:
        batch = [((1, 2), 3), (4, (5, 6))]
        with torch.no_grad():
            check_map(through_forward, batch, model=MODEL)  # map, then the eager loop
        assert len(seen) == 2 * sum(internal_nodes(t) for t in batch)
        assert all(shape == (H,) for shape in seen)
    finally:
        handle.remove()
    assert Cell.forward.__code__ is original

    @acrobat.autobatch
    def fails(tree, model):
        encode(tree, model, False)
        raise ValueError("instance error")

    with pytest.raises(ValueError, match="instance error"):
        fails.map([(1, 2)], model=MODEL)
    assert Cell.forward.__code__ is original


class Recursive(nn.Module):
    """The per-instance function is itself a method (the decorated object a bound method)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, H)
        self.cell = Cell()

    def merge(self, l, r):
        return self.cell(l, r) * 2 - 1

    def encode(self, tree):
        if isinstance(tree, int):
            return self.emb(torch.tensor(tree))
        return self.merge(self.encode(tree[0]), self.encode(tree[1]))


RECURSIVE = Recursive()


@settings(max_examples=15, deadline=None)
@given(batch=st.lists(trees, min_size=1, max_size=6))
def test_a_decorated_bound_method_reaches_its_objects_methods(batch):
    encode = acrobat.autobatch(RECURSIVE.encode)
    original = Recursive.encode.__code__
    with torch.no_grad():
        got, stats = encode.map(batch, stats=True)
        want = [RECURSIVE.encode(t) for t in batch]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    calls = sum(internal_nodes(t) for t in batch)
    assert stats.by_op.get("block:Recursive.merge", [0, 0])[1] == calls  # (forward inlined)
    assert Recursive.encode.__code__ is original


class Decorated(Recursive):
    """``@acrobat.autobatch`` on a method in the class body."""

    @acrobat.autobatch
    def encode(self, tree):
        if isinstance(tree, int):
            return self.emb(torch.tensor(tree))
        return self.merge(self.encode(tree[0]), self.encode(tree[1]))


def test_autobatch_on_a_method_binds_to_the_object():
    model = Decorated()
    batch = [((1, 2), 3), (4, (5, (6, 7))), 8]
    assert model.encode is model.encode  # one bound function per object
    assert Decorated.encode.fn is Decorated.__dict__["encode"].fn
    with torch.no_grad():
        got, stats = model.encode.map(batch, stats=True)
        want = [model.encode.eager(t) for t in batch]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
        assert stats.by_op["block:Recursive.merge"][1] == sum(internal_nodes(t) for t in batch)
        other = Decorated()  # another object: its own parameters
        other_got = other.encode.map(batch)
    for g, w in zip(other_got, [other.encode(t) for t in batch]):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


GLOBAL_MODEL = Encoder()


@acrobat.autobatch
def through_a_global_model(tree):
    return encode(tree, GLOBAL_MODEL, False)


def make_closure(model):
    @acrobat.autobatch
    def through_a_closure(tree):
        return encode(tree, model, True)

    return through_a_closure


def test_models_reached_as_globals_or_closure_variables_are_searched_too():
    batch = [((1, 2), 3), (4, (5, (6, 7))), 8, (9, 0)]
    calls = sum(internal_nodes(t) for t in batch)
    with torch.no_grad():
        stats = check_map(through_a_global_model, batch)
        assert stats.by_op["block:Cell.forward"][1] == calls
        stats = check_map(make_closure(Encoder()), batch)
        assert stats.by_op["block:Encoder.combine"][1] == calls
