"""Gathers of scattered rows: the address-copy kernel (acrobat_kernels.gather), the
executor's use of it (config.FAST_GATHER), and reuse of a column's last gather."""

from __future__ import annotations

import itertools
from array import array

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import config, executor
from acrobat_kernels.gather import gather_rows

DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.float16]

# sources of a row shape and dtype, their heights, and the draw of the rows to copy
_ROW_CASES = given(
    shape=st.lists(st.integers(0, 5), max_size=3).map(tuple),
    dtype=st.sampled_from(DTYPES),
    heights=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    data=st.data(),
)


@settings(max_examples=60, deadline=None)
@_ROW_CASES
def test_gather_rows_copies_the_rows_at_the_addresses(shape, dtype, heights, data):
    sources, chosen, want = _sources_and_rows(shape, dtype, heights, data)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    addresses = array("q", [sources[s].data_ptr() + r * nbytes for s, r in chosen])
    got = gather_rows(addresses, shape, dtype, nbytes)
    assert got.shape == (len(chosen), *shape) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want)


def _sources_and_rows(shape, dtype, heights, data):
    """Source tensors of the given heights, (source, row) picks drawn by hypothesis, and
    the picked rows stacked by torch."""
    gen = torch.Generator().manual_seed(len(heights))
    sources = [(torch.randn((h, *shape), generator=gen) * 10).to(dtype) for h in heights]
    picks = data.draw(
        st.lists(st.integers(0, sum(heights) - 1), max_size=12), label="rows (flat index)"
    )
    rows = [(s, r) for s, h in enumerate(heights) for r in range(h)]
    chosen = [rows[p] for p in picks]
    want = torch.stack([sources[s][r] for s, r in chosen]) if chosen else torch.empty(0, *shape)
    return sources, chosen, want.to(dtype)


@acrobat.autobatch
def recall(xs: list, picks: list, w: torch.Tensor) -> torch.Tensor:
    """Each step adds the state of an earlier step chosen by the input: the rows of that
    operand column come from as many producer batches as there are distinct picks."""
    h = torch.zeros(w.shape[0])
    states = [h]
    for x, p in zip(xs, picks):
        h = torch.tanh(w @ (h + states[p % len(states)]) + x)
        states.append(h)
    return torch.stack(states)


def _recall_inputs(seed: int, batch: int, dim: int = 6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (batch,), generator=gen).tolist()
    xs = [list(torch.randn(n, dim, generator=gen)) for n in lengths]
    picks = [torch.randint(0, 100, (n,), generator=gen).tolist() for n in lengths]
    return list(zip(xs, picks)), torch.randn(dim, dim, generator=gen) * 0.5


def _spy(monkeypatch, module, name: str) -> list:
    calls: list = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("fast", [True, False])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(2, 9))
def test_maps_with_scattered_rows_match_eager(fast, seed, batch):
    inputs, w = _recall_inputs(seed, batch)
    with config.override(FAST_GATHER=fast), torch.no_grad():
        got = recall.map([x for x, _ in inputs], [p for _, p in inputs], w=w)
    want = [recall.eager(x, p, w=w) for x, p in inputs]
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fast", [True, False])
def test_fast_gather_runs_only_when_enabled_and_without_autograd(fast, monkeypatch):
    # the copy by address: _native_copy with the C extension (gather calls it first),
    # _fast_gather's numba kernel without
    name = "_native_copy" if executor._native is not None else "_fast_gather"
    calls = _spy(monkeypatch, executor, name)
    inputs, w = _recall_inputs(3, 8)
    xs, picks = [x for x, _ in inputs], [p for _, p in inputs]
    with config.override(FAST_GATHER=fast):
        with torch.no_grad():
            recall.map(xs, picks, w=w)
        assert bool(calls) == fast
        calls.clear()
        # autograd: torch's gathers, gradients as in the eager loop
        wg = w.clone().requires_grad_()
        torch.cat(recall.map(xs, picks, w=wg)).sum().backward()
        assert not calls
    we = w.clone().requires_grad_()
    torch.cat([recall.eager(x, p, w=we) for x, p in inputs]).sum().backward()
    torch.testing.assert_close(wg.grad, we.grad, atol=1e-5, rtol=1e-5)


