"""Calls of functions with control flow among straight lines (analysis.CONTROL_CALLERS): a
module's ``forward`` that only calls ``self.encode(tree)`` and a head was taken for a
straight-line block, and an encoder's recursive calls joined the run of the tensor lines
after them, so both regions were given the tree objects and ran as written, op by op
(about the eager loop's time). Now the caller is searched as a function with control flow
and a call of one is left out of runs: each cell is one node."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import analysis
from tests.helpers import check_grads, check_map, outlined_with

DIM, WORDS = 8, 20


def block_nodes(stats) -> int:
    """Nodes recorded by blocks (automatic ones and regions)."""
    return sum(n for k, (_, n) in stats.by_op.items() if k.startswith("block:"))


def check_cells(f, data, model, cells: int, absent: tuple, atol=1e-5, rtol=1e-5):
    """map == eager without gradients, ``cells`` block nodes and none of the ops
    ``absent`` recorded on their own; then the gradients as eager's. Returns the stats."""
    with torch.no_grad():
        stats = check_map(f, data, model=model)
    assert block_nodes(stats) == cells, stats.by_op
    assert not any(op in stats.by_op for op in absent), stats.by_op
    check_grads(f, data, model, atol=atol, rtol=rtol, model=model)
    return stats


@dataclass
class Node:
    word: int
    kids: list = field(default_factory=list)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(WORDS, DIM)
        self.mix = nn.Linear(2 * DIM, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 3)

    def encode(self, node):
        if not node.kids:
            return torch.tanh(self.emb(torch.tensor(node.word)))
        left, right = self.encode(node.kids[0]), self.encode(node.kids[1])
        return torch.tanh(self.mix(torch.cat([left, right])))

    def forward(self, node):
        h = self.encode(node)
        return self.head(torch.relu(self.proj(h)))


def encode_tree(model, node):
    """The same recursion as a function of its own."""
    if not node.kids:
        return torch.tanh(model.emb(torch.tensor(node.word)))
    left = encode_tree(model, node.kids[0])
    right = encode_tree(model, node.kids[1])
    return torch.tanh(model.mix(torch.cat([left, right])))


def classify_tree(model, node):
    h = encode_tree(model, node)
    return model.head(torch.relu(model.proj(h)))


@acrobat.autobatch
def by_method(tree, model):
    return model(tree)


@acrobat.autobatch
def by_function(tree, model):
    return classify_tree(model, tree)


def trees(depth: int):
    leaf = st.builds(Node, st.integers(0, WORDS - 1))
    if depth == 0:
        return leaf
    sub = trees(depth - 1)
    return st.one_of(leaf, st.builds(Node, st.just(0), st.lists(sub, min_size=2, max_size=2)))


def _internal(node) -> int:
    return 0 if not node.kids else 1 + sum(_internal(k) for k in node.kids)


@settings(max_examples=15, deadline=None)
@given(forest=st.lists(trees(4), min_size=1, max_size=6), how=st.sampled_from(["method", "fn"]))
def test_a_recursive_encoder_called_from_straight_lines_batches_its_cells(forest, how):
    torch.manual_seed(0)
    model = Encoder()
    f = by_method if how == "method" else by_function
    # each tree's mix cell one node, the head's lines one node per tree
    cells = sum(map(_internal, forest)) + len(forest)
    check_cells(f, forest, model, cells, ("linear", "cat"))


def head_of_argument(tree, model):
    """The recursion called as a method of a model passed in (unknown to the analysis of
    this function), then a head of tensor lines."""
    h = model.encode(tree)
    z = model.head(torch.relu(model.proj(h))) * 2
    return torch.log_softmax(z, -1)


class FlatEncoder(Encoder):
    """The same method name, straight-line: ``encode`` is a tensor op here."""

    def encode(self, x):
        return torch.tanh(self.proj(x))


