"""Hoisting out of blocks: a block argument that comes back call after call (the input of
an inner RNN loop) gets its part of the block cut out, computed once per argument, and
``linear(cat([x, h]))`` is split by weight columns to expose that part."""

from __future__ import annotations

import importlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from tests.helpers import assert_close_tree, check_map

block_mod = importlib.import_module("acrobat.hoisting")


class Loop(nn.Module):
    def __init__(self, dim: int, x_first: bool):
        super().__init__()
        self.dim = dim
        self.x_first = x_first
        self.cell = nn.Linear(2 * dim, dim)
        self.proj = nn.Linear(dim, dim)


def loop_cell(m: Loop, x, r):
    parts = [x, r] if m.x_first else [r, x]
    gate = torch.sigmoid(m.proj(x))  # depends on x alone: hoisted whole
    return torch.tanh(m.cell(torch.cat(parts))) * gate + r * (1 - gate)


loop_block = acrobat.block(loop_cell)


@acrobat.autobatch
def inner_loop(inst, m: Loop):
    x, steps = inst
    r = torch.zeros(m.dim)
    outs = []
    for _ in range(steps):
        r = loop_block(m, x, r)
        outs.append(r)
    return torch.stack(outs).sum(0)


def _hoisted_batches(stats) -> int:
    return sum(count for name, (count, _) in stats.by_op.items() if name.endswith(":hoisted"))


def _hoisted_nodes(stats) -> int:
    return sum(nodes for name, (_, nodes) in stats.by_op.items() if name.endswith(":hoisted"))


