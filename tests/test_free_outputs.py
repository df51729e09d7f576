"""Outputs released while the map runs (config.FREE_OUTPUTS): a computed node lets go of its
operands, each batch counts the lazy tensors of each of its outputs, and an output whose
last handle dies is dropped from the batch (its buffer back to the allocator) while the
map goes on. Values anything can still read are never dropped: map == eager either way."""

from __future__ import annotations

import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import acrobat
from acrobat import config, executor, fibers
from acrobat.graph import Node
from acrobat.tensor import LazyTensor, _native
from tests.helpers import check_grads, check_map

needs_native = pytest.mark.skipif(_native is None, reason="acrobat._native is not built")


class Cell(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.state = torch.nn.Linear(2 * width, width)
        self.head = torch.nn.Linear(width, 1)


def _cell(m: Cell, h: torch.Tensor, x: torch.Tensor):
    """Two outputs of different lifetimes: the state (read by the next step only) and the
    score (kept to the end)."""
    s = torch.tanh(m.state(torch.cat([h, x])))
    return s, m.head(s)


def _walk(x: torch.Tensor, m: Cell, steps: int):
    """A state carried step to step, a value read at each step (one flush per step), the
    scores of every step returned: each step's state dies two steps later."""
    h = torch.zeros_like(x)
    scores = []
    for _ in range(steps):
        h, score = _cell(m, h, x)
        scores.append(score)
        if float(score.detach()) > 10.0:  # a value read: the instance waits for its step's batch
            break
    return torch.stack(scores), h


walk = acrobat.autobatch(_walk)


@acrobat.autobatch
def walk_total(x: torch.Tensor, m: Cell, steps: int) -> torch.Tensor:
    scores, h = _walk(x, m, steps)
    return scores.sum() + h.sum()


def _gone_before_the_end(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and how many of the batch outputs its map made were released
    from their batch's tuple by the time its last batch ran (the tuples held here; under
    config.VERIFY the released tensors are kept to the map's end, poisoned)."""
    seen: list = []  # (the batch's outputs tuple, output index)
    gone = [0]
    original = fibers.execute

    def execute(batches, stats):
        original(batches, stats)
        for nodes in batches:
            outs = nodes[0].outs
            seen.extend((outs, k) for k, out in enumerate(outs) if isinstance(out, torch.Tensor))
        gone[0] = sum(outs[k] is None for outs, k in seen)

    fibers.execute = execute
    try:
        return fn(*args, **kwargs), gone[0]
    finally:
        fibers.execute = original


@settings(max_examples=12, deadline=None)
@given(
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    width=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_maps_that_free_outputs_equal_eager(steps, width, seed):
    torch.manual_seed(seed)
    m = Cell(width)
    xs = [torch.randn(width) for _ in steps]

    @acrobat.autobatch
    def f(x, k):
        return _walk(x, m, k)

    with torch.no_grad():
        for free in (True, False):
            with config.override(FREE_OUTPUTS=free):
                got = f.map(xs, steps)
            want = [f.eager(x, k) for x, k in zip(xs, steps)]
            for (gs, gh), (ws, wh) in zip(got, want):
                torch.testing.assert_close(gs, ws)
                torch.testing.assert_close(gh, wh)


@needs_native
def test_dead_states_are_freed_while_the_map_runs():
    torch.manual_seed(0)
    m = Cell(8)
    xs = [torch.randn(8) for _ in range(6)]
    gone = {}
    with torch.no_grad():
        walk.map(xs, m=m, steps=5)  # (the first map's calls are watched for a cut: held)
    for free in (True, False):
        with torch.no_grad(), config.override(FREE_OUTPUTS=free):
            got, gone[free] = _gone_before_the_end(walk.map, xs, m=m, steps=5)
        with torch.no_grad():
            for (gs, gh), x in zip(got, xs):
                ws, wh = walk.eager(x, m=m, steps=5)
                torch.testing.assert_close(gs, ws)
                torch.testing.assert_close(gh, wh)
    # with the switch off, a batch's outputs go only with its last node; on, each step's
    # state leaves its batch two steps later, its scores kept
    assert gone[False] == 0 and gone[True] >= 4, gone


@needs_native
def test_an_output_is_dropped_alone_while_the_others_stay():
    """The cell's state dies, its score lives on (stacked at the end): the batch's tuple
    keeps the score and drops the state."""
    torch.manual_seed(1)
    m = Cell(4)
    cells: list = []
    states = []  # at the start of each flush: (state kept, score kept) of the first cells
    original = fibers.execute

    def execute(batches, stats):
        if cells:
            outs = cells[0][0].outs
            states.append((outs[0] is not None, outs[1] is not None))
        original(batches, stats)
        cells.extend(nodes for nodes in batches if len(nodes[0].outs) == 2)

    xs = [torch.randn(4) for _ in range(3)]
    with torch.no_grad():
        walk.map(xs, m=m, steps=4)  # (the first map's calls are watched for a cut: held)
    fibers.execute = execute
    try:
        with torch.no_grad():
            got = walk.map(xs, m=m, steps=4)
    finally:
        fibers.execute = original
    assert states[0] == (True, True)  # the next step reads the state
    assert (False, True) in states  # then only the score is left
    assert all(score for _, score in states)  # and it is, until the stack has run
    assert all(g[0].shape == (4, 1) for g in got)


@settings(max_examples=10, deadline=None)
@given(
    rounds=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_in_place_updates_across_flushes_equal_eager(rounds, seed):
    """Handles rebound by in-place updates (``a += b``) between value reads: each
    rebinding moves the handle's count, the old value stays readable where an op
    recorded before reads it, and nothing is freed that a later step reads."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(3, generator=g) for _ in rounds]

    @acrobat.autobatch
    def f(x, k):
        a = x + 1
        before = a * 2  # reads a's old value
        total = torch.zeros(3)
        for _ in range(k):
            b = torch.tanh(a)
            a += b  # rebinds a
            if float(a.sum()) > 100.0:  # a value read: a flush per round
                break
            total = total + before + a
        return total, a, before

    with torch.no_grad():
        got, gone = _gone_before_the_end(f.map, xs, rounds)
        want = [f.eager(x, k) for x, k in zip(xs, rounds)]
    for g_, w_ in zip(got, want):
        for a_, b_ in zip(g_, w_):
            torch.testing.assert_close(a_, b_)
    if _native is not None and max(rounds) > 2:
        assert gone > 0


@needs_native
def test_handles_of_a_node_count_up_and_down():
    node = Node(None, None, (), None, (), None, None, 0, 0, 0, None)
    shape, dtype = torch.Size([2]), torch.float32
    a = LazyTensor(node, 0, shape, dtype)
    b = LazyTensor(node, 1, shape, dtype)
    c = LazyTensor(node, 1, shape, dtype)
    assert _native.out_counts(node)[0] == (1, 2, 0, 0)
    del b
    assert _native.out_counts(node)[0] == (1, 1, 0, 0)
    other = Node(None, None, (), None, (), None, None, 0, 0, 0, None)
    c.rebind(other, 0)
    assert _native.out_counts(node)[0] == (1, 0, 0, 0)
    assert _native.out_counts(other)[0] == (1, 0, 0, 0)
    LazyTensor.__init__(a, other, 3, shape, dtype)  # (re-initialised: counted anew)
    assert _native.out_counts(node)[0] == (0, 0, 0, 0)
    assert _native.out_counts(other)[0] == (1, 0, 0, 1)
    far = LazyTensor(node, 7, shape, dtype)  # past the counted outputs: never released
    assert _native.out_counts(node)[0] == (0, 0, 0, 0)
    with pytest.raises(AttributeError):
        far.node = other  # only rebind() moves a handle
    with pytest.raises(AttributeError):
        far.idx = 0


@needs_native
def test_a_batch_frees_an_output_when_its_last_handle_dies():
    nodes = [Node(None, None, (), None, (), None, None, 0, 0, i, None) for i in range(3)]
    shape, dtype = torch.Size([2]), torch.float32
    hs = [LazyTensor(nd, 0, shape, dtype) for nd in nodes]
    keep = [LazyTensor(nd, 1, shape, dtype) for nd in nodes]
    state, scores = torch.zeros(3, 2), torch.ones(3, 2)
    ref = weakref.ref(state)
    outs = (state, scores, torch.zeros(3))
    del state
    _native.finish_rows(nodes, outs, 0, True)
    assert nodes[0].outs is not outs and nodes[0].outs == outs[:2] + (None,)
    del outs
    assert nodes[0].outs is nodes[2].outs  # one copy of the tuple, the batch's own
    assert _native.out_counts(nodes[0])[1] == (3, 3, 0)
    assert nodes[0].outs[2] is None  # no handle at all: dropped right away
    del hs[:2]
    assert ref() is not None and _native.out_counts(nodes[0])[1] == (1, 3, 0)
    del hs[0]
    assert ref() is None and nodes[1].outs[0] is None
    assert nodes[1].outs[1] is scores and len(keep) == 3
    # a pinned batch keeps everything
    more = [Node(None, None, (), None, (), None, None, 0, 0, i, None) for i in range(2)]
    t = LazyTensor(more[0], 0, shape, dtype)
    _native.finish_rows(more, (torch.zeros(2, 2),), 10, True)
    _native.pin(more[0])
    del t
    assert isinstance(more[0].outs[0], torch.Tensor) and _native.out_counts(more[1])[2]
    # without ``free``: the tuple as given, no counts
    plain = (torch.zeros(2, 2),)
    _native.finish_rows(more, plain, 20)
    assert more[0].outs is plain and _native.out_counts(more[0])[1] is None


@needs_native
def test_computed_nodes_keep_their_operands_where_autograd_records(monkeypatch):
    """With gradients on, a requires_grad walk reads computed nodes' operands: kept."""
    torch.manual_seed(2)
    m = Cell(3)
    released = []
    monkeypatch.setattr(
        executor._native, "release_inputs", lambda batches: released.extend(batches)
    )
    xs = [torch.randn(3) for _ in range(3)]
    check_grads(walk_total, xs, m, m=m, steps=3)
    assert not released
    with torch.no_grad():
        check_map(walk_total, xs, m=m, steps=3)
    assert released


def test_the_switch_is_on_by_default():
    assert config.FREE_OUTPUTS


class _Words(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(3, 4)
        self.leaf = torch.nn.Linear(4, 4)


def _leaf(model, x):  # straight-line: a block; equal words read equal table rows
    return torch.tanh(model.leaf(x))


@needs_native
def test_rows_shared_by_equal_words_outlive_the_instance_that_computed_them():
    """Equal words' leaves run once (executor._distinct): the other instances read the
    first one's row, uncounted, so that batch is pinned. Here the first instance is done
    (its leaf's handles gone) flushes before the others read the shared row."""
    torch.manual_seed(3)
    model = _Words()

    @acrobat.autobatch
    def f(word, rounds):
        x = _leaf(model, model.emb(torch.tensor(word)))
        y = x * 1.0
        for _ in range(rounds):
            if float(y.sum()) > 1e6:  # a value read: a flush per round
                break
            y = y + 0.0
        return x + y

    shared: list = []  # the outputs tuples of batches other nodes read uncounted
    kept = []  # at each later flush: whether all of them still hold their tensors
    original = fibers.execute

    def execute(batches, stats):
        kept.extend(all(o is not None for o in outs) for outs in shared)
        original(batches, stats)
        rt = batches[0][0].rt
        shared.extend(nodes[0].outs for nodes in batches if id(nodes[0].outs) in rt.shared)

    words, rounds = [1, 1, 1, 2], [1, 4, 3, 2]
    with torch.no_grad():
        f.map(words, rounds)  # (the trace decisions made)
        fibers.execute = execute
        try:
            got, stats = f.map(words, rounds, stats=True)
        finally:
            fibers.execute = original
        want = [f.eager(w, r) for w, r in zip(words, rounds)]
    assert stats.shared > 0 and shared  # the equal words' leaves were shared
    assert kept and all(kept)  # ... and their rows kept while the map ran
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_)


@needs_native
def test_the_helpers_refuse_what_is_not_theirs():
    with pytest.raises(TypeError, match=r"pin\(node\)"):
        _native.pin(object())
    with pytest.raises(TypeError, match=r"out_counts\(node\)"):
        _native.out_counts(3)
    with pytest.raises(TypeError, match=r"keep_freed\(list or None\)"):
        _native.keep_freed(())
    with pytest.raises(TypeError, match=r"release_inputs\(batches"):
        _native.release_inputs(())
    with pytest.raises(TypeError, match=r"finish_rows\(nodes: list, outs, base, free=False\)"):
        _native.finish_rows([], (), 0, True, 5)
    with pytest.raises(TypeError, match="rebind"):
        LazyTensor(Node(None, None, (), None, (), None, None, 0, 0, 0, None), 0,
                   torch.Size([1]), torch.float32).rebind(None)
