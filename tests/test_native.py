"""The C record path (acrobat/_native.c) against the Python one it replaces.

Both must record the same graph: the same nodes, batches and results for every model,
and the Python path (ACROBAT_NATIVE=0, or the module not built) must keep passing the
suite's core tests on its own. The C path is what the rest of the suite runs whenever
the module is built.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import acrobat
from acrobat import graph
from acrobat.graph import Node
from acrobat.tensor import LazyTensor, _native

ROOT = Path(__file__).resolve().parent.parent
needs_native = pytest.mark.skipif(_native is None, reason="acrobat._native is not built")

# One script, run in this process's environment and with ACROBAT_NATIVE=0: per model
# (blocks and plain code), its recorded nodes and batches and a checksum of each output.
_RECORD = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from acrobat.tensor import _native
    from models import berxit, birnn, drnn, mvrnn, nestedrnn, stackrnn, treelstm

    def sums(value):
        if isinstance(value, torch.Tensor):
            return [round(float(value.double().sum()), 4)]
        if isinstance(value, (list, tuple)):
            return [s for v in value for s in sums(v)]
        return [value]

    report = {{"native": _native is not None}}
    for mod in (berxit, birnn, drnn, mvrnn, nestedrnn, stackrnn, treelstm):
        for blocks in (True, False):
            task = mod.make_task("small", 4, blocks=blocks)
            with torch.no_grad():
                out, st = task.fn.map(task.inputs, **task.kwargs, stats=True)
            report[f"{{task.name}}-{{blocks}}"] = [st.nodes, st.batches, sums(out)]
    print(json.dumps(report))
    """
)


