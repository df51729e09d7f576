"""Operands read by address (acrobat/rows.py): the batched products over per-instance
addresses against torch, and blocks whose matrix inputs are read where their producers
wrote them (map == eager, with the path on and off, and under autograd)."""

from __future__ import annotations

from array import array

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import codegen, config, executor, rows
from acrobat.tensor import _native
from acrobat_kernels import blas

# Skipped where the C extension is not built or torch's BLAS has no batched GEMM; where
# both are there, rows.available() must hold (its self-check passed).
pytestmark = pytest.mark.skipif(
    _native is None or blas.gemm_batch_addresses() is None,
    reason="no C extension or no batched GEMM in torch's BLAS",
)


def test_the_batched_gemm_passes_its_check():
    assert rows.available()

DTYPES = [torch.float32, torch.float64]


def _operand(values: torch.Tensor, kind: str, data):
    """The batch ``values`` (n first) as a product operand of the given kind: Rows at the
    addresses of scattered copies, a contiguous tensor, or a strided view of one."""
    if kind == "rows":
        n = values.shape[0]
        spare = data.draw(st.integers(0, 3))
        home = torch.zeros(n + spare, *values.shape[1:], dtype=values.dtype)
        where = data.draw(st.permutations(range(n + spare)))[:n]
        if n:
            home[list(where)] = values
        nbytes = values.shape[1:].numel() * values.element_size()
        addresses = array("q", [home.data_ptr() + r * nbytes for r in where])
        return rows.Rows(addresses, values.shape[1:], values.dtype), home
    if kind == "strided" and values.dim() == 3:  # the transpose of a contiguous batch
        return values.transpose(1, 2).contiguous().transpose(1, 2), None
    if kind == "strided":  # every other row of a wider buffer
        wide = torch.zeros(values.shape[0], 2 * values.shape[1], dtype=values.dtype)
        wide[:, ::2] = values
        return wide[:, ::2], None
    return values.clone(), None


_FORMS = {  # name: (x shape, x shared, y shape, y shared) as functions of (m, k, p)
    "W @ X": lambda m, k, p: ((m, k), True, (k, p), False),
    "X @ W": lambda m, k, p: ((m, k), False, (k, p), True),
    "X @ Y": lambda m, k, p: ((m, k), False, (k, p), False),
    "X @ v": lambda m, k, p: ((m, k), False, (k,), False),
    "v @ X": lambda m, k, p: ((k,), False, (k, p), False),
}


@settings(max_examples=80, deadline=None)
@given(
    form=st.sampled_from(sorted(_FORMS)),
    dims=st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9)),
    n=st.integers(0, 7),
    dtype=st.sampled_from(DTYPES),
    kinds=st.tuples(*[st.sampled_from(["rows", "tensor", "strided"])] * 2),
    data=st.data(),
)
def test_product_over_addresses_equals_torch(form, dims, n, dtype, kinds, data):
    xs, x_shared, ys, y_shared = _FORMS[form](*dims)
    g = torch.Generator().manual_seed(sum(dims) + n)
    x = torch.randn(xs if x_shared else (n, *xs), generator=g, dtype=dtype)
    y = torch.randn(ys if y_shared else (n, *ys), generator=g, dtype=dtype)
    xo, keep_x = (x, None) if x_shared else _operand(x, kinds[0], data)
    yo, keep_y = (y, None) if y_shared else _operand(y, kinds[1], data)
    with torch.no_grad():
        got = rows.matmul(xo, x_shared, yo, y_shared, n)
    want = [(x if x_shared else x[i]) @ (y if y_shared else y[i]) for i in range(n)]
    assert got.dtype == dtype and got.shape[0] == n
    for i in range(n):
        torch.testing.assert_close(got[i], want[i])
    del keep_x, keep_y


