"""Property tests: random op chains drawn from the op table, random trees through a
recursive cell (with and without ``@acrobat.block``), random sentence lengths through an
Elman RNN. Every one is checked against the eager loop with ``check_map``.

A chain is a small program over per-instance values with symbolic shapes: sizes are
ints (the same for every instance: hidden sizes, shared weights) or free symbols ``a``,
``b`` that take one value per instance when the instances are ``ragged``. Every op is
chosen so that it is valid whatever the free symbols are, so one program runs on every
instance; ragged instances give the same ops different signatures, which must stay correct.
"""

from __future__ import annotations

import operator
import random
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, note, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat.ops import TABLE
from tests.helpers import check_map, check_schedule

# ---- the chain interpreter -------------------------------------------------------------

# Continuous, bounded-growth ops only: a batched reduction may differ from the eager one in
# the last bit, which a discontinuous op (floor, sign, argmax) would turn into a big error.
UNARY = {
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": F.relu,
    "neg": operator.neg,
    "abs": torch.abs,
    "sin": torch.sin,
    "cos": lambda v: v.cos(),
    "erf": torch.erf,
    "gelu": F.gelu,
    "silu": F.silu,
    "elu": F.elu,
    "softplus": F.softplus,
    "clamp": lambda v: v.clamp(-1.0, 1.0),
    "exp": lambda v: torch.exp(v.clamp(max=2.0)),
    "log": lambda v: torch.log(v.abs() + 1.0),
    "sqrt": lambda v: (v * v + 0.5).sqrt(),
}
BINARY = {
    "add": operator.add,
    "sub": torch.sub,
    "mul": operator.mul,
    "maximum": torch.maximum,
    "minimum": lambda a, b: a.minimum(b),
    "div": lambda a, b: a / (b.abs() + 1.0),
    "where": lambda a, b: torch.where(a > b, a, b),
    "lerp": lambda a, b: torch.lerp(a, b, 0.25),
}
REDUCE = {
    "sum": lambda v, d, k: v.sum(d, keepdim=k),
    "mean": lambda v, d, k: torch.mean(v, d, k),
    "amax": lambda v, d, k: v.amax(d, keepdim=k),
    "logsumexp": lambda v, d, k: torch.logsumexp(v, d, keepdim=k),
    "softmax": lambda v, d, k: F.softmax(v, dim=d),
    "log_softmax": lambda v, d, k: v.log_softmax(d),
}


def test_chain_ops_are_table_rows():
    """The chains draw from the op table: every op they name is a row of it."""
    names = set(UNARY) | set(BINARY) | set(REDUCE)
    names |= {
        "linear",
        "matmul",
        "cat",
        "stack",
        "chunk",
        "reshape",
        "flatten",
        "transpose",
        "unsqueeze",
        "squeeze",
        "getitem",
    }
    assert names <= set(TABLE), names - set(TABLE)


Dim = int | str  # an int is the same for every instance; a str is an expression of symbols


def _add_dims(x: Dim, y: Dim) -> Dim:
    return x + y if isinstance(x, int) and isinstance(y, int) else f"({x}+{y})"


def _mul_dims(x: Dim, y: Dim) -> Dim:
    return x * y if isinstance(x, int) and isinstance(y, int) else f"({x}*{y})"


