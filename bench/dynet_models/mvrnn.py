"""The MV-RNN of :mod:`models.mvrnn` in DyNet, one tree at a time."""

from __future__ import annotations

import dynet as dy

from bench.dynet_models.common import Linear, evaluate, lookup, numpy32
from models.common import Task
from models.mvrnn import MVRNN
from models.sst import Tree


class DyMVRNN:
    def __init__(self, model: MVRNN):
        n = self.dim = model.dim
        self.pc = dy.ParameterCollection()
        self.vec = lookup(self.pc, model.vec.weight)
        # dy.reshape fills a matrix column by column, torch's reshape row by row:
        # store each word matrix transposed so that both read back the same matrix.
        matrices = model.mat.weight.reshape(-1, n, n).transpose(1, 2).reshape(-1, n * n)
        self.mat = lookup(self.pc, matrices)
        self.compose = Linear(self.pc, model.compose)
        self.compose_matrix = self.pc.parameters_from_numpy(numpy32(model.compose_matrix))
        self.out = Linear(self.pc, model.out)

    def phrase(self, tree: Tree) -> tuple[dy.Expression, dy.Expression]:
        """(vector, matrix) of the phrase spanned by ``tree``."""
        if tree.is_leaf:
            a = dy.lookup(self.vec, tree.word_id)
            A = dy.reshape(dy.lookup(self.mat, tree.word_id), (self.dim, self.dim))
            return a, A
        a, A = self.phrase(tree.left)
        b, B = self.phrase(tree.right)
        p = dy.tanh(self.compose(dy.concatenate([B * a, A * b])))
        P = self.compose_matrix * dy.concatenate([A, B], d=0)
        return p, P

    def encode(self, tree: Tree) -> tuple[dy.Expression, dy.Expression]:
        p, _ = self.phrase(tree)
        return p, self.out(p)


def build(task: Task) -> DyMVRNN:
    return DyMVRNN(task.model)


def forward(net: DyMVRNN, trees: list[Tree]) -> list:
    """[(p, logits)] as numpy arrays, one graph and one forward pass for all trees."""
    dy.renew_cg()
    return evaluate([net.encode(tree) for tree in trees])


def run(task: Task) -> list:
    return forward(build(task), task.inputs)
