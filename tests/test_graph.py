"""Graph construction: depth, phases, taint (reuse vs gather), hoisting, signatures, and
the schedule's shape."""

import random

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import acrobat
from tests.helpers import check_map, check_schedule

torch.manual_seed(0)
W = torch.randn(8, 6)
U = torch.randn(8, 8)
V = torch.randn(8, 8)
b = torch.randn(8)


@acrobat.autobatch
def project(x):
    return x @ W.t() + b


def test_reused_weight_is_one_batch_and_hoisted():
    xs = [torch.randn(6) for _ in range(16)]
    stats = check_map(project, xs)
    # the 16 inputs (one data batch), ONE matmul reading the hoisted W.t(), ONE add
    assert stats.nodes == 16 * 3
    check_schedule(stats, batches=3)


@acrobat.autobatch
def two_directions(xs):
    fwd, bwd = [], []
    h = g = torch.zeros(8)
    for x in xs:
        h = torch.tanh(x @ W.t() + h @ U)
        fwd.append(h)
    for x in reversed(xs):
        g = torch.tanh(x @ W.t() + g @ V)
        bwd.append(g)
    with acrobat.phase("output"):
        return torch.stack([torch.sigmoid(f + r) for f, r in zip(fwd, reversed(bwd))])


def test_directions_batch_separately_and_output_phase_is_one_batch():
    rng = random.Random(0)
    seqs = [[torch.randn(6) for _ in range(rng.randint(2, 7))] for _ in range(12)]
    # else each direction is one node, each step's line a region
    with acrobat.config.override(AUTO_SCANS=False, AUTO_REGIONS=False):
        got, stats = two_directions.map(seqs, stats=True)
    for g, s in zip(got, seqs):
        torch.testing.assert_close(g, two_directions.eager(s))
    # inputs; per step and direction: matmul x W^T (hoisted to depth 1 with all tokens),
    # h @ U/V, add, add, tanh; then the output phase: ONE add and ONE sigmoid batch.
    # The first step reads the hoisted zeros state (its h @ U is shared), so it fuses less.
    assert stats.batches <= 1 + 2 + 2 * 4 * 7 + 2, stats
    total_tokens = sum(len(s) for s in seqs)
    assert stats.by_op["sigmoid"] == [1, total_tokens]
    # x @ W^T of every token of both directions: ONE batch (same reused W, depth 1); the
    # recurrent h @ U and g @ V: one batch per step and direction (different weights), except
    # the first step whose zeros state is hoisted (shared, computed once)
    longest = max(len(s) for s in seqs)
    assert stats.by_op["matmul"] == [1 + 2 * (longest - 1), 4 * total_tokens - 2 * len(seqs)]


def test_phase_makes_output_ops_one_batch():
    @acrobat.autobatch
    def f(h, n):
        outs = []
        for _ in range(n):
            h = torch.tanh(h + 1.0)
            outs.append(h)
        with acrobat.phase("out"):
            return [torch.sigmoid(o) for o in outs]

    lengths = [1, 3, 5, 2, 4]
    h0s = [torch.randn(4) for _ in lengths]
    # else the loop is one node per instance, its line a region
    with acrobat.config.override(AUTO_SCANS=False, AUTO_REGIONS=False):
        got, stats = f.map(h0s, lengths, stats=True)
    for g, h0, n in zip(got, h0s, lengths):
        for a, e in zip(g, f.eager(h0, n)):
            torch.testing.assert_close(a, e)
    # inputs, add+tanh per step (5 depths x 2), then ONE sigmoid batch for all outputs
    check_schedule(stats, batches=1 + 2 * 5 + 1)


def test_depth_is_dataflow_depth():
    @acrobat.autobatch
    def f(x):
        a = torch.tanh(x)  # depth 2 (x is an input node at depth 0 -> its op depth 1)
        b2 = torch.sigmoid(x)  # also depth 2: independent of a, batches with nothing else
        return a * b2

    with acrobat.config.override(AUTO_REGIONS=False):  # else a, b2: one block node
        _, stats = f.map([torch.randn(3) for _ in range(4)], stats=True)
    check_schedule(stats, batches=4)  # input, tanh, sigmoid, mul


def _random_tree(rng, height):
    if height == 0 or rng.random() < 0.3:
        return rng.randrange(10)
    return (_random_tree(rng, height - 1), _random_tree(rng, height - 1))


emb = torch.nn.Embedding(10, 8)
cell_w = torch.nn.Linear(16, 16)


@acrobat.block
def cell(hl, hr):
    a, g = cell_w(torch.cat([hl, hr])).chunk(2)
    return torch.tanh(a) * torch.sigmoid(g)


