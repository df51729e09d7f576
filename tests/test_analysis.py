"""Automatic coarsening: straight-line functions reachable from an autobatched function
run as blocks inside f.map, with the same results, and fall back safely."""

import collections
import json
import os
import random
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import analysis
from tests import module_cells
from tests.helpers import check_map, outlined_with

lin = nn.Linear(8, 8)
SCALE = 0.5
COUNTER = []


def cell(x, h):
    """A straight-line cell."""
    a, b = lin(torch.cat([x, h])[:8]).chunk(2)
    return torch.tanh(a) * torch.sigmoid(b) * SCALE


def cell_with_comprehension(x):
    y, z = (t * 2 for t in x.chunk(2))
    return y + z


def branchy(x):
    if x.sum() > 0:
        return x
    return -x


def side_effect(x):
    COUNTER.append(1)
    return x * 2


def writes_attribute(m, x):
    m.cache = x
    return x


def reads_value(x):
    k = int(x.argmax())
    return x * k


CELLS = (cell, reads_value)


@acrobat.autobatch
def run(xs):
    h = torch.zeros(4)
    outs = []
    for x in xs:
        h = CELLS[0](x, h)
        outs.append(h)
    return torch.stack(outs), CELLS[1](h)


def test_straight_line_verdicts():
    assert analysis.straight_line(cell)
    assert analysis.straight_line(cell_with_comprehension)
    assert analysis.straight_line(reads_value)  # statically fine; tracing will fall back
    assert not analysis.straight_line(branchy)
    assert not analysis.straight_line(side_effect)
    assert not analysis.straight_line(writes_attribute)
    assert not analysis.straight_line(lambda x: x)
    assert not analysis.straight_line(torch.tanh)
    assert not analysis.straight_line(passthrough)  # nothing to batch: no block
    assert not analysis.straight_line(pair_up)


def passthrough(a, b):
    return a


def pair_up(a, b):
    c = a
    return (c, b)


@acrobat.autobatch
def carries(x, n):
    """Helpers without any operation, called with Python values and lazy tensors."""
    picks = [passthrough(i, n) for i in range(n)]
    h, k = pair_up(torch.tanh(x), len(picks))
    return passthrough(h * k, None), sum(picks)


def test_helpers_without_operations_run_as_written():
    xs = [torch.randn(3, generator=torch.Generator().manual_seed(s)) for s in range(5)]
    with torch.no_grad():
        stats = check_map(carries, xs, n=6)
    # the helpers are called as written: no dispatcher put in front of them (its call
    # cost ~1 us each with Python values), no block node
    for helper in (passthrough, pair_up):
        assert analysis._code_key(helper) not in analysis._DISPATCHERS
    assert not any(name.startswith("block:") for name in stats.by_op), stats.by_op


def test_discovery_follows_containers_and_control_flow_functions():
    found = {f.__name__ for f in analysis.discover(run)}
    assert found == {"cell", "reads_value"}


@acrobat.autobatch
def run_through_a_module(xs):
    h = torch.zeros(4)
    for x in xs:
        h = module_cells.TAIL.shrink(module_cells.step(x, h))
    return h


def uses_library_modules(x):
    return json.dumps(os.path.join("a", "b")) if x is None else x


def test_discovery_follows_the_users_modules_only():
    assert {f.__name__ for f in analysis.discover(run_through_a_module)} == {"step", "shrink"}
    assert analysis.discover(uses_library_modules) == []
    assert analysis._user_module(module_cells)
    for library in (json, os, torch, torch.nn.functional, acrobat, random):
        assert not analysis._user_module(library)


def test_cells_reached_through_a_module_record_one_node_per_call():
    rng = random.Random(1)
    seqs = [[torch.randn(4) for _ in range(rng.randint(1, 5))] for _ in range(6)]
    with torch.no_grad():
        stats = check_map(run_through_a_module, seqs)
    calls = sum(len(s) for s in seqs)
    assert stats.by_op["block:step"][1] == calls
    assert stats.by_op["block:shrink"][1] == calls