def _record(native: bool) -> dict:
    env = dict(os.environ, ACROBAT_NATIVE="1" if native else "0", PYTHONPATH=str(ROOT))
    code = _RECORD.format(root=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_native
def test_native_and_python_record_the_same_graphs():
    fast, slow = _record(True), _record(False)
    assert fast.pop("native") is True
    assert slow.pop("native") is False
    assert fast.keys() == slow.keys()
    for name in fast:
        nodes, batches, sums = fast[name]
        assert (nodes, batches) == tuple(slow[name][:2]), name
        assert sums == pytest.approx(slow[name][2], rel=1e-4, abs=1e-4), name


def test_python_path_passes_the_core_tests():
    """The fallback is a supported configuration: run core test files with it."""
    env = dict(os.environ, ACROBAT_NATIVE="0", PYTHONPATH=str(ROOT))
    files = [
        "tests/test_fibers.py",
        "tests/test_hoisting.py",
        "tests/test_errors.py",
        # the dispatchers' Python __call__ (Block._call, AutoBlock._call, _region_call)
        "tests/test_blocks_and_grad.py",
        "tests/test_analysis.py",
        "tests/test_regions.py",
        "tests/test_scans.py",
        "tests/test_shortcuts.py",  # the Python stand-ins (ops._shortcut_py)
        "tests/test_dead.py",  # scheduler.prune_dead in Python
        "tests/test_in_place.py",  # the Python add_node and Tracer.record mark reads
        "tests/test_stale.py",  # traces checked against what they folded in
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout


@needs_native
def test_node_fields_behave_like_slots():
    nd = Node("op", None, (), None, [], None, ("sig",), 3, 1, 7, None)
    assert (nd.op, nd.depth, nd.phase, nd.instance, nd.row, nd.slot, nd.height) == (
        "op",
        3,
        1,
        7,
        0,
        0,
        0,
    )
    assert nd.data is None and nd.outs is None
    nd.depth = -1
    nd.slot = (5 << 44) | (2 << 24) | 9  # the executor's packed slot needs 64 bits
    nd.outs = (torch.ones(2),)
    assert nd.depth == -1 and nd.slot == (5 << 44) | (2 << 24) | 9
    assert isinstance(nd.outs[0], torch.Tensor)
    with pytest.raises(AttributeError):
        nd.unknown = 1  # no __dict__: the fields are all there is
    lazy = LazyTensor(nd, 0, torch.Size([2]), torch.float32)
    assert lazy.node is nd and lazy.key == LazyTensor(nd, 0, torch.Size([2]), torch.float32).key


@needs_native
def test_reader_counts_read_back_as_one_dict():
    """NodeBase keeps the readers of outputs 1-4 in C fields and any later one in a dict;
    Python sees them as one dict, as graph.mark_read and graph.readers use it."""
    nd = Node("op", None, (), None, [], None, ("sig",), 1, 0, 0, None)
    assert nd.used_at is None
    outs = [LazyTensor(nd, i, torch.Size([2]), torch.float32) for i in range(7)]
    for i in (0, 2, 2, 6, 1, 2):
        graph.mark_read(outs[i])
    assert nd.used == 6
    assert nd.used_at == {1: 1, 2: 3, 6: 1}
    assert [graph.readers(nd, i) for i in range(7)] == [1, 1, 3, 0, 0, 0, 1]
    nd.used_at = {3: 2, 9: 4}
    assert nd.used_at == {3: 2, 9: 4}
    nd.used_at = None
    assert nd.used_at is None and graph.readers(nd, 0) == 6
    with pytest.raises(TypeError):
        nd.used_at = [1]


def _relifted_in_python(nodes, op, sig, info, consts):
    for nd in nodes:
        inputs = list(nd.inputs)
        for pos, c in consts:
            inputs.insert(pos, c)
        nd.inputs, nd.op, nd.sig, nd.info = inputs, op, sig, info


@needs_native
@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=5),
    st.lists(st.integers(0, 6), min_size=0, max_size=4, unique=True),
)
def test_relift_rewrites_nodes_as_the_python_loop_does(sizes, positions):
    """scheduler._join's rewrite of lifted nodes in C: the constants inserted at their
    (ascending) positions, past the end appended, the op, sig and info replaced."""

    def lazy(tag):
        return LazyTensor(
            Node(tag, None, (), None, [], None, None, 0, 0, 0, None),
            0,
            torch.Size([1]),
            torch.float32,
        )

    consts = [(pos, lazy(f"c{pos}")) for pos in sorted(positions)]
    made = []
    for _ in range(2):
        nodes = []
        for k, size in enumerate(sizes):
            ins = [lazy(f"x{k}.{j}") for j in range(size)]
            nodes.append(Node("old", None, (), None, ins, "info0", "sig0", 1, 0, k, None))
        made.append(nodes)
    _native.relift(made[0], "op", "sig", "info", consts)
    _relifted_in_python(made[1], "op", "sig", "info", consts)
    for a, b in zip(*made):
        assert [t.node.op for t in a.inputs] == [t.node.op for t in b.inputs]
        assert (a.op, a.sig, a.info) == (b.op, b.sig, b.info) == ("op", "sig", "info")
    with pytest.raises(ValueError):
        _native.relift(made[0], "op", "sig", "info", [(2, consts and consts[0][1]), (1, None)])


@needs_native
@pytest.mark.parametrize("impl", ["c", "python"])
def test_resume_all_makes_the_unblocked_fibers_ready_or_names_a_missing_one(impl):
    from collections import deque

    from acrobat import fibers

    resume = _native.resume_all if impl == "c" else fibers._resume_all_py

    def blocked_on(outs):
        nd = Node("op", None, (), None, [], None, None, 1, 0, 0, None)
        nd.outs = outs
        fb = fibers.Fiber(0, 0)
        fb.waiting = LazyTensor(nd, 0, torch.Size([1]), torch.float32)
        return fb

    done = [blocked_on((torch.ones(1),)) for _ in range(3)]
    ready = deque([fibers.Fiber(1, 0)])
    assert resume(done, ready) is None
    assert list(ready)[1:] == done
    stuck = blocked_on(None)
    ready = deque()
    assert resume([*done, stuck], ready) is stuck
    assert not ready  # (none made ready: the driver raises)


