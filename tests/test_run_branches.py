"""Ifs between the statements of a run join it (analysis.RUN_BRANCHES).

``h = self.fc1(x); if self.use_norm: h = self.norm(h); h = torch.relu(h)`` was three
pieces: the run before the if, the if's branch op by op, the run after it (a batch per
length for each lone op). Now the if is part of the run, so the region runs it as
written. A test that reads nothing the run assigns is evaluated at the region's call,
as the source wrote it, and the region is given its truth: its trace is keyed by the
branch taken. A test on what the run computed is read inside the trace when a trace
fixes it (shapes, ``is None``, a module's flag). Either way the test may read only what
is the same for every instance or keys a trace anyway (a module's flags, shapes,
``is None``): a per-instance bool or a tree node's attribute keeps the if out, where the
run after it batches across both branches. These tests hold the forms to the eager
results, values and gradients, and check the ifs that must stay out do."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import analysis
from tests.helpers import check_grads, check_map, outlined_with, random_rows

DIM = 6


class Net(nn.Module):
    def __init__(self, use_norm: bool = True, act: str = "relu"):
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.use_norm = use_norm
        self.act = act
        self.extra = None  # (a layer a config may add)

    def forward(self, x, mask=None):
        h = self.fc1(x)
        if self.use_norm:
            h = self.norm(h)
        h = torch.relu(h)
        if mask is not None:
            h = h * mask
        return self.fc2(h).sum(0)


def activation(x, m):
    h = m.fc1(x) * 2
    if m.act == "relu":
        h = torch.relu(h)
    elif m.act == "tanh":
        h = torch.tanh(h)
    else:
        h = torch.sigmoid(h)
    return m.fc2(h).sum(0)


def both_branches(x, m):
    h = torch.tanh(m.fc1(x))
    if m.use_norm:
        y = m.norm(h)
    else:
        y = h * 2
    return (m.fc2(y) + h).sum(0)


def temporaries(x, m):
    h = m.fc1(x)
    if m.use_norm:  # (mu only in the branch, read nowhere after it)
        mu = h.mean(-1, keepdim=True)
        h = (h - mu) * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + 1e-5)
    return torch.tanh(m.fc2(h)).sum(0)


def on_shape(x, m):
    h = torch.tanh(m.fc1(x))
    if h.shape[0] > 2:  # (per instance: read inside the trace, keyed by shapes)
        h = h * 2
    if h.dim() == 2:
        h = h.sum(0)
    return torch.sigmoid(m.fc2(h))


def per_instance(pair, m):
    x, flag = pair
    h = torch.tanh(m.fc1(x))
    if flag:  # (a Python bool per instance: the if stays out of the runs)
        h = m.fc2(h)
    return (h * 3).sum(0)


def kept_state(x, h, m):
    y = m.fc1(x) * 2
    if m.use_norm:  # (h unread before: a branch not taken returns the caller's h)
        h = m.norm(y)
    return torch.tanh(h + y).sum(0)


def optional_layer(x, m):
    h = torch.tanh(m.fc1(x))
    if m.extra is not None:  # (never taken here: m.extra.weight is never read)
        h = m.extra.weight @ h.T
        h = h.T
    return m.fc2(h).sum(0)


FORMS = [activation, both_branches, temporaries, on_shape, kept_state, optional_layer]


def rows(sizes: list[int], seed: int) -> list:
    return random_rows(sizes, seed, DIM)


def blocks(stats) -> dict:
    return {op: v for op, v in stats.by_op.items() if op.startswith("block:")}


def one_block(stats, instances: int) -> None:
    """The map recorded one block op, once per instance, and nothing else but inputs."""
    assert set(stats.by_op) <= {"input"} | set(blocks(stats)), stats.by_op
    (counts,) = blocks(stats).values()
    assert counts[1] == instances, stats.by_op


torch.manual_seed(0)
NETS = [Net(True, "relu"), Net(False, "tanh"), Net(True, "gelu")]
SIZES = st.lists(st.integers(1, 5), min_size=1, max_size=6)


def call(fn, sizes, seed, m):
    data = rows(sizes, seed)
    if fn is kept_state:
        return check_map(acrobat.autobatch(fn), data, h=torch.randn(DIM), m=m)
    return check_map(acrobat.autobatch(fn), data, m=m)


@settings(deadline=None, max_examples=10)
@given(SIZES, st.integers(0, 2**16), st.integers(0, 2))
@pytest.mark.parametrize("fn", FORMS, ids=lambda fn: fn.__name__)
def test_forms_are_one_block(fn, sizes, seed, net):
    with torch.no_grad():
        stats = call(fn, sizes, seed, NETS[net])
    one_block(stats, len(sizes))


@pytest.mark.parametrize("fn", FORMS, ids=lambda fn: fn.__name__)
def test_forms_with_the_flag_off_record_more(fn):
    with torch.no_grad():
        on = call(fn, [2, 3, 2], 1, NETS[0])
        with outlined_with(fn, RUN_BRANCHES=False):
            off = call(fn, [2, 3, 2], 1, NETS[0])
    assert on.nodes < off.nodes, (on.by_op, off.by_op)


@settings(deadline=None, max_examples=10)
@given(SIZES, st.integers(0, 2**16), st.booleans(), st.booleans())
def test_a_modules_forward(sizes, seed, use_norm, masked):
    net = Net(use_norm)
    data = rows(sizes, seed)
    mask = (torch.rand(DIM) > 0.5).float() if masked else None
    with torch.no_grad():
        one_block(check_map(acrobat.autobatch(net), data, mask=mask), len(sizes))


@settings(deadline=None, max_examples=10)
@given(st.lists(st.tuples(st.integers(1, 4), st.booleans()), min_size=1, max_size=8))
def test_a_per_instance_test_stays_out(cases):
    """Joined, the run after the if would be a trace per branch: two batches where one
    serves both branches now."""
    data = [(x, flag) for x, (_, flag) in zip(rows([n for n, _ in cases], 3), cases)]
    with torch.no_grad():
        stats = check_map(acrobat.autobatch(per_instance), data, m=NETS[0])
    assert stats.nodes > 2 * len(cases)  # (inputs and the one block each, and the rest)


def tensor_test(pair, m):
    x, gate = pair
    h = torch.tanh(m.fc1(x))
    if gate:  # (a tensor: its value read at the call, as eager reads it here)
        h = m.fc2(h)
    return (h * 3).sum(0)


def test_a_test_reading_a_tensor_value():
    data = [(x, torch.tensor(i % 2 == 0)) for i, x in enumerate(rows([2, 3, 1, 2], 5))]
    with torch.no_grad():
        stats = check_map(acrobat.autobatch(tensor_test), data, m=NETS[0])
    assert stats.suspensions > 0


@pytest.mark.parametrize("fn", [both_branches, activation, kept_state])
def test_gradients(fn):
    torch.manual_seed(5)  # (the weights alike whatever ran before; float32 sums: atol 1e-5)
    net = Net(True, "tanh")
    kwargs = {"h": torch.randn(DIM)} if fn is kept_state else {}
    f = acrobat.autobatch(fn)
    stats = check_grads(f, rows([2, 4, 1], 3), net, atol=1e-5, m=net, **kwargs)
    one_block(stats, 3)


def test_flags_changed_between_maps():
    """The test evaluated at the call keys the trace by its truth; a module's flag read
    inside the trace (the elif) is part of the module's state a trace checks."""
    net = Net(True, "relu")
    data = rows([3, 1, 4], 7)
    with torch.no_grad():
        for use_norm, act in [(True, "relu"), (False, "relu"), (False, "tanh"), (True, "x")]:
            net.use_norm, net.act = use_norm, act
            one_block(check_map(acrobat.autobatch(net), data), 3)
            one_block(check_map(acrobat.autobatch(activation), data, m=net), 3)


