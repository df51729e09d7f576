"""Writes into part of a tensor in instance code: ``out[t] = h`` into a buffer made with
``torch.zeros``, ``mask[i] = -inf`` after each choice, ``counts[k] += 1``. Analysis
rewrites them to ``x = put_item(v, x, i)`` for locals the function owns (acrobat/ops.py,
the section on ``x[index] = value``); the map equals the eager loop, batches the writes
across instances and positions, and trains."""

from __future__ import annotations

import ast
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import analysis
from tests.helpers import assert_close_tree, check_grads, check_map, outlined_with

DIM = 5
torch.manual_seed(0)
CELL = nn.GRUCell(DIM, DIM)
SCORE = nn.Linear(DIM, DIM)


@acrobat.autobatch
def encode_into_buffer(xs, cell=CELL):
    """An RNN writing each state into a buffer made up front (a common idiom)."""
    out = torch.zeros(xs.shape[0], DIM)
    h = torch.zeros(DIM)
    for t in range(xs.shape[0]):
        h = cell(xs[t], h)
        out[t] = h
    return out


@acrobat.autobatch
def columns_and_slices(xs, cell=CELL):
    """Writes by column, by a slice of a row, and accumulated."""
    out = torch.zeros(DIM, xs.shape[0])
    tail = torch.ones(xs.shape[0], 3)
    h = torch.zeros(DIM)
    for t in range(xs.shape[0]):
        h = cell(xs[t], h)
        out[:, t] = h
        tail[t, 1:] = h[:2] * 2
        tail[t] += 1.0
    return out.sum(1) + tail.sum(0).sum()


@acrobat.autobatch
def point_in_turn(points, score=SCORE):
    """A pointer network's loop: choose the best unvisited row (a value read), mask it."""
    e = torch.tanh(score(points))
    h = e.mean(0)
    mask = torch.zeros(points.shape[0])
    order = []
    for _ in range(points.shape[0]):
        scores = e @ h + mask
        i = int(scores.argmax())
        order.append(i)
        mask[i] = float("-inf")
        h = torch.tanh(h + e[i])
    return torch.tensor(order), h


@acrobat.autobatch
def count_labels(labels, n: int = 4):
    counts = torch.zeros(n)
    for k in labels.tolist():
        counts[k] += 1
    return counts / labels.shape[0]


lengths = st.lists(st.integers(1, 7), min_size=1, max_size=6)


def sentences(ns: list, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, DIM, generator=g) for n in ns]


@settings(max_examples=8, deadline=None)
@given(ns=lengths, seed=st.integers(0, 2**16))
def test_a_buffer_filled_in_a_loop_equals_eager_and_batches(ns, seed):
    """The writes at their steps, as written (LOOP_ROW_WRITES off: with it, this loop
    writes its buffer after the loop, tests/test_row_writes.py; a loop it leaves, such
    as one that also reads the buffer, writes like this)."""
    with outlined_with(encode_into_buffer, LOOP_ROW_WRITES=False):
        _buffer_filled_at_each_step(ns, seed)


def _buffer_filled_at_each_step(ns, seed):
    xs = sentences(ns, seed)
    with torch.no_grad():
        check_map(encode_into_buffer, xs)  # (the first map makes the traces of each size)
        stats = check_map(encode_into_buffer, xs)
    # the cell and the write are one block per step, the step's int a per-instance index
    # (one trace for all steps: not a trace per int)
    (body,) = [k for k in stats.by_op if k.startswith("block:encode_into_buffer")]
    assert stats.by_op[body][1] == sum(ns), stats.by_op
    # padded over the lengths: at most a batch per call of the longest instance and per
    # instance (the scheduler may level the first steps by what follows them)
    assert stats.by_op[body][0] <= max(ns) + len(ns), stats.by_op
    assert not any(k.startswith("put") for k in stats.by_op), stats.by_op
    check_grads(encode_into_buffer, xs, CELL, atol=1e-5)


@acrobat.autobatch
def copy_into_buffer(xs):
    out = torch.zeros(xs.shape[0], DIM)
    for t in range(xs.shape[0]):
        out[t] = xs[t]  # (a write alone: recorded op by op)
    return out


@settings(max_examples=8, deadline=None)
@given(ns=lengths, seed=st.integers(0, 2**16))
def test_writes_op_by_op_go_into_the_buffer_the_one_before_made(ns, seed):
    xs = sentences(ns, seed)
    with outlined_with(copy_into_buffer, LOOP_ROW_WRITES=False), torch.no_grad():
        stats = check_map(copy_into_buffer, xs)
    writes = {k: v for k, v in stats.by_op.items() if k.startswith("put")}
    assert sum(nodes for _, nodes in writes.values()) == sum(ns), stats.by_op
    # every write after the first goes into the buffer the one before made
    assert writes.get("put_into", (0, 0))[1] == sum(ns) - len(ns), stats.by_op


