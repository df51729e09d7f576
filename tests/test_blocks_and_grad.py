"""@acrobat.block (traced once per signature, one node per call) and autograd through a
batched run (gradients equal the eager loop's)."""

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from tests.helpers import assert_close_tree, check_map, check_schedule


class Cell(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.emb = nn.Embedding(20, h)
        self.lin = nn.Linear(2 * h, 4 * h)
        self.out = nn.Linear(h, 3)


def node_cell(m, hl, cl, hr, cr):
    i, fl, fr, u = m.lin(torch.cat([hl, hr])).chunk(4)
    c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
    return torch.tanh(c), c


block_cell = acrobat.block(node_cell)


def make_encoder(cell):
    def state(t, m):
        if isinstance(t, int):
            x = m.emb(torch.tensor(t))
            return torch.tanh(x), x
        hl, cl = state(t[0], m)
        hr, cr = state(t[1], m)
        return cell(m, hl, cl, hr, cr)

    @acrobat.autobatch
    def encode(t, m):
        h, _ = state(t, m)
        return m.out(h)

    return encode


encode_plain = make_encoder(node_cell)
encode_block = make_encoder(block_cell)


def random_tree(rng, depth):
    if depth == 0 or rng.random() < 0.35:
        return rng.randrange(20)
    return (random_tree(rng, depth - 1), random_tree(rng, depth - 1))


def trees(n, seed=0):
    rng = random.Random(seed)
    return [random_tree(rng, 5) for _ in range(n)]


@pytest.mark.parametrize("encode", [encode_plain, encode_block], ids=["plain", "block"])
def test_tree_map_equals_eager(encode):
    m = Cell(6)
    with torch.no_grad():
        check_map(encode, trees(16), m=m)


def test_block_records_one_node_per_call_and_caches_its_trace():
    m = Cell(6)
    ts = trees(16)
    with torch.no_grad(), acrobat.config.override(AUTO_BLOCKS=False):
        _, plain = encode_plain.map(ts, stats=True, m=m)
    with torch.no_grad():
        _, blocked = encode_block.map(ts, stats=True, m=m)
        block_cell.cache.clear()
        _, again = encode_block.map(ts, stats=True, m=m)
    n_cells = plain.by_op["cat"][1]
    assert blocked.by_op["block:node_cell"][1] == n_cells
    assert blocked.nodes < plain.nodes - 8 * n_cells  # each call: 1 node instead of ~14
    assert len(block_cell.cache) == 1  # one signature (same shapes, same module)
    assert blocked.batches < plain.batches
    assert again.nodes == blocked.nodes


def test_block_sees_parameter_updates():
    m = Cell(4)
    ts = trees(6, seed=3)
    with torch.no_grad():
        before = encode_block.map(ts, m=m)
        m.lin.weight.mul_(0.5)  # in-place update bumps the version: a cached trace must see it
        after = encode_block.map(ts, m=m)
        want = [encode_block.eager(t, m=m) for t in ts]
    for a, w in zip(after, want):
        torch.testing.assert_close(a, w)
    assert any(not torch.allclose(a, b) for a, b in zip(after, before))


def test_block_with_hoisted_parameter_math_retraces_per_run():
    lin = nn.Linear(3, 3)

    @acrobat.block
    def cell(x):
        w = lin.weight.t() * 2  # parameter-only: hoisted inside the trace
        return x @ w

    @acrobat.autobatch
    def f(x):
        return cell(x)

    xs = [torch.randn(3) for _ in range(4)]
    with torch.no_grad():
        check_map(f, xs)
        lin.weight.add_(1.0)
        check_map(f, xs)


def test_block_errors():
    @acrobat.block
    def decides(x):
        return x * 2 if x.sum() > 0 else x

    @acrobat.autobatch
    def f(x):
        return decides(torch.tanh(x))

    with pytest.raises(acrobat.LazyValueError, match="block read a tensor value"):
        f.map([torch.randn(3)])

    captured = []

    @acrobat.block
    def closes_over(x):
        return x + captured[0]

    @acrobat.autobatch
    def g(x):
        captured[:] = [torch.sigmoid(x)]
        return closes_over(torch.tanh(x))

    with pytest.raises(acrobat.AcrobatError, match="did not receive as an argument"):
        g.map([torch.randn(3)])


def test_block_runs_eagerly_outside_map():
    m = Cell(3)
    h = torch.randn(3)
    got = block_cell(m, h, h, h, h)
    want = node_cell(m, h, h, h, h)
    torch.testing.assert_close(got[0], want[0])


def test_lstm_cell_module_inside_block_and_plain():
    cell = nn.LSTMCell(5, 7)

    @acrobat.autobatch
    def run(xs):
        h = c = torch.zeros(7)
        for x in xs:
            h, c = cell(x, (h, c))
        return h

    rng = random.Random(1)
    seqs = [[torch.randn(5) for _ in range(rng.randint(1, 5))] for _ in range(6)]
    with torch.no_grad():
        stats = check_map(run, seqs)
    assert stats.batches_of("rnn_cell") == 5  # one fused cell batch per time step


@pytest.mark.parametrize("encode", [encode_plain, encode_block], ids=["plain", "block"])
def test_gradients_match_eager(encode):
    torch.manual_seed(0)
    m = Cell(5)
    ts = trees(10, seed=7)
    targets = torch.randint(0, 3, (len(ts),))

    def loss_of(outs):
        logits = torch.stack(list(outs))
        return nn.functional.cross_entropy(logits, targets)

    m.zero_grad()
    loss_of(encode.map(ts, m=m)).backward()
    got = {k: p.grad.clone() for k, p in m.named_parameters()}
    m.zero_grad()
    loss_of([encode.eager(t, m=m) for t in ts]).backward()
    for k, p in m.named_parameters():
        torch.testing.assert_close(got[k], p.grad, atol=1e-5, rtol=1e-4, msg=k)


def test_training_steps_match_eager():
    torch.manual_seed(1)
    m1 = Cell(4)
    m2 = Cell(4)
    m2.load_state_dict(m1.state_dict())
    ts = trees(8, seed=11)
    targets = torch.randint(0, 3, (len(ts),))
    opt1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    for _ in range(3):
        for opt, outs in (
            (opt1, lambda: encode_block.map(ts, m=m1)),
            (opt2, lambda: [encode_block.eager(t, m=m2) for t in ts]),
        ):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(torch.stack(list(outs())), targets)
            loss.backward()
            opt.step()
    for (k, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=k)


def test_no_fiber_switches_without_value_demands():
    m = Cell(4)
    with torch.no_grad():
        _, stats = encode_block.map(trees(8), stats=True, m=m)
    check_schedule(stats, suspensions=0)
    assert stats.flushes == 1


def test_random_draw_inside_a_block_is_refused():
    @acrobat.block
    def noisy(x):
        return x + torch.randn(3)

    @acrobat.autobatch
    def f(x):
        return noisy(torch.tanh(x))

    with pytest.raises(acrobat.AcrobatError, match="randn inside a block"):
        f.map([torch.randn(3)])


def test_aliases_of_one_row_keep_their_own_dtype_inside_a_block():
    @acrobat.block
    def cell(x, y):
        a, b = x & y, torch.logical_and(x, y)  # one op row, two dtypes (int64, bool)
        return a, b.float() if b.dtype == torch.bool else b * 100

    @acrobat.autobatch
    def f(x, y):
        return cell(x + 0, y + 0)

    check_map_inputs = ([torch.tensor([1, 2, 3])], [torch.tensor([3, 1, 0])])
    got = f.map(*check_map_inputs)
    want = [f.eager(x, y) for x, y in zip(*check_map_inputs)]
    for g, w in zip(got, want):
        assert g[1].dtype == w[1].dtype == torch.float32
        torch.testing.assert_close(g[1], w[1])


rnn_step = acrobat.block(lambda m, x, h: torch.tanh(m.lin(torch.cat([x, h])))[: h.shape[0]])


@acrobat.autobatch
def run_steps(word_ids, m):
    h = torch.zeros(6)  # a new (hoisted) tensor every map, equal in value
    for w in word_ids:
        h = rnn_step(m, m.emb(torch.tensor(w)), h)
    return h


def test_block_called_with_a_factory_constant_traces_once_across_maps():
    m = Cell(6)
    xs = [[1, 2, 3], [4, 5], [6]]
    traced = []
    original = rnn_step._trace

    def counting(*args):
        traced.append(1)
        return original(*args)

    rnn_step._trace = counting
    try:
        with torch.no_grad():
            for _ in range(3):
                check_map(run_steps, xs, m=m)
    finally:
        del rnn_step._trace
    assert len(traced) == 2  # (x, zeros) and (x, h): once each, not once per map


def _all_traces(blk):
    return list(blk.cache.values())


@pytest.mark.parametrize("h", [1, 3, 5])
def test_generated_block_code_equals_the_interpreted_program(h):
    """Trace.run_ops runs generated straight-line code (acrobat/codegen.py); it must compute
    exactly what the op-by-op interpreter computes, and call torch directly for the ops
    it knows (linear, cat, chunk, elementwise) instead of their rules."""
    m = Cell(h)
    block_cell.cache.clear()
    with torch.no_grad():
        check_map(encode_block, trees(8, seed=h), m=m)
    (trace,) = _all_traces(block_cell)
    source = trace.compiled.source
    assert "linear(" in source and "torch.cat(" in source and ".chunk(4, 1)" in source
    assert "rule" not in source  # every op of node_cell has an emitter
    n = 5
    xs = [torch.randn(n, h) for _ in trace.placeholders]
    with acrobat.config.override(FAST_GEMM=False):  # one GEMM for both (no online trials)
        got = trace.run_ops(xs, n)
        want = trace.interpret(xs, n)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


mixed_block = acrobat.block(
    lambda x, y: (torch.softmax(x * 2.0 + y.sum(), 0), torch.stack([x, y]).amax(0), x.sum())
)


@acrobat.autobatch
def mixed(pair):
    return mixed_block(*pair)


def test_generated_code_calls_rules_for_ops_without_an_emitter():
    pairs = [(torch.randn(4), torch.randn(4)) for _ in range(5)]
    with torch.no_grad():
        check_map(mixed, pairs)
    (trace,) = _all_traces(mixed_block)
    assert "rule" in trace.compiled.source  # softmax, stack, reductions: their own rules
    n = 3
    inputs = [torch.randn(n, 4) for _ in trace.placeholders]
    for g, w in zip(trace.run_ops(inputs, n), trace.interpret(inputs, n)):
        assert torch.equal(g, w)


class Elman(nn.Module):
    def __init__(self, h, bias_h):
        super().__init__()
        self.wx = nn.Linear(h, h)
        self.wh = nn.Linear(h, h, bias=bias_h)


@acrobat.block
def elman_cell(m, x, h):
    return torch.tanh(m.wx(x) + m.wh(h))


@acrobat.block
def elman_reuse(m, x, h):
    u = m.wh(h)  # read twice: must be materialized
    return torch.tanh(m.wx(x) + u) * u


@acrobat.autobatch
def elman(xs, m, cell):
    h = torch.zeros(m.wh.in_features)
    for x in xs:
        h = cell(m, x, h)
    return h


@pytest.mark.parametrize("bias_h", [False, True])
@pytest.mark.parametrize("cell", [elman_cell, elman_reuse], ids=["once", "twice"])
def test_linear_plus_add_becomes_one_addmm(bias_h, cell):
    """Generated code fuses ``linear(h, W) + y`` (no bias, the linear read once) into
    ``addmm(y, h, W.t())``; with a bias or a second reader it keeps both ops."""
    torch.manual_seed(4)
    m = Elman(5, bias_h)
    cell.cache.clear()
    seqs = [list(torch.randn(k, 5)) for k in (3, 1, 4)]
    # the cell's own trace (a loop over a sequence would trace its body as a scan's)
    with torch.no_grad(), acrobat.config.override(AUTO_SCANS=False):
        check_map(elman, seqs, m=m, cell=cell)
    sources = [t.compiled.source for t in _all_traces(cell) if t.compiled is not None]
    fused = any("addmm(" in src or "addmm_tanh(" in src for src in sources)
    assert fused == (not bias_h and cell is elman_cell), sources


def test_a_code_generation_failure_falls_back_to_the_interpreter(monkeypatch):
    """Generated code is an optimisation: if it cannot be made, the program runs op by op
    (with a warning); under config.VERIFY (the tests' default) the failure raises."""
    from acrobat import codegen

    def broken(*args):
        raise ValueError("no emitter today")

    monkeypatch.setattr(codegen, "compile_program", broken)
    m = Cell(3)
    ts = trees(6, seed=7)
    block_cell.cache.clear()
    with torch.no_grad():
        with acrobat.config.override(VERIFY=False), pytest.warns(RuntimeWarning, match="op by op"):
            check_map(encode_block, ts, m=m)
        block_cell.cache.clear()
        with pytest.raises(acrobat.AcrobatError, match="no emitter today"):
            encode_block.map(ts, m=m)
    block_cell.cache.clear()


@acrobat.block
def mat_compose(W, A, B, C, how):
    if how == "two":
        return W @ torch.cat([A, B], dim=0)
    if how == "three":
        return torch.matmul(W, torch.cat([A, B, C], -2))
    X = torch.cat([A, B])  # read twice: the concatenation must exist
    return W @ X + X[:1].sum()


@acrobat.autobatch
def mat_tree(mats, W, how):
    A, B, C = mats
    return mat_compose(W, A, B, C, how)


@given(
    n=st.integers(1, 6),
    rows=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
    how=st.sampled_from(["two", "three", "reused"]),
    grad=st.booleans(),
)
@settings(max_examples=30, deadline=None)
def test_matmul_over_cat_is_split_into_bmm_and_baddbmm(n, rows, how, grad):
    """``W @ cat([A, B], 0)`` (cat read once) runs as ``W[:, :a] @ A + W[:, a:] @ B``
    without the concatenated batch: map == eager, gradients included."""
    g = torch.Generator().manual_seed(sum(rows) + n)
    cols = 3
    parts = rows if how == "three" else (rows[0], rows[1], rows[1])
    k = sum(parts) if how == "three" else parts[0] + parts[1]
    W = torch.randn(2, k, generator=g, requires_grad=grad)
    mats = [tuple(torch.randn(r, cols, generator=g) for r in parts) for _ in range(n)]
    mat_compose.cache.clear()
    with torch.set_grad_enabled(grad):
        got = mat_tree.map(mats, W=W, how=how)
        want = [mat_tree.eager(m, W=W, how=how) for m in mats]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        if grad:
            (gw,) = torch.autograd.grad(sum(o.sum() for o in got), W)
            (ww,) = torch.autograd.grad(sum(o.sum() for o in want), W)
            torch.testing.assert_close(gw, ww)
    sources = [t.compiled.source for t in _all_traces(mat_compose) if t.compiled is not None]
    assert any("torch.baddbmm(" in s for s in sources) == (how != "reused"), sources


def test_a_trace_made_for_one_tensor_passed_twice_serves_two_tensors():
    # cell(x, x) first, then cell(x, h): one trace (same shapes), two argument positions
    lin = torch.nn.Linear(4, 4)

    @acrobat.block
    def cell(x, h):
        return torch.tanh(lin(h) + x)

    @acrobat.autobatch
    def run(x):
        h = cell(x, x)
        for _ in range(3):
            h = cell(x, h)
        return h

    xs = [torch.randn(4, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    with torch.no_grad():
        check_map(run, xs)
    check_map(run, [x.requires_grad_() for x in xs])


@acrobat.block
def action_step(table, layer, a, h, first):
    x = F.embedding(a, table)
    return torch.tanh(layer(torch.cat([x, h] if first else [h, x])))


@acrobat.autobatch
def action_history(actions, h, table, layer, first):
    for a in actions:
        h = action_step(table, layer, torch.tensor(a), h, first)
    return h


@given(
    runs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=5),
    first=st.booleans(),
    bias=st.booleans(),
    grad=st.booleans(),
)
@settings(max_examples=30, deadline=None)
def test_linear_of_a_small_table_lookup_uses_the_tables_product(runs, first, bias, grad):
    """``linear(cat([embedding(a, E), h]), W, b)`` of a small table E runs as
    ``(E W_e^T + b)[a] + h W_h^T``: map == eager (gradients of E, W and b included), and
    an in-place change of E or W is seen by the next map."""
    g = torch.Generator().manual_seed(len(runs) + 7 * first + 3 * bias)
    table = torch.randn(4, 3, generator=g).requires_grad_(grad)
    layer = nn.Linear(3 + 5, 5, bias=bias)
    hs = [torch.randn(5, generator=g) for _ in runs]
    action_step.cache.clear()
    with torch.set_grad_enabled(grad):
        for _ in range(2):  # the second map: after the parameters changed in place
            got = action_history.map(runs, hs, table=table, layer=layer, first=first)
            want = [action_history.eager(r, h, table, layer, first) for r, h in zip(runs, hs)]
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
            if grad:
                params = [table, *layer.parameters()]
                got_g = torch.autograd.grad(sum(o.sum() for o in got), params)
                want_g = torch.autograd.grad(sum(o.sum() for o in want), params)
                for a, b in zip(got_g, want_g):
                    torch.testing.assert_close(a, b)
            with torch.no_grad():
                table.mul_(-0.5)
                layer.weight.add_(0.25)
    sources = [t.compiled.source for t in _all_traces(action_step) if t.compiled is not None]
    assert any("lookup_linear(" in s for s in sources), sources


def test_linear_of_a_large_table_lookup_is_left_as_written():
    """A table of more than ops.LOOKUP_ROWS rows is not multiplied out."""
    from acrobat import ops

    table = torch.randn(ops.LOOKUP_ROWS + 1, 3)
    layer = nn.Linear(8, 5)
    runs = [[1, ops.LOOKUP_ROWS], [0]]
    hs = [torch.randn(5) for _ in runs]
    action_step.cache.clear()
    with torch.no_grad():
        got = action_history.map(runs, hs, table=table, layer=layer, first=True)
        for g, r, h in zip(got, runs, hs):
            torch.testing.assert_close(g, action_history.eager(r, h, table, layer, True))
    sources = [t.compiled.source for t in _all_traces(action_step) if t.compiled is not None]
    assert sources and not any("lookup_linear(" in s for s in sources), sources


@acrobat.block
def squash_cell(m, x, h, reuse):
    a = m.wx(x)
    if reuse:  # the product read twice: it must exist, no epilogue
        return torch.tanh(a) * a
    return torch.tanh(a) + torch.tanh(m.wh(h) + x)


@acrobat.autobatch
def squash_chain(xs, m, reuse):
    h = torch.zeros(m.wh.in_features)
    for x in xs:
        h = squash_cell(m, x, h, reuse)
    return h


@given(
    lengths=st.lists(st.integers(2, 4), min_size=1, max_size=6),  # h lazy from step 2
    bias_h=st.booleans(),
    reuse=st.booleans(),
    grad=st.booleans(),
    backend=st.sampled_from(["kernel", "torch"]),
)
@settings(max_examples=30, deadline=None)
def test_tanh_of_a_product_is_one_kernel_call(lengths, bias_h, reuse, grad, backend):
    """``tanh(linear(x, W, b))`` and ``tanh(linear(h, W) + y)`` (the product read only by
    the tanh) are emitted as ``linear_tanh`` / ``addmm_tanh``: map == eager, gradients
    included, whichever GEMM the choice takes."""
    from acrobat import ops

    torch.manual_seed(len(lengths))
    m = Elman(5, bias_h)
    seqs = [list(torch.randn(k, 5)) for k in lengths]
    squash_cell.cache.clear()
    decided = dict(ops._GEMM_DECIDED)
    ops._GEMM_DECIDED.clear()
    for kind in ("linear_tanh", "addmm_tanh"):
        for rows in (1, 2, 4, 8):
            key = (kind, rows, torch.Size([5, 5]), torch.get_num_threads())
            if kind == "linear_tanh":
                key = (*key[:3], False, key[3])
            ops._GEMM_DECIDED[key] = backend
    try:
        with torch.set_grad_enabled(grad), acrobat.config.override(AUTO_SCANS=False):
            got = squash_chain.map(seqs, m=m, reuse=reuse)
            want = [squash_chain.eager(s, m, reuse) for s in seqs]
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
            if grad:
                params = list(m.wx.parameters() if reuse else m.parameters())  # (used ones)
                got_g = torch.autograd.grad(sum(o.sum() for o in got), params)
                want_g = torch.autograd.grad(sum(o.sum() for o in want), params)
                for a, b in zip(got_g, want_g):
                    torch.testing.assert_close(a, b)
    finally:
        ops._GEMM_DECIDED.clear()
        ops._GEMM_DECIDED.update(decided)
    sources = [t.compiled.source for t in _all_traces(squash_cell) if t.compiled is not None]
    assert any("linear_tanh(" in s for s in sources) == (not reuse), sources
    assert any("addmm_tanh(" in s for s in sources) == (not reuse and not bias_h), sources


# ---- torch's grad mode inside instances -------------------------------------------------


class _GradNet(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)


def _cell(net, h):  # straight-line: an automatic block outside a region, op by op inside
    return torch.tanh(net.b(h) * 2)


_explicit_cell = acrobat.block(_cell)


def _helper(net, h):
    return torch.sigmoid(net.a(h))


_helper_no_grad = torch.no_grad()(_helper)  # the decorator form


@acrobat.autobatch
def _regions(x, net, how):
    h = torch.tanh(net.a(x))
    if how == "plain":
        with torch.no_grad():
            t = _cell(net, h)  # from the instance's h and the parameters: no gradient
            float(t.sum())  # a read inside the region: the instance suspends there
    elif how == "explicit-block":
        with torch.no_grad():
            t = _explicit_cell(net, h)
    elif how == "decorator":
        t = _helper_no_grad(net, h)
    elif how == "function":  # the function form, and back
        torch.set_grad_enabled(False)
        t = net.b(h).exp()
        torch.set_grad_enabled(True)
    elif how == "nested":
        with torch.no_grad():
            t = net.b(h)
            with torch.enable_grad():  # the map's mode again, inside the region
                t = t + net.a(h)  # a's gradient flows through this term only
    elif how == "fork":
        with torch.no_grad():
            t = acrobat.fork(_cell, net, h).result()  # the child runs in the region
    elif how == "shared":  # parameters-only values are hoisted: once per mode
        with torch.no_grad():
            w2 = net.b.weight * 2
        t = h @ w2 + h @ (net.b.weight * 2)
    else:
        t = torch.zeros_like(h)
    if int(x[0] > 0):  # the instances diverge after the region: their fibers too
        h = h * 2
    return (h * t).sum(), t


_HOWS = ["plain", "explicit-block", "decorator", "function", "nested", "fork", "shared"]


@settings(max_examples=12, deadline=None)
@given(
    how=st.lists(st.sampled_from([*_HOWS, "none"]), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_no_grad_inside_instances_is_eager_no_grad(how, seed):
    """``torch.no_grad()`` (and enable_grad, set_grad_enabled, the decorator) inside
    instance code: values and gradients as the eager loop's, each instance in its own
    mode whatever the others do (reads, forks and blocks inside the region), the results
    made inside without ``grad_fn`` as eager's; the caller's mode intact after."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = _GradNet()
    xs = [torch.randn(4, generator=g) for _ in how]

    def loss(outs):
        return sum(o[0] for o in outs)

    net.zero_grad(set_to_none=True)
    batched = _regions_many.map(xs, how, net=net)  # each instance its own kind of region
    loss(batched).backward()
    grads = lambda: {k: p.grad for k, p in net.named_parameters()}
    got_grads = grads()
    net.zero_grad(set_to_none=True)
    eager = [_regions.eager(x, net, h) for x, h in zip(xs, how)]
    loss(eager).backward()
    want_grads = grads()
    assert torch.is_grad_enabled()
    for i, (b, e) in enumerate(zip(batched, eager)):
        assert_close_tree(b, e, 1e-5, 1e-5, path=f"instance {i}")
        assert b[1].requires_grad == e[1].requires_grad, (how[i], b[1], e[1])
    for k in want_grads:  # (None: no gradient reached the parameter, in both)
        if want_grads[k] is None or got_grads[k] is None:
            assert got_grads[k] is want_grads[k], k
        else:
            torch.testing.assert_close(got_grads[k], want_grads[k], atol=1e-5, rtol=1e-5, msg=k)


@acrobat.autobatch
def _regions_many(x, how, net):
    return _regions(x, net, how)


def test_a_map_without_gradients_with_enable_grad_inside():
    """``torch.enable_grad()`` inside an instance of a map called under ``no_grad``: that
    instance's results carry gradients, as eager's do, and backward through them gives
    eager's gradients."""
    torch.manual_seed(0)
    net = _GradNet()

    @acrobat.autobatch
    def f(x, net):
        h = net.a(x)
        with torch.enable_grad():
            y = torch.tanh(net.b(h)).sum()
        return y, h

    xs = [torch.randn(4) for _ in range(3)]
    with torch.no_grad():
        got = f.map(xs, net=net)
        want = [f.eager(x, net) for x in xs]
        assert not torch.is_grad_enabled()
    for (gy, gh), (wy, _) in zip(got, want):
        assert gy.requires_grad and wy.requires_grad and not gh.requires_grad
        torch.testing.assert_close(gy, wy)
    (gb,) = torch.autograd.grad(sum(y for y, _ in got), net.b.weight)
    (wb,) = torch.autograd.grad(sum(y for y, _ in want), net.b.weight)
    torch.testing.assert_close(gb, wb)


def test_grad_mode_switches_that_stay_refused():
    """``torch.inference_mode()`` inside an instance of a map with gradients on (its
    tensors could never join the batch's autograd graph), and a switch inside a block's
    body (a block is traced once and replayed): clear errors naming the line; torch's own
    switches pass; the caller's mode intact."""
    w = torch.randn(3, requires_grad=True)
    xs = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-1.0, 0.5, 2.0])]

    @acrobat.autobatch
    def inference(x, w):
        with torch.inference_mode():
            return x * w

    @acrobat.block
    def cell(x, w):
        with torch.no_grad():
            return x * w

    @acrobat.autobatch
    def in_block(x, w):
        return cell(x, w) + x

    @acrobat.autobatch
    def torch_switches(x, w, buf):
        torch.nn.init.zeros_(buf)  # torch's own no_grad around work recording nothing
        return x * w + buf

    with pytest.raises(acrobat.AcrobatError, match=r"inference_mode.*test_blocks"):
        inference.map(xs, w=w)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    with torch.inference_mode():
        check_map(inference, xs, w=w)
    with pytest.raises(acrobat.AcrobatError, match="inside a block"):
        in_block.map(xs, w=w)
    assert torch.is_grad_enabled()
    buf = torch.ones(3)
    got = torch_switches.map(xs, w=w, buf=buf)
    assert all(g.requires_grad for g in got) and not buf.any()
    check_map(torch_switches, xs, w=w, buf=buf)


# ---- autocast --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["treelstm", "birnn", "drnn"])
@pytest.mark.parametrize("blocks", [False, True], ids=["plain", "blocks"])
def test_a_map_under_autocast_is_eager_under_autocast(name, blocks):
    """Under torch.autocast the batches run torch's kernels, which autocast casts, and the
    recorded dtypes are autocast's (inferred on the device): the outputs have eager's
    dtypes and, within bfloat16's rounding, its values. Traces made outside autocast are
    not reused inside it, nor the other way round."""
    import importlib

    from models.common import outputs_close, run_eager

    task = importlib.import_module(f"models.{name}").make_task("small", 4, blocks=blocks)
    with torch.no_grad():
        plain = task.fn.map(task.inputs, **task.kwargs)  # (traces made without autocast)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = task.fn.map(task.inputs, **task.kwargs)
            want = run_eager(task)
        again = task.fn.map(task.inputs, **task.kwargs)
    leaves = lambda tree: [t for t in _flat(tree) if isinstance(t, torch.Tensor)]
    assert [t.dtype for t in leaves(got)] == [t.dtype for t in leaves(want)]
    assert any(t.dtype == torch.bfloat16 for t in leaves(got))
    check = outputs_close(
        [t.float() for t in leaves(got)], [t.float() for t in leaves(want)], atol=0.05, rtol=0.05
    )
    assert check, check.message
    assert [t.dtype for t in leaves(again)] == [t.dtype for t in leaves(plain)]


def _flat(tree):
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in _flat(item)]
    return [tree]


