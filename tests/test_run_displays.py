"""Statements a run may take that it left out before (analysis.RUN_DISPLAYS,
analysis.RUN_OPERATORS): a container the run built itself (``hs = [m.a(x), m.b(x)];
h = torch.cat(hs)``), and a return of operators over what the run computed (``return
u @ v``). Before, each split the run: the container's reader and the return were
recorded op by op between two regions. Checked against the eager loop, values and
gradients, and with each flag off."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from tests.helpers import check_grads, check_map, outlined_with, random_rows

DIM = 6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.c = nn.Linear(2 * DIM, DIM)


def built_list(x, m):
    hs = [m.a(x), m.b(x)]
    h = torch.cat(hs)
    return torch.tanh(m.c(h)).sum(-1)


def built_dict_and_tuple(x, m):
    parts = {"a": torch.relu(m.a(x)), "b": torch.sigmoid(m.b(x))}
    pair = (parts["a"] * parts["b"], parts["a"] - parts["b"])
    return torch.stack(pair).sum(0)


def operator_return(x, m):
    h = torch.tanh(m.a(x))
    g = torch.sigmoid(m.b(x))
    u, v = h * g, h - g
    return u @ v


def operator_return_of_a_tree(x, m):
    """The return reads names of the run and a parameter: ``-(h * m.a.bias) + g``."""
    h = torch.tanh(m.a(x))
    g = m.b(h)
    return -(h * m.a.bias) + g


CASES = [
    (built_list, "RUN_DISPLAYS"),
    (built_dict_and_tuple, "RUN_DISPLAYS"),
    (operator_return, "RUN_OPERATORS"),
    (operator_return_of_a_tree, "RUN_OPERATORS"),
]


def _blocks(stats) -> dict:
    return {k: v for k, v in stats.by_op.items() if k.startswith("block:")}


@pytest.mark.parametrize("fn, flag", CASES, ids=[c[0].__name__ for c in CASES])
@settings(max_examples=8, deadline=None)
@given(count=st.integers(1, 7), seed=st.integers(0, 999))
def test_the_whole_body_is_one_region_and_equals_eager(fn, flag, count, seed):
    torch.manual_seed(seed)
    m = Net()
    xs = [torch.randn(DIM) for _ in range(count)]
    f = acrobat.autobatch(fn)
    with torch.no_grad():
        stats = check_map(f, xs, m=m)
    # one region, one node per instance, nothing recorded op by op
    assert list(_blocks(stats).values()) == [[1, len(xs)]], stats.by_op
    assert set(stats.by_op) == {"input", *_blocks(stats)}, stats.by_op
    check_grads(f, xs, m, atol=1e-5, m=m)
    with outlined_with(fn, **{flag: False}), torch.no_grad():
        off = check_map(acrobat.autobatch(fn), xs, m=m)
    assert len(off.by_op) > 2, off.by_op  # split: op by op between regions


def list_read_after_the_run(rows, m):
    """The list the run builds is also read after it (by a loop): the region returns it,
    and the statement inside the run that reads it stays a part of the run."""
    hs = [m.a(rows[0]), m.b(rows[0])]
    h = torch.cat(hs)
    total = torch.tanh(m.c(h))
    for k in range(len(rows) - 1):
        total = total + hs[k % 2] * rows[k + 1]
    return total


@settings(max_examples=10, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6), seed=st.integers(0, 999))
def test_a_list_the_run_built_and_returns_is_read_after_it(sizes, seed):
    torch.manual_seed(seed)
    m = Net()
    data = random_rows(sizes, seed, DIM)
    with torch.no_grad():
        check_map(acrobat.autobatch(list_read_after_the_run), data, m=m)


def int_return(x, m):
    """Operators over Python numbers the run made from shapes: not tensor work, but a
    return of them joins the run as an assignment would; the values equal eager's."""
    h = torch.tanh(m.a(x))
    n = h.shape[0]
    return n * 2 + 1, h.sum()


def test_a_return_of_numbers_the_run_made_equals_eager():
    torch.manual_seed(0)
    m = Net()
    xs = [torch.randn(DIM) for _ in range(5)]
    with torch.no_grad():
        got = acrobat.autobatch(int_return).map(xs, m=m)
    assert [g[0] for g in got] == [2 * DIM + 1] * 5
    for g, x in zip(got, xs):
        torch.testing.assert_close(g[1], int_return(x, m)[1])