def test_auto_blocks_match_eager_and_record_one_node_per_cell_call():
    rng = random.Random(0)
    seqs = [[torch.randn(4) for _ in range(rng.randint(1, 6))] for _ in range(8)]
    with torch.no_grad():
        stats = check_map(run, seqs)
        with acrobat.config.override(AUTO_BLOCKS=False):
            per_op = check_map(run, seqs)
    calls = sum(len(s) for s in seqs)
    assert stats.by_op["block:cell"][1] == calls
    assert stats.nodes < per_op.nodes
    # reads_value demands a value: it fell back to per-op recording and still matches
    assert "block:reads_value" not in stats.by_op


def test_code_is_restored_after_map_and_after_errors():
    original = cell.__code__

    @acrobat.autobatch
    def boom(x):
        cell(x, x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        boom.map([torch.randn(4)])
    assert cell.__code__ is original
    run.map([[torch.randn(4)]])
    assert cell.__code__ is original
    # and the function still works eagerly, with its own code
    x = torch.ones(4)
    torch.testing.assert_close(cell(x, torch.zeros(4)), run.eager([x])[0][0])


def test_side_effects_are_not_coarsened():
    @acrobat.autobatch
    def f(x):
        return side_effect(torch.tanh(x))

    COUNTER.clear()
    f.map([torch.randn(3) for _ in range(4)])
    assert len(COUNTER) == 4  # once per instance, as in the eager loop


def draws_noise(x):
    return x + torch.randn(4)


def uses_python_random(x):
    return x * random.random()


def test_random_functions_are_not_coarsened():
    assert not analysis.straight_line(draws_noise)
    assert not analysis.straight_line(uses_python_random)


# ---- value parameters: a parameter read only as torch.tensor(p) ----------------------------

VOCAB, DIM = 11, 3
vectors = nn.Embedding(VOCAB, DIM)
matrices = nn.Embedding(VOCAB, DIM * DIM)


def word(word_id):
    """Both lookups of a word, by the instance's Python int: a value parameter."""
    index = torch.tensor(word_id)
    return vectors(index), matrices(index).reshape(DIM, DIM)


def shifted(x, amount):
    """A value parameter that is not a lookup: the block's program runs."""
    return x * 2 + torch.tensor(amount)


def word_and_count(word_id):
    """word_id is also read as a number: not a value parameter."""
    return vectors(torch.tensor(word_id)) * (word_id + 1)


def fold(ids, k):
    v, m = word(ids[k])  # one call, then a call with control flow: no region around it
    if k == len(ids) - 1:
        return m @ v
    rest = fold(ids, k + 1)
    return m @ v + rest * 0.5 + word_and_count(ids[k])


@acrobat.autobatch
def phrase(ids):
    return fold(ids, 0)


@acrobat.autobatch
def shift_each(instance):
    x, amount = instance
    return shifted(x, amount)


def test_value_parameters_found_from_source():
    calls = {}
    for fn in (word, shifted, word_and_count):
        dispatcher = analysis.AutoBlock(fn)
        analysis._value_params(fn, dispatcher)
        calls[fn.__name__] = dispatcher.values
    assert calls == {"word": (0,), "shifted": (1,), "word_and_count": ()}


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), min_size=1, max_size=6),
    st.lists(
        st.floats(-4, 4, allow_subnormal=False) | st.integers(-4, 4) | st.booleans(),
        min_size=1,
        max_size=6,
    ),
)
def test_value_parameters_match_eager_with_one_node_per_call(ids, amounts):
    with torch.no_grad():
        stats = check_map(phrase, ids)
        with acrobat.config.override(VALUE_PARAMS=False):
            off = check_map(phrase, ids)
        shifts = check_map(shift_each, [(torch.randn(3), a) for a in amounts])
    calls = sum(len(x) for x in ids)
    assert stats.by_op["block:word"][1] == calls
    assert "block:word_and_count" not in stats.by_op  # no lazy argument: op by op
    assert "block:word" not in off.by_op and stats.nodes < off.nodes
    assert shifts.by_op["block:shifted"][1] == len(amounts)  # not a lookup: its program ran


