"""What every benchmark model shares: the :class:`Task` record and output comparison.

A model module ``models.<name>`` exposes ``make_task(size, batch, seed=0, blocks=True)``
returning a :class:`Task`. Its ``fn`` is an ``@acrobat.autobatch`` function of ONE
per-instance positional argument, so a whole task runs as::

    outs = task.fn.map(task.inputs, **task.kwargs)   # batched
    refs = run_eager(task)                           # the plain PyTorch reference
    assert outputs_close(outs, refs, atol=1e-5, rtol=1e-5)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Task:
    """One benchmark workload: a model, its per-instance inputs and the function to run.

    ``inputs`` has one element per instance, and each element is the single
    per-instance positional argument of ``fn`` (a tree, a list of word ids, ...).
    ``kwargs`` holds the shared keyword arguments, at least ``model=``.
    """

    name: str
    size: str
    batch: int
    fn: Any  # an acrobat.autobatch function: has .map and .eager
    inputs: list
    kwargs: dict
    model: torch.nn.Module
    seed: int = 0
    blocks: bool = True


def run_eager(task: Task) -> list:
    """The reference outputs: ``task.fn.eager`` on every instance, one at a time."""
    return [task.fn.eager(x, **task.kwargs) for x in task.inputs]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Runs the body under ``torch.manual_seed(seed)`` without disturbing the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def flatten(tree: Any) -> list:
    """The leaves of a pytree of tuples, lists and dicts (dicts in key order)."""
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in flatten(item)]
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in flatten(tree[key])]
    return [tree]


@dataclass(frozen=True)
class Comparison:
    """Result of :func:`outputs_close`; true when every element is within tolerance."""

    ok: bool
    max_abs_diff: float
    message: str = ""

    def __bool__(self) -> bool:
        return self.ok


def outputs_close(a: Any, b: Any, atol: float = 1e-5, rtol: float = 1e-5) -> Comparison:
    """Compares two pytrees of tensors (or numpy arrays) leaf by leaf, like ``torch.allclose``.

    Only the leaves are compared, in order, so a tuple and a list with the same
    leaves match. ``b`` is the reference for ``rtol``. Any structural mismatch (leaf
    count, shape) gives ``ok=False`` and an infinite ``max_abs_diff``.

    >>> outputs_close((torch.ones(2), [torch.zeros(1)]), [torch.ones(2), torch.zeros(1)]).ok
    True
    """
    leaves_a, leaves_b = flatten(a), flatten(b)
    if len(leaves_a) != len(leaves_b):
        return Comparison(False, math.inf, f"{len(leaves_a)} leaves vs {len(leaves_b)}")
    worst, ok, message = 0.0, True, ""
    for i, (x, y) in enumerate(zip(leaves_a, leaves_b)):
        x = torch.as_tensor(x).detach().to("cpu", torch.float64)
        y = torch.as_tensor(y).detach().to("cpu", torch.float64)
        if x.shape != y.shape:
            return Comparison(
                False, math.inf, f"leaf {i}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
            )
        if x.numel() == 0:
            continue
        diff = (x - y).abs()
        leaf_worst = diff.max().item()  # NaN if any element is NaN
        worst = leaf_worst if math.isnan(leaf_worst) or leaf_worst > worst else worst
        if not bool((diff <= atol + rtol * y.abs()).all()):
            if ok:
                message = f"leaf {i}: max abs diff {leaf_worst:.3g}"
            ok = False
    return Comparison(ok, worst, message)
