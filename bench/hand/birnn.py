"""Hand-batched bidirectional Elman tagger: sentences padded to one length, masked to their own.

Sentences are sorted by falling length, so at time step t the sentences still
running are a prefix of the batch: the mask is a slice, and no work is spent on
padding. The backward RNN reads every sentence reversed (and left-aligned), so it
too starts from ``h = 0`` at each sentence's own last word. The input projections
``W_x x_t + b`` of all steps are one GEMM up front.
"""

from __future__ import annotations

import torch

from models.birnn import BiRNN, Elman
from models.common import Task


def run_prefix(rnn: Elman, x: torch.Tensor, mask: torch.Tensor, running: list[int]) -> torch.Tensor:
    """(batch, T, dim) states over padded ``x``; at step t only rows ``[:running[t]]`` are real.

    ``mask`` (batch, T) marks the real tokens, the same as ``running`` does.
    """
    batch, length, dim = x.shape
    inputs = torch.zeros_like(x)
    inputs[mask] = rnn.wx(x[mask])
    states = x.new_zeros(batch, length, dim)
    h = x.new_zeros(batch, dim)
    for t, rows in enumerate(running):
        h = torch.tanh(inputs[:rows, t] + rnn.wh(h[:rows]))
        states[:rows, t] = h
    return states


@torch.no_grad()
def run(task: Task) -> list[torch.Tensor]:
    """[(T, 5) logits] for ``task.inputs``, equal to the eager BiRNN's outputs."""
    model: BiRNN = task.model
    sentences = task.inputs
    order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
    lengths = [len(sentences[i]) for i in order]
    longest = lengths[0]
    running = [sum(length > t for length in lengths) for t in range(longest)]
    mask = torch.arange(longest) < torch.tensor(lengths).unsqueeze(1)

    ids = torch.zeros(len(order), longest, dtype=torch.long)
    reversed_ids = torch.zeros_like(ids)
    # reverse[row, t]: where the backward state of token t sits in the reversed run.
    reverse = torch.arange(longest).repeat(len(order), 1)
    for row, i in enumerate(order):
        length = lengths[row]
        ids[row, :length] = torch.tensor(sentences[i])
        reversed_ids[row, :length] = torch.tensor(sentences[i][::-1])
        reverse[row, :length] = torch.arange(length - 1, -1, -1)

    h_fwd = run_prefix(model.fwd, model.emb(ids), mask, running)
    h_bwd_reversed = run_prefix(model.bwd, model.emb(reversed_ids), mask, running)
    h_bwd = h_bwd_reversed.gather(1, reverse.unsqueeze(2).expand_as(h_bwd_reversed))
    logits = model.out(torch.cat([h_fwd, h_bwd], dim=2))

    outputs: list[torch.Tensor] = [torch.empty(0)] * len(order)
    for row, i in enumerate(order):
        outputs[i] = logits[row, : lengths[row]]
    return outputs
