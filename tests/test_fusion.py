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
    with torch.no_grad(), acrobat.config.override(KERNEL_BACKEND="online"):
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


# ---- the CPU path: the region as one kernel call inside the block's generated code ----


def _fused_code(trace, backend="numba"):
    return trace.compiled_fused[backend].source


def test_cpu_block_code_calls_the_kernel_once_reading_the_gates_by_columns():
    rng = random.Random(5)
    trees = [random_tree(rng, 3) for _ in range(6)]
    with torch.no_grad(), acrobat.config.override(KERNEL_BACKEND="numba"):
        stats = check_map(encode, trees)
    (trace,) = cell.cache.values()
    source = _fused_code(trace)
    assert source.count("fused_call(") == 1
    assert ".chunk(" not in source  # the five gates: one matrix, read by columns
    assert "sigmoid" not in source and "tanh" not in source
    assert stats.gathers_fused == 0  # on the CPU the executor gathers the operands


def test_cpu_block_code_falls_back_where_the_kernel_declines():
    rng = random.Random(6)
    trees = [random_tree(rng, 3) for _ in range(5)]
    with torch.no_grad(), acrobat.config.override(KERNEL_BACKEND="numba"):
        encode.map(trees)
        (trace,) = cell.cache.values()
        declined = []

        def make_call(layout):
            return lambda n, *args: declined.append(n)  # None: "cannot read these"

        trace.compiled_fused["numba"] = trace._generate((trace.fusion, make_call, trace.run_ops))
        check_map(encode, trees)
    assert declined


def test_default_runs_the_cpu_kernel_once_compiled():
    rng = random.Random(7)
    trees = [random_tree(rng, 3) for _ in range(6)]
    with torch.no_grad(), acrobat.config.override(KERNEL_BACKEND="auto"):
        check_map(encode, trees)  # the kernels compile in the background meanwhile
        fusion.wait_compiled()
        check_map(encode, trees)
    (trace,) = cell.cache.values()
    assert "numba" in trace.compiled_fused


UNARY = ["sigmoid", "tanh", "relu", "neg", "exp", "abs"]
BINARY = ["add", "sub", "mul", "maximum"]


def random_tail(rng: random.Random, chunks: int):
    """A block: a linear layer's output cut into ``chunks`` gates, a random elementwise
    program over them, a per-instance state, a shared vector and numbers, then one more
    linear layer over one of its values (an op after the region)."""
    steps = []
    n_values = chunks + 1  # the gates, then the state
    for _ in range(rng.randint(3, 8)):
        if rng.random() < 0.45:
            steps.append((rng.choice(UNARY), rng.randrange(n_values)))
        else:
            other = rng.choice(["value", "value", "shared", "number"])
            b = rng.randrange(n_values) if other == "value" else other
            steps.append((rng.choice(BINARY), rng.randrange(n_values), b))
        n_values += 1
    out_a, out_b = rng.randrange(chunks + 1, n_values), n_values - 1
    return steps, out_a, out_b


def tail_block(layer, head, shared, chunks, steps, out_a, out_b):
    def tail(x, state):
        values = [*layer(x).chunk(chunks, -1), state]
        for op, a, *rest in steps:
            if not rest:
                v = values[a]
                v = torch.exp(torch.clamp(v, max=5.0)) if op == "exp" else getattr(torch, op)(v)
            else:
                b = rest[0]
                if b == "number" and op == "maximum":  # (torch.maximum takes tensors)
                    b = "shared"
                b = shared if b == "shared" else 0.75 if b == "number" else values[b]
                v = getattr(torch, op)(values[a], b)
            values.append(v)
        return head(values[out_a]), values[out_b]

    return acrobat.block(tail)


@settings(max_examples=12)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 9), rows=st.sampled_from([None, 2]))
def test_random_block_tails_match_eager_with_the_cpu_kernel(seed, n, rows):
    """Random elementwise tails over a GEMM's chunks, a state and shared operands, per
    instance a vector or a (rows, H) matrix, fused by the CPU path: map == eager."""
    rng = random.Random(seed)
    chunks = rng.randint(1, 4)
    steps, out_a, out_b = random_tail(rng, chunks)
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(H, chunks * H)
    head = nn.Linear(H, 3)
    shared = torch.randn(H, generator=gen)
    block = tail_block(layer, head, shared, chunks, steps, out_a, out_b)

    @acrobat.autobatch
    def f(x):
        a, b = block(x, torch.sigmoid(x))
        return a, b * 2.0

    shape = (H,) if rows is None else (rows, H)
    xs = [torch.randn(shape, generator=gen) for _ in range(n)]
    with torch.no_grad(), acrobat.config.override(KERNEL_BACKEND="numba"):
        check_map(f, xs, atol=1e-4, rtol=1e-4)
        check_map(f, xs, atol=1e-4, rtol=1e-4)
    (trace,) = block.cache.values()
    if rows is None:  # (a shared vector does not broadcast into a fused (rows, H) region)
        assert trace.fusion is not None
    assert trace.fusion is None or "numba" in trace.compiled_fused  # the region ran fused