def test_switching_autocast_inside_an_instance_is_refused():
    @acrobat.autobatch
    def f(x, lin):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lin(x)

    lin = nn.Linear(3, 2)
    xs = [torch.randn(3) for _ in range(2)]
    with pytest.raises(acrobat.AcrobatError, match="autocast switched"):
        f.map(xs, lin=lin)
    assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the map's own autocast: fine
        got = f.map(xs, lin=lin)
        want = [f.eager(x, lin) for x in xs]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.bfloat16
        torch.testing.assert_close(g, w)


# ---- requires_grad / is_leaf of lazy tensors ---------------------------------------------

_TRAINED, _FROZEN = nn.Linear(3, 3), nn.Linear(3, 3).requires_grad_(False)


@acrobat.block
def _pair(a, b):  # a block whose outputs differ: one reads a parameter, one does not
    return a * 2, torch.tanh(_TRAINED(b))


def _interpret(x, y, program):
    """Runs ``program`` (steps over a list of values, starting from the arguments) and
    returns every value's ``requires_grad`` and ``is_leaf``."""
    values = [x, y]
    for step in program:
        kind, i, j = step
        a, b = values[i % len(values)], values[j % len(values)]
        if kind == "trained":
            values.append(_TRAINED(a))
        elif kind == "frozen":
            values.append(_FROZEN(a))
        elif kind == "mul":
            values.append(a * b)
        elif kind == "detach":
            values.append(a.detach())
        elif kind == "compare":
            values.append((a > 0).float())
        elif kind == "block":
            values.extend(_pair(a, b))
        elif kind == "no_grad":
            with torch.no_grad():
                values.append(_TRAINED(a) + b)
        elif kind == "enable_grad":
            with torch.enable_grad():
                values.append(_TRAINED(a) * b)
        elif kind == "parameter":
            values.append(a + _TRAINED.weight[0])
    return [(v.requires_grad, v.is_leaf) for v in values]


