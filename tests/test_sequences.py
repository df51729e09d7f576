"""nn.LSTM / nn.GRU / nn.RNN on per-instance sequences (config.PACKED_SEQUENCES): the
sequences of every instance, of any lengths, run as one packed call of the module, equal
to the eager loop forward and backward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import config
from tests.helpers import check_grads, check_map

D = 4


def make_module(kind: str, hidden: int, layers: int, bidirectional: bool, batch_first: bool):
    cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind]
    return cls(D, hidden, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)


def encoder(module, form: str):
    @acrobat.autobatch
    def encode(x):
        if form == "batch of one":
            x = x.unsqueeze(0 if module.batch_first else 1)
        out, state = module(x)
        return out, state

    return encode


modules = st.builds(
    make_module,
    kind=st.sampled_from(["lstm", "gru", "rnn"]),
    hidden=st.integers(1, 5),
    layers=st.integers(1, 2),
    bidirectional=st.booleans(),
    batch_first=st.booleans(),
)


@settings(max_examples=25, deadline=None)
@given(
    module=modules,
    form=st.sampled_from(["unbatched", "batch of one"]),
    lengths=st.lists(st.integers(1, 7), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_sequences_of_any_lengths_are_one_packed_call_equal_to_eager(module, form, lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, D, generator=gen) for n in lengths]
    with torch.no_grad():
        stats = check_map(encoder(module, form), xs)
    assert stats.by_op["sequences"] == [1, len(xs)]  # one packed call for every length


def test_switched_off_the_module_is_not_batched():
    module = nn.GRU(D, 3)
    with config.override(PACKED_SEQUENCES=False, GENERIC_VMAP=False), pytest.raises(
        acrobat.UnsupportedOpError
    ):
        encoder(module, "unbatched").map([torch.randn(3, D), torch.randn(2, D)])


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_gradients_through_packed_sequences_equal_eager(kind):
    torch.manual_seed(1)
    module = make_module(kind, 3, 2, True, False)
    encode = encoder(module, "unbatched")
    xs = [torch.randn(n, D, requires_grad=True) for n in (4, 1, 6, 4)]

    def loss(outputs):
        total = 0
        for out, state in outputs:
            states = state if isinstance(state, tuple) else (state,)
            total = total + (out * out).sum() + sum(s.sum() for s in states)
        return total

    loss(encode.map(xs)).backward()
    got = [p.grad.clone() for p in module.parameters()] + [x.grad.clone() for x in xs]
    module.zero_grad()
    for x in xs:
        x.grad = None
    loss([encode.eager(x) for x in xs]).backward()
    want = [p.grad for p in module.parameters()] + [x.grad for x in xs]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


class SentenceClassifier(nn.Module):
    """The usual sentence model: word ids -> embeddings -> LSTM -> last state -> logits."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, D)
        self.lstm = nn.LSTM(D, 5, batch_first=True)
        self.out = nn.Linear(5, 3)

    def forward(self, words):
        vectors = self.emb(torch.tensor(words)).unsqueeze(0)
        _, (h, _) = self.lstm(vectors)
        return self.out(h[-1, 0])


@settings(max_examples=15, deadline=None)
@given(st.lists(st.lists(st.integers(0, 19), min_size=1, max_size=9), min_size=1, max_size=8))
def test_a_sentence_classifier_as_written(sentences):
    model = SentenceClassifier().eval()

    @acrobat.autobatch
    def classify(words, model):
        return model(words)

    with torch.no_grad():
        stats = check_map(classify, sentences, model=model)
    assert stats.by_op["sequences"] == [1, len(sentences)]  # every sentence in one LSTM call


def state_shape(module, form: str) -> tuple:
    dirs = 2 if module.bidirectional else 1
    size = (module.num_layers * dirs, module.hidden_size)
    return size if form == "unbatched" else (size[0], 1, size[1])


