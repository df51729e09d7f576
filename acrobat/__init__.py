"""acrobat: dynamic auto-batching for control-flow-heavy PyTorch models.

Write the forward pass for ONE instance in plain PyTorch, decorate it with
:func:`autobatch`, and run a mini-batch with ``f.map``::

    @acrobat.autobatch
    def encode(tree, model): ...
    outs = encode.map(trees, model=model)
"""

from acrobat import config, fusion
from acrobat.api import Autobatched, autobatch, concurrent, fork, phase, stats
from acrobat.block import block
from acrobat.errors import (
    AcrobatError,
    AcrobatWarning,
    InstanceIndexError,
    LazyValueError,
    ShapeError,
    UnsupportedOpError,
)
from acrobat.fibers import Future
from acrobat.ops import TABLE as OPS
from acrobat.stats import Stats
from acrobat.tensor import LazyTensor

__version__ = "0.1.0"

__all__ = [
    "OPS",
    "AcrobatError",
    "AcrobatWarning",
    "Autobatched",
    "Future",
    "InstanceIndexError",
    "LazyTensor",
    "LazyValueError",
    "ShapeError",
    "Stats",
    "UnsupportedOpError",
    "autobatch",
    "block",
    "concurrent",
    "config",
    "fork",
    "fusion",
    "phase",
    "stats",
]
