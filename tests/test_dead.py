"""Dead nodes (scheduler.prune_dead, config.PRUNE_DEAD): recorded ops whose outputs
nothing can read any more are not executed; everything that can be read still is, and
map == eager either way."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import acrobat
from acrobat import scheduler
from acrobat.tensor import _native
from tests.helpers import check_map


def _body(x, w, keep):
    h = torch.tanh(x @ w)
    h.detach()  # read by nothing
    unused = torch.sigmoid(h) * 2  # a dead chain of two
    del unused
    kept = []
    for i in range(keep):  # per-instance: some branches keep more than others
        kept.append(torch.relu(h + i))
    return h, kept


@settings(max_examples=15, deadline=None)
@given(
    keeps=st.lists(st.integers(0, 3), min_size=1, max_size=5),
    width=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_dead_nodes_are_not_executed_and_the_rest_is_eagers(keeps, width, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(width, width, generator=g)
    xs = [torch.randn(width, generator=g) for _ in keeps]

    @acrobat.autobatch
    def f(x, keep):
        return _body(x, w, keep)

    inputs = list(zip(xs, keeps))
    with acrobat.config.override(AUTO_BLOCKS=False):  # op by op: no block traces them
        got, st_on = f.map(xs, keeps, stats=True)
    want = [f.eager(x, k) for x, k in inputs]
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_[0], w_[0])
        assert len(g_[1]) == len(w_[1])
        for a, b in zip(g_[1], w_[1]):
            torch.testing.assert_close(a, b)
    # per instance: a detach, a sigmoid and a mul nobody reads
    assert st_on.dead == 3 * len(keeps)
    with acrobat.config.override(PRUNE_DEAD=False, AUTO_BLOCKS=False):
        _, st_off = f.map(xs, keeps, stats=True)
    assert st_off.dead == 0 and st_off.nodes == st_on.nodes
    assert st_on.batches < st_off.batches


def test_values_kept_anywhere_are_computed():
    """A LazyTensor kept in a container, an attribute or a closure is alive; so is one a
    later read demands."""
    box: dict = {}

    class Holder:
        pass

    @acrobat.autobatch
    def f(x):
        holder = Holder()
        holder.t = x * 3
        box.setdefault("y", []).append(x + 1)  # escapes the map: computed while alive
        keep = [x - 1]
        late = lambda: keep[0] * 2
        flag = bool((x.sum() > 100).item())  # a read: a flush while all of them live
        return holder.t + late() + (1.0 if flag else 0.0)

    xs = [torch.randn(3) for _ in range(4)]
    st_ = check_map(f, xs)
    assert st_.dead == 0


def test_a_demanded_value_is_never_dropped():
    @acrobat.autobatch
    def f(x):
        return float((x * 2).sum())  # only the fiber's wait holds the product

    xs = [torch.randn(3) for _ in range(3)]
    got, st_ = f.map(xs, stats=True)
    assert got == [float((x * 2).sum()) for x in xs]
    assert st_.dead == 0


def test_python_and_c_prune_the_same():
    if _native is None:
        pytest.skip("acrobat._native is not built")

    class N:  # stands for a node: referenced by its list, maybe by a handle
        def __init__(self, inputs=()):
            self.inputs = list(inputs)

    def build():
        a, b = N(), N()
        c = N([a])  # reads a; dead itself
        d = N([b])
        keep = [d]
        return [[a, b], [c, d]], keep

    for prune in (scheduler.prune_dead, _native.prune_dead):
        batches, keep = build()
        assert prune(batches) == 2  # c, then a (only c read it)
        assert [len(b) for b in batches] == [1, 1]
        assert batches[1][0] is keep[0]
