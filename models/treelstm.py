"""Binary constituency TreeLSTM (Tai et al., 2015) over SST parse trees.

Each leaf embeds its word and runs the leaf cell; each internal node combines its
two children with the node cell (one forget gate per child). The result is the
root's hidden state and 5-class sentiment logits from it.

>>> task = make_task("small", batch=2)
>>> h, logits = task.fn.eager(task.inputs[0], **task.kwargs)
>>> tuple(h.shape), tuple(logits.shape)
((256,), (5,))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

import acrobat
from models.common import Task, seeded
from models.sst import Tree, first_trees, split_vocab

SIZES = {"small": 256, "large": 512}  # hidden size = embedding size
NUM_CLASSES = 5


class TreeLSTM(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.hidden = hidden
        self.emb = nn.Embedding(vocab_size, hidden)
        self.leaf = nn.Linear(hidden, 3 * hidden)  # gates i, o, u of a leaf
        self.node = nn.Linear(2 * hidden, 5 * hidden)  # gates i, f_left, f_right, o, u
        self.out = nn.Linear(hidden, num_classes)


def leaf_cell(model: TreeLSTM, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, c) of a leaf with word embedding ``x``."""
    i, o, u = model.leaf(x).chunk(3)
    c = torch.sigmoid(i) * torch.tanh(u)
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


def node_cell(
    model: TreeLSTM, hl: torch.Tensor, cl: torch.Tensor, hr: torch.Tensor, cr: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, c) of an internal node from the states of its left and right children."""
    i, fl, fr, o, u = model.node(torch.cat([hl, hr])).chunk(5)
    c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


class Cells(NamedTuple):
    """The cell functions one entry point uses: plain, or wrapped as acrobat blocks."""

    leaf: Callable
    node: Callable


PLAIN = Cells(leaf_cell, node_cell)
BLOCKS = Cells(acrobat.block(leaf_cell), acrobat.block(node_cell))


def tree_state(tree: Tree, model: TreeLSTM, cells: Cells) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, c) of the root of ``tree``, computed bottom-up by recursion."""
    if tree.is_leaf:
        return cells.leaf(model, model.emb(torch.tensor(tree.word_id)))
    hl, cl = tree_state(tree.left, model, cells)
    hr, cr = tree_state(tree.right, model, cells)
    return cells.node(model, hl, cl, hr, cr)


@acrobat.autobatch
def encode_blocks(tree: Tree, model: TreeLSTM) -> tuple[torch.Tensor, torch.Tensor]:
    """Root hidden state and logits of one tree, each cell an ``acrobat.block``."""
    h, _ = tree_state(tree, model, BLOCKS)
    with acrobat.phase("output"):  # every root's classifier: one batch
        return h, model.out(h)


@acrobat.autobatch
def encode_plain(tree: Tree, model: TreeLSTM) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`encode_blocks` with the cells' ops recorded one by one."""
    h, _ = tree_state(tree, model, PLAIN)
    with acrobat.phase("output"):  # every root's classifier: one batch
        return h, model.out(h)


def tree_state_inline(tree: Tree, model: TreeLSTM) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tree_state` with both cells written inline around the recursion, as a user
    would write it without factoring cells out (acrobat outlines each inline cell into
    one block: config.AUTO_REGIONS)."""
    if tree.is_leaf:
        x = model.emb(torch.tensor(tree.word_id))
        i, o, u = model.leaf(x).chunk(3)
        c = torch.sigmoid(i) * torch.tanh(u)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c
    hl, cl = tree_state_inline(tree.left, model)
    hr, cr = tree_state_inline(tree.right, model)
    i, fl, fr, o, u = model.node(torch.cat([hl, hr])).chunk(5)
    c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


@acrobat.autobatch
def encode_inline(tree: Tree, model: TreeLSTM) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`encode_plain` with the cells written inline."""
    h, _ = tree_state_inline(tree, model)
    with acrobat.phase("output"):  # every root's classifier: one batch
        return h, model.out(h)


INLINE = encode_inline  # bench/run.py times it as "acrobat-inline"


def make_task(size: str, batch: int, seed: int = 0, blocks: bool = True) -> Task:
    """The first ``batch`` SST test trees and a TreeLSTM of the given size (vocab: test split)."""
    vocab = split_vocab("test")
    trees = first_trees(batch, vocab)
    with seeded(seed):
        model = TreeLSTM(len(vocab), SIZES[size]).eval()
    fn = encode_blocks if blocks else encode_plain
    return Task("treelstm", size, batch, fn, trees, {"model": model}, model, seed, blocks)