@acrobat.autobatch
def _read_twice(x):
    d = x > 0
    first = d.tolist()
    first.append("mutated")  # the caller owns its list: a later read is not affected
    second = d.tolist()
    second.append("again")
    third = d.tolist()  # (a row handed out before: converted anew)
    other = (x > 0).tolist()  # the same values, another node
    flag = bool(d[0])
    return first, second, third, other, flag


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_a_value_read_twice_gives_each_read_its_own_list(n, seed):
    """A batch output's rows are converted once; a row's first read takes its list (no
    copy) and a later read of the same row converts the tensor anew: every read as
    eager's, each list its own."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(3, generator=gen) for _ in range(n)]
    with torch.no_grad():
        got = _read_twice.map(xs)
    assert got == [_read_twice.eager(x) for x in xs]
    for first, second, third, other, _ in got:
        assert first[-1] == "mutated" and second[-1] == "again"
        assert first[:-1] == second[:-1] == third == other


@needs_native
def test_a_long_chain_of_nodes_is_freed_without_recursion():
    prev = None
    for depth in range(200_000):
        nd = Node(
            None, None, (), None, [] if prev is None else [prev], None, None, depth, 0, 0, None
        )
        prev = LazyTensor(nd, 0, torch.Size([]), torch.float32, -1)
    del nd, prev  # would overflow the C stack if each free recursed into the next


@needs_native
def test_nodes_and_lazy_tensors_free_in_one_pass_and_release_what_they_hold():
    # graph.Node and LazyTensor get the one-pass dealloc (not subtype_dealloc); a class
    # that adds slots, a __dict__ or is not a direct subclass keeps CPython's own
    assert _native.fast_dealloc(Node) and _native.fast_dealloc(LazyTensor)
    with_slots = type("WithSlots", (_native.NodeBase,), {"__slots__": ("extra",)})
    with_dict = type("WithDict", (_native.LazyBase,), {})
    deeper = type("Deeper", (Node,), {"__slots__": ()})
    for cls in (with_slots, with_dict, deeper, int, object):
        assert not _native.fast_dealloc(cls)
    held = object()
    node_refs, lazy_refs = sys.getrefcount(Node), sys.getrefcount(LazyTensor)
    held_refs = sys.getrefcount(held)
    for _ in range(1000):
        nd = Node(held, None, (), None, [], None, None, 0, 0, 0, None)
        lazy = LazyTensor(nd, 0, torch.Size([2]), torch.float32, held)
        assert sys.getrefcount(held) == held_refs + 2
        del nd, lazy
    # every field released and the class's own reference given back, instance by instance
    assert (sys.getrefcount(Node), sys.getrefcount(LazyTensor), sys.getrefcount(held)) == (
        node_refs,
        lazy_refs,
        held_refs,
    )
    obj = with_slots("op", None, (), None, [], None, None, 0, 0, 0, None)
    obj.extra = held  # (CPython's dealloc clears the added slot)
    del obj
    assert sys.getrefcount(held) == held_refs


@needs_native
def test_native_paths_are_the_ones_bound():
    from acrobat import fibers

    assert graph.add_node is _native.add_node
    assert graph._py_add_node is not _native.add_node
    assert fibers._fiber_main is _native.fiber_main
    assert fibers.switch_away is _native.switch_away
    assert fibers._worker_loop is _native.worker_loop

    @acrobat.block
    def cell(w, x, h):
        return torch.tanh(x @ w + h)

    @acrobat.autobatch
    def run(x, w):
        h = torch.zeros(3)
        for _ in range(4):
            h = cell(w, x, h)
        return h

    w = torch.randn(3, 3)
    xs = [torch.randn(3) for _ in range(5)]
    out, st = run.map(xs, w=w, stats=True)
    for got, x in zip(out, xs):
        torch.testing.assert_close(got, run.eager(x, w=w))
    assert st.batches == 4 + 1  # the four steps, and the inputs' data batch


@pytest.mark.skipif(
    os.environ.get("ACROBAT_NATIVE", "1") == "0" or shutil.which("cc") is None,
    reason="no C compiler (or the C path is switched off)",
)
def test_the_c_helpers_are_built_where_a_compiler_is():
    """The build makes the extension optional; on a machine with a compiler a missing or
    unloadable module (a build error, an unresolved symbol) is a bug, not a fallback."""
    import importlib

    module = importlib.import_module("acrobat._native")
    assert _native is module


_W = torch.randn(4, 4) / 2


@acrobat.block
def _step_block(x, h):
    return torch.tanh(x @ _W + h)


def _step_plain(x, h):  # no decorator: an AutoBlock routes it for the map
    return torch.tanh(x @ _W + h)


@acrobat.autobatch
def _chain_block(x, keywords):
    h = x
    for _ in range(5):
        h = _step_block(x, h=h * 0.5) if keywords else _step_block(x, h)
    return h


@acrobat.autobatch
def _chain_plain(x, keywords):
    h = x
    for _ in range(5):
        h = _step_plain(x, h=h * 0.5) if keywords else _step_plain(x, h)
    return h


@needs_native
@pytest.mark.parametrize("plain", [False, True])
@pytest.mark.parametrize("keywords", [False, True])
def test_block_calls_hit_the_c_slot_and_fall_back_to_call(monkeypatch, plain, keywords):
    """Block and AutoBlock calls go through their C base's tp_call: a positional call whose
    trace is cached never reaches the Python ``_call``; a keyword call of a Block always
    does (it takes the Python path; a routed function's trampoline passes its arguments
    positionally); every call is one block node, with eager's values."""
    from acrobat.analysis import AutoBlock
    from acrobat.block import Block

    assert issubclass(Block, _native.BlockBase) and issubclass(AutoBlock, _native.AutoBase)
    f = _chain_plain if plain else _chain_block
    cls = AutoBlock if plain else Block
    calls = []
    original = cls._call

    def spy(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "_call", spy)
    xs = [torch.randn(4) for _ in range(6)]
    with torch.no_grad(), acrobat.config.override(AUTO_SCANS=False, AUTO_REGIONS=False):
        got, stats = f.map(xs, keywords=keywords, stats=True)
        calls_in_map = len(calls)
        for g, x in zip(got, xs):
            torch.testing.assert_close(g, f.eager(x, keywords=keywords))
    # routed: one block node per call (once a part is hoisted out, the rest's node)
    blocks = sum(
        n for op, (_, n) in stats.by_op.items() if op.startswith("block:") and "hoisted" not in op
    )
    assert blocks == 6 * 5
    if keywords and not plain:
        assert calls_in_map == 6 * 5  # every call of every instance
    else:
        assert calls_in_map <= 1  # the trace's first call at most: the rest hit in C