@acrobat.autobatch
def recall_transposed(xs: list, picks: list) -> torch.Tensor:
    """Like ``recall``, but the recalled states are transposed views (batched: a
    non-contiguous output), which the address copy cannot read."""
    y = torch.zeros(6)
    mats = [y.reshape(2, 3).t()]
    for x, p in zip(xs, picks):
        y = torch.tanh(y + x)
        mats.append(y.reshape(2, 3).t() + mats[p % len(mats)])
    return torch.stack(mats)


def test_sources_that_are_not_contiguous_take_torch_gathers(monkeypatch):
    fallback = _spy(monkeypatch, executor, "_gather_sources")
    inputs, _ = _recall_inputs(5, 8)
    xs, picks = [x for x, _ in inputs], [p for _, p in inputs]
    with config.override(FAST_GATHER=True), torch.no_grad():
        got = recall_transposed.map(xs, picks)
    want = [recall_transposed.eager(x, p) for x, p in inputs]
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
    assert fallback


@acrobat.autobatch
def loop(x: torch.Tensor, steps: int, w: torch.Tensor) -> torch.Tensor:
    wx = w @ x  # computed once, read at every step
    h = torch.zeros(w.shape[0])
    for _ in range(steps):
        h = torch.tanh(wx + h)
    return h


def test_a_column_reading_the_same_rows_again_reuses_its_gather(monkeypatch):
    # the loop recorded step by step (as one node, a scan's rows are views by design)
    monkeypatch.setattr(config, "AUTO_SCANS", False)
    # a copy: _native_copy with the C extension (gather calls it first), else _copy_rows
    name = "_native_copy" if executor._native is not None else "_copy_rows"
    copies = _spy(monkeypatch, executor, name)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, 5, generator=gen) * 0.5
    xs = list(torch.randn(4, 5, generator=gen))
    steps = [5, 2, 5, 5]  # instance 1 leaves after 2 steps: rows 0, 2, 3 of wx from then on
    with torch.no_grad():
        got = loop.map(xs, steps, w=w)
        want = [loop.eager(x, n, w=w) for x, n in zip(xs, steps)]
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
    # From step 3 on, rows 0, 2, 3: wx is copied at step 3 and that copy reused at steps
    # 4 and 5; h is copied once (rows of step 2's batch of 4), later steps read views.
    assert len(copies) == 2
    copies.clear()

    class Forgetful(dict):
        def __setitem__(self, key, value):
            pass

    monkeypatch.setattr(executor, "_reused", Forgetful())
    with torch.no_grad():
        again = loop.map(xs, steps, w=w)
    assert len(copies) == 4  # wx at steps 3, 4, 5 and h at step 3
    for g, e in zip(again, want):
        torch.testing.assert_close(g, e)


_native = acrobat.tensor._native


def _lazy_rows(sources, chosen, shape, dtype):
    """A computed LazyTensor per chosen (source, row): source s is output 0 of a node."""
    from acrobat.graph import Info, LazyTensor, Node
    from acrobat.ops import INPUT

    info = Info(((torch.Size(shape), dtype),), True, None)
    nodes = []
    for src in sources:
        node = Node(INPUT, None, (), None, [], info, None, 0, 0, -1, None)
        node.outs = (src,)
        nodes.append(node)
    return [LazyTensor(nodes[s], 0, torch.Size(shape), dtype, None) for s, _ in chosen]


