"""The bidirectional Elman tagger of :mod:`models.birnn` in DyNet, one sentence at a time."""

from __future__ import annotations

import dynet as dy

from bench.dynet_models.common import evaluate, lookup, numpy32
from models.birnn import BiRNN, Elman
from models.common import Task


class DyElman:
    def __init__(self, pc: dy.ParameterCollection, rnn: Elman):
        self.Wx = pc.parameters_from_numpy(numpy32(rnn.wx.weight))
        self.b = pc.parameters_from_numpy(numpy32(rnn.wx.bias))
        self.Wh = pc.parameters_from_numpy(numpy32(rnn.wh.weight))
        self.dim = rnn.wh.in_features

    def states(self, xs: list[dy.Expression]) -> list[dy.Expression]:
        h = dy.zeros(self.dim)
        states = []
        for x in xs:
            h = dy.tanh(dy.affine_transform([self.b, self.Wx, x, self.Wh, h]))
            states.append(h)
        return states


class DyBiRNN:
    def __init__(self, model: BiRNN):
        self.pc = dy.ParameterCollection()
        self.emb = lookup(self.pc, model.emb.weight)
        self.fwd = DyElman(self.pc, model.fwd)
        self.bwd = DyElman(self.pc, model.bwd)
        self.out_W = self.pc.parameters_from_numpy(numpy32(model.out.weight))
        self.out_b = self.pc.parameters_from_numpy(numpy32(model.out.bias))

    def tag(self, word_ids: list[int]) -> dy.Expression:
        """(classes, T) logits of one sentence (transposed when read back)."""
        xs = [dy.lookup(self.emb, word_id) for word_id in word_ids]
        h_fwd = self.fwd.states(xs)
        h_bwd = self.bwd.states(xs[::-1])[::-1]
        logits = [
            dy.affine_transform([self.out_b, self.out_W, dy.concatenate([f, b])])
            for f, b in zip(h_fwd, h_bwd)
        ]
        return dy.concatenate_cols(logits)


def build(task: Task) -> DyBiRNN:
    return DyBiRNN(task.model)


def forward(net: DyBiRNN, sentences: list[list[int]]) -> list:
    """[(T, classes) logits] as numpy arrays, one graph and one forward pass for all sentences."""
    dy.renew_cg()
    values = evaluate([net.tag(word_ids) for word_ids in sentences])
    return [value.reshape(value.shape[0], -1).T for value in values]


def run(task: Task) -> list:
    return forward(build(task), task.inputs)