@acrobat.autobatch
def _inline_steps(x, ids):
    h = x
    for i in ids:
        if i < 0:  # a branch keeps the body a run of its own, not a scan
            break
        g = torch.tanh(x @ _W + h) * torch.tensor(i)  # a run: torch.tensor(i) passed as i
        h = torch.sigmoid(g) + h
    return h


@needs_native
def test_region_calls_hit_the_c_slot(monkeypatch):
    """An outlined run's dispatcher makes its common call in C: the run's torch.tensor(i)
    a data node, one region node per step; the Python ``_region_call`` only for the
    first call(s) and for what the slot does not take."""
    from acrobat.analysis import RegionBlock

    assert issubclass(RegionBlock, _native.RegionBase)
    calls = []
    original = RegionBlock._region_call

    def spy(self, *args):
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(RegionBlock, "_region_call", spy)
    xs = [torch.randn(4) for _ in range(5)]
    ids = [[1, 2, 3, 4], [2, 2], [3], [1, 1, 1, 1], [4, 3, 2, 1]]
    with torch.no_grad(), acrobat.config.override(AUTO_SCANS=False):
        got, stats = _inline_steps.map(xs, ids, stats=True)
        for g, x, i in zip(got, xs, ids):
            torch.testing.assert_close(g, _inline_steps.eager(x, i))
    regions = sum(n for op, (_, n) in stats.by_op.items() if op.startswith("block:"))
    assert regions == sum(map(len, ids))  # one node per step
    assert len(calls) <= 1  # the trace's first call at most