@pytest.mark.skipif(_native is None, reason="acrobat._native is not built")
@settings(max_examples=60, deadline=None)
@_ROW_CASES
def test_native_copy_rows_copies_the_rows_its_slots_name(shape, dtype, heights, data):
    """The C row copy (executor._native_copy): slots name (source,
    row) as the executor packs them, sources by their first row's address, entered into
    ``bases`` from the LazyTensors the first time a source is read."""
    sources, chosen, want = _sources_and_rows(shape, dtype, heights, data)
    size = torch.Size(shape)
    nbytes = size.numel() * dtype.itemsize
    keys = [(7 + s) << 20 for s in range(len(sources))]  # batch/output part of a slot
    slots = [(keys[s] << executor._ROW_BITS) + r for s, r in chosen]
    ts = _lazy_rows(sources, chosen, shape, dtype)

    def copy(bases):
        got = torch.zeros((len(chosen), *shape), dtype=dtype)
        return _native.copy_rows(got.data_ptr(), slots, bases, nbytes, ts, size, dtype), got

    full = {k: src.data_ptr() for k, src in zip(keys, sources)}
    done, got = copy(dict(full))
    assert done is True and torch.equal(got, want)
    # sources not in bases yet: entered (row 0's address) and copied in the same call
    bases: dict = {}
    done, got = copy(bases)
    assert done is True and torch.equal(got, want)
    assert bases == {keys[s]: sources[s].data_ptr() for s, _ in chosen}
    if chosen and size.numel():
        s0 = chosen[0][0]
        # a source a byte copy cannot read (None): False, and no row written
        done, got = copy({**full, keys[s0]: None})
        assert done is False and not got.any()
        # entered as None when its buffer is not a contiguous tensor of such rows
        wide = torch.zeros((sources[s0].shape[0], *shape, 2), dtype=dtype)[..., 0]
        other = [sources[s0].to(torch.float64 if dtype != torch.float64 else torch.int32)]
        if not wide.is_contiguous():  # (one row, or empty rows: contiguous whatever the stride)
            other.append(wide)
        for odd in other:
            for t in ts:
                if t.node.outs[0] is sources[s0]:
                    t.node.outs = (odd,)
            bases = {}
            done, got = copy(bases)
            assert done is False and bases[keys[s0]] is None and not got.any()
            for t in ts:
                if t.node.outs[0] is odd:
                    t.node.outs = (sources[s0],)


# Concatenations of block inputs gathered as one buffer (executor._join): a tree of
# vectors whose composition reads cat([left, right]) of children from many batches.


@acrobat.block
def pair_cell(w, a, b):
    return torch.tanh(w @ torch.cat([a, b]))


@acrobat.block
def pair_cell_reads_twice(w, a, b):
    return torch.tanh(w @ torch.cat([a, b])) + a  # a also read by the add: not joined


@acrobat.block
def pair_leaf(table, word):
    return table[word]


def _pair(tree, w, table, cell):
    if isinstance(tree, int):
        return pair_leaf(table, torch.tensor(tree))
    return cell(w, _pair(tree[0], w, table, cell), _pair(tree[1], w, table, cell))


@acrobat.autobatch
def pair_tree(tree, w, table, cell):
    return _pair(tree, w, table, cell)


_pair_trees = st.recursive(st.integers(0, 4), lambda t: st.tuples(t, t), max_leaves=7)


