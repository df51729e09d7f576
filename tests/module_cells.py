"""Cells that tests/test_analysis.py reaches only through this module's name
(``module_cells.step(...)``, ``module_cells.TAIL.shrink(...)``)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

lin = nn.Linear(4, 4)


def step(x, h):
    """A straight-line cell."""
    return torch.tanh(lin(x) + h)


def shrink(h):
    return h * 0.5 + 0.1


class Tail(NamedTuple):
    shrink: object


TAIL = Tail(shrink)

HIDDEN = 4  # constants a function reads as module_cells.HIDDEN (tests/test_module_attributes.py)
SCALE = 0.5
