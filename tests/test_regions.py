"""Straight-line runs inside functions with control flow (config.AUTO_REGIONS): outlined
into one block node each, with the eager loop's results and control decisions."""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import inspect
import linecache
import os
import random
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import analysis, config
from tests.helpers import assert_close_tree, outlined_with

DIM = 6
node_lin = nn.Linear(2 * DIM, 5 * DIM)
leaf_lin = nn.Linear(DIM, 3 * DIM)
emb = nn.Embedding(10, DIM)


def state(tree):
    """A TreeLSTM with both cells written inline around the recursion."""
    if isinstance(tree, int):
        x = emb(torch.tensor(tree))
        i, o, u = leaf_lin(x).chunk(3)
        c = torch.sigmoid(i) * torch.tanh(u)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c
    hl, cl = state(tree[0])
    hr, cr = state(tree[1])
    i, fl, fr, o, u = node_lin(torch.cat([hl, hr])).chunk(5)
    c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


@acrobat.autobatch
def encode(tree):
    h, _ = state(tree)
    return h


def random_tree(rng: random.Random, height: int):
    if height == 0 or rng.random() < 0.3:
        return rng.randrange(10)
    return (random_tree(rng, height - 1), random_tree(rng, height - 1))


def tree_nodes(tree) -> int:
    return 1 if isinstance(tree, int) else 1 + tree_nodes(tree[0]) + tree_nodes(tree[1])


def _map_matches_eager(f, *columns, **shared):
    with torch.no_grad():
        got, stats = f.map(*columns, stats=True, **shared)
        want = [f.eager(*args, **shared) for args in zip(*columns)]
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=f"instance {i}")
        else:
            assert g == w, f"instance {i}"
    return stats


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 8))
def test_inline_cells_become_one_node_each_and_match_eager(seed, batch):
    rng = random.Random(seed)
    trees = [random_tree(rng, 4) for _ in range(batch)]
    with config.override(AUTO_REGIONS=False):
        per_op = _map_matches_eager(encode, trees)
    stats = _map_matches_eager(encode, trees)
    nodes = sum(tree_nodes(t) for t in trees)
    # one node per cell, plus the deferred word ids (row lookups are inside the leaf block)
    assert stats.nodes <= 2 * nodes
    assert per_op.nodes >= 5 * nodes
    assert stats.batches <= per_op.batches


def test_outlined_runs_their_parameters_and_outputs():
    outlined = analysis.outline(state)
    assert outlined is not None
    names = [r.impl.__name__ for r in outlined.regions]
    lines, first = inspect.getsourcelines(state)
    leaf = first + next(i for i, line in enumerate(lines) if "x = emb(" in line)
    node = first + next(i for i, line in enumerate(lines) if "i, fl, fr, o, u" in line)
    assert names == [
        f"state (test_regions.py, lines {leaf}-{leaf + 3})",
        f"state (test_regions.py, lines {node}-{node + 2})",
    ]
    leaf, node = outlined.regions
    code = leaf.impl.__code__
    # torch.tensor(tree) is evaluated at the call: the tree itself is not an argument
    assert code.co_varnames[: code.co_argcount] == ("_acrobat_arg0",)
    code = node.impl.__code__
    assert code.co_varnames[: code.co_argcount] == ("hl", "hr", "cr", "cl")
    # outside a map a region is its code: the names it assigns that the function may
    # read after it (analysis.LIVE_OUTPUTS), in order; x is the leaf run's own, while i,
    # o and u are read again further down the source (the node's lines)
    outputs = leaf.impl(torch.tensor(3))
    assert len(outputs) == 5  # i, o, u, c, h
    torch.testing.assert_close(outputs[-1], state(3)[0])
    # the node's run: only h and c are read after it (returned)
    h, c = node.impl(*(torch.randn(DIM) for _ in range(4)))
    assert h.shape == c.shape == (DIM,)


def test_a_run_returns_what_may_be_read_after_it():
    """A run's temporaries are not its results (analysis.LIVE_OUTPUTS), but a name read
    later, read in a loop around the run, or carried by it, is; so is everything when
    the function reads its locals by name."""

    def loop(xs, h):
        for x in xs:
            if x.sum() > 100:
                continue
            a = torch.tanh(x * 2) + 1  # a: the run's own
            b = torch.sigmoid(a) * h  # b: read at the loop's top, next time round
            h = torch.tanh(b + x)  # h: carried
            if b.sum() > 100:
                break
        return h

    def deleted(x):
        a = torch.tanh(x * 2) + 1
        b = torch.sigmoid(a) * 3
        c = torch.cos(b) + 1
        if b.sum() > 100:
            return b
        del a  # (a del, an augmented assignment: reads of the name after the run)
        c += 1
        return b * 2

    def dynamic(x):
        t = torch.tanh(x * 2) + 1
        u = torch.sigmoid(t) * 3
        if u.sum() > 100:
            return u
        return locals()["t"]

    region = analysis.outline(loop).regions[0]
    xs = [torch.randn(3) for _ in range(2)]
    got = region.impl(xs[0], torch.ones(3))  # (x, h): its results are (b, h)
    assert len(got) == 2
    torch.testing.assert_close(got[1], torch.tanh(torch.sigmoid(torch.tanh(xs[0] * 2) + 1) + xs[0]))
    def deletes(x):
        a = torch.tanh(x * 2) + 1
        b = torch.sigmoid(a) * 3
        if b.sum() > 100:
            return b
        del a
        return b * 2

    region = analysis.outline(deleted).regions[0]
    assert len(region.impl(torch.randn(3))) == 3  # a (deleted), b (read), c (+=)
    region = analysis.outline(deletes).regions[0]
    assert len(region.impl(torch.randn(3))) == 2  # a (deleted), b
    _map_matches_eager(acrobat.autobatch(deletes), [torch.randn(3) for _ in range(3)])
    region = analysis.outline(dynamic).regions[0]
    assert len(region.impl(torch.randn(3))) == 2  # t, u: locals() may read any
    _map_matches_eager(acrobat.autobatch(loop), [xs, xs[::-1]], h=torch.ones(3))


