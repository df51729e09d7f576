"""Plain per-instance code as people write it for sequences, pairs and graphs of many
sizes: acrobat against the eager loop, and against itself with padding off.

The seven benchmark models (bench/run.py) are trees, stacks and loops; these are the
other shapes of work users bring: a language model's loss over its tokens, a causal
transformer trained with dropout, a text CNN, a tagger, self-attention, message passing
over graphs (a dense adjacency; an edge list, whose node and edge counts vary apart), an
encoder-decoder over sentence pairs, a BiLSTM-CRF, a greedy attention decoder that
reads its tokens, generation attending over its own growing history, an RNN writing
its states into a buffer (``states[t] = h``), the same cell over positions (``x[t]``)
with its states appended and stacked, the PyTorch seq2seq tutorial's training step
(teacher forcing, ``loss += ...`` from ``loss = 0``), the char-RNN classification
tutorial's forward (its output read after the loop), a state decayed and weights masked
by in-place methods (``h.mul_``, ``w.masked_fill_``), a pointer network masking what it
chose, a stack of residual layers looped over as ModuleLists (``for layer, norm in
zip(m.stack, m.norms)``), a layer written for several configurations (``if
m.pre_norm:``, ``if m.proj is not None:``).
Each is written once
for one instance (no batching in it), run over ``--batch`` instances of 3-20 tokens (or
nodes) in rounds that alternate the systems (the order shuffled each round), and
checked against the eager loop's outputs. Times are medians of ``--rounds`` rounds, in
milliseconds; "step" rows time forward and backward of the summed outputs. The last
columns run the pattern with ``config.MAP_CHOICE`` on (the benches turn it off, see
bench/__init__.py) and say what it kept: the batched map or the eager loop.

    python -m bench.patterns                    # every pattern, batch 64
    python -m bench.patterns --only lm_gru,text_cnn --rounds 21 --out /tmp/patterns.md
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import acrobat

VOCAB, HIDDEN, TAGS = 200, 32, 6


class Model(nn.Module):
    """Every layer the patterns use, one instance shared by all."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(64, HIDDEN)
        self.gru = nn.GRU(HIDDEN, HIDDEN)
        self.lstm = nn.LSTM(HIDDEN, HIDDEN // 2, bidirectional=True)
        self.out = nn.Linear(HIDDEN, VOCAB)
        self.layer = nn.TransformerEncoderLayer(HIDDEN, 2, 64, dropout=0.1, batch_first=True)
        self.conv = nn.Conv1d(HIDDEN, 64, 3, padding=1)
        self.cls = nn.Linear(64, 5)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.head = nn.Linear(HIDDEN, 5)
        self.tags = nn.Linear(HIDDEN, TAGS)
        self.trans = nn.Parameter(torch.randn(TAGS, TAGS) * 0.1)
        self.own = nn.Linear(HIDDEN, HIDDEN)
        self.msg = nn.Linear(HIDDEN, HIDDEN)
        self.decoder = nn.GRU(HIDDEN, HIDDEN)
        self.edge = nn.Linear(2 * HIDDEN, HIDDEN)
        self.att_enc = nn.Linear(HIDDEN, HIDDEN)
        self.att_dec = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.att_v = nn.Linear(HIDDEN, 1, bias=False)
        self.dcell = nn.GRUCell(2 * HIDDEN, HIDDEN)
        self.cell = nn.GRUCell(HIDDEN, HIDDEN)
        self.enc_cell = nn.GRUCell(HIDDEN, HIDDEN)  # (last: the layers above keep their init)
        self.char_rnn = TutorialRNN(VOCAB, HIDDEN, 5)
        self.stack = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.norms = nn.ModuleList(nn.LayerNorm(HIDDEN) for _ in range(4))
        self.pre_norm, self.residual, self.proj = True, True, None  # (configured_layer)


class TutorialRNN(nn.Module):
    """The hand-written RNN module of PyTorch's char-RNN classification tutorial."""

    def __init__(self, input_size: int, hidden_size: int, output_size: int):
        super().__init__()
        self.i2h = nn.Linear(input_size + hidden_size, hidden_size)
        self.i2o = nn.Linear(input_size + hidden_size, output_size)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, input, hidden):
        combined = torch.cat((input, hidden), 1)
        hidden = self.i2h(combined)
        output = self.i2o(combined)
        output = self.softmax(output)
        return output, hidden


def lm_gru(tokens, m):
    h, _ = m.gru(m.emb(tokens[:-1]))
    return F.cross_entropy(m.out(h), tokens[1:])


