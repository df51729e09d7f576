"""The Elman recurrence kernel (acrobat_kernels/recurrence.py) against the step-by-step
torch loop, and its use by batched loops (acrobat/scan.py): taken where the loop body is
exactly an Elman step, giving the eager results; not taken under autograd or for other
bodies."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import acrobat
from acrobat import config, scan
from acrobat_kernels import parallel, recurrence

tol = dict(atol=2e-5, rtol=2e-5)


def _reference(h0, c, w, b, active, offsets, per_step):
    """The loop step by step in torch: (states, final) as recurrence.run returns them."""
    h, states, final = h0, [], h0.clone()
    for t, a in enumerate(active):
        ct = c[offsets[t] : offsets[t] + a] if per_step else c[:a]
        h = torch.tanh(F.linear(h[:a], w, b) + ct)
        states.append(h)
        final[:a] = h
    return torch.cat(states), final


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 7), min_size=1, max_size=recurrence.MAX_ROWS // 4),
    n=st.integers(1, 40),
    per_step=st.booleans(),
    bias=st.booleans(),
    spaced=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_the_kernel_gives_the_step_by_step_results(counts, n, per_step, bias, spaced, seed):
    counts = sorted(counts, reverse=True)
    if counts[0] == 0:
        counts[0] = 1  # a batch runs only when some row takes a step
    active = scan.looping(counts)
    offsets = list(itertools.accumulate(active, initial=0))[:-1]
    g = torch.Generator().manual_seed(seed)
    rows = len(counts)
    h0 = torch.randn(rows, n, generator=g)
    wide = torch.randn(n, 2 * n, generator=g) / n**0.5
    w = wide[:, n:] if spaced else wide[:, :n].contiguous()  # a column view: rows spaced
    b = torch.randn(n, generator=g) if bias else None
    c = torch.randn(sum(active) if per_step else rows, n, generator=g)
    assert recurrence.usable(h0, c, w, b)
    states, final = recurrence.run(h0, c, w, b, active, offsets, per_step)
    want_states, want_final = _reference(h0, c, w, b, active, offsets, per_step)
    torch.testing.assert_close(states, want_states, **tol)
    torch.testing.assert_close(final, want_final, **tol)


def test_rows_computed_in_two_parts_equal_one_call():
    """The kernel's row range (r0, r1): rows do not interact, so two parts (two threads)
    write what one call writes, up to the last bits: a row's dot products are summed in
    the order of the row block it falls in (eight, four or one rows per pass over W)."""
    g = torch.Generator().manual_seed(1)
    counts = [6, 5, 5, 3, 2, 0]
    active = scan.looping(counts)
    offsets = list(itertools.accumulate(active, initial=0))[:-1]
    h0, w = torch.randn(6, 9, generator=g), torch.randn(9, 9, generator=g)
    c = torch.randn(sum(active), 9, generator=g)
    whole, whole_final = recurrence.run(h0, c, w, None, active, offsets, True)
    kernel = recurrence._kernel
    meta = torch.tensor([active, offsets], dtype=torch.int64)
    out, final = torch.full_like(whole, float("nan")), torch.full_like(h0, float("nan"))
    for r0, r1 in ((0, 3), (3, 6)):
        kernel(c.data_ptr(), 1, h0.data_ptr(), w.data_ptr(), 9, 0, out.data_ptr(),
               final.data_ptr(), meta.data_ptr(), meta.data_ptr() + 8 * len(active),
               len(active), 6, 9, r0, r1)  # fmt: skip
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, whole_final, atol=1e-5, rtol=1e-5)
    assert not out.isnan().any() and not final.isnan().any()  # every row written
    torch.testing.assert_close(final[5], h0[5])  # a row taking no step keeps h0


@pytest.mark.skipif(not parallel.available(), reason="torch's OpenMP runtime is not libgomp")
@pytest.mark.parametrize(
    "counts", [[3, 3, 2, 1, 1], [9, 8, 8, 8, 5, 5, 4, 2, 0], [7] * 17 + [2] * 23]
)
def test_rows_split_over_torchs_threads_give_the_step_by_step_results(counts, monkeypatch):
    launches = []
    real = parallel.run
    monkeypatch.setattr(parallel, "run", lambda *a: launches.append(a) or real(*a))
    monkeypatch.setattr(recurrence, "PARALLEL_WORK", 0)
    active = scan.looping(counts)
    offsets = list(itertools.accumulate(active, initial=0))[:-1]
    g = torch.Generator().manual_seed(len(counts))
    rows, n = len(counts), 33
    h0, w = torch.randn(rows, n, generator=g), torch.randn(n, n, generator=g) / n**0.5
    b, c = torch.randn(n, generator=g), torch.randn(sum(active), n, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for per_step in (True, False):
            cs = c if per_step else c[:rows]
            got = recurrence.run(h0, cs, w, b, active, offsets, per_step)
            want = _reference(h0, cs, w, b, active, offsets, per_step)
            for g_, w_ in zip(got, want):
                torch.testing.assert_close(g_, w_, **tol)
    finally:
        torch.set_num_threads(threads)
    assert len(launches) == 2


def test_run_refuses_addends_or_states_shorter_than_the_steps():
    h0, w = torch.randn(3, 4), torch.randn(4, 4)
    active, offsets = [3, 2], [0, 3]
    with pytest.raises(ValueError, match="addend rows"):
        recurrence.run(h0, torch.randn(4, 4), w, None, active, offsets, True)  # needs 5
    with pytest.raises(ValueError, match="addend rows"):
        recurrence.run(h0, torch.randn(2, 4), w, None, active, offsets, False)  # needs 3
    with pytest.raises(ValueError, match="states"):
        recurrence.run(h0[:2], torch.randn(5, 4), w, None, active, offsets, True)


def test_usable_only_where_it_is_exactly_the_recurrence():
    h0, c, w, b = torch.randn(4, 8), torch.randn(12, 8), torch.randn(8, 8), torch.randn(8)
    assert recurrence.usable(h0, c, w, b)
    with torch.no_grad():
        assert recurrence.usable(h0, c, nn.Parameter(w), None)  # a module's weight
    assert not recurrence.usable(h0.double(), c.double(), w.double(), b.double())
    assert not recurrence.usable(h0, c, torch.randn(8, 16), b)  # W not square
    assert not recurrence.usable(h0, c, torch.randn(8, 8).t(), b)  # W's columns strided
    assert not recurrence.usable(h0, c.t().contiguous().t(), w, b)  # c not contiguous
    assert not recurrence.usable(h0, c, w, torch.randn(4))  # a bias of the wrong length
    assert not recurrence.usable(torch.randn(recurrence.MAX_ROWS + 1, 8), c, w, b)
    with torch.enable_grad():
        assert not recurrence.usable(h0, c, w.requires_grad_(), b)  # autograd: torch


# ---- batched loops --------------------------------------------------------------------

DIM = 10
torch.manual_seed(0)
inner = nn.Linear(2 * DIM, DIM)
wx, wh = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM, bias=False)


def counted(x, h, n: int):
    for _ in range(n):
        h = torch.tanh(inner(torch.cat([x, h])))  # hoisted: x's half of the GEMM
    return h


def over_sequence(xs):
    h = torch.zeros(DIM)
    states = []
    for x in xs:
        h = torch.tanh(wx(x) + wh(h))  # hoisted: wx(x) of every element at once
        states.append(h)
    return torch.stack(states + [h])  # (and the initial state for an empty sequence)


def with_relu(x, h, n: int):
    for _ in range(n):
        h = torch.relu(inner(torch.cat([x, h])))  # not an Elman tanh step
    return h


@acrobat.autobatch
def run_counted(x, h, n):
    return counted(x, h, n)


@acrobat.autobatch
def run_over_sequence(xs):
    return over_sequence(xs)


@acrobat.autobatch
def run_with_relu(x, h, n):
    return with_relu(x, h, n)


@pytest.fixture
def calls(monkeypatch):
    """Counts recurrence.run calls made by batched loops."""
    count = [0]
    real = recurrence.run

    def counting(*args):
        count[0] += 1
        return real(*args)

    monkeypatch.setattr(recurrence, "run", counting)
    return count


def _inputs(seed: int, counts: list[int]):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(DIM, generator=g), torch.randn(DIM, generator=g), k) for k in counts]


@settings(max_examples=20, deadline=None)
@given(counts=st.lists(st.integers(0, 9), min_size=1, max_size=12), seed=st.integers(0, 999))
def test_counted_loops_run_in_the_kernel_with_the_eager_results(counts, seed):
    items = _inputs(seed, counts)
    with torch.no_grad():
        got = run_counted.map(*zip(*items))
        want = [run_counted.eager(*item) for item in items]
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, **tol)


def test_the_kernel_is_taken_and_switched_to_when_few_rows_remain(calls, monkeypatch):
    items = _inputs(3, [9, 7, 7, 4, 2, 2, 1, 0])
    with torch.no_grad():
        want = [run_counted.eager(*item) for item in items]
        got = run_counted.map(*zip(*items))
        assert calls[0] > 0
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, **tol)
        # more rows than the kernel takes: steps one by one until few enough remain
        monkeypatch.setattr(recurrence, "MAX_ROWS", 3)
        before = calls[0]
        got = run_counted.map(*zip(*items))
        assert calls[0] > before
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, **tol)
        # a loop over a sequence: per-step addends, and states appended at every step
        before = calls[0]
        g = torch.Generator().manual_seed(4)
        seqs = [[torch.randn(DIM, generator=g) for _ in range(k)] for k in (5, 3, 3, 0)]
        got = run_over_sequence.map(seqs)
        assert calls[0] > before
        for g_, xs in zip(got, seqs):
            torch.testing.assert_close(g_, run_over_sequence.eager(xs), **tol)


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(0, 8), min_size=1, max_size=8), seed=st.integers(0, 999))
def test_loops_over_sequences_give_the_eager_states(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    items = [([torch.randn(DIM, generator=g) for _ in range(k)],) for k in lengths]
    with torch.no_grad():
        got = run_over_sequence.map(*zip(*items))
        want = [run_over_sequence.eager(*item) for item in items]
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, **tol)


def test_other_bodies_and_the_switch_off_step_one_by_one(calls, monkeypatch):
    items = _inputs(5, [4, 3, 1])
    with torch.no_grad():
        got = run_with_relu.map(*zip(*items))
        want = [run_with_relu.eager(*item) for item in items]
        assert calls[0] == 0
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, **tol)
        monkeypatch.setattr(config, "FAST_RECURRENCE", False)
        got = run_counted.map(*zip(*items))
        assert calls[0] == 0
        for g_, w_ in zip(got, [run_counted.eager(*item) for item in items]):
            torch.testing.assert_close(g_, w_, **tol)


def test_training_steps_one_by_one_and_gradients_match(calls):
    items = _inputs(7, [5, 3, 3])
    loss = sum(h.sum() for h in run_counted.map(*zip(*items)))
    loss.backward()
    got = [p.grad.clone() for p in inner.parameters()]
    inner.zero_grad()
    sum(run_counted.eager(*item).sum() for item in items).backward()
    want = [p.grad.clone() for p in inner.parameters()]
    inner.zero_grad()
    assert calls[0] == 0
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, **tol)
