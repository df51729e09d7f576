"""Hand-batched MV-RNN: level by level by node height, like :mod:`bench.hand.treelstm`.

Phrase vectors live in an (nodes, n) buffer and phrase matrices in an (nodes, n, n)
buffer; the matrix-vector and matrix-matrix products of one level are ``bmm`` and
broadcast ``matmul`` calls.
"""

from __future__ import annotations

import torch

from bench.hand.treelstm import number_levels
from models.common import Task
from models.mvrnn import MVRNN


@torch.no_grad()
def run(task: Task) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(root p, logits)] for ``task.inputs``, equal to the eager MV-RNN's outputs."""
    model: MVRNN = task.model
    n = model.dim
    levels, rows = number_levels(task.inputs)
    total = sum(len(level) for level in levels)
    vectors = torch.empty(total, n)
    matrices = torch.empty(total, n, n)

    leaves = levels[0]
    word_ids = torch.tensor([leaf.word_id for leaf in leaves])
    vectors[: len(leaves)] = model.vec(word_ids)
    matrices[: len(leaves)] = model.mat(word_ids).reshape(-1, n, n)

    start = len(leaves)
    for level in levels[1:]:
        end = start + len(level)
        left = torch.tensor([rows[id(node.left)] for node in level])
        right = torch.tensor([rows[id(node.right)] for node in level])
        a, A = vectors.index_select(0, left), matrices.index_select(0, left)
        b, B = vectors.index_select(0, right), matrices.index_select(0, right)
        Ba = torch.bmm(B, a.unsqueeze(2)).squeeze(2)
        Ab = torch.bmm(A, b.unsqueeze(2)).squeeze(2)
        vectors[start:end] = torch.tanh(model.compose(torch.cat([Ba, Ab], dim=1)))
        matrices[start:end] = model.compose_matrix @ torch.cat([A, B], dim=1)
        start = end

    p_root = vectors.index_select(0, torch.tensor([rows[id(root)] for root in task.inputs]))
    logits = model.out(p_root)
    return list(zip(p_root.unbind(0), logits.unbind(0)))
