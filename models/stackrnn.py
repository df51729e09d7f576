"""StackRNN: a Stack-LSTM arc-standard dependency parser (Dyer et al., 2015) with Elman cells.

The parser state has three recurrent summaries, each Elman cells
``h = tanh(W [x; h_prev] + b)`` in place of Dyer et al.'s LSTMs:

- the buffer: an RNN run over the sentence right to left, so the state for the
  remaining words ``w_i .. w_n`` is computed once, up front, and SHIFT just moves
  to the next one;
- the stack: every element keeps the RNN state computed when it was pushed, so a
  pop restores the state below it without recomputing anything;
- the action history: an RNN over the embeddings of the actions taken so far.

At each step ``p = tanh(W_p [stack; buffer; actions] + b_p)`` scores the actions
SHIFT, LEFT-ARC and RIGHT-ARC; invalid actions (SHIFT on an empty buffer, an arc
with fewer than two stack elements) get ``NEG`` added, and the parser takes the
``argmax``, read with ``int(...)``: tensor-dependent control flow. An arc pops
the two top elements ``s0`` (top) and ``s1`` and pushes their composition
``tanh(W_c [head; dependent] + b_c)``, with head ``s0`` for LEFT-ARC (``s0 -> s1``)
and ``s1`` for RIGHT-ARC (``s1 -> s0``). Parsing ends with the buffer empty and
one element on the stack, after ``2n - 1`` actions for ``n`` words.

With random weights, Dyer et al.'s ReLU for ``p`` makes every sentence parse the
same way (reduce as soon as possible, nearly always with the same arc): the
ReLU's output has a large common component that fixes the argmax. A
zero-centred ``tanh`` and a scorer bias of zero except ``SHIFT_BIAS`` on SHIFT
make the decisions depend on the state: for seeds 0 to 2 at both sizes, both
arcs are common and the deepest stack of a sentence is 4 to 12 elements at the
median of a batch of 64 (2 to 29 overall).

The sentences are those of the SST test trees; the output of one sentence is
``(actions, h)``: the action ids as an int64 tensor and the final stack state.

>>> task = make_task("small", batch=2)
>>> actions, h = task.fn.eager(task.inputs[0], **task.kwargs)
>>> len(actions) == 2 * len(task.inputs[0]) - 1, tuple(h.shape)
(True, (256,))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

import acrobat
from models.common import Task, seeded
from models.sst import first_trees, sentence_ids, split_vocab

SIZES = {"small": 256, "large": 512}  # hidden size = embedding size
SHIFT, LEFT_ARC, RIGHT_ARC = 0, 1, 2
NUM_ACTIONS = 3
NEG = -1e9  # added to the scores of invalid actions
SHIFT_BIAS = 0.15  # the scorer's bias for SHIFT at init (the others are 0)


class StackRNN(nn.Module):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.emb = nn.Embedding(vocab_size, hidden)
        self.action_emb = nn.Embedding(NUM_ACTIONS, hidden)
        self.buffer_rnn = nn.Linear(2 * hidden, hidden)
        self.stack_rnn = nn.Linear(2 * hidden, hidden)
        self.action_rnn = nn.Linear(2 * hidden, hidden)
        self.parser = nn.Linear(3 * hidden, hidden)
        self.scorer = nn.Linear(hidden, NUM_ACTIONS)
        self.compose = nn.Linear(2 * hidden, hidden)
        with torch.no_grad():
            self.scorer.bias.copy_(torch.tensor([SHIFT_BIAS, 0.0, 0.0]))


def rnn_cell(layer: nn.Linear, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One Elman step of the RNN whose weights are ``layer``."""
    return torch.tanh(layer(torch.cat([x, h])))


def score_cell(
    model: StackRNN, stack: torch.Tensor, buffer: torch.Tensor, actions: torch.Tensor
) -> torch.Tensor:
    """The (NUM_ACTIONS,) action scores of a parser state."""
    return model.scorer(torch.tanh(model.parser(torch.cat([stack, buffer, actions]))))


def compose_cell(model: StackRNN, head: torch.Tensor, dependent: torch.Tensor) -> torch.Tensor:
    """The representation of ``head`` with ``dependent`` attached."""
    return torch.tanh(model.compose(torch.cat([head, dependent])))


class Cells(NamedTuple):
    rnn: Callable
    score: Callable
    compose: Callable


PLAIN = Cells(rnn_cell, score_cell, compose_cell)
BLOCKS = Cells(*(acrobat.block(cell) for cell in PLAIN))


def parse(word_ids: list[int], model: StackRNN, cells: Cells) -> tuple[torch.Tensor, torch.Tensor]:
    """(action ids, final stack state) of one sentence."""
    empty = torch.zeros(model.hidden)
    with acrobat.phase("buffer"):
        words = [model.emb(torch.tensor(word_id)) for word_id in word_ids]
        buffer = [empty]  # buffer[j]: state of the last j words, read right to left
        for x in reversed(words):
            buffer.append(cells.rnn(model.buffer_rnn, x, buffer[-1]))
    with acrobat.phase("parse"):
        stack = [(empty, empty)]  # (value, RNN state); the bottom is a sentinel
        history = empty
        actions: list[int] = []
        next_word = 0
        while next_word < len(words) or len(stack) > 2:
            scores = cells.score(model, stack[-1][1], buffer[len(words) - next_word], history)
            can_shift, can_reduce = next_word < len(words), len(stack) > 2
            mask = [0.0 if ok else NEG for ok in (can_shift, can_reduce, can_reduce)]
            action = int(torch.argmax(scores + torch.tensor(mask)))  # suspends
            if action == SHIFT:
                value = words[next_word]
                next_word += 1
            else:
                (s0, _), (s1, _) = stack.pop(), stack.pop()
                head, dependent = (s0, s1) if action == LEFT_ARC else (s1, s0)
                value = cells.compose(model, head, dependent)
            stack.append((value, cells.rnn(model.stack_rnn, value, stack[-1][1])))
            history = cells.rnn(model.action_rnn, model.action_emb(torch.tensor(action)), history)
            actions.append(action)
    return torch.tensor(actions), stack[-1][1]


@acrobat.autobatch
def parse_blocks(word_ids: list[int], model: StackRNN) -> tuple[torch.Tensor, torch.Tensor]:
    """Actions and final stack state of one sentence, each cell an ``acrobat.block``."""
    return parse(word_ids, model, BLOCKS)


@acrobat.autobatch
def parse_plain(word_ids: list[int], model: StackRNN) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`parse_blocks` with the cells' ops recorded one by one."""
    return parse(word_ids, model, PLAIN)


def make_task(size: str, batch: int, seed: int = 0, blocks: bool = True) -> Task:
    """The sentences of the first ``batch`` SST test trees and a StackRNN of the given size."""
    vocab = split_vocab("test")
    sentences = [sentence_ids(tree) for tree in first_trees(batch, vocab)]
    with seeded(seed):
        model = StackRNN(len(vocab), SIZES[size]).eval()
    fn = parse_blocks if blocks else parse_plain
    return Task("stackrnn", size, batch, fn, sentences, {"model": model}, model, seed, blocks)
