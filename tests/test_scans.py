"""Counted loops recorded as one node per instance (config.AUTO_SCANS, acrobat/scan.py):
what is outlined as a scan, and that a batch of scans with any trip counts gives the
eager loop's results, values and gradients."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import acrobat
from acrobat import analysis, config

DIM = 6
torch.manual_seed(0)
cell = nn.Linear(2 * DIM, DIM)
gates = nn.Linear(2 * DIM, 4 * DIM)


def elman(x, h, n: int):
    for _ in range(n):
        h = torch.tanh(cell(torch.cat([x, h])))
    return h


def lstm(x, h, c, n: int):
    for _ in range(n):
        i, f, o, u = gates(torch.cat([x, h])).chunk(4)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(u)
        h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


class Item(NamedTuple):
    x: torch.Tensor
    n: int


def from_zero(item: Item):
    h = torch.zeros(DIM)  # a real tensor at first: the first step runs as written
    for _ in range(item.n):
        h = torch.tanh(cell(torch.cat([item.x, h])))  # item.x is read once, at the loop
    return h


@acrobat.autobatch
def run_elman(x, h, n):
    return elman(x, h, n)


@acrobat.autobatch
def run_lstm(x, h, c, n):
    return lstm(x, h, c, n)


@acrobat.autobatch
def run_from_zero(item):
    return from_zero(item)


def _scan_of(fn) -> analysis.ScanBlock:
    """The one loop of ``fn`` outlined as a scan (the loop kept to run as written has its
    body outlined as a region too)."""
    (scan,) = [r for r in analysis.outline(fn).regions if isinstance(r, analysis.ScanBlock)]
    return scan


def _close(got, want):
    for g, w in zip(got, want):
        if isinstance(w, tuple):
            for gi, wi in zip(g, w):
                torch.testing.assert_close(gi, wi, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def _vectors(seed: int, count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return list(torch.randn(count, DIM, generator=gen))


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=7),
    seed=st.integers(0, 1000),
)
def test_scans_with_any_trip_counts_give_the_eager_results(counts, seed):
    xs, hs, cs = (_vectors(seed + k, len(counts)) for k in range(3))
    with torch.no_grad():
        got, stats = run_lstm.map(xs, hs, cs, counts, stats=True)
        want = [run_lstm.eager(x, h, c, n) for x, h, c, n in zip(xs, hs, cs, counts)]
        _close(got, want)
        got = run_elman.map(xs, hs, counts)
        _close(got, [run_elman.eager(x, h, n) for x, h, n in zip(xs, hs, counts)])
    # three inputs per instance, and one node per loop of two or more steps (a single
    # step is the body as one block)
    loops = sum(1 for n in counts if n >= 1)
    assert stats.nodes == 3 * len(counts) + loops


def test_a_batch_of_scans_runs_each_step_on_the_rows_still_looping():
    counts = [3, 7, 0, 1, 7, 2]
    xs, hs = _vectors(1, 6), _vectors(2, 6)
    with torch.no_grad():
        got, stats = run_elman.map(xs, hs, counts, stats=True)
        off = config.AUTO_SCANS
        config.AUTO_SCANS = False
        try:
            stepwise, step_stats = run_elman.map(xs, hs, counts, stats=True)
        finally:
            config.AUTO_SCANS = off
    want = [run_elman.eager(x, h, n) for x, h, n in zip(xs, hs, counts)]
    _close(got, want)
    _close(stepwise, want)
    assert stats.by_op["scan:elman (test_scans.py, line 27)"] == [1, 4]  # one batch
    assert step_stats.nodes - stats.nodes == sum(counts) - 4 - 1  # 20 steps vs 4 + 1 nodes
    assert stats.gathers < step_stats.gathers


def test_state_that_starts_real_and_attributes_of_inputs():
    items = [Item(x, n) for x, n in zip(_vectors(3, 5), [4, 0, 1, 2, 6])]
    want = [run_from_zero.eager(item) for item in items]
    with torch.no_grad():
        got, stats = run_from_zero.map(items, stats=True)
        with config.override(CONSTANT_STATES=False):
            peeled, peeled_stats = run_from_zero.map(items, stats=True)
    _close(got, want)
    _close(peeled, want)
    # the zeros state is read as a shared row: one scan node per loop of 2+ steps (4, 2, 6)
    (scans,) = [v for k, v in stats.by_op.items() if k.startswith("scan:from_zero")]
    assert scans == [1, 3]
    # peeled: the first step alone, then a scan for each loop with 2+ steps left (4, 6)
    (scans,) = [v for k, v in peeled_stats.by_op.items() if k.startswith("scan:from_zero")]
    assert scans == [1, 2]
    assert peeled_stats.nodes > stats.nodes


def test_the_loop_invariant_gemm_is_hoisted_out_of_the_loop():
    xs, hs = _vectors(4, 4), _vectors(5, 4)
    with torch.no_grad():
        run_elman.map(xs, hs, [5, 5, 3, 2])
    scan = _scan_of(elman)
    trace = next(iter(scan.step.block.cache.values()))
    assert trace.scan and trace.scan.split is not None  # W_x x + b: once per row


def test_gradients_flow_through_a_scan():
    counts = [3, 0, 5, 1]
    xs = [x.requires_grad_() for x in _vectors(6, 4)]
    hs = _vectors(7, 4)
    got = run_elman.map(xs, hs, counts)
    torch.stack(got).square().sum().backward()
    # (an x its instance never reads: None, as in eager, when its input node is dropped
    # unread (scheduler.prune_dead), else zeros from its batch)
    grads = [None if x.grad is None else x.grad.clone() for x in xs]
    weight = cell.weight.grad.clone()
    for x in xs:
        x.grad = None
    cell.weight.grad = None
    want = [run_elman.eager(x, h, n) for x, h, n in zip(xs, hs, counts)]
    torch.stack(want).square().sum().backward()
    for g, x in zip(grads, xs):  # (None in eager where x is not used)
        if g is None:
            assert x.grad is None
            continue
        want_grad = x.grad if x.grad is not None else torch.zeros_like(x)
        torch.testing.assert_close(g, want_grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight, cell.weight.grad, atol=1e-5, rtol=1e-5)
    cell.weight.grad = cell.bias.grad = None


def counter_read(h, n):
    for i in range(n):
        h = torch.tanh(h * i)
    return h


def with_else(h, n):
    for _ in range(n):
        h = torch.tanh(h)
    else:
        h = h + 1
    return h


def temp_read_after(h, n):
    for _ in range(n):
        a = torch.tanh(h)
        h = a * 2
    return h + a


def temp_inside(h, n):
    for _ in range(n):
        a = torch.tanh(h)
        h = a * 2
    return h


def reads_before_bound(h, n):
    if n > 100:
        g = h
    for _ in range(n):
        g = torch.tanh(g)  # g may be unbound here: the loop stays as written
    return h


def deletes(h, n):
    for _ in range(n):
        h = torch.tanh(h)
    del n
    return h


def test_what_is_outlined_as_a_scan():
    for fn in (counter_read, with_else, reads_before_bound, deletes):
        outlined = analysis.outline(fn)
        regions = outlined.regions if outlined else []
        scans = [r for r in regions if isinstance(r, analysis.ScanBlock)]
        assert not scans, fn.__name__
    scan = _scan_of(temp_inside)
    assert isinstance(scan, analysis.ScanBlock) and scan.carried == 1
    hs = _vectors(8, 3)
    assert scan(range(4), (), hs[0]) is None  # outside a map: the loop runs as written
    rewritten = type(temp_inside)(analysis.outline(temp_inside).code, temp_inside.__globals__)
    for h, n in zip(hs, [0, 1, 4]):
        torch.testing.assert_close(rewritten(h, n), temp_inside(h, n))


@acrobat.autobatch
def run_temp_read_after(h, n):
    return temp_read_after(h, n)


@settings(max_examples=10, deadline=None)
@given(counts=st.lists(st.integers(1, 6), min_size=1, max_size=6), seed=st.integers(0, 999))
def test_a_temporary_read_after_the_loop_is_its_last_value(counts, seed):
    """``a``, assigned in the loop and read after it, is one more output a step
    (analysis.SCAN_LASTS): the loop is a scan, and ``a`` its last step's value."""
    scan = _scan_of(temp_read_after)
    assert scan.carried == 1 and scan.appends == 1
    _check_loop(run_temp_read_after, temp_read_after, counts, seed)


