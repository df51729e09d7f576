"""Loops over a module's layers join the runs around them (analysis.LOOP_RUNS).

``for layer in self.layers: h = torch.relu(layer(h)) + h`` could be neither written out
(the AST does not know how many layers there are) nor a scan (its elements are modules,
not per-instance tensors): each trip was a region node of its own, and a lone op before
the loop ran op by op, a batch per length. Now the loop is part of the run: the region
runs it as written, so its trace writes it out for the layers the module has (the trace
is keyed by the module, whose layers a trace's validity check covers: appending or
replacing a layer traces again). A guard at the call checks that the containers are
modules; anything else (a list, an object's tensors) runs as it did before (a scan, a
region per trip). These tests hold the forms to the eager results, values and
gradients, and check the loops that must stay out of runs do."""

from __future__ import annotations

import inspect
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from bench.patterns import Model, make_data, residual_stack
from tests.helpers import check_grads, check_map, outlined_with, random_rows

DIM = 6


class Branchy(nn.Module):
    """A layer that reads a value (control flow): a region's trace cannot hold it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h):
        y = self.lin(h)
        if y.sum() > 0:
            return torch.tanh(y)
        return y * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(3))
        self.seq = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.ws = nn.ParameterList(nn.Parameter(torch.randn(DIM, DIM) * 0.3) for _ in range(2))
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2)) for _ in range(2)
        )
        self.empty = nn.ModuleList()
        self.branchy = nn.ModuleList(Branchy() for _ in range(2))
        self.plain = [nn.Linear(DIM, DIM) for _ in range(2)]  # (a list: not a module)

    def forward(self, x):
        h = torch.tanh(x)
        for layer in self.layers:
            h = torch.relu(layer(h)) + h
        return h.sum(0)


torch.manual_seed(0)
NET = Net()


def zipped(x, m):
    h = torch.tanh(x)
    for layer, norm in zip(m.layers, m.norms):
        h = norm(h + torch.relu(layer(h)))
    return h.sum(0)


def enumerated(x, m):
    h = torch.tanh(x)
    for i, layer in enumerate(m.layers):
        h = layer(h) * (i + 1)
    return h.sum(0)


def reverse_slice(x, m):
    h = x * 2
    for layer in reversed(m.layers[1:]):
        h = torch.sigmoid(layer(h))
    return h.sum(0)


def sequential(x, m):
    h = torch.tanh(x)
    for layer in m.seq:
        h = layer(h)
    return h.sum(0)


def parameters(x, m):
    h = torch.tanh(x)
    for w in m.ws:
        h = torch.tanh(h @ w)
    return h.sum(0)


def nested(x, m):
    h = torch.tanh(x)
    for block in m.blocks:
        for layer in block:
            h = h + layer(h)
    return h.sum(0)


LOOPS = [zipped, enumerated, reverse_slice, sequential, parameters, nested]


def rows(sizes: list[int], seed: int) -> list:
    return random_rows(sizes, seed, DIM)


def one_block(stats, instances: int) -> None:
    """The map recorded one block op, once per instance, and nothing else but inputs."""
    assert set(stats.by_op) <= {"input"} | {op for op in stats.by_op if op.startswith("block:")}
    blocks = [op for op in stats.by_op if op.startswith("block:")]
    assert len(blocks) == 1 and stats.by_op[blocks[0]][1] == instances, stats.by_op


SIZES = st.lists(st.integers(1, 9), min_size=1, max_size=7)


@settings(deadline=None, max_examples=15)
@given(SIZES, st.integers(0, 2**16))
@pytest.mark.parametrize("fn", LOOPS, ids=lambda fn: fn.__name__)
def test_loops_over_modules_are_one_block(fn, sizes, seed):
    f = acrobat.autobatch(fn)
    with torch.no_grad():
        stats = check_map(f, rows(sizes, seed), m=NET)
    one_block(stats, len(sizes))


@settings(deadline=None, max_examples=15)
@given(SIZES, st.integers(0, 2**16))
def test_a_modules_own_forward(sizes, seed):
    f = acrobat.autobatch(NET)
    with torch.no_grad():
        stats = check_map(f, rows(sizes, seed))
    one_block(stats, len(sizes))
    lines, first = inspect.getsourcelines(Net.forward)
    name = next(op for op in stats.by_op if op.startswith("block:"))
    assert f"lines {first + 1}-{first + len(lines) - 1}" in name, name  # the whole body


@pytest.mark.parametrize("fn", LOOPS, ids=lambda fn: fn.__name__)
def test_gradients(fn):
    stats = check_grads(acrobat.autobatch(fn), rows([2, 4, 1, 4], 3), NET, m=NET)
    one_block(stats, 4)


def passed_in(x, layers):
    h = torch.tanh(x)
    for layer in layers:  # (a bare name, LOOP_NAMES: a module here)
        h = torch.relu(layer(h)) + h
    return h.sum(0)


def test_a_module_passed_in():
    data = rows([3, 1, 2], 4)
    with torch.no_grad():
        one_block(check_map(acrobat.autobatch(passed_in), data, layers=NET.layers), 3)
        # a list of layers: the guard fails, the loop runs as it did before
        check_map(acrobat.autobatch(passed_in), data, layers=NET.plain)


def test_the_pattern_is_one_block_and_fewer_nodes_than_the_loop():
    """bench/patterns.py's residual_stack: with LOOP_RUNS off, a node per layer."""
    m = Model().eval()
    data = make_data("tokens", 6)
    with torch.no_grad():
        on = check_map(acrobat.autobatch(residual_stack), data, m=m)
        with outlined_with(residual_stack, LOOP_RUNS=False):
            off = check_map(acrobat.autobatch(residual_stack), data, m=m)
    one_block(on, 6)
    assert on.nodes < off.nodes, (on, off)