def causal_lm(tokens, m):
    n = tokens.shape[0] - 1
    x = m.emb(tokens[:-1]) + m.pos(torch.arange(n))
    causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    h = m.layer(x[None], src_mask=causal)[0]
    return F.cross_entropy(m.out(h), tokens[1:])


def text_cnn(tokens, m):
    h = torch.relu(m.conv(m.emb(tokens).T))
    return m.cls(h.max(-1).values)


def tagger(tokens, m):
    h, _ = m.lstm(m.emb(tokens))
    return F.cross_entropy(m.tags(h), tokens % TAGS)


def self_attention(tokens, m):
    h = m.emb(tokens)
    q, k, v = m.qkv(h).chunk(3, -1)
    a = torch.softmax(q @ k.T / HIDDEN**0.5, -1)
    return m.head(torch.tanh((a @ v).mean(0)))


def message_passing(graph, m):
    adj, ids = graph
    h = m.emb(ids)
    deg = adj.sum(1, keepdim=True) + 1
    for _ in range(3):
        h = torch.tanh(m.own(h) + m.msg(adj @ h) / deg)
    return m.head(h.mean(0))


def edge_gnn(graph, m):
    ids, edges = graph  # edges: (2, E) source and target node of each edge
    h = m.emb(ids)
    src, dst = edges[0], edges[1]
    for _ in range(2):
        msg = torch.relu(m.edge(torch.cat([h[src], h[dst]], -1)))
        h = torch.tanh(h + torch.zeros_like(h).index_add(0, dst, msg))
    return m.head(h.mean(0))


def encoder_decoder(pair, m):
    source, target = pair
    _, state = m.gru(m.emb(source)[:, None])
    decoded, _ = m.decoder(m.emb(target[:-1])[:, None], state)
    return F.cross_entropy(m.out(decoded[:, 0]), target[1:])


def greedy_decoder(tokens, m):
    # attention over the source's states, their projection written inside the loop (as
    # often done); each step reads its token and stops at an end token (about 1 in 10)
    states, h = m.gru(m.emb(tokens))
    h = h[0]
    token, steps = 1, []
    for _ in range(12):
        scores = m.att_v(torch.tanh(m.att_enc(states) + m.att_dec(h))).squeeze(-1)
        context = torch.softmax(scores, 0) @ states
        h = m.dcell(torch.cat([m.emb.weight[token], context]), h)
        steps.append(m.out(h))
        token = int(steps[-1].argmax())
        if token < VOCAB // 10:
            break
    return torch.stack(steps)


def autoregressive(tokens, m):
    # generation attending over everything made so far (a one-layer decoder without a
    # cache tensor): the history is a growing list, stacked each step; stops as above
    hist = list(m.emb(tokens))
    steps = []
    for _ in range(12):
        mem = torch.stack(hist)
        q, k, v = m.qkv(hist[-1]), m.qkv(mem), mem
        scores = k[:, HIDDEN : 2 * HIDDEN] @ q[:HIDDEN] / HIDDEN**0.5
        h = torch.relu(m.own(torch.softmax(scores, 0) @ v)) + hist[-1]
        steps.append(m.out(h))
        token = int(steps[-1].argmax())
        if token < VOCAB // 10:
            break
        hist.append(m.emb.weight[token] + h)
    return torch.stack(steps)


def buffer_rnn(tokens, m):
    # an RNN cell run by hand, each state written into a buffer made up front
    x = m.emb(tokens)
    states = torch.zeros(x.shape[0], HIDDEN)
    h = torch.zeros(HIDDEN)
    for t in range(x.shape[0]):
        h = m.cell(x[t], h)
        states[t] = h
    return F.cross_entropy(m.out(states[:-1]), tokens[1:])


def position_rnn(tokens, m):
    # an RNN cell run by hand over positions, its states appended and stacked under the
    # loss (the common way to write one): the loop reads x[t]
    x = m.emb(tokens)
    h = torch.zeros(HIDDEN)
    states = []
    for t in range(len(tokens)):
        h = m.cell(x[t], h)
        states.append(h)
    return F.cross_entropy(m.out(torch.stack(states)[:-1]), tokens[1:])


def seq2seq_tutorial(pair, m):
    # the PyTorch seq2seq tutorial's training step, per pair: the encoder run token by
    # token, the decoder with teacher forcing (its next input the target token), the loss
    # summed with ``+=`` from the number 0
    source, target = pair
    h = torch.zeros(HIDDEN)
    for i in range(source.shape[0]):
        h = m.enc_cell(m.emb(source[i]), h)
    loss = 0
    dec_in = torch.tensor(0)
    for di in range(target.shape[0]):
        h = m.cell(m.emb(dec_in), h)
        out = F.log_softmax(m.out(h), -1)
        loss += F.nll_loss(out[None], target[di][None])
        dec_in = target[di]
    return loss / target.shape[0]


