"""Tensor-dependent control flow: value demands suspend an instance's fiber, the pending
graph runs batched across all suspended instances, fork-join runs children concurrently."""

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import acrobat
from tests.helpers import assert_close_tree, check_map, check_schedule

torch.manual_seed(0)
W = torch.randn(6, 6) / 3
U = torch.randn(6, 6) / 3


@acrobat.autobatch
def until_small(x, limit):
    """A data-dependent while loop: iterate until the norm drops below a threshold."""
    steps = 0
    while float((x * x).sum()) > 0.5 and steps < limit:
        x = torch.tanh(x @ W) * 0.9
        steps += 1
    return x, steps


def test_while_loop_on_values_batches_across_instances():
    xs = [torch.randn(6) * s for s in (0.1, 1, 2, 3, 4, 5)]
    with torch.no_grad():
        stats = check_map(until_small, xs, limit=30)
    # every round: all live instances' steps in one batch per op, one flush per round
    longest = max(until_small.eager(x, limit=30)[1] for x in xs)
    assert stats.flushes <= longest + 2
    assert stats.batches_of("matmul") <= longest
    assert stats.suspensions >= len(xs)


@acrobat.autobatch
def branchy(x):
    h = torch.sigmoid(x @ W)
    if bool(h.sum() > 3.0):
        h = torch.tanh(h @ U)
    else:
        h = h * 2 - 1
    n = int((h > 0).sum())
    for _ in range(n % 3):
        h = h + torch.relu(h @ W)
    return h, n, h.argmax().item(), h.tolist()


def test_item_int_bool_tolist():
    xs = [torch.randn(6) for _ in range(10)]
    with torch.no_grad():
        check_map(branchy, xs)


def drnn_like(h, depth):
    """Generate a tree top-down: children only if the node's own value says so."""
    p = torch.sigmoid(h.sum())
    out = [torch.tanh(h)]
    if depth < 3 and p.item() > 0.4:
        left = acrobat.fork(drnn_like, torch.tanh(h @ W), depth + 1)
        right = acrobat.fork(drnn_like, torch.tanh(h @ U), depth + 1)
        out += left.result() + right.result()
    return out


generate = acrobat.autobatch(drnn_like)


def test_fork_join_generates_identical_trees_and_batches_siblings():
    hs = [torch.randn(6) for _ in range(12)]
    with torch.no_grad():
        got, stats = generate.map(hs, [0] * len(hs), stats=True)
        want = [generate.eager(h, 0) for h in hs]
    for g, w in zip(got, want):
        assert_close_tree(g, w)
    # sibling subtrees of different instances batch together: far fewer batches than nodes
    assert stats.nodes > 4 * stats.batches


def test_concurrent_returns_results_in_order():
    @acrobat.autobatch
    def f(x):
        a, b, c = acrobat.concurrent(
            lambda: torch.tanh(x).sum().item(),
            lambda: torch.sigmoid(x),
            lambda: 7,
        )
        return b * a, c

    with torch.no_grad():
        check_map(f, [torch.randn(4) for _ in range(5)])


def test_fork_eager_outside_map():
    fut = acrobat.fork(lambda a: a + 1, 1)
    assert fut.done() and fut.result() == 2


def test_several_fibers_join_one_future():
    """A future joined by its parent and by a sibling fiber wakes both, in order, with the
    child's value; done() once the child has returned."""

    @acrobat.autobatch
    def f(x):
        shared = acrobat.fork(lambda: torch.tanh(x).sum().item())  # suspends on a value
        other = acrobat.fork(lambda: shared.result() * 2)  # a second joiner
        v = shared.result()
        assert shared.done()
        return x * v, other.result()

    with torch.no_grad():
        check_map(f, [torch.randn(4) for _ in range(5)])


def test_deadlock_through_fork_is_detected():
    @acrobat.autobatch
    def f(x):
        box = {}

        def child():
            return box["parent"].result()  # waits for a future that waits for it

        box["parent"] = acrobat.fork(lambda: box["child"].result())
        box["child"] = acrobat.fork(child)
        return box["parent"].result()

    with pytest.raises(acrobat.AcrobatError, match="deadlock") as err:
        f.map([torch.randn(2)])
    # names where the instance's code waits: the user's line, read from the greenlet
    assert "test_fibers.py" in str(err.value) and ".result()" in str(err.value)


