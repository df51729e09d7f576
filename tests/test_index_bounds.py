"""Per-instance indices batched into one call must keep each instance to its own rows.

Two ways they did not (found in session 42):

- a batch that lays the instances' rows end to end and offsets each one's indices
  (``ops.scatter_rule`` for ``index_add`` / ``scatter_add`` / ``scatter``, torch.vmap's
  rule for ``F.embedding`` of a per-instance table): an index past its instance's rows
  reached the next instance's, silently (a wrong value, or a message added into another
  instance's result), where eager raises;
- a padded batch (acrobat/padding.py) of tensors whose length varies: an index past its
  instance's length but within the padded one read or wrote a pad, silently, and a
  negative index (``h[-1]``, valid) counted from the padded end: a wrong value.

Now indices are checked against each instance's own size (``ops.check_range``,
``padding._in_bounds``), negative ones of ``x[i]`` count from the instance's own end, and
an out-of-range index raises an error naming its instance, the others untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat

torch.manual_seed(0)
LIN = nn.Linear(2, 2)

# op(h, i): a lookup or update of the instance's own (n, 2) tensor h by its indices i
OPS = {
    "index_add": lambda h, i: torch.zeros_like(h).index_add(0, i, h[: i.shape[0]]),
    "scatter_add": lambda h, i: torch.zeros_like(h).scatter_add(
        0, i[:, None].expand(-1, 2), h[: i.shape[0]]
    ),
    "scatter": lambda h, i: torch.zeros_like(h).scatter(
        0, i[:, None].expand(-1, 2), h[: i.shape[0]]
    ),
    "index_select": lambda h, i: h.index_select(0, i),
    "gather": lambda h, i: h.gather(0, i[:, None].expand(-1, 2)),
    "getitem": lambda h, i: h[i],
    "embedding": lambda h, i: F.embedding(i, h),
}


# ops that do not run padded (each length its own batch): a per-instance table's
# embedding, a plain scatter (a pad would overwrite entry 0)
UNPADDED = {"embedding", "scatter"}


def _fn(op):
    """The instance's function (no closure: its two lines are one automatic block, so
    instances of different lengths run padded)."""

    def fn(x, idx, op=op):
        h = torch.tanh(LIN(x))
        return op(h, idx).sum(0) * 1

    return fn


@pytest.mark.parametrize("lengths", [(3, 3, 3, 3), (3, 4, 5, 5, 4)], ids=["fixed", "ragged"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_an_index_past_its_instance_raises_naming_it(name, lengths):
    """Instance 1's index 4 is past its 3 rows (the fixed batch: in the next instance's
    rows once laid end to end; the ragged one: within the padded length)."""
    fn = _fn(OPS[name])
    f = acrobat.autobatch(fn)
    xs = [torch.randn(n, 2) for n in lengths]
    good = [torch.tensor([0, 2])] * len(xs)
    with torch.no_grad():
        f.map(xs, good)  # (traced, and padded from the next map on)
        got, stats = f.map(xs, good, stats=True)
    for a, x, i in zip(got, xs, good):
        torch.testing.assert_close(a, fn(x, i))
    if name not in UNPADDED:
        assert sum(v[0] for k, v in stats.by_op.items() if k.startswith("block")) == 1
    xs[1] = torch.randn(3, 2)
    bad = list(good)
    bad[1] = torch.tensor([0, 4])
    with pytest.raises((IndexError, RuntimeError)):
        fn(xs[1], bad[1])  # eager refuses it
    with pytest.raises(acrobat.AcrobatError, match="instance 1"), torch.no_grad():
        f.map(xs, bad)
    with torch.no_grad():  # the next map, valid again, is right
        got = f.map(xs, good)
    for a, x, i in zip(got, xs, good):
        torch.testing.assert_close(a, fn(x, i))


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=2, max_size=7),
    st.integers(0, 2**16),
)
def test_negative_indices_count_from_each_instances_own_end(lengths, seed):
    """``h[i]`` with negative entries, ``h`` of a length that varies: padded, -1 is each
    instance's last row, as in eager."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, 2, generator=g) for n in lengths]
    idxs = [torch.randint(-n, n, (3,), generator=g) for n in lengths]
    fn = _fn(OPS["getitem"])
    f = acrobat.autobatch(fn)
    with torch.no_grad():
        for _ in range(2):
            got, stats = f.map(xs, idxs, stats=True)
    for a, x, i in zip(got, xs, idxs):
        torch.testing.assert_close(a, fn(x, i))
    assert sum(v[0] for k, v in stats.by_op.items() if k.startswith("block")) == 1, stats.by_op
