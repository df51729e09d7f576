"""Sampling in instance code: ``torch.multinomial`` (a sampling decoder's next token,
``Categorical(probs).sample()``) and ``torch.bernoulli``. A batch draws for every instance at
once: each instance gets its own draw, from its own probabilities, with eager's
distribution (not eager's numbers: another random stream, as with dropout)."""

from __future__ import annotations

import math

import pytest
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


def test_poisson_draws_count_each_instances_own_rates():
    @acrobat.autobatch
    def counts(x):
        return torch.poisson(torch.exp(x))  # (a count model's sample of its own rates)

    torch.manual_seed(5)
    rates = [math.log(0.5), math.log(4.0), math.log(30.0)]
    xs = [torch.full((4000,), r) for r in rates]
    got, stats = counts.map(xs, stats=True)
    assert stats.by_op["poisson"][0] == 1, stats.by_op  # (one draw for all instances)
    for g, r in zip(got, rates):
        assert g.shape == (4000,) and g.dtype == torch.float32
        assert torch.equal(g, g.round()) and bool((g >= 0).all())
        rate = math.exp(r)  # the sample mean within 5 standard errors of the rate
        assert abs(float(g.mean()) - rate) < 5 * math.sqrt(rate / 4000), (float(g.mean()), rate)


def test_binomial_draws_use_each_instances_own_probabilities():
    @acrobat.autobatch
    def successes(x):
        return torch.binomial(torch.full_like(x, 10.0), torch.sigmoid(x))

    torch.manual_seed(6)
    probs = [0.1, 0.5, 0.9, 0.5]  # (two instances with equal rows: each its own draw)
    xs = [torch.full((3000,), math.log(p / (1 - p))) for p in probs]
    got, stats = successes.map(xs, stats=True)
    assert stats.by_op["binomial"][0] == 1, stats.by_op
    assert not torch.equal(got[1], got[3])
    for g, p in zip(got, probs):
        assert torch.equal(g, g.round()) and bool(((g >= 0) & (g <= 10)).all())
        sd = math.sqrt(10 * p * (1 - p) / 3000)
        assert abs(float(g.mean()) - 10 * p) < 5 * sd, (float(g.mean()), p)


def test_draws_differ_between_instances():
    torch.manual_seed(3)
    xs = [torch.zeros(50) for _ in range(6)]  # uniform over 50: equal draws are unlikely
    got = draw.map(xs)
    assert len({int(g) for g in got}) > 1


POLICY = nn.Linear(4, 3)


@acrobat.autobatch
def episode(inst, policy=POLICY):
    """A policy's rollout over given states and actions (a replayed episode): the
    log-probability and entropy of each action under torch.distributions.Categorical."""
    states, actions = inst
    logp, entropy = [], []
    for s, a in zip(states, actions):
        d = torch.distributions.Categorical(logits=policy(s))
        logp.append(d.log_prob(torch.tensor(a)))
        entropy.append(d.entropy())
    return torch.stack(logp).sum(), torch.stack(entropy).mean()


