"""nn.Linear and nn.Embedding record lazy inputs directly while a map runs (config
FAST_MODULES): same results as the generic route, hooks and subclasses respected, the
original forwards back in place after every map, failed ones included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from tests.helpers import check_grads, check_map


class Tagger(nn.Module):
    def __init__(self, vocab: int, dim: int, padding_idx=None, max_norm=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx, max_norm=max_norm)
        self.lin = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 3, bias=False)


@acrobat.autobatch
def tag(words, m: Tagger):
    h = torch.zeros(m.lin.out_features)
    for w in words:
        h = torch.tanh(m.lin(m.emb(torch.tensor(w))) + h)
    return m.out(h)


@settings(max_examples=15, deadline=None)
@given(
    sentences=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6), min_size=1, max_size=5),
    dim=st.integers(1, 6),
    padding=st.sampled_from([None, 0]),
    fast=st.booleans(),
)
def test_fast_and_generic_routes_equal_eager(sentences, dim, padding, fast):
    torch.manual_seed(dim)
    m = Tagger(10, dim, padding_idx=padding)
    with acrobat.config.override(FAST_MODULES=fast):
        with torch.no_grad():
            check_map(tag, sentences, m=m)
        got = tag.map(sentences, m=m)  # with grad: padding_idx takes the generic route
        loss = sum(g.sum() for g in got)
        loss.backward()
    grads = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    sum(tag.eager(s, m=m).sum() for s in sentences).backward()
    for k, p in m.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, atol=1e-5, rtol=1e-5, msg=k)


def test_max_norm_embedding_takes_the_generic_route():
    """max_norm renormalises the looked-up rows of the table in place, in eager and in
    the batched lookup alike: not the row-lookup fast path."""
    torch.manual_seed(3)
    m = Tagger(10, 4, max_norm=0.5)
    ref = Tagger(10, 4, max_norm=0.5)
    ref.load_state_dict(m.state_dict())
    sentences = [[1, 2, 5], [3], [5, 1]]
    # op by op (AUTO_REGIONS would make the loop body one block node, lookup inside)
    with torch.no_grad(), acrobat.config.override(AUTO_REGIONS=False):
        got, stats = tag.map(sentences, m=m, stats=True)
        want = [tag.eager(s, m=ref) for s in sentences]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(m.emb.weight, ref.emb.weight)
    assert stats.by_op["embedding"][1] == 6 and "take" not in stats.by_op


class Doubled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


@acrobat.autobatch
def doubled(x, m):
    return m(x)


def test_subclass_forward_and_hooks_are_respected():
    m = Doubled(3, 3)
    calls = []
    m.register_forward_hook(lambda mod, inp, out: calls.append(1))
    xs = [torch.randn(3) for _ in range(4)]
    with torch.no_grad():
        check_map(doubled, xs, m=m)
    assert len(calls) == 4 + 4  # every map call and every eager call ran the hook


class _Scale(nn.Module):
    def forward(self, w):
        return 2 * w


def test_parametrized_weights_are_read_through_the_attribute():
    """The fast forwards read an exact nn.Linear's / nn.Embedding's parameters from
    ``_parameters``; a parametrized module (a subclass whose ``weight`` is a property
    computing 2 * w) must get the parametrized weight, as eager does."""
    from torch.nn.utils import parametrize

    m = Tagger(10, 4)
    parametrize.register_parametrization(m.lin, "weight", _Scale())
    parametrize.register_parametrization(m.emb, "weight", _Scale())
    sentences = [[1, 2, 3], [4], [5, 6]]
    with torch.no_grad():
        got = tag.map(sentences, m=m)
        want = [tag.eager(s, m=m) for s in sentences]
        plain = Tagger(10, 4)
        plain.load_state_dict({k.replace(".parametrizations.weight.original", ".weight"): v
                               for k, v in m.state_dict().items()})  # fmt: skip
        unscaled = [tag.eager(s, m=plain) for s in sentences]
    for g, w, u in zip(got, want, unscaled):
        torch.testing.assert_close(g, w)
        assert not torch.allclose(w, u)  # (the parametrization changes the result)


def test_pre_hooks_and_global_hooks_see_every_call():
    """The fast ``__call__`` (ops._fast_call) skips torch's call machinery only when no hook
    of any kind is registered: a pre-hook on the module, or a global forward hook, makes
    every call take the original route; both are back to torch's when the map returns."""
    m = nn.Linear(3, 3)
    seen = []
    xs = [torch.randn(3) for _ in range(4)]
    handle = m.register_forward_pre_hook(lambda mod, inp: seen.append("pre"))
    with torch.no_grad():
        check_map(doubled, xs, m=m)
    handle.remove()
    assert seen.count("pre") == 4 + 4
    handle = nn.modules.module.register_module_forward_hook(
        lambda mod, inp, out: seen.append("global")
    )
    try:
        with torch.no_grad():
            check_map(doubled, xs, m=m)
    finally:
        handle.remove()
    assert seen.count("global") == 4 + 4
    assert "__call__" not in vars(nn.Linear) and "__call__" not in vars(nn.Embedding)