_interpret_map = acrobat.autobatch(_interpret)
_STEPS = ["trained", "frozen", "mul", "detach", "compare", "block", "no_grad", "enable_grad",
          "parameter"]  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    programs=st.lists(
        st.lists(
            st.tuples(st.sampled_from(_STEPS), st.integers(0, 20), st.integers(0, 20)),
            max_size=8,
        ),
        min_size=1,
        max_size=4,
    ),
    grads=st.lists(st.booleans(), min_size=4, max_size=4),
    mode=st.booleans(),
)
def test_requires_grad_and_is_leaf_are_eagers(programs, grads, mode):
    """``x.requires_grad`` / ``x.is_leaf`` of lazy tensors answer as eager's, from the
    graph (no value read): arguments that require grad or not, trained and frozen
    parameters, detach, comparisons, a block with one grad and one non-grad output, grad
    regions, parameter rows, in a map with gradients on or off."""
    xs = [torch.randn(3, requires_grad=g) for g in grads[: len(programs)]]
    ys = [torch.randn(3, requires_grad=g) for g in grads[::-1][: len(programs)]]
    with torch.set_grad_enabled(mode):
        got, stats = _interpret_map.map(xs, ys, programs, stats=True)
        want = [_interpret(x, y, p) for x, y, p in zip(xs, ys, programs)]
    assert got == want
    assert stats.suspensions == 0  # (nothing was read)