@settings(max_examples=6, deadline=None)
@given(
    episodes=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1, max_size=5),
    seed=st.integers(0, 99),
)
def test_log_probabilities_of_given_actions_equal_eager_and_train(episodes, seed):
    g = torch.Generator().manual_seed(seed)
    data = [(list(torch.randn(len(acts), 4, generator=g)), acts) for acts in episodes]
    got = episode.map(data)
    want = [episode.eager(x) for x in data]
    for (lp, h), (wlp, wh) in zip(got, want):
        torch.testing.assert_close(lp, wlp)
        torch.testing.assert_close(h, wh)
    POLICY.zero_grad()
    sum(lp for lp, _ in got).backward()
    grads = [p.grad.clone() for p in POLICY.parameters()]
    POLICY.zero_grad()
    sum(lp for lp, _ in want).backward()
    for a, p in zip(grads, POLICY.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_a_sampled_policy_and_a_value_outside_the_support():
    @acrobat.autobatch
    def act(s, policy=POLICY):
        d = torch.distributions.Categorical(logits=policy(s))
        a = d.sample()
        return a, d.log_prob(a)

    torch.manual_seed(5)
    for a, lp in act.map([torch.randn(4) for _ in range(8)]):
        logits = POLICY(torch.zeros(4)).detach()  # (any state: a valid action index)
        assert 0 <= int(a) < logits.shape[0] and float(lp) <= 0.0

    @acrobat.autobatch
    def bad(s, policy=POLICY):
        return torch.distributions.Categorical(logits=policy(s)).log_prob(s.sum() * 0 + 7)

    with pytest.raises(ValueError, match="support"):
        bad.map([torch.randn(4), torch.randn(4)])


LATENT = nn.Linear(4, 6)


@acrobat.autobatch
def reparameterized(x, enc=LATENT):
    """A VAE's latent sample: Normal(mu, sigma).rsample() (torch.distributions draws into
    torch.empty(shape).normal_()): each instance its own noise, batched."""
    mu, logvar = enc(x).chunk(2, -1)
    return torch.distributions.Normal(mu, (0.5 * logvar).exp()).rsample()


def test_rsample_draws_per_instance_with_the_right_distribution_and_batches():
    torch.manual_seed(6)
    xs = [torch.randn(4) for _ in range(500)]
    with torch.no_grad():
        got, stats = reparameterized.map(xs, stats=True)
        mu, logvar = LATENT(torch.stack(xs)).chunk(2, -1)
    noise = (torch.stack(got) - mu) / (0.5 * logvar).exp()
    assert abs(noise.mean().item()) < 0.05 and abs(noise.std().item() - 1) < 0.05
    assert len({tuple(n.tolist()) for n in noise}) == len(xs)  # nobody shares a draw
    assert stats.batches < 20, stats.by_op  # the reading ops batch across instances


def test_gumbel_softmax_is_one_hot_with_the_soft_gradient():
    @acrobat.autobatch
    def pick(x, enc=LATENT):
        return torch.nn.functional.gumbel_softmax(enc(x), tau=0.5, hard=True)

    torch.manual_seed(7)
    xs = [torch.randn(4) for _ in range(6)]
    got = pick.map(xs)
    for y in got:
        assert sorted(y.tolist()) == [0.0] * 5 + [1.0]
    LATENT.zero_grad()
    (torch.stack(got) * torch.arange(6.0)).sum().backward()
    assert LATENT.weight.grad.abs().sum() > 0  # straight through: the soft values' gradient


def test_a_random_fill_inside_a_block_is_refused():
    noise = acrobat.block(lambda x: x + torch.empty(x.shape).normal_())

    @acrobat.autobatch
    def f(x):
        return noise(x * 2)

    with pytest.raises(acrobat.AcrobatError, match="inside a block"):
        f.map([torch.randn(3), torch.randn(3)])


def test_a_gaussian_policy_samples_and_scores_its_actions():
    @acrobat.autobatch
    def act(x, enc=LATENT):
        mu, log_std = enc(x).chunk(2, -1)
        d = torch.distributions.Normal(mu, log_std.exp())
        a = d.sample()
        return (a - mu) / log_std.exp(), d.log_prob(a).sum(), d.entropy().sum()

    torch.manual_seed(8)
    xs = [torch.randn(4) for _ in range(400)]
    with torch.no_grad():
        got = act.map(xs)
    z = torch.stack([g[0] for g in got])
    assert abs(z.mean().item()) < 0.06 and abs(z.std().item() - 1) < 0.06
    for (zi, logp, h), x in zip(got, xs):  # log N(a; mu, sigma) from the standardized draw
        with torch.no_grad():
            _, log_std = LATENT(x).chunk(2, -1)
        want = (-0.5 * zi**2 - log_std - 0.5 * math.log(2 * math.pi)).sum()
        torch.testing.assert_close(logp, want, atol=1e-4, rtol=1e-4)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + log_std).sum()
        torch.testing.assert_close(h, entropy, atol=1e-4, rtol=1e-4)


def test_a_run_that_builds_a_distribution_runs_as_written():
    """Without argument checks (validate_args=False) nothing in ``h = cell(x, h); d =
    Categorical(logits=head(h))`` reads a value, so the two lines are one run: a block
    that would return a Categorical. The run then runs as written (before, the map
    raised "a block returned a Categorical")."""

    @acrobat.autobatch
    def act(x, enc=LATENT):
        h = torch.tanh(enc(x))
        d = torch.distributions.Categorical(logits=h, validate_args=False)
        best = int(d.logits.argmax())  # (a read: the run ends here, d lives on)
        return d.log_prob(torch.tensor(best))

    xs = [torch.randn(4) for _ in range(5)]
    for got, x in zip(act.map(xs), xs):
        torch.testing.assert_close(got, act.eager(x))


def test_a_sample_of_the_wrong_shape_raises_as_eager():
    """The lazy-aware sample check keeps eager's shape checks: the event size (a one-hot
    of 4 against 3 categories) and the batch shape (3 values against a batch of 2)."""

    @acrobat.autobatch
    def wrong_event(x, enc=LATENT):
        d = torch.distributions.OneHotCategorical(logits=enc(x)[:3])
        return d.log_prob(torch.cat([x, x])[:4] * 0)

    @acrobat.autobatch
    def wrong_batch(x, enc=LATENT):
        d = torch.distributions.Categorical(logits=enc(x).reshape(2, 3))
        return d.log_prob(x[:3].long() * 0)

    xs = [torch.randn(4), torch.randn(4)]
    for f, message in ((wrong_event, "right-most size"), (wrong_batch, "not broadcastable")):
        with pytest.raises(ValueError, match=message):
            f.eager(xs[0])
        with pytest.raises(ValueError, match=message):
            f.map(xs)