def _pair_model(dim: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(dim)
    w = (torch.randn(dim, 2 * dim, generator=gen) / dim).to(dtype)
    return w, torch.randn(5, dim, generator=gen).to(dtype)


@settings(max_examples=25, deadline=None)
@given(
    trees=st.lists(_pair_trees, min_size=1, max_size=6),
    dim=st.integers(1, 9),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    join=st.booleans(),
    grad=st.booleans(),
)
def test_joined_concatenations_match_eager(trees, dim, dtype, join, grad):
    """map == eager with the parts of cat([a, b]) gathered into one buffer or one by one,
    and under autograd (parts gathered one by one, gradients as eager's)."""
    w, table = _pair_model(dim, dtype)
    w.requires_grad_(grad)
    with pytest.MonkeyPatch.context() as mp, torch.set_grad_enabled(grad):
        mp.setattr(config, "JOIN_GATHERS", join)
        for _ in range(2):  # the second map: the compiled program
            got = pair_tree.map(trees, w=w, table=table, cell=pair_cell)
        want = [pair_tree.eager(t, w, table, pair_cell) for t in trees]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
            assert a.requires_grad == b.requires_grad  # (a lone leaf does not read w)
        if grad and any(isinstance(t, tuple) for t in trees):
            got_g = torch.autograd.grad(sum(g.sum() for g in got), w)
            want_g = torch.autograd.grad(sum(g.sum() for g in want), w)
            torch.testing.assert_close(got_g, want_g)


def _pair_sources(cell) -> list[str]:
    return [t.compiled.source for t in cell.cache.values() if t.compiled is not None]


@pytest.mark.skipif(_native is None, reason="joins are copied by acrobat._native (not built)")
def test_a_joined_concatenation_is_one_gather(monkeypatch):
    """Children from many batches: each composition batch gathers both parts with one
    buffer (fewer gathers than one per part), and equals the path with joins off."""
    w, table = _pair_model(6)
    trees = [((0, 1), ((2, 3), 4)), (((1, 0), 1), 2), (3, (4, (2, (0, 1))))]
    pair_cell.cache.clear()
    with torch.no_grad():
        pair_tree.map(trees, w=w, table=table, cell=pair_cell)
        joined, on = pair_tree.map(trees, w=w, table=table, cell=pair_cell, stats=True)
        monkeypatch.setattr(config, "JOIN_GATHERS", False)
        apart, off = pair_tree.map(trees, w=w, table=table, cell=pair_cell, stats=True)
    for a, b in zip(joined, apart):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert on.gathers < off.gathers, (on, off)
    (trace,) = [t for t in pair_cell.cache.values() if t.compiled is not None]
    assert trace.op.joins == ((0, 1),)
    assert "is None else torch.cat(" in trace.compiled.source


def test_a_part_read_elsewhere_is_not_joined():
    w, table = _pair_model(6)
    trees = [((0, 1), ((2, 3), 4)), (((1, 0), 1), 2)]
    pair_cell_reads_twice.cache.clear()
    with torch.no_grad():
        for _ in range(2):
            got = pair_tree.map(trees, w=w, table=table, cell=pair_cell_reads_twice)
        want = [pair_tree.eager(t, w, table, pair_cell_reads_twice) for t in trees]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    traces = [t for t in pair_cell_reads_twice.cache.values() if t.compiled is not None]
    assert traces and all(t.op.joins == () for t in traces)


@pytest.mark.skipif(_native is None, reason="joins are copied by acrobat._native (not built)")
def test_a_join_whose_rows_cannot_all_be_read_gathers_the_parts(monkeypatch):
    """A source the C copy cannot read (marked so in the address table) makes the group
    fall back to one gather per part; the result is the same."""
    w, table = _pair_model(6)
    trees = [((0, 1), ((2, 3), 4)), (((1, 0), 1), 2)]
    pair_cell.cache.clear()
    real = executor._native.join_into
    calls = []

    def unreadable(dst, stride, nodes, group, bases):
        for j in group:
            for s in executor._native.column(nodes, j)[1]:
                bases[s >> executor._ROW_BITS] = None
        calls.append(1)
        found = real(dst, stride, nodes, group, bases)
        assert found is False
        return found

    with torch.no_grad():
        pair_tree.map(trees, w=w, table=table, cell=pair_cell)
        monkeypatch.setattr(executor._native, "join_into", unreadable)
        got = pair_tree.map(trees, w=w, table=table, cell=pair_cell)
        want = [pair_tree.eager(t, w, table, pair_cell) for t in trees]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert calls


# linear(x, W_x, b_x) + linear(h, W_h, b_h) over two block inputs: one GEMM over the
# buffer [x, h] with the concatenated weights (codegen.joined_linears, ops.JoinedLinear).


def _sum_cell(form):
    def cell(lx, lh, x, h):
        s = lx(x) + lh(h) if form != "swapped" else lh(h) + lx(x)
        return torch.tanh(s) if form != "plain" else s * 2

    return acrobat.block(cell)


_SUM_CELLS = {form: _sum_cell(form) for form in ("tanh", "plain", "swapped")}


def _chain(xs, lx, lh, cell, h):
    if not xs:
        return []
    h = cell(lx, lh, xs[0], h)  # h from the previous step's batch, x from the inputs
    return [h, *_chain(xs[1:], lx, lh, cell, h)]  # (recursion: no loop to scan)


@acrobat.autobatch
def sum_chain(xs, lx, lh, cell):
    return torch.stack(_chain(xs, lx, lh, cell, torch.zeros(lh.in_features)))


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    dims=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    biases=st.sampled_from([(True, False), (False, True), (True, True), (False, False)]),
    form=st.sampled_from(sorted(_SUM_CELLS)),
    grad=st.booleans(),
)
def test_joined_linears_match_eager(lengths, dims, biases, form, grad):
    """map == eager with the two products joined into one (no autograd) or apart (autograd:
    gradients as eager's), for every bias combination and operand order."""
    dx, dh = dims
    torch.manual_seed(dx * 10 + dh)
    lx, lh = nn.Linear(dx, dh, bias=biases[0]), nn.Linear(dh, dh, bias=biases[1])
    seqs = [[torch.randn(dx) for _ in range(k)] for k in lengths]
    cell = _SUM_CELLS[form]
    with torch.set_grad_enabled(grad):
        for _ in range(2):  # the second map: the compiled program
            got = sum_chain.map(seqs, lx=lx, lh=lh, cell=cell)
        want = [sum_chain.eager(s, lx, lh, cell) for s in seqs]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        if grad:
            params = [p for p in (*lx.parameters(), *lh.parameters())]
            got_g = torch.autograd.grad(sum(g.sum() for g in got), params)
            want_g = torch.autograd.grad(sum(g.sum() for g in want), params)
            torch.testing.assert_close(got_g, want_g)


