"""Hand-batched bidirectional Elman tagger: sentences padded to one length, masked.

Both directions step over the padded (batch, T) grid one time step at a time, all
sentences together. The input projections ``W_x x_t + b`` of all steps are one
GEMM up front. A sentence's state is updated only at its real tokens, so the
backward RNN of a short sentence starts from ``h = 0`` at its own last word.
"""

from __future__ import annotations

import torch

from models.birnn import BiRNN, Elman
from models.common import Task


def run_masked(rnn: Elman, x: torch.Tensor, mask: torch.Tensor, reverse: bool) -> torch.Tensor:
    """(batch, T, dim) states of one direction over padded ``x``; ``mask`` marks real tokens."""
    batch, length, dim = x.shape
    inputs = rnn.wx(x)
    h = x.new_zeros(batch, dim)
    states = x.new_zeros(batch, length, dim)
    steps = range(length - 1, -1, -1) if reverse else range(length)
    for t in steps:
        h_new = torch.tanh(inputs[:, t] + rnn.wh(h))
        h = torch.where(mask[:, t, None], h_new, h)
        states[:, t] = h
    return states


@torch.no_grad()
def run(task: Task) -> list[torch.Tensor]:
    """[(T, 5) logits] for ``task.inputs``, equal to the eager BiRNN's outputs."""
    model: BiRNN = task.model
    lengths = [len(word_ids) for word_ids in task.inputs]
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    for row, word_ids in enumerate(task.inputs):
        ids[row, : len(word_ids)] = torch.tensor(word_ids)
    mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]

    x = model.emb(ids)
    h_fwd = run_masked(model.fwd, x, mask, reverse=False)
    h_bwd = run_masked(model.bwd, x, mask, reverse=True)
    logits = model.out(torch.cat([h_fwd, h_bwd], dim=2))
    return [logits[row, :length] for row, length in enumerate(lengths)]