@settings(max_examples=8, deadline=None)
@given(ns=lengths, seed=st.integers(0, 2**16))
def test_columns_slices_and_accumulated_items(ns, seed):
    xs = sentences(ns, seed)
    with torch.no_grad():
        check_map(columns_and_slices, xs)
    check_grads(columns_and_slices, xs, CELL, atol=1e-4, rtol=1e-4)  # (gradients of ~300)


@settings(max_examples=8, deadline=None)
@given(ns=st.lists(st.integers(2, 8), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_a_mask_written_after_each_choice(ns, seed):
    g = torch.Generator().manual_seed(seed)
    data = [torch.randn(n, DIM, generator=g) for n in ns]
    with torch.no_grad():
        got = point_in_turn.map(data)
    for (order, h), points in zip(got, data):
        want_order, want_h = point_in_turn.eager(points)
        assert torch.equal(order, want_order)
        assert sorted(order.tolist()) == list(range(points.shape[0]))  # each row once
        torch.testing.assert_close(h, want_h, atol=1e-5, rtol=1e-5)


@given(labels=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9), min_size=1, max_size=5))
def test_counts_accumulated_by_item(labels):
    check_map(count_labels, [torch.tensor(ls) for ls in labels])


def _owned(src: str) -> set:
    node = ast.parse(textwrap.dedent(src)).body[0]
    local = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return analysis._owned_tensors(node, local)


def test_only_tensors_nothing_else_can_see_are_rewritten():
    # made here, read by value only: rewritten
    assert _owned("""
        def f(x, i):
            out = torch.zeros(3)
            y = x * out + out.sum()
            out[i] = 1.0
            return y, out
    """) == {"out"}
    # a layer's result used at once: the layer may hand back its argument, but nothing
    # keeps it
    assert _owned("""
        def f(m, i):
            out = torch.zeros(3)
            out[i] = 1.0
            return F.cross_entropy(m.out(out[:-1]), i) + m.out(out).sum()
    """) == {"out"}
    for kept in [
        "y = out",  # an alias sees the write in eager
        "y = m.drop(out)",  # (dropout in eval mode returns its argument)
        "y = m.flat(out[0])",  # (nn.Flatten returns a view)
        "y = out[0]",  # a view too
        "y = out.view(3)",
        "ys.append(out)",  # a list holding it
        "y = helper(out)",  # code that could keep it
        "y = torch.narrow(out, 0, 0, 1)",
        "del out",
        "y = F.dropout(out, 0.5, False)",  # (returns its input itself when not training)
        "y = out.mul_(2)",
    ]:
        src = f"""
            def f(x, i, ys, m):
                out = torch.zeros(3)
                {kept}
                out[i] = 1.0
                return out
        """
        assert _owned(src) == set(), kept
    # a parameter (the caller's tensor) and a tensor not made here
    assert _owned("def f(out, i):\n    out[i] = 1.0\n    return out") == set()
    assert _owned("def f(x, i):\n    out = x * 2\n    out[i] = 1.0\n    return out") == set()


def test_writes_the_rewrite_leaves_behave_as_before():
    @acrobat.autobatch
    def f(x, i):
        y = x * 2  # not a tensor the function owns: the write is taken in place while
        y[i] = 0.0  # nothing has read y yet
        return y

    xs = [torch.randn(4) for _ in range(3)]
    got = f.map(xs, [0, 2, 3])
    assert_close_tree(got, [f.eager(x, i) for x, i in zip(xs, [0, 2, 3])])


def test_an_index_out_of_range_names_the_instance_and_line():
    @acrobat.autobatch
    def f(x, i):
        out = torch.zeros(3)
        out[i] = x.sum()
        return out

    # (the write and the sum are one block, the int i a per-instance index into it: the
    # error comes when it runs, naming the block's lines and the instance)
    with pytest.raises(IndexError, match=r"f \(test_item_writes.py, lines \d+-\d+\) failed for "
                       r"instance 1: index 5 is out of bounds for dimension 0 with size 3"):
        f.map([torch.randn(2), torch.randn(2)], [0, 5])

    @acrobat.autobatch
    def g(x, i):
        out = torch.zeros(3)
        if i >= 0:  # (the write alone: recorded as it runs, checked there)
            out[i] = x
        return out

    with pytest.raises(IndexError, match=r"index 5 is out of bounds for dimension 0 with size 3 "
                       r"\(instance 1, at .*test_item_writes.py"):
        g.map([torch.randn(()), torch.randn(())], [0, 5])


def test_an_index_the_batch_cannot_take_is_refused_clearly():
    @acrobat.autobatch
    def f(x):
        out = torch.zeros(4, 2)
        out[None, 0] = x[:2]  # a new axis
        return out

    with pytest.raises(acrobat.AcrobatError, match=r"index entry None"):
        f.map([torch.randn(3)])


INDEX = torch.tensor([0, 2])
ROWS = torch.tensor([True, False, True, False])