@pytest.mark.skipif(_native is None, reason="joins are copied by acrobat._native (not built)")
def test_joined_linears_are_one_gemm_and_follow_parameter_updates(monkeypatch):
    cell = _SUM_CELLS["tanh"]
    torch.manual_seed(0)
    lx, lh = nn.Linear(5, 7), nn.Linear(7, 7, bias=False)
    seqs = [[torch.randn(5) for _ in range(k)] for k in (3, 1, 4, 2)]
    from acrobat import ops

    calls = []
    joined_weights = ops.JoinedLinear.__call__
    counted = lambda jl: calls.append(1) or joined_weights(jl)
    monkeypatch.setattr(ops.JoinedLinear, "__call__", counted)
    cell.cache.clear()
    with torch.no_grad():
        sum_chain.map(seqs, lx=lx, lh=lh, cell=cell)
        calls.clear()
        joined = sum_chain.map(seqs, lx=lx, lh=lh, cell=cell)
        assert calls  # the one GEMM ran
        traces = [t for t in cell.cache.values() if t.compiled is not None]
        assert any((0, 1) in t.op.joins for t in traces)  # (x, h: the lazy arguments)
        monkeypatch.setattr(config, "JOIN_GATHERS", False)  # the two products
        calls.clear()
        apart = sum_chain.map(seqs, lx=lx, lh=lh, cell=cell)
        assert not calls
        monkeypatch.setattr(config, "JOIN_GATHERS", True)
        for a, b in zip(joined, apart):
            torch.testing.assert_close(a, b)
        lx.weight.mul_(-0.5)  # in place: the joined weights are made again
        lh.weight.add_(0.1)
        got = sum_chain.map(seqs, lx=lx, lh=lh, cell=cell)
        want = [sum_chain.eager(s, lx, lh, cell) for s in seqs]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_a_joined_weight_past_the_bound_stays_two_gemms(monkeypatch):
    from acrobat import codegen

    monkeypatch.setattr(codegen, "JOINED_WEIGHT_MAX", 16)
    cell = _sum_cell("tanh")
    lx, lh = nn.Linear(5, 7), nn.Linear(7, 7, bias=False)
    seqs = [[torch.randn(5) for _ in range(k)] for k in (3, 2)]
    with torch.no_grad():
        for _ in range(2):
            got = sum_chain.map(seqs, lx=lx, lh=lh, cell=cell)
        want = [sum_chain.eager(s, lx, lh, cell) for s in seqs]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    traces = [t for t in cell.cache.values() if t.compiled is not None]
    assert traces and not any("jw" in t.compiled.source for t in traces)


# Linear layers reading the same value: one GEMM over the stacked weights
# (codegen.stacked_linears, ops.StackedLinear): a textbook LSTM cell, one layer per gate.


class GateLSTM(nn.Module):
    def __init__(self, d: int, h: int, bias_h: bool = False):
        super().__init__()
        self.w = nn.ModuleList(nn.Linear(d, h) for _ in range(4))
        self.u = nn.ModuleList(nn.Linear(h, h, bias=bias_h) for _ in range(4))


@acrobat.block
def gate_cell(m, x, h, c):
    i, f, o, g = (m.w[k](x) + m.u[k](h) for k in range(4))
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _gate_chain(m, xs, h, c):
    if not xs:
        return h
    h, c = gate_cell(m, xs[0], h, c)
    return _gate_chain(m, xs[1:], h, c)  # (recursion: no loop to scan)