def test_code_is_swapped_only_during_the_map_and_restored_after_errors():
    original = state.__code__
    seen = []

    @acrobat.autobatch
    def spy(tree):
        seen.append(state.__code__ is original)
        h, _ = state(tree)
        if isinstance(tree, int) and tree == 7:
            raise RuntimeError("boom")
        return h

    with torch.no_grad():
        spy.map([(1, 2), 3])
    assert seen == [False, False] and state.__code__ is original
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        spy.map([(1, 2), 7])
    assert state.__code__ is original
    with config.override(AUTO_REGIONS=False), torch.no_grad():
        seen.clear()
        spy.map([(1, 2)])
    assert seen == [True]


def small_run(x, flag: bool):
    if flag:
        y = torch.tanh(x)  # one tensor call: not worth a block
        x = y + 1
    return x


def demands(x, n: int):
    steps = 0
    while steps < n:
        a = torch.tanh(x)
        b = torch.sigmoid(a) * 2
        s = float(b.sum())  # a value demand: never inside a run
        if s > DIM:
            x = a - b
        else:
            x = a + b
        steps += 1
    return x, steps


def in_try(x):
    try:
        a = torch.tanh(x)
        b = torch.sigmoid(a)
    except RuntimeError:
        a = b = x
    return a + b


def in_suppress(x):
    with contextlib.suppress(RuntimeError):
        a = torch.tanh(x)
        b = torch.sigmoid(a)
    return a + b


def in_phase(x):
    with acrobat.phase("p"):
        a = torch.tanh(x)
        b = torch.sigmoid(a)
    return a + b


def with_closure(x):
    def inner(t):
        return t * 2

    a = torch.tanh(x)
    b = torch.sigmoid(a)
    return inner(a + b)


def test_what_is_outlined():
    assert analysis.outline(small_run) is None
    regions = analysis.outline(demands).regions
    assert len(regions) == 1
    code = regions[0].impl.__code__
    assert code.co_varnames[: code.co_argcount] == ("x",)
    assert analysis.outline(in_try) is None
    assert analysis.outline(in_suppress) is None
    assert analysis.outline(in_phase) is not None
    assert analysis.outline(with_closure) is None


@pytest.mark.parametrize("fn", [demands])
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), lengths=st.lists(st.integers(0, 5), min_size=1, max_size=6))
def test_value_demands_around_runs_take_the_eager_decisions(fn, seed, lengths):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(DIM, generator=gen) * 3 for _ in lengths]
    run = acrobat.autobatch(fn)
    with torch.no_grad():
        got = run.map(xs, lengths)
        want = [run.eager(x, n) for x, n in zip(xs, lengths)]
    for (g, gs), (w, ws) in zip(got, want):
        torch.testing.assert_close(g, w)
        assert gs == ws


@acrobat.autobatch
def phased(x):
    return in_phase(x)


def test_a_run_in_a_phase_body_is_one_node():
    xs = [torch.randn(DIM) for _ in range(5)]
    stats = _map_matches_eager(phased, xs)
    assert stats.by_op.get("tanh") is None and stats.by_op.get("sigmoid") is None


class Node:
    def __init__(self, value, scale):
        self.value = value
        self.scale = scale


def reads_an_object(node, h):
    for _ in range(2):
        a = torch.tanh(h * node.scale)
        h = torch.sigmoid(a) + node.value
    return h


@acrobat.autobatch
def with_objects(node, h):
    return reads_an_object(node, h)


def test_a_run_given_an_object_runs_as_written():
    nodes = [Node(torch.randn(DIM), s) for s in (0.5, 1.0, 2.0)]
    hs = [torch.randn(DIM) for _ in nodes]
    _map_matches_eager(with_objects, nodes, hs)


def scaled_steps(h, n: int):
    for i in range(n):
        a = torch.tanh(h * i)  # i keys the trace: a new one every step
        h = torch.sigmoid(a) + h
    return h


@acrobat.autobatch
def scaled(h, n):
    return scaled_steps(h, n)


def test_a_run_that_retraces_every_call_is_turned_off():
    hs = [torch.randn(DIM) * 0.1 for _ in range(3)]
    _map_matches_eager(scaled, hs, [80, 80, 80])
    (region,) = analysis.outline(scaled_steps).regions
    assert region.disabled
    _map_matches_eager(scaled, hs, [5, 80, 3])  # still right, op by op


