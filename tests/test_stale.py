"""A block's trace folds in the tensors its function reached when it was traced. Replacing
a module's layer or parameter, or rebinding a global the function reads, between maps made
the cached trace compute with the old tensors, silently (map != eager); each trace now
records those identities and is traced again when one changed (block.Trace.deps)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import acrobat

torch.manual_seed(0)
HEAD = nn.Linear(4, 3)  # a global the functions below read
SCALE = torch.tensor(2.0)


def global_cell(x):  # straight-line: an automatic block reading globals
    return torch.tanh(HEAD(x)) * SCALE


@acrobat.autobatch
def uses_globals(x):
    return global_cell(x * 1) + 1


@acrobat.autobatch
def uses_globals_in_a_region(x):
    h = torch.tanh(HEAD(x * 1))
    if h.sum() > 100:  # control flow: the straight-line runs around it are outlined
        return h
    return HEAD(x) * SCALE + h


@acrobat.autobatch
def region_calls_a_cell(x):
    h = torch.tanh(global_cell(x * 1))  # a region whose trace calls an automatic block
    if h.sum() > 100:
        return h
    return h * 2


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 3)


def module_cell(m, x):
    return torch.tanh(m.head(x)) * 2


@acrobat.block
def explicit_cell(m, x):
    return torch.sigmoid(m.head(x))


@acrobat.autobatch
def uses_module(x, m):
    return module_cell(m, x * 1) + explicit_cell(m, x)


XS = [torch.randn(4) for _ in range(3)]


def _check(fn, **shared):
    with torch.no_grad():
        got = fn.map(XS, **shared)
        want = [fn.eager(x, **shared) for x in XS]
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


def test_a_rebound_global_is_seen():
    global HEAD, SCALE
    # (region_calls_a_cell: while a map runs, global_cell's code is a trampoline, which
    # loads no global; the region's trace depended on none of HEAD and SCALE and kept
    # computing with the old ones, silently)
    for fn in (uses_globals, uses_globals_in_a_region, region_calls_a_cell):
        _check(fn)
        old = HEAD, SCALE
        try:
            HEAD = nn.Linear(4, 3)
            _check(fn)
            HEAD = nn.Linear(4, 5)  # another shape
            _check(fn)
            SCALE = torch.tensor(-3.0)  # a global tensor
            _check(fn)
        finally:
            HEAD, SCALE = old


def test_a_replaced_layer_or_parameter_is_seen():
    m = Model()
    _check(uses_module, m=m)
    m.head = nn.Linear(4, 3)  # a submodule replaced
    _check(uses_module, m=m)
    m.head.weight = nn.Parameter(torch.randn(3, 4))  # a parameter replaced
    _check(uses_module, m=m)
    m.load_state_dict(Model().state_dict())  # in place (seen before too)
    _check(uses_module, m=m)


def test_an_unchanged_trace_is_kept():
    m = Model()
    with torch.no_grad():
        uses_module.map(XS, m=m)
        before = list(explicit_cell.cache.values())
        uses_module.map(XS, m=m)
        after = list(explicit_cell.cache.values())
    assert before and all(a is b for a, b in zip(before, after))


class Dropping(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(1.0)  # training: every element dropped, deterministically


def dropping_cell(m, x):
    return m.drop(torch.tanh(m.lin(x))) + 1


@acrobat.autobatch
def uses_dropout(x, m):
    return dropping_cell(m, x * 1)


SEQ = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Dropout(1.0))


@acrobat.autobatch
def uses_sequential(x):
    return SEQ(x * 1) + 1


def test_switching_train_and_eval_is_seen():
    """model.train() / model.eval() between maps: a trace made in eval mode has no
    dropout (it kept none in training, silently), one made in training keeps it."""
    m = Dropping()
    for mode in ("eval", "train", "eval", "train"):
        getattr(m, mode)()
        getattr(SEQ, mode)()
        _check(uses_dropout, m=m)
        _check(uses_sequential)


def test_hooks_added_or_removed_are_seen():
    """A forward hook registered after a trace was made: the trace ran without it."""
    m = Model()
    _check(uses_module, m=m)
    handle = m.head.register_forward_hook(lambda module, inputs, out: out * 3)
    _check(uses_module, m=m)
    pre = m.head.register_forward_pre_hook(lambda module, inputs: (inputs[0] * -1,))
    _check(uses_module, m=m)
    handle.remove()
    pre.remove()
    _check(uses_module, m=m)


class Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 3)
        self.temperature = 1.0


def tempered_cell(m, x):
    return torch.softmax(m.head(x) / m.temperature, -1)


@acrobat.autobatch
def uses_temperature(x, m):
    return tempered_cell(m, x * 1)


def test_a_changed_plain_attribute_is_seen():
    """``m.temperature = 5.0`` between maps: the trace had folded in 1.0."""
    m = Tempered()
    _check(uses_temperature, m=m)
    m.temperature = 5.0
    _check(uses_temperature, m=m)


def test_a_module_is_checked_once_per_map_for_all_its_traces(monkeypatch):
    """Two traces depend on one model (module_cell's automatic block, explicit_cell): the
    second map reads the model's state once for both, and a change before a later map
    is still seen by both."""
    import importlib

    block_module = importlib.import_module("acrobat.block")
    m = Model()
    _check(uses_module, m=m)  # traces both cells
    reads = []
    real = block_module._module_state
    monkeypatch.setattr(
        block_module, "_module_state", lambda mod: (reads.append(id(mod)), real(mod))[1]
    )
    _check(uses_module, m=m)
    assert reads.count(id(m)) == 1
    m.head = nn.Linear(4, 3)  # seen by both traces in the next map
    _check(uses_module, m=m)


def test_the_traces_of_one_block_share_its_module_state_and_see_a_change():
    """One automatic block traced at three shapes: its traces take one state object of
    the model (block._intern_state), which a map compares with the model once; a
    replaced parameter before a later map is still seen by every trace."""
    m = Model()
    xs = [torch.randn(n, 4) for n in (1, 2, 3, 2)]

    def check():
        with torch.no_grad():
            got = uses_module.map(xs, m=m)
            want = [uses_module.eager(x, m=m) for x in xs]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)

    check()
    states = [
        state
        for b in _blocks_of(module_cell)
        for t in b.cache.values()
        if t.deps is not None
        for mod, state in t.deps[0]
        if mod is m
    ]
    assert len(states) == 3 and len({id(state) for state in states}) == 1
    m.head.weight = nn.Parameter(torch.randn(3, 4))
    check()


def _blocks_of(fn) -> list:
    """The acrobat.block objects standing for the automatic block of ``fn``."""
    from acrobat import analysis

    found = analysis._DISPATCHERS.get(analysis._code_key(fn))
    return [found.block] if found is not None else []


@pytest.mark.parametrize("native", [True, False], ids=["C", "python"])
def test_module_state_tells_every_kind_of_change(monkeypatch, native):
    """block._module_state (the C one, and the Python one used without the extension):
    equal while nothing changed, different after each change a trace depends on, equal
    again when the change is undone."""
    import importlib

    block_module = importlib.import_module("acrobat.block")
    if not native:
        monkeypatch.setattr(block_module, "_native", None)
    elif block_module._native is None:
        pytest.skip("the C extension is not built")
    state = block_module._module_state
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Dropout()))
    m.register_buffer("z", torch.zeros(2))
    first = state(m)
    assert state(m) == first
    m.eval()
    assert state(m) != first
    m.train()
    assert state(m) == first
    hook = m[2].register_forward_hook(lambda *a: None)
    assert state(m) != first
    hook.remove()
    assert state(m) == first
    m[2][1].p = 0.3  # a plain attribute
    assert state(m) != first
    m[2][1].p = 0.5
    assert state(m) == first
    z = m.z
    m.z = torch.ones(2)  # a buffer replaced
    assert state(m) != first
    m.z = z
    assert state(m) == first
    old = m[2][0]
    m[2][0] = nn.Linear(4, 4)  # a layer replaced
    assert state(m) != first
    m[2][0] = old
    assert state(m) == first
    weight = m[0].weight
    m[0].weight = nn.Parameter(torch.randn(4, 3))  # a parameter replaced
    assert state(m) != first
    m[0].weight = weight
    assert state(m) == first
    m[1].extra = nn.Linear(2, 2)  # a layer added
    assert state(m) != first
    del m[1].extra
    assert state(m) == first
    shared = nn.Linear(2, 2)
    m.a, m.b = shared, shared  # one module under two names: read once, like modules()
    assert len([x for x in m.modules() if x is shared]) == 1
    assert state(m) != first


TWIN_SOURCE = '''
import torch

W = torch.full((3,), {value})


def cell(x):  # straight-line: an automatic block
    return torch.tanh(x * W) + torch.sigmoid(x)


def step(x):  # control flow: its runs outlined into regions
    h = torch.tanh(x * W) + torch.sigmoid(x)
    if h.sum() > 100:
        return h
    return cell(h) * W + h
'''


def test_one_function_in_two_modules_reads_each_modules_globals(tmp_path, monkeypatch):
    """The same source in two files compiles to code objects that compare equal (code
    compares by value, not by file): analysis cached one outline and one block for both,
    and the second module's calls ran the first's, reading the first module's ``W``."""
    import importlib.util
    import sys

    modules = []
    for k in (1, 2):
        path = tmp_path / f"twin_{k}.py"
        path.write_text(TWIN_SOURCE.format(value=float(k)))
        spec = importlib.util.spec_from_file_location(f"twin_{k}", path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, f"twin_{k}", module)
        spec.loader.exec_module(module)
        modules.append(module)
    assert modules[0].step.__code__ == modules[1].step.__code__  # (what made them one)
    xs = [torch.randn(3) for _ in range(3)]
    for module in modules:
        for fn in (module.cell, module.step):
            got, stats = acrobat.autobatch(fn).map(xs, stats=True)
            assert any(op.startswith("block:") for op in stats.by_op), stats.by_op
            for a, x in zip(got, xs):
                torch.testing.assert_close(a, fn(x))
