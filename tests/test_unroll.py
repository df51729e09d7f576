"""Loops of a literal trip count written out (analysis.UNROLL_LOOPS, ``_Rewriter._unrolled``).

A GNN's ``for _ in range(3): h = torch.tanh(m.own(h) + m.msg(adj @ h) / deg)`` was a scan
of its own between a block for the lookups before it and one for the readout after: three
nodes per graph, and two of the batches padded apart. Written out, the loop joins the
straight-line code around it and the whole function is one block: one node per graph.
These tests hold the written-out loops to the eager results, values and gradients, for
the forms the counter takes (unread, an index into a ModuleList, a number, read after
the loop, nested loops, negative steps, an ``else:``), and check that the loops that must stay loops
do."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import analysis
from bench.patterns import edge_gnn, message_passing  # (loops of range(3) / range(2))
from tests.helpers import check_grads, check_map, outlined_with, random_rows

DIM = 6
VOCAB = 11


class GNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.own = nn.Linear(DIM, DIM)
        self.msg = nn.Linear(DIM, DIM)
        self.edge = nn.Linear(2 * DIM, DIM)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.head = nn.Linear(DIM, 3)


torch.manual_seed(0)
MODEL = GNN()


def layered(x, m):
    # the counter picks a layer and scales; after the loop it holds its last value
    for i in range(3):
        x = torch.tanh(m.layers[i](x)) * (i + 1)
    y = m.head(x) * 2
    return y + i


def nested(x, m):
    h = m.layers[0](x)
    for _ in range(2):
        for j in range(1, 4, 2):
            h = torch.relu(m.layers[1](h)) * j
    for k in range(2, 0, -1):
        h = h + torch.sigmoid(m.layers[2](h)) / k
    return h.sum(0)


def loop_else(x, m):
    for _ in range(2):
        x = torch.tanh(m.layers[0](x))
    else:  # (nothing in the body can break: runs after the copies)
        x = x * 3
    return x.sum(0)


def adjacency_graphs(sizes: list[int], seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        a = (torch.rand(n, n, generator=g) < 0.4).float()
        out.append(((a + a.T > 0).float(), torch.randint(VOCAB, (n,), generator=g)))
    return out


def edge_graphs(sizes: list[tuple[int, int]], seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(VOCAB, (n,), generator=g), torch.randint(n, (2, e), generator=g))
        for n, e in sizes
    ]


def rows(sizes: list[int], seed: int) -> list:
    return random_rows(sizes, seed, DIM)


def one_block(stats, instances: int) -> str:
    """The name of the map's only block op, recorded once per instance, and no scan."""
    assert not [op for op in stats.by_op if op.startswith("scan:")], stats.by_op
    blocks = [op for op in stats.by_op if op.startswith("block:")]
    assert len(blocks) == 1, stats.by_op
    assert stats.by_op[blocks[0]][1] == instances, stats.by_op
    return blocks[0]


SIZES = st.lists(st.integers(1, 9), min_size=1, max_size=7)
EDGES = st.lists(
    st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, 2 * n))),
    min_size=1,
    max_size=7,
)


@settings(deadline=None)
@given(SIZES, st.integers(0, 2**16))
def test_message_passing_is_one_block(sizes, seed):
    f = acrobat.autobatch(message_passing)
    with torch.no_grad():
        stats = check_map(f, adjacency_graphs(sizes, seed), m=MODEL)
    name = one_block(stats, len(sizes))
    lines, first = inspect.getsourcelines(message_passing)
    assert f"lines {first + 1}-{first + len(lines) - 1}" in name, name  # the whole body


@settings(deadline=None)
@given(EDGES, st.integers(0, 2**16))
def test_edge_lists_are_one_block(sizes, seed):
    f = acrobat.autobatch(edge_gnn)
    with torch.no_grad():
        stats = check_map(f, edge_graphs(sizes, seed), m=MODEL)
    one_block(stats, len(sizes))


