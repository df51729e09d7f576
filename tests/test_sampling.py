"""Sampling in instance code: ``torch.multinomial`` (a sampling decoder's next token,
``Categorical(probs).sample()``) and ``torch.bernoulli``. A batch draws for every instance at
once: each instance gets its own draw, from its own probabilities, with eager's
distribution (not eager's numbers: another random stream, as with dropout)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat

PROBS = torch.tensor([0.2, 0.3, 0.5])


@acrobat.autobatch
def draw(logits):
    return torch.multinomial(torch.softmax(logits, -1), 1)


def test_each_instance_draws_from_its_own_probabilities():
    torch.manual_seed(0)
    n = 1200
    # half the instances always draw 0, half sample from PROBS
    sure = torch.tensor([0.0, -1e9, -1e9])
    xs = [PROBS.log() if i % 2 else sure for i in range(n)]
    with torch.no_grad():
        got, stats = draw.map(xs, stats=True)
    assert stats.batches <= 4, stats.by_op  # one batch of draws, not one per instance
    draws = torch.cat(got[1::2])
    assert all(int(g) == 0 for g in got[0::2])
    for k, p in enumerate(PROBS.tolist()):
        freq = (draws == k).float().mean().item()
        sd = math.sqrt(p * (1 - p) / (n // 2))
        assert abs(freq - p) < 5 * sd, (k, freq, p)


@acrobat.autobatch
def sample_tokens(h, model):
    """A sampling decoder: feed back a sampled token until the end token or 8 steps."""
    tokens = []
    token = 1
    for _ in range(8):
        h = model.cell(model.emb.weight[token], h)
        token = int(torch.distributions.Categorical(logits=model.out(h)).sample())
        tokens.append(token)
        if token == 0:
            break
    return torch.tensor(tokens)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(6, 4)
        self.cell = nn.GRUCell(4, 4)
        self.out = nn.Linear(4, 6)


@settings(max_examples=5, deadline=None)
@given(batch=st.integers(1, 12), seed=st.integers(0, 99))
def test_a_sampling_decoder_runs_batched(batch, seed):
    torch.manual_seed(seed)
    model = Decoder()
    hs = [torch.randn(4) for _ in range(batch)]
    with torch.no_grad():
        got = sample_tokens.map(hs, model=model)
    for tokens in got:
        assert 1 <= len(tokens) <= 8 and tokens.dtype == torch.long
        assert all(0 <= t < 6 for t in tokens.tolist())
        assert (tokens[:-1] != 0).all()  # it stops at the first end token


def test_samples_without_replacement_are_distinct_and_bernoulli_is_zero_or_one():
    @acrobat.autobatch
    def f(x):
        return torch.multinomial(x.softmax(-1), 4), torch.bernoulli(torch.sigmoid(x))

    torch.manual_seed(2)
    xs = [torch.randn(2, 5) for _ in range(20)]
    for picks, coins in f.map(xs):
        assert picks.shape == (2, 4) and coins.shape == (2, 5)
        assert all(len(set(row)) == 4 for row in picks.tolist())
        assert set(coins.flatten().tolist()) <= {0.0, 1.0}


def test_draws_differ_between_instances():
    torch.manual_seed(3)
    xs = [torch.zeros(50) for _ in range(6)]  # uniform over 50: equal draws are unlikely
    got = draw.map(xs)
    assert len({int(g) for g in got}) > 1
