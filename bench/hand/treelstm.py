"""Hand-batched TreeLSTM: all nodes of equal height, across the batch, in one batched step.

Nodes are numbered level by level (leaves first, then height 1, 2, ...), so the
states of one level are one contiguous slice of the state buffers: a level writes
its results with a slice assignment and reads its children with ``index_select``.
"""

from __future__ import annotations

import torch

from models.common import Task
from models.sst import Tree
from models.treelstm import TreeLSTM


def number_levels(trees: list[Tree]) -> tuple[list[list[Tree]], dict[int, int]]:
    """Nodes grouped by height, and each node's row in the state buffers (keyed by ``id``).

    Rows follow the level order: every node of height k comes before any of height k + 1.
    """
    levels: list[list[Tree]] = []

    def visit(tree: Tree) -> int:
        level = 0 if tree.is_leaf else 1 + max(visit(tree.left), visit(tree.right))
        if level == len(levels):
            levels.append([])
        levels[level].append(tree)
        return level

    for tree in trees:
        visit(tree)
    rows, row = {}, 0
    for level in levels:
        for node in level:
            rows[id(node)] = row
            row += 1
    return levels, rows


@torch.no_grad()
def run(task: Task) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(root h, logits)] for ``task.inputs``, equal to the eager TreeLSTM's outputs."""
    model: TreeLSTM = task.model
    levels, rows = number_levels(task.inputs)
    total = sum(len(level) for level in levels)
    h = torch.empty(total, model.hidden)
    c = torch.empty(total, model.hidden)

    leaves = levels[0]
    x = model.emb(torch.tensor([leaf.word_id for leaf in leaves]))
    i, o, u = model.leaf(x).chunk(3, dim=1)
    c_new = torch.sigmoid(i) * torch.tanh(u)
    c[: len(leaves)] = c_new
    h[: len(leaves)] = torch.sigmoid(o) * torch.tanh(c_new)

    start = len(leaves)
    for level in levels[1:]:
        end = start + len(level)
        left = torch.tensor([rows[id(node.left)] for node in level])
        right = torch.tensor([rows[id(node.right)] for node in level])
        hl, hr = h.index_select(0, left), h.index_select(0, right)
        cl, cr = c.index_select(0, left), c.index_select(0, right)
        i, fl, fr, o, u = model.node(torch.cat([hl, hr], dim=1)).chunk(5, dim=1)
        c_new = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        c[start:end] = c_new
        h[start:end] = torch.sigmoid(o) * torch.tanh(c_new)
        start = end

    h_root = h.index_select(0, torch.tensor([rows[id(root)] for root in task.inputs]))
    logits = model.out(h_root)
    return list(zip(h_root.unbind(0), logits.unbind(0)))