def test_layers_added_or_replaced_between_maps():
    net = Net()
    f = acrobat.autobatch(net)
    data = rows([3, 1, 4], 7)
    with torch.no_grad():
        for _ in range(2):
            one_block(check_map(f, data), 3)
            net.layers.append(nn.Linear(DIM, DIM))
        net.layers[0] = nn.Linear(DIM, DIM)
        one_block(check_map(f, data), 3)
        net.layers = nn.ModuleList()
        check_map(f, data)


def empty(x, m):
    h = torch.tanh(x)
    for layer in m.empty:
        h = torch.relu(layer(h)) + h
    return h.sum(0)


def value_reading_layers(x, m):
    h = torch.tanh(x)
    for layer in m.branchy:
        h = torch.relu(layer(h)) + h
    return h


@pytest.mark.parametrize("fn", [empty, value_reading_layers], ids=lambda fn: fn.__name__)
def test_no_layers_and_layers_that_read_values(fn):
    data = [torch.randn(DIM), torch.randn(DIM), -torch.ones(DIM)]
    with torch.no_grad():
        check_map(acrobat.autobatch(fn), data, m=NET)
    if fn is value_reading_layers:  # (no layers: no parameters to take gradients of)
        check_grads(acrobat.autobatch(fn), data, NET, m=NET)


def variable_read_after(x, m):
    h = torch.tanh(x)
    for layer in m.layers:
        h = torch.relu(layer(h)) + h
    return layer(h)  # (unbound after a loop over no layers: the loop stays out)


def bound_in_the_loop_only(x, m):
    for layer in m.layers:
        y = torch.relu(layer(x)) + x
    return y


def a_plain_list(x, m):
    h = torch.tanh(x)
    for layer in m.plain:  # (the guard's other branch: as before)
        h = torch.relu(layer(h)) + h
    return h


def container_assigned_in_the_run(x, m):
    layers = m.layers
    h = torch.tanh(x)
    for layer in layers:  # (the guard would read ``layers`` before the run assigns it)
        h = torch.relu(layer(h)) + h
    return h


def appends(x, m):
    h = torch.tanh(x)
    outs = []
    for layer in m.layers:  # (a statement no run takes: the loop stays out)
        h = torch.relu(layer(h)) + h
        outs.append(h.sum(0))
    return torch.stack(outs)