def _ceil_div(x: Dim, k: int) -> Dim:
    return -(-x // k) if isinstance(x, int) else f"(-(-{x}//{k}))"


def _size(d: Dim, sizes: dict) -> int:
    return d if isinstance(d, int) else eval(d, {}, dict(sizes))


def _broadcasts(s: tuple, t: tuple) -> bool:
    return all(x == y or x == 1 or y == 1 for x, y in zip(reversed(s), reversed(t)))


@dataclass
class Chain:
    """A program: per-instance inputs, shared parameters, and steps over a value list."""

    inputs: list[tuple]  # symbolic shapes of the per-instance inputs
    params: dict = field(default_factory=dict)  # name -> real tensor (reused operands)
    steps: list = field(default_factory=list)  # (text, fn(vals, params) -> tensor)
    shapes: list = field(default_factory=list)  # symbolic shape of every value

    def run(self, inputs, **params):
        vals = list(inputs)
        for _, fn in self.steps:
            vals.append(fn(vals, params))
        return vals

    def listing(self) -> str:
        lines = [f"v{i}: input {s}" for i, s in enumerate(self.inputs)]
        lines += [f"v{len(self.inputs) + k}: {text}" for k, (text, _) in enumerate(self.steps)]
        return "\n".join(lines)


class ChainBuilder:
    MAX_NDIM = 3

    def __init__(self, draw, gen: torch.Generator):
        self.draw = draw
        self.gen = gen
        self.hidden = draw(st.integers(2, 5), label="hidden")
        n_inputs = draw(st.integers(1, 2))
        shapes = [self.random_shape() for _ in range(n_inputs)]
        self.chain = Chain(inputs=shapes, shapes=list(shapes))

    def random_shape(self) -> tuple:
        ndim = self.draw(st.integers(0, 3))
        return tuple(self.draw(st.sampled_from(["a", "b", self.hidden, 1, 3])) for _ in range(ndim))

    def param(self, shape) -> str:
        name = f"p{len(self.chain.params)}"
        scale = shape[-1] ** -0.5 if shape else 1.0
        self.chain.params[name] = torch.randn(shape, generator=self.gen) * scale
        return name

    def emit(self, text, shape, fn):
        self.chain.steps.append((text, fn))
        self.chain.shapes.append(tuple(shape))

    def pick(self, ok=lambda s: True):
        """Index of a random value whose shape satisfies ``ok`` (None if there is none)."""
        ids = [i for i, s in enumerate(self.chain.shapes) if ok(s)]
        return self.draw(st.sampled_from(ids)) if ids else None

    def dim(self, s) -> int:
        d = self.draw(st.integers(0, len(s) - 1))
        return d - len(s) if self.draw(st.booleans()) else d  # negative dims too

    # ---- steps; each returns False when it does not apply to the drawn operand ----------

    def unary(self):
        i = self.pick()
        name = self.draw(st.sampled_from(sorted(UNARY)))
        f = UNARY[name]
        self.emit(f"{name}(v{i})", self.chain.shapes[i], lambda v, p: f(v[i]))

    def binary(self):
        i = self.pick()
        s = self.chain.shapes[i]
        name = self.draw(st.sampled_from(sorted(BINARY)))
        f = BINARY[name]
        kind = self.draw(st.sampled_from(["lazy", "shared", "scalar"]))
        if kind == "lazy":
            j = self.pick(lambda t: _broadcasts(s, t))
            out = _broadcast_shape(s, self.chain.shapes[j])
            left = self.draw(st.booleans())
            if len(out) > self.MAX_NDIM:
                return False
            a, b = (i, j) if left else (j, i)
            self.emit(f"{name}(v{a}, v{b})", out, lambda v, p: f(v[a], v[b]))
        elif kind == "shared":
            k = self.draw(st.integers(0, len(s)))
            shape = tuple(
                d if isinstance(d, int) and self.draw(st.booleans()) else 1 for d in s[len(s) - k :]
            )
            w = self.param(shape or ())
            if self.draw(st.booleans()):
                self.emit(f"{name}(v{i}, {w}{shape})", s, lambda v, p: f(v[i], p[w]))
            else:
                self.emit(f"{name}({w}{shape}, v{i})", s, lambda v, p: f(p[w], v[i]))
        else:
            c = self.draw(st.sampled_from([0.5, -2.0, 3.0]))
            if name in ("add", "sub", "mul"):  # a Python number
                self.emit(f"{name}(v{i}, {c})", s, lambda v, p: f(v[i], c))
            else:  # a per-instance constant (op "tensor")
                self.emit(f"{name}(v{i}, tensor({c}))", s, lambda v, p: f(v[i], torch.tensor(c)))

    def linear(self):
        i = self.pick(lambda s: len(s) >= 1 and isinstance(s[-1], int))
        if i is None:
            return False
        s = self.chain.shapes[i]
        out = self.draw(st.sampled_from([self.hidden, 1, 4]))
        w, b = self.param((out, s[-1])), self.param((out,))
        form = self.draw(st.sampled_from(["F.linear", "matmul", "matmul no bias", "W @ v"]))
        if form == "F.linear":
            self.emit(
                f"linear(v{i}, {w}, {b})", s[:-1] + (out,), lambda v, p: F.linear(v[i], p[w], p[b])
            )
        elif form == "matmul":
            self.emit(f"v{i} @ {w}.t() + {b}", s[:-1] + (out,), lambda v, p: v[i] @ p[w].t() + p[b])
        elif form == "matmul no bias":  # (not W.T: see test_ops.test_x_at_W_T_batches)
            self.emit(
                f"matmul(v{i}, {w}.mT)",
                s[:-1] + (out,),
                lambda v, p: torch.matmul(v[i], p[w].transpose(0, 1)),
            )
        elif len(s) == 1:
            self.emit(f"{w} @ v{i}", (out,), lambda v, p: p[w] @ v[i])
        else:
            return False
        return True

    def matmul(self):
        i = self.pick(lambda s: len(s) >= 1)
        if i is None:
            return False
        s = self.chain.shapes[i]
        j = self.pick(lambda t: t == s)  # v[i] itself at least
        if len(s) == 1:
            self.emit(f"v{i} @ v{j}", (), lambda v, p: v[i] @ v[j])
        elif self.draw(st.booleans()):
            self.emit(f"v{i} @ v{j}.mT", s[:-1] + (s[-2],), lambda v, p: v[i] @ v[j].mT)
        else:
            self.emit(
                f"v{i}.mT @ v{j}",
                s[:-2] + (s[-1], s[-1]),
                lambda v, p: torch.matmul(v[i].transpose(-2, -1), v[j]),
            )
        return True

    def cat(self):
        i = self.pick(lambda s: len(s) >= 1)
        if i is None:
            return False
        s = self.chain.shapes[i]
        d = self.dim(s)
        same = [
            k
            for k, t in enumerate(self.chain.shapes)
            if len(t) == len(s)
            and all(x == y for n, (x, y) in enumerate(zip(s, t)) if n != d % len(s))
        ]
        j = self.draw(st.sampled_from(same))
        t = self.chain.shapes[j]
        if self.draw(st.booleans()) and all(isinstance(x, int) for x in s):
            w = self.param(s)  # a shared part
            out = tuple(_add_dims(x, x) if n == d % len(s) else x for n, x in enumerate(s))
            self.emit(f"cat([v{i}, {w}], {d})", out, lambda v, p: torch.cat([v[i], p[w]], d))
            return True
        out = tuple(_add_dims(x, y) if n == d % len(s) else x for n, (x, y) in enumerate(zip(s, t)))
        self.emit(f"cat([v{i}, v{j}], {d})", out, lambda v, p: torch.cat([v[i], v[j]], dim=d))
        return True

    def stack(self):
        i = self.pick(lambda s: len(s) < self.MAX_NDIM)
        if i is None:
            return False
        s = self.chain.shapes[i]
        j = self.pick(lambda t: t == s)
        d = self.draw(st.integers(-len(s) - 1, len(s)))
        out = list(s)
        out.insert(d % (len(s) + 1), 2)
        self.emit(f"stack([v{i}, v{j}], {d})", out, lambda v, p: torch.stack((v[i], v[j]), d))
        return True

    def chunk(self):
        i = self.pick(lambda s: len(s) >= 1)
        if i is None:
            return False
        s = self.chain.shapes[i]
        d, k = self.dim(s), self.draw(st.integers(1, 3))
        out = tuple(_ceil_div(x, k) if n == d % len(s) else x for n, x in enumerate(s))
        self.emit(f"chunk(v{i}, {k}, {d})[0]", out, lambda v, p: v[i].chunk(k, d)[0])
        return True

    def reshape(self):
        i = self.pick()
        s = self.chain.shapes[i]
        form = self.draw(
            st.sampled_from(["flat", "flatten", "transpose", "unsqueeze", "squeeze", "index"])
        )
        if form == "flat":
            size = 1
            for x in s:
                size = _mul_dims(size, x)
            self.emit(f"v{i}.reshape(-1)", (size,), lambda v, p: v[i].reshape(-1))
        elif form == "flatten" and len(s) >= 2:
            self.emit(
                f"v{i}.flatten(-2)",
                s[:-2] + (_mul_dims(s[-2], s[-1]),),
                lambda v, p: torch.flatten(v[i], -2),
            )
        elif form == "transpose" and len(s) >= 2:
            d0, d1 = self.dim(s), self.dim(s)
            out = list(s)
            out[d0], out[d1] = out[d1], out[d0]
            self.emit(f"v{i}.transpose({d0}, {d1})", out, lambda v, p: v[i].transpose(d0, d1))
        elif form == "unsqueeze" and len(s) < self.MAX_NDIM:
            d = self.draw(st.integers(0, len(s)))
            self.emit(f"v{i}.unsqueeze({d})", s[:d] + (1,) + s[d:], lambda v, p: v[i].unsqueeze(d))
        elif form == "squeeze" and 1 in s:
            d = s.index(1)
            self.emit(f"v{i}.squeeze({d})", s[:d] + s[d + 1 :], lambda v, p: v[i].squeeze(d))
        elif form == "index" and len(s) >= 1:
            if self.draw(st.booleans()):
                self.emit(f"v{i}[0]", s[1:], lambda v, p: v[i][0])
            else:
                self.emit(f"v{i}[..., :1]", s[:-1] + (1,), lambda v, p: v[i][..., :1])
        else:
            return False
        return True

    def reduce(self):
        i = self.pick(lambda s: len(s) >= 1)
        if i is None:
            return False
        s = self.chain.shapes[i]
        name = self.draw(st.sampled_from(sorted(REDUCE)))
        d, keep = self.dim(s), self.draw(st.booleans())
        f = REDUCE[name]
        if name in ("softmax", "log_softmax"):
            out = s
        else:
            out = tuple(
                1 if n == d % len(s) else x for n, x in enumerate(s) if keep or n != d % len(s)
            )
        self.emit(f"{name}(v{i}, {d}, keepdim={keep})", out, lambda v, p: f(v[i], d, keep))
        return True

    STEPS = ("unary", "binary", "linear", "matmul", "cat", "stack", "chunk", "reshape", "reduce")

    def build(self, n_steps) -> Chain:
        while len(self.chain.steps) < n_steps:
            getattr(self, self.draw(st.sampled_from(self.STEPS)))()
        return self.chain


def _broadcast_shape(s, t):
    n = max(len(s), len(t))
    s = (1,) * (n - len(s)) + tuple(s)
    t = (1,) * (n - len(t)) + tuple(t)
    return tuple(y if x == 1 else x for x, y in zip(s, t))


def _instances(chain: Chain, sizes: list[dict], gen) -> list[tuple]:
    return [
        tuple(torch.randn([_size(d, sz) for d in shape], generator=gen) for shape in chain.inputs)
        for sz in sizes
    ]


@settings(max_examples=300)
@given(st.data())
def test_random_op_chains(data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    chain = ChainBuilder(data.draw, gen).build(data.draw(st.integers(1, 8), label="steps"))
    n = data.draw(st.integers(1, 8), label="instances")
    ragged = data.draw(st.booleans(), label="ragged")

    def symbols():
        return {s: data.draw(st.integers(1, 4)) for s in ("a", "b")}

    first = symbols()
    sizes = [symbols() if ragged and k else first for k in range(n)]
    note(chain.listing())
    note(f"sizes per instance: {sizes}")
    xs = _instances(chain, sizes, gen)
    f = acrobat.autobatch(chain.run)
    stats = check_map(f, xs, **chain.params)
    if not ragged and n > 1:
        # equal shapes batch completely: n instances take as many batches as one
        _, one = f.map(xs[:1], stats=True, **chain.params)
        check_schedule(stats, batches=one.batches)


# ---- recursive cells over random trees ---------------------------------------------------


class TreeCell(nn.Module):
    """Child-sum tree cell: h = tanh(a) * sigmoid(g), [a, g] = W [x; sum(children)]."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.emb = nn.Embedding(vocab, hidden)
        self.leaf = nn.Linear(hidden, hidden)
        self.node = nn.Linear(2 * hidden, 2 * hidden)
        self.bin = nn.Linear(2 * hidden, 2 * hidden)


def cell_plain(m: TreeCell, children: list):
    """Any number of children: their states are summed, as in a child-sum TreeLSTM."""
    total = children[0] if len(children) == 1 else torch.stack(children).sum(0)
    a, g = m.node(torch.cat([total, torch.tanh(total)])).chunk(2)
    return torch.tanh(a) * torch.sigmoid(g)


cell_block = acrobat.block(cell_plain)


def binary_plain(m: TreeCell, left, right):
    a, g = torch.split(m.bin(torch.cat([left, right], dim=-1)), m.hidden, dim=-1)
    return torch.tanh(a) * torch.sigmoid(g)


binary_block = acrobat.block(binary_plain)


def leaf(m: TreeCell, word: int):
    return torch.tanh(m.leaf(m.emb(torch.tensor(word))))


@acrobat.autobatch
def encode_binary(tree, m, block):
    if isinstance(tree, int):
        return leaf(m, tree)
    cell = binary_block if block else binary_plain
    return cell(m, encode_binary(tree[0], m, block), encode_binary(tree[1], m, block))


@acrobat.autobatch
def encode_nary(tree, m, block):
    if isinstance(tree, int):
        return leaf(m, tree)
    cell = cell_block if block else cell_plain
    return cell(m, [encode_nary(child, m, block) for child in tree])


def binary_trees(max_leaves=12):
    return st.recursive(st.integers(0, 9), lambda t: st.tuples(t, t), max_leaves=max_leaves)


def nary_trees(max_leaves=12):
    return st.recursive(
        st.integers(0, 9),
        lambda t: st.lists(t, min_size=1, max_size=3).map(tuple),
        max_leaves=max_leaves,
    )


def height(tree) -> int:
    return 0 if isinstance(tree, int) else 1 + max(height(c) for c in tree)


@pytest.mark.parametrize("block", [False, True], ids=["plain", "block"])
@settings(max_examples=50)
@given(trees=st.lists(binary_trees(), min_size=1, max_size=8), hidden=st.integers(2, 16))
def test_random_binary_trees(block, trees, hidden):
    torch.manual_seed(hidden)
    m = TreeCell(10, hidden)
    with torch.no_grad():
        stats = check_map(encode_binary, trees, m=m, block=block)
    # leaves: word constants and the leaf block (at most 4 batches whatever the trees); then
    # per tree level: one block batch, or the cell's ops (cat, linear, split, tanh,
    # sigmoid, mul)
    per_level = 1 if block else 6
    check_schedule(stats, max_batches=4 + per_level * max(height(t) for t in trees))


@pytest.mark.parametrize("block", [False, True], ids=["plain", "block"])
@settings(max_examples=50)
@given(trees=st.lists(nary_trees(), min_size=1, max_size=8), hidden=st.integers(2, 16))
def test_random_nary_trees(block, trees, hidden):
    torch.manual_seed(hidden)
    m = TreeCell(10, hidden)
    with torch.no_grad():
        stats = check_map(encode_nary, trees, m=m, block=block)
    assert stats.by_op.get("embedding", [0])[0] <= 1
    # leaf(m, word) reads word only as torch.tensor(word): one block node per leaf over
    # the word ids (a value parameter), all leaves one batch
    assert stats.by_op["block:leaf"][0] == 1
    if block:
        # one block signature per number of children (1..3) per tree level
        blocks = sum(
            v[0] for k, v in stats.by_op.items() if k.startswith("block:") and k != "block:leaf"
        )
        assert blocks <= 3 * max(height(t) for t in trees)


def test_block_and_plain_trees_agree():
    rng = random.Random(0)

    def tree(h):
        if h == 0 or rng.random() < 0.3:
            return rng.randrange(10)
        return tuple(tree(h - 1) for _ in range(rng.randint(1, 3)))

    trees = [tree(4) for _ in range(12)]
    m = TreeCell(10, 6)
    with torch.no_grad():
        plain = encode_nary.map(trees, m=m, block=False)
        blocked = encode_nary.map(trees, m=m, block=True)
    for p, b in zip(plain, blocked):
        torch.testing.assert_close(p, b, atol=1e-6, rtol=1e-6)


# ---- an Elman RNN over random sentence lengths --------------------------------------------


class Elman(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.emb = nn.Embedding(vocab, hidden)
        self.wx = nn.Linear(hidden, hidden)
        self.wh = nn.Linear(hidden, hidden, bias=False)
        self.out = nn.Linear(hidden, 3)


@acrobat.autobatch
def elman(words, m):
    h = torch.zeros(m.hidden)
    states = []
    for w in words:
        h = torch.tanh(m.wx(m.emb(torch.tensor(w))) + m.wh(h))
        states.append(h)
    with acrobat.phase("classify"):
        logits = [F.log_softmax(m.out(s), -1) for s in states]
    return h, logits


@settings(max_examples=50)
@given(
    sentences=st.lists(st.lists(st.integers(0, 19), max_size=10), min_size=1, max_size=8),
    hidden=st.integers(2, 16),
)
def test_elman_rnn_random_lengths(sentences, hidden):
    torch.manual_seed(hidden)
    m = Elman(20, hidden)
    with torch.no_grad():
        check_map(elman, sentences, m=m)  # the loop and the comprehension: scans
        with acrobat.config.override(AUTO_SCANS=False):  # the schedule op by op
            stats = check_map(elman, sentences, m=m)
    longest = max(len(s) for s in sentences)
    if longest:
        # words, embedding and input projection of every token (one batch each), then per
        # step: recurrent linear, add, tanh; then ONE batch per op of the output phase
        check_schedule(stats, max_batches=3 + 3 * longest + 2)
        assert stats.by_op["log_softmax"][0] == 1