def test_requires_grad_inside_a_block():
    """Inside a block body (traced once, replayed for calls whose operands differ) the
    question is refused like a value read: an explicit block raises naming the line, an
    automatic one records its function op by op and answers as eager."""

    def auto(x):  # straight-line: an automatic block
        y = _TRAINED(x)
        return y * float(y.requires_grad)

    @acrobat.autobatch
    def f(x):
        return auto(x) + 1

    @acrobat.block
    def explicit(x):
        return x * float(x.requires_grad)  # asked-here

    @acrobat.autobatch
    def g(x):
        return explicit(x)

    xs = [torch.randn(3), torch.randn(3, requires_grad=True)]
    check_map(f, xs)
    with pytest.raises(acrobat.LazyValueError, match=r"requires_grad.*asked-here"):
        g.map(xs)


def test_grad_fn_is_none_where_eagers_is_and_refused_elsewhere():
    @acrobat.autobatch
    def f(x):
        leaf = x.grad_fn is None  # an argument: a leaf
        plain = (x * 2).detach().grad_fn is None
        try:
            _ = _TRAINED(x).grad_fn  # asked-here
        except acrobat.UnsupportedOpError as e:
            assert "asked-here" in str(e) and "requires grad" in str(e)
            return torch.tensor(float(leaf and plain))
        return torch.tensor(-1.0)

    got = f.map([torch.randn(3), torch.randn(3)])
    assert [float(g) for g in got] == [1.0, 1.0]