def _check_loop(run, fn, counts: list, seed: int) -> None:
    """``run.map`` over vectors and step counts equals ``fn`` instance by instance, and
    its loop is a scan where one runs more than one step (loops of one step run as
    written)."""
    hs = _vectors(seed, len(counts))
    with torch.no_grad():
        got, stats = run.map(hs, counts, stats=True)
    _close(got, [fn(h, n) for h, n in zip(hs, counts)])
    if max(counts) > 1:
        assert any(k.startswith("scan:") for k in stats.by_op), stats.by_op


def test_a_temporary_of_a_loop_without_steps_stays_unbound():
    with pytest.raises(UnboundLocalError):
        temp_read_after(torch.zeros(DIM), 0)
    with pytest.raises(UnboundLocalError), torch.no_grad():
        run_temp_read_after.map(_vectors(1, 2), [3, 0])


def with_previous(h, n):
    prev = torch.zeros(DIM)
    for _ in range(n):
        prev, h = h, torch.tanh(cell(torch.cat([h, prev])))  # (prev: the step's argument)
    return h + prev


@acrobat.autobatch
def run_with_previous(h, n):
    return with_previous(h, n)


@settings(max_examples=8, deadline=None)
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=6), seed=st.integers(0, 999))
def test_a_state_set_to_the_previous_state_is_carried(counts, seed):
    """``prev, h = h, ...`` hands on an argument of the step: the outlined body gives a
    clone of it (what a Scan can carry), and the loop is a scan."""
    _check_loop(run_with_previous, with_previous, counts, seed)