@acrobat.autobatch
def tree_rnn(t):
    if isinstance(t, int):
        return torch.tanh(emb(torch.tensor(t)))
    return cell(tree_rnn(t[0]), tree_rnn(t[1]))


def _height(t):
    return 0 if isinstance(t, int) else 1 + max(_height(t[0]), _height(t[1]))


@given(st.integers(0, 10_000), st.integers(1, 7))
def test_tree_schedule_is_O_height(seed, h):
    rng = random.Random(seed)
    trees = [_random_tree(rng, h) for _ in range(64)]
    with torch.no_grad():
        stats = check_map(tree_rnn, trees)
    height = max(_height(t) for t in trees)
    # word lookups, one tanh batch, then one cell batch per level
    check_schedule(stats, max_batches=3 + height)
    # depth scheduling of trees is optimal: exactly the lower bound
    assert stats.batches == stats.batches_lower_bound


def test_hoisted_constant_state_is_shared():
    h0_calls = []

    @acrobat.autobatch
    def f(x):
        h = torch.zeros(4)
        h0_calls.append(h)
        return x + h

    f.map([torch.randn(4) for _ in range(5)])
    assert all(h is h0_calls[0] for h in h0_calls), "torch.zeros(4) should be made once per map"


def test_schedule_listing_and_lint():
    from acrobat import graph, scheduler

    @acrobat.autobatch
    def f(x):
        return F.relu(x) * 2

    f.map([torch.randn(3)])
    listing = scheduler.describe(
        [[graph.Node(acrobat.OPS["relu"], None, (), None, (), None, None, 1, 0, 0, None)]]
    )
    assert "relu" in listing and "depth" in listing


@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    picks=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 11)), min_size=1, max_size=30),
    dense=st.booleans(),
)
def test_gather_reads_any_mix_of_producer_rows(sizes, picks, dense):
    """executor.gather: a view for consecutive rows, one index_select for one source, and
    rows from several sources (dense: concatenated ranges; sparse: one copy per source),
    with gradients flowing back to every source."""
    from types import SimpleNamespace

    from acrobat import executor
    from acrobat.stats import Stats

    executor.reset_slots()
    outs = [torch.randn(k, 3, requires_grad=True) for k in sizes]
    nodes = []
    for buf in outs:
        base = next(executor._batches) << executor._BATCH_SHIFT
        nodes.append([SimpleNamespace(outs=(buf,), slot=base + r) for r in range(len(buf))])
    if dense:  # consecutive rows of the first source
        picks = [(0, r) for r in range(len(outs[0]))]
    picks = [(b % len(outs), r % len(outs[b % len(outs)])) for b, r in picks]
    ts = [SimpleNamespace(node=nodes[b][r], idx=0) for b, r in picks]
    got = executor.gather(ts, len(ts), Stats())
    want = torch.stack([outs[b][r] for b, r in picks])
    assert torch.equal(got, want)
    got.sum().backward()
    for b, buf in enumerate(outs):
        counts = torch.zeros(len(buf))
        for pb, r in picks:
            if pb == b:
                counts[r] += 1
        grad = buf.grad if buf.grad is not None else torch.zeros_like(buf)  # unread source
        assert torch.equal(grad, counts[:, None].expand(-1, 3))


@acrobat.autobatch
def stacked(xs, how):
    steps = [torch.tanh(x * (i + 1)) for i, x in enumerate(xs)]
    if how == "stack0":
        return torch.stack(steps)
    if how == "stack-3":
        return torch.stack(steps, -3)  # dim 0 of a stack of (2, 3) parts
    if how == "stack1":
        return torch.stack(steps, 1)  # not along dim 0: one gather per part
    if how == "cat0":
        return torch.cat(steps)
    if how == "dup":  # one part several times, and parts of different steps
        return torch.stack([steps[0], steps[-1], steps[0]])
    return torch.cat(steps + [steps[0][:1]], 0)  # parts of different shapes


@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    how=st.sampled_from(["stack0", "stack-3", "stack1", "cat0", "ragged"]),
)
def test_stack_and_cat_of_steps_gather_all_parts_at_once(lengths, how):
    xs = [list(torch.randn(k, 2, 3)) for k in lengths]
    from acrobat.ops import TABLE

    with torch.no_grad(), acrobat.config.override(RAGGED=False):
        stats = check_map(stacked, xs, how=how)
        saved = TABLE["stack"].extra.pop("flat"), TABLE["cat"].extra.pop("flat")
        try:  # the same map, one gather per part
            per_part = check_map(stacked, xs, how=how)
        finally:
            TABLE["stack"].extra["flat"], TABLE["cat"].extra["flat"] = saved
    assert stats.gathers <= per_part.gathers