@pytest.mark.skipif(acrobat.tensor._native is None, reason="the C extension is not built")
def test_value_parameter_calls_of_numbers_take_the_c_path(monkeypatch):
    """Ints and floats at value positions are made data nodes and recorded by the C call
    slot (AutoBlock._call, the Python path, is not entered; bools take it)."""
    entered = []
    real = analysis.AutoBlock._call
    monkeypatch.setattr(
        analysis.AutoBlock, "_call", lambda self, *a, **k: entered.append(a) or real(self, *a, **k)
    )
    with torch.no_grad():
        for _ in range(2):  # the second map: trace hits
            check_map(shift_each, [(torch.randn(3), a) for a in (1, 2.5, -3, 0.0)])
        assert not entered
        check_map(shift_each, [(torch.randn(3), a) for a in (True, False)])
    assert entered


def _in_place_answers(monkeypatch) -> list:
    """executor._lookup_in_place's answers during the test (True: a batch ran in place)."""
    from acrobat import executor

    answers = []
    original = executor._lookup_in_place

    def spy(*args):
        answers.append(original(*args))
        return answers[-1]

    monkeypatch.setattr(executor, "_lookup_in_place", spy)
    return answers


def test_lookup_blocks_copy_nothing_and_train(monkeypatch):
    in_place = _in_place_answers(monkeypatch)
    ids = [[1, 2, 3], [4], [10, 5, 1]]
    params = (vectors.weight, matrices.weight)
    for p in params:
        p.grad = None
    for x in ids:
        phrase.eager(x).sum().backward()
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    torch.stack(phrase.map(ids)).sum().backward()
    assert in_place and all(in_place)  # the word batches took the in-place path
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)
        p.grad = None


table = nn.Embedding(VOCAB, DIM)


def looked_up(word_id):
    """A lookup block of its own (the tests below leave ``word``'s state alone)."""
    return table(torch.tensor(word_id))


@acrobat.autobatch
def looked_up_sum(ids):
    return torch.stack([looked_up(i) for i in ids]).sum(0)


@settings(max_examples=25, deadline=None)
@given(ids=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), min_size=1))
def test_lookups_read_in_place_equal_eager(ids):
    """Every word id in range: each batch of lookup blocks is done in place (its ids read
    from the torch.tensor(i) nodes, in C with the extension) and the results equal
    eager's."""
    from acrobat import executor

    answers = []
    original = executor._lookup_in_place

    def spy(*args):
        answers.append(original(*args))
        return answers[-1]

    executor._lookup_in_place = spy
    try:
        with torch.no_grad():
            got = looked_up_sum.map(ids)
            want = [looked_up_sum.eager(x) for x in ids]
    finally:
        executor._lookup_in_place = original
    assert answers and all(answers)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("bad", [-1, VOCAB, True])
def test_a_word_id_the_table_has_no_row_for_runs_the_program(monkeypatch, bad):
    """An id out of range (or a bool, which embedding refuses) is not looked up in place:
    the block's program runs and reports it, naming the instance, as eager raises."""
    in_place = _in_place_answers(monkeypatch)
    ids = [[1, 2], [bad], [3]]
    with pytest.raises((IndexError, RuntimeError)):  # (eager's embedding refuses it)
        looked_up_sum.eager(ids[1])
    with torch.no_grad(), pytest.raises(Exception, match="instance 1"):
        looked_up_sum.map(ids)
    if bad is True:  # a bool tensor: refused when recorded (torch 2.13's shape inference),
        # or a batch of its own, after the valid ids' (in place), that fails (torch 2.11)
        assert not in_place or in_place[-1] is False
    else:  # in the valid ids' batch, which runs the program
        assert not any(in_place)
    with torch.no_grad():
        for g, x in zip(looked_up_sum.map([[1, 2], [3]]), [[1, 2], [3]]):  # usable again
            torch.testing.assert_close(g, looked_up_sum.eager(x))