class Cells(NamedTuple):
    step: object


def reads_a_value(h):
    if float(h.sum()) > 0:  # a value demand: cannot be traced as a loop body
        return torch.tanh(h)
    return -h


def calls_through_cells(h, n, cells):
    for _ in range(n):
        h = cells.step(h)
    return h


@acrobat.autobatch
def run_cells(h, n):
    return calls_through_cells(h, n, Cells(reads_a_value))


def test_a_body_that_reads_a_value_runs_as_written():
    hs = _vectors(9, 4)
    counts = [3, 2, 0, 4]
    with torch.no_grad():
        got = run_cells.map(hs, counts)
    _close(got, [run_cells.eager(h, n) for h, n in zip(hs, counts)])
    scan = _scan_of(calls_through_cells)
    assert scan.disabled


def bad_shape(x, h, n: int, k: int):
    for _ in range(n):
        h = torch.tanh(h + x.reshape(k, -1).sum(0))
    return h


@acrobat.autobatch
def run_bad_shape(x, h, n, k):
    return bad_shape(x, h, n, k)


def test_an_error_inside_a_scan_names_the_instance():
    xs, hs = _vectors(10, 3), _vectors(11, 3)
    with pytest.raises(Exception) as info, torch.no_grad():
        run_bad_shape.map(xs, hs, [3, 3, 3], [1, 4, 1])
    assert "instance 1" in str(info.value)


# ---- loops over sequences, with outputs appended at every step ----------------------------

wx = nn.Linear(DIM, DIM)
wh = nn.Linear(DIM, DIM, bias=False)


def rnn_states(xs, h):
    states = []
    for x in xs:
        h = torch.tanh(wx(x) + wh(h))  # wx(x) depends on the element alone: hoisted
        states.append(h)
        states.append(h * 2)
    return states, h


def counted_outputs(h, n: int):
    outs = []
    for _ in range(n):
        h = torch.sigmoid(h) * 2 - 0.5
        outs.append(torch.tanh(h))
    return outs


@acrobat.autobatch
def run_rnn(xs, h):
    states, last = rnn_states(xs, h)
    return (torch.stack(states) if states else torch.zeros(0, DIM)), last


