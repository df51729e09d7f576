"""A user module's constants read in a run (analysis.MODULE_ATTRIBUTES).

``h = torch.zeros(config.HIDDEN)`` reads a global that is a module: analysis cannot let a
trace fix ``config.HIDDEN`` (the module's attribute may change between calls), so the
statement stayed out of runs and split the straight-line code around it. The run now
reads ``module.NAME`` at its call, as it reads a local object's attributes: one trace
for the value it gets, and a new value gives what eager gives."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from acrobat import analysis
from tests import module_cells
from tests.helpers import check_map, outlined_with

torch.manual_seed(0)
CELL = nn.GRUCell(module_cells.HIDDEN, module_cells.HIDDEN)
EMB = nn.Embedding(9, module_cells.HIDDEN)


def encode(tokens):
    x = EMB(tokens) * module_cells.SCALE
    h = torch.zeros(module_cells.HIDDEN)
    for t in range(x.shape[0]):
        h = CELL(x[t], h)
    return h * module_cells.SCALE + x.mean(0)


def _tokens(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(9, (n,), generator=g) for n in lengths]


def _regions(fn) -> list:
    outlined = analysis.outline(fn)
    return [] if outlined is None else outlined.regions


def test_a_modules_constants_join_the_run():
    """The embedding, its scaling and the zeros state are one run (before: the zeros
    statement split them, the lookup ran alone per size)."""
    regions = _regions(encode)
    spans = [r.impl.__qualname__ for r in regions if isinstance(r, analysis.RegionBlock)]
    assert any("lines 28-29" in s for s in spans), spans
    with outlined_with(encode, MODULE_ATTRIBUTES=False):
        before = [r.impl.__qualname__ for r in _regions(encode)]
    assert not any("lines 28-29" in s for s in before), before


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 7), min_size=1, max_size=6), seed=st.integers(0, 999))
def test_a_modules_constants_in_runs_give_the_eager_results(lengths, seed):
    with torch.no_grad():
        check_map(acrobat.autobatch(encode), _tokens(lengths, seed))


def test_a_changed_constant_is_read_at_the_next_call():
    f = acrobat.autobatch(encode)
    data = _tokens([3, 5, 2], 4)
    with torch.no_grad():
        check_map(f, data)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(module_cells, "SCALE", 2.0)
            check_map(f, data)  # (a trace that fixed 0.5 would give other values)
        check_map(f, data)


def test_module_roots_are_constants_read_as_attributes_only():
    import ast

    def roots(src: str) -> set:
        expr = ast.parse(src, mode="eval").body
        return analysis._module_roots(encode, expr, set())

    assert roots("torch.zeros(module_cells.HIDDEN) * module_cells.SCALE") == {"module_cells"}
    assert roots("module_cells.step(x, h)") == set()  # a call through it
    assert roots("module_cells.lin.weight") == set()  # deeper: a layer, not a constant
    assert roots("f(module_cells) + module_cells.HIDDEN") == set()  # read bare
    assert roots("torch.pi * 2") == set()  # torch's own (already allowed)