class _Prefixed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.cls = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.cat([self.cls.unsqueeze(0), x]).sum(0)


@pytest.mark.parametrize("pad", [False, True])
def test_training_after_a_map_without_autograd(pad):
    """A block whose trace reads a value hoisted earlier in the same map (the second
    shape's trace reads ``cls.unsqueeze(0)``, made by the first's): traced under
    ``no_grad``, that value is a view of a parameter without autograd history. The trace
    did not know it read it (only the trace that made it did), so later maps that train
    reused it and ``cls`` got no gradient from those instances (6.19 off of eager's)."""
    model = _Prefixed()
    f = acrobat.autobatch(model)
    data = [torch.randn(n, 4) for n in (2, 3, 3, 5)]
    with acrobat.config.override(PAD_RAGGED=pad):
        with torch.no_grad():
            f.map(data)
        out = f.map(data)
        torch.stack([o.square().sum() for o in out]).sum().backward()
    got = model.cls.grad.clone()
    model.cls.grad = None
    torch.stack([model(x).square().sum() for x in data]).sum().backward()
    torch.testing.assert_close(got, model.cls.grad)


def test_a_view_of_a_parameter_hoisted_without_autograd_is_not_retraced():
    """``cls.unsqueeze(0)`` under no_grad requires grad (a view of a parameter) but has no
    autograd graph that a later map could find stale: the traces holding it are reused
    (they were traced again in every map: 23.3 against 11.2 ms for a transformer
    classifier over 64 sentences)."""
    from acrobat import analysis

    model = _Prefixed()
    f = acrobat.autobatch(model)
    data = [torch.randn(n, 4) for n in (2, 3, 3, 5)]
    with torch.no_grad():
        f.map(data)
        block = analysis._DISPATCHERS[analysis._code_key(_Prefixed.forward)].block
        first = {k: id(t) for k, t in block.cache.items()}
        f.map(data)
        assert {k: id(t) for k, t in block.cache.items()} == first
