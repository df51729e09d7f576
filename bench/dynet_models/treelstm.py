"""The TreeLSTM of :mod:`models.treelstm` in DyNet, one tree at a time."""

from __future__ import annotations

import dynet as dy

from bench.dynet_models.common import Linear, chunks, evaluate, lookup
from models.common import Task
from models.sst import Tree
from models.treelstm import TreeLSTM


class DyTreeLSTM:
    def __init__(self, model: TreeLSTM):
        self.pc = dy.ParameterCollection()
        self.hidden = model.hidden
        self.emb = lookup(self.pc, model.emb.weight)
        self.leaf = Linear(self.pc, model.leaf)
        self.node = Linear(self.pc, model.node)
        self.out = Linear(self.pc, model.out)

    def state(self, tree: Tree) -> tuple[dy.Expression, dy.Expression]:
        """(h, c) of the root of ``tree``."""
        if tree.is_leaf:
            gates = self.leaf(dy.lookup(self.emb, tree.word_id))
            i, o, u = chunks(gates, 3, self.hidden)
            c = dy.cmult(dy.logistic(i), dy.tanh(u))
            return dy.cmult(dy.logistic(o), dy.tanh(c)), c
        hl, cl = self.state(tree.left)
        hr, cr = self.state(tree.right)
        gates = self.node(dy.concatenate([hl, hr]))
        i, fl, fr, o, u = chunks(gates, 5, self.hidden)
        c = (
            dy.cmult(dy.logistic(i), dy.tanh(u))
            + dy.cmult(dy.logistic(fl), cl)
            + dy.cmult(dy.logistic(fr), cr)
        )
        return dy.cmult(dy.logistic(o), dy.tanh(c)), c

    def encode(self, tree: Tree) -> tuple[dy.Expression, dy.Expression]:
        h, _ = self.state(tree)
        return h, self.out(h)


def build(task: Task) -> DyTreeLSTM:
    return DyTreeLSTM(task.model)


def forward(net: DyTreeLSTM, trees: list[Tree]) -> list:
    """[(h, logits)] as numpy arrays, one graph and one forward pass for all trees."""
    dy.renew_cg()
    return evaluate([net.encode(tree) for tree in trees])


def run(task: Task) -> list:
    return forward(build(task), task.inputs)