class Sentence(NamedTuple):
    tokens: list
    start: torch.Tensor


CELL = nn.GRUCell(DIM, DIM)


def over_an_instances_tensors(s, m):
    h = torch.tanh(m.layers[0](s.start))
    for t in s.tokens:  # (an attribute chain of tensors: the guard fails, a scan as before)
        h = CELL(t, h)
    return h


def test_tensors_under_an_attribute_stay_a_scan():
    g = torch.Generator().manual_seed(2)
    data = [
        Sentence(list(torch.randn(n, DIM, generator=g)), torch.randn(DIM, generator=g))
        for n in (3, 2, 4)
    ]
    with torch.no_grad():
        stats = check_map(acrobat.autobatch(over_an_instances_tensors), data, m=NET)
    assert [op for op in stats.by_op if op.startswith("scan:")], stats.by_op


def test_error_names_the_line_in_the_loop():
    def bad(x, m):
        h = torch.tanh(x[:, :DIM])
        for layer in m.layers:
            h = torch.relu(layer(h)) + x
        return h

    f = acrobat.autobatch(bad)
    xs = [torch.randn(2, DIM), torch.randn(3, DIM + 1)]
    with pytest.raises(RuntimeError, match="must match the size"):
        bad(xs[1], NET)
    line = inspect.getsourcelines(bad)[1] + 3
    with pytest.raises(
        acrobat.ShapeError, match=rf"instance 1, at .*test_loop_runs.py:{line} in bad:"
    ):
        f.map(xs, m=NET)


class Layers(nn.Module):
    """Loop bodies with ifs on what a trace may fix (LOOP_BRANCHES)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(3))
        self.residual = True
        self.mode = "tanh"


def mlp(x, m):
    for i, layer in enumerate(m.layers):  # the idiom: no activation after the last layer
        x = layer(x)
        if i < len(m.layers) - 1:
            x = torch.relu(x)
    return x.sum(0)


def flags(x, m):
    h = torch.tanh(x)
    for layer, norm in zip(m.layers, m.norms):
        y = torch.relu(layer(h))
        if m.residual and m.mode == "tanh":
            y = y + h
        elif m.mode == "sigmoid":
            y = torch.sigmoid(y) + h
        else:
            y = y * 2
        h = norm(y)
    return h.sum(0)


def by_shape(x, m):
    h = x
    for layer in m.layers:
        if h.shape[0] > 3:  # (the trace is keyed by shapes)
            h = torch.relu(layer(h))
        else:
            h = torch.tanh(layer(h))
    return h.sum(0)


BRANCHES = [mlp, flags, by_shape]
LAYERS = Layers()


@settings(deadline=None, max_examples=15)
@given(SIZES, st.integers(0, 2**16))
@pytest.mark.parametrize("fn", BRANCHES, ids=lambda fn: fn.__name__)
def test_branches_in_loops_are_one_block(fn, sizes, seed):
    with torch.no_grad():
        stats = check_map(acrobat.autobatch(fn), rows(sizes, seed), m=LAYERS)
    assert set(stats.by_op) <= {"input"} | {op for op in stats.by_op if "block:" in op}
    assert sum(n for op, (_, n) in stats.by_op.items() if op != "input") <= 2 * len(sizes)


@pytest.mark.parametrize("fn", BRANCHES, ids=lambda fn: fn.__name__)
def test_branches_gradients(fn):
    check_grads(acrobat.autobatch(fn), rows([2, 4, 1, 5], 6), LAYERS, m=LAYERS)


def test_flags_changed_between_maps():
    """A module's plain attribute the branch reads is part of its state: a new trace."""
    m = Layers()
    f = acrobat.autobatch(flags)
    data = rows([2, 4, 1], 8)
    with torch.no_grad():
        for residual, mode in [(True, "tanh"), (False, "tanh"), (False, "sigmoid"), (True, "x")]:
            m.residual, m.mode = residual, mode
            one_block(check_map(f, data, m=m), 3)