def test_exception_in_suspended_world_cleans_up():
    @acrobat.autobatch
    def f(x, bad):
        v = torch.tanh(x).sum().item()
        if bad:
            raise ValueError("instance failed after a demand")
        return x * v

    with pytest.raises(ValueError) as err:
        f.map([torch.randn(3) for _ in range(4)], [False, False, True, False])
    assert any("instance 2" in n for n in err.value.__notes__)
    xs = [torch.randn(3) for _ in range(3)]
    with torch.no_grad():
        got = f.map(xs, [False] * 3)  # usable again, and correct
        want = [f.eager(x, False) for x in xs]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_phases_wait_for_all_instances():
    @acrobat.autobatch
    def f(x):
        steps = []
        h = x
        while h.sum().item() > -1 and len(steps) < 4:
            h = h - 0.7
            steps.append(h)
        with acrobat.phase("out"):
            return [torch.sigmoid(s) for s in steps]

    xs = [torch.full((3,), float(v)) for v in (0.1, 0.5, 1.0, 2.0)]
    with torch.no_grad():
        stats = check_map(f, xs)
    assert stats.batches_of("sigmoid") == 1  # all instances' outputs, one batch


@acrobat.autobatch
def shift_reduce(x, steps):
    """A parser's loop: one branch of the ``if`` does an extra op before the shared tail,
    and every round ends in a value demand."""
    h, taken = x, []
    for _ in range(steps):
        go = bool(h.sum() > 0)
        taken.append(go)
        if go:
            h = torch.tanh(h @ U)  # the longer branch
        h = torch.sigmoid(h @ W) - 0.5  # both branches: one batch per round if levelled late
    return h, taken