def test_flat_gather_for_a_long_stack_of_scattered_steps():
    """Sentences of equal length separated by others in every step's batch: one gather
    per token in the per-part path, a cat and a reorder in the flat one."""
    from acrobat.ops import TABLE

    xs = [list(torch.randn(k, 2, 3)) for k in (6, 7, 6, 7, 6)]
    with torch.no_grad(), acrobat.config.override(RAGGED=False):
        stats = check_map(stacked, xs, how="stack0")
        saved = TABLE["stack"].extra.pop("flat")
        try:
            per_part = check_map(stacked, xs, how="stack0")
        finally:
            TABLE["stack"].extra["flat"] = saved
    # 2 stack batches (lengths 6 and 7): 6 + 7 column gathers become at most 2 x 2
    assert per_part.gathers - stats.gathers >= 13 - 4, (stats, per_part)


def _grad_or_zeros(x):
    return torch.zeros_like(x) if x.grad is None else x.grad.clone()


@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    how=st.sampled_from(["stack0", "stack-3", "stack1", "cat0", "ragged", "dup"]),
    grad=st.booleans(),
)
def test_stacks_of_any_part_count_batch_together(lengths, how, grad):
    """config.RAGGED: a stack / cat along dim 0 of same-shape parts is one batch whatever
    each instance's number of parts (one column gather, each result a view of its rows);
    the others (another dim, parts of different shapes) batch by part count. Same values
    and gradients as eager either way."""
    xs = [[torch.randn(2, 3, requires_grad=grad) for _ in range(k)] for k in lengths]
    with torch.set_grad_enabled(grad):
        stats = check_map(stacked, xs, how=how)
        with acrobat.config.override(RAGGED=False):
            by_count = check_map(stacked, xs, how=how)
    kinds = 1 if how == "dup" else len(set(lengths))  # dup: always three parts
    ragged = how in ("stack0", "stack-3", "cat0", "dup")
    op = "cat" if how.startswith("cat") or how == "ragged" else "stack"
    assert stats.by_op[op][0] == (1 if ragged else kinds), stats.by_op
    assert by_count.by_op[op][0] == kinds, by_count.by_op
    if grad:
        got, _ = stacked.map(xs, how=how, stats=True)
        sum(g.sum() * (i + 1) for i, g in enumerate(got)).backward()
        # an input the result does not read: eager leaves no grad; map a zero one, or
        # none where the part's ops were dropped as dead (config.PRUNE_DEAD)
        mapped = [[_grad_or_zeros(x) for x in row] for row in xs]
        for row in xs:
            for x in row:
                x.grad = None
        sum(stacked.eager(row, how=how).sum() * (i + 1) for i, row in enumerate(xs)).backward()
        for i, row in enumerate(xs):
            for j, x in enumerate(row):
                want = x.grad if x.grad is not None else torch.zeros_like(x)
                torch.testing.assert_close(mapped[i][j], want, msg=f"instance {i} part {j}")


@acrobat.autobatch
def lookups(ids, table, emb):
    """Row lookups of a parameter (indexing, nn.Embedding), row-wise views of them, a
    lookup returned as it is."""
    mats = [table[i].reshape(3, 4).t() for i in ids]  # (4, 3) views of table rows
    vecs = [emb(torch.tensor(i)) for i in ids]
    out = sum(m @ v[:3] for m, v in zip(mats, vecs))
    return out, table[ids[0]], mats[-1]


@given(
    ids=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=5), min_size=1, max_size=6),
    grad=st.booleans(),
)
def test_row_lookups_read_the_table_in_place(ids, grad):
    """A batch of row lookups is the table itself (each node at its index's row) and a
    row-wise view of it views the whole table: map == eager, gradients equal, and what
    map returns is a copy (a later in-place update of the table does not change it)."""
    torch.manual_seed(0)
    table = torch.randn(10, 12, requires_grad=grad)
    emb = torch.nn.Embedding(10, 5)
    with torch.set_grad_enabled(grad):
        got = lookups.map(ids, table=table, emb=emb)
        want = [lookups.eager(i, table=table, emb=emb) for i in ids]
        for g, w in zip(got, want):
            for a, b in zip(g, w):
                torch.testing.assert_close(a, b)
        if grad:
            (g_table,) = torch.autograd.grad(sum(o.sum() for g in got for o in g), table)
            (w_table,) = torch.autograd.grad(sum(o.sum() for w in want for o in w), table)
            torch.testing.assert_close(g_table, w_table)
    before = [g[1].clone() for g in got]
    with torch.no_grad():
        table.add_(1.0)
    for g, b in zip(got, before):
        assert torch.equal(g[1], b)  # not a view of the table