def char_rnn_tutorial(tokens, m):
    # the char-RNN classification tutorial's forward: its RNN module over one-hot
    # letters (n, 1, letters), the output of the last step read after the loop
    line = F.one_hot(tokens, VOCAB).float()[:, None]
    hidden = torch.zeros(1, HIDDEN)
    for i in range(line.size()[0]):
        output, hidden = m.char_rnn(line[i], hidden)
    return output


def decayed_state(tokens, m):
    # a running state decayed and updated by in-place methods (h.mul_, h.add_) and
    # weights masked in place, on tensors the function makes
    h = torch.zeros(HIDDEN)
    for t in range(tokens.shape[0]):
        h.mul_(0.9)
        h.add_(torch.tanh(m.own(m.emb(tokens[t]))))
    w = torch.ones(tokens.shape[0])
    w.masked_fill_(tokens % 5 == 0, 0.0)
    return m.head(h + (m.emb(tokens) * w[:, None]).sum(0))


def pointer(tokens, m):
    # a pointer network's decoding: point at the best token not taken yet (a value read),
    # mask it out, feed it back; the order of all tokens
    e = m.emb(tokens)
    h = e.mean(0)
    mask = torch.zeros(tokens.shape[0])
    scores = []
    for _ in range(tokens.shape[0]):
        s = e @ m.own(h) + mask
        i = int(s.argmax())
        scores.append(s.max())
        mask[i] = float("-inf")
        h = m.cell(e[i], h)
    return torch.stack(scores)


def crf_nll(tokens, m):
    h, _ = m.lstm(m.emb(tokens))
    em = m.tags(h)
    tags = tokens % TAGS
    alpha = em[0]
    for t in range(1, tokens.shape[0]):
        alpha = torch.logsumexp(alpha[:, None] + m.trans, 0) + em[t]
    gold = em.gather(1, tags[:, None]).sum() + m.trans[tags[:-1], tags[1:]].sum()
    return torch.logsumexp(alpha, 0) - gold


def residual_stack(tokens, m):
    # a deep model's ``for layer in self.layers``: every token through each residual
    # layer of two ModuleLists, then mean-pooled
    h = m.emb(tokens)
    for layer, norm in zip(m.stack, m.norms):
        h = norm(h + torch.relu(layer(h)))
    return m.head(h.mean(0))


def configured_layer(tokens, m):
    # a layer written for several configurations: ifs on the model's flags between its
    # tensor ops (pre- or post-norm, a residual, an optional projection)
    h = m.emb(tokens)
    if m.pre_norm:
        h = m.norms[0](h)
    y = torch.relu(m.stack[0](h))
    if m.residual:
        y = y + h
    if not m.pre_norm:
        y = m.norms[0](y)
    if m.proj is not None:
        y = m.proj(y)
    return m.head(y.mean(0))


@dataclass
class Pattern:
    fn: Callable
    data: str  # "tokens", "graphs", "edges" or "pairs"
    train: bool  # time a training step (forward + backward), else inference


PATTERNS = {
    "lm_gru": Pattern(lm_gru, "tokens", True),
    "causal_lm": Pattern(causal_lm, "tokens", True),
    "text_cnn": Pattern(text_cnn, "tokens", False),
    "tagger": Pattern(tagger, "tokens", True),
    "self_attention": Pattern(self_attention, "tokens", False),
    "message_passing": Pattern(message_passing, "graphs", False),
    "edge_gnn": Pattern(edge_gnn, "edges", False),
    "encoder_decoder": Pattern(encoder_decoder, "pairs", False),
    "crf_nll": Pattern(crf_nll, "tokens", False),
    "greedy_decoder": Pattern(greedy_decoder, "tokens", False),
    "autoregressive": Pattern(autoregressive, "tokens", False),
    "buffer_rnn": Pattern(buffer_rnn, "tokens", True),
    "position_rnn": Pattern(position_rnn, "tokens", True),
    "seq2seq_tutorial": Pattern(seq2seq_tutorial, "pairs", True),
    "char_rnn_tutorial": Pattern(char_rnn_tutorial, "tokens", False),
    "decayed_state": Pattern(decayed_state, "tokens", False),
    "pointer": Pattern(pointer, "tokens", False),
    "residual_stack": Pattern(residual_stack, "tokens", True),
    "configured_layer": Pattern(configured_layer, "tokens", True),
}