@settings(max_examples=25, deadline=None)
@given(
    module=modules,
    form=st.sampled_from(["unbatched", "batch of one"]),
    lazy=st.booleans(),
    in_a_block=st.booleans(),
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_initial_states_lazy_or_shared_equal_eager(module, form, lazy, in_a_block, lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = state_shape(module, form)
    shared = torch.randn(shape, generator=gen)
    lstm = isinstance(module, nn.LSTM)

    def states(x):
        h = torch.tanh(x.sum() + shared) if lazy else shared  # per-instance or shared
        return (h, h * 0.5) if lstm else h

    def run(x):
        seq = x if form == "unbatched" else x.unsqueeze(0 if module.batch_first else 1)
        if in_a_block:  # a statement of several tensor calls: outlined, traced as a block
            out, state = module(seq * 1.0, states(x))
        else:
            hx = states(x)
            out, state = module(seq, hx)
        return out, state

    encode = acrobat.autobatch(lambda x: run(x))
    xs = [torch.randn(n, D, generator=gen) for n in lengths]
    with torch.no_grad():
        stats = check_map(encode, xs)
    if not in_a_block:
        assert stats.by_op["sequences"][1] == len(xs)


class Seq2Seq(nn.Module):
    """An encoder whose final state starts the decoder, as translation models do."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.LSTM(D, 5, batch_first=True)
        self.decoder = nn.LSTM(D, 5, batch_first=True)
        self.out = nn.Linear(5, 3)


@acrobat.autobatch
def translate(pair, model):
    source, target = pair
    _, state = model.encoder(source.unsqueeze(0))
    decoded, _ = model.decoder(target.unsqueeze(0), state)
    return model.out(decoded[0])


@acrobat.autobatch
def translate_op_by_op(pair, model):  # (translate's body: a block of its own)
    source, target = pair
    _, state = model.encoder(source.unsqueeze(0))
    decoded, _ = model.decoder(target.unsqueeze(0), state)
    return model.out(decoded[0])


def test_an_encoder_state_starting_a_decoder_trains_like_eager():
    torch.manual_seed(2)
    model = Seq2Seq()
    pairs = [(torch.randn(s, D), torch.randn(t, D)) for s, t in ((3, 2), (5, 4), (1, 1), (4, 6))]
    with torch.no_grad():
        check_map(translate, pairs, model=model)
        # (one padding family of two sizes apart, a pair's lengths: (4, 6) with the pairs
        # within it in both sizes, and (5, 4); the sequence modules packed inside)
        stats = check_map(translate, pairs, model=model)
    assert [b for k, (b, _) in stats.by_op.items() if k.startswith("block:")] == [2]
    check_grads(translate, pairs, model, atol=1e-5, rtol=1e-4, model=model)
    with torch.no_grad(), config.override(PAD_APART=False):
        check_map(translate_op_by_op, pairs, model=model)
        # (the run's first calls are a block each, until two of its traces differ in two
        # sizes apart: from then on it records op by op)
        stats = check_map(translate_op_by_op, pairs, model=model)
    assert stats.by_op["sequences"] == [2, 2 * len(pairs)]  # one call each: encoder, decoder
    with config.override(PAD_APART=False):
        check_grads(translate_op_by_op, pairs, model, atol=1e-5, rtol=1e-4, model=model)


def test_a_state_of_another_shape_goes_to_the_module_as_written():
    module = nn.GRU(D, 3)

    @acrobat.autobatch
    def encode(x):
        return module(x, torch.zeros(2, 3))[0]  # two layers' state for a one-layer GRU

    xs = [torch.randn(2, D), torch.randn(3, D)]
    with pytest.raises(RuntimeError, match="Expected hidden size") as eager:
        encode.eager(xs[0])
    with pytest.raises(RuntimeError, match="Expected hidden size") as batched:
        encode.map(xs)  # the module's own check, as in eager
    assert str(eager.value).splitlines()[0] == str(batched.value).splitlines()[0]


def test_a_failing_packed_call_names_the_instance_that_fails_alone(monkeypatch):
    from acrobat import ops

    real = ops.SEQUENCES.rule

    def rule(nodes, xs):
        if any(nd.instance == 1 for nd in nodes):
            raise ValueError("bad sequence")
        return real(nodes, xs)

    monkeypatch.setattr(ops.SEQUENCES, "rule", rule)
    with pytest.raises(acrobat.AcrobatError, match="sequences failed for instance 1: bad"):
        encoder(nn.GRU(D, 3), "unbatched").map([torch.randn(n, D) for n in (2, 3, 4)])