@settings(max_examples=12, deadline=None)
@given(
    dim=st.integers(1, 9),
    x_first=st.booleans(),
    steps=st.lists(st.integers(1, 24), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_reused_argument_is_hoisted_and_results_match(dim, x_first, steps, seed):
    torch.manual_seed(seed)
    m = Loop(dim, x_first)
    inputs = [(torch.randn(dim), k) for k in steps]
    with torch.no_grad():
        for _ in range(2):  # the first map decides; the second runs cut from its start
            stats = check_map(inner_loop, inputs, m=m)
    # the trace counts its calls with a lazy state (instance after instance: nothing
    # here demands a value) over both maps; it cuts once SPLIT_CALLS calls have passed
    # and SPLIT_REUSE of them reused x, or at a map's start by the share so far
    calls = [i for i, k in enumerate(steps) for _ in range(k - 1)]
    hoisted, from_start = _hoisted_in_second_map(calls)
    assert _hoisted_nodes(stats) == hoisted, stats.by_op
    if from_start and hoisted:
        assert _hoisted_batches(stats) == 1, stats.by_op  # one node per instance, one batch


def _hoisted_in_second_map(calls: list) -> tuple[int, bool]:
    """(hoisted nodes in the second of two maps that call a trace with these arguments in
    this order, whether it cut from that map's start): hoisting.split_call's rule."""
    n = reused = 0
    for run in range(2):
        seen: set = set()
        if run == 1 and n >= block_mod.SPLIT_CALLS:  # decided mid-map or at this map's start
            return (len(set(calls)), True) if reused >= block_mod.SPLIT_REUSE * n else (0, False)
        for j, arg in enumerate(calls):
            n += 1
            reused += arg in seen
            seen.add(arg)
            if n >= block_mod.SPLIT_CALLS and reused >= block_mod.SPLIT_REUSE * n:
                if run == 1:  # cut from this call on
                    return len(set(calls[j:])), False
                break
    return 0, False


def test_long_loops_cut_every_instance_once():
    torch.manual_seed(0)
    m = Loop(6, True)
    inputs = [(torch.randn(6), k) for k in (30, 25, 40, 33)]
    with torch.no_grad():
        check_map(inner_loop, inputs, m=m)
        stats = check_map(inner_loop, inputs, m=m)
    assert _hoisted_nodes(stats) == 4 and _hoisted_batches(stats) == 1, stats.by_op
    # the cut program has no cat: the hoisted part carries the x columns and the bias
    names = " ".join(stats.by_op)
    assert ":rest" in names


@acrobat.autobatch
def fresh_inputs(xs, m: Loop):
    r = torch.zeros(m.dim)
    for x in xs:  # every step reads a different x: nothing comes back
        r = loop_block(m, x, r)
    return r


def test_arguments_that_never_come_back_are_not_cut():
    torch.manual_seed(1)
    m = Loop(5, False)
    inputs = [list(torch.randn(k, 5)) for k in (20, 30, 25)]
    with torch.no_grad():
        for _ in range(2):
            stats = check_map(fresh_inputs, inputs, m=m)
    assert _hoisted_nodes(stats) == 0, stats.by_op


def test_gradients_and_parameter_updates_through_the_cut():
    torch.manual_seed(2)
    m = Loop(4, True)
    ref = Loop(4, True)
    ref.load_state_dict(m.state_dict())
    inputs = [(torch.randn(4), k) for k in (40, 35, 38)]
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        out = inner_loop.map(inputs, m=m)
        loss = sum((o**2).sum() for o in out)
        opt.zero_grad()
        loss.backward()
        want = [inner_loop.eager(x, m=ref) for x in inputs]
        loss_ref = sum((o**2).sum() for o in want)
        opt_ref.zero_grad()
        loss_ref.backward()
        assert_close_tree(out, want, atol=1e-5, rtol=1e-4)
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
        opt.step()
        opt_ref.step()
    # no grad: the cut uses column views of the weights, so an in-place update is seen
    with torch.no_grad():
        check_map(inner_loop, inputs, m=m)
        m.cell.weight.mul_(0.5)
        check_map(inner_loop, inputs, m=m)


def test_training_after_an_evaluation_map_gives_the_weights_their_gradients():
    """A cut built without autograd (column views of the weights made under no_grad)
    must not be reused by a map that trains: it would cut the weights off the graph."""
    torch.manual_seed(3)
    m = Loop(4, True)
    inputs = [(torch.randn(4), k) for k in (40, 35, 38)]
    with torch.no_grad():
        check_map(inner_loop, inputs, m=m)  # evaluation first: cuts under no_grad
    out = inner_loop.map(inputs, m=m)
    sum((o**2).sum() for o in out).backward()
    got = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    want = [inner_loop.eager(x, m=m) for x in inputs]
    sum((o**2).sum() for o in want).backward()
    for g, p in zip(got, m.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)


def test_a_map_with_cut_traces_frees_its_graph():
    """The cut's memo (argument -> hoisted outputs) lives on the trace, which outlives the
    map: it is cleared when the map ends, so nothing of the run stays alive."""
    import weakref

    from acrobat import graph

    torch.manual_seed(5)
    m = Loop(4, True)
    inputs = [(torch.randn(4), 40) for _ in range(3)]
    runtimes = []
    original = graph.Runtime.__init__

    def tracking(self, *args):
        original(self, *args)
        runtimes.append(weakref.ref(self))

    graph.Runtime.__init__ = tracking
    try:
        with torch.no_grad():
            for _ in range(2):
                stats = check_map(inner_loop, inputs, m=m)
    finally:
        graph.Runtime.__init__ = original
    assert _hoisted_nodes(stats) == 3
    assert runtimes and all(r() is None for r in runtimes)


class Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.enc = nn.Linear(dim, dim)
        self.dec = nn.Linear(dim, dim, bias=False)
        self.score = nn.Linear(dim, 1, bias=False)
        self.cell = nn.GRUCell(dim, dim)


@acrobat.autobatch
def greedy_decode(inst, m: Attention):
    """Attention over a sentence's states at every step, the states' projection written
    inside the loop (as often done), and a stop read from the values each step."""
    states, limit = inst
    h = states.mean(0)
    outs = []
    for _ in range(limit):
        scores = m.score(torch.tanh(m.enc(states) + m.dec(h))).squeeze(-1)
        h = m.cell(torch.softmax(scores, 0) @ states, h)
        outs.append(h)
        if h.sum().item() > 2.0:
            break
    return torch.stack(outs)


def test_instances_that_take_turns_are_cut_and_the_cut_keeps_their_sizes_in_one_batch():
    """Every step reads a value, so instances take turns: a map's first calls are every
    instance's first step (no reuse yet: the first SPLIT_CALLS calls used to decide
    against the cut for good). The sentences have many lengths, one padding family of
    traces: all of them cut, and the
    hoisted parts and the rests of every length run as one padded batch each (a batch
    per length and step made the cut map 2.5x slower than the uncut one)."""
    torch.manual_seed(7)
    m = Attention(8)
    lengths = [3, 5, 9, 4, 12, 7, 5, 3, 10, 6, 8, 11] * 3
    inputs = [(torch.randn(n, 8), 6) for n in lengths]
    with torch.no_grad():
        check_map(greedy_decode, inputs, m=m)  # decides the cut
        stats = check_map(greedy_decode, inputs, m=m)
    assert _hoisted_nodes(stats) == len(inputs), stats.by_op
    assert _hoisted_batches(stats) == 1, stats.by_op
    rests = [v for name, v in stats.by_op.items() if name.endswith(":rest")]
    steps = max(len(out) for out in greedy_decode.map(inputs, m=m))
    assert rests and sum(b for b, _ in rests) <= steps, stats.by_op


@acrobat.autobatch
def decode_with_table(inst, m: Attention):
    states, limit = inst
    h = states.mean(0) + m.table.weight[1]
    outs = []
    for _ in range(limit):
        # m.table.weight[2]: a parameter-only value, hoisted into the trace; with
        # gradients on it carries the map's autograd graph, so every map traces again
        scores = m.score(torch.tanh(m.enc(states) + m.dec(h) + m.table.weight[2])).squeeze(-1)
        h = m.cell(torch.softmax(scores, 0) @ states, h)
        outs.append(h)
        if h.sum().item() > 2.0:  # (a read: the loop is not one scan node)
            break
    return torch.stack(outs)


def test_a_cut_carries_over_to_the_traces_made_again_every_training_map():
    """Training maps retrace a block whose hoisted values carry autograd: the new trace
    keeps the cut its predecessor decided (it does not watch its calls anew), and the
    gradients through the cut equal the eager loop's."""
    torch.manual_seed(8)
    m = Attention(6)
    m.table = nn.Embedding(4, 6)
    inputs = [(torch.randn(n, 6), 5) for n in [4, 7, 4, 9, 7, 5] * 4]
    for round_ in range(3):
        got, stats = decode_with_table.map(inputs, m=m, stats=True)
        m.zero_grad()
        sum((g**2).sum() for g in got).backward()
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        want = [decode_with_table.eager(x, m=m) for x in inputs]
        assert_close_tree(got, want, atol=1e-5, rtol=1e-4)
        sum((w**2).sum() for w in want).backward()
        for g, p in zip(grads, m.parameters()):
            torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)
        if round_ > 0:
            assert _hoisted_nodes(stats) == len(inputs), (round_, stats.by_op)
            assert _hoisted_batches(stats) == 1, (round_, stats.by_op)
