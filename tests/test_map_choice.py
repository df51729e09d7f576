"""The online choice between the batched map and the eager loop (config.MAP_CHOICE,
api._MapChoice): trials that compute the real results, the faster kept per function,
batch-size bucket, grad mode and modules; results equal eager's whichever runs."""

from __future__ import annotations

import itertools

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
    # (trials: map, eager, map, eager, map, eager; the eager loop is never chosen early,
    # however much faster: then the eager loop)
    assert len(maps) == 3
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


def drive(choice: api._MapChoice, cost, maps: int) -> list[str]:
    """The variants ``choice`` runs over ``maps`` maps, each timed at ``cost(variant, k)``
    seconds per instance at the k-th map."""
    ran = []
    for k in range(maps):
        variant = choice.next()
        ran.append(variant)
        choice.note(variant, cost(variant, k) * 4, 4)
    return ran


def test_a_clear_verdict_is_taken_without_the_remaining_trials():
    # the batched map 10x faster than even the eager loop's untimed first run: map, eager,
    # map, and the eager loop is not tried again
    ran = drive(api._MapChoice(), lambda v, k: 1.0 if v == "map" else 10.0, 20)
    assert ran[:3] == ["map", "eager", "map"] and ran.count("eager") == 1
    # the batched map 4x faster than the eager loop's timed run: decided after one of each
    ran = drive(api._MapChoice(), lambda v, k: 1.0 if v == "map" else (2.0 if k == 1 else 4.0), 20)
    assert ran[:4] == ["map", "eager", "map", "eager"] and ran[4:] == ["map"] * 16
    # the eager loop's untimed first run 5x the map's (one-time costs of its own), its
    # timed runs 15% faster than the map: every trial runs, then the eager loop
    ran = drive(api._MapChoice(), lambda v, k: 1.0 if v == "map" else (5.0 if k == 1 else 0.85), 20)
    assert ran[:6] == ["map", "eager"] * 3 and ran[6:] == ["eager"] * 14
    # the eager loop 4x faster: never early (the map may still be tracing), all trials
    ran = drive(api._MapChoice(), lambda v, k: 4.0 if v == "map" else 1.0, 20)
    assert ran[:6] == ["map", "eager"] * 3 and ran[6:] == ["eager"] * 14
    # close: every trial runs (3 each), then the faster
    ran = drive(api._MapChoice(), lambda v, k: 1.0 if v == "map" else 0.8, 20)
    assert ran[:6] == ["map", "eager"] * 3 and ran[6:] == ["eager"] * 14


def test_a_verdict_made_while_the_map_warmed_up_is_revised(monkeypatch):
    # the batched map slow for its first 4 runs (traces of new shapes), then 2x faster
    # than the eager loop: the trials pick the eager loop, the first re-check still finds
    # the map slow, the second finds it faster
    runs = {"map": 0}

    def cost(variant, k):
        if variant == "eager":
            return 1.0
        runs["map"] += 1
        return 3.0 if runs["map"] <= 4 else 0.5

    monkeypatch.setattr(api._MapChoice, "RECHECK", 4)
    choice = api._MapChoice()
    ran = drive(choice, cost, 80)
    assert ran[:6] == ["map", "eager"] * 3 and ran[6] == "eager"
    assert choice.choice == "map"
    checks = [k for k, v in enumerate(ran) if k >= 6 and v == "map"]
    # the first re-check 4 x 3 maps after the verdict (the map was 3x slower; still slow),
    # the second 8 x 3 after that: faster, kept; the eager loop re-checked after 4 x 2
    # maps and 8 x 2 more (it was 2x slower)
    assert checks[:2] == [17, 41]
    assert [k for k, v in enumerate(ran) if k > 41 and v == "eager"] == [49, 65]


def test_rechecks_back_off_and_cost_little_when_the_verdict_stands(monkeypatch):
    monkeypatch.setattr(api._MapChoice, "RECHECK", 16)
    choice = api._MapChoice()
    ran = drive(choice, lambda v, k: 1.0 if v == "map" else 4.0, 5000)
    checks = [k for k, v in enumerate(ran) if v == "eager"][1:]  # after the trial
    gaps = [b - a for a, b in itertools.pairwise(checks)]
    assert choice.choice == "map" and len(checks) >= 3
    assert all(b > a for a, b in itertools.pairwise(gaps))  # each period longer than the last
    assert gaps[0] >= 16 * 4  # the other is 4x slower: re-tried 4x less often
    # a single slow re-check run (noise) never flips a clear verdict, and a noisy kept
    # run does not either: the kept variant's best of its recent runs is the reference
    monkeypatch.setattr(api._MapChoice, "RECHECK", 4)
    noisy = api._MapChoice()
    ran = drive(noisy, lambda v, k: (1.0 if k % 7 else 5.0) if v == "map" else 2.0, 400)
    assert noisy.choice == "map" and ran[-50:].count("map") >= 48