def test_bad_value_parameter_names_the_instance():
    with pytest.raises(Exception, match="instance 1") as info:
        phrase.map([[1], [VOCAB + 3], [2]])
    message = str(info.value)
    assert "block:word in word (test_analysis.py, line" in message and "index" in message
    assert phrase.map([[1], [2]])[1].shape == (DIM,)  # usable again


def ramp(x, n):
    """n read only as torch.tensor(n), but as a size: the value block cannot trace it."""
    return x[:3] * torch.arange(torch.tensor(n))[:3].float()


@acrobat.autobatch
def ramps(instance):
    x, n = instance
    return ramp(x, n)


def test_value_parameter_the_body_needs_as_a_number_falls_back_to_the_block():
    xs = [(torch.randn(5), n) for n in (4, 6, 4)]
    with torch.no_grad():
        stats = check_map(ramps, xs)
    assert stats.by_op["block:ramp"][1] == len(xs)  # its trace keeps torch.tensor(n) real


def test_value_parameter_given_a_non_number_runs_as_written():
    @acrobat.autobatch
    def f(x):
        return shifted(x, [1.0, 2.0, 3.0])  # a list: torch.tensor(list) in the body

    with torch.no_grad():
        check_map(f, [torch.randn(3) for _ in range(4)])


padded = nn.Embedding(VOCAB, DIM, padding_idx=0)


def padded_word(word_id):
    """padding_idx changes the gradient (row 0 gets none): not a lookup done in place."""
    return padded(torch.tensor(word_id))


@acrobat.autobatch
def padded_sum(ids):
    return (
        torch.stack([padded_word(i) for i in ids]).sum(0) if len(ids) > 1 else padded_word(ids[0])
    )


def test_lookup_with_a_gradient_option_runs_its_program(monkeypatch):
    in_place = _in_place_answers(monkeypatch)
    ids = [[0, 2], [3], [0]]
    for x in ids:
        padded_sum.eager(x).sum().backward()
    want = padded.weight.grad.clone()
    padded.weight.grad = None
    got = padded_sum.map(ids)
    torch.stack(got).sum().backward()
    assert not in_place  # no Lookup was made for the block
    torch.testing.assert_close(padded.weight.grad, want)
    padded.weight.grad = None


# ---- lookup calls: f(torch.tensor(x)) outside outlined runs --------------------------------

table = nn.Embedding(VOCAB, DIM)
features = nn.Linear(2, DIM)


def leaf_sum(ids, k, emb):
    """A recursive sum of word vectors; each lookup is a call argument or a return value,
    so no outlined run holds it: analysis rewrites it to ops.lookup_call."""
    if k == len(ids) - 1:
        return emb(torch.tensor(ids[k]))
    return torch.tanh(emb(torch.tensor(ids[k])) + leaf_sum(ids, k + 1, emb) * 0.5)


@acrobat.autobatch
def lookups(ids):
    return leaf_sum(ids, 0, table)


@acrobat.autobatch
def lookups_of(instance):
    ids, emb = instance
    return leaf_sum(ids, 0, emb)


def _callers_of_special_take(monkeypatch) -> list:
    from acrobat import ops

    callers = []
    original = ops._special_take

    def spy(*args):
        callers.append(sys._getframe(1).f_code.co_name)
        return original(*args)

    monkeypatch.setattr(ops, "_special_take", spy)
    return callers


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), min_size=1, max_size=6)
)
def test_lookup_calls_match_eager_and_record_the_same_graph(ids):
    with torch.no_grad():
        on = check_map(lookups, ids)
        with outlined_with(leaf_sum, LOOKUP_CALLS=False):
            off = check_map(lookups, ids)
            assert analysis._OUTLINED[analysis._code_key(leaf_sum)] is None  # nothing else left
    assert on.nodes == off.nodes and on.by_op == off.by_op
    assert on.by_op["take"][1] == sum(len(x) for x in ids)