@acrobat.autobatch
def assorted_writes(x):
    by_index = torch.zeros(4)
    by_index[INDEX] = x[:2]  # a real index tensor, the same for every instance
    by_mask = torch.zeros(4, 2)
    by_mask[ROWS] = x[:2] * 2  # a real mask: each chosen row gets the value
    seen = torch.zeros(4, dtype=torch.bool)
    seen[int(x.argmax())] = True  # a bool buffer, an int read from the values
    row = torch.zeros(2, 3)
    row[1] = torch.tensor([1.0, 2.0, 3.0])  # all real: one constant for every instance
    return by_index, by_mask, seen, row + x[:3].sum()


@given(st.lists(st.integers(0, 2**16), min_size=1, max_size=6))
def test_real_indices_masks_bool_buffers_and_constant_writes(seeds):
    xs = [torch.randn(4, generator=torch.Generator().manual_seed(s)) for s in seeds]
    check_map(assorted_writes, xs)


@st.composite
def _writes(draw):
    """(shape, index, value shape): a basic index of ints (negative too), slices (steps
    too) and at most one ``...``, and a value that broadcasts to the part it writes (a
    suffix of its shape, with a leading one, or a scalar)."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    entries: list = []
    for n in shape[: draw(st.integers(1, len(shape)))]:
        if draw(st.booleans()):
            entries.append(draw(st.integers(-n, n - 1)))
        else:
            entries.append(
                slice(
                    draw(st.sampled_from([None, 0, 1])),
                    draw(st.sampled_from([None, n, n - 1])),
                    draw(st.sampled_from([None, 1, 2])),
                )
            )
    if len(shape) > 1 and draw(st.booleans()):
        entries.insert(draw(st.integers(0, len(entries))), Ellipsis)
    index = tuple(entries) if len(entries) != 1 else entries[0]
    part = torch.zeros(shape)[index].shape
    kind = draw(st.sampled_from(["scalar", "suffix", "leading one", "whole"]))
    cut = draw(st.integers(0, len(part)))
    value = {"scalar": (), "suffix": part[cut:], "leading one": (1, *part), "whole": part}[kind]
    return shape, index, tuple(value)


@settings(max_examples=40, deadline=None)
@given(write=_writes(), batch=st.integers(1, 4))
def test_any_basic_index_and_broadcast_value_equals_eager(write, batch):
    from acrobat.ops import put

    shape, index, value_shape = write

    @acrobat.autobatch
    def f(x, v):
        return put(x * 1, index, v * 2)  # (x * 1: a lazy tensor the write may not alter)

    xs = [torch.randn(shape) for _ in range(batch)]
    vs = [torch.randn(value_shape) for _ in range(batch)]
    for got, x, v in zip(f.map(xs, vs), xs, vs):
        assert torch.equal(got, f.eager(x, v))


@acrobat.autobatch
def write_positions(inst):
    x, picks = inst
    out = torch.zeros(5, 2)
    out[picks] = x[: len(picks)] * 2  # a list of this instance's positions
    where = torch.tensor(picks)
    out[where] += x.sum()  # a tensor of them
    return out


@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4, unique=True), min_size=1,
                max_size=5))  # fmt: skip
def test_writes_at_a_list_or_tensor_of_positions(picks):
    data = [
        (torch.randn(4, 2, generator=torch.Generator().manual_seed(len(p))), p) for p in picks
    ]
    check_map(write_positions, data)


V_BEAM = 7
BEAM_EMB = nn.Embedding(V_BEAM, DIM)
BEAM_OUT = nn.Linear(DIM, V_BEAM)


def beam_search(x, k=3, steps=4):
    """A beam search: the beams' scores start as a constant written in place (all but the
    first beam at -inf) and are then rebound to each step's top-k, so the function does
    not own them; they were made inside the run before the loop, the trace's one tensor
    for every instance, and every instance wrote into it (an error at the end of the map)."""
    h = torch.tanh(x).expand(k, DIM).contiguous()
    scores = torch.zeros(k)
    scores[1:] = float("-inf")
    tok = torch.zeros(k, dtype=torch.long)
    alive = torch.ones(k, dtype=torch.bool)
    for _ in range(steps):
        h = CELL(BEAM_EMB(tok), h)
        lp = torch.log_softmax(BEAM_OUT(h), -1)
        lp[~alive] = 0.0
        top, idx = (scores[:, None] + lp).view(-1).topk(k)
        src, tok = idx // V_BEAM, idx % V_BEAM
        h = h[src]
        alive = alive[src] & (tok != 0)
        scores = top
        if not bool(alive.any()):
            break
    return scores, tok


@given(st.integers(1, 6), st.integers(0, 2**16))
def test_a_constant_written_in_place_and_rebound_later(batch, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(DIM, generator=g) for _ in range(batch)]
    with torch.no_grad():
        check_map(acrobat.autobatch(beam_search), xs)


def test_constants_written_in_place_are_made_outside_runs():
    node = ast.parse(textwrap.dedent("""
        def f(x, y):
            s = torch.zeros(3)
            s[1:] = 1.0
            t = torch.ones(2)
            t.mul_(2)
            u = torch.zeros(2)
            s = x * u
            return s, t, u
    """)).body[0]
    assert analysis._written_in_place(node) == {"s", "t"}
