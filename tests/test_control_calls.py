"""Calls of functions with control flow among straight lines (analysis.CONTROL_CALLERS): a
module's ``forward`` that only calls ``self.encode(tree)`` and a head was taken for a
straight-line block, and an encoder's recursive calls joined the run of the tensor lines
after them, so both regions were given the tree objects and ran as written, op by op
(about the eager loop's time). Now the caller is searched as a function with control flow
and a call of one is left out of runs: each cell is one node."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from tests.helpers import check_grads, check_map

DIM, WORDS = 8, 20


@dataclass
class Node:
    word: int
    kids: list = field(default_factory=list)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(WORDS, DIM)
        self.mix = nn.Linear(2 * DIM, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 3)

    def encode(self, node):
        if not node.kids:
            return torch.tanh(self.emb(torch.tensor(node.word)))
        left, right = self.encode(node.kids[0]), self.encode(node.kids[1])
        return torch.tanh(self.mix(torch.cat([left, right])))

    def forward(self, node):
        h = self.encode(node)
        return self.head(torch.relu(self.proj(h)))


def encode_tree(model, node):
    """The same recursion as a function of its own."""
    if not node.kids:
        return torch.tanh(model.emb(torch.tensor(node.word)))
    left = encode_tree(model, node.kids[0])
    right = encode_tree(model, node.kids[1])
    return torch.tanh(model.mix(torch.cat([left, right])))


def classify_tree(model, node):
    h = encode_tree(model, node)
    return model.head(torch.relu(model.proj(h)))


@acrobat.autobatch
def by_method(tree, model):
    return model(tree)


@acrobat.autobatch
def by_function(tree, model):
    return classify_tree(model, tree)


def trees(depth: int):
    leaf = st.builds(Node, st.integers(0, WORDS - 1))
    if depth == 0:
        return leaf
    sub = trees(depth - 1)
    return st.one_of(leaf, st.builds(Node, st.just(0), st.lists(sub, min_size=2, max_size=2)))


def _internal(node) -> int:
    return 0 if not node.kids else 1 + sum(_internal(k) for k in node.kids)


@settings(max_examples=15, deadline=None)
@given(forest=st.lists(trees(4), min_size=1, max_size=6), how=st.sampled_from(["method", "fn"]))
def test_a_recursive_encoder_called_from_straight_lines_batches_its_cells(forest, how):
    torch.manual_seed(0)
    model = Encoder()
    f = by_method if how == "method" else by_function
    with torch.no_grad():
        stats = check_map(f, forest, model=model)
    mixes = sum(map(_internal, forest))
    cells = {k: v for k, v in stats.by_op.items() if k.startswith("block:")}
    # each tree's mix cell one node, the head's lines one node per tree
    assert sum(n for _, n in cells.values()) == mixes + len(forest), stats.by_op
    assert "linear" not in stats.by_op and "cat" not in stats.by_op
    check_grads(f, forest, model, atol=1e-5, model=model)