@acrobat.autobatch
def gate_chain(xs, m):
    return _gate_chain(m, xs, torch.zeros(m.u[0].in_features), torch.zeros(m.u[0].in_features))


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    dims=st.tuples(st.integers(1, 7), st.integers(1, 7)),
    bias_h=st.booleans(),
    grad=st.booleans(),
)
def test_stacked_linears_match_eager(lengths, dims, bias_h, grad):
    """A cell with one layer per gate: map == eager with the layers stacked (no autograd)
    or one by one (autograd: gradients as eager's)."""
    torch.manual_seed(sum(dims))
    m = GateLSTM(*dims, bias_h=bias_h)
    seqs = [[torch.randn(dims[0]) for _ in range(k)] for k in lengths]
    with torch.set_grad_enabled(grad):
        for _ in range(2):  # the second map: the compiled program
            got = gate_chain.map(seqs, m=m)
        want = [gate_chain.eager(s, m) for s in seqs]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        if grad:
            params = list(m.parameters())
            got_g = torch.autograd.grad(sum(g.sum() for g in got), params)
            want_g = torch.autograd.grad(sum(g.sum() for g in want), params)
            torch.testing.assert_close(got_g, want_g)
    traces = [t for t in gate_cell.cache.values() if t.compiled is not None]
    assert any("stk" in t.compiled.source for t in traces)


def test_stacked_linears_are_one_gemm_and_follow_parameter_updates(monkeypatch):
    from acrobat import ops

    torch.manual_seed(0)
    m = GateLSTM(5, 6)
    seqs = [[torch.randn(5) for _ in range(k)] for k in (3, 1, 4)]
    calls = []
    stacked_call = ops.StackedLinear.__call__
    monkeypatch.setattr(
        ops.StackedLinear, "__call__", lambda s, x: calls.append(len(s.sizes)) or stacked_call(s, x)
    )
    with torch.no_grad():
        gate_chain.map(seqs, m=m)
        calls.clear()
        gate_chain.map(seqs, m=m)
        assert calls and set(calls) == {4}  # the W x and the U h layers: 4 each
        for layer in (*m.w, *m.u):
            layer.weight.mul_(-0.7)  # in place: the stacked weights are made again
        got = gate_chain.map(seqs, m=m)
        want = [gate_chain.eager(s, m) for s in seqs]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(_native is None, reason="acrobat._native is not built")
@settings(max_examples=60, deadline=None)
@given(
    heights=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    width=st.integers(1, 6),
    gap=st.sampled_from([0, 0, 1]),
    data=st.data(),
)
def test_rows_span_finds_rows_lying_back_to_back(heights, width, gap, data):
    """The C span check (executor._span_view): sources are row ranges of one buffer (a
    loop's per-step outputs), ``gap`` rows apart; the rows picked lie back to back
    exactly when each is the next row of that buffer (picks of up to 90 rows: the check
    resolves addresses 32 at a time and stops at the first row out of line)."""
    buffer = torch.randn(sum(heights) + gap * len(heights), width)
    sources, start = [], 0
    for h in heights:
        sources.append(buffer[start : start + h])
        start += h + gap
    rows = [(s, r) for s, h in enumerate(heights) for r in range(h)]
    picks = data.draw(st.lists(st.integers(0, len(rows) - 1), min_size=1, max_size=90))
    if data.draw(st.booleans(), label="a run of consecutive rows"):
        first = picks[0]
        picks = list(range(first, min(first + len(picks), len(rows))))
    chosen = [rows[p] for p in picks]
    keys = [(7 + s) << 20 for s in range(len(sources))]
    slots = [(keys[s] << executor._ROW_BITS) + r for s, r in chosen]
    ts = _lazy_rows(sources, chosen, (width,), torch.float32)
    nbytes = width * 4
    addresses = [sources[s][r].data_ptr() for s, r in chosen]
    back_to_back = all(b - a == nbytes for a, b in itertools.pairwise(addresses))
    size = torch.Size((width,))
    got = _native.rows_span(slots, {}, nbytes, ts, size, torch.float32)
    assert got == (addresses[0] if back_to_back else 0)
    unreadable = {keys[s]: None for s, _ in chosen}
    assert _native.rows_span(slots, unreadable, nbytes, ts, size, torch.float32) is False


@pytest.mark.skipif(_native is None, reason="acrobat._native is not built")
def test_rows_written_back_to_back_are_read_as_a_view(monkeypatch):
    """A BiRNN's output layer reads the forward states step-major, as the loop wrote
    them: a view of the loop's buffer instead of a copy, with the same results."""
    from models import birnn
    from models.common import outputs_close, run_eager

    task = birnn.make_task("small", 8, blocks=False)
    results = {}
    with torch.no_grad():
        want = run_eager(task)
        for threshold in (1 << 60, 0):
            monkeypatch.setattr(executor, "SPAN_VIEW_BYTES", threshold)
            outs, stats = task.fn.map(task.inputs, stats=True, **task.kwargs)
            check = outputs_close(outs, want, atol=1e-5, rtol=1e-5)
            assert check, check.message
            results[threshold] = stats
    copied, viewed = results[1 << 60], results[0]
    assert viewed.gathers < copied.gathers and viewed.gather_bytes < copied.gather_bytes