def gated(h, flip: bool):
    if flip:  # control flow: the function is outlined, not one block
        h = -h
    a = torch.tanh(h)
    b = torch.sigmoid(a) * h
    return b


@acrobat.autobatch
def gated_map(h, flip):
    return gated(h, flip)


def counted_steps(h, n: int):
    for _ in range(n):
        a = torch.tanh(h)
        h = torch.sigmoid(a) * h
    return h


@acrobat.autobatch
def counted(h, n):
    return counted_steps(h, n)


def test_a_run_serving_many_shapes_stays_on():
    """Many traces alone do not turn a run off: 70 model sizes in one process (a test
    suite, a notebook) make 70 traces of each run, each reused by every call of its
    size; only a run that needs a new trace for a large share of its calls is switched
    off (the scalar case above)."""
    from acrobat import config

    assert config.BLOCK_CACHE_SIZE // 4 < 70  # more sizes than the old switch-off allowed
    for dim in range(2, 72):
        hs = [torch.randn(dim) for _ in range(10)]
        stats = _map_matches_eager(gated_map, hs, [i % 2 == 0 for i in range(10)])
        assert stats.nodes == 10 + 10 + 5  # inputs, one block per instance, 5 negations
        stats = _map_matches_eager(counted, hs[:3], [4, 6, 5])
        (scans,) = [v for k, v in stats.by_op.items() if k.startswith("scan:counted_steps")]
        assert scans == [1, 3]  # one scan node per instance, one batch
    (region,) = analysis.outline(gated).regions
    assert not region.disabled and len(region.block.cache) >= 70
    loop, body = analysis.outline(counted_steps).regions  # the scan, its body's run
    assert not loop.disabled and not body.disabled


def failing(x, k):
    a = torch.tanh(x)
    b = a.reshape(k, -1)  # bad shape for some k
    return b


@acrobat.autobatch
def fails(x, k):
    for _ in range(1):
        y = failing(x, k)
        z = torch.tanh(x)
        w = z.reshape(k, -1) * 2
    return y, w


def test_an_error_in_a_run_names_the_instance_and_the_lines():
    xs = [torch.randn(DIM) for _ in range(3)]
    with pytest.raises(Exception) as info, torch.no_grad():
        fails.map(xs, [2, 4, 3])
    message = str(info.value)
    assert "instance 1" in message and "test_regions.py" in message, message


SOURCE = """
import torch


def steps(x):
    for _ in range(2):
        a = torch.tanh(x)
        x = torch.sigmoid(a) * 2
    return x
"""


def test_a_function_whose_source_changed_after_import_is_left_alone(tmp_path):
    path = tmp_path / "edited_module.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("edited_module", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["edited_module"] = module
    try:
        spec.loader.exec_module(module)
        assert analysis.outline(module.steps) is not None
        analysis._OUTLINED.pop(analysis._code_key(module.steps))
        path.write_text(SOURCE.replace("* 2", "* 3"))  # same lines, other code
        linecache.checkcache(str(path))
        assert analysis.outline(module.steps) is None
    finally:
        del sys.modules["edited_module"]


@pytest.mark.parametrize("batch", [8])
def test_treelstm_written_inline_records_at_most_two_nodes_per_tree_node(batch):
    from models import sst, treelstm

    task = treelstm.make_task("small", batch, blocks=False)
    with torch.no_grad():
        got, stats = treelstm.encode_inline.map(task.inputs, model=task.model, stats=True)
        want = [treelstm.encode_plain.eager(t, model=task.model) for t in task.inputs]
        _, plain_stats = treelstm.encode_plain.map(task.inputs, model=task.model, stats=True)
    for (h, logits), (hw, lw) in zip(got, want):
        torch.testing.assert_close(h, hw, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, lw, atol=1e-5, rtol=1e-5)
    tree_nodes = sum(sst.num_nodes(t) for t in task.inputs)
    assert stats.nodes <= 2 * tree_nodes
    assert (stats.nodes, stats.batches) == (plain_stats.nodes, plain_stats.batches)


@acrobat.autobatch
def embed_all(ids, h):
    if len(ids) > 2:
        h = h * 2
    xs = [emb(torch.tensor(i)) for i in ids]  # i is the comprehension's: not hoisted
    g = torch.stack(xs).sum(0) + h
    return torch.tanh(g)


def test_factories_over_comprehension_variables_stay_inside():
    ids = [[1, 2, 3], [4], [5, 6, 7, 8]]
    hs = [torch.randn(DIM) for _ in ids]
    # the comprehension is a scan over the ids (acrobat/scan.py); the stack reads its
    # list (SPLIT_CONTAINERS: given the list, a run would run op by op), so it is split
    # off (SPLIT_PARTS) and the sum, the add and the tanh after it are a run
    scan, run = analysis.outline(embed_all.fn).regions
    assert isinstance(scan, analysis.ScanBlock) and scan.values == (0,)
    assert isinstance(run, analysis.RegionBlock) and not isinstance(run, analysis.ScanBlock)
    _map_matches_eager(embed_all, ids, hs)


# ---- random programs: outlined code == the original, and map == eager -----------------------

