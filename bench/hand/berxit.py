"""Hand-batched Berxit: the still-running sequences go through each layer as one (B, T, h) batch.

After every layer the classifier runs on the whole active batch, one ``tolist()``
reads which instances exit, and the batch is compacted to the rest, so no
compute is spent on sequences that have exited.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models.berxit import MAX_LAYERS, NUM_CLASSES, THRESHOLD, Berxit
from models.common import Task


def layer_batch(model: Berxit, x: torch.Tensor) -> torch.Tensor:
    """:func:`models.berxit.layer_cell` on a (batch, T, hidden) batch."""
    batch, length, hidden = x.shape
    heads = model.dims.heads
    q, k, v = model.qkv(x).chunk(3, dim=-1)
    q, k, v = (t.reshape(batch, length, heads, hidden // heads).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(2, 3)) * (1.0 / math.sqrt(hidden // heads))
    context = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, length, hidden)
    x = model.ln_attn(x + model.attn_out(context))
    return model.ln_ffn(x + model.ffn_out(F.gelu(model.ffn_in(x))))


@torch.no_grad()
def run(task: Task) -> list[tuple[torch.Tensor, int]]:
    """[(summed logits, layers used)] for ``task.inputs``, equal to the eager outputs."""
    model: Berxit = task.model
    batch = len(task.inputs)
    x = torch.stack(task.inputs)
    totals = torch.zeros(batch, NUM_CLASSES)
    active = torch.arange(batch)  # instance of each row of x and totals
    outputs: list = [None] * batch
    for depth in range(1, MAX_LAYERS + 1):
        x = layer_batch(model, x)
        totals = totals + model.classifier(torch.tanh(model.pooler(x[:, 0])))
        confident = torch.softmax(totals, dim=-1).amax(dim=-1) > THRESHOLD
        done = confident.tolist() if depth < MAX_LAYERS else [True] * len(active)
        for row, instance in enumerate(active.tolist()):
            if done[row]:
                outputs[instance] = (totals[row], depth)
        if all(done):
            break
        keep = ~torch.tensor(done)
        x, totals, active = x[keep], totals[keep], active[keep]
    return outputs