def unbound_after(x, m):
    h = m.fc1(x) * 2
    if m.use_norm:  # (extra is unbound after it when not taken: the if stays out)
        extra = m.norm(h)
    h = torch.tanh(h)
    if m.use_norm:
        h = h + extra
    return h.sum(0)


def object_branch(pair, m):
    x, node = pair
    h = torch.tanh(m.fc1(x))
    if node.scale is not None:  # (node.bias is read only where it exists)
        h = h * node.scale + node.bias
    return h.sum(0)


class Node:
    def __init__(self, scale):
        self.scale = scale
        if scale is not None:
            self.bias = torch.full((DIM,), scale)


def value_branch(x, m):
    h = torch.tanh(m.fc1(x))
    if h.sum() > 0:  # (a value: the test ends the run)
        h = h * 2
    return h.sum(0)


def test_ifs_that_stay_out_are_right():
    data = rows([2, 3, 1], 11)
    with torch.no_grad():
        for use_norm in (True, False):
            stats = check_map(acrobat.autobatch(unbound_after), data, m=Net(use_norm))
            assert stats.nodes > 2 * len(data)  # (the ifs ended their runs: not one block)
        pairs = [(x, Node(s)) for x, s in zip(data, [None, 0.5, 2.0])]
        check_map(acrobat.autobatch(object_branch), pairs, m=NETS[0])
        stats = check_map(acrobat.autobatch(value_branch), data, m=NETS[0])
        assert stats.suspensions > 0


def indexed_in_loop(x, m, i):
    h = torch.tanh(x)
    for layer in m.layers:
        h = layer(h)
        if len(m.ws) > 1:  # (never taken: m.ws[i] must not be read)
            h = h @ m.ws[i]
    return h.sum(0)