_VARS = ["a", "b", "c"]
_TEMPLATES = [
    "{v} = torch.tanh({u})",
    "{v} = {u} * 0.5 + {w}",
    "{v}, {v2} = torch.cat([{u}, {w}]).chunk(2)",
    "{v} = torch.stack([torch.sigmoid(t) for t in ({u}, {w})]).sum(0)",
    "{v} = lin({u}) - {w}",
    "{v} = {u} + torch.tensor(float(k))",
    "out.append({u})",
    "k = len(out) + 1",
]


def _statements(draw, depth: int, indent: str) -> list[str]:
    lines = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 9 if depth < 2 else 7))
        if kind <= 7:
            v, v2, u, w = (draw(st.sampled_from(_VARS)) for _ in range(4))
            if v2 == v:
                v2 = next(x for x in _VARS if x != v)
            lines.append(indent + _TEMPLATES[kind].format(v=v, v2=v2, u=u, w=w))
        elif kind == 8:
            u = draw(st.sampled_from(_VARS))
            lines.append(f"{indent}if float({u}.sum()) > 0:")
            lines += _statements(draw, depth + 1, indent + "    ")
            lines.append(f"{indent}else:")
            lines += _statements(draw, depth + 1, indent + "    ")
        else:
            lines.append(f"{indent}for _ in range(n):")
            lines += _statements(draw, depth + 1, indent + "    ")
    return lines


@st.composite
def programs(draw) -> str:
    body = _statements(draw, 0, "    ")
    return "\n".join(
        [
            "import torch",
            "from torch import nn",
            "",
            "torch.manual_seed(0)",
            f"lin = nn.Linear({DIM // 2 * 2}, {DIM // 2 * 2})",
            "",
            "",
            "def program(x, y, n):",
            "    a, b, c = x, y, x * 2",
            "    out = []",
            "    k = 1",
            *body,
            "    return torch.stack([a, b, c]), len(out), k",
            "",
        ]
    )


_COUNTER = [0]


@settings(max_examples=int(os.environ.get("REGION_EXAMPLES", "40")), deadline=None)
@given(source=programs(), seed=st.integers(0, 100))
def test_random_programs_outline_to_the_same_results(tmp_path_factory, source, seed):
    _COUNTER[0] += 1
    name = f"regions_program_{_COUNTER[0]}"
    path = tmp_path_factory.mktemp("programs") / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        program = module.program
        gen = torch.Generator().manual_seed(seed)
        xs = [torch.randn(DIM, generator=gen) for _ in range(4)]
        ys = [torch.randn(DIM, generator=gen) for _ in range(4)]
        ns = [0, 1, 2, 3]
        outlined = analysis.outline(program)
        if outlined is not None:  # run directly (outside a map a region is its code)
            rewritten = type(program)(outlined.code, program.__globals__)
            for x, y, n in zip(xs, ys, ns):
                with torch.no_grad():
                    want, got = program(x, y, n), rewritten(x, y, n)
                assert torch.equal(got[0], want[0]) and got[1:] == want[1:], source
        f = acrobat.autobatch(program)
        with torch.no_grad():
            got = f.map(xs, ys, ns)
            want = [f.eager(x, y, n) for x, y, n in zip(xs, ys, ns)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g[0], w[0], atol=1e-4, rtol=1e-4, msg=source)
            assert g[1:] == w[1:], source
    finally:
        del sys.modules[name]


# ---- value reads split off their tensor work (analysis.SPLIT_DEMANDS) ----------------------


def picks(x, n: int):
    chosen = []
    values = []
    steps = 0
    while steps < n:
        mask = [0.0 if k % 2 == steps % 2 else -1e9 for k in range(DIM)]
        k = int(torch.argmax(torch.tanh(x) + torch.tensor(mask)))
        v = torch.tanh(x * 2).sum().item()
        chosen.append(k)
        values.append(v)
        x = x * 0.5 + x[k]
        steps += 1
    return x, chosen, values


def shadowed(x):
    int = float  # a local named int is not the builtin
    k = int(torch.tanh(x).sum() * 2)
    return x * k


def test_value_reads_are_split_off_their_work():
    fn = analysis.outline(picks)
    assert fn is not None
    assert len(fn.regions) == 2  # the argmax's work, and the sum's work
    for region in fn.regions:
        assert {"int", "item"}.isdisjoint(region.impl.__code__.co_names)  # reads stay outside
    # a local named int is not the builtin: not split, and the map still matches eager
    xs = [torch.randn(DIM) for _ in range(3)]
    _map_matches_eager(acrobat.autobatch(shadowed), xs)


def exits_early(x):
    h = torch.tanh(x * 2)
    y = h * 3  # read only in the if's body, which lies inside the split-off test's span
    if torch.sigmoid(h).sum().item() > DIM / 2:
        return y
    return h


def stores_at_a_key(x, memo: dict):
    h = torch.tanh(x * 2)
    k = len(memo)  # read only by the store's target: Python evaluates it after the value
    memo[k] = torch.sigmoid(h) * 2
    return memo[k] + h


