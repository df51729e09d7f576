"""Per-instance index tensors where torch takes a Python number: ``select`` / ``narrow``
batch (same shape, different rows); a slice bound (a value-dependent shape) is refused
with a clear error, and the map after it works (the refusal used to leave torch's
function handling disabled for the thread)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import acrobat


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(2, 5),
    cols=st.integers(2, 5),
    picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=5),
    dim=st.sampled_from([0, 1, -1, -2]),
    how=st.sampled_from(["select", "select-method", "narrow", "narrow-keywords"]),
    seed=st.integers(0, 2**16),
)
def test_select_and_narrow_take_per_instance_indices(rows, cols, picks, dim, how, seed):
    g = torch.Generator().manual_seed(seed)
    size = (rows, cols)[dim]
    length = 1 + seed % max(size - 1, 1)  # 1 .. size - 1
    xs = [torch.randn(rows, cols, generator=g) for _ in picks]
    hi = size if how.startswith("select") else size - length + 1
    idx = [torch.tensor(p % hi) for p in picks]

    @acrobat.autobatch
    def f(x, i):
        if how == "select":
            return torch.select(x, dim, i)
        if how == "select-method":
            return x.select(dim, i) * 2
        if how == "narrow":
            return torch.narrow(x, dim, i, length)
        return torch.narrow(x, dim=dim, start=i, length=length)

    got = f.map(xs, idx)
    want = [f.eager(x, i) for x, i in zip(xs, idx)]
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


def test_a_per_instance_slice_bound_is_refused_and_the_next_map_works():
    @acrobat.autobatch
    def f(x, i):
        return x[i:]  # slice-bound-line

    xs, idx = [torch.arange(4.0), torch.arange(4.0)], [torch.tensor(1), torch.tensor(2)]
    with pytest.raises(acrobat.UnsupportedOpError, match=r"int\(t\)") as err:
        f.map(xs, idx)
    assert "slice-bound-line" in str(err.value)
    assert torch._C._is_torch_function_enabled()

    @acrobat.autobatch
    def g(x, i):
        return x[int(i):].sum()  # read first: fine

    got = g.map(xs, idx)
    assert [float(v) for v in got] == [float(x[int(i):].sum()) for x, i in zip(xs, idx)]


def test_a_float_index_is_refused():
    @acrobat.autobatch
    def f(x, i):
        return torch.select(x, 0, i)

    with pytest.raises(acrobat.UnsupportedOpError, match="0-d integer"):
        f.map([torch.randn(3, 2)], [torch.tensor(1.0)])


_NUMBER_USES = {
    # shape from the value: refused when recorded (they returned wrong shapes silently)
    "reshape": lambda x, i: x.reshape(i, -1),
    "unsqueeze": lambda x, i: x.unsqueeze(i),
    "repeat": lambda x, i: x.repeat(i, 1),
    "expand": lambda x, i: x[0:1].expand(i, 4),
    "chunk": lambda x, i: torch.chunk(x, i)[0],
    # same shape, another program per value: refused when the batch runs
    "transpose": lambda x, i: x.transpose(0, i - 1),
    "sum": lambda x, i: x.sum(i - 1),
    "softmax": lambda x, i: torch.softmax(x, i - 1),
    "cumsum": lambda x, i: torch.cumsum(x, dim=i - 1),
    "roll": lambda x, i: torch.roll(x, i, 0),
}


@pytest.mark.parametrize("name", sorted(_NUMBER_USES))
def test_a_per_instance_number_is_refused_never_wrong(name):
    xs = [torch.arange(12.0).reshape(3, 4), torch.arange(12.0, 24.0).reshape(3, 4)]
    idx = [torch.tensor(1), torch.tensor(2)]
    with pytest.raises(acrobat.UnsupportedOpError, match=r"int\(t\)"):
        acrobat.autobatch(_NUMBER_USES[name]).map(xs, idx)
    assert torch._C._is_torch_function_enabled()
    fine = acrobat.autobatch(lambda x, i: x * i + x[i])  # tensor uses of i: batched
    got = fine.map(xs, idx)
    for g, x, i in zip(got, xs, idx):
        torch.testing.assert_close(g, x * i + x[i])


@acrobat.autobatch
def greedy_scores(h, w, steps):
    """A greedy decoder's bookkeeping: each step picks the log-probability of its own
    argmax, a Python int that differs from instance to instance."""
    total = []
    for _ in range(steps):
        logp = torch.log_softmax(h @ w, -1)
        tok = int(logp.argmax())
        total.append(logp[tok])
        h = torch.tanh(h + w[:, tok])
    return torch.stack(total).sum()


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4), st.integers(0, 1000))
def test_picks_with_per_instance_ints_batch_across_the_ints(n, steps, seed):
    """``logp[tok]`` with a different ``tok`` per instance: one batch per step
    (config.INT_PICKS), where the int in the signature made one per distinct value."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(5, 7, generator=gen, requires_grad=True)
    hs = [torch.randn(5, generator=gen) for _ in range(n)]
    got, stats = greedy_scores.map(hs, w=w, steps=steps, stats=True)
    want = [greedy_scores.eager(h, w, steps) for h in hs]
    torch.testing.assert_close(torch.stack(got), torch.stack(want))
    # one batch per step at most; the picks are read by nothing until the map's last
    # flush (the stack of them): left pending by each step's flush, they run there
    # together (config.DEFER_UNNEEDED)
    assert stats.by_op["pick"] == [1, n * steps]
    with torch.no_grad(), acrobat.config.override(DEFER_UNNEEDED=False):
        _, apart = greedy_scores.map(hs, w=w, steps=steps, stats=True)
    assert apart.by_op["pick"] == [steps, n * steps]
    (g_map,) = torch.autograd.grad(torch.stack(got).sum(), w)
    (g_eager,) = torch.autograd.grad(torch.stack(want).sum(), w)
    torch.testing.assert_close(g_map, g_eager)
    with torch.no_grad(), acrobat.config.override(INT_PICKS=False, DEFER_UNNEEDED=False):
        _, off = greedy_scores.map(hs, w=w, steps=steps, stats=True)
    assert "pick" not in off.by_op and off.by_op["getitem"][0] >= steps


