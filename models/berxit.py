"""Berxit (Xin et al., 2021): an early-exit transformer encoder whose layers share weights.

One post-LN encoder layer (ALBERT-style: the SAME weights at every depth) is
applied up to ``MAX_LAYERS`` times to a (SEQ_LEN, hidden) sequence::

    x = layer_norm(x + attention(x))          # multi-head self-attention
    x = layer_norm(x + W_2 gelu(W_1 x))       # feed-forward

After each layer the classifier (on the first token: a ``tanh`` pooler, then a
linear layer) adds its class logits to a running sum, and the instance exits as
soon as the largest softmax probability of the sum exceeds ``THRESHOLD``. That
read (``float(...)``) is tensor-dependent control flow: each instance suspends
after every layer. The output of one instance is ``(summed logits, layers
used)``, the layer count a Python int.

Why the sum: with random weights, a classifier's confidence hardly changes from
one layer to the next, so exiting on the last layer's logits alone sends each
instance out after layer 1 or never (checked for seeds 0 to 3). Summing the
logits of all layers so far (an ensemble of the internal classifiers, as in
ensemble-based early exit) makes confidence grow with depth at a rate that
differs per instance. With the classifier's weights scaled by
``CLASSIFIER_GAIN`` at init and ``THRESHOLD = 0.9``, a batch exits after 2 to
12 layers (median 4 to 8, a few instances using all 12) for seeds 0 to 3 at
both sizes.

>>> task = make_task("small", batch=2)
>>> logits, layers = task.fn.eager(task.inputs[0], **task.kwargs)
>>> tuple(logits.shape), 1 <= layers <= MAX_LAYERS
((3,), True)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import acrobat
from models.common import Task, seeded


class Dims(NamedTuple):
    hidden: int
    heads: int
    ffn: int


SIZES = {"small": Dims(256, 4, 1024), "large": Dims(512, 8, 2048)}
SEQ_LEN = 32
MAX_LAYERS = 12
NUM_CLASSES = 3
CLASSIFIER_GAIN = 3.0  # scales the classifier's random weights at init
THRESHOLD = 0.9  # exit once the largest class probability of the summed logits exceeds this


class Berxit(nn.Module):
    def __init__(self, dims: Dims, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.dims = dims
        hidden = dims.hidden
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln_attn = nn.LayerNorm(hidden)
        self.ffn_in = nn.Linear(hidden, dims.ffn)
        self.ffn_out = nn.Linear(dims.ffn, hidden)
        self.ln_ffn = nn.LayerNorm(hidden)
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_classes)
        with torch.no_grad():
            self.classifier.weight *= CLASSIFIER_GAIN


def layer_cell(model: Berxit, x: torch.Tensor) -> torch.Tensor:
    """One encoder layer on a (T, hidden) sequence."""
    length, hidden = x.shape
    heads = model.dims.heads
    q, k, v = model.qkv(x).chunk(3, dim=-1)
    # (T, hidden) -> (heads, T, head_dim)
    q, k, v = (t.reshape(length, heads, hidden // heads).transpose(0, 1) for t in (q, k, v))
    scores = (q @ k.transpose(1, 2)) * (1.0 / math.sqrt(hidden // heads))
    context = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(length, hidden)
    x = model.ln_attn(x + model.attn_out(context))
    return model.ln_ffn(x + model.ffn_out(F.gelu(model.ffn_in(x))))


def exit_cell(
    model: Berxit, x: torch.Tensor, total: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed logits, their largest class probability) after adding this layer's logits."""
    total = total + model.classifier(torch.tanh(model.pooler(x[0])))
    return total, torch.softmax(total, dim=-1).max()


class Cells(NamedTuple):
    layer: Callable
    exit: Callable


PLAIN = Cells(layer_cell, exit_cell)
BLOCKS = Cells(acrobat.block(layer_cell), acrobat.block(exit_cell))


def classify(x: torch.Tensor, model: Berxit, cells: Cells) -> tuple[torch.Tensor, int]:
    """(summed logits, layers used) of one sequence: layers run until the sum is confident."""
    logits = torch.zeros(NUM_CLASSES)
    for depth in range(1, MAX_LAYERS + 1):
        x = cells.layer(model, x)
        logits, confidence = cells.exit(model, x, logits)
        if depth == MAX_LAYERS or float(confidence) > THRESHOLD:  # suspends for the value
            break
    return logits, depth


@acrobat.autobatch
def classify_blocks(x: torch.Tensor, model: Berxit) -> tuple[torch.Tensor, int]:
    """Early-exit logits of one sequence, each cell an ``acrobat.block``."""
    return classify(x, model, BLOCKS)


@acrobat.autobatch
def classify_plain(x: torch.Tensor, model: Berxit) -> tuple[torch.Tensor, int]:
    """Same as :func:`classify_blocks` with the cells' ops recorded one by one."""
    return classify(x, model, PLAIN)


def make_inputs(batch: int, hidden: int, seed: int) -> list[torch.Tensor]:
    """``batch`` standard normal (SEQ_LEN, hidden) sequences."""
    generator = torch.Generator().manual_seed(seed)
    return list(
        torch.randn(batch, SEQ_LEN, hidden, generator=generator, device="cpu")
        .to(torch.get_default_device())
        .unbind(0)
    )


def make_task(size: str, batch: int, seed: int = 0, blocks: bool = True) -> Task:
    """``batch`` random sequences and a Berxit encoder of the given size."""
    dims = SIZES[size]
    with seeded(seed):
        model = Berxit(dims).eval()
    inputs = make_inputs(batch, dims.hidden, seed)
    fn = classify_blocks if blocks else classify_plain
    return Task("berxit", size, batch, fn, inputs, {"model": model}, model, seed, blocks)