def test_names_the_rest_of_a_split_statement_reads_are_a_runs_results():
    """A statement split in two (a value read's work, a store's value) keeps its position
    for the part that joins a run; names bound in the run and read by the rest of the
    statement (an if's body, a store's target) were taken for the run's own reads and
    not returned: the map raised NameError."""
    xs = [torch.randn(DIM) for _ in range(4)]
    _map_matches_eager(acrobat.autobatch(exits_early), xs)
    run = acrobat.autobatch(lambda x: stores_at_a_key(x, {}))
    _map_matches_eager(run, xs)
    for fn, name in ((exits_early, "y"), (stores_at_a_key, "k")):
        outlined = analysis.outline(fn)
        assert outlined is not None
        assert name in outlined.regions[0].impl.__code__.co_varnames


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), lengths=st.lists(st.integers(0, 5), min_size=1, max_size=6))
def test_split_value_reads_take_the_eager_decisions(seed, lengths):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(DIM, generator=gen) for _ in lengths]
    run = acrobat.autobatch(picks)

    def _map_matches_eager(f, *columns):  # outputs are (tensor, [int], [float])
        with torch.no_grad():
            got, stats = f.map(*columns, stats=True)
            want = [f.eager(*args) for args in zip(*columns)]
        assert_close_tree(got, want)
        return stats

    stats = _map_matches_eager(run, xs, lengths)
    if max(lengths) > 0:
        assert "argmax" not in stats.by_op  # inside the region's block
    with config.override(AUTO_REGIONS=True), outlined_with(picks, SPLIT_DEMANDS=False):
        off = _map_matches_eager(run, xs, lengths)
    if max(lengths) > 0:
        assert "argmax" in off.by_op and stats.nodes < off.nodes


# ---- torch.tensor(x) moved out of a run: the dispatcher makes it ------------------------


def weighted(x, n: int, weights: list):
    steps = 0
    while steps < n:
        w = weights[steps % len(weights)]
        k = int(x.sum() > 0)
        x = torch.tanh(x) * torch.tensor(w) + k
        steps += 1
    return x


def test_a_run_is_passed_x_and_makes_torch_tensor_of_it(monkeypatch):
    fn = analysis.outline(picks)
    assert fn is not None
    argmax_run = fn.regions[0]
    assert argmax_run.tensor_args == (0,)  # torch.tensor(mask): the call passes mask
    mask = [0.0, -1e9, 0.0, -1e9, 0.0, -1e9]
    x = torch.randn(DIM)
    # outside a map the dispatcher is the run's code, given torch.tensor(mask)
    torch.testing.assert_close(argmax_run(mask, x), argmax_run.impl(torch.tensor(mask), x))
    made: list = []
    real = analysis.value_data
    monkeypatch.setattr(analysis, "value_data", lambda v: made.append(v) or real(v))
    through_torch: list = []  # one mask given to torch.tensor (the batch rule gives all)
    real_tensor = torch.tensor

    def spy(data, *args, **kwargs):
        if isinstance(data, list) and data and not isinstance(data[0], list):
            through_torch.append(data)
        return real_tensor(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", spy)
    lengths = [3, 0, 5]
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(DIM, generator=gen) for _ in lengths]
    with torch.no_grad():
        got, stats = acrobat.autobatch(picks).map(xs, lengths, stats=True)
    monkeypatch.undo()
    assert_close_tree(got, [picks(x, n) for x, n in zip(xs, lengths)])
    # every step's mask a data node made directly: by value_data, or by the C call slot's
    # copy of its common cases, never through torch.tensor
    assert stats.by_op["tensor"][1] == sum(lengths) and not through_torch
    assert len(made) <= sum(lengths)


@settings(max_examples=15, deadline=None)
@given(
    kind=st.sampled_from(["int", "float", "flat", "nested", "tensor"]),
    seed=st.integers(0, 1000),
    lengths=st.lists(st.integers(0, 4), min_size=1, max_size=5),
)
def test_tensors_made_by_a_run_dispatcher_match_eager(kind, seed, lengths):
    """Numbers and flat lists become data nodes; a nested list or a tensor goes through
    torch.tensor as written (a real constant), and every kind matches eager."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(DIM, generator=gen) for _ in lengths]
    values = torch.randn(3, DIM, generator=gen)
    weights = {
        "int": [2, -1, 3],
        "float": [0.5, -1.5, 2.0],
        "flat": values.tolist(),
        "nested": [[row] for row in values.tolist()],
        "tensor": list(values),
    }[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.tensor(tensor) advises clone
        _map_matches_eager(acrobat.autobatch(weighted), xs, lengths, weights=weights)


def gated_sum(xs):
    """A loop whose body is a run assigning ONE name: the region returns a 1-tuple."""
    total = xs[0]
    for x in xs[1:]:
        if len(xs) > 100:  # never: keeps the body a region, not a scan
            break
        total = total + torch.sigmoid(x) * torch.tanh(total)
    return total


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.integers(0, 1000))
def test_a_run_assigning_one_name_returns_its_output_as_a_plain_tuple(lengths, seed):
    torch.manual_seed(seed)
    xs = [[torch.randn(3) for _ in range(n)] for n in lengths]
    _map_matches_eager(acrobat.autobatch(gated_sum), xs)
    outlined = analysis.outline(gated_sum)
    assert outlined is not None and len(outlined.regions) == 1
    traces = list(outlined.regions[0].block.cache.values())
    if any(n > 1 for n in lengths):
        assert traces and all(t.plain_tuple and t.info.single for t in traces)


def convert(x, v, n: int):
    """A run whose torch.tensor(v) the dispatcher makes (in C for its common cases)."""
    for _ in range(n):
        if n < 0:  # never: keeps the body a run, not a scan
            break
        t = torch.tensor(v)
        y = torch.tanh(x) + torch.sigmoid(x)
    return t, y


_NUMBERS = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False),
    st.booleans(),
)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(
        st.one_of(
            _NUMBERS,
            st.lists(st.integers(-100, 100), max_size=4),
            st.lists(st.floats(-10, 10, allow_nan=False, allow_subnormal=False), max_size=4),
            st.lists(st.one_of(st.integers(-5, 5), st.floats(-5, 5, allow_subnormal=False)),
                     min_size=1, max_size=4).map(tuple),
            st.lists(st.booleans(), min_size=1, max_size=3),
            st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=2), min_size=1, max_size=2),
        ),
        min_size=1,
        max_size=5,
    ),
    n=st.integers(1, 3),
)
def test_run_arguments_become_the_tensors_torch_makes(values, n):
    """Whatever path makes a run's torch.tensor(v) (the C slot's common cases, value_data,
    torch.tensor as written), the tensor has eager's dtype, shape and values."""
    xs = [torch.randn(DIM) for _ in values]
    f = acrobat.autobatch(convert)
    with torch.no_grad():
        got = f.map(xs, values, [n] * len(values))
        want = [f.eager(x, v, n) for x, v in zip(xs, values)]
    assert_close_tree([t for t, _ in got], [t for t, _ in want], atol=0, rtol=0)
    assert_close_tree([y for _, y in got], [y for _, y in want])


