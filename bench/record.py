"""Recording cost per node: what acrobat spends in Python (or C) per recorded op.

Each case runs inside ``f.map`` over 16 instances that each record a chain of ``STEPS``
nodes; the time of the recording loops (not the flush) divided by the nodes recorded is
the cost per node. Buckets are shared across instances, as in the models. Run with
``ACROBAT_NATIVE=0`` to measure the Python record path.

    python -m bench.record            # C record path (if built)
    ACROBAT_NATIVE=0 python -m bench.record
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

import acrobat
from acrobat.tensor import _native

STEPS = 200
INSTANCES = 16
HIDDEN = 64


class Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.wx = nn.Linear(HIDDEN, HIDDEN)
        self.wh = nn.Linear(HIDDEN, HIDDEN)
        self.wxh = nn.Linear(2 * HIDDEN, HIDDEN)
        self.emb = nn.Embedding(100, HIDDEN)


@acrobat.block
def cell(m: Cell, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(m.wx(x) + m.wh(h))


@acrobat.block
def cut_cell(m: Cell, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    # x is the same at every step: after 32 calls the trace is cut there (hoisting.py)
    return torch.tanh(m.wxh(torch.cat([x, h])))


def _op(x, m, spent):
    h = x
    t = time.perf_counter()
    for _ in range(STEPS):
        h = torch.tanh(h)
    spent.append(time.perf_counter() - t)
    return h


def _block(x, m, spent):
    h = x
    t = time.perf_counter()
    for _ in range(STEPS):
        h = cell(m, x, h)
    spent.append(time.perf_counter() - t)
    return h


def plain_cell(m: Cell, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    # no decorator: analysis routes it to a block for the map (automatic coarsening)
    return torch.tanh(m.wx(x) + m.wh(h))


def _auto_block(x, m, spent):
    h = x
    t = time.perf_counter()
    for _ in range(STEPS):
        h = plain_cell(m, x, h)
    spent.append(time.perf_counter() - t)
    return h


def _cut_block(x, m, spent):
    h = x
    t = time.perf_counter()
    for _ in range(STEPS):
        h = cut_cell(m, x, h)
    spent.append(time.perf_counter() - t)
    return h


def _lookup(x, m, spent):
    out = x
    t = time.perf_counter()
    for i in range(STEPS):
        out = m.emb(torch.tensor(i % 100))
    spent.append(time.perf_counter() - t)
    return out


CASES = {
    "operator (torch.tanh)": _op,
    "block call": _block,
    "block call, plain function (automatic)": _auto_block,
    "block call, cut (hoisted part reused)": _cut_block,
    "word lookup (emb(torch.tensor(i)))": _lookup,
}


def measure(body, reps: int = 7) -> float:
    """Median µs per recorded node of ``body`` over ``reps`` maps (after one warm-up)."""
    m = Cell().eval()
    xs = [torch.randn(HIDDEN) for _ in range(INSTANCES)]
    spent: list[float] = []

    @acrobat.autobatch
    def run(x, m):
        return body(x, m, spent)

    per_node = []
    # the chains are counted loops: as scans they would record one node per instance
    with torch.no_grad(), acrobat.config.override(AUTO_SCANS=False):
        for rep in range(reps + 1):
            spent.clear()
            run.map(xs, m=m)
            if rep:
                per_node.append(sum(spent) / (INSTANCES * STEPS) * 1e6)
    return statistics.median(per_node)


def main() -> None:
    torch.set_num_threads(1)
    path = "C (acrobat._native)" if _native is not None else "Python"
    print(f"record path: {path}; {INSTANCES} instances x {STEPS} nodes, median of 7 maps")
    for name, body in CASES.items():
        print(f"  {name:40s} {measure(body):5.2f} µs/node")


if __name__ == "__main__":
    main()
