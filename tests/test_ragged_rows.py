"""Op-by-op work over per-instance values of different sizes (config.RAGGED_ROWS): a row
picked by a per-instance int, a whole reduction, a write at a per-instance int, each one
batch whatever the sizes; and the runs that hold such a write (``mask[i] = -inf`` after a
choice), one block for every int and, padded, for every size. The map equals the eager
loop, values and gradients, with the option on and off."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import config
from tests.helpers import check_grads, check_map

DIM = 4
torch.manual_seed(0)
LAYER = nn.Linear(DIM, DIM)

sizes = st.lists(st.integers(1, 6), min_size=2, max_size=6)


def values(ns: list, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, DIM, generator=g) for n in ns]


def batches(stats, name: str) -> int:
    return stats.by_op.get(name, (0, 0))[0]


@acrobat.autobatch
def pick_row(x, i, layer=LAYER):
    h = layer(x)
    return h[i]  # (no run of its own: a pick, recorded as it runs)


@st.composite
def values_and_ints(draw) -> tuple:
    """Per-instance values of different sizes, and an int in range of each (negative too)."""
    ns = draw(sizes)
    ints = [draw(st.integers(-n, n - 1)) for n in ns]
    return ns, values(ns, draw(st.integers(0, 2**16))), ints


@settings(max_examples=10, deadline=None)
@given(values_and_ints())
def test_picks_from_values_of_different_sizes_are_one_batch(case):
    ns, xs, ints = case
    with torch.no_grad():
        got, stats = pick_row.map(xs, ints, stats=True)
    want = [pick_row.eager(x, i) for x, i in zip(xs, ints)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert batches(stats, "pick") == 1, stats.by_op
    with config.override(RAGGED_ROWS=False), torch.no_grad():
        _, per_size = pick_row.map(xs, ints, stats=True)
    assert batches(per_size, "pick") == len(set(ns)), per_size.by_op


@acrobat.autobatch
def pick_block(x, i, layer=LAYER):
    h = layer(x).reshape(x.shape[0], 2, 2)
    return h[i]  # (a row of 2 x 2 from each value)


@settings(max_examples=10, deadline=None)
@given(values_and_ints(), st.booleans())
def test_picks_of_different_sizes_copy_their_rows_by_address(case, native):
    """Without autograd each value's row is copied by address, all in one C call
    (executor._native_picks, _native.pick_rows); with the C path off, a view of each value,
    their concatenation and a lookup: both eager's, negative ints too, rows of any shape."""
    from acrobat import executor

    ns, xs, ints = case
    used = []
    real = executor._native_picks

    def counting(nodes, column, stats):
        out = real(nodes, column, stats)
        used.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as mp, torch.no_grad(), config.override(FAST_GATHER=native):
        mp.setattr(executor, "_native_picks", counting)
        for f in (pick_row, pick_block):
            got = f.map(xs, ints)
            want = [f.eager(x, i) for x, i in zip(xs, ints)]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)
    if len(set(ns)) > 1:  # (values of one size: a batch of one shape, no ragged picks)
        assert used and all(used) == (native and executor._native is not None)


REDUCTIONS = ["sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "all",
              "any"]  # fmt: skip


def whole(name: str, dtype: torch.dtype):
    def f(x, layer=LAYER):
        h = layer(x)
        if dtype == torch.bool:
            h = h > 0
        elif dtype != torch.float32:
            h = (h * 10).to(dtype)
        out = getattr(h, name)()  # (alone in its run: a whole reduction as it runs)
        return out

    f.__name__ = f"whole_{name}"
    return acrobat.autobatch(f)


