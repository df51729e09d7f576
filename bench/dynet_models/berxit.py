"""The Berxit encoder of :mod:`models.berxit` in DyNet, one sequence at a time.

A sequence is an (hidden, T) matrix (DyNet is column-major: one column per
token). After each layer the exit decision reads the confidence with
``.value()``, which runs the graph built since the last read: one layer of one
instance. DyNet can batch inside that layer (its heads), never across instances.
"""

from __future__ import annotations

import math

import dynet as dy
import numpy as np
import torch

from bench.dynet_models.common import Linear, numpy32
from models.berxit import MAX_LAYERS, NUM_CLASSES, THRESHOLD, Berxit
from models.common import Task


class LayerNorm:
    """A torch ``nn.LayerNorm`` over the rows of each column of an (hidden, T) matrix."""

    def __init__(self, pc: dy.ParameterCollection, layer: torch.nn.LayerNorm):
        self.g = pc.parameters_from_numpy(numpy32(layer.weight))
        self.b = pc.parameters_from_numpy(numpy32(layer.bias))
        self.eps = layer.eps

    def __call__(self, x: dy.Expression) -> dy.Expression:
        length = x.dim()[0][1]
        centred = x - dy.reshape(dy.mean_dim(x, [0], False), (1, length))
        variance = dy.reshape(dy.mean_dim(dy.square(centred), [0], False), (1, length))
        normed = dy.cdiv(centred, dy.sqrt(variance + self.eps))
        return dy.cmult(normed, self.g) + self.b


def gelu(x: dy.Expression) -> dy.Expression:
    """The exact (erf) GELU, as ``torch.nn.functional.gelu``."""
    return dy.cmult(x, dy.erf(x * (1.0 / math.sqrt(2.0))) + 1.0) * 0.5


class DyBerxit:
    def __init__(self, model: Berxit):
        self.pc = dy.ParameterCollection()
        self.dims = model.dims
        self.qkv = Linear(self.pc, model.qkv)
        self.attn_out = Linear(self.pc, model.attn_out)
        self.ln_attn = LayerNorm(self.pc, model.ln_attn)
        self.ffn_in = Linear(self.pc, model.ffn_in)
        self.ffn_out = Linear(self.pc, model.ffn_out)
        self.ln_ffn = LayerNorm(self.pc, model.ln_ffn)
        self.pooler = Linear(self.pc, model.pooler)
        self.classifier = Linear(self.pc, model.classifier)

    def layer(self, x: dy.Expression) -> dy.Expression:
        hidden, heads = self.dims.hidden, self.dims.heads
        head_dim = hidden // heads
        qkv = self.qkv(x)
        contexts = []
        for head in range(heads):
            rows = head * head_dim
            q = dy.pick_range(qkv, rows, rows + head_dim)
            k = dy.pick_range(qkv, hidden + rows, hidden + rows + head_dim)
            v = dy.pick_range(qkv, 2 * hidden + rows, 2 * hidden + rows + head_dim)
            scores = (dy.transpose(k) * q) * (1.0 / math.sqrt(head_dim))  # (T keys, T queries)
            contexts.append(v * dy.softmax(scores, d=0))
        x = self.ln_attn(x + self.attn_out(dy.concatenate(contexts, d=0)))
        return self.ln_ffn(x + self.ffn_out(gelu(self.ffn_in(x))))

    def classify(self, x: np.ndarray) -> tuple[np.ndarray, int]:
        """(summed logits, layers used) of one (T, hidden) sequence, in a fresh graph."""
        dy.renew_cg()
        h = dy.inputTensor(np.ascontiguousarray(x.T))
        total = dy.zeros(NUM_CLASSES)
        for depth in range(1, MAX_LAYERS + 1):
            h = self.layer(h)
            first = dy.pick(h, 0, dim=1)
            total = total + self.classifier(dy.tanh(self.pooler(first)))
            if depth == MAX_LAYERS or float(np.max(dy.softmax(total).npvalue())) > THRESHOLD:
                break
        return total.npvalue(), depth


def build(task: Task) -> DyBerxit:
    return DyBerxit(task.model)


def forward(net: DyBerxit, inputs: list) -> list:
    """[(summed logits, layers used)] with numpy logits, one sequence after another."""
    return [net.classify(numpy32(x)) for x in inputs]


def run(task: Task) -> list:
    return forward(build(task), task.inputs)
