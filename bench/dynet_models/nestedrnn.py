"""The NestedRNN of :mod:`models.nestedrnn` in DyNet, one instance at a time.

Its loops read no tensor values, so the natural DyNet program builds every
instance into one graph and runs one forward pass: DyNet's autobatching sees
the whole mini-batch.
"""

from __future__ import annotations

import dynet as dy

from bench.dynet_models.common import Linear, chunks, evaluate, numpy32
from models.common import Task
from models.nestedrnn import Instance, NestedRNN


class DyNestedRNN:
    def __init__(self, model: NestedRNN):
        self.pc = dy.ParameterCollection()
        self.hidden = model.hidden
        self.inner = Linear(self.pc, model.inner)
        self.gates = Linear(self.pc, model.gates)
        self.cand_x = Linear(self.pc, model.cand_x)
        self.cand_h = Linear(self.pc, model.cand_h)

    def gru(self, r: dy.Expression, g: dy.Expression) -> dy.Expression:
        reset, update = chunks(dy.logistic(self.gates(dy.concatenate([r, g]))), 2, self.hidden)
        cand = dy.tanh(self.cand_x(r) + dy.cmult(reset, self.cand_h(g)))
        return cand + dy.cmult(update, g - cand)

    def final_state(self, instance: Instance) -> dy.Expression:
        x = dy.inputTensor(numpy32(instance.x))
        g = dy.zeros(self.hidden)
        for trips in instance.trips:
            r = g
            for _ in range(trips):
                r = dy.tanh(self.inner(dy.concatenate([x, r])))
            g = self.gru(r, g)
        return g


def build(task: Task) -> DyNestedRNN:
    return DyNestedRNN(task.model)


def forward(net: DyNestedRNN, instances: list[Instance]) -> list:
    """[final state] as numpy arrays, one graph and one forward pass for all instances."""
    dy.renew_cg()
    return evaluate([net.final_state(instance) for instance in instances])


def run(task: Task) -> list:
    return forward(build(task), task.inputs)