mix = nn.Linear(2 * DIM, DIM)
query = nn.Linear(DIM, DIM)


def attend(tree):
    """Attention over a node's children: the children's states come back in a list
    (a container, which a run would have to take whole), the work after it and the
    returned expression are straight-line."""
    if isinstance(tree, int):
        return torch.tanh(leaf_lin(emb(torch.tensor(tree)))[:DIM])
    kids = [attend(c) for c in tree]
    k = torch.stack(kids)
    q = query(k.mean(0))
    a = torch.softmax(k @ q, 0)
    pooled = (a.unsqueeze(1) * k).sum(0)
    return torch.tanh(mix(torch.cat([pooled, k.max(0).values])))


@acrobat.autobatch
def attend_tree(tree):
    return attend(tree)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 6))
def test_work_after_a_list_and_a_returned_expression_join_one_run(seed, batch):
    """``k = torch.stack(kids)`` reads a list: left out of the run (given the list, the
    run would have run op by op); the three assignments after it and the returned
    expression (split off its ``return``) are one region: per internal node, a stack and
    one block node. The leaf's lone ``return`` stays as written (its lookup's fast path)."""
    rng = random.Random(seed)
    trees = [random_tree(rng, 3) for _ in range(batch)]
    stats = _map_matches_eager(attend_tree, trees)
    internal = sum(tree_nodes(t) - _leaves(t) for t in trees)
    blocks = {n: v[1] for n, v in stats.by_op.items() if n.startswith("block:attend")}
    assert list(blocks.values()) == ([internal] if internal else []), blocks
    lines, start = inspect.getsourcelines(attend)
    q = start + next(i for i, line in enumerate(lines) if "q = query" in line)
    assert not internal or [f"lines {q}-{q + 3}" in n for n in blocks] == [True]  # to return
    assert stats.by_op.get("stack", (0, 0))[1] == internal


def _leaves(tree) -> int:
    return 1 if isinstance(tree, int) else _leaves(tree[0]) + _leaves(tree[1])


def test_container_names_are_locals_only_ever_bound_to_displays():
    import ast
    import textwrap

    src = textwrap.dedent(
        """
        def f(xs, t):
            kids = [g(c) for c in t]
            pair = (1, 2)
            table = {}
            table = {1: 2}
            maybe = []
            maybe = xs
            a, b = [1, 2]
            xs = [1]
            for item in xs:
                loop = [item]
            inner = [y for y in xs]
            return kids
        """
    )
    fn = ast.parse(src).body[0]
    assert analysis._container_names(fn) == {"kids", "pair", "table", "loop", "inner"}


class Obj:
    """A tree node of the user's own class: its input in an attribute (config.OBJECT_INPUTS)."""

    def __init__(self, x, children):
        self.x, self.children = x, children


obj_leaf = nn.Linear(DIM, DIM)
obj_mix = nn.Linear(2 * DIM, DIM)


def obj_state(node):
    """A tree cell whose internal branch is a loop around the recursive call: both
    returns stand alone (no run before them) and read ``node.x``."""
    if not node.children:
        return torch.tanh(obj_leaf(node.x))
    h = torch.zeros(DIM)
    for c in node.children:
        h = h + obj_state(c)
    return torch.tanh(obj_mix(torch.cat([h, node.x])))


@acrobat.autobatch
def obj_encode(node):
    return obj_state(node)


def random_obj(rng: random.Random, height: int) -> Obj:
    x = torch.randn(DIM, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    if height == 0 or rng.random() < 0.3:
        return Obj(x, [])
    return Obj(x, [random_obj(rng, height - 1) for _ in range(rng.randint(1, 3))])


def _obj_counts(node: Obj) -> tuple[int, int]:
    """(leaves, internal nodes) of an Obj tree."""
    if not node.children:
        return 1, 0
    counts = [_obj_counts(c) for c in node.children]
    return sum(c[0] for c in counts), 1 + sum(c[1] for c in counts)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 6))