@pytest.mark.parametrize("name", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool])
def test_whole_reductions_of_values_of_different_sizes_are_one_batch(name, dtype):
    if name in ("mean",) and dtype != torch.float32:
        pytest.skip("mean of an integer tensor is an error in eager too")
    if name in ("amax", "amin", "argmax", "argmin") and dtype == torch.bool:
        pytest.skip("torch has no such reduction of a bool tensor")
    f = whole(name, dtype)
    xs = values([3, 1, 5, 3, 6, 2], seed=4)
    with torch.no_grad():
        stats = check_map(f, xs)
    assert batches(stats, name) == 1, stats.by_op
    with config.override(RAGGED_ROWS=False), torch.no_grad():
        per_size = check_map(f, xs)
    assert batches(per_size, name) == 5, per_size.by_op


@given(
    sizes,
    st.integers(0, 2**16),
    st.sampled_from(["sum", "mean", "amax", "argmin", "prod"]),
    st.booleans(),
)
def test_whole_reductions_padded_by_address_equal_eager(ns, seed, name, native):
    """Without autograd the values are copied into the padded matrix by address, one C
    call (executor._padded_flat); with the C path off, pad_sequence: both are
    eager's, for 2-d values of many sizes and the values' own rows."""
    xs = values(ns, seed)

    def f(x, layer=LAYER):
        h = layer(x)
        return getattr(h, name)(), getattr(h[0], name)()

    with torch.no_grad(), config.override(FAST_GATHER=native):
        check_map(acrobat.autobatch(f), xs, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(sizes, st.integers(0, 2**16))
def test_whole_reductions_train_through_the_padding(ns, seed):
    xs = values(ns, seed)
    for name in ("sum", "mean", "amax", "prod"):
        check_grads(whole(name, torch.float32), xs, LAYER, atol=1e-5)


@acrobat.autobatch
def write_row(x, i, layer=LAYER):
    h = layer(x) + 1.0  # (not tanh: eager's own backward needs tanh's output unwritten)
    h[i] = 0.5  # (not a local it made: a write into the lazy h, recorded as it runs)
    return h


@settings(max_examples=10, deadline=None)
@given(values_and_ints())
def test_writes_into_values_of_different_sizes_are_one_batch(case):
    _, xs, ints = case
    got, stats = write_row.map(xs, ints, stats=True)
    for g, x, i in zip(got, xs, ints):
        torch.testing.assert_close(g, write_row.eager(x, i))
    assert batches(stats, "put") == 1, stats.by_op
    LAYER.zero_grad()
    torch.stack([g.sum() for g in write_row.map(xs, ints)]).sum().backward()
    got_grad = LAYER.weight.grad.clone()
    LAYER.zero_grad()
    torch.stack([write_row.eager(x, i).sum() for x, i in zip(xs, ints)]).sum().backward()
    torch.testing.assert_close(got_grad, LAYER.weight.grad, atol=1e-5, rtol=1e-5)


def pointer(tokens, emb, cell):
    """A pointer network's loop: choose the best row not taken yet (a value read), mask it
    out, feed it back (bench/patterns.py's pointer)."""
    e = emb(tokens)
    h = e.mean(0)
    mask = torch.zeros(tokens.shape[0])
    scores = []
    for _ in range(tokens.shape[0]):
        s = e @ h + mask
        i = int(s.argmax())
        scores.append(s.max())
        mask[i] = float("-inf")
        h = cell(e[i], h)
    return torch.stack(scores)


EMB = nn.Embedding(30, DIM)
CELL = nn.GRUCell(DIM, DIM)


@settings(max_examples=8, deadline=None)
@given(sizes, st.integers(0, 2**16))
def test_a_pointer_network_writes_its_mask_in_one_padded_block_per_step(ns, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(30, (n,), generator=g) for n in ns]
    f = acrobat.autobatch(pointer)
    with torch.no_grad():
        check_map(f, tokens, emb=EMB, cell=CELL)
        stats = check_map(f, tokens, emb=EMB, cell=CELL)
    # the write and the cell: one block, its int a per-instance index (no trace per int);
    # each instance's last step is dead (nothing reads its mask or h)
    step = f"block:pointer (test_ragged_rows.py, lines {_line('mask[i]')}-{_line('h = cell')})"
    if max(ns) > 1:
        assert stats.by_op[step][1] == sum(ns) - len(ns), stats.by_op
    assert "put" not in stats.by_op and "put_into" not in stats.by_op, stats.by_op
    # padded over the sizes: a batch per step, the first too (its mask, each size's real
    # zeros(n), read as a row: the traces differ in an argument's size, not a constant)
    assert stats.by_op.get(step, (0, 0))[0] <= max(ns) - 1, stats.by_op
    holder = nn.Module()
    holder.emb, holder.cell = EMB, CELL
    check_grads(f, tokens, holder, atol=1e-5, emb=EMB, cell=CELL)


def _line(text: str) -> int:
    """The line of ``pointer``'s source that holds ``text``."""
    source, start = inspect.getsourcelines(pointer)
    return start + next(k for k, line in enumerate(source) if text in line)


def test_an_int_out_of_range_in_a_padded_write_names_the_instance():
    @acrobat.autobatch
    def f(x, i, layer=LAYER):
        h = torch.tanh(layer(x)).clone()  # (its own tensor: the write joins the block)
        h[i] = 0.0
        return h.sum(0) * 2

    xs = values([2, 4, 3], seed=1)
    f.map(xs, [0, 0, 0])  # (the traces of the three sizes made, and joined)
    _, stats = f.map(xs, [1, -4, -3], stats=True)
    assert sum(b for k, (b, _) in stats.by_op.items() if k.startswith("block:f")) == 1, stats
    with pytest.raises(
        acrobat.InstanceIndexError,
        match=r"block:f \(test_ragged_rows.py, lines \d+-\d+\) failed for instance 2: index 3 "
        r"is out of bounds for dimension 0 with size 3",
    ):
        f.map(xs, [1, -4, 3])
    got = f.map(xs, [1, -4, -3])  # (negative ints count from each instance's own end)
    for g, x, i in zip(got, xs, [1, -4, -3]):
        torch.testing.assert_close(g, f.eager(x, i))


def test_writes_at_per_instance_index_tensors_check_each_instances_own_size():
    """``h[t] = v`` with ``t`` a per-instance 0-d index tensor (not an int, so not checked
    when recorded): one batch over the sizes, negative indices from each instance's own
    end, and one out of its instance's range raises naming that instance."""
    xs = values([2, 4, 3], seed=1)
    good = [torch.tensor(1), torch.tensor(-4), torch.tensor(-3)]
    got, stats = write_row.map(xs, good, stats=True)
    assert batches(stats, "put") == 1, stats.by_op
    for g, x, t in zip(got, xs, good):
        torch.testing.assert_close(g, write_row.eager(x, t))
    bad = [torch.tensor(1), torch.tensor(-4), torch.tensor(3)]
    with pytest.raises(acrobat.InstanceIndexError, match=r"put failed for instance 2: index 3 "
                       r"is out of bounds for dimension 0 with size 3"):  # fmt: skip
        write_row.map(xs, bad)
    with pytest.raises(IndexError, match="index 3 is out of bounds for dimension 0 with size 3"):
        write_row.eager(xs[2], bad[2])  # (what eager says for that instance)


# ---- an embedding whose gradient counts ids (scale_grad_by_freq) ---------------------
# A batch of lookups ran as one F.embedding of every instance's ids, so an id's count was
# every instance's: a wrong gradient (found in session 45). Under autograd such a batch
# looks up each instance's ids on its own.

FREQ = nn.Embedding(11, DIM, scale_grad_by_freq=True)


@acrobat.autobatch
def look_up_counted(ids):
    return FREQ(ids)  # (a lone lookup: no run, recorded as it runs)


@settings(max_examples=8, deadline=None)
@given(ns=sizes, seed=st.integers(0, 999))
def test_a_lookup_that_counts_ids_trains_as_eager(ns, seed):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(4, (n,), generator=g) for n in ns]  # (ids repeat across instances)
    with torch.no_grad():
        check_map(look_up_counted, ids)
    check_grads(look_up_counted, ids, FREQ, atol=1e-6)
