"""Loops over positions (``for t in range(n): ... x[t] ...``) recorded as scans
(analysis.INDEX_LOOPS, ``_Rewriter._index_loop``).

The most common way to write an RNN by hand reads the input at each position,
``h = cell(x[t], h)``. Its counter is read, so it was not a counted scan, and it ran op
by op: every step's ops, every instance's (an nn.GRUCell call alone is four nodes a
step). Where the counter is read only as ``x[t]`` of locals the body reads no other way,
the loop is the same as one over the rows ``x[t]`` reads, and is rewritten to that: a
scan over sequences, one node per instance, one batch for all lengths. These tests hold
the rewritten loops to the eager results, values and gradients, for the range forms
people write, and check what is left as written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import analysis
from tests.helpers import check_grads, check_map

DIM = 5
VOCAB = 13


class PositionRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.cell = nn.GRUCell(DIM, DIM)
        self.out = nn.Linear(DIM, 3)


torch.manual_seed(0)
MODEL = PositionRNN()


def forward(tokens, m):
    x = m.emb(tokens)
    h = torch.zeros(DIM)
    states = []
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        states.append(h)
    return torch.stack(states), h


def backward(tokens, m):
    x = m.emb(tokens)
    h = torch.zeros(DIM)
    states = []
    for t in reversed(range(len(x))):
        h = m.cell(x[t], h)
        states.append(m.out(h))
    return torch.stack(states)


def counting_down(tokens, m):
    x = m.emb(tokens)
    h = torch.zeros(DIM)
    for t in range(x.shape[0] - 1, -1, -1):
        h = m.cell(x[t], h)
    return h


def every_other_from_one(tokens, m):
    x = m.emb(tokens)
    h = torch.zeros(DIM)
    for t in range(1, x.shape[0], 2):
        h = torch.tanh(m.cell(x[t], h) + h)
    return h


def two_sequences(tokens, m):
    x = m.emb(tokens)
    y = torch.sigmoid(m.out(x))
    h = torch.zeros(DIM)
    scores = []
    for t in range(len(x)):
        h = m.cell(x[t], h)
        scores.append((m.out(h) * y[t]).sum())
    return torch.stack(scores)


def from_a_list(tokens, m):
    ids = tokens.tolist()  # a Python list: its items are numbers
    h = torch.zeros(DIM)
    for t in range(len(ids)):
        h = m.cell(m.emb(torch.tensor(ids[t])), h)
    return h


FUNCTIONS = [forward, backward, counting_down, every_other_from_one, two_sequences, from_a_list]


def _tokens(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (n,), generator=g) for n in lengths]


def _scan_batches(stats) -> list:
    return [b for k, (b, _) in stats.by_op.items() if k.startswith("scan:")]


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_a_loop_over_positions_is_a_scan(fn):
    outlined = analysis.outline(fn)
    assert outlined is not None
    scans = [r for r in outlined.regions if isinstance(r, analysis.ScanBlock)]
    assert len(scans) == 1 and not scans[0].counted, fn.__name__


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 9), min_size=1, max_size=7),
    seed=st.integers(0, 999),
    which=st.sampled_from(FUNCTIONS),
)
def test_loops_over_positions_give_the_eager_results(lengths, seed, which):
    f = acrobat.autobatch(which)
    data = _tokens(lengths, seed)
    with torch.no_grad():
        stats = check_map(f, data, m=MODEL)
    if which is not from_a_list and which is not every_other_from_one:
        # one loop node per instance, every length in one batch (op by op before: a
        # batch per step of each op)
        assert _scan_batches(stats) == [1], stats.by_op


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(2, 8), min_size=1, max_size=5), seed=st.integers(0, 99))
def test_loops_over_positions_train(lengths, seed):
    for fn in (backward, two_sequences):
        f = acrobat.autobatch(fn)
        check_grads(f, _tokens(lengths, seed), MODEL, atol=1e-5, m=MODEL)


def test_short_loops_and_no_steps():
    f = acrobat.autobatch(forward)
    data = _tokens([1, 3, 1, 2], 3)  # loops of 0 or 1 steps are no scans: as written
    with torch.no_grad():
        check_map(f, data, m=MODEL)
    g = acrobat.autobatch(every_other_from_one)  # lengths 1-2: no step or one
    with torch.no_grad():
        check_map(g, _tokens([1, 2, 5], 4), m=MODEL)


def index_after(tokens, m):
    x = m.emb(tokens)
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
    return h * t  # the counter's last value


def counter_as_number(tokens, m):
    x = m.emb(tokens)
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h) * (t + 1)
    return h


def sequence_read_otherwise(tokens, m):
    x = m.emb(tokens)
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h) + x.mean(0)
    return h


def sequence_written(tokens, m):
    x = torch.zeros(tokens.shape[0], DIM)
    h = torch.zeros(DIM)
    for t in range(tokens.shape[0]):
        h = m.cell(m.emb(tokens[t]) + x[t], h)
        x[t] = h  # (a write: rewritten to x = put(x, t, h), the counter read as such)
    return x


def range_of_a_call(tokens, m):
    x = m.emb(tokens)
    y = m.out(x)
    h = torch.zeros(DIM)
    for t in range(_steps(x)):
        h = m.cell(x[t], h) * y[t].sum()
    return h


def _steps(x):
    return x.shape[0]


LEFT = [index_after, counter_as_number, sequence_read_otherwise, sequence_written, range_of_a_call]


@pytest.mark.parametrize("fn", LEFT, ids=lambda f: f.__name__)
def test_what_is_left_as_written(fn):
    """The counter read otherwise or after the loop, the sequence read or written
    otherwise in the body, or (two sequences) a range whose arguments a call computes:
    no loop over positions (each would change what the loop reads or does)."""
    outlined = analysis.outline(fn)
    scans = [r for r in (outlined.regions if outlined else []) if isinstance(r, analysis.ScanBlock)]
    assert not scans, fn.__name__
    f = acrobat.autobatch(fn)
    with torch.no_grad():
        check_map(f, _tokens([3, 5, 2], 7), m=MODEL)


def past_the_end(tokens, m):
    x = m.emb(tokens)
    h = torch.zeros(DIM)
    for t in range(x.shape[0] + 1):  # one position too many
        h = m.cell(x[t], h)
    return h


def test_a_position_out_of_range_raises_eagers_error_naming_the_instance():
    data = _tokens([3, 4, 2], 5)
    with pytest.raises(IndexError, match="index 3 is out of bounds for dimension 0 with size 3"):
        past_the_end(data[0], MODEL)
    f = acrobat.autobatch(past_the_end)
    message = "index 3 is out of bounds for dimension 0 with size 3"
    with pytest.raises(IndexError, match=message) as info, torch.no_grad():
        f.map(data, m=MODEL)
    assert any("instance 0" in note for note in info.value.__notes__)
    g = acrobat.autobatch(forward)  # the next map is right
    with torch.no_grad():
        check_map(g, data, m=MODEL)


def test_index_rows_reads_what_the_loop_would():
    x = torch.arange(12.0).reshape(4, 3)
    forms = (
        lambda: range(4),
        lambda: range(3, -1, -1),
        lambda: reversed(range(1, 4)),
        lambda: range(-4, 0),
    )
    for indices in forms:
        got = analysis.index_rows(x, indices())
        want = [x[i] for i in indices()]
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert analysis.index_rows([5, 6, 7], range(2, -1, -1)) == [7, 6, 5]
    with pytest.raises(IndexError, match="index -5 is out of bounds for dimension 0 with size 4"):
        analysis.index_rows(x, range(-5, 0))
    with pytest.raises(IndexError):
        analysis.index_rows([1, 2], range(3))


# ---- a statement that first stacks a list: the stack split off, the rest a run ----------
# (analysis.SPLIT_PARTS). A loop's outputs appended to a list and stacked under a loss
# kept the whole statement out of runs (it reads a list), so the loss ran op by op, a
# batch per length of each op; now ``torch.stack(states)`` is split off before it.


def loss_over_states(tokens, m):
    x = m.emb(tokens)
    h = torch.zeros(DIM)
    states = []
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        states.append(h)
    return torch.nn.functional.cross_entropy(m.out(torch.stack(states)[:-1]), tokens[1:] % 3)


def assigned_then_returned(tokens, m):
    x = m.emb(tokens)
    outs = [torch.tanh(v) for v in x]
    y = m.out(torch.stack(outs)).sum(0) * 2
    return y


def whole_value_is_the_stack(tokens, m):
    outs = [m.emb(v) for v in tokens]
    return torch.stack(outs)  # (nothing to split: the statement is the stack)


@pytest.mark.parametrize(
    "fn", [loss_over_states, assigned_then_returned, whole_value_is_the_stack],
    ids=lambda f: f.__name__,
)
def test_a_stack_of_a_list_is_split_off_the_work_after_it(fn):
    f = acrobat.autobatch(fn)
    data = _tokens([3, 6, 2, 5, 6, 4], 11)
    with torch.no_grad():
        stats = check_map(f, data, m=MODEL)
    # the work after the stack: block nodes, one padded batch for all lengths (before,
    # its ops ran one by one, a batch per length each)
    assert all(v[0] == 1 for k, v in stats.by_op.items() if k.startswith("block:")), stats.by_op
    assert not {"linear", "loss", "sum", "mul", "reshape"} & set(stats.by_op), stats.by_op
    check_grads(f, data, MODEL, atol=1e-5, m=MODEL)


def reads_what_it_appends(tokens, m):
    x = list(m.emb(tokens).unbind(0))
    out = x  # (another name for the list the loop reads: it grows as the loop runs)
    h = torch.zeros(DIM)
    for t in range(2 * len(x) - 1):
        h = m.cell(x[t], h)
        out.append(h)
    return h


def test_a_loop_reading_a_list_it_appends_to_reads_each_row_at_its_step():
    """``x[t]`` reads rows the loop itself appended (through another name): read up
    front, they would not exist yet (an IndexError where eager runs)."""
    outlined = analysis.outline(reads_what_it_appends)
    assert any(isinstance(r, analysis.ScanBlock) for r in outlined.regions)
    f = acrobat.autobatch(reads_what_it_appends)
    with torch.no_grad():
        check_map(f, _tokens([2, 4, 3], 13), m=MODEL)
    assert list(analysis.index_rows([1, 2], range(2), ())) == [1, 2]


# ---- x[t - 1], x[t + 1]: rows at an offset from the counter ------------------------------


def previous_and_next(tokens, m):
    x = m.emb(tokens)
    h = torch.zeros(DIM)
    states = []
    for t in range(1, x.shape[0] - 1):
        h = m.cell(x[t - 1] + x[t + 1] * 0.5 + x[t], h)
        states.append(h)
    return torch.stack(states)


def wrapping_around(tokens, m):
    x = m.emb(tokens)
    y = torch.sigmoid(m.out(x))
    h = torch.zeros(DIM)
    scores = []
    for t in reversed(range(len(x))):
        h = m.cell(x[t - 1], h)  # (t - 1 = -1 at t = 0: the last row, as eager reads it)
        scores.append((m.out(h) * y[t]).sum())
    return torch.stack(scores)


OFFSETS = [previous_and_next, wrapping_around]


@pytest.mark.parametrize("fn", OFFSETS, ids=lambda f: f.__name__)
def test_rows_at_an_offset_are_a_loop_over_positions(fn):
    outlined = analysis.outline(fn)
    assert outlined is not None
    scans = [r for r in outlined.regions if isinstance(r, analysis.ScanBlock)]
    assert len(scans) == 1 and not scans[0].counted, fn.__name__


@settings(max_examples=10, deadline=None)
@given(
    lengths=st.lists(st.integers(4, 9), min_size=1, max_size=6),  # (2 steps or more)
    seed=st.integers(0, 999),
    which=st.sampled_from(OFFSETS),
)
def test_rows_at_an_offset_give_the_eager_results(lengths, seed, which):
    f = acrobat.autobatch(which)
    with torch.no_grad():
        stats = check_map(f, _tokens(lengths, seed), m=MODEL)
    assert _scan_batches(stats) == [1], stats.by_op
    check_grads(f, _tokens(lengths, seed), MODEL, atol=1e-5, m=MODEL)


def one_past(tokens, m):
    x = m.emb(tokens)
    h = torch.zeros(DIM)
    for t in range(x.shape[0]):
        h = m.cell(x[t + 1], h)  # the last step reads past the end
    return h


def test_an_offset_past_the_end_raises_eagers_error():
    data = _tokens([3, 2], 1)
    with pytest.raises(IndexError, match="index 3 is out of bounds for dimension 0 with size 3"):
        one_past(data[0], MODEL)
    with pytest.raises(IndexError, match="index 3 is out of bounds") as info, torch.no_grad():
        acrobat.autobatch(one_past).map(data, m=MODEL)
    assert any("instance 0" in note for note in info.value.__notes__)
    assert analysis.index_rows([5, 6, 7], range(1, 3), (), -1) == [5, 6]
