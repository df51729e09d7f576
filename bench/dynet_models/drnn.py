"""The DRNN of :mod:`models.drnn` in DyNet, written the natural way: depth-first recursion.

Each node's decisions are read with ``.value()`` before the program knows what
to build next, so every read runs the graph built since the previous read: one
node's few operations. DyNet's autobatching therefore finds almost nothing to
batch; nothing in the natural program lets it see other instances or other
subtrees (the ACRoBat paper's "DN" column for DRNN).
"""

from __future__ import annotations

import dynet as dy
import numpy as np

from bench.dynet_models.common import Linear, numpy32
from models.common import Task
from models.drnn import DRNN, MAX_DEPTH, MAX_SIBLINGS


class DyDRNN:
    def __init__(self, model: DRNN):
        self.pc = dy.ParameterCollection()
        self.hidden = model.hidden
        self.root = Linear(self.pc, model.root)
        self.pred_a = Linear(self.pc, model.pred_a)
        self.U_f = self.pc.parameters_from_numpy(numpy32(model.pred_f.weight))
        self.topology = Linear(self.pc, model.topology)
        self.label = Linear(self.pc, model.label)
        self.ancestral = Linear(self.pc, model.ancestral)
        self.fraternal = Linear(self.pc, model.fraternal)

    def siblings(self, h_a: dy.Expression, depth: int, limit: int, parent: int, out: tuple) -> None:
        """Generates a sibling chain and, depth first, each sibling's subtree into ``out``."""
        logits, parents = out
        h_f = dy.zeros(self.hidden)
        for made in range(1, limit + 1):
            h = dy.tanh(self.pred_a(h_a) + self.U_f * h_f)
            p = dy.logistic(self.topology(h))
            has_children, has_sibling = (value > 0.5 for value in p.value())
            node = len(parents)
            logits.append(self.label(h))
            parents.append(parent)
            if has_children and depth < MAX_DEPTH:
                child_h_a = dy.tanh(self.ancestral(dy.concatenate([h, h_a])))
                self.siblings(child_h_a, depth + 1, MAX_SIBLINGS, node, out)
            if not has_sibling or made == limit:
                return
            h_f = dy.tanh(self.fraternal(dy.concatenate([h, h_f])))

    def generate(self, x: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """(preorder logits, preorder parents) of one tree, in a fresh graph."""
        dy.renew_cg()
        logits: list[dy.Expression] = []
        parents: list[int] = []
        h_a = dy.tanh(self.root(dy.inputTensor(x)))
        self.siblings(h_a, 0, 1, -1, (logits, parents))
        values = dy.concatenate_cols(logits).npvalue().reshape(-1, len(logits))
        return values.T, parents


def build(task: Task) -> DyDRNN:
    return DyDRNN(task.model)


def forward(net: DyDRNN, inputs: list) -> list:
    """[(logits, parents)] with numpy logits, one instance after another."""
    return [net.generate(numpy32(x)) for x in inputs]


def run(task: Task) -> list:
    return forward(build(task), task.inputs)
