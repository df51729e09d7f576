"""A buffer filled a row per step inside a loop (analysis.LOOP_ROW_WRITES, ops.put_rows).

``states = torch.zeros(n, h)`` then ``for t in range(n): h = cell(x[t], h); states[t] =
h`` writes in place in eager. Recorded as written, every step's write was a put of the
whole buffer (inside a traced loop body: O(n^2) copies) and the counter was read as an
index, so the loop was no scan. Where the loop touches the buffer only by that write,
the values are appended to a list and written after the loop in one op. These tests
hold the rewritten loops to eager (values, gradients, errors) and check which loops are
left as written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import acrobat
from acrobat import analysis, ops
from acrobat.errors import AcrobatError
from tests.helpers import check_grads, check_map, outlined_with
from tests.test_index_loops import DIM, MODEL, _tokens  # (the same RNN and token lists)


def forward(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], DIM)
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        states[t] = h
    return m.out(states).sum(0), states


def backward(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(len(tokens), DIM)
    h = torch.zeros(DIM)
    for t in reversed(range(len(tokens))):
        h = m.cell(x[t], h)
        states[t] = torch.tanh(h)
    return states


def from_one(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], DIM)  # row 0 stays zero: a write of some rows
    h = torch.zeros(DIM)
    for t in range(1, x.shape[0]):
        h = m.cell(x[t], h)
        states[t] = h
    return states


def counting_down(tokens, m):
    x = m.emb(tokens)
    out = torch.ones(x.shape[0], DIM)
    h = torch.zeros(DIM)
    for t in range(x.shape[0] - 1, -1, -1):
        h = m.cell(x[t], h)
        out[t] = h * 2
    return out


def a_scalar_per_row(tokens, m):
    x = m.emb(tokens)
    scores = torch.zeros(x.shape[0], 2)  # each row gets one number, broadcast
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        scores[t] = h.sum()
    return scores


def another_dtype(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], DIM, dtype=torch.float64)  # the write converts
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        states[t] = h
    return states


def negative_positions(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], DIM)
    h = torch.zeros(DIM)
    for t in range(-x.shape[0], 0):
        h = m.cell(x[t], h)
        states[t] = h
    return states


def two_buffers(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], DIM)
    logits = torch.zeros(x.shape[0], 3)
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        states[t] = h
        logits[t] = m.out(h)
    return states, logits


def copy_rows(tokens, m):
    x = m.emb(tokens)
    out = torch.zeros(len(tokens), DIM)
    for t in range(len(tokens)):
        out[t] = x[t]  # (no op in the loop: its rows stacked after it)
    return out


FUNCTIONS = [
    forward,
    copy_rows,
    backward,
    from_one,
    counting_down,
    a_scalar_per_row,
    another_dtype,
    negative_positions,
]


def _deferred(fn) -> int:
    """How many loops of ``fn`` write their buffer after the loop."""
    outlined = analysis.outline(fn)
    if outlined is None:
        return 0
    return sum(name.startswith("_acrobat_rw") for name in outlined.code.co_varnames)


def twice(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], DIM)
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        states[t] = h
        states[t] = h * 2  # (the buffer's second write: the loop as written)
    return states


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_a_buffer_filled_in_a_loop_is_written_after_it(fn):
    assert _deferred(fn) == 1, fn.__name__


def test_two_buffers_filled_in_one_loop_are_written_after_it():
    assert _deferred(two_buffers) == 2
    f = acrobat.autobatch(two_buffers)
    with torch.no_grad():
        stats = check_map(f, _tokens([3, 5, 2], 1), m=MODEL)
    assert [b for k, (b, _) in stats.by_op.items() if k.startswith("scan:")] == [1]


@settings(max_examples=14, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=7),
    seed=st.integers(0, 999),
    which=st.sampled_from(FUNCTIONS),
)
def test_buffers_filled_in_loops_give_the_eager_results(lengths, seed, which):
    f = acrobat.autobatch(which)
    with torch.no_grad():
        check_map(f, _tokens(lengths, seed), m=MODEL)


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(2, 8), min_size=1, max_size=5), seed=st.integers(0, 99))
def test_buffers_filled_in_loops_train(lengths, seed):
    for fn in (backward, from_one, a_scalar_per_row):
        f = acrobat.autobatch(fn)
        check_grads(f, _tokens(lengths, seed), MODEL, atol=1e-5, m=MODEL)


def test_the_filled_buffer_is_one_scan_and_no_per_step_copies():
    """The loop is a scan over positions (one batch of loop nodes for every length)
    and the buffer one stack, where each step's write was a put of the whole buffer."""
    f = acrobat.autobatch(forward)
    with torch.no_grad():
        stats = check_map(f, _tokens([3, 7, 4, 9, 2], 5), m=MODEL)
    scans = [b for k, (b, _) in stats.by_op.items() if k.startswith("scan:")]
    assert scans == [1], stats.by_op
    assert not {"put", "put_into"} & stats.by_op.keys(), stats.by_op
    with outlined_with(forward, LOOP_ROW_WRITES=False), torch.no_grad():
        before = check_map(acrobat.autobatch(forward), _tokens([3, 7, 4, 9, 2], 5), m=MODEL)
    assert before.nodes > stats.nodes, (before.by_op, stats.by_op)