def value_branch(x, m):
    h = x
    for layer in m.layers:
        h = layer(h)
        if bool(h.sum() > 0):  # (a value read: the loop stays out of runs)
            h = torch.relu(h)
    return h.sum(0)


def assigned_flag(x, m):
    h = x
    for layer in m.layers:
        big = h.sum() > 0  # (the test reads a name the loop assigns: stays out)
        if big:
            h = torch.relu(layer(h))
    return h.sum(0)


@pytest.mark.parametrize(
    "fn, flag",
    [
        (variable_read_after, "LOOP_RUNS"),
        (bound_in_the_loop_only, "LOOP_RUNS"),
        (a_plain_list, "LOOP_RUNS"),
        (container_assigned_in_the_run, "LOOP_RUNS"),
        (appends, "LOOP_RUNS"),
        (value_branch, "LOOP_BRANCHES"),
        (assigned_flag, "LOOP_BRANCHES"),
    ],
    ids=lambda a: getattr(a, "__name__", a),
)
def test_loops_that_stay_out_of_runs(fn, flag):
    """Names the loop alone binds that are read after it, a container that is no module
    (the guard at the call), a container the run assigns, a statement no run takes, an
    if that reads a value or a name the loop assigns: the map records what it records
    with the rewrite off, with eager's results."""
    data = rows([2, 3, 1], 5)
    model = LAYERS if flag == "LOOP_BRANCHES" else NET
    with torch.no_grad():
        on = check_map(acrobat.autobatch(fn), data, m=model)
        with outlined_with(fn, **{flag: False}):
            off = check_map(acrobat.autobatch(fn), data, m=model)
    assert on.by_op == off.by_op


def multihead(x, m):
    h = torch.tanh(x)
    hs = [torch.tanh(head(h)) for head in m.layers]  # a comprehension over the layers
    return torch.cat(hs, -1).sum(0)


def stacked_heads(x, m):
    h = torch.tanh(x)
    return torch.stack([norm(layer(h)).sum(0) for layer, norm in zip(m.layers, m.norms)])


@settings(deadline=None, max_examples=15)
@given(SIZES, st.integers(0, 2**16))
@pytest.mark.parametrize("fn", [multihead, stacked_heads], ids=lambda fn: fn.__name__)
def test_comprehensions_over_layers_are_one_block(fn, sizes, seed):
    with torch.no_grad():
        one_block(check_map(acrobat.autobatch(fn), rows(sizes, seed), m=NET), len(sizes))
    check_grads(acrobat.autobatch(fn), rows(sizes, seed), NET, atol=1e-5, rtol=1e-4, m=NET)


def comprehension_over_a_list(x, m):
    h = torch.tanh(x)
    hs = [torch.tanh(head(h)) for head in m.plain]  # (a list: the guard fails)
    return torch.cat(hs, -1).sum(0)


def test_a_comprehension_over_a_list_is_mapped_as_before():
    data = rows([2, 3, 1], 5)
    with torch.no_grad():
        on = check_map(acrobat.autobatch(comprehension_over_a_list), data, m=NET)
        with outlined_with(comprehension_over_a_list, LOOP_RUNS=False):
            off = check_map(acrobat.autobatch(comprehension_over_a_list), data, m=NET)
    assert on.by_op == off.by_op


def captured(x, m):
    h = torch.tanh(m.layers[0](x))  # h is a cell on 3.11: the comprehension captures it
    h = torch.relu(m.layers[1](h)) + h
    scales = [torch.sigmoid(h * w).sum(0) for w in (x[0], x[-1])]
    return torch.stack(scales)


def test_names_a_comprehension_captures_join_runs():
    """On 3.11 a name a comprehension reads is a cell variable, not among the code's
    varnames: analysis took it for a global, and every statement reading it stayed out
    of runs (op by op)."""
    with torch.no_grad():
        stats = check_map(acrobat.autobatch(captured), rows([2, 3, 1, 3], 9), m=NET)
    assert "linear" not in stats.by_op and "relu" not in stats.by_op, stats.by_op