def test_row_lookup_batch_copies_nothing(monkeypatch):
    from acrobat import executor

    table = torch.randn(50, 12)
    emb = torch.nn.Embedding(50, 5)
    xs = [[1, 7, 3], [40, 2], [9]]
    with torch.no_grad():
        stats = check_map(lookups, xs, table=table, emb=emb)
        monkeypatch.setattr(executor, "ROW_VIEWS", frozenset())
        monkeypatch.setattr(executor, "_take_in_place", lambda *args: False)
        copying = check_map(lookups, xs, table=table, emb=emb)
    assert stats.batches_of("reshape") == copying.batches_of("reshape") == 1
    # copies: the copying path's lookup batches each copy their rows before anything
    # gathers them; in place, the rows are copied once, by the gather that reads them
    assert stats.gathers < copying.gathers + copying.batches_of("take")
    assert stats.gathers >= copying.gathers


# ---- alignment: a new bucket joins a nearby later one of its signature ------------------

step_w = torch.nn.Linear(8, 8)
mix_w = torch.nn.Linear(16, 8)


@acrobat.block
def inner_step(x, r):
    return torch.tanh(step_w(r) + x)


@acrobat.block
def outer_step(r, g):
    return torch.sigmoid(mix_w(torch.cat([r, g]))) * g


@acrobat.autobatch
def nested_loops(inst):
    x, trips = inst
    g = x
    for k in trips:
        r = g
        for _ in range(k):
            r = inner_step(x, r)
        g = outer_step(r, g)
    return g


def test_a_rare_step_waits_for_a_later_batch_of_its_kind():
    # A: 5 inner steps, outer, 4 inner, outer; B: 3 inner, outer, 4 inner, outer.
    # By depth B's outer steps (levels 4, 9) miss A's (6, 11): 4 outer batches and inner
    # steps at 10 levels. Aligned, B's first outer step waits 2 levels for A's, and then
    # B runs in step with A: 2 outer batches, inner steps at 9 levels.
    gen = torch.Generator().manual_seed(0)
    xs = [(torch.randn(8, generator=gen), trips) for trips in ((5, 4), (3, 4))]
    with torch.no_grad():
        with acrobat.config.override(ALIGN_WINDOW=0):
            by_depth = check_map(nested_loops, xs)
        with acrobat.config.override(ALIGN_WINDOW=2):
            aligned = check_map(nested_loops, xs)
        with acrobat.config.override(ALIGN_WINDOW=1):
            narrow = check_map(nested_loops, xs)
    names = "block:outer_step", "block:inner_step"
    assert [by_depth.batches_of(n) for n in names] == [4, 10]
    assert [aligned.batches_of(n) for n in names] == [2, 9]
    # A's first outer step is 2 levels beyond B's, out of reach; B's second (level 10)
    # joins A's at 11
    assert [narrow.batches_of(n) for n in names] == [3, 9]


@given(
    st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4), min_size=1, max_size=6),
    st.integers(0, 6),
)
def test_aligned_schedules_compute_what_eager_does(trip_lists, window):
    gen = torch.Generator().manual_seed(len(trip_lists))
    xs = [(torch.randn(8, generator=gen), tuple(t)) for t in trip_lists]
    with torch.no_grad(), acrobat.config.override(ALIGN_WINDOW=window, VERIFY=True):
        check_map(nested_loops, xs)


def test_type_keys_are_no_int_arguments():
    """A lazy tensor stands in a signature for its (shape, dtype) key, an int: keys must
    not be ints ops take. They counted down from -1, so ``x[-1]`` had the signature of
    ``x[i]`` for a lazy index ``i`` of the first interned (shape, dtype): after a map
    whose first input was an int64 vector of 3, a block's ``h[-1]`` of a (3, 8) tensor
    was inferred as a gather of rows, (3, 8) instead of (8,) (session 45)."""
    from acrobat import tensor

    shapes = [torch.Size([n]) for n in range(1, 40)]
    keys = [tensor.type_key(s, torch.int64) for s in shapes]
    assert all(k <= tensor._KEY_BASE for k in keys)
    assert all(k < -(1 << 58) for k in tensor._TYPE_KEYS.values())

    first = acrobat.autobatch(lambda t: t * 2)
    with torch.no_grad():
        first.map([torch.arange(3), torch.arange(4)])

    @acrobat.block
    def body(x):
        h = torch.tanh(x)
        return h[h[:, 0].argsort()][-1] + h[-2] + h[h[:, 1].argmax()]

    @acrobat.autobatch
    def last_rows(x):
        return body(x)

    xs = [torch.randn(n, 8) for n in (3, 2, 4, 3, 5)]
    with torch.no_grad():
        check_map(last_rows, xs)