# ---- loops left as written --------------------------------------------------------------


def reads_the_buffer(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], DIM)
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h) + states.sum(0)
        states[t] = h
    return states


def breaks_early(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], DIM)
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        states[t] = h
        if t == 2:
            break
    return states


def in_a_try(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], DIM)
    h = torch.zeros(DIM)
    try:
        for t in range(x.shape[0] + 1):  # the last write fails; the rows before stay
            h = m.cell(x[min(t, x.shape[0] - 1)], h)
            states[t] = h
    except IndexError:
        pass
    return states


def conditional_write(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], DIM)
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        if t % 2 == 0:
            states[t] = h
    return states


def updates_in_place(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], DIM)
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        states[t] = h
        h.mul_(0.5)
    return states


LEFT = [reads_the_buffer, breaks_early, in_a_try, conditional_write, twice]


@pytest.mark.parametrize("fn", LEFT, ids=lambda f: f.__name__)
def test_what_is_left_as_written(fn):
    """The buffer read in the loop, a loop that can end early, one inside a
    try (the rows written before an error stay), a write not made at every step, two
    writes of one buffer a step: the writes stay at their steps, with the eager results."""
    assert _deferred(fn) == 0, fn.__name__
    f = acrobat.autobatch(fn)
    with torch.no_grad():
        check_map(f, _tokens([3, 5, 2], 7), m=MODEL)


def test_an_update_in_place_in_the_loop_is_left_as_written():
    assert _deferred(updates_in_place) == 0
    f = acrobat.autobatch(updates_in_place)
    refused = r"h.mul_\(0.5\)\) cannot be recorded"
    with pytest.raises(AcrobatError, match=refused), torch.no_grad():
        f.map(_tokens([3, 5], 2), m=MODEL)


def halve(h):
    h.mul_(0.5)  # an update in place of its argument, which the buffer holds a copy of
    return h


def callee_updates_in_place(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], DIM)
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        states[t] = h
        h = halve(h)
    return states


def test_an_update_in_place_by_a_callee_is_refused_as_before():
    """The rewrite cannot see into ``halve``: the value it keeps is marked read (as the
    write at its step marked it), so the update in place is refused with the error the
    loop as written gives, never a buffer holding the updated value."""
    assert _deferred(callee_updates_in_place) == 1
    data = _tokens([3, 5], 2)
    with pytest.raises(AcrobatError, match="cannot be recorded") as new, torch.no_grad():
        acrobat.autobatch(callee_updates_in_place).map(data, m=MODEL)
    with outlined_with(callee_updates_in_place, LOOP_ROW_WRITES=False), torch.no_grad():
        assert _deferred(callee_updates_in_place) == 0
        with pytest.raises(AcrobatError, match="cannot be recorded") as before:
            acrobat.autobatch(callee_updates_in_place).map(data, m=MODEL)
    assert type(new.value) is type(before.value)


def too_short(tokens, m):
    x = m.emb(tokens)
    states = torch.zeros(3, DIM)  # fewer rows than steps for longer inputs
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        states[t] = h
    return states


def test_a_position_out_of_range_raises_eagers_error_naming_the_instance():
    data = _tokens([2, 4, 3], 5)
    message = "index 3 is out of bounds for dimension 0 with size 3"
    with pytest.raises(IndexError, match=message):
        too_short(data[1], MODEL)
    assert _deferred(too_short) == 1
    f = acrobat.autobatch(too_short)
    with pytest.raises(IndexError, match=message) as info, torch.no_grad():
        f.map(data, m=MODEL)
    assert any("instance 1" in note for note in info.value.__notes__)
    assert "in too_short: states[t] = h" in str(info.value)  # (the write's line)


def test_put_rows_writes_what_the_loop_would():
    """ops.put_rows on real tensors, every path: the stack of a whole cover, one write
    of some rows, and the write per value (a value that broadcasts, another dtype)."""
    cases = [
        (torch.zeros(4, 3), range(4), False, [torch.randn(3) for _ in range(4)]),
        (torch.zeros(4, 3), range(4), True, [torch.randn(3) for _ in range(4)]),
        (torch.ones(4, 3), range(1, 4, 2), False, [torch.randn(3) for _ in range(2)]),
        (torch.zeros(4, 3), range(-4, 0), False, [torch.randn(3) for _ in range(4)]),
        (torch.zeros(4, 3), range(4), False, [torch.randn(()) for _ in range(4)]),
        (torch.zeros(4, 3, dtype=torch.float64), range(4), False, [torch.randn(3)] * 4),
        (torch.zeros(4, 3), range(0), False, []),
    ]
    for x, span, reverse, values in cases:
        want = x.clone()
        for t, v in zip(reversed(span) if reverse else span, values):
            want[t] = v
        got = ops.put_rows(x.clone(), span, values, reverse)
        torch.testing.assert_close(got, want)
    with pytest.raises(IndexError):
        ops.put_rows(torch.zeros(2, 3), range(3), [torch.randn(3)] * 3, False)


def test_keep_row_copies_a_real_tensor():
    v = torch.randn(3)
    kept = ops.keep_row(v)
    v.mul_(2)
    assert not torch.equal(kept, v)
    assert ops.keep_row(2.5) == 2.5