def _ragged_stack(x, n):
    return torch.stack([torch.tanh(x * (k + 1)) for k in range(n)])


@pytest.mark.skipif(_native is None, reason="acrobat._native is not built")
@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(1, 9), min_size=1, max_size=10),
    width=st.integers(1, 5),
    seed=st.integers(0, 99),
)
def test_ragged_stacks_take_their_parts_in_one_c_loop(counts, width, seed):
    """A batch of stacks of different part counts (executor._run_ragged) takes every part
    of every node and its slot from ``_native.flat_column``: the same operands, in the
    same order, as the nodes' inputs one after another, and results equal to eager."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(width, generator=gen) for _ in counts]
    f = acrobat.autobatch(_ragged_stack)
    seen = []

    class Spy:
        def __getattr__(self, name):
            return getattr(_native, name)

        def flat_column(self, nodes):
            got = _native.flat_column(nodes)
            seen.append((got, [t for nd in nodes for t in nd.inputs]))
            return got

    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(executor, "_native", Spy())
        mp.setattr(config, "AUTO_BLOCKS", False)  # (op by op: the stacks are nodes of their own)
        got = f.map(xs, counts)
    want = [_ragged_stack(x, n) for x, n in zip(xs, counts)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert seen  # the ragged batch went through the C loop
    for (column, slots), expected in seen:
        assert len(column) == len(expected)
        assert all(a is b for a, b in zip(column, expected))
        assert slots == executor._slots(expected)


def _ragged_stack_reversed(x, n):
    parts = [torch.tanh(x * (k + 1)) for k in range(n)]
    return torch.stack(parts[::-1])  # (rows not back to back: copied, not a view)


@pytest.mark.skipif(_native is None, reason="acrobat._native is not built")
@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(1, 9), min_size=1, max_size=10),
    width=st.integers(1, 5),
    reverse=st.booleans(),
    seed=st.integers(0, 99),
)
def test_ragged_stacks_copy_their_parts_by_address_in_one_call(counts, width, reverse, seed):
    """``_native.flat_into`` (executor._flat_copy) copies every part of every node of a
    ragged batch straight into one buffer, or answers None where the parts lie back to
    back already (then gather takes a view of them): results equal to eager either way."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(width, generator=gen) for _ in counts]
    fn = _ragged_stack_reversed if reverse else _ragged_stack
    f = acrobat.autobatch(fn)
    answers = []

    class Spy:
        def __getattr__(self, name):
            return getattr(_native, name)

        def flat_into(self, *args):
            answers.append(_native.flat_into(*args))
            return answers[-1]

    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(executor, "_native", Spy())
        mp.setattr(config, "AUTO_BLOCKS", False)  # (op by op: the stacks are nodes of their own)
        got, stats = f.map(xs, counts, stats=True)
    for a, b in zip(got, [fn(x, n) for x, n in zip(xs, counts)]):
        torch.testing.assert_close(a, b)
    assert answers and all(a in (True, None) for a in answers)
    if reverse and max(counts) > 1:
        assert True in answers and stats.gathers >= 1  # (copied: the rows run backwards)


@pytest.mark.skipif(_native is None, reason="acrobat._native is not built")
def test_flat_into_refuses_what_is_not_a_node_list():
    with pytest.raises(TypeError, match="flat_into"):
        _native.flat_into(0, (1, 2), {}, 4, torch.Size([1]), torch.float32)
    with pytest.raises(TypeError, match="flat_into"):
        _native.flat_into(0, [object()], {}, 4, torch.Size([1]), torch.float32)


@pytest.mark.skipif(_native is None, reason="acrobat._native is not built")
def test_flat_column_refuses_what_is_not_a_node_list():
    with pytest.raises(TypeError, match="flat_column"):
        _native.flat_column((1, 2))
    with pytest.raises(TypeError, match="not a Node"):
        _native.flat_column([object()])