@acrobat.autobatch
def run_counted_outputs(h, n):
    outs = counted_outputs(h, n)
    return torch.stack(outs).sum(0) if outs else h


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(0, 8), min_size=1, max_size=6), seed=st.integers(0, 1000))
def test_loops_over_sequences_give_the_eager_results(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    seqs = [list(torch.randn(t, DIM, generator=gen)) for t in lengths]
    hs = _vectors(seed, len(lengths))
    with torch.no_grad():
        got, stats = run_rnn.map(seqs, hs, stats=True)
        _close(got, [run_rnn.eager(xs, h) for xs, h in zip(seqs, hs)])
        got = run_counted_outputs.map(hs, lengths)
        _close(got, [run_counted_outputs.eager(h, n) for h, n in zip(hs, lengths)])
    scans = [v for name, v in stats.by_op.items() if name.startswith("scan:rnn_states")]
    if any(t >= 2 for t in lengths):
        assert scans == [[1, sum(1 for t in lengths if t >= 2)]], stats.by_op


def test_a_sequence_scan_hoists_the_input_projection_and_trains():
    seqs = [list(torch.randn(t, DIM)) for t in (5, 2, 7)]
    seqs = [[x.requires_grad_() for x in xs] for xs in seqs]
    hs = _vectors(12, 3)
    got = run_rnn.map(seqs, hs)
    sum(s.square().sum() + last.sum() for s, last in got).backward()
    grads = [x.grad.clone() for xs in seqs for x in xs]
    weight = wx.weight.grad.clone()
    for xs in seqs:
        for x in xs:
            x.grad = None
    wx.weight.grad = None
    want = [run_rnn.eager(xs, h) for xs, h in zip(seqs, hs)]
    sum(s.square().sum() + last.sum() for s, last in want).backward()
    for g, x in zip(grads, [x for xs in seqs for x in xs]):
        torch.testing.assert_close(g, x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight, wx.weight.grad, atol=1e-5, rtol=1e-5)
    wx.weight.grad = wx.bias.grad = wh.weight.grad = None
    scan = _scan_of(rnn_states)
    trace = next(t for t in scan.step.block.cache.values() if t.scan)
    assert trace.scan.split is not None and trace.scan.hoisted_pos == 0  # per element


def reads_its_list(xs, h):
    states = [h]
    for x in xs:
        h = torch.tanh(x + states[-1])  # reads the list it appends to
        states.append(h)
    return states


def element_after(xs, h):
    for x in xs:
        h = torch.tanh(x + h)
    return h + x


def test_what_is_outlined_as_a_sequence_scan():
    for fn in (reads_its_list, element_after):
        outlined = analysis.outline(fn)
        regions = outlined.regions if outlined else []
        scans = [r for r in regions if isinstance(r, analysis.ScanBlock)]
        assert not scans, fn.__name__
    scan = _scan_of(rnn_states)
    assert isinstance(scan, analysis.ScanBlock) and not scan.counted and scan.appends == 2


def test_scans_keep_working_across_many_maps_and_models():
    """Real tensors a map makes (a state's torch.zeros) are not remembered per map, so a
    model first seen after many maps is still scanned."""
    hs = _vectors(13, 3)
    with torch.no_grad():
        first = nn.Linear(2 * DIM, DIM)
        for _ in range(70):
            run_other_cell.map(hs, [4, 5, 6], [first] * 3)
        other = nn.Linear(2 * DIM, DIM)
        _, stats = run_other_cell.map(hs, [4, 5, 6], [other] * 3, stats=True)
    assert any(name.startswith("scan:") for name in stats.by_op), stats.by_op
    assert len(_scan_of(from_zero_with).step.code_like) < 10


def from_zero_with(x, n: int, lin):
    h = torch.zeros(DIM)
    for _ in range(n):
        h = torch.tanh(lin(torch.cat([x, h])))
    return h


@acrobat.autobatch
def run_other_cell(x, n, lin):
    return from_zero_with(x, n, lin)


def both_directions(xs):
    fwd, bwd = [], []
    h = g = torch.zeros(DIM)
    for x in xs:
        h = torch.tanh(wx(x) + wh(h))
        fwd.append(h)
    for x in reversed(xs):
        g = torch.tanh(wx(x) - wh(g))
        bwd.append(g)
    return torch.stack([f * b for f, b in zip(fwd, reversed(bwd))])


@acrobat.autobatch
def run_both(xs):
    return both_directions(xs)


def test_a_loop_over_reversed_elements_is_a_scan():
    seqs = [list(torch.randn(t, DIM)) for t in (4, 1, 6, 3)]
    with torch.no_grad():
        got, stats = run_both.map(seqs, stats=True)
    _close(got, [run_both.eager(xs) for xs in seqs])
    scans = [v for name, v in stats.by_op.items() if name.startswith("scan:")]
    assert sorted(scans) == [[1, 3], [1, 3]], stats.by_op  # each direction, 3 of 4 rows
    regions = analysis.outline(both_directions).regions
    assert [r.reverse for r in regions if isinstance(r, analysis.ScanBlock)] == [False, True]


# ---- comprehensions and loops without state: every element at once ---------------------

emb = nn.Embedding(30, DIM)
out = nn.Linear(2 * DIM, DIM)


def tagger(ids, h, scale):
    words = [emb(torch.tensor(i)) for i in ids]  # Python ints: one tensor per batch
    states = []
    for x in words:
        h = torch.tanh(wx(x) + wh(h))
        states.append(h)
    # an element of each list per step, and a per-instance operand (scale) of every step
    logits = [F.log_softmax(out(torch.cat([x, s])) * scale, -1) for x, s in zip(words, states)]
    return logits


@acrobat.autobatch
def run_tagger(ids, h, scale):
    logits = tagger(ids, h, scale)
    return torch.stack(logits) if logits else torch.zeros(0, DIM)


@settings(max_examples=20, deadline=None)
@given(
    sentences=st.lists(st.lists(st.integers(0, 29), max_size=8), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_comprehensions_are_scans_over_every_element_at_once(sentences, seed):
    hs, scales = _vectors(seed, len(sentences)), _vectors(seed + 1, len(sentences))
    with torch.no_grad():
        got, stats = run_tagger.map(sentences, hs, scales, stats=True)
        with acrobat.config.override(AUTO_SCANS=False):
            stepwise, step_stats = run_tagger.map(sentences, hs, scales, stats=True)
    want = [run_tagger.eager(*args) for args in zip(sentences, hs, scales)]
    _close(got, want)
    _close(stepwise, want)
    long = sum(1 for ids in sentences if len(ids) >= 2)
    by_op = stats.by_op
    # the two comprehensions and the loop between them (from a lazy h): one node per
    # instance of 2+ words each, one batch each
    scans = [v for name, v in by_op.items() if name.startswith("scan:tagger")]
    assert scans == ([[1, long]] * 3 if long else []), by_op
    # the word lookups of those instances are the comprehension's: no take node
    assert by_op.get("take", [0, 0])[1] == sum(len(ids) for ids in sentences if len(ids) < 2)
    if long:
        assert stats.nodes < step_stats.nodes


def uses_id_otherwise(ids):
    return [emb(torch.tensor(i)) * i for i in ids]  # i read as a number too


def filtered(xs):
    return [torch.tanh(x) for x in xs if x is not None]


def two_loops(xs):
    return [torch.tanh(x) for x in xs for _ in range(2)]


def shadows(xs, x):
    ys = [torch.tanh(x) for x in xs]  # the comprehension's x, not the parameter
    return ys, x


def test_what_comprehensions_are_outlined_as_scans():
    for fn in (uses_id_otherwise, filtered, two_loops):
        outlined = analysis.outline(fn)
        regions = outlined.regions if outlined else []
        assert not [r for r in regions if isinstance(r, analysis.ScanBlock)], fn.__name__
    scans = [r for r in analysis.outline(tagger).regions if isinstance(r, analysis.ScanBlock)]
    words, loop, logits = scans
    assert words.values == (0,) and words.sequences == 1 and words.carried == 0
    assert not loop.values and loop.sequences == 1 and loop.carried == 1
    assert not logits.values and logits.sequences == 2 and logits.carried == 0
    xs = _vectors(14, 3)
    rewritten = type(shadows)(analysis.outline(shadows).code, shadows.__globals__)
    got, x = rewritten(xs, xs[0] * 3)
    want, x_want = shadows(xs, xs[0] * 3)
    _close(got, want)
    torch.testing.assert_close(x, x_want)


@acrobat.autobatch
def run_shadows(xs, x):
    ys, x = shadows(xs, x)
    return torch.stack(ys) + x


def test_a_comprehension_variable_does_not_leak_and_trains():
    seqs = [[x.requires_grad_() for x in _vectors(15 + t, t)] for t in (3, 5, 2)]
    hs = _vectors(18, 3)
    got = run_shadows.map(seqs, hs)
    sum(g.square().sum() for g in got).backward()
    grads = [x.grad.clone() for xs in seqs for x in xs]
    for xs in seqs:
        for x in xs:
            x.grad = None
    want = [run_shadows.eager(xs, h) for xs, h in zip(seqs, hs)]
    _close(got, want)
    sum(w.square().sum() for w in want).backward()
    for g, x in zip(grads, [x for xs in seqs for x in xs]):
        torch.testing.assert_close(g, x.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(analysis._native is None, reason="the C dispatcher needs the extension")
@settings(max_examples=15, deadline=None)
@given(
    sentences=st.lists(st.lists(st.integers(0, 29), min_size=2, max_size=8), min_size=2,
                       max_size=8),
    seed=st.integers(0, 1000),
)  # fmt: skip
def test_the_c_dispatcher_takes_the_common_loops_and_matches_python(sentences, seed):
    """With the extension, a loop's dispatch runs in C (analysis.ScanBlock's call slot)
    once the body's trace is valid for the map: only the first call of each loop site in
    a map reaches the Python dispatcher (ScanBlock._scan_call), whatever the loop: over
    numbers read as tensors, over lazy tensors with a carried state, over a zip, counted,
    reversed (every loop of two steps or more: shorter ones run as written, from Python).
    The results equal the Python dispatcher's and eager's."""
    hs, scales = _vectors(seed, len(sentences)), _vectors(seed + 1, len(sentences))
    counts = [len(ids) for ids in sentences]
    gen = torch.Generator().manual_seed(seed)
    seqs = [list(torch.randn(len(ids), DIM, generator=gen)) for ids in sentences]
    SB = analysis.ScanBlock
    python_calls = []
    real = SB._scan_call

    def counting(self, *args):
        python_calls.append(self)
        return real(self, *args)

    def run_all():
        return (
            run_tagger.map(sentences, hs, scales),
            run_rnn.map(seqs, hs),
            run_counted_outputs.map(hs, counts),
            run_both.map(seqs),
        )

    with torch.no_grad():
        run_all()  # (traces made: the maps below find them)
        SB._scan_call = counting
        try:
            fast = run_all()
        finally:
            SB._scan_call = real
        SB.__call__ = SB._scan_call  # the whole dispatch in Python
        try:
            slow = run_all()
        finally:
            del SB.__call__
        want = (
            [run_tagger.eager(*a) for a in zip(sentences, hs, scales)],
            [run_rnn.eager(*a) for a in zip(seqs, hs)],
            [run_counted_outputs.eager(*a) for a in zip(hs, counts)],
            [run_both.eager(xs) for xs in seqs],
        )
    for got, py, ref in zip(fast, slow, want):
        _close(got, ref)
        _close(py, ref)
    sites = {id(s) for s in python_calls}
    assert len(python_calls) == len(sites), "a loop site reached Python twice in one map"


_table = nn.Embedding(10, DIM)


@acrobat.autobatch
def looks_up_then_edits(words):
    xs = [_table(torch.tensor(w)) for w in words]  # a loop over Python numbers
    words[0] = 9  # the instance's list changes before the loop has run
    words.append(0)
    return torch.stack(xs)


def test_a_loop_over_numbers_reads_them_as_they_were():
    batch = [[1, 2, 3], [4, 5], [6]]
    with torch.no_grad():
        want = [looks_up_then_edits.eager(list(w)) for w in batch]
        got, stats = looks_up_then_edits.map([list(w) for w in batch], stats=True)
    assert any(name.startswith("scan:") for name in stats.by_op)  # (the loop outlined)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


class TokenReader(nn.Module):
    """An RNN written over a per-instance token tensor: ``for t in tokens``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(21)
        self.emb = nn.Embedding(30, 8)
        self.cell = nn.GRUCell(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        h = torch.zeros(8)
        for t in tokens:
            h = self.cell(self.emb(t).unsqueeze(0), h.unsqueeze(0))[0]
        return self.head(h)


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.integers(2, 9), min_size=1, max_size=8), seed=st.integers(0, 99))
def test_a_loop_over_a_tensors_rows_is_a_scan(lengths, seed):
    """The rows of a per-instance tensor (unbound once, as the loop as written would) are
    the loop's elements: one scan per instance, one batch for every length (a block per
    step before)."""
    from tests.helpers import check_grads, check_map

    g = torch.Generator().manual_seed(seed)
    model = TokenReader()
    f = acrobat.autobatch(model)
    data = [torch.randint(30, (n,), generator=g) for n in lengths]
    with torch.no_grad():
        stats = check_map(f, data)
    assert [b for k, (b, _) in stats.by_op.items() if k.startswith("scan:")] == [1], stats
    check_grads(f, data, model, atol=1e-5)
