"""Hand-batched StackRNN: all unfinished sentences take their next parser action together.

The stacks live in two (batch, longest + 1, hidden) tensors, values and RNN
states, with a stack pointer per sentence (row 0 is the empty-stack sentinel);
a pop is a pointer decrement, so restoring the state below costs nothing. Each
step scores every active sentence in one batched call, takes the masked argmax,
composes the arcs of all reducing sentences in one call, pushes every new
element with one stack-RNN call and updates every action history with one more.
The buffer RNN runs first, over the reversed sentences, with the input half of
its weights applied to all words in one GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.common import Task
from models.stackrnn import LEFT_ARC, NEG, SHIFT, StackRNN


def rnn_rows(layer: torch.nn.Linear, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Batched :func:`models.stackrnn.rnn_cell` on (rows, hidden) inputs."""
    return torch.tanh(layer(torch.cat([x, h], dim=1)))


@torch.no_grad()
def run(task: Task) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(actions, final stack state)] for ``task.inputs``, equal to the eager outputs."""
    model: StackRNN = task.model
    sentences: list[list[int]] = task.inputs
    batch, hidden = len(sentences), model.hidden
    lengths = torch.tensor([len(words) for words in sentences])
    longest = int(lengths.max())
    ids = torch.zeros(batch, longest, dtype=torch.long)
    for row, words in enumerate(sentences):
        ids[row, : len(words)] = torch.tensor(words)
    words = model.emb(ids)  # (batch, longest, hidden)

    # buffer[b, j]: state of the last j words of sentence b, read right to left.
    reversed_ids = torch.zeros_like(ids)
    for row, word_ids in enumerate(sentences):
        reversed_ids[row, : len(word_ids)] = torch.tensor(word_ids[::-1])
    w_x, w_h = model.buffer_rnn.weight[:, :hidden], model.buffer_rnn.weight[:, hidden:]
    x_part = F.linear(model.emb(reversed_ids), w_x, model.buffer_rnn.bias)
    buffer = torch.zeros(batch, longest + 1, hidden)
    for j in range(1, longest + 1):
        rows = (lengths >= j).nonzero().squeeze(1)
        buffer[rows, j] = torch.tanh(x_part[rows, j - 1] + F.linear(buffer[rows, j - 1], w_h))

    values = torch.zeros(batch, longest + 1, hidden)
    states = torch.zeros(batch, longest + 1, hidden)
    top = torch.zeros(batch, dtype=torch.long)  # stack size; row `top` is the top element
    next_word = torch.zeros(batch, dtype=torch.long)
    history = torch.zeros(batch, hidden)
    actions = torch.full((batch, 2 * longest), -1, dtype=torch.long)
    active = torch.arange(batch)
    step = 0
    while len(active):
        sp, nw, n = top[active], next_word[active], lengths[active]
        features = torch.cat([states[active, sp], buffer[active, n - nw], history[active]], dim=1)
        scores = model.scorer(torch.tanh(model.parser(features)))
        can_shift, can_reduce = nw < n, sp >= 2
        mask = torch.stack([can_shift, can_reduce, can_reduce], dim=1)
        action = (scores + torch.where(mask, 0.0, NEG)).argmax(dim=1)
        actions[active, step] = action

        value = torch.empty(len(active), hidden)
        shifting = action == SHIFT
        shift_rows = shifting.nonzero().squeeze(1)
        value[shift_rows] = words[active[shift_rows], nw[shift_rows]]
        reduce_rows = (~shifting).nonzero().squeeze(1)
        if len(reduce_rows):
            instances, sp_r = active[reduce_rows], sp[reduce_rows]
            s0, s1 = values[instances, sp_r], values[instances, sp_r - 1]
            left = (action[reduce_rows] == LEFT_ARC)[:, None]
            head, dependent = torch.where(left, s0, s1), torch.where(left, s1, s0)
            value[reduce_rows] = torch.tanh(model.compose(torch.cat([head, dependent], dim=1)))
        sp = torch.where(shifting, sp, sp - 2)
        next_word[active] = nw + shifting.long()

        below = states[active, sp]
        sp = sp + 1
        values[active, sp] = value
        states[active, sp] = rnn_rows(model.stack_rnn, value, below)
        top[active] = sp
        history[active] = rnn_rows(model.action_rnn, model.action_emb(action), history[active])

        finished = (next_word[active] == n) & (sp == 1)
        active = active[~finished]
        step += 1

    return [
        (actions[b, : 2 * len(sentences[b]) - 1].clone(), states[b, 1].clone())
        for b in range(batch)
    ]
