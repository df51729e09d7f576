"""Helpers shared by the DyNet models: copying torch weights and evaluating a batch."""

from __future__ import annotations

import dynet as dy
import numpy as np
import torch


def numpy32(tensor: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.detach().cpu().numpy(), dtype=np.float32)


class Linear:
    """A torch ``nn.Linear``'s weight and bias as DyNet parameters: ``y = W x + b``."""

    def __init__(self, pc: dy.ParameterCollection, layer: torch.nn.Linear):
        self.W = pc.parameters_from_numpy(numpy32(layer.weight))
        self.b = pc.parameters_from_numpy(numpy32(layer.bias))

    def __call__(self, x: dy.Expression) -> dy.Expression:
        return dy.affine_transform([self.b, self.W, x])


def lookup(pc: dy.ParameterCollection, weight: torch.Tensor) -> dy.LookupParameters:
    """Embedding rows ``weight[i]`` as DyNet lookup parameters."""
    return pc.lookup_parameters_from_numpy(numpy32(weight))


def chunks(x: dy.Expression, count: int, size: int) -> list[dy.Expression]:
    """``torch.chunk`` of a vector of ``count * size`` elements."""
    return [dy.pick_range(x, k * size, (k + 1) * size) for k in range(count)]


def evaluate(outputs: list) -> list:
    """Values of a list of per-instance pytrees of expressions, after ONE forward pass.

    Asking for one expression's value first would run the graph only up to that
    expression, and DyNet would batch just the instances built before it.
    """
    flat = [e for out in outputs for e in (out if isinstance(out, tuple) else (out,))]
    dy.forward(flat)
    return [
        tuple(e.npvalue() for e in out) if isinstance(out, tuple) else out.npvalue()
        for out in outputs
    ]