@pytest.mark.parametrize("relevel", [True, False])
def test_demand_flushes_level_late_so_branches_line_up(relevel):
    xs = [torch.randn(6, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    with torch.no_grad(), acrobat.config.override(RELEVEL=relevel, ALIGN_WINDOW=0):
        stats = check_map(shift_reduce, xs, steps=6)
    decisions = [shift_reduce.eager(x, steps=6)[1] for x in xs]
    mixed = [len({d[i] for d in decisions}) > 1 for i in range(6)]
    assert any(mixed[:5])  # both branches taken in some round, else nothing to show
    # sigmoid runs once per round; a round where the branches differ costs a second batch
    # under depth levelling (the shorter branch reaches sigmoid a level early), and under
    # late levelling only in the last round (it runs in the map's final flush, by depth)
    expected = 6 + (mixed[5] if relevel else sum(mixed))
    # (the line is a region, one block node: analysis.OPERATORS counts its - and @)
    lines, start = inspect.getsourcelines(shift_reduce.fn)
    line = start + next(i for i, text in enumerate(lines) if "h = torch.sigmoid(" in text)
    tail = [
        batches
        for name, (batches, _) in stats.by_op.items()
        if name == "sigmoid" or name == f"block:shift_reduce (test_fibers.py, line {line})"
    ]
    assert tail == [expected], stats.by_op


@acrobat.block
def context_cell(h, context):
    return torch.tanh(h @ W + context @ U)


@acrobat.autobatch
def empty_or_not(x, steps):
    """Each round reads either a per-instance context or a shared ``torch.zeros``, chosen by
    a value (a parser's step on a full vs. an empty buffer): two traces of one block."""
    empty = torch.zeros(6)
    h, taken = x, []
    for _ in range(steps):
        full = bool(h.sum() > 0)
        taken.append(full)
        h = context_cell(h, torch.sigmoid(h) if full else empty)
    return h, taken


@pytest.mark.parametrize("merge", [True, False])
def test_a_block_given_a_shared_constant_joins_the_batch_given_tensors(merge):
    xs = [torch.randn(6, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    with torch.no_grad(), acrobat.config.override(MERGE_LIFTED=merge):
        stats = check_map(empty_or_not, xs, steps=6)
    decisions = [empty_or_not.eager(x, steps=6)[1] for x in xs]
    mixed = sum(len({d[i] for d in decisions}) > 1 for i in range(6))
    assert mixed >= 2  # rounds with both kinds of step, else nothing to show
    # merged: one batch per round; apart, a second one in every mixed round but the last
    # (it runs in the map's final flush, levelled by depth, where the two are not level)
    last_mixed = len({d[5] for d in decisions}) > 1
    assert stats.batches_of("block:context_cell") == (6 + last_mixed if merge else 6 + mixed)


def test_merged_constant_batches_train_like_eager():
    w, u = W.clone().requires_grad_(), U.clone().requires_grad_()

    @acrobat.block
    def cell(h, context):
        return torch.tanh(h @ w + context @ u)

    @acrobat.autobatch
    def f(x):
        empty = torch.zeros(6)
        h = x
        for _ in range(5):
            h = cell(h, torch.sigmoid(h) if bool(h.sum() > 0) else empty)
        return h

    xs = [torch.randn(6, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    xs = [x.requires_grad_() for x in xs]
    hs, stats = f.map(xs, stats=True)
    assert stats.batches_of("block:cell") <= 6  # merged: a round's steps in one batch
    got = torch.autograd.grad(sum(h.sum() for h in hs), [w, u, *xs])
    want = torch.autograd.grad(sum(f.eager(x).sum() for x in xs), [w, u, *xs])
    assert_close_tree(list(got), list(want))


@settings(max_examples=15, deadline=None)
@given(seeds=st.lists(st.integers(0, 2**16), min_size=1, max_size=6), steps=st.integers(1, 5))
def test_merged_constant_batches_match_eager(seeds, steps):
    xs = [torch.randn(6, generator=torch.Generator().manual_seed(s)) for s in seeds]
    with torch.no_grad():
        check_map(empty_or_not, xs, steps=steps)


# ---- hypothesis: random branching programs ------------------------------------------

OPS = [
    lambda h: torch.tanh(h @ W),
    lambda h: torch.sigmoid(h @ U) - 0.5,
    lambda h: h * 0.5 + 0.1,
    lambda h: torch.relu(h) - h.mean(),
]


@st.composite
def programs(draw):
    """A program is a list of steps: ('op', k) | ('if', k_then, k_else, threshold) |
    ('while', k, threshold, cap) | ('fork', k1, k2)."""
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["op", "if", "while", "fork"]))
        k = draw(st.integers(0, len(OPS) - 1))
        k2 = draw(st.integers(0, len(OPS) - 1))
        thr = draw(st.floats(-1.0, 1.0, allow_subnormal=False))
        steps.append((kind, k, k2, thr, draw(st.integers(1, 4))))
    return steps


def interpret(program, h, trace):
    for kind, k, k2, thr, cap in program:
        if kind == "op":
            h = OPS[k](h)
        elif kind == "if":
            taken = h.sum().item() > thr
            trace.append(taken)
            h = OPS[k](h) if taken else OPS[k2](h)
        elif kind == "while":
            n = 0
            while float(h.mean()) > thr / 4 and n < cap:
                h = OPS[k](h)
                n += 1
            trace.append(n)
        else:
            a = acrobat.fork(OPS[k], h)
            b = acrobat.fork(OPS[k2], h)
            h = a.result() + b.result()
    return h


@acrobat.autobatch
def run_program(h, program):
    trace = []
    out = interpret(program, h, trace)
    return out, trace


@given(programs(), st.integers(1, 8), st.integers(0, 1000))
def test_random_branching_programs(program, n, seed):
    g = torch.Generator().manual_seed(seed)
    hs = [torch.randn(6, generator=g) for _ in range(n)]
    with torch.no_grad():
        got = run_program.map(hs, program=program)
        want = [run_program.eager(h, program=program) for h in hs]
    for (g_out, g_trace), (w_out, w_trace) in zip(got, want):
        assert g_trace == w_trace  # identical control decisions
        torch.testing.assert_close(g_out, w_out, atol=1e-5, rtol=1e-5)


def test_no_switches_without_demands():
    @acrobat.autobatch
    def f(x):
        return torch.tanh(x @ W)

    with torch.no_grad():
        stats = check_map(f, [torch.randn(6) for _ in range(8)])
    check_schedule(stats, suspensions=0)
    assert stats.flushes == 1


def test_a_map_leaves_no_reference_cycles():
    """Every graph object of a map is freed by reference counting when it returns: cyclic
    garbage (a suspended fiber's frame pointing back at it) would cost a collector pass
    over tens of thousands of objects after every map."""
    import gc

    hs = [torch.randn(6) for _ in range(12)]
    ours = {"Node", "LazyTensor", "Fiber", "Future", "Runtime"}
    with torch.no_grad():
        generate.map(hs, [0] * len(hs))  # warm: traces and caches live on by design
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            got, stats = generate.map(hs, [0] * len(hs), stats=True)
            gc.collect()
            cyclic = [o for o in gc.garbage if type(o).__name__ in ours]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert stats.suspensions > 0 and len(got) == len(hs)
    assert not cyclic, f"{len(cyclic)} acrobat objects in reference cycles"



def test_a_map_leaves_nothing_alive_once_it_returns():
    """A fiber that blocks switches straight to the next ready one, and a worker whose
    fiber ended parks and switches on: the parked workers' frames must not keep the
    finished map's runtime (and with it the graph) alive until they run again."""
    import weakref

    seen = []

    @acrobat.autobatch
    def f(x):
        if acrobat.graph.RT is not None:  # (check_map runs eager too)
            seen.append(weakref.ref(acrobat.graph.RT))
        kid = acrobat.fork(lambda: (torch.tanh(x).sum() > 0).item())
        return x * 2 if kid.result() and (x.sum() > 0).item() else x

    with torch.no_grad():
        stats = check_map(f, [torch.randn(5) for _ in range(9)])
    assert stats.suspensions > 9
    assert seen and all(ref() is None for ref in seen)


def test_worker_stacks_do_not_nest():
    """Workers start on the driver's greenlet only: one made by a blocking fiber would
    have its C stack below that fiber's, and thousands of fibers nested that way overflow
    a thread's stack (they raised RecursionError here). 4000 instances that each block
    three times, in a thread with a 1 MiB stack."""
    import threading

    @acrobat.autobatch
    def f(x):
        for _ in range(3):
            if (x.sum() > 100).item():
                x = x + 1
            x = x * 1.5
        return x

    xs = [torch.randn(3) for _ in range(4000)]
    out: dict = {}

    def run():
        try:
            with torch.no_grad():
                out["got"] = f.map(xs)
        except BaseException as exc:  # (re-raised below, in the test's thread)
            out["error"] = exc

    old = threading.stack_size(1 << 20)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    finally:
        threading.stack_size(old)
    if "error" in out:
        raise out["error"]
    for g, x in zip(out["got"], xs):
        torch.testing.assert_close(g, f.eager(x))


_MODELS = ["berxit", "birnn", "drnn", "mvrnn", "nestedrnn", "stackrnn", "treelstm"]


def _float_leaves(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _float_leaves(v)]
    return []


def _map_and_maybe_train(task, train: bool) -> None:
    with torch.set_grad_enabled(train):
        out = task.fn.map(task.inputs, **task.kwargs)
        if train:
            torch.stack([t.sum() for t in _float_leaves(out)]).sum().backward()


@pytest.mark.parametrize("name", _MODELS)
@pytest.mark.parametrize("blocks", [True, False])
@pytest.mark.parametrize("train", [False, True])
def test_models_leave_no_reference_cycles(name, blocks, train):
    """The same for every model, inference and training: a map's shared constants
    (executor.constant) point back at its runtime, dropped when it ends; a trace's op
    runs its bound ``run``, a cycle broken when the trace (or a cut of it) is replaced,
    which training does every map where a trace hoisted values carrying autograd."""
    import gc
    import importlib

    task = importlib.import_module(f"models.{name}").make_task("small", 3, blocks=blocks)
    ours = {"Node", "LazyTensor", "Fiber", "Future", "Runtime", "Trace", "Op", "Split"}
    _map_and_maybe_train(task, train)  # warm: traces and caches live on by design
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        _map_and_maybe_train(task, train)
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage if type(o).__name__ in ours]
        garbage = len(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not cyclic, f"acrobat objects in reference cycles: {cyclic}"
    assert garbage == 0, f"{garbage} objects in reference cycles"


@acrobat.autobatch
def read_values(x, shape, dtype):
    v = torch.tanh(x.sum() + torch.arange(6.0)).reshape(shape)
    if dtype is torch.bool:
        v = v > 0
    elif dtype is torch.int64:
        v = (v * 10).long()
    first = v.tolist()
    if isinstance(first, list):
        first.append("mutated")  # the caller owns its list: a second read is unaffected
    again = v.tolist()
    scalar = v.reshape(-1)[2:3].item()
    nested = v.reshape(-1)[3:4].reshape(1, 1).item()  # (1, 1): one number
    return (
        first,
        again,
        scalar,
        nested,
        bool(v.reshape(-1)[0]),
        int(v.reshape(-1)[1]),
        float(v.reshape(-1)[4]),
    )


@given(
    shape=st.sampled_from([(6,), (2, 3), (1, 6), (3, 1, 2)]),
    dtype=st.sampled_from([torch.float32, torch.int64, torch.bool]),
    n=st.integers(1, 5),
    seed=st.integers(0, 100),
)
def test_values_read_as_python_equal_eager(shape, dtype, n, seed):
    torch.manual_seed(seed)
    xs = [torch.randn(4) for _ in range(n)]
    with torch.no_grad():
        got = read_values.map(xs, [shape] * n, [dtype] * n)
        want = [read_values.eager(x, shape, dtype) for x in xs]
    for g, w in zip(got, want):
        _same_python(g, w)



@acrobat.autobatch
def _read_whole(x, how):
    return how(x)


@pytest.mark.parametrize("how", [int, float, bool, lambda t: t.item()])
def test_reading_a_tensor_of_several_elements_as_one_number_is_an_error(how):
    """``int(t)``, ``float(t)``, ``bool(t)`` and ``t.item()`` of a (3,) tensor: torch's
    ValueError (read in C with the extension: the same message), naming the instance."""
    with pytest.raises(ValueError, match="3 elements cannot be converted to Scalar") as err:
        _read_whole.map([torch.randn(3), torch.randn(3)], [how, how])
    assert any("instance 0" in n for n in err.value.__notes__)

def _same_python(g, w):
    """Equal Python values of the same types (floats within rounding of batched sums)."""
    assert type(g) is type(w), (g, w)
    if isinstance(w, (list, tuple)):
        assert len(g) == len(w), (g, w)
        for a, b in zip(g, w):
            _same_python(a, b)
    elif isinstance(w, float):
        assert abs(g - w) <= 1e-6 * max(1.0, abs(w)), (g, w)
    elif isinstance(w, int) and not isinstance(w, bool) and abs(w) > 0:
        assert abs(g - w) <= 1, (g, w)  # (v * 10).long() of a value at a rounding edge
    else:
        assert g == w, (g, w)


def _fork_tree(x, depth):
    if depth == 0:
        return x * 1
    a = acrobat.fork(_fork_tree, x, depth - 1)
    b = acrobat.fork(_fork_tree, x, depth - 1)
    return a.result() + b.result()


@acrobat.autobatch
def fork_tree(x, depth):
    return _fork_tree(x, depth)


def test_the_worker_pool_keeps_what_a_map_needed_up_to_its_cap(monkeypatch):
    """Fibers run on parked worker greenlets (config.FIBER_POOL per thread): a map that
    holds more fibers at once than the pool has makes the rest anew, and they park for
    the next map, which then makes none; past the cap, workers end instead."""
    from acrobat import fibers

    if fibers.tensor._native is None:
        pytest.skip("without the C extension a map's workers end with it (no stack mark)")
    made = []
    real = fibers._start

    def counting(rt, fiber):  # (the one place a worker greenlet is made)
        made.append(1)
        return real(rt, fiber)

    monkeypatch.setattr(fibers, "_start", counting)
    xs = [torch.randn(3) for _ in range(8)]  # 8 instances x 31 fibers
    fibers._LOCAL.pool_mark = None  # (the next map starts without parked workers)
    with torch.no_grad():
        want = [fork_tree.eager(x, 4) for x in xs]
        assert_close_tree(fork_tree.map(xs, depth=4), want)
        first = len(made)  # the most fibers the map held at once
        assert first > 16 and len(fibers._pool()) == first
        assert_close_tree(fork_tree.map(xs, depth=4), want)
        assert len(made) == first  # every fiber of the second map on a parked worker
        with acrobat.config.override(FIBER_POOL=16):
            assert_close_tree(fork_tree.map(xs, depth=4), want)
            assert len(fibers._pool()) == 16
            made.clear()
            assert_close_tree(fork_tree.map(xs, depth=4), want)
            assert len(made) == first - 16  # the rest made anew
