"""``x[mask] = v`` with one value per selected entry: ``y[y > 0] = y[y > 0] * 2``,
``y[m] = torch.exp(-y[m])``, ``y[m] += y[m] * 0.5``, ``y[keep] = rows``.

In eager ``v`` has the masked entries' count as its first dim, so the count (each
instance's own) is read: the mask's value, as ``y[m]`` itself reads it. The write is then
``where(mask, v.index_select(0, rank), x)``, ``rank`` each entry's place among the
selected ones (the instance's data): a lookup and an elementwise op, which batch across
instances whatever their counts, and carry gradients to ``x`` and ``v`` as eager's put.
These raised ("not one value per masked entry"), or were refused as updates of a tensor
an op had read (the read of ``y > 0`` that sized ``y[y > 0]``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from tests.helpers import check_grads, check_map

DIM = 4


def doubled(x, lin):
    y = lin(x)
    y[y > 0] = y[y > 0] * 2  # the value reads y under the mask, as the index does
    return y


def decayed(x, lin):
    y = torch.tanh(lin(x))
    m = y > 0.2
    y[m] = torch.exp(-y[m])
    return y


def updated(x, lin):
    y = lin(x)
    m = y > 0
    y[m] += y[m] * 0.5  # (analysis: update_item; the item's op written back)
    return y


def rows_replaced(x, lin):
    y = lin(x)
    keep = x.sum(1) > 0  # a mask of the leading dim: one row of v per kept row
    y[keep] = lin(x[keep] * 2)
    return y


def owned(x, lin):
    y = x.clone()  # a local the function owns: put, no in-place checks
    y[x > 0] = torch.sqrt(x[x > 0])
    return lin(y)


def cast(x, lin):
    y = lin(x)
    counts = torch.zeros(y.shape, dtype=torch.long)
    counts[y > 0] = (y[y > 0] * 10).long()  # a long value into a long tensor
    return y + counts


PROGRAMS = [doubled, decayed, updated, rows_replaced, owned, cast]
GRADS = [doubled, updated, rows_replaced, owned]  # (eager cannot: tanh saved its output)


def _inputs(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, DIM, generator=g) for n in sizes]


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from(PROGRAMS),
    st.lists(st.integers(1, 6), min_size=1, max_size=6),
    st.integers(0, 2**16),
)
def test_one_value_per_masked_entry_equals_eager(program, sizes, seed):
    torch.manual_seed(seed)
    lin = nn.Linear(DIM, DIM)
    with torch.no_grad():
        check_map(acrobat.autobatch(program), _inputs(sizes, seed), lin=lin)


@settings(max_examples=8, deadline=None)
@given(
    st.sampled_from(GRADS),
    st.lists(st.integers(1, 5), min_size=1, max_size=4),
    st.integers(0, 2**16),
)
def test_gradients_through_a_per_entry_put_equal_eager(program, sizes, seed):
    torch.manual_seed(seed)
    lin = nn.Linear(DIM, DIM)
    check_grads(acrobat.autobatch(program), _inputs(sizes, seed), lin, lin=lin)


def nothing_selected(x, lin):
    y = lin(x)
    y[y > 1e9] = y[y > 1e9] * 2  # no entry: an empty value, nothing written
    return y


def everything_selected(x, lin):
    y = lin(x)
    y[y == y] = -y[y == y]
    return y


@pytest.mark.parametrize("program", [nothing_selected, everything_selected])
def test_empty_and_full_masks_equal_eager(program):
    torch.manual_seed(1)
    check_map(acrobat.autobatch(program), _inputs([3, 1, 4], 5), lin=nn.Linear(DIM, DIM))


def wrong_count(x, lin):
    y = lin(x)
    y[y > 0] = torch.ones(100)  # more values than selected entries
    return y


def other_dtype(x, lin):
    y = lin(x)
    y[y < 0] = (y[y < 0] * 100).long()  # eager casts only a value of one element
    return y


def other_dtype_row(x, lin):
    y = lin(x)
    y[x.sum(1) > 0] = torch.ones(DIM, dtype=torch.float64)  # (broadcast to each row)
    return y


@pytest.mark.parametrize(
    "program, message",
    [
        (wrong_count, "shape mismatch"),
        (other_dtype, "dtypes match"),
        (other_dtype_row, "dtypes match"),
    ],
)
def test_values_eager_refuses_raise_its_error(program, message):
    """A value whose count is not the instance's, or of another dtype with more than one
    element, raises eager's error naming the line (the second cast before: the map
    returned values where eager raises)."""
    lin = nn.Linear(DIM, DIM)
    xs = [torch.ones(3, DIM), -torch.ones(2, DIM)]  # (every entry masked in one of them)
    with pytest.raises(RuntimeError, match=message):
        for x in xs:
            program(x, lin)
    with pytest.raises(RuntimeError, match=message) as err:
        acrobat.autobatch(program).map(xs, lin=lin)
    assert f"in {program.__name__}: y[" in str(err.value)  # the line, as eager's error
