"""A batch of a pure block runs once per distinct row of operands (config.DISTINCT_ROWS):
leaves of the same word share one computed row. Every map still equals the eager loop,
gradients included, and no two instances' results share memory."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import config
from acrobat.tensor import _native
from tests.helpers import check_grads, check_map

H = 8
WORDS = 4  # few words: most batches of trees repeat some


class Model(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(WORDS, H)
        self.leaf = nn.Linear(H, 2 * H)
        self.node = nn.Linear(2 * H, H)
        self.dropout = nn.Dropout(dropout)


def leaf_cell(model, x):  # straight-line: one block per call (config.AUTO_BLOCKS)
    a, b = model.leaf(x).chunk(2)
    return torch.sigmoid(a) * torch.tanh(b)


def node_cell(model, l, r):
    return torch.tanh(model.node(torch.cat([l, r])))


def noisy_leaf(model, x):
    return model.dropout(torch.tanh(model.leaf(x)))


def encode(tree, model):
    if isinstance(tree, int):
        return leaf_cell(model, model.emb(torch.tensor(tree)))
    return node_cell(model, encode(tree[0], model), encode(tree[1], model))


@acrobat.autobatch
def encode_tree(tree, model):
    return encode(tree, model)


@acrobat.autobatch
def encode_word(word, model):
    return leaf_cell(model, model.emb(torch.tensor(word)))


@acrobat.autobatch
def noisy_word(word, model):
    return noisy_leaf(model, model.emb(torch.tensor(word)))


trees = st.recursive(
    st.integers(0, WORDS - 1), lambda sub: st.tuples(sub, sub), max_leaves=8
)


def leaves(tree) -> list[int]:
    return [tree] if isinstance(tree, int) else leaves(tree[0]) + leaves(tree[1])


@pytest.fixture(autouse=True)
def distinct_on(monkeypatch):
    monkeypatch.setattr(config, "DISTINCT_ROWS", True)


@settings(max_examples=30, deadline=None)
@given(batch=st.lists(trees, min_size=1, max_size=8))
def test_trees_with_repeated_words_match_eager(batch):
    torch.manual_seed(0)
    model = Model().eval()
    with torch.no_grad():
        stats = check_map(encode_tree, batch, model=model)
    words = [w for tree in batch for w in leaves(tree)]
    # every leaf cell runs in one batch: one row per distinct word; equal subtrees at one
    # level may share too
    assert stats.shared >= len(words) - len(set(words))
    assert stats.by_op["block:leaf_cell"][1] == len(words)  # (counted as recorded)


@settings(max_examples=20, deadline=None)
@given(words=st.lists(st.integers(0, WORDS - 1), min_size=1, max_size=12))
def test_one_row_per_distinct_word(words):
    torch.manual_seed(1)
    model = Model().eval()
    with torch.no_grad():
        stats = check_map(encode_word, words, model=model)
    assert stats.shared == len(words) - len(set(words))


@settings(max_examples=15, deadline=None)
@given(batch=st.lists(trees, min_size=1, max_size=6))
def test_gradients_through_shared_rows_match_eager(batch):
    torch.manual_seed(2)
    model = Model()
    stats = check_grads(encode_tree, batch, model, model=model)
    words = [w for tree in batch for w in leaves(tree)]
    assert stats.shared >= len(words) - len(set(words))


def test_results_of_instances_do_not_share_memory():
    model = Model().eval()
    with torch.no_grad():
        out, stats = encode_word.map([3, 3, 3], stats=True, model=model)
        want = encode_word.eager(3, model=model)
    assert stats.shared == 2
    assert len({t.data_ptr() for t in out}) == 3
    out[0].zero_()  # the user's own tensor: the others keep eager's value
    torch.testing.assert_close(out[1], want)
    torch.testing.assert_close(out[2], want)


def test_random_draws_are_never_shared():
    torch.manual_seed(3)
    model = Model(dropout=0.5).train()
    with torch.no_grad():
        out, stats = noisy_word.map([1] * 6, stats=True, model=model)
    assert stats.shared == 0
    masks = {tuple((t != 0).tolist()) for t in out}
    assert len(masks) > 1  # each instance drew its own mask (as eager does)


def test_off_shares_nothing_and_matches(monkeypatch):
    monkeypatch.setattr(config, "DISTINCT_ROWS", False)
    torch.manual_seed(4)
    model = Model().eval()
    batch = [((0, 1), 0), (0, (1, 1)), 2, 2]
    with torch.no_grad():
        stats = check_map(encode_tree, batch, model=model)
    assert stats.shared == 0


# ---- a loop's hoisted part over elements made from equal ints -------------------------


class Tagger(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(WORDS, H)
        self.wx = nn.Linear(H, H)
        self.wh = nn.Linear(H, H, bias=False)
        self.vx = nn.Linear(H, H)
        self.vh = nn.Linear(H, H, bias=False)
        self.dropout = nn.Dropout(dropout)


def elman(wx, wh, x, h):  # W_x x is hoisted out of the loop: one GEMM for all steps
    return torch.tanh(wx(x) + wh(h))


def run_loop(wx, wh, xs):
    h = torch.zeros(H)
    states = []
    for x in xs:
        h = elman(wx, wh, x, h)
        states.append(h)
    return states


def run_loop_reading_x(wx, wh, xs):  # the step reads x besides W_x x
    h = torch.zeros(H)
    states = []
    for x in xs:
        h = torch.tanh(wx(x) + wh(h)) * torch.sigmoid(x)
        states.append(h)
    return states


def run_noisy_loop(model, xs):
    h = torch.zeros(H)
    states = []
    for x in xs:
        h = torch.tanh(model.wx(model.dropout(x)) + model.wh(h))
        states.append(h)
    return states


@acrobat.autobatch
def tag(words, model):
    xs = [model.emb(torch.tensor(w)) for w in words]
    forward = run_loop(model.wx, model.wh, xs)
    backward = run_loop(model.vx, model.vh, xs[::-1])[::-1]
    return torch.stack([f + b for f, b in zip(forward, backward)])


@acrobat.autobatch
def tag_reading_x(words, model):
    xs = [model.emb(torch.tensor(w)) for w in words]
    return torch.stack(run_loop_reading_x(model.wx, model.wh, xs))


@acrobat.autobatch
def tag_noisy(words, model):
    xs = [model.emb(torch.tensor(w)) for w in words]
    return torch.stack(run_noisy_loop(model, xs))


sentences = st.lists(
    st.lists(st.integers(0, WORDS - 1), min_size=1, max_size=12), min_size=1, max_size=12
)


@settings(max_examples=25, deadline=None)
@given(batch=sentences)
def test_loops_over_repeated_words_match_eager(batch):
    torch.manual_seed(5)
    model = Tagger().eval()
    with torch.no_grad():
        stats = check_map(tag, batch, model=model)
        check_map(tag_reading_x, batch, model=model)
    assert stats.shared <= 2 * sum(len(s) for s in batch)  # (what it found, if anything)


@pytest.mark.skipif(_native is None, reason="loop repeats are found by acrobat._native")
def test_each_directions_projection_runs_once_per_word():
    torch.manual_seed(6)
    model = Tagger().eval()
    batch = [[(i + j) % WORDS for j in range(3 + i % 7)] for i in range(24)]
    words = sum(len(s) for s in batch)
    with torch.no_grad():
        stats = check_map(tag, batch, model=model)
        reading = check_map(tag_reading_x, batch, model=model)
    assert stats.shared == 2 * (words - WORDS)  # every word but the first of each kind
    assert reading.shared == words - WORDS  # (the step's own x read as gathered)


@pytest.mark.skipif(_native is None, reason="loop repeats are found by acrobat._native")
def test_loop_gradients_through_repeated_words_match_eager():
    torch.manual_seed(7)
    model = Tagger()
    batch = [[(i * j) % WORDS for j in range(2 + i % 9)] for i in range(20)]
    # (sums of ~200 float32 terms: the eager loop's own order differs, with or without)
    stats = check_grads(tag, batch, model, atol=2e-4, rtol=1e-4, model=model)
    assert stats.shared > 0


def test_a_draw_per_element_is_never_shared():
    torch.manual_seed(8)
    model = Tagger(dropout=0.5).train()
    batch = [[j % WORDS for j in range(10)] for _ in range(16)]
    with torch.no_grad():
        out, stats = tag_noisy.map(batch, stats=True, model=model)
    assert stats.shared == 0
    assert len({tuple(o[0].tolist()) for o in out}) > 1  # one mask per instance's word
