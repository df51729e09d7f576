"""The StackRNN parser of :mod:`models.stackrnn` in DyNet, one sentence at a time.

Each parser step reads the masked action scores with ``.npvalue()`` and takes
the argmax in numpy (DyNet has no batched argmax), so every read runs the graph
built since the previous one: one step of one sentence.
"""

from __future__ import annotations

import dynet as dy
import numpy as np

from bench.dynet_models.common import Linear, lookup
from models.common import Task
from models.stackrnn import LEFT_ARC, NEG, SHIFT, StackRNN


class DyStackRNN:
    def __init__(self, model: StackRNN):
        self.pc = dy.ParameterCollection()
        self.hidden = model.hidden
        self.emb = lookup(self.pc, model.emb.weight)
        self.action_emb = lookup(self.pc, model.action_emb.weight)
        self.buffer_rnn = Linear(self.pc, model.buffer_rnn)
        self.stack_rnn = Linear(self.pc, model.stack_rnn)
        self.action_rnn = Linear(self.pc, model.action_rnn)
        self.parser = Linear(self.pc, model.parser)
        self.scorer = Linear(self.pc, model.scorer)
        self.compose = Linear(self.pc, model.compose)

    @staticmethod
    def rnn(layer: Linear, x: dy.Expression, h: dy.Expression) -> dy.Expression:
        return dy.tanh(layer(dy.concatenate([x, h])))

    def parse(self, word_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(action ids, final stack state) of one sentence, in a fresh graph."""
        dy.renew_cg()
        empty = dy.zeros(self.hidden)
        words = [dy.lookup(self.emb, word_id) for word_id in word_ids]
        buffer = [empty]
        for x in reversed(words):
            buffer.append(self.rnn(self.buffer_rnn, x, buffer[-1]))
        stack = [(empty, empty)]
        history = empty
        actions: list[int] = []
        next_word = 0
        while next_word < len(words) or len(stack) > 2:
            features = dy.concatenate([stack[-1][1], buffer[len(words) - next_word], history])
            scores = self.scorer(dy.tanh(self.parser(features)))
            can_shift, can_reduce = next_word < len(words), len(stack) > 2
            mask = np.array([0.0 if ok else NEG for ok in (can_shift, can_reduce, can_reduce)])
            action = int(np.argmax(scores.npvalue() + mask.astype(np.float32)))
            if action == SHIFT:
                value = words[next_word]
                next_word += 1
            else:
                (s0, _), (s1, _) = stack.pop(), stack.pop()
                head, dependent = (s0, s1) if action == LEFT_ARC else (s1, s0)
                value = dy.tanh(self.compose(dy.concatenate([head, dependent])))
            stack.append((value, self.rnn(self.stack_rnn, value, stack[-1][1])))
            history = self.rnn(self.action_rnn, dy.lookup(self.action_emb, action), history)
            actions.append(action)
        return np.array(actions, dtype=np.int64), stack[-1][1].npvalue()


def build(task: Task) -> DyStackRNN:
    return DyStackRNN(task.model)


def forward(net: DyStackRNN, sentences: list[list[int]]) -> list:
    """[(actions, final stack state)] as numpy arrays, one sentence after another."""
    return [net.parse(word_ids) for word_ids in sentences]


def run(task: Task) -> list:
    return forward(build(task), task.inputs)