@settings(max_examples=40, deadline=None)
@given(
    parts=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    m=st.integers(1, 6),
    p=st.integers(1, 6),
    n=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_sum_over_column_slices_equals_w_at_cat(parts, m, p, n, dtype, data):
    """``matmul_sum`` over W's column slices is ``W @ cat(parts, 0)`` per instance."""
    g = torch.Generator().manual_seed(sum(parts) + m + p + n)
    w = torch.randn(m, sum(parts), generator=g, dtype=dtype)
    values = [torch.randn(n, k, p, generator=g, dtype=dtype) for k in parts]
    terms, keep, start = [], [], 0
    for k, v in zip(parts, values):
        o, home = _operand(v, data.draw(st.sampled_from(["rows", "tensor", "strided"])), data)
        keep.append(home)
        terms.append((w[:, start : start + k], True, o, False))
        start += k
    with torch.no_grad():
        got = rows.matmul_sum(terms, n)
    for i in range(n):
        torch.testing.assert_close(got[i], w @ torch.cat([v[i] for v in values], 0))


# A tree of phrases carrying a matrix each (MV-RNN's shape, small): the children's
# matrices of a level come from different producer batches, so without addresses they
# are gathered.


class Phrases(nn.Module):
    def __init__(self, d: int, words: int = 6):
        super().__init__()
        g = torch.Generator().manual_seed(d)
        noise = 0.1 * torch.randn(words, d * d, generator=g)
        self.mat = nn.Parameter(torch.eye(d).flatten() + noise)
        self.vec = nn.Parameter(torch.randn(words, d, generator=g))
        self.w = nn.Parameter(torch.randn(d, 2 * d, generator=g) / d)
        self.d = d


@acrobat.block
def leaf(m, word):
    return m.vec[word], m.mat[word].reshape(m.d, m.d)


@acrobat.block
def compose(m, a, A, b, B):
    p = torch.tanh(B @ a + A @ b)
    return p, m.w @ torch.cat([A, B], 0)


@acrobat.block
def compose_reads_twice(m, a, A, b, B):
    p = torch.tanh(B @ a + (A * 0.5).sum(0))  # A also read by a non-product
    return p, m.w @ torch.cat([A, B], 0)


def _phrase(tree, m, cell):
    if isinstance(tree, int):
        return leaf(m, torch.tensor(tree))
    a, A = _phrase(tree[0], m, cell)
    b, B = _phrase(tree[1], m, cell)
    return cell(m, a, A, b, B)


@acrobat.autobatch
def encode(tree, m, cell):
    p, P = _phrase(tree, m, cell)
    return p, P


_trees = st.recursive(st.integers(0, 5), lambda t: st.tuples(t, t), max_leaves=6)


def _sources(cell) -> list[str]:
    return [t.compiled.source for t in cell.cache.values() if t.compiled is not None]


def _maps_equal_eager(trees, m, cell):
    """Two maps (the first compiles the block's program): the second's results equal the
    eager loop's; its stats."""
    with torch.no_grad():
        for _ in range(2):
            got, stats = encode.map(trees, m=m, cell=cell, stats=True)
        want = [encode.eager(t, m, cell) for t in trees]
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)
    return stats