@pytest.mark.parametrize(
    "name", ["treelstm", "mvrnn", "birnn", "nestedrnn", "drnn", "berxit", "stackrnn"]
)
def test_models_plain_code_match_eager_with_the_cpu_kernel(name):
    import importlib

    from models.common import outputs_close, run_eager

    task = importlib.import_module(f"models.{name}").make_task("small", 6, blocks=False)
    with torch.no_grad(), acrobat.config.override(KERNEL_BACKEND="numba"):
        want = run_eager(task)
        for _ in range(2):
            check = outputs_close(task.fn.map(task.inputs, **task.kwargs), want, 1e-4, 1e-4)
            assert check, check.message


def test_long_elementwise_chains_fuse_a_bounded_prefix():
    layer = nn.Linear(H, H)

    @acrobat.block
    def chain(x):
        y = layer(x)
        for k in range(fusion.MAX_REGION + 10):  # unrolled when traced: one op each
            y = torch.tanh(y) * 0.9 + 0.01 * k if k % 2 else torch.sigmoid(y) - 0.5
        return y

    @acrobat.autobatch
    def f(x):
        return chain(x)

    xs = [torch.randn(H) for _ in range(5)]
    with torch.no_grad(), acrobat.config.override(KERNEL_BACKEND="numba"):
        check_map(f, xs, atol=1e-4, rtol=1e-4)
    (trace,) = chain.cache.values()
    plan = trace.fusion
    assert len(plan.members) == fusion.MAX_REGION and plan.after  # the rest: op by op
    assert "numba" in trace.compiled_fused


lstm_x = nn.Linear(H, 4 * H)
lstm_h = nn.Linear(H, 4 * H, bias=False)


@acrobat.autobatch
def lstm_over(words):
    """An LSTM written inline in a loop over the tokens: one scan node per instance whose
    steps run the cell's elementwise region as one kernel call."""
    h, c = torch.zeros(H), torch.zeros(H)
    for w in words:
        i, f, g, o = (lstm_x(emb(torch.tensor(w))) + lstm_h(h)).chunk(4)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


@settings(max_examples=8)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 7))
def test_loop_steps_run_the_fused_region(seed, n):
    import gc

    from acrobat.scan import Scan

    rng = random.Random(seed)
    sentences = [[rng.randrange(10) for _ in range(rng.randint(1, 6))] for _ in range(n)]
    with torch.no_grad(), acrobat.config.override(KERNEL_BACKEND="numba"):
        check_map(lstm_over, sentences)
    scans = [o for o in gc.get_objects() if type(o) is Scan and "lstm_over" in o.op.name]
    assert scans
    for scan in scans:  # the step (the split's rest, or the whole body) ran fused
        step = scan.split.var if scan.split is not None else scan.trace
        assert "numba" in step.compiled_fused


w_x = nn.Linear(H, H)
w_h = nn.Linear(H, H, bias=False)


@acrobat.block
def forget_gate(x, h, c, c_k):
    """``W x + U h`` (a pair the executor gathers as one buffer ``[x, h]`` for one GEMM)
    read by the elementwise region: the fused program is given the joined buffer."""
    f = torch.sigmoid(w_x(x) + w_h(h))
    return c + f * c_k


@acrobat.autobatch
def forget_chain(x, hs, cs):
    c = torch.zeros(H)
    for h, c_k in zip(hs, cs):
        c = forget_gate(x, h, c, c_k)
    return c


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 12))
def test_a_joined_pair_read_by_the_fused_region_matches_eager(seed, n):
    """The op-by-op program (first map, the kernel compiling) sets the op's joins; the
    fused program, once compiled, got ``[x, h]`` joined and read None for ``h``'s product
    (an AcrobatError, "please report this as an acrobat bug"): it runs op by op then."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    xs = [torch.randn(H, generator=gen) for _ in range(n)]
    hs = [[torch.randn(H, generator=gen) for _ in range(rng.randint(1, 3))] for _ in xs]
    cs = [[torch.randn(H, generator=gen) for _ in h] for h in hs]
    with torch.no_grad(), acrobat.config.override(KERNEL_BACKEND="auto"):
        want = [forget_chain.eager(*args) for args in zip(xs, hs, cs)]
        for _ in range(2):
            torch.testing.assert_close(forget_chain.map(xs, hs, cs), want)
            fusion.wait_compiled()
    assert any("numba" in trace.compiled_fused for trace in forget_gate.cache.values())
