"""The online choice between the batched map and the eager loop (config.MAP_CHOICE,
api._MapChoice): trials that compute the real results, the faster kept per function,
batch-size bucket, grad mode and modules; results equal eager's whichever runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import api
from tests.helpers import assert_close_tree


@pytest.fixture(autouse=True)
def choice_on():
    with acrobat.config.override(MAP_CHOICE=True):
        yield


def wide(x, lin):
    """One instance's work: two large ops (cheaper per instance than a batched map's
    fixed cost at a few instances)."""
    return torch.tanh(lin(x)).sum(0)


def test_trials_alternate_then_keep_the_faster_and_results_equal_eager(monkeypatch):
    lin = nn.Linear(8, 8)
    f = acrobat.autobatch(wide)
    xs = [torch.randn(3, 8) for _ in range(4)]
    want = [wide(x, lin) for x in xs]
    # the eager loop made to look 2x faster per instance than the batched map
    clock = iter(range(10**6))
    monkeypatch.setattr(api.time, "perf_counter", lambda: next(clock))
    ran = []
    real = api.fibers.run_map

    def run_map(*args, **kwargs):
        ran.append("map")
        for _ in range(2):
            next(clock)
        return real(*args, **kwargs)

    monkeypatch.setattr(api.fibers, "run_map", run_map)
    for k in range(10):
        with torch.no_grad():
            got = f.map(xs, lin=lin)
        assert_close_tree(got, want)
        ran.append(("eager" if acrobat.stats().eager_loop else "batched", k))
    maps = [k for k, r in enumerate(ran) if r == "map"]
    assert len(maps) == 3  # (trials: map, eager, map, eager, map, eager; then the eager loop)
    assert [r for r in ran if type(r) is tuple][-4:] == [("eager", k) for k in range(6, 10)]


def test_a_faster_batched_map_is_kept(monkeypatch):
    lin = nn.Linear(8, 8)
    f = acrobat.autobatch(wide)
    xs = [torch.randn(3, 8) for _ in range(4)]
    steps = {"n": 0}

    def clock():  # every call of wide takes 5 ticks, batched or eager: a tie (the
        return steps["n"]  # eager loop must be 10% faster to be chosen)

    monkeypatch.setattr(api.time, "perf_counter", clock)
    real = f.fn

    def slow(*args, **kwargs):
        steps["n"] += 5
        return real(*args, **kwargs)

    f.fn = slow
    with torch.no_grad():
        for _ in range(8):
            f.map(xs, lin=lin)
    choice = next(iter(f._choices.values()))
    assert choice.choice == "map"
    with torch.no_grad():
        f.map(xs, lin=lin)
    assert not acrobat.stats().eager_loop


def test_keys_stats_and_errors():
    lin, other = nn.Linear(8, 8), nn.Linear(8, 8)
    f = acrobat.autobatch(wide)
    xs = [torch.randn(3, 8) for _ in range(4)]
    with torch.no_grad():
        f.map(xs, lin=lin)
        f.map(xs + xs, lin=lin)  # another batch-size bucket
        f.map(xs, lin=other)  # other modules
        _, st = f.map(xs, lin=lin, stats=True)  # always batched, not a trial
    f.map(xs, lin=lin)  # grad mode: another key
    assert len(f._choices) == 4
    assert not st.eager_loop
    # an instance that fails: the batched map raises acrobat's error naming it, whichever
    # variant the choice is at
    bad = xs[:2] + [torch.randn(3, 5)]
    for _ in range(4):
        with pytest.raises(acrobat.AcrobatError, match="instance 2"), torch.no_grad():
            f.map(bad, lin=lin)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=9), st.booleans())
def test_every_map_equals_eager_through_the_trials(ns, grad):
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    f = acrobat.autobatch(wide)
    xs = [torch.randn(n, 8) for n in ns]
    with torch.set_grad_enabled(grad):
        want = [wide(x, lin) for x in xs]
        for _ in range(8):
            got = f.map(xs, lin=lin)
            assert_close_tree(got, [w.detach() if not grad else w for w in want], atol=1e-5)
            if grad:
                torch.stack(got).sum().backward()