@acrobat.autobatch
def pick_at(x, i):
    return (x * 2)[i]


def test_a_pick_out_of_range_names_the_instance():
    xs = [torch.randn(3) for _ in range(4)]
    assert [float(v) for v in pick_at.map(xs, [0, -1, 2, -3])] == [
        float(x[i] * 2) for x, i in zip(xs, [0, -1, 2, -3])
    ]
    with pytest.raises(IndexError, match=r"index 3 is out of bounds .* size 3 \(instance 2"):
        pick_at.map(xs, [0, 1, 3, 0])


@acrobat.autobatch
def viterbi_path(feats, trans):
    """A Viterbi decoder: the forward pass, then a backtrace of Python int reads of the
    back pointers, each a pick of a tensor computed already."""
    score = feats[0]
    back = []
    for t in range(1, feats.shape[0]):
        score, idx = (score.unsqueeze(1) + trans + feats[t].unsqueeze(0)).max(0)
        back.append(idx)
    best = int(score.argmax())
    path = [best]
    for idx in reversed(back):
        best = int(idx[best])
        path.append(best)
    return score.max(), path[::-1]


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    tags=st.integers(2, 6),
    seed=st.integers(0, 2**16),
)
def test_a_viterbi_backtrace_reads_its_back_pointers_as_eager(lengths, tags, seed):
    """``int(idx[best])`` of back pointers computed by earlier flushes, one read per step:
    the paths equal eager's. (Reading a pick computed at once, without its flush, was
    tried: correct once the py_rows cache could not serve a reused id (as
    executor.constant now guards), but no faster on this CPU, and one device sync per read
    on a GPU.)"""
    gen = torch.Generator().manual_seed(seed)
    feats = [torch.randn(n, tags, generator=gen) for n in lengths]
    trans = torch.randn(tags, tags, generator=gen)
    with torch.no_grad():
        got = viterbi_path.map(feats, trans=trans)
    want = [viterbi_path.eager(f, trans) for f in feats]
    for g, w in zip(got, want):
        assert g[1] == w[1]
        torch.testing.assert_close(g[0], w[0])