def test_lookup_calls_take_the_direct_path_and_train(monkeypatch):
    callers = _callers_of_special_take(monkeypatch)
    ids = [[1, 2, 3], [4], [10, 5, 1]]
    for x in ids:
        lookups.eager(x).sum().backward()
    want = table.weight.grad.clone()
    table.weight.grad = None
    torch.stack(lookups.map(ids)).sum().backward()
    assert callers == ["lookup_call"] * 7  # every lookup, none through nn.Embedding.forward
    torch.testing.assert_close(table.weight.grad, want)
    table.weight.grad = None


def test_lookup_calls_keep_hooks_and_options(monkeypatch):
    """A hook, a gradient option or a module that is not an embedding: called as written."""
    callers = _callers_of_special_take(monkeypatch)
    hooked = nn.Embedding(VOCAB, DIM)
    seen = []
    hooked.register_forward_hook(lambda m, args, out: seen.append(1))
    padded = nn.Embedding(VOCAB, DIM, padding_idx=0)
    with torch.no_grad():
        check_map(lookups_of, [([1, 2], hooked), ([3], hooked)])
        assert len(seen) == 2 * 3  # map and eager: each lookup ran the module's hook
        check_map(lookups_of, [([0, 2], padded), ([3, 0], padded)])
        check_map(lookups_of, [([[1.0, 2.0], [0.5, 1.0]], features), ([[3.0, 4.0]], features)])
    assert "lookup_call" not in callers


def test_bad_lookup_call_names_the_instance_and_line():
    with pytest.raises(IndexError, match="instance 1") as info:
        lookups.map([[1], [VOCAB + 3], [2]])
    assert "test_analysis.py" in str(info.value) and "leaf_sum" in str(info.value)
    assert lookups.map([[1], [2]])[1].shape == (DIM,)  # usable again


# ---- factory calls: torch.zeros(n) / torch.ones(n) outside runs -------------------------


def chain_of(instance):
    """A loop whose state restarts from a constant made inside the instance each step."""
    x, steps = instance
    out = torch.ones(x.shape[0])
    for k in range(steps):
        h = torch.zeros(x.shape[0])
        if k % 2:
            h = h + x
        out = out * 0.5 + torch.tanh(h + out)
    return out


chains = acrobat.autobatch(chain_of)


def _callers_of_hoist(monkeypatch) -> list:
    from acrobat import graph

    callers = []
    original = graph.hoist

    def spy(func, args, kwargs):
        callers.append(getattr(func, "__name__", func))
        return original(func, args, kwargs)

    monkeypatch.setattr(graph, "hoist", spy)
    monkeypatch.setattr(acrobat.fibers, "hoist", spy)
    return callers


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(1, 6))
def test_factory_calls_match_eager_and_record_the_same_graph(steps, dim):
    xs = [torch.randn(dim) for _ in steps]
    # (counted with its operators, the last line would be a region of its own)
    with torch.no_grad(), outlined_with(chain_of, OPERATORS=False):
        on = check_map(chains, list(zip(xs, steps)))
        with outlined_with(chain_of, FACTORY_CALLS=False):
            off = check_map(chains, list(zip(xs, steps)))
            assert analysis._OUTLINED[analysis._code_key(chain_of)] is None  # nothing else left
    assert on.nodes == off.nodes and on.by_op == off.by_op


def test_factory_calls_hoist_once_per_map_and_share_the_constant(monkeypatch):
    assert analysis.outline(chain_of) is not None
    callers = _callers_of_hoist(monkeypatch)
    xs = [torch.randn(3) for _ in range(4)]
    with torch.no_grad():
        check_map(chains, [(x, 5) for x in xs])
    # the mode's handler hoisted each constant once: one zeros and one ones for the map
    assert callers.count("zeros") == 1 and callers.count("ones") == 1


