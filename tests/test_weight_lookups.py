"""Lookups into a weight by a per-instance Python int, written the plain way: ``W[:, tok]``
(a column of an output projection), ``self.W[tok]`` in a module's step method, in a loop's
body or in a run beside control flow. Each used to key a trace by the int (a batch per
distinct token: twice the eager loop's time) or, for ``W[:, tok]``, to stay a real tensor
(nothing batched at all). Now the int is instance data: the lookups of every instance are
one batch, and the map equals the eager loop, gradients included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from tests.helpers import check_grads, check_map

DIM, VOCAB = 6, 9


def _column(i, w):
    return torch.tanh(w[:, i]) * 2.0


def _middle(i, w):
    return torch.tanh(w[1:, i, :2]) * 2.0


def _row(i, w):
    return torch.tanh(w[i]) * 2.0


_LOOKUPS = {"column": (_column, (DIM, VOCAB)), "middle": (_middle, (3, VOCAB, 4)),
            "row": (_row, (VOCAB, DIM))}  # fmt: skip


@settings(max_examples=20, deadline=None)
@given(
    how=st.sampled_from(sorted(_LOOKUPS)),
    ints=st.lists(st.integers(-VOCAB, VOCAB - 1), min_size=1, max_size=7),
    seed=st.integers(0, 2**16),
)
def test_a_weight_indexed_by_an_int_is_one_lookup_batch(how, ints, seed):
    """``w[:, i]`` / ``w[1:, i, :2]`` / ``w[i]`` of a real tensor by each instance's int
    (negative ones included): one ``take`` batch over all of them, gradients as eager's."""
    fn, shape = _LOOKUPS[how]
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    f = acrobat.autobatch(fn)
    with torch.no_grad():
        stats = check_map(f, ints, w=w)
    assert stats.by_op["take"] == [1, len(ints)]
    holder = nn.Module()
    holder.w = nn.Parameter(w.detach().clone())
    check_grads(f, ints, holder, w=holder.w)


def test_a_lookup_along_a_dim_out_of_range_names_the_instance():
    w = torch.randn(DIM, VOCAB)
    f = acrobat.autobatch(_column)
    with pytest.raises(IndexError, match=r"index 9 is out of bounds .*size 9 \(instance 2"):
        f.map([0, 1, VOCAB, 2], w=w)
    assert len(f.map([0, -1], w=w)) == 2  # usable again


class Reader(nn.Module):
    """A recurrent reader of token ids written four ways: a step method, a loop body, a
    loop body beside control flow, and a step whose int is also used otherwise."""

    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.by_column = nn.Parameter(torch.randn(DIM, VOCAB) * 0.5)
        self.by_row = nn.Parameter(torch.randn(VOCAB, DIM) * 0.5)
        self.cell = nn.Linear(3 * DIM, DIM)
        self.out = nn.Linear(DIM, 2)

    def step(self, h, tok):
        x = torch.cat([self.by_column[:, tok], self.by_row[tok]])
        return torch.tanh(self.cell(torch.cat([x, h])))

    def step_shifted(self, h, tok):  # tok read as a number too: keyed by it, as before
        x = torch.cat([self.by_column[:, tok], self.by_row[(tok + 1) % VOCAB]])
        return torch.tanh(self.cell(torch.cat([x, h])))

    def forward(self, toks):
        if self.style == "method":
            h = self.read_method(toks)
        elif self.style == "shifted":
            h = self.read_shifted(toks)
        elif self.style == "loop":
            h = self.read_loop(toks)
        else:
            h = self.read_branchy(toks)
        return self.out(h)

    def read_method(self, toks):
        h = torch.zeros(DIM)
        for tok in toks:
            h = self.step(h, tok)
        return h

    def read_shifted(self, toks):
        h = torch.zeros(DIM)
        for tok in toks:
            h = self.step_shifted(h, tok)
        return h

    def read_loop(self, toks):
        h = torch.zeros(DIM)
        for tok in toks:
            x = torch.cat([self.by_column[:, tok], self.by_row[tok]])
            h = torch.tanh(self.cell(torch.cat([x, h])))
        return h

    def read_branchy(self, toks):  # the if: the body's run is a region, not a scan
        h = torch.zeros(DIM)
        for tok in toks:
            x = torch.cat([self.by_column[:, tok], self.by_row[tok]])
            h = torch.tanh(self.cell(torch.cat([x, h])))
            if tok == 0:
                continue
        return h


@acrobat.autobatch
def read(toks, model):
    return model(toks)


@settings(max_examples=12, deadline=None)
@given(
    style=st.sampled_from(["method", "loop", "branchy", "shifted"]),
    sentences=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), min_size=1, max_size=6
    ),
    seed=st.integers(0, 2**16),
)
def test_token_lookups_in_user_code_batch_across_the_tokens(style, sentences, seed):
    torch.manual_seed(seed)
    model = Reader(style)
    with torch.no_grad():
        stats = check_map(read, sentences, model=model)
    steps, words = max(map(len, sentences)), sum(map(len, sentences))
    blocks = [c for k, c in stats.by_op.items() if k.startswith("block:")]
    scans = [c for k, c in stats.by_op.items() if k.startswith("scan:")]
    assert len(blocks) <= 1 and len(scans) <= 1, stats.by_op
    batches, nodes = blocks[0] if blocks else (0, 0)
    if style == "loop":  # the whole loop one scan node per instance (of two steps or more)
        assert (scans[0][1] if scans else 0) == sum(len(s) > 1 for s in sentences)
        assert nodes == sum(len(s) == 1 for s in sentences)
    elif style == "shifted":  # the int is read as a number too: it keys the trace, as before
        assert "tensor" not in stats.by_op and not scans
        assert nodes == words - len(sentences)  # (the first step, given no lazy tensor, op by op)
    else:  # a block node per step, one batch per step whatever the tokens
        assert nodes == words and batches == steps and not scans, stats.by_op
    check_grads(read, sentences, model, atol=1e-5, model=model)


def test_a_step_method_given_a_float_where_it_indexes_fails_like_eager():
    """A float where the body indexes (made a 0-d float tensor like an int is made an
    int64 one) fails in the map as it does in the eager loop, naming the instance."""
    model = Reader("method")
    with pytest.raises((IndexError, TypeError, acrobat.AcrobatError)):
        model([1.0])
    with torch.no_grad(), pytest.raises((IndexError, TypeError, acrobat.AcrobatError)) as info:
        read.map([[1], [1.0]], model=model)
    assert "instance 1" in " ".join([str(info.value), *getattr(info.value, "__notes__", [])])
    with torch.no_grad():  # ints still take the value path: one batch per step
        stats = check_map(read, [[1, 2], [3, 4]], model=model)
    assert stats.by_op["block:Reader.step"] == [2, 4] and "tensor" in stats.by_op


@pytest.mark.parametrize("style", ["method", "loop", "branchy"])
def test_a_token_out_of_range_names_the_instance_and_the_map_works_after(style):
    model = Reader(style)
    with torch.no_grad(), pytest.raises((IndexError, acrobat.AcrobatError)) as info:
        read.map([[1, 2], [3, VOCAB + 2]], model=model)
    said = " ".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert "instance 1" in said and "out of bounds" in said
    assert "test_weight_lookups.py" in said
    with torch.no_grad():
        check_map(read, [[1, 2], [3]], model=model)
