"""Bidirectional Elman RNN tagger over the words of SST sentences.

Two Elman RNNs, ``h_t = tanh(W_x x_t + W_h h_{t-1} + b)`` with ``h_0 = 0``, read
the sentence left to right and right to left, each with its own weights. A linear
classifier maps ``cat([h_fwd_t, h_bwd_t])`` to 5 classes at every token. The
per-instance input is the list of word ids; the output the (T, 5) logits.

>>> task = make_task("small", batch=2)
>>> tuple(task.fn.eager(task.inputs[0], **task.kwargs).shape)
(4, 5)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import acrobat
from models.common import Task, seeded
from models.sst import first_trees, sentence_ids, split_vocab

SIZES = {"small": 256, "large": 512}  # hidden size = embedding size
NUM_CLASSES = 5


class Elman(nn.Module):
    """Weights of one direction: ``W_x`` with the bias ``b``, and ``W_h``."""

    def __init__(self, dim: int):
        super().__init__()
        self.wx = nn.Linear(dim, dim)
        self.wh = nn.Linear(dim, dim, bias=False)


class BiRNN(nn.Module):
    def __init__(self, vocab_size: int, dim: int, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.dim = dim
        self.emb = nn.Embedding(vocab_size, dim)
        self.fwd = Elman(dim)
        self.bwd = Elman(dim)
        self.out = nn.Linear(2 * dim, num_classes)


def rnn_cell(rnn: Elman, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One Elman step of direction ``rnn``."""
    return torch.tanh(rnn.wx(x) + rnn.wh(h))


def output_cell(model: BiRNN, h_fwd: torch.Tensor, h_bwd: torch.Tensor) -> torch.Tensor:
    """Class logits of one token from both directions' states."""
    return model.out(torch.cat([h_fwd, h_bwd]))


def run_rnn(rnn: Elman, xs: list[torch.Tensor], cell: Callable) -> list[torch.Tensor]:
    """The states after each input of ``xs``, in the order of ``xs``."""
    h = torch.zeros(rnn.wh.in_features)
    states = []
    for x in xs:
        h = cell(rnn, x, h)
        states.append(h)
    return states


def tag(word_ids: list[int], model: BiRNN, rnn: Callable, output: Callable) -> torch.Tensor:
    """(T, 5) logits of one sentence with the given cell functions."""
    with acrobat.phase("rnn"):
        xs = [model.emb(torch.tensor(word_id)) for word_id in word_ids]
        h_fwd = run_rnn(model.fwd, xs, rnn)
        h_bwd = run_rnn(model.bwd, xs[::-1], rnn)[::-1]
    with acrobat.phase("output"):
        logits = [output(model, f, b) for f, b in zip(h_fwd, h_bwd)]
    return torch.stack(logits)


rnn_block = acrobat.block(rnn_cell)
output_block = acrobat.block(output_cell)


@acrobat.autobatch
def tag_blocks(word_ids: list[int], model: BiRNN) -> torch.Tensor:
    """Per-token logits of one sentence, each cell an ``acrobat.block``."""
    return tag(word_ids, model, rnn_block, output_block)


@acrobat.autobatch
def tag_plain(word_ids: list[int], model: BiRNN) -> torch.Tensor:
    """Same as :func:`tag_blocks` with the cells' ops recorded one by one."""
    return tag(word_ids, model, rnn_cell, output_cell)


def make_task(size: str, batch: int, seed: int = 0, blocks: bool = True) -> Task:
    """The sentences of the first ``batch`` SST test trees and a BiRNN of the given size."""
    vocab = split_vocab("test")
    sentences = [sentence_ids(tree) for tree in first_trees(batch, vocab)]
    with seeded(seed):
        model = BiRNN(len(vocab), SIZES[size]).eval()
    fn = tag_blocks if blocks else tag_plain
    return Task("birnn", size, batch, fn, sentences, {"model": model}, model, seed, blocks)
