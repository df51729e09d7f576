"""Fused elementwise block tails (acrobat/fusion.py + acrobat_kernels): every backend and
variant computes what the eager loop computes."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import choice, fusion
from tests.helpers import check_map

H = 6
emb = nn.Embedding(10, H)
lin = nn.Linear(2 * H, 5 * H)
bias = torch.randn(H)


@acrobat.block
def cell(hl, cl, hr, cr):
    i, fl, fr, o, u = lin(torch.cat([hl, hr])).chunk(5)
    c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
    h = torch.sigmoid(o) * torch.tanh(c + bias) * 0.5
    return h, c


@acrobat.block
def leaf(x):
    return torch.tanh(x), torch.relu(x) - 1.0


def state(t):
    if isinstance(t, int):
        return leaf(emb(torch.tensor(t)))
    return cell(*state(t[0]), *state(t[1]))


@acrobat.autobatch
def encode(t):
    h, c = state(t)
    return h + c


def random_tree(rng, depth):
    if depth == 0 or rng.random() < 0.35:
        return rng.randrange(10)
    return (random_tree(rng, depth - 1), random_tree(rng, depth - 1))


def test_plan_fuses_the_cell_tail_and_reads_cell_states_in_place():
    with torch.no_grad():
        encode.map([((1, 2), 3)])
    (trace,) = cell.cache.values()
    plan = trace.fusion
    assert plan is not None
    names = [nd.op.name for nd in plan.members]
    assert names.count("sigmoid") == 4 and "tanh" in names and "mul" in names
    assert [nd.op.name for nd in plan.before] == ["cat", "linear", "chunk"]
    # c_left and c_right (arguments 1 and 3) are read only by the fused region
    assert plan.source_args == {1, 3}


@pytest.mark.parametrize("backend", ["torch", "numba"])
@settings(max_examples=10)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 12))
def test_fused_backends_match_eager(backend, seed, n):
    rng = random.Random(seed)
    trees = [random_tree(rng, 4) for _ in range(n)]
    with torch.no_grad(), acrobat.config.override(KERNEL_BACKEND=backend):
        check_map(encode, trees)


def test_online_choice_between_fused_and_unfused_is_correct_throughout():
    rng = random.Random(1)
    trees = [random_tree(rng, 3) for _ in range(16)]
    with torch.no_grad(), acrobat.config.override(KERNEL_BACKEND="auto"):
        encode.map(trees)  # traces the blocks
        for trace in list(cell.cache.values()) + list(leaf.cache.values()):
            if trace.fusion is not None:
                fusion._compile(trace.fusion.program)  # as the background thread does
        for _ in range(3 * (choice.TRIALS + 2)):
            check_map(encode, trees)
    assert any(k[0] == "fusion" for k in choice.CHOOSER.decided)


def test_grad_mode_runs_unfused_and_gradients_flow():
    trees = [((1, 2), 3), (4, 5)]
    with acrobat.config.override(KERNEL_BACKEND="numba"):
        out = encode.map(trees)
        torch.stack(out).sum().backward()
    got = lin.weight.grad.clone()
    lin.weight.grad = None
    torch.stack([encode.eager(t) for t in trees]).sum().backward()
    torch.testing.assert_close(got, lin.weight.grad, atol=1e-5, rtol=1e-4)
    lin.weight.grad = None
