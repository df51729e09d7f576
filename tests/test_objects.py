"""Tensors in attributes of the user's own objects are per-instance inputs
(acrobat/objects.py, config.OBJECT_INPUTS): a tree of ``Node`` objects with ``node.x``
leaves batches like one built of lists, and maps as it runs eagerly."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import config
from tests.helpers import TreeNet, assert_close_tree

H = 8

Net = TreeNet  # hidden H


class Node:
    kind = "node"  # a class attribute: read through the instance as before

    def __init__(self, x, kids, scale=None):
        self.x, self.kids = x, kids
        if scale is not None:
            self.scale = scale

    @property
    def leafy(self) -> bool:
        return not self.kids


def _tree(depth: int, gen: torch.Generator, shared: torch.Tensor) -> Node:
    if depth == 0 or torch.rand(1, generator=gen).item() < 0.3:
        scale = shared if torch.rand(1, generator=gen).item() < 0.3 else None
        return Node(torch.randn(H, generator=gen), [], scale)
    n = int(torch.randint(1, 4, (1,), generator=gen))
    return Node(None, [_tree(depth - 1, gen, shared) for _ in range(n)])


def _leaves(node: Node) -> int:
    return 1 if not node.kids else sum(_leaves(k) for k in node.kids)


@acrobat.autobatch
def encode(node: Node, model: Net):
    assert node.kind == "node"
    if node.leafy:
        x = node.x
        if "scale" in node.__dict__:
            x = x * node.scale  # a tensor shared by instances
        return torch.tanh(model.leaf(x) + node.x)  # read twice: one input
    h = encode(node.kids[0], model)
    for k in node.kids[1:]:
        h = torch.tanh(model.mix(torch.cat([h, encode(k, model)])))
    return h


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 6))
def test_object_trees_batch_and_match_eager(seed, batch):
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(H, generator=gen)
    trees = [_tree(3, gen, shared) for _ in range(batch)]
    model = Net()
    with torch.no_grad():
        got, stats = encode.map(trees, model=model, stats=True)
        assert_close_tree(got, [encode.eager(t, model=model) for t in trees])
    leaves = sum(_leaves(t) for t in trees)
    # node.x read twice: one input per leaf; the shared scale one for its first reader only
    assert leaves <= stats.by_op["input"][1] <= leaves + 1
    batches, nodes = stats.by_op["linear"]
    assert nodes >= leaves and (batches < nodes or nodes == 1)  # batched across leaves
    assert "x" not in Node.__dict__ and "scale" not in Node.__dict__  # restored


@acrobat.autobatch
def broken(node: Node, model: Net):
    if node.kids:
        return broken(node.kids[0], model)
    raise KeyError("instance failure")


def test_classes_are_restored_after_an_error_and_the_flag_off_warns():
    gen = torch.Generator().manual_seed(1)
    trees = [_tree(2, gen, torch.zeros(H)) for _ in range(3)]
    model = Net()
    with pytest.raises(KeyError):
        broken.map(trees, model=model)
    assert "x" not in Node.__dict__ and Node.kind == "node"
    with torch.no_grad(), config.override(OBJECT_INPUTS=False):
        with pytest.warns(acrobat.AcrobatWarning, match=r"Node\.x"):
            got, stats = encode.map(trees, model=model, stats=True)
        assert stats.nodes == 0  # every op ran eagerly, instance by instance
        assert_close_tree(got, [encode.eager(t, model=model) for t in trees])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per function
            encode.map(trees, model=model)


class Sample:
    def __init__(self, x):
        self.x = x


@acrobat.autobatch
def rebind(s: Sample):
    s.x = s.x * 2  # the instance writes its object: the lazy value, read back as such
    return s.x + 1


def test_attribute_writes_and_parameters_stay_as_eager():
    xs = [torch.randn(H) for _ in range(4)]
    got = rebind.map([Sample(x.clone()) for x in xs])
    assert_close_tree(got, [rebind.eager(Sample(x.clone())) for x in xs])
    p = Sample(nn.Parameter(torch.randn(H)))  # model state: left a real tensor
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # (a parameter is no instance data to warn about)
        got, stats = scaled.map([p, p], stats=True)
        assert stats.nodes == 0
        assert_close_tree(got, [scaled.eager(p)] * 2)


@acrobat.autobatch
def scaled(s: Sample):
    return s.x * 2 + 1


def test_another_thread_reading_an_object_during_a_map_gets_its_real_tensor():
    import threading

    seen = []
    sample = Sample(torch.randn(H))

    @acrobat.autobatch
    def peek(s: Sample):
        y = s.x + 1  # lazy here
        worker = threading.Thread(target=lambda: seen.append(type(s.x)))
        worker.start()
        worker.join()
        return y

    got = peek.map([sample])
    assert seen == [torch.Tensor]
    assert_close_tree(got, [sample.x + 1])