def test_factory_calls_outside_a_map_make_fresh_tensors():
    a = acrobat.ops.factory_call(torch.zeros, 3)
    b = acrobat.ops.factory_call(torch.zeros, 3)
    assert a is not b and torch.equal(a, torch.zeros(3))
    a[0] = 1  # a real tensor of its own, as torch.zeros gives
    assert torch.equal(b, torch.zeros(3))
    assert acrobat.ops.factory_call(torch.ones, (2, 2)).shape == (2, 2)  # sizes as written


def test_factory_call_hits_in_c_give_the_constant_the_python_path_gives():
    from acrobat.tensor import _native

    if _native is None:
        pytest.skip("acrobat._native is not built")
    assert acrobat.ops.factory_call is _native.factory_call
    python_path = acrobat.ops.factory_call_py
    seen = []

    def f(x):
        first = acrobat.ops.factory_call(torch.zeros, 3)  # (hoisted by the mode's handler)
        again = acrobat.ops.factory_call(torch.zeros, 3)  # the cache hit in C
        seen.append((again is first, python_path(torch.zeros, 3) is first))
        ones = acrobat.ops.factory_call(torch.ones, 3)
        sized = acrobat.ops.factory_call(torch.ones, (3,))  # not an int: as written
        return x + again + ones + sized

    xs = [torch.randn(3) for _ in range(3)]
    got = acrobat.autobatch(f).map(xs)
    assert seen == [(True, True)] * 3
    for g, x in zip(got, xs):
        torch.testing.assert_close(g, x + 2)


def write_into_constant(x):
    for _ in range(2):
        m = torch.zeros(3)
        y = x + m  # a recorded op reads the constant before the write
        m[0] = 1.0  # rewritten: m = put_item(1.0, m, 0), the instance's own tensor
    return y + m


def _set_ones(t):
    t.fill_(1.0)  # (m.fill_(1.0) in fill_constant itself is rebound: analysis.AUGMENTED)


def fill_constant(x):
    for _ in range(2):
        m = torch.zeros(3)
        y = x + m  # a recorded op reads the constant before the write
        _set_ones(m)  # in place into the map's shared constant (y must not see it)
    return y


def test_item_writes_into_a_constant_read_before_are_the_instances_own():
    f = acrobat.autobatch(write_into_constant)
    assert analysis.outline(write_into_constant) is not None
    xs = [torch.randn(3), torch.randn(3)]
    got = f.map(xs)
    for g, x in zip(got, xs):
        torch.testing.assert_close(g, write_into_constant(x))


def test_factory_calls_keep_the_in_place_write_check():
    f = acrobat.autobatch(fill_constant)
    assert analysis.outline(fill_constant) is not None
    with pytest.raises(acrobat.AcrobatError, match="modified in place"):
        f.map([torch.randn(3), torch.randn(3)])


Pair = collections.namedtuple("Pair", "squashed scaled")


def top(x):
    """Straight-line, so an automatic block, returning torch.return_types.max."""
    return (x * 2).max(-1)


@acrobat.block
def pair(x):
    """A block returning a namedtuple of tensors."""
    return Pair(torch.tanh(x), x * 3)


@acrobat.autobatch
def uses_structs(x):
    values, indices = top(x)
    p = pair(x)
    return values + p.squashed.sum(), indices, p.scaled


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 5))
def test_blocks_return_structseqs_and_namedtuples(batch, rows, cols):
    """A straight-line helper returning ``x.max(-1)`` (a torch.return_types.max) failed
    the map ("a block returned a max"), as did a block returning a namedtuple: both are
    rebuilt from the block's outputs."""
    gen = torch.Generator().manual_seed(batch * 100 + rows * 10 + cols)
    xs = [torch.randn(rows, cols, generator=gen) for _ in range(batch)]
    with torch.no_grad():
        stats = check_map(uses_structs, xs)
        got = uses_structs.map(xs)
    assert stats.batches_of("block:top") == 1 and stats.batches_of("block:pair") == 1
    assert all(g[1].dtype == torch.int64 for g in got)