def make_data(kind: str, batch: int, seed: int = 1) -> list:
    """``batch`` instances: token tensors of 3-20 tokens, (adjacency, ids) graphs of 3-20
    nodes, (ids, edge list) graphs of 3-20 nodes and 1 to 2n edges, or (source, target)
    pairs of independent lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(3, 21, (batch,), generator=g)]
    if kind == "tokens":
        return [torch.randint(VOCAB, (n,), generator=g) for n in lengths]
    if kind == "graphs":
        out = []
        for n in lengths:
            a = (torch.rand(n, n, generator=g) < 0.3).float()
            out.append(((a + a.T > 0).float(), torch.randint(VOCAB, (n,), generator=g)))
        return out
    if kind == "edges":  # (ids, edges): n nodes, 1 to 2n edges, two sizes apart
        return [
            (
                torch.randint(VOCAB, (n,), generator=g),
                torch.randint(n, (2, int(torch.randint(1, 2 * n, (), generator=g))), generator=g),
            )
            for n in lengths
        ]
    others = [int(n) for n in torch.randint(3, 21, (batch,), generator=g)]
    return [
        (torch.randint(VOCAB, (s,), generator=g), torch.randint(VOCAB, (t,), generator=g))
        for s, t in zip(lengths, others)
    ]


def _close(a, b) -> bool:
    return all(torch.allclose(x, y, atol=1e-4, rtol=1e-4) for x, y in zip(a, b))


def measure(name: str, batch: int, rounds: int) -> dict:
    """Median times (ms) of the eager loop, acrobat with padding off and on; acrobat's
    batches; whether its outputs matched the eager loop's (in eval mode: no dropout)."""
    p = PATTERNS[name]
    model = Model()
    data = make_data(p.data, batch)
    f = acrobat.autobatch(p.fn)
    with torch.no_grad():
        model.eval()
        want = [p.fn(x, model) for x in data]
        got = f.map(data, m=model)
    model.train(p.train)

    def eager():
        outs = [p.fn(x, model) for x in data]
        if p.train:
            torch.stack(outs).sum().backward()

    def mapped(pad: bool):
        def run():
            with acrobat.config.override(PAD_RAGGED=pad):
                outs = f.map(data, m=model)
            if p.train:
                torch.stack(outs).sum().backward()

        return run

    chosen = acrobat.autobatch(p.fn)  # (a function of its own: its choice's trials)

    def choosing():
        with acrobat.config.override(MAP_CHOICE=True):
            outs = chosen.map(data, m=model)
        if p.train:
            torch.stack(outs).sum().backward()

    # (acrobat first: the traces its warm-up makes join their padding families; with
    # padding off the same traces run, their batches not joined)
    systems = {"acrobat": mapped(True), "pad off": mapped(False), "eager": eager}
    systems["choice"] = choosing
    times: dict = {k: [] for k in systems}
    with torch.set_grad_enabled(p.train):
        for run in systems.values():  # warm-up: traces, kernels, caches (and the
            for _ in range(7):  # choice's trials: 3 of each variant)
                run()
        for _ in range(rounds):
            order = list(systems)
            random.shuffle(order)
            for k in order:
                t = time.perf_counter()
                systems[k]()
                times[k].append(time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
        with acrobat.config.override(PAD_RAGGED=True):
            _, stats = f.map(data, m=model, stats=True)
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out.update(batches=stats.batches, ok=_close(got, want))
    out["chose"] = next(iter(chosen._choices.values())).choice or "-"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PATTERNS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    lines = [
        f"batch {args.batch}, median of {args.rounds} rounds (ms), torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads",
        "",
        "| pattern | timed | eager | acrobat, pad off | acrobat | x eager | batches | = eager "
        "| MAP_CHOICE on | it chose |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |",
    ]
    print("\n".join(lines), flush=True)
    for name in args.only.split(","):
        r = measure(name, args.batch, args.rounds)
        line = (
            f"| {name} | {'step' if PATTERNS[name].train else 'map'} | {r['eager']:.2f} | "
            f"{r['pad off']:.2f} | {r['acrobat']:.2f} | {r['eager'] / r['acrobat']:.2f}x | "
            f"{r['batches']} | {'yes' if r['ok'] else 'NO'} | {r['choice']:.2f} | {r['chose']} |"
        )
        lines.append(line)
        print(line, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