def test_a_loop_branch_reads_nothing_it_does_not_take():
    """An if's branch in a loop over layers (LOOP_BRANCHES) is read only where taken:
    ``m.ws[i]`` was read at the region's call, an IndexError eager never raises."""
    m = nn.Module()
    m.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
    m.ws = nn.ParameterList([nn.Parameter(torch.randn(DIM, DIM))])
    with torch.no_grad():
        check_map(acrobat.autobatch(indexed_in_loop), rows([2, 1, 3], 2), m=m, i=1)


def test_the_rules():
    import ast

    rw = analysis._Rewriter(both_branches, {"x", "m", "h", "y", "n", "node"})
    rw.callers = {"m"}  # (the locals the function calls through: m.fc1(x))

    def call_test(src, varying=()):
        return rw._call_test(ast.parse(src, mode="eval").body, set(varying))

    def fixed_test(src, varying=()):
        return rw._fixed_test(ast.parse(src, mode="eval").body, set(varying))

    assert call_test("m.flag and len(m.layers) > 2")
    assert call_test("x.dim() == 3 or x is None")
    assert call_test("not isinstance(x, torch.Tensor) or hasattr(m, 'norm')")
    assert call_test("x.shape[0] > 1 and m.training")
    assert not call_test("torch.is_grad_enabled()")  # (no call but the builtins above)
    assert not call_test("h.shape[0] > 1", ["h"])  # (assigned by the run: not at the call)
    assert not call_test("x.sum() > 0")  # (a value)
    assert not call_test("n > 3")  # (a local: a value per instance, maybe)
    assert not call_test("node.is_leaf")  # (a record's attribute: per instance)
    assert not call_test("len(node.children) > 1")
    assert fixed_test("h.shape[0] > 1", ["h"])
    assert fixed_test("h is not None", ["h"])
    assert fixed_test("m.act == 'relu'")
    assert fixed_test("len(m.layers) > 1")
    assert not fixed_test("n > 3")  # (a bare local: a trace per value)
    assert not fixed_test("m.a and m.b")  # (no short circuits inside a trace)
    assert not fixed_test("h.sum() > 0", ["h"])
    assert not fixed_test("h.flag", ["h"])
    assert not fixed_test("x.act == 'relu'")  # (an object's, not a module's)
    assert not fixed_test("isinstance(h, torch.Tensor)", ["h"])


def restarted(x, m, steps):
    out = torch.ones(DIM)
    for _ in range(steps):
        h = torch.zeros(DIM)
        if x.shape[0] > 2:  # (not taken: this step computes nothing per instance)
            h = h + x.sum(0)
        out = out * 0.5 + torch.tanh(h + out)
    return out


def test_calls_that_compute_nothing_per_instance_leave_the_region_on():
    """Where a branch is not taken, a region may read none of its lazy inputs (the
    state still the constant it started as): that call runs as written, and the region
    stays a block for the calls that do compute (it was run as written for good)."""
    data = rows([1, 3, 2, 4, 3], 8)
    with torch.no_grad():
        for _ in range(12):  # (more than IDLE_CALLS calls as written over the maps)
            stats = check_map(acrobat.autobatch(restarted), data, m=NETS[0], steps=3)
            (counts,) = blocks(stats).values()
            assert counts[1] == 3 * 3  # (3 steps of the 3 instances of more than 2 rows)


def pooled(x, hs, m):
    h = torch.tanh(m.fc1(x))
    if m.use_norm:  # (not taken: hs may be empty)
        h = h + torch.stack(hs).sum(0)
    return (h * 2).sum(0)


def pooled_pair(pair, m):
    return pooled(pair[0], pair[1], m)


def test_a_list_stacked_in_a_branch_not_taken_may_be_empty():
    """A list the run only stacks is given to the region (padded by length); an empty one
    ran the region as written, op by op."""
    data = rows([2, 3, 1], 4)
    with torch.no_grad():
        stats = check_map(acrobat.autobatch(pooled_pair), [(x, []) for x in data], m=Net(False))
        one_block(stats, 3)
        stacked = [(x, [torch.randn(DIM)] * k) for x, k in zip(data, [1, 2, 2])]
        check_map(acrobat.autobatch(pooled_pair), stacked, m=Net(True))


def masked_pair(pair, m):
    x, mask = pair  # (a mask or None per instance)
    h = m.fc1(x) * 2
    if mask is not None:
        h = h * mask
    return torch.tanh(m.fc2(h)).sum(0)


@settings(deadline=None, max_examples=10)
@given(st.lists(st.tuples(st.integers(1, 4), st.booleans()), min_size=1, max_size=8))
def test_instances_with_and_without_a_mask(cases):
    """An instance given as ``(x, mask or None)``: a tuple holding a None was given to the
    region as a container (run as written, op by op) where one of tensors was a block."""
    g = torch.Generator().manual_seed(1)
    data = [
        (x, (torch.rand(DIM, generator=g) > 0.5).float() if masked else None)
        for x, (_, masked) in zip(rows([n for n, _ in cases], 2), cases)
    ]
    with torch.no_grad():
        one_block(check_map(acrobat.autobatch(masked_pair), data, m=NETS[0]), len(cases))