@settings(max_examples=15, deadline=None)
@given(forest=st.lists(trees(4), min_size=1, max_size=6))
def test_a_method_with_control_flow_of_a_model_passed_in_stays_out_of_runs(forest):
    """``h = model.encode(tree)`` with ``model`` an argument: the analysis of the function
    does not know its class, so the call joined the head's run, whose trace recursed over
    the tree (the run as written: the head op by op). The map's module classes name their
    methods with control flow (analysis._MAP_FLOW): the call stays out, the head is one
    region per tree; with that off, the head's ops are recorded one by one."""
    torch.manual_seed(0)
    model = Encoder()
    f = acrobat.autobatch(head_of_argument)
    cells = sum(map(_internal, forest)) + len(forest)
    stats = check_cells(f, forest, model, cells, ("linear", "relu", "log_softmax"))
    assert stats.by_op[next(k for k in stats.by_op if "head_of_argument" in k)][1] == len(forest)
    with outlined_with(head_of_argument, ARG_METHODS=False), torch.no_grad():
        off = check_map(acrobat.autobatch(head_of_argument), forest, model=model)
    assert "log_softmax" in off.by_op and "linear" in off.by_op, off.by_op


def test_a_straight_line_method_of_the_same_name_joins_the_run():
    """The names come from the classes of the map's models: where ``encode`` is
    straight-line (another model class, the same function), it joins the head's run, one
    region per instance; the outline of each map is its own (keyed by the names it calls),
    and the recursive model's map after it keeps its call out."""
    torch.manual_seed(0)
    flat = FlatEncoder()
    xs = list(torch.randn(5, DIM).unbind(0))
    f = acrobat.autobatch(head_of_argument)
    with torch.no_grad():
        stats = check_map(f, xs, model=flat)
    blocks = {k: v for k, v in stats.by_op.items() if k != "input"}
    assert [v for k, v in blocks.items() if "head_of_argument" in k] == [[1, 5]], stats.by_op
    assert len(blocks) == 1, stats.by_op
    forest = [Node(1, [Node(2), Node(3)]), Node(4)]
    with torch.no_grad():
        stats = check_map(f, forest, model=Encoder())
    assert "linear" not in stats.by_op and "log_softmax" not in stats.by_op, stats.by_op


class MeanOfKids(nn.Module):
    """A tree module recursing through ``self(child)`` inside a comprehension."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(WORDS, DIM)
        self.comb = nn.Linear(2 * DIM, DIM)

    def forward(self, node):
        x = self.emb(torch.tensor(node.word))
        if not node.kids:
            return torch.relu(x)
        m = torch.stack([self(k) for k in node.kids]).mean(0)
        return torch.relu(self.comb(torch.cat([x, m])))


@acrobat.autobatch
def mean_of_kids(tree, model):
    return model(tree)


@settings(max_examples=15, deadline=None)
@given(forest=st.lists(trees(4), min_size=1, max_size=6))
def test_a_module_recursing_through_self_call_batches_its_cells(forest):
    """``self(child)`` is the module's forward, with control flow: its statement stays out
    of the run after it (which was given the tree and ran op by op, slower than eager)."""
    torch.manual_seed(0)
    model = MeanOfKids()
    check_cells(mean_of_kids, forest, model, sum(map(_internal, forest)), ("linear", "cat"))


class DictState(nn.Module):
    """A recurrence whose state is a dict of tensors, rebuilt at each step."""

    def __init__(self):
        super().__init__()
        self.wx = nn.Linear(DIM, DIM)
        self.wh = nn.Linear(DIM, DIM)

    def forward(self, xs):
        st = {"h": torch.zeros(DIM), "c": torch.zeros(DIM)}
        for x in xs:
            st = {"h": torch.tanh(self.wx(x) + self.wh(st["h"])), "c": st["c"] * 0.5 + st["h"]}
        return st["h"] * st["c"]


@acrobat.autobatch
def run_dict_state(xs, model):
    return model(xs)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=6), seed=st.integers(0, 999))
def test_a_dict_state_loop_is_a_region_per_step(lengths, seed):
    """``st["h"]`` (a dict item by a constant key) is read at the region's call, and the
    loop, whose state is a dict (not a tensor), is left to run its body's region per step
    instead of being one scan that ran every step op by op: one node per step."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [[torch.randn(DIM, generator=gen) for _ in range(n)] for n in lengths]
    torch.manual_seed(seed)
    model = DictState()
    with torch.no_grad():
        stats = check_map(run_dict_state, seqs, model=model)
    cells = [c for k, c in stats.by_op.items() if k.startswith("block:")]
    # (the first step, given the zeros state, has no lazy argument but the element)
    assert cells and cells[0][1] == sum(lengths), stats.by_op
    assert cells[0][0] == max(lengths)
    assert "linear" not in stats.by_op and "tanh" not in stats.by_op
    check_grads(run_dict_state, seqs, model, atol=1e-5, model=model)