@needs_native
def test_trace_hit_returns_the_cached_trace_and_the_lazy_operands():
    """_native.trace_hit (Block.trace_for's cache hit in C): the trace the call's key
    names in this map with the call's LazyTensor operands; None where trace_for would
    trace, revalidate or find no per-instance argument."""
    found = []

    @acrobat.autobatch
    def f(x):
        h = _step_block(x, x)  # traced (or revalidated) by this first call
        rt = graph.RT
        hit = _native.trace_hit(_step_block, (x, h), rt)
        found.append(
            (
                hit,
                _native.trace_hit(_step_block, (torch.zeros(4), torch.zeros(4)), rt),
                _native.trace_hit(_step_block, (x[:2], x[:2]), rt),
                x,
                h,
            )
        )
        return h

    with torch.no_grad():
        f.map([torch.randn(4) for _ in range(3)])
    for hit, no_lazy, new_shape, x, h in found:
        trace, inputs = hit
        assert any(trace is t for t in _step_block.cache.values())
        assert len(inputs) == 2 and inputs[0] is x and inputs[1] is h
        assert no_lazy is None and new_shape is None


# Six layers over three input widths: two of each width, so calls that key alike by
# their tensors differ only by the layer (keyed by identity); more than the four hits a
# block remembers (_native's MEMO_WAYS).
_LAYERS = [torch.nn.Linear(k, 3) for k in (2, 3, 4, 2, 3, 4)]


@acrobat.block
def _project(layer, x):
    return torch.tanh(layer(x))


@acrobat.autobatch
def _projections(x, order):
    inputs = {k: x[:k] for k in (2, 3, 4)}
    return [_project(_LAYERS[i], inputs[_LAYERS[i].in_features]) for i in order]


@needs_native
@settings(max_examples=25, deadline=None)
@given(
    order=st.lists(st.integers(0, 5), min_size=1, max_size=14),
    n=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_remembered_cache_hits_give_each_call_its_own_trace(order, n, seed):
    """A block remembers its last cache hits by the objects that keyed the call (a
    LazyTensor's key, a module by identity): a call of another layer or another shape,
    in any order, still gets its own trace; results equal eager's."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(4, generator=gen) for _ in range(n)]
    with torch.no_grad():
        got = _projections.map(xs, order=order)
        want = [_projections.eager(x, order=order) for x in xs]
    for g, w in zip(got, want):
        assert len(g) == len(w) == len(order)
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b)


@needs_native
def test_remembered_cache_hits_last_one_map():
    """The hits are stored on a call that found its trace in the cache and dropped when
    the map ends (they hold the call's arguments: a model, a map's constants)."""
    layer = torch.nn.Linear(4, 3)
    seen = []

    @acrobat.autobatch
    def f(x):
        h = _project(layer, x)  # (traced by the first instance)
        h = _project(layer, x)
        seen.append(_native.memo_entries(_project))
        return h

    with torch.no_grad():
        out = f.map([torch.randn(4) for _ in range(3)])
    assert out[0].shape == (3,)
    assert seen[-1] >= 1  # a cache hit was remembered during the map
    assert _native.memo_entries(_project) == 0  # and dropped at its end


_STEPS = 3


@acrobat.autobatch
def _reads(x, k):
    got = []
    h = x
    for step in range(_STEPS):
        h = torch.tanh(h * k + step)
        value = (h > 0).tolist()  # a batch read by every instance (C: a row of it)
        if isinstance(value, list):
            value.append(step)  # mutating one instance's list must not touch another's
        got.append(value)
        if float(h.sum()) > 1e9:  # float(...): item() through the same read
            break
    return got, int((h > 0).sum())


@needs_native
@settings(max_examples=20, deadline=None)
@given(
    shape=st.sampled_from([(), (1,), (4,), (2, 3)]),
    n=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_value_reads_take_the_c_path_with_eager_values(shape, n, seed):
    """``t.tolist()`` and ``item()`` are ``_native.value_read``: after a batch's first
    read (demand_py converts the batch), every instance's read of it is its row copied
    in C, suspension included; nested rows go to demand_py. Values equal eager's."""
    from acrobat import fibers

    assert LazyTensor.tolist is _native.LazyBase.tolist
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=gen) for _ in range(n)]
    slow = []

    def spy(t):
        slow.append(1)
        return fibers.demand_py(t)

    _native.setup_fibers(spy, fibers._host_list, fibers._torch_function_on)
    try:
        with torch.no_grad():
            got = _reads.map(xs, k=1.5)
    finally:
        _native.setup_fibers(fibers.demand_py, fibers._host_list, fibers._torch_function_on)
    assert got == [_reads.eager(x, k=1.5) for x in xs]
    reads = n * (2 * _STEPS + 1)  # tolist + float per step, int at the end
    if len(shape) <= 1:  # flat rows: demand_py makes each batch's rows once
        assert len(slow) <= 2 * _STEPS + 1  # one per batch read, whatever n
        assert n == 1 or len(slow) < reads
    else:
        assert len(slow) >= n * _STEPS  # nested rows: copied by demand_py


