"""A model held in a global (analysis.GLOBAL_MODULES).

Script and notebook code often makes the model once at the top (``net = Net()``) and
reads it from plain functions. The analysis took a global it could not prove constant
(anything but torch's own objects, functions and immutable constants) as a reason to
leave a statement alone, so every statement reading ``net`` ran op by op: no automatic
block, no region, a node per op per instance. A global holding an ``nn.Module`` is now
read as a module argument is: a trace that reads it records the module's state and is
traced again when a layer is replaced or appended, a parameter swapped, the mode
changed, or the global rebound (tests below, against the eager loop)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from tests.helpers import check_grads, check_map, outlined_with, random_rows

DIM = 6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(0.5)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.out = nn.Linear(DIM, 3)


torch.manual_seed(0)
net = Net().eval()


def cell(h):  # straight-line, reading the global model: an automatic block
    return torch.relu(net.mid(h)) + h


def encode(x):
    h = torch.tanh(net.inp(x))
    if x.shape[0] > 2:  # control flow: the runs around it are regions
        h = cell(h)
    for layer in net.layers:  # (a loop over the global's layers joins its run)
        h = torch.sigmoid(layer(h)) * h
    return net.out(net.drop(h).mean(0))


def rows(sizes: list[int], seed: int) -> list:
    return random_rows(sizes, seed, DIM)


@settings(deadline=None, max_examples=15)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=7), st.integers(0, 2**16))
def test_a_global_model_is_read_by_blocks_and_regions(sizes, seed):
    with torch.no_grad():
        stats = check_map(acrobat.autobatch(encode), rows(sizes, seed))
    assert set(stats.by_op) <= {"input"} | {op for op in stats.by_op if "block:" in op}, (
        stats.by_op
    )


def test_fewer_nodes_than_with_the_global_left_alone(monkeypatch):
    data = rows([3, 1, 4, 2], 1)
    with torch.no_grad():
        on = check_map(acrobat.autobatch(encode), data)
        monkeypatch.setattr(acrobat.analysis, "_VERDICTS", {})
        with outlined_with(encode, GLOBAL_MODULES=False):
            off = check_map(acrobat.autobatch(encode), data)
    assert "linear" in off.by_op and "linear" not in on.by_op, (on.by_op, off.by_op)
    assert on.nodes < off.nodes


def test_gradients():
    check_grads(acrobat.autobatch(encode), rows([3, 1, 4, 2], 2), net)


def test_changes_to_the_global_between_maps():
    """Each change makes the next map trace again (its results equal eager's)."""
    global net
    saved = net
    f = acrobat.autobatch(encode)
    data = rows([3, 1, 4], 3)
    changes = [
        lambda: setattr(net, "mid", nn.Linear(DIM, DIM)),  # a layer replaced
        lambda: net.layers.append(nn.Linear(DIM, DIM)),  # a layer appended
        lambda: setattr(net.out, "weight", nn.Parameter(torch.randn(3, DIM))),
        lambda: net.train(),  # dropout on: compared with the seed fixed below
    ]
    try:
        with torch.no_grad():
            for change in [lambda: None, *changes]:
                change()
                if net.training:
                    torch.manual_seed(5)
                    got = f.map(data)
                    assert all(not torch.equal(a, b) for a, b in zip(got, f.map(data)))
                    net.eval()
                check_map(f, data)
            net = Net().eval()  # the global rebound
            check_map(f, data)
    finally:
        net = saved


@pytest.mark.parametrize("flag", [True, False])
def test_straight_line_verdict_follows_the_flag(monkeypatch, flag):
    monkeypatch.setattr(acrobat.analysis, "GLOBAL_MODULES", flag)
    monkeypatch.setattr(acrobat.analysis, "_VERDICTS", {})
    assert acrobat.analysis.straight_line(cell) is flag


class Tree:
    def __init__(self, word: int, kids: list):
        self.word, self.kids = word, kids


class TreeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, DIM)
        self.cell = nn.Linear(2 * DIM, DIM)
        self.out = nn.Linear(DIM, 3)

    def encode(self, t):
        if not t.kids:
            return torch.tanh(self.emb(torch.tensor(t.word)))
        left, right = self.encode(t.kids[0]), self.encode(t.kids[1])
        return torch.tanh(self.cell(torch.cat([left, right])))

    def forward(self, t):  # (straight-line, calling a method with control flow)
        return self.encode(t)


tree_net = TreeNet().eval()


def global_method(t):
    h = tree_net.encode(t)  # (control flow: not in the run after it)
    return tree_net.out(h) * 2


def global_forward(t):
    h = tree_net(t)
    return tree_net.out(h) * 2


def trees(seed: int, count: int) -> list:
    rng = torch.Generator().manual_seed(seed)

    def grow(depth):
        if depth == 0 or torch.rand((), generator=rng) < 0.3:
            return Tree(int(torch.randint(10, (), generator=rng)), [])
        return Tree(0, [grow(depth - 1), grow(depth - 1)])

    return [grow(3) for _ in range(count)]


@pytest.mark.parametrize("fn", [global_method, global_forward])
def test_a_global_models_methods_with_control_flow_stay_out_of_runs(fn):
    """``tree_net.encode(t)`` recurses over the tree: inside a region its trace would be
    keyed by the tree (a trace per call, the region run as written, the head op by op).
    Known as a control call, it stays out; the head after it is one region."""
    data = trees(2, 6)
    with torch.no_grad():
        stats = check_map(acrobat.autobatch(fn), data)
    heads = [v for op, v in stats.by_op.items() if op.startswith(f"block:{fn.__name__} ")]
    assert heads == [[1, 6]], stats.by_op
    assert "linear" not in stats.by_op and "mul" not in stats.by_op
