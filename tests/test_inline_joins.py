"""Joins of child fibers that have not started run them inline (fibers.INLINE_JOINS):
``fut.result()`` on a child forked last and not started yet runs the child on the joining
fiber's greenlet, as a call, instead of parking the joiner and handing the child to a
worker. The child keeps its own identity (its reads suspend it, its forks are its own),
the graph is the same, and an error in it fails the map naming its instance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import acrobat
from acrobat import fibers
from tests.helpers import assert_close_tree, check_map


def _chain(x, depth):
    """A chain of children, each forked and joined at once; every other one reads."""
    if depth == 0:
        return torch.tanh(x)
    if depth % 2 and (x.sum() > 0).item():  # a read: the inline child suspends
        x = x * 0.5
    kid = acrobat.fork(_chain, x + 1, depth - 1)
    return kid.result() * 2


@acrobat.autobatch
def chain(x, depth):
    return _chain(x, depth)


def _tree(x, depth):
    """Two children: the first starts when its parent next blocks (a running join), the
    second is forked last and joined first (inline)."""
    if depth == 0:
        return x * 1
    a = acrobat.fork(_tree, torch.tanh(x), depth - 1)
    if (x.mean() > 0).item():
        x = -x
    b = acrobat.fork(_tree, x * 0.5, depth - 1)
    return b.result() + a.result()


@acrobat.autobatch
def tree(x, depth):
    return _tree(x, depth)


@pytest.fixture
def inlined(monkeypatch):
    runs = []
    real = fibers._run_inline

    def counting(rt, me, child):
        runs.append(me.nest + 1)
        return real(rt, me, child)

    monkeypatch.setattr(fibers, "_run_inline", counting)
    return runs


def test_a_join_of_a_child_not_started_runs_it_inline(inlined):
    xs = [torch.randn(4) for _ in range(6)]
    with torch.no_grad():
        on = check_map(chain, xs, depth=5)
        assert len(inlined) == 6 * 5  # every join: its child forked last, not started
        inlined.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fibers, "INLINE_JOINS", False)
            off = check_map(chain, xs, depth=5)
        assert not inlined
    # the same graph; only the joins' suspensions are gone
    assert (on.nodes, on.batches, on.flushes) == (off.nodes, off.batches, off.flushes)
    assert on.suspensions == off.suspensions - 6 * 5


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 5), st.lists(st.integers(0, 2**16), min_size=1, max_size=6))
def test_trees_with_reads_equal_eager_inline_or_not(depth, seeds):
    xs = [torch.randn(3, generator=torch.Generator().manual_seed(s)) for s in seeds]
    with torch.no_grad():
        want = [tree.eager(x, depth) for x in xs]
        assert_close_tree(tree.map(xs, depth=depth), want)
        saved = fibers.INLINE_JOINS
        fibers.INLINE_JOINS = False
        try:
            assert_close_tree(tree.map(xs, depth=depth), want)
        finally:
            fibers.INLINE_JOINS = saved


def test_inline_joins_nest_up_to_their_bound(inlined):
    """A chain of 80 joins: the first _INLINE_NEST run inline inside one another, the
    next one goes to a worker (whose own joins nest again from 0)."""
    xs = [torch.randn(2) for _ in range(3)]
    with torch.no_grad():
        check_map(chain, xs, depth=80)
    assert max(inlined) == fibers._INLINE_NEST
    assert len(inlined) < 3 * 80  # (some joins went to a worker)


def test_an_error_in_an_inline_child_names_its_instance_and_the_next_map_works():
    def child(x, bad):
        v = (x.sum() > 0).item()  # suspends first
        if bad:
            raise ValueError("child failed")
        return x * (2 if v else 3)

    @acrobat.autobatch
    def f(pair):
        x, bad = pair
        return acrobat.fork(child, x, bad).result() + 1

    xs = [torch.randn(3) for _ in range(4)]
    with pytest.raises(ValueError, match="child failed") as err:
        f.map(list(zip(xs, [False, False, True, False])))
    assert any("instance 2" in note for note in err.value.__notes__)
    _only_parked_workers_live()
    with torch.no_grad():
        check_map(f, [(x, False) for x in xs])


def test_a_deadlock_inside_an_inline_child_unwinds_its_joiner_too():
    """The child, run inline on its joiner's greenlet, waits for a fiber that waits for
    it: a deadlock; unwinding the map unwinds both (one greenlet), which parks."""

    @acrobat.autobatch
    def f(x):
        box = {}
        box["parent"] = acrobat.fork(lambda: box["child"].result())
        box["child"] = acrobat.fork(lambda: box["parent"].result())  # (joined inline)
        return box["parent"].result()

    with pytest.raises(acrobat.AcrobatError, match="deadlock"):
        f.map([torch.randn(2), torch.randn(2)])
    _only_parked_workers_live()


def _only_parked_workers_live():
    """No fiber survives a failed map: every live greenlet but the current one is a
    worker parked in the pool."""
    import gc

    import greenlet

    gc.collect()
    live = [o for o in gc.get_objects() if type(o) is greenlet.greenlet and o and not o.dead]
    parked = {id(g) for g in fibers._pool()}
    assert all(id(g) in parked for g in live if g is not greenlet.getcurrent())