def test_torch_errors_in_shape_inference_do_not_crash_the_process():
    """Shape inference tries CPU ones, meta, zeros, and expects torch to fail on some;
    a C++ error captures a backtrace by unwinding the stack, and on a pooled fiber's
    stack that walked into stale driver frames: this pair of test files, in this order,
    segfaulted inside _Unwind_Backtrace (torch's embedding, under test_analysis) every
    time, on this session's code and the code before it. Pooled workers are now reused
    only at the C stack depth they started from (fibers._pool_for_map)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_stale.py", "tests/test_analysis.py"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])


def test_a_namedtuple_of_cells_keeps_the_c_call_path(monkeypatch):
    """A run given a namedtuple of functions (StackRNN's ``Cells``) is keyed by its
    identity, as the C call path keys it: keyed by its fields (since namedtuples of lazy
    tensors are), every call missed the C path and went through Python's trace_for
    (StackRNN small b64 recorded in 36.7 ms against 20.7)."""
    import sys

    import pytest

    from acrobat.tensor import _native
    from models import stackrnn

    if _native is None:
        pytest.skip("needs the C extension")
    block = sys.modules["acrobat.block"]  # (acrobat.block is the decorator)
    task = stackrnn.make_task("small", 8, blocks=False)
    calls = []
    original = block.Block.trace_for

    def counted(self, rt, args, kwargs=None):
        calls.append(self)
        return original(self, rt, args, kwargs)

    with torch.no_grad():
        task.fn.map(task.inputs, **task.kwargs)
        monkeypatch.setattr(block.Block, "trace_for", counted)
        task.fn.map(task.inputs, **task.kwargs)
    # (a trace's first call in a map is checked in Python: one miss per trace at most)
    for b in set(calls):
        assert calls.count(b) <= len(b.cache), f"{calls.count(b)} calls missed the C path"


@needs_native
def test_ragged_copies_refuse_rows_past_their_buffer():
    """The padded batches' C copies check each part's bytes against the row stride before
    writing (a member longer than its padded row would write into the next row, or past
    the buffer), and a pick against its value's end."""
    out = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="longer than its row"):
        _native.pad_parts(
            out.data_ptr(), 12, [0], {}, [None], torch.float32, [1], [torch.Size([5])], [20]
        )
    with pytest.raises(ValueError, match="longer than stride"):
        _native.unpad_parts(out.data_ptr(), 12, out.data_ptr(), [1], [20])
    with pytest.raises(ValueError, match="past its value's end"):
        _native.pick_rows(
            out.data_ptr(), 12, [0], {}, [None], torch.float32, [torch.Size([2, 3])], [24], [16]
        )


