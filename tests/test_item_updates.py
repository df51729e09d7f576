"""Augmented writes into part of a tensor the function did not make itself:
``y[y < 0] *= 0.5`` on a layer's output, ``h[i] += h[i - 1]``, ``y[1:] *= 2``; and into
a tensor it owns at an index no plain expression (``y[x > 0] += v``, ``c[x.argmax()] +=
1``: ``ops.item_updated``).

Python runs ``x[i] op= v`` as ``t = x[i]; t op= v; x[i] = t``; on a lazy ``x`` the
in-place op on the view ``t`` could not be recorded, and these raised. Analysis
(``ITEM_UPDATES``) rewrites them to ``ops.update_item``, which writes the item back out of
place, or makes a boolean mask's update one ``where`` (no value read). The map equals the
eager loop, values and gradients; anything but a lazy target is updated as written."""

from __future__ import annotations

import ast
import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import analysis
from tests.helpers import check_grads, check_map, check_schedule, outlined_with

DIM = 4
torch.manual_seed(0)
LIN = nn.Linear(DIM, DIM)
BIAS = nn.Parameter(torch.randn(DIM))


def masked_scale(x, lin=LIN):
    y = lin(x)
    y[y < 0] *= 0.5  # a leaky ReLU written by hand
    return y


def row_mask(x, lin=LIN):
    y = lin(x)
    keep = x.sum(1) > 0
    y[keep] += BIAS  # a row mask, a row value
    y[keep] -= 1.0
    return y


def prefix_sum(x, lin=LIN):
    h = lin(x)
    for i in range(1, h.shape[0]):
        h[i] += h[i - 1]
    return h


def slices_and_columns(x, lin=LIN):
    y = lin(x)
    y[0] = 0.0
    y[1:] *= 2
    y[:, 0] /= x[:, 1].abs() + 1
    return y


def owned_masks(x):
    y = torch.zeros(x.shape[0], DIM)  # owned, a real constant until written
    y[x > 0] += x.sum()  # (a mask's index: analysis's put cannot evaluate it twice)
    y[x[:, 0] < 0] -= 1.0
    return y


def owned_counts(x):
    counts = torch.zeros(DIM)
    counts[x.sum(0).argmax()] += 1  # an index computed by a call: evaluated once
    counts[x[0].argmin()] *= 3
    return counts


def in_containers(x, lin=LIN):
    state = {"h": lin(x)}
    state["h"][0] *= 3  # an item of a lookup: read twice, the same tensor
    hs = [torch.tanh(x)]
    hs[0][x > 0] -= 1.0
    return state["h"] + hs[0]


PROGRAMS = [
    masked_scale, row_mask, prefix_sum, slices_and_columns, owned_masks, owned_counts,
    in_containers,
]  # fmt: skip


def _inputs(rows: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, DIM, generator=g) for n in rows]