@settings(deadline=None)
@given(SIZES, st.integers(0, 2**16))
def test_counter_as_index_number_and_last_value(sizes, seed):
    f = acrobat.autobatch(layered)
    with torch.no_grad():
        stats = check_map(f, rows(sizes, seed), m=MODEL)
    # the loop and the line after it one block (``return y + i`` adds a Python int: op by op)
    blocks = [op for op in stats.by_op if op.startswith("block:")]
    assert len(blocks) == 1 and stats.by_op[blocks[0]][1] == len(sizes), stats.by_op
    assert "linear" not in stats.by_op and "tanh" not in stats.by_op, stats.by_op


@settings(deadline=None)
@given(SIZES, st.integers(0, 2**16))
@pytest.mark.parametrize("fn", [nested, loop_else])
def test_nested_loops_negative_steps_and_else(fn, sizes, seed):
    f = acrobat.autobatch(fn)
    with torch.no_grad():
        stats = check_map(f, rows(sizes, seed), m=MODEL)
    one_block(stats, len(sizes))


@pytest.mark.parametrize(
    "fn, data",
    [
        (message_passing, adjacency_graphs([3, 5, 1, 5, 4], 1)),
        (edge_gnn, edge_graphs([(3, 4), (5, 2), (1, 1), (5, 9)], 2)),
        (nested, rows([2, 4, 1], 3)),
    ],
)
def test_gradients(fn, data):
    f = acrobat.autobatch(fn)
    stats = check_grads(f, data, MODEL, m=MODEL)
    assert not [op for op in stats.by_op if op.startswith("scan:")], stats.by_op


@pytest.mark.parametrize("fn, data", [(message_passing, adjacency_graphs([3, 5, 1, 5], 4))])
def test_fewer_nodes_than_the_loop(fn, data):
    """The same function with the rewrite off: the loop is a scan between two blocks."""
    f = acrobat.autobatch(fn)
    with torch.no_grad():
        on = check_map(f, data, m=MODEL)
        with outlined_with(fn, UNROLL_LOOPS=False):
            off = check_map(acrobat.autobatch(fn), data, m=MODEL)
    assert [op for op in off.by_op if op.startswith("scan:")], off.by_op
    assert on.nodes < off.nodes, (on, off)


def value_read(x, m):
    for _ in range(2):
        y = m.layers[0](x)
        if y.sum() > 0:
            x = x + 1
    return x


def appends(x, m):
    out = []
    for _ in range(3):
        x = torch.tanh(m.layers[0](x))
        out.append(x)
    return torch.stack(out)


def many_trips(x, m):
    for _ in range(analysis.UNROLL_TRIPS + 1):  # (not a literal: a global's attribute)
        x = torch.tanh(m.layers[0](x))
    for _ in range(9):
        x = torch.tanh(m.layers[1](x))
    return x


def invariant_work(x, m):
    h = torch.zeros(DIM)
    for _ in range(3):  # m.layers[0](x) reads nothing the body assigns: the scan hoists it
        h = torch.tanh(m.layers[0](x) + m.layers[1](h))
    return h


def counter_assigned(x, m):
    for i in range(2):
        x = torch.tanh(m.layers[0](x))
        i = 5  # the counter rebound in the body: left as a loop
    return x * i


def literal_loops_that_stay(x, m):
    scales = (0.5, 0.25)
    for w in scales:  # (a name, not a display)
        x = torch.tanh(m.layers[0](x) * w)
    for w in (0.5, m):  # (not all constants)
        x = x + 1 if w is m else torch.tanh(m.layers[1](x))
    return x


@pytest.mark.parametrize(
    "fn",
    [value_read, appends, many_trips, invariant_work, counter_assigned, literal_loops_that_stay],
)
def test_loops_that_stay(fn):
    """A body that reads a value, appends to a list, computes loop-invariant tensor work or
    rebinds the counter, trip counts that are no literal or above UNROLL_TRIPS, and loops
    over a name or a display holding anything but constants stay loops: the map records
    what it records with the rewrite off, with eager's results."""
    data = rows([2, 3, 1], 5)
    with torch.no_grad():
        on = check_map(acrobat.autobatch(fn), data, m=MODEL)
        with outlined_with(fn, UNROLL_LOOPS=False):
            off = check_map(acrobat.autobatch(fn), data, m=MODEL)
    assert on.by_op == off.by_op