class EarlyExit(nn.Module):
    def __init__(self):
        super().__init__()
        self.wx = nn.Linear(DIM, DIM)
        self.wh = nn.Linear(DIM, DIM)
        self.stop = nn.Linear(DIM, 1)

    def forward(self, xs):
        h = torch.zeros(DIM)
        for x in xs:
            h = torch.tanh(self.wx(x) + self.wh(h))
            if torch.sigmoid(self.stop(h)).item() > 0.55:
                break
        return h


@acrobat.autobatch
def run_early_exit(xs, model):
    return model(xs)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 8), min_size=1, max_size=6), seed=st.integers(0, 999))
def test_an_if_reading_a_value_splits_its_tensor_work_into_the_run(lengths, seed):
    """``if torch.sigmoid(stop(h)).item() > 0.55:``: the tensor work of the test joins the
    run before it (SPLIT_DEMANDS), one node per step where it was three."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [[torch.randn(DIM, generator=gen) for _ in range(n)] for n in lengths]
    torch.manual_seed(seed)
    model = EarlyExit()
    with torch.no_grad():
        stats = check_map(run_early_exit, seqs, model=model)
    cells = [c for k, c in stats.by_op.items() if k.startswith("block:")]
    assert len(cells) == 1 and stats.suspensions == cells[0][1], stats.by_op
    assert not any(op in stats.by_op for op in ("linear", "sigmoid", "tanh"))
    check_grads(run_early_exit, seqs, model, atol=1e-5, model=model)


class TopTwo(nn.Module):
    """Straight lines that read a value: ``.tolist()`` (seen in the source) and ``int(t)``
    (a builtin, seen when the trace reads it)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.w = nn.Linear(DIM, DIM)
        self.s = nn.Linear(DIM, 1)

    def forward(self, xs):
        if self.how == "tolist":
            return self.by_tolist(xs)
        return self.by_int(xs)

    def by_tolist(self, xs):
        hs = [torch.tanh(self.w(x)) for x in xs]
        best = torch.topk(torch.cat([self.s(h) for h in hs]), 2).indices.tolist()
        return hs[best[0]] + hs[best[1]]

    def by_int(self, xs):
        hs = [torch.tanh(self.w(x)) for x in xs]
        k = int(torch.argmax(torch.cat([self.s(h) for h in hs])))
        return torch.relu(hs[k] * 2.0) - hs[0]


@acrobat.autobatch
def top_two(xs, model):
    return model(xs)


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 7), min_size=1, max_size=6),
    seed=st.integers(0, 999),
    how=st.sampled_from(["tolist", "int"]),
)
def test_straight_lines_that_read_a_value_are_outlined(lengths, seed, how):
    """A straight-line function that reads a value cannot be one traced block: it ran as
    written, op by op (slower than the eager loop). ``.tolist()`` / ``.item()`` in its
    source make it a function with control flow (outlined: the comprehension a scan);
    a builtin read (``int(t)``) found when its trace fails switches it to its outlined
    body from then on (analysis.AUTO_OUTLINE)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [[torch.randn(DIM, generator=gen) for _ in range(n)] for n in lengths]
    torch.manual_seed(seed)
    model = TopTwo(how)
    with torch.no_grad():
        check_map(top_two, seqs, model=model)  # (the first map finds an int read)
        stats = check_map(top_two, seqs, model=model)
    # both comprehensions one scan node per instance, the one inside torch.cat(...) too
    # (SPLIT_LISTS: ``_acrobat_list_k = [...]`` split off before the call)
    scans = [c for k, c in stats.by_op.items() if k.startswith("scan:")]
    assert [n for _, n in scans] == [len(seqs)] * 2, stats.by_op
    assert "tanh" not in stats.by_op and "linear" not in stats.by_op
    check_grads(top_two, seqs, model, atol=1e-5, model=model)


@dataclass
class VecNode:
    x: torch.Tensor
    kids: list = field(default_factory=list)


def vec_trees(gen, depth: int):
    kids = [] if depth == 0 or torch.rand((), generator=gen) < 0.4 else [0, 1]
    return VecNode(torch.randn(DIM, generator=gen), [vec_trees(gen, depth - 1) for _ in kids])


class GRUTree(nn.Module):
    """Children summed in a loop, the cell on the node's ``x.unsqueeze(0)``."""

    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(DIM, DIM)

    def forward(self, node):
        h = torch.zeros(1, DIM)
        for k in node.kids:
            h = h + self(k)
        return self.cell(node.x.unsqueeze(0), h)