@given(
    program=st.sampled_from(PROGRAMS),
    rows=st.lists(st.integers(2, 5), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_item_updates_equal_eager(program, rows, seed):
    xs = _inputs(rows, seed)
    f = acrobat.autobatch(program)
    with torch.no_grad():
        check_map(f, xs)
    if program not in (owned_masks, owned_counts):  # (no parameter in those)
        check_grads(f, xs, LIN, atol=1e-5, rtol=1e-4)  # (prefix sums: sums in another order)


@pytest.mark.parametrize("program", [p for p in PROGRAMS if p not in (masked_scale, row_mask)])
def test_they_raised_without_the_rewrite(program):
    f = acrobat.autobatch(program)
    with outlined_with(program, ITEM_UPDATES=False), pytest.raises(acrobat.UnsupportedOpError):
        f.map(_inputs([3, 4, 3], 0))


@pytest.mark.parametrize("program", [masked_scale, row_mask])
def test_a_mask_update_as_python_runs_it_reads_the_mask(program):
    """Without the rewrite ``y[y < 0] *= 0.5`` is Python's ``t = y[m]; t *= 0.5; y[m] =
    t``: the masked entries' count is read (one value per masked entry, put back by
    ops._entry_put; the mask's compare, computed by that read, holds y and does not stop
    the write: ops._pending_holders), where the rewrite's where reads nothing."""
    f = acrobat.autobatch(program)
    with torch.no_grad(), outlined_with(program, ITEM_UPDATES=False):
        stats = check_map(f, _inputs([3, 4, 3], 0))
    assert stats.suspensions > 0


def test_a_mask_update_reads_no_value_and_batches():
    """``y[y < 0] *= 0.5`` is ``where(y < 0, y * 0.5, y)``: no suspension for the masked
    entries' count, one batch per op for all instances and sizes."""
    f = acrobat.autobatch(masked_scale)
    with torch.no_grad():
        stats = check_map(f, _inputs([2, 3, 4, 5, 3, 2], 1))
    check_schedule(stats, suspensions=0)


def test_a_mask_beside_other_index_entries_is_refused_clearly():
    """One value per masked entry maps (tests/test_masked_put.py); a mask beside other
    entries of the index does not: the error names the statement and what to write."""

    def f(x, lin=LIN):
        y = lin(x)
        m = y[:, 0] > 0
        y[m, 1:] += y[m, 1:] * 0
        return y

    with pytest.raises(acrobat.UnsupportedOpError, match=r"data-dependent shape") as e:
        acrobat.autobatch(f).map(_inputs([3, 2, 4], 2))
    assert "y[m, 1:] += y[m, 1:] * 0" in str(e.value) and "torch.where" in str(e.value)


def masked_mean(x, lin=LIN):
    y = lin(x)
    y[y < 0] = y.mean()  # a lazy 0-dim value for every masked entry
    return y


def masked_rows(x, lin=LIN):
    y = lin(x)
    y[x.sum(1) > 0] = lin.bias * 2  # a row mask, a real row
    return y


def masked_owned(x):
    y = torch.zeros(x.shape[0], DIM)  # (owned: analysis's put)
    y[x > 0] = x.sum()
    return y


def masked_cast(x):
    y = (x * 3).long()
    y[y > 0] = x.sum()  # a float value written into int64: truncated, as eager does
    return y


@given(
    program=st.sampled_from([masked_mean, masked_rows, masked_owned, masked_cast]),
    rows=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_masked_writes_of_a_tensor_value_equal_eager(program, rows, seed):
    """``x[mask] = v`` with a tensor ``v`` that broadcasts against one masked entry is
    ``where(mask, v, x)``: no value read, one batch; it raised for a lazy ``v``."""
    xs = _inputs(rows, seed)
    f = acrobat.autobatch(program)
    with torch.no_grad():
        check_schedule(check_map(f, xs), suspensions=0)
    if program is masked_mean:
        check_grads(f, xs, LIN)


def test_eager_errors_stay_errors():
    """An update that does not keep the item's dtype raises where eager raises."""

    def f(x):
        y = (x * 10).long()
        y[y > 0] *= 0.5  # (in place, a float result into an int64 tensor)
        return y

    xs = _inputs([3, 2], 3)
    with pytest.raises(RuntimeError):
        f(xs[0])
    with pytest.raises(RuntimeError):
        acrobat.autobatch(f).map(xs)


def test_an_input_of_the_map_is_refused_clearly():
    def f(x):
        x[0] += 1.0  # the caller's tensor
        return x

    with pytest.raises(acrobat.UnsupportedOpError, match="input of the map"):
        acrobat.autobatch(f).map(_inputs([2, 3], 4))


def test_other_targets_are_updated_as_written():
    """A list of lazy tensors and a real tensor the function made are no lazy targets:
    the statement runs as written (a list's item updated in place, a constant refused
    as before)."""

    def in_a_list(x):
        ys = [x * 2, x * 3]
        ys[0] += 1.0
        return ys[0] + ys[1]

    check_map(acrobat.autobatch(in_a_list), _inputs([2, 3], 5))


def _rewritten(src: str) -> str:
    node = ast.parse(textwrap.dedent(src)).body[0]
    analysis._rewrite_item_updates(node)
    return ast.unparse(node)


def test_which_statements_are_rewritten():
    out = _rewritten("""
        def f(y, m, i):
            y[m] *= 0.5
            y[i:] += 1
            self.h[i] += 1
            y[i] //= 2
            y += 1
            d["h"][i] *= 2
            y[f(i)][i] += 1
    """)
    lines = out.splitlines()
    assert sum("if " in line for line in lines) == 3  # name[index] op= v, d["h"][i] too
    assert "self.h[i] += 1" in out and "y[i] //= 2" in out and "y += 1" in out
    assert "if " not in out.split("y[f(i)][i]")[0].splitlines()[-1]  # (a call: left)
    assert "(i, None, None)" in out  # (the slice as a call's value, evaluated once)
