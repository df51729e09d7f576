"""The torch functions' stand-ins while a map runs (ops.fast_functions,
config.FAST_FUNCTIONS): lazy arguments are recorded as the TorchFunctionMode records
them, without torch's dispatch; everything else reaches torch (and the mode) as before.

The oracle is twofold: map == eager, and the same graph (nodes, batches) as the mode's
route with the stand-ins off."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import acrobat
from acrobat import config, ops
from acrobat.errors import LazyValueError, ShapeError
from acrobat.tensor import _native
from tests.helpers import assert_close_tree, check_map

TANH, CAT, LINEAR, RELU = torch.tanh, torch.cat, F.linear, F.relu  # the originals
COS, SIGMOID = torch.cos, torch.sigmoid


def _body(x, w, b):
    h = torch.tanh(F.linear(x, w, b))  # positional
    h = torch.add(h, x, alpha=0.5)  # a keyword
    parts = torch.cat(tensors=[h, x], dim=0)  # keywords only
    s = torch.stack([h, x]).sum(dim=0)
    m = torch.where(h > 0, h, torch.sigmoid(s))
    return torch.clamp(parts, min=-0.9, max=0.9), m, torch.softmax(m, -1)


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 6),
    width=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_stand_ins_record_the_modes_graph(n, width, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(width, generator=g) for _ in range(n)]
    w, b = torch.randn(width, width, generator=g), torch.randn(width, generator=g)
    f = acrobat.autobatch(_body)
    with acrobat.config.override(FAST_FUNCTIONS=True):
        fast = check_map(f, xs, w=w, b=b)
        got = f.map(xs, w=w, b=b)
    with acrobat.config.override(FAST_FUNCTIONS=False):
        slow = check_map(f, xs, w=w, b=b)
        want = f.map(xs, w=w, b=b)
    assert (fast.nodes, fast.batches) == (slow.nodes, slow.batches)
    assert_close_tree(got, want)


def test_stand_ins_are_in_place_while_a_map_runs_and_gone_after():
    seen = []

    @acrobat.autobatch
    def f(x):
        seen.append((torch.tanh, torch.cat, F.linear, F.relu, torch.cos))
        if len(seen) == 2:
            raise ValueError("boom")
        return torch.tanh(torch.cat([F.linear(x, torch.eye(2)), x]))

    f.map([torch.ones(2)])  # its first map: the mode's route, noting what f calls
    assert seen[0][:3] == (TANH, CAT, LINEAR)
    with pytest.raises(ValueError, match="boom"):
        f.map([torch.ones(2)] * 3)
    tanh, cat, linear, relu, cos = seen[1]
    if config.FAST_FUNCTIONS:
        assert tanh is not TANH and tanh.__wrapped__ is TANH
        assert cat.__wrapped__ is CAT and linear.__wrapped__ is LINEAR
        assert tanh.__name__ == "tanh" and tanh.__doc__ == TANH.__doc__
        assert ops.SHORTCUT_ORIGINALS[tanh] is TANH
        # written in Python (its rule reads the arguments its dispatch passes): as it is
        assert relu is RELU
        assert cos is COS  # never called by f: not put in
        if _native is not None:
            assert type(tanh) is _native.Shortcut
    # restored, after a map that failed
    assert (torch.tanh, torch.cat, F.linear, F.relu) == (TANH, CAT, LINEAR, RELU)
    with acrobat.config.override(FAST_FUNCTIONS=False):
        seen.clear()
        f.map([torch.ones(2)])
        assert seen[0][0] is TANH


def test_a_map_puts_in_the_stand_ins_its_function_was_seen_calling():
    """The stand-ins a map puts in are those its function called before (learned from the
    mode's handler, also in a map that failed); a new call is learned when first made."""
    seen = []

    @acrobat.autobatch
    def f(x, deeper):
        seen.append((torch.tanh, torch.sigmoid))
        y = torch.tanh(x)
        if deeper:
            y = torch.sigmoid(y)
        if deeper == 2:
            raise ValueError("boom")
        return y

    xs = [torch.randn(3) for _ in range(2)]
    want = [torch.sigmoid(torch.tanh(x)) for x in xs]
    f.map(xs, deeper=0)
    assert seen[-1] == (TANH, SIGMOID)
    assert_close_tree(f.map(xs, deeper=1), want)
    if config.FAST_FUNCTIONS:
        assert seen[-1][0] is not TANH and seen[-1][1] is SIGMOID
        with pytest.raises(ValueError, match="boom"):
            f.map(xs, deeper=2)
        assert seen[-1][1] is not SIGMOID  # learned in the map before, which called it
    assert_close_tree(f.map(xs, deeper=1), want)
    assert (torch.tanh, torch.sigmoid) == (TANH, SIGMOID)


def test_real_arguments_reach_torch_and_the_mode():
    """Calls without lazy arguments inside a map are torch's (shared constants hoisted by
    the mode), also through a torch function written in Python that dispatches under the
    stand-in's name (F.relu's handle_torch_function)."""

    @acrobat.autobatch
    def f(x):
        c = torch.tanh(torch.ones(3))  # a real argument: torch, then the mode (hoisted)
        r = F.relu(torch.full((3,), -1.0) + c)  # F.relu -> handle_torch_function(relu...)
        return x * c + r

    xs = [torch.randn(3) for _ in range(4)]
    fast = check_map(f, xs)
    with acrobat.config.override(FAST_FUNCTIONS=False):
        slow = check_map(f, xs)
    assert (fast.nodes, fast.batches) == (slow.nodes, slow.batches)


def test_other_threads_get_torch_while_a_map_runs():
    out: dict = {}

    @acrobat.autobatch
    def f(x):
        def other():
            out["real"] = torch.tanh(torch.zeros(2))  # the stand-in: torch's result
            try:
                torch.tanh(x)  # a lazy tensor on another thread: not recorded
            except LazyValueError as e:
                out["lazy"] = str(e)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        return torch.tanh(x)

    check_map(f, [torch.randn(2)])
    assert torch.equal(out["real"], torch.zeros(2))
    assert "outside f.map" in out["lazy"]


def test_errors_name_the_users_line():
    @acrobat.autobatch
    def f(x):
        return torch.cat([x, x.unsqueeze(0)])  # 1-d with 2-d: bad_cat_line

    with pytest.raises(ShapeError) as info:
        f.map([torch.ones(2), torch.ones(2)])
    assert "bad_cat_line" in str(info.value)
    assert "test_shortcuts.py" in str(info.value)


def test_escaped_lazy_tensors_still_raise():
    @acrobat.autobatch
    def f(x):
        kept.append(x * 2)
        return x

    kept: list = []
    f.map([torch.ones(2)])
    with pytest.raises(LazyValueError, match=r"outside f\.map"):
        torch.tanh(kept[0])


@pytest.mark.parametrize("fast", [False, True], ids=["mode", "stand-ins"])
def test_a_rules_own_torch_calls_record_on_the_modes_route(fast):
    """A rule reached through the mode's handler (the stand-ins off, or a function's first
    map) calls torch on lazy tensors itself (narrow by a per-instance start: ``arange(n) +
    i``): torch took the mode off the thread for the handler, which puts it back for the
    rule (it raised "a LazyTensor was passed to add outside f.map" before)."""

    @acrobat.autobatch
    def f(x, i):
        return torch.narrow(x, 0, i, 2) * 2

    xs = [torch.randn(5, 3) for _ in range(3)]
    idx = [torch.tensor(k) for k in (0, 3, 1)]
    with acrobat.config.override(FAST_FUNCTIONS=fast):
        for _ in range(2):  # (the first map of f takes the mode's route either way)
            got = f.map(xs, idx)
            assert_close_tree(got, [torch.narrow(x, 0, int(i), 2) * 2 for x, i in zip(xs, idx)])