def test_lone_returns_reading_object_attributes_are_blocks(seed, batch):
    """Each ``return <tensor work>`` standing alone is a run of its own (LONE_RETURNS),
    and ``node.x`` in it is read at the region's call (REGION_ATTRIBUTES): given the
    ``Obj`` itself, the region ran as written, op by op. One block node per tree node."""
    rng = random.Random(seed)
    trees = [random_obj(rng, 3) for _ in range(batch)]
    stats = _map_matches_eager(obj_encode, trees)
    leaves = sum(_obj_counts(t)[0] for t in trees)
    internal = sum(_obj_counts(t)[1] for t in trees)
    lines, start = inspect.getsourcelines(obj_state)
    leaf_line = start + next(i for i, line in enumerate(lines) if "obj_leaf(" in line)
    mix_line = start + next(i for i, line in enumerate(lines) if "obj_mix(" in line)
    blocks = {n: v[1] for n, v in stats.by_op.items() if n.startswith("block:obj_state")}
    assert blocks == {
        f"block:obj_state (test_regions.py, line {leaf_line})": leaves,
        **({f"block:obj_state (test_regions.py, line {mix_line})": internal} if internal else {}),
    }
    assert "linear" not in stats.by_op and "tanh" not in stats.by_op


def test_lone_returns_and_region_attributes_off_record_op_by_op():
    rng = random.Random(5)
    trees = [random_obj(rng, 3) for _ in range(4)]
    for flag in ("LONE_RETURNS", "REGION_ATTRIBUTES"):
        with outlined_with(obj_state, **{flag: False}):
            stats = _map_matches_eager(obj_encode, trees)
        assert stats.by_op["linear"][1] == sum(sum(_obj_counts(t)) for t in trees), flag


def test_object_roots_are_locals_read_only_through_attributes():
    import ast

    run = ast.parse(
        "a = torch.tanh(model.fc(node.x) + cfg.scale * x.shape[0])\n"
        "b = other.w + other + tree.left.h * z.T\n"
        "c = obj.p.q(1) + cell.bias\n"
    ).body
    local = {"model", "node", "cfg", "x", "other", "tree", "z", "obj", "cell"}
    # model: called through; x, z: tensor attributes; other: also read bare; obj: a method
    assert analysis._object_roots(run, local) == {"node", "cfg", "tree", "cell"}
    assert analysis._object_roots(run, local - {"cfg"}) == {"node", "tree", "cell"}
    # a tensor method of an attribute's value (``leaf.x.unsqueeze(0)``) is no call through
    # the object; another method of it (``obj.p.q(1)`` above) is
    more = ast.parse("d = leaf.x.unsqueeze(0) + box.v.shape[0] * box.v.q(2)\n").body
    assert analysis._object_roots(more, {"leaf", "box"}) == {"leaf"}


cs_emb = nn.Embedding(10, DIM)
cs_iou = nn.Linear(2 * DIM, 3 * DIM)
cs_f = nn.Linear(2 * DIM, DIM)


def child_sum(node):
    """A child-sum TreeLSTM cell (Tai et al.) over ``Obj`` nodes holding a word id in
    ``x``, written as a user would: a lone lookup, a sum over a list, a loop of forget
    gates and ``h = o * torch.tanh(c)`` standing alone before the return."""
    hs, cs = [], []
    for kid in node.children:
        h, c = child_sum(kid)
        hs.append(h)
        cs.append(c)
    x = cs_emb(torch.tensor(node.x))
    if hs:
        h_sum = torch.stack(hs).sum(0)
    else:
        h_sum = torch.zeros(DIM)
    i, o, u = cs_iou(torch.cat([x, h_sum])).chunk(3)
    c = torch.sigmoid(i) * torch.tanh(u)
    for h_k, c_k in zip(hs, cs):
        c = c + torch.sigmoid(cs_f(torch.cat([x, h_k]))) * c_k
    h = o * torch.tanh(c)
    return h, c


@acrobat.autobatch
def child_sum_encode(node):
    return child_sum(node)[0]


def random_words(rng: random.Random, height: int) -> Obj:
    if height == 0 or rng.random() < 0.3:
        return Obj(rng.randrange(10), [])
    return Obj(rng.randrange(10), [random_words(rng, height - 1) for _ in range(rng.randint(1, 3))])


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 6))
def test_operators_beside_a_tensor_call_and_lone_lookups(seed, batch):
    """``h = o * torch.tanh(c)`` counts two tensor ops (OPERATORS) and is a block; the lone
    ``x = cs_emb(torch.tensor(node.x))`` stays an embedding lookup (one node, no data
    node) rather than a block fed by a tensor."""
    rng = random.Random(seed)
    trees = [random_words(rng, 3) for _ in range(batch)]
    stats = _map_matches_eager(child_sum_encode, trees)
    nodes = sum(sum(_obj_counts(t)) for t in trees)
    lines, start = inspect.getsourcelines(child_sum)
    last = start + lines.index("    h = o * torch.tanh(c)\n")
    assert stats.by_op[f"block:child_sum (test_regions.py, line {last})"][1] == nodes
    assert "tanh" not in stats.by_op and "mul" not in stats.by_op
    assert "tensor" not in stats.by_op  # (the lookup reads the word id itself)
    assert sum(v[1] for v in stats.by_op.values()) == stats.nodes