def test_original_forwards_return_after_a_failing_map():
    m = Tagger(10, 4)
    # instance 1 looks up a word out of range (an IndexError op by op; an AcrobatError
    # naming the instance and the lines when the loop body is one block, AUTO_REGIONS)
    with pytest.raises((IndexError, acrobat.AcrobatError), match="out of range"):
        tag.map([[1, 2], [99]], m=m)
    assert nn.Linear.forward.__module__ == "torch.nn.modules.linear"
    assert nn.Embedding.forward.__module__ == "torch.nn.modules.sparse"
    assert "__call__" not in vars(nn.Linear) and "__call__" not in vars(nn.Embedding)
    with torch.no_grad():
        check_map(tag, [[1, 2], [3]], m=m)


# --- nn.Sequential of pure layers: one block node per call (config.SEQUENTIAL_BLOCKS) ------

LAYERS = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "leaky": lambda: nn.LeakyReLU(0.1),
    "elu": nn.ELU,
    "softplus": nn.Softplus,
    "norm": lambda: nn.LayerNorm(5),
    "softmax": lambda: nn.Softmax(-1),
    "logsoftmax": lambda: nn.LogSoftmax(-1),
    "identity": nn.Identity,
    "dropout": lambda: nn.Dropout(0.3),
}


def mlp(names: list[str]) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(4, 5)]
    for name in names:
        layers.append(LAYERS[name]())
        layers.append(nn.Sequential(nn.Linear(5, 5)))  # nested
    return nn.Sequential(*layers).eval()


@acrobat.autobatch
def heads(xs, head):
    return torch.stack([head(torch.tanh(x)) for x in xs])


@settings(max_examples=20, deadline=None)
@given(
    names=st.lists(st.sampled_from(sorted(LAYERS)), max_size=4),
    lengths=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_pure_sequentials_are_one_node_per_call_and_equal_eager(names, lengths, seed):
    torch.manual_seed(seed)
    head = mlp(names)
    batch = [[torch.randn(4) for _ in range(n)] for n in lengths]
    with torch.no_grad():
        stats = check_map(heads, batch, head=head)
        with acrobat.config.override(SEQUENTIAL_BLOCKS=False):
            per_layer = check_map(heads, batch, head=head)
    assert stats.by_op["block:sequential"][1] == sum(lengths)
    assert "block:sequential" not in per_layer.by_op
    assert per_layer.nodes > stats.nodes if names else per_layer.nodes == stats.nodes


class Twice(nn.Module):
    def forward(self, x):
        return x * 2


@pytest.mark.parametrize(
    "layer",
    [lambda: nn.Dropout(0.5).train(), lambda: nn.ReLU(inplace=True), Twice],
    ids=["training dropout", "inplace", "a module of the user's"],
)
def test_sequentials_with_other_layers_run_layer_by_layer(layer):
    head = nn.Sequential(nn.Linear(4, 4), layer(), nn.Linear(4, 2))
    batch = [[torch.randn(4)], [torch.randn(4), torch.randn(4)]]
    with torch.no_grad():
        got, stats = heads.map(batch, head=head, stats=True)
    assert "block:sequential" not in stats.by_op
    if not isinstance(head[1], nn.Dropout):  # (a training dropout draws its own masks)
        want = [heads.eager(xs, head=head) for xs in batch]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_sequential_blocks_train_like_eager():
    torch.manual_seed(3)
    head = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 2))
    batch = [[torch.randn(4) for _ in range(n)] for n in (1, 3, 2)]
    stats = check_grads(heads, batch, head, head=head)
    assert stats.by_op["block:sequential"][1] == 6


def test_a_sequential_changed_between_maps_is_traced_anew():
    torch.manual_seed(4)
    head = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    batch = [[torch.randn(4)], [torch.randn(4), torch.randn(4)]]
    with torch.no_grad():
        check_map(heads, batch, head=head)
        head.append(nn.Linear(4, 2))  # the same object, another program
        stats = check_map(heads, batch, head=head)
        head[0] = nn.Linear(4, 4)  # a layer replaced
        check_map(heads, batch, head=head)
    assert stats.by_op["block:sequential"][1] == 3