@needs_native
@pytest.mark.parametrize("impl", ["c", "python"])
def test_fiber_main_keeps_the_value_or_the_error_and_wakes_the_joiners(impl):
    """``_native.fiber_main`` against ``fibers._fiber_main_py`` on the same tasks: the
    value kept, an error kept with its traceback (any BaseException), keyword arguments
    passed, an instance's arguments wrapped, the grad-region end called, the joiners
    appended to the ready queue, the task and the worker let go."""
    from collections import deque
    from types import SimpleNamespace

    from acrobat import fibers

    run = _native.fiber_main if impl == "c" else fibers._fiber_main_py
    resumed = []
    rt = SimpleNamespace(grad_resume=None, ready=deque(["other"]))

    def add(a, b=0):
        return a + b

    def fail():
        raise KeyboardInterrupt("stop")

    done = fibers.Fiber(0, 0, (add, (2,), {"b": 5}, False))
    done.glet = "worker"
    joiner = fibers.Fiber(1, 0)
    done.joiners = [joiner]
    run(rt, done)
    assert (done.value, done.error, done.done, done.task, done.glet) == (7, None, True, None, None)
    assert list(rt.ready) == ["other", joiner]

    rt.grad_resume = lambda: resumed.append(True)
    failed = fibers.Fiber(2, 0, (fail, (), {}, False))
    run(rt, failed)
    assert type(failed.error) is KeyboardInterrupt and failed.done and failed.value is None
    assert failed.error.__traceback__ is not None and resumed == [True]
    assert list(rt.ready) == ["other", joiner]  # (no joiners: nothing woken)

    ended = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fibers, "_wrap_inputs", lambda a: ("wrapped", a))
        mp.setattr(fibers, "_tag_fiber", lambda rt_, fiber, tag: ended.append((fiber, tag)))
        mp.setattr(fibers, "_SET_GRAD_ENABLED", lambda mode: ended.append(mode))
        rt.grad_mode = True
        wrapped = fibers.Fiber(3, 0, (lambda x, y: (x, y), (1, 2), {}, True))
        wrapped.grad = "a tag"
        run(rt, wrapped)
    assert wrapped.value == (("wrapped", 1), ("wrapped", 2))
    assert ended == [(wrapped, None), True]


def _fork_tree(x, depth, w):
    """A binary tree of forks over per-instance values: each level's children forked with
    positional and keyword arguments, joined in reverse order (some inline, some not)."""
    h = torch.tanh(x @ w)
    if depth == 0 or float(h.sum()) < -1.5:
        return [h]
    left = acrobat.fork(_fork_tree, h, depth - 1, w=w)
    right = acrobat.fork(_fork_tree, -h, depth=depth - 1, w=w)
    return right.result() + left.result() + [h]


@needs_native
@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 6), depth=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_c_fork_makes_the_fibers_python_fork_makes(n, depth, seed):
    """``_native.fork`` (bound as acrobat.fork) against ``fibers.fork_py``: the same
    results, graph and schedule, and both equal to the eager loop; a fork outside a map
    returns the value at once."""
    from acrobat import fibers

    assert acrobat.fork is _native.fork and fibers.fork is _native.fork
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 4, generator=g)
    xs = [torch.randn(4, generator=g) for _ in range(n)]
    tree = acrobat.autobatch(_fork_tree)
    runs = {}
    for impl in (_native.fork, fibers.fork_py):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(acrobat, "fork", impl)
            got, stats = tree.map(xs, depth=depth, w=w, stats=True)
        runs[impl] = (got, stats.nodes, stats.batches, stats.suspensions, stats.flushes)
    c, py = runs[_native.fork], runs[fibers.fork_py]
    assert c[1:] == py[1:]
    for a, b, x in zip(c[0], py[0], xs):
        want = _fork_tree(x, depth, w)
        assert len(a) == len(b) == len(want)
        for u, v, e in zip(a, b, want):
            torch.testing.assert_close(u, v)
            torch.testing.assert_close(u, e)
    assert _native.fork(lambda a, b=0: a + b, 2, b=3).result() == 5


@acrobat.block
def _scaled(a, b):
    return a * b


def _affine(k, n):  # straight-line: an AutoBlock candidate
    return k * n + 1


@acrobat.autobatch
def _numbers_and_tensors(x, n):
    s = _affine(2, n) + _affine(n, 3)  # Python numbers only: run as written
    return _scaled(x, 2.0) + _scaled(3, n) + s, _affine(x, 2.0)