def test_rechecks_run_through_map_and_equal_eager(monkeypatch):
    monkeypatch.setattr(api._MapChoice, "RECHECK", 1)
    lin = nn.Linear(8, 8)
    f = acrobat.autobatch(wide)
    xs = [torch.randn(3, 8) for _ in range(4)]
    want = [wide(x, lin).detach() for x in xs]
    with torch.no_grad():
        f.map(xs, lin=lin)
        choice = next(iter(f._choices.values()))
        loops = []
        for _ in range(30):
            assert_close_tree(f.map(xs, lin=lin), want)
            loops.append(acrobat.stats().eager_loop)
    assert choice.choice is not None
    assert True in loops and False in loops  # both ran: trials, then re-checks of the other


class _Tick(torch.autograd.Function):
    """Identity whose backward advances the fake clock by ``cost``: a backward that takes
    that long."""

    @staticmethod
    def forward(ctx, x, clock, cost):
        ctx.clock, ctx.cost = clock, cost
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock["t"] += ctx.cost
        return grad, None, None


def drive_steps(choice: api._MapChoice, forward, backward, maps: int, monkeypatch) -> list:
    """The variants ``choice`` runs over ``maps`` training steps (4 instances each): a run
    of ``variant`` takes ``forward[variant]`` on the fake clock, then its results' backward
    ``backward[variant]`` (None: no backward for that run)."""
    clock = {"t": 0.0}
    monkeypatch.setattr(api.time, "perf_counter", lambda: clock["t"])
    w = torch.ones(3, requires_grad=True)
    ran = []
    for _ in range(maps):
        choice.settle()
        variant = choice.next()
        ran.append(variant)
        results = [_Tick.apply(w * k, clock, backward[variant] or 0.0) for k in range(4)]
        choice.observe(variant, forward[variant] * 4, 4, results)
        if backward[variant] is not None:
            torch.stack(results).sum().backward()
    return ran


def test_a_training_step_is_judged_with_its_backward(monkeypatch):
    """With gradients, a run is timed through the backward of its results: the eager
    loop's forward 2x faster, its backward 3x slower than the map's whole step, the map
    is kept (timed by forwards alone, the eager loop won); where the eager loop is also
    faster through its backward, it is kept; a run whose backward never comes counts its
    forward alone at the next map."""
    ran = drive_steps(
        api._MapChoice(), {"map": 1.0, "eager": 0.5}, {"map": 4.0, "eager": 12.0}, 12, monkeypatch
    )
    assert ran[:6] == ["map", "eager"] * 3 and ran[6:] == ["map"] * 6
    ran = drive_steps(
        api._MapChoice(), {"map": 1.0, "eager": 0.5}, {"map": 4.0, "eager": 2.0}, 12, monkeypatch
    )
    assert ran[6:] == ["eager"] * 6
    choice = api._MapChoice()
    none = {"map": None, "eager": None}
    ran = drive_steps(choice, {"map": 1.0, "eager": 0.5}, none, 12, monkeypatch)
    assert ran[6:] == ["eager"] * 6 and choice.runs["map"] == [1.0] * 3
    # the kept variant's steps with gradients: one in SAMPLE timed (with its backward);
    # the 6 after the verdict none (SAMPLE = 8), its recent times the trial's alone
    assert choice.SAMPLE > 6 and choice.recent == [0.5]


def test_a_map_with_gradients_is_noted_after_its_backward(monkeypatch):
    """Through f.map: the run is noted when the backward through its results ends, its
    forward and backward together; without gradients, at once."""
    noted = []
    real = api._MapChoice.note

    def note(self, variant, seconds, instances):
        noted.append((variant, seconds))
        real(self, variant, seconds, instances)

    monkeypatch.setattr(api._MapChoice, "note", note)
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    f = acrobat.autobatch(wide)
    xs = [torch.randn(3, 8) for _ in range(4)]
    got = f.map(xs, lin=lin)
    assert noted == []  # waiting for the backward
    torch.stack(got).sum().backward()
    assert [v for v, _ in noted] == ["map"] and noted[0][1] > 0
    assert_close_tree([g.detach() for g in got], [wide(x, lin).detach() for x in xs])
    f.map(xs, lin=lin)  # the eager loop's trial, never backpropagated ...
    assert len(noted) == 1
    f.map(xs, lin=lin)  # ... noted by its forward at the next map
    assert [v for v, _ in noted] == ["map", "eager"]
    with torch.no_grad():
        f.map(xs, lin=lin)
    assert [v for v, _ in noted] == ["map", "eager", "map"]