def test_error_names_the_line_in_the_loop():
    def bad(x, m):
        h = m.layers[0](x[:, :DIM])
        for _ in range(2):
            h = torch.tanh(m.layers[1](h)) + x
        return h

    f = acrobat.autobatch(bad)
    xs = [torch.randn(2, DIM), torch.randn(3, DIM + 1)]
    with pytest.raises(RuntimeError, match="must match the size"):
        bad(xs[1], MODEL)
    line = inspect.getsourcelines(bad)[1] + 3
    where = rf"instance 1, at .*test_unroll.py:{line} in bad:"
    with pytest.raises(acrobat.ShapeError, match=where):
        f.map(xs, m=MODEL)


def literal_scales(x, m):
    # a loop over a tuple of constants (UNROLL_LITERALS): the counter a number, then
    # read after the loop (its last value)
    h = m.layers[0](x)
    for w in (0.5, -0.25, 2.0):
        h = torch.tanh(m.layers[1](h) * w) + h
    return m.head(h).sum(0) * w


def literal_layers(x, m):
    # over a list of ints (indices into a ModuleList) and strings (a module's attributes)
    for k in [2, 0]:
        x = torch.relu(m.layers[k](x))
    for name in ("own", "msg"):
        x = torch.tanh(getattr(m, name)(x))
    return x.sum(0)


def operator_scales(x, m):
    # a body of operators alone on a name tensor work binds (UNROLL_OPERATORS)
    h = m.layers[0](x)
    for w in (0.5, 0.25):
        h = h * w + x
    for _ in range(2):
        h = -h / 2
    return m.head(h).sum(0)


@pytest.mark.parametrize(
    "fn, flag",
    [
        (literal_scales, "UNROLL_LITERALS"),
        (literal_layers, "UNROLL_LITERALS"),
        (operator_scales, "UNROLL_OPERATORS"),
    ],
)
@settings(max_examples=10, deadline=None)
@given(SIZES, st.integers(0, 2**16))
def test_loops_over_literal_tuples_and_operator_bodies_are_written_out(fn, flag, sizes, seed):
    """A loop over a tuple or list display of constants, and a loop whose body is
    operators alone on a name tensor work binds, are written out as a ``range`` loop of
    literals is: the whole function one block per instance, eager's values and
    gradients; with the flag off it stays a loop (more nodes)."""
    data = rows(sizes, seed)
    with torch.no_grad():
        on = check_map(acrobat.autobatch(fn), data, m=MODEL)
        one_block(on, len(data))
        with outlined_with(fn, **{flag: False}):
            off = check_map(acrobat.autobatch(fn), data, m=MODEL)
    assert on.nodes < off.nodes, (on.by_op, off.by_op)
    check_grads(acrobat.autobatch(fn), data, MODEL, atol=1e-4, rtol=1e-4, m=MODEL)  # (float32 sums)


def index_arithmetic(x, m):
    n = 0
    for k in range(3):  # (operators on a number: the loop stays)
        n = n + k * 2
    h = torch.tanh(m.layers[0](x)) * n
    return h.sum(0)


def test_operator_bodies_on_numbers_stay_loops():
    """``n = n + k * 2`` on a number stays a loop: the run starts after it (written out,
    its copies would join the run, which would begin at ``n = 0``)."""
    data = rows([2, 3, 1], 5)
    fn = index_arithmetic
    with torch.no_grad():
        on = check_map(acrobat.autobatch(fn), data, m=MODEL)
    lines, first = inspect.getsourcelines(fn)
    h_line = first + next(i for i, line in enumerate(lines) if "h = torch.tanh" in line)
    (block,) = [op for op in on.by_op if op.startswith("block:")]
    assert f"lines {h_line}-" in block, block
