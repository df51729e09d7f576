"""NestedRNN: an Elman RNN loop nested inside a GRU loop (ACRoBat's Table 3).

The outer GRU runs one step per entry of the instance's trip list; outer step
``i`` first runs the inner Elman RNN for ``trips[i]`` steps, starting from the
outer state ``g`` and reading the instance's input vector ``x`` at every step,
then feeds the inner result to the GRU::

    g = 0
    for k in trips:                   # outer loop, len(trips) steps
        r = g
        for _ in range(k):            # inner loop
            r = tanh(W [x; r] + b)
        g = GRU(r, g)
    return g

As in the paper, the trip counts (outer and inner) are drawn uniformly from
[20, 40] by a seeded generator: they are part of the per-instance input, so the
loop structure differs between instances but reads no tensor values.

>>> task = make_task("small", batch=2)
>>> tuple(task.fn.eager(task.inputs[0], **task.kwargs).shape)
(256,)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

import acrobat
from models.common import Task, seeded

SIZES = {"small": 256, "large": 512}  # hidden size = input size
MIN_TRIPS, MAX_TRIPS = 20, 40  # inclusive range of both loops' trip counts


class NestedRNN(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.inner = nn.Linear(2 * hidden, hidden)  # Elman cell on [x; r]
        self.gates = nn.Linear(2 * hidden, 2 * hidden)  # GRU reset and update gates on [r; g]
        self.cand_x = nn.Linear(hidden, hidden)  # GRU candidate, input part
        self.cand_h = nn.Linear(hidden, hidden)  # GRU candidate, state part (under the reset gate)


class Instance(NamedTuple):
    """One input: the vector read by the inner RNN and the inner trip count of each outer step."""

    x: torch.Tensor
    trips: tuple[int, ...]


def rnn_cell(model: NestedRNN, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """One inner Elman step."""
    return torch.tanh(model.inner(torch.cat([x, r])))


def gru_cell(model: NestedRNN, r: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """One outer GRU step with input ``r`` and state ``g`` (PyTorch's GRUCell equations)."""
    reset, update = torch.sigmoid(model.gates(torch.cat([r, g]))).chunk(2)
    cand = torch.tanh(model.cand_x(r) + reset * model.cand_h(g))
    return cand + update * (g - cand)


class Cells(NamedTuple):
    rnn: Callable
    gru: Callable


PLAIN = Cells(rnn_cell, gru_cell)
BLOCKS = Cells(acrobat.block(rnn_cell), acrobat.block(gru_cell))


def nested(instance: Instance, model: NestedRNN, cells: Cells) -> torch.Tensor:
    """The final outer state of one instance."""
    g = torch.zeros(model.hidden)
    for trips in instance.trips:
        r = g
        for _ in range(trips):
            r = cells.rnn(model, instance.x, r)
        g = cells.gru(model, r, g)
    return g


@acrobat.autobatch
def nested_blocks(instance: Instance, model: NestedRNN) -> torch.Tensor:
    """Final GRU state of one instance, each cell an ``acrobat.block``."""
    return nested(instance, model, BLOCKS)


@acrobat.autobatch
def nested_plain(instance: Instance, model: NestedRNN) -> torch.Tensor:
    """Same as :func:`nested_blocks` with the cells' ops recorded one by one."""
    return nested(instance, model, PLAIN)


def make_inputs(batch: int, hidden: int, seed: int) -> list[Instance]:
    """``batch`` instances: a standard normal vector and trip counts in [20, 40] each."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    instances = []
    for _ in range(batch):
        outer = rng.randint(MIN_TRIPS, MAX_TRIPS)
        trips = tuple(rng.randint(MIN_TRIPS, MAX_TRIPS) for _ in range(outer))
        instances.append(
            Instance(
                torch.randn(hidden, generator=generator, device="cpu").to(
                    torch.get_default_device()
                ),
                trips,
            )
        )
    return instances


def make_task(size: str, batch: int, seed: int = 0, blocks: bool = True) -> Task:
    """``batch`` random instances and a NestedRNN of the given size."""
    hidden = SIZES[size]
    with seeded(seed):
        model = NestedRNN(hidden).eval()
    inputs = make_inputs(batch, hidden, seed)
    fn = nested_blocks if blocks else nested_plain
    return Task("nestedrnn", size, batch, fn, inputs, {"model": model}, model, seed, blocks)