class PostOrder(nn.Module):
    """A tree walked with an explicit stack, states kept in a dict and on the nodes."""

    def __init__(self):
        super().__init__()
        self.leaf = nn.Linear(DIM, DIM)
        self.comb = nn.Linear(3 * DIM, DIM)

    def forward(self, root):
        memo = {}
        stack = [(root, False)]
        while stack:
            node, done = stack.pop()
            if not node.kids:
                memo[id(node)] = torch.tanh(self.leaf(node.x))
            elif done:
                left, right = memo[id(node.kids[0])], memo[id(node.kids[1])]
                node.h = torch.tanh(self.comb(torch.cat([node.x, left, right])))
                memo[id(node)] = node.h
            else:
                stack.append((node, True))
                for k in node.kids:
                    stack.append((k, False))
        return memo[id(root)]


@acrobat.autobatch
def walk(tree, model):
    return model(tree)


def _nodes(node) -> int:
    return 1 + sum(_nodes(k) for k in node.kids)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 999), count=st.integers(1, 5), style=st.sampled_from(["gru", "walk"]))
def test_tree_cells_written_with_stores_and_attribute_methods_are_one_node(seed, count, style):
    """``memo[k] = <tensor work>`` / ``node.h = <tensor work>`` (SPLIT_STORES: the work joins
    a run, the store stays) and ``node.x.unsqueeze(0)`` (a tensor method of an attribute:
    ``node`` stays an object whose attributes are read at the call) made every cell op by
    op, slower than the eager loop; each cell is one node now."""
    gen = torch.Generator().manual_seed(seed)
    forest = [vec_trees(gen, 4) for _ in range(count)]
    torch.manual_seed(seed)
    model = GRUTree() if style == "gru" else PostOrder()
    absent = ("linear", "rnn_cell", "tanh", "cat")
    check_cells(walk, forest, model, sum(map(_nodes, forest)), absent)


class PairUp(nn.Module):
    """Pairs a queue's front two until one is left (a deque: popleft/append)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(WORDS, DIM)
        self.c = nn.Linear(2 * DIM, DIM)

    def forward(self, words):
        q = deque(self.emb(torch.tensor(w)) for w in words)
        out = []
        while len(q) > 1:
            a = q.popleft()
            b = q.popleft()
            q.append(torch.tanh(self.c(torch.cat([a, b]))))
            out.append(q[-1] * 2.0 + a)
        return torch.stack([q[0], *out]).sum(0)


@acrobat.autobatch
def pair_up(words, model):
    return model(words)


@settings(max_examples=15, deadline=None)
@given(sentences=st.lists(st.lists(st.integers(0, WORDS - 1), min_size=1, max_size=9), min_size=1,
                          max_size=6))  # fmt: skip
def test_appends_of_tensor_work_join_runs_and_deque_pops_stay_out(sentences):
    """``q.append(<tensor work>)``: the work joins a run (SPLIT_STORES); ``q.popleft()``
    is a mutation, never part of a run (it was, and the region, given the deque, ran as
    written: every combination op by op)."""
    torch.manual_seed(0)
    model = PairUp()
    cells = sum(len(s) - 1 for s in sentences)
    absent = ("linear", "cat", "tanh")
    check_cells(pair_up, sentences, model, cells, absent, atol=1e-4, rtol=1e-4)  # (grads ~400)


def test_comprehension_variables_are_not_the_functions_locals():
    """From Python 3.12 on a comprehension's variables are among the function's
    ``co_varnames`` (PEP 709): taken for locals, every statement with a comprehension
    looked like one shadowing a local and stayed out of runs (found on a lent H100's
    Python 3.12). Only names bound elsewhere too stay locals."""
    import ast

    node = ast.parse(
        "def f(self, xs, k):\n"
        "    hs = [self.w(x) for x in xs]\n"
        "    s = sum(h.sum() for h in hs)\n"
        "    for x in xs:\n"
        "        s = s + x\n"
        "    return {k: v for k, v in zip(xs, hs)}, s\n"
    ).body[0]
    assert analysis._comprehension_only(node) == {"h", "v"}