def test_operators_count_only_beside_a_tensor_call():
    import ast

    rw = analysis._Rewriter(child_sum, {"a", "b", "c", "i"})
    ops = [rw._ops(s) for s in ast.parse("a = b * torch.tanh(c)\ni = 2 * i + 1\na = -b").body]
    assert ops == [2, 0, 0]


dec_out = nn.Linear(DIM, 7)


@acrobat.autobatch
def decode_scores(h, steps):
    """A greedy decoder's loop: the run after the value read indexes by the read int."""
    kept = [h]
    total = torch.zeros(())
    for k in range(steps):
        logp = torch.log_softmax(dec_out(h), -1)
        tok = int(logp.argmax())
        total = total + torch.exp(logp[tok]) * 2.0
        h = torch.tanh(h + kept[k] * 0.5)
        kept.append(h)
    return total


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 6), steps=st.integers(1, 4))
def test_subscripts_of_locals_are_read_at_the_region_call(seed, batch, steps):
    """``logp[tok]`` in a run is read at its call (REGION_SUBSCRIPTS): the int no longer
    keys the region's trace (a batch per distinct token), and the pick batches across
    the ints; ``kept[k]`` gives the run a tensor instead of the list."""
    gen = torch.Generator().manual_seed(seed)
    hs = [torch.randn(DIM, generator=gen) for _ in range(batch)]
    stats = _map_matches_eager(decode_scores, hs, [steps] * batch)
    lines, start = inspect.getsourcelines(decode_scores.fn)
    line = start + lines.index("        total = total + torch.exp(logp[tok]) * 2.0\n")
    name = f"block:decode_scores (test_regions.py, lines {line}-{line + 1})"  # with h's
    assert stats.by_op[name] == [steps, batch * steps]
    assert stats.by_op["pick"] == [steps, batch * steps]
    assert not any(n in stats.by_op for n in ("tanh", "add", "mul", "getitem"))


LState = collections.namedtuple("LState", "h c")
ls_ih = nn.Linear(DIM, 4 * DIM)
ls_hh = nn.Linear(DIM, 4 * DIM)


def ls_cell(x, st):
    """An LSTM cell over a namedtuple state, returning the state's ``_replace``."""
    i, f, o, u = (ls_ih(x) + ls_hh(st.h)).chunk(4)
    c = torch.sigmoid(f) * st.c + torch.sigmoid(i) * torch.tanh(u)
    return st._replace(h=torch.sigmoid(o) * torch.tanh(c), c=c)


@acrobat.autobatch
def ls_run(xs):
    st = LState(torch.zeros(DIM), torch.zeros(DIM))
    total = torch.zeros(DIM)
    for x in xs:
        st = ls_cell(x * 1.0, st)
        if st.h.sum() > 100:  # control flow: the loop is not a scan
            break
        total = total + torch.tanh(st.c) * st.h
    return total, st


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), lengths=st.lists(st.integers(1, 5), min_size=1, max_size=6))
def test_namedtuple_states_pass_through_blocks_and_regions(seed, lengths):
    """A namedtuple of lazy tensors given to an automatic block failed the map ("uses a
    lazy tensor it did not receive as an argument": its fields were not the block's
    inputs) and made a region run as written; both take it by its type and fields now."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [[torch.randn(DIM, generator=gen) for _ in range(n)] for n in lengths]
    with torch.no_grad():
        got, stats = ls_run.map(seqs, stats=True)
    want = [ls_run.eager(s) for s in seqs]
    assert_close_tree(got, want, atol=1e-5, rtol=1e-5)
    assert all(type(g[1]) is LState for g in got)
    # the first step (a state of zeros, real tensors) calls the cell's block; the later
    # steps, given the lazy state, the region of its line (the cell traced inside it)
    lines, start = inspect.getsourcelines(ls_run.fn)
    line = start + lines.index("        st = ls_cell(x * 1.0, st)\n")
    assert stats.by_op["block:ls_cell"][1] == len(lengths)
    region = stats.by_op.get(f"block:ls_run (test_regions.py, line {line})", [0, 0])
    assert region[1] == sum(lengths) - len(lengths)
    assert not any(n in stats.by_op for n in ("linear", "sigmoid", "tanh", "chunk"))


def test_a_run_given_a_tuple_of_per_instance_tensors_is_one_block():
    """``adj, ids = graph`` inside the run: the tuple argument is keyed by its fields, as a
    block's is (before, a run given any container ran op by op)."""
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)

    def f(graph, emb):
        adj, ids = graph
        h = emb(ids)
        return torch.tanh(adj @ h + h).sum(0)

    g = acrobat.autobatch(f)
    data = [(torch.rand(3, 3), torch.randint(10, (3,))) for _ in range(5)]
    with torch.no_grad():
        got, stats = g.map(data, emb=emb, stats=True)
    assert [k for k in stats.by_op if k.startswith("block:")], stats.by_op
    assert "embedding" not in stats.by_op and "matmul" not in stats.by_op, stats.by_op
    for out, x in zip(got, data):
        assert_close_tree(out, f(x, emb))