@settings(max_examples=25, deadline=None)
@given(
    trees=st.lists(_trees, min_size=1, max_size=6),
    d=st.sampled_from([2, 3, 8]),
    on=st.booleans(),
)
def test_tree_of_matrices_map_equals_eager(trees, d, on):
    """map == eager with the matrices read by address (any size: MIN_NUMEL lowered) and
    with the path off; with it on, batches that read scattered children use addresses."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rows, "MIN_NUMEL", 1)
        mp.setattr(config, "ROW_OPERANDS", on)
        _check_trees(trees, d, on)


def _check_trees(trees, d, on):
    m = Phrases(d)
    compose.cache.clear()
    with torch.no_grad():
        got = encode.map(trees, m=m, cell=compose)
        got2, stats2 = encode.map(trees, m=m, cell=compose, stats=True)  # compiled
        want = [encode.eager(t, m, compose) for t in trees]
    for g1, g2, w in zip(got, got2, want):
        for a, b, c in zip(g1, g2, w):
            torch.testing.assert_close(a, c)
            torch.testing.assert_close(b, c)
    if on and any(isinstance(t, tuple) and not isinstance(t[0], int) for t in trees):
        assert any("rows_matmul" in s for s in _sources(compose))
    if not on:
        assert stats2.gathers_fused == 0


def test_scattered_children_are_read_by_address():
    """Deep trees of 8 x 8 matrices: the composition's children come from many batches,
    and the products read them in place (counted as fused gathers, no copies of them)."""
    m = Phrases(8)
    trees = [((0, 1), ((2, 3), 4)), (((5, 0), 1), 2), (3, (4, (5, (0, 1))))]
    compose.cache.clear()
    stats = _maps_equal_eager(trees, m, compose)
    assert stats.gathers_fused > 0, stats
    (source,) = _sources(compose)
    assert "rows_matmul_sum(" in source and "rows_matmul(" in source, source


def test_an_input_read_by_another_op_is_gathered():
    """A matrix that a non-product also reads is gathered (the program needs a tensor)."""
    m = Phrases(8)
    trees = [((0, 1), ((2, 3), 4)), (((5, 0), 1), 2)]
    compose_reads_twice.cache.clear()
    _maps_equal_eager(trees, m, compose_reads_twice)
    (trace,) = [t for t in compose_reads_twice.cache.values() if t.compiled is not None]
    # (a, A, b, B): A is read by A * 0.5 too, the vectors are under rows.MIN_NUMEL
    assert trace.op.row_args == {3}, trace.op.row_args


def test_training_through_the_same_program_matches_eager():
    """Under autograd the executor gathers and the program runs the ops' own rules:
    gradients equal the eager loop's, after an inference map compiled the program."""
    m = Phrases(8)
    trees = [((0, 1), ((2, 3), 4)), (((5, 0), 1), 2), (3, 4)]
    compose.cache.clear()
    with torch.no_grad():
        encode.map(trees, m=m, cell=compose)
        encode.map(trees, m=m, cell=compose)
    got = encode.map(trees, m=m, cell=compose)
    want = [encode.eager(t, m, compose) for t in trees]
    params = list(m.parameters())
    got_g = torch.autograd.grad(sum(p.sum() + P.sum() for p, P in got), params)
    want_g = torch.autograd.grad(sum(p.sum() + P.sum() for p, P in want), params)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)


def test_a_source_that_cannot_be_read_by_address_is_gathered(monkeypatch):
    """rows_of gives None for a source the C code cannot read (here: marked so in the
    executor's address table); the batch is gathered and the result is the same."""
    m = Phrases(8)
    trees = [((0, 1), ((2, 3), 4)), (((5, 0), 1), 2)]
    compose.cache.clear()
    seen = []

    def unreadable(ts, slots, bases):
        for s in slots:
            bases[s >> executor._ROW_BITS] = None
        got = rows.rows_of(ts, slots, bases)
        seen.append(got)
        return got

    monkeypatch.setattr(executor, "rows_of", unreadable)
    _maps_equal_eager(trees, m, compose)
    assert seen and all(r is None for r in seen)


def test_products_over_addresses_are_found_in_generated_code_only_when_available(monkeypatch):
    """With the path off, row_operands finds nothing and the program is as before."""
    monkeypatch.setattr(config, "ROW_OPERANDS", False)
    assert codegen.row_operands([], [], [], {}) == set()


def test_turning_the_flag_off_after_compiling_gathers_again(monkeypatch):
    """config.ROW_OPERANDS is read at every batch: off, a compiled program gets gathered
    tensors (and computes the same)."""
    m = Phrases(8)
    trees = [((0, 1), ((2, 3), 4)), (((5, 0), 1), 2), (3, (4, (5, (0, 1))))]
    compose.cache.clear()
    with torch.no_grad():
        on, on_stats = encode.map(trees, m=m, cell=compose, stats=True)
        assert on_stats.gathers_fused > 0
        monkeypatch.setattr(config, "ROW_OPERANDS", False)
        off, off_stats = encode.map(trees, m=m, cell=compose, stats=True)
    assert off_stats.gathers_fused == 0 and off_stats.gathers > on_stats.gathers
    for g, w in zip(off, on):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)