@needs_native
def test_block_calls_without_per_instance_arguments_run_as_written(monkeypatch):
    """A block or an AutoBlock called with no lazy tensor or container among its
    arguments runs its function directly from the C call slot (Block._call is not
    entered); calls with a lazy tensor record their nodes as before; map == eager."""
    import importlib

    block = importlib.import_module("acrobat.block")  # (acrobat.block is the decorator)
    entered = []
    real = block.Block._call

    def counting(self, *args, **kwargs):
        entered.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(block.Block, "_call", counting)
    xs = [torch.randn(3, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    with torch.no_grad():
        for _ in range(2):  # (the second map: every trace a cache hit)
            entered.clear()
            got, stats = _numbers_and_tensors.map(xs, n=5, stats=True)
    in_map = list(entered)
    for (a, b), x in zip(got, xs):
        want_a, want_b = _numbers_and_tensors.eager(x, n=5)
        torch.testing.assert_close(a, want_a)
        torch.testing.assert_close(b, want_b)
    assert not [args for args in in_map if not any(type(a) is LazyTensor for a in args)]
    assert stats.by_op["block:_scaled"] == [1, len(xs)]


_LEAVES = st.one_of(
    st.integers(-5, 5),
    st.floats(allow_nan=False, allow_subnormal=False, width=32),  # (numba sets FTZ)
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.just(torch.Size([2, 3])),
    st.just(torch.float32),
)


def _pytrees(leaves):
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4),
            st.lists(inner, max_size=4).map(tuple),
            st.dictionaries(st.text(max_size=2), inner, max_size=3),
        ),
        max_leaves=12,
    )


@needs_native
@settings(max_examples=80, deadline=None)
@given(tree=_pytrees(_LEAVES))
def test_c_materialize_returns_what_python_returns_or_the_miss(tree):
    """Without lazy tensors: the C version's result is the Python one's (lists copied,
    tuples of plain values as they are), or its miss sentinel where a dict is anywhere."""
    from acrobat import fibers

    got = _native.materialize(tree)
    want = fibers._materialize_py(tree, 0, "f")
    if got is fibers._MISS:
        assert "{" in repr(tree)  # (only dicts miss here)
        return
    assert got == want and type(got) is type(want)
    if isinstance(tree, list):
        assert got is not tree  # a copy, as eager's result is the instance's own


@needs_native
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 6), sizes=st.lists(st.integers(1, 3), min_size=6, max_size=6))
def test_map_results_through_the_c_materialize_match_eager(n, sizes):
    """Lazy results in the containers the C path takes (tuples, lists, nesting) come from
    it alone; the ones it leaves to Python (a dict, a table's row the batch shares with
    the table, which Python clones) go there; all equal the eager loop's."""
    from acrobat import fibers

    table = torch.randn(10, 3)
    before = table.clone()
    calls = {"py": 0}
    real = fibers._materialize_py

    def counted(value, instance, fn_name):
        calls["py"] += 1
        return real(value, instance, fn_name)

    @acrobat.autobatch
    def f(x, k):
        h = torch.tanh(x * 2)
        rows = [h[: k + 1].sum(0, keepdim=True) * i for i in range(k)]
        return h, rows, [k, "s"], (h.sum(), None)

    @acrobat.autobatch
    def g(x, k):
        return {"h": torch.tanh(x)}, table[torch.tensor(k)]

    xs = [torch.randn(4, 3) for _ in range(n)]
    ks = sizes[:n]
    old = fibers._materialize_py
    fibers._materialize_py = counted
    try:
        got = f.map(xs, ks)
        assert calls["py"] == 0  # every instance's result by the C path
        got_g = g.map(xs, ks)
        assert calls["py"] >= n  # the dicts went to the Python version
    finally:
        fibers._materialize_py = old
    for out, out_g, x, k in zip(got, got_g, xs, ks):
        want, want_g = f.eager(x, k), g.eager(x, k)
        torch.testing.assert_close(out[0], want[0])
        assert type(out[1]) is list and len(out[1]) == k
        for a, b in zip(out[1], want[1]):
            torch.testing.assert_close(a, b)
        assert out[2] == [k, "s"] and out[3][1] is None
        torch.testing.assert_close(out[3][0], want[3][0])
        torch.testing.assert_close(out_g[0]["h"], want_g[0]["h"])
        torch.testing.assert_close(out_g[1], want_g[1])
        out_g[1].add_(1)  # the instance's own copy, not the table's row
    assert torch.equal(table, before)
