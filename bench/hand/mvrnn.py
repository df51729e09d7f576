"""Hand-batched MV-RNN: level by level by node height, like :mod:`bench.hand.treelstm`.

Phrase vectors live in an (nodes, n) buffer and phrase matrices, TRANSPOSED, in an
(nodes, n, n) buffer. Transposed, ``P = W_M @ cat([A, B])`` of a whole level is
``P^T = A^T @ W_1^T + B^T @ W_2^T`` (``W_M = [W_1 W_2]``): two plain GEMMs over the
level's stacked matrices, written straight into the buffer with no transposing
copy; ``B @ a`` is ``a^T @ B^T``, one ``bmm``.
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
    widest = max(len(level) for level in levels)
    vectors = torch.empty(total, n)
    matrices_t = torch.empty(total, n, n)
    # Gathered children's matrices go to buffers reused by every level: allocating
    # fresh ones per level costs more than the gathers themselves.
    A_t_buffer, B_t_buffer = torch.empty(widest, n, n), torch.empty(widest, n, n)
    w1_t = model.compose_matrix[:, :n].t()
    w2_t = model.compose_matrix[:, n:].t()

    leaves = levels[0]
    word_ids = torch.tensor([leaf.word_id for leaf in leaves])
    vectors[: len(leaves)] = model.vec(word_ids)
    word_matrices_t = model.mat.weight.view(-1, n, n).transpose(1, 2)
    torch.index_select(word_matrices_t, 0, word_ids, out=matrices_t[: len(leaves)])

    start = len(leaves)
    for level in levels[1:]:
        end = start + len(level)
        left = torch.tensor([rows[id(node.left)] for node in level])
        right = torch.tensor([rows[id(node.right)] for node in level])
        A_t = torch.index_select(matrices_t, 0, left, out=A_t_buffer[: len(level)])
        B_t = torch.index_select(matrices_t, 0, right, out=B_t_buffer[: len(level)])
        a, b = vectors.index_select(0, left), vectors.index_select(0, right)
        Ba = torch.bmm(a.unsqueeze(1), B_t).squeeze(1)
        Ab = torch.bmm(b.unsqueeze(1), A_t).squeeze(1)
        vectors[start:end] = torch.tanh(model.compose(torch.cat([Ba, Ab], dim=1)))
        P_t = matrices_t[start:end].view(-1, n)
        torch.mm(A_t.view(-1, n), w1_t, out=P_t)
        P_t.addmm_(B_t.view(-1, n), w2_t)
        start = end

    p_root = vectors.index_select(0, torch.tensor([rows[id(root)] for root in task.inputs]))
    logits = model.out(p_root)
    return list(zip(p_root.unbind(0), logits.unbind(0)))
