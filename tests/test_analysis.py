"""Automatic coarsening: straight-line functions reachable from an autobatched function
run as blocks inside f.map, with the same results, and fall back safely."""

import random

import pytest
import torch
from torch import nn

import acrobat
from acrobat import analysis
from tests.helpers import check_map

lin = nn.Linear(8, 8)
SCALE = 0.5
COUNTER = []


def cell(x, h):
    """A straight-line cell."""
    a, b = lin(torch.cat([x, h])[:8]).chunk(2)
    return torch.tanh(a) * torch.sigmoid(b) * SCALE


def cell_with_comprehension(x):
    y, z = (t * 2 for t in x.chunk(2))
    return y + z


def branchy(x):
    if x.sum() > 0:
        return x
    return -x


def side_effect(x):
    COUNTER.append(1)
    return x * 2


def writes_attribute(m, x):
    m.cache = x
    return x


def reads_value(x):
    k = int(x.argmax())
    return x * k


CELLS = (cell, reads_value)


@acrobat.autobatch
def run(xs):
    h = torch.zeros(4)
    outs = []
    for x in xs:
        h = CELLS[0](x, h)
        outs.append(h)
    return torch.stack(outs), CELLS[1](h)


def test_straight_line_verdicts():
    assert analysis.straight_line(cell)
    assert analysis.straight_line(cell_with_comprehension)
    assert analysis.straight_line(reads_value)  # statically fine; tracing will fall back
    assert not analysis.straight_line(branchy)
    assert not analysis.straight_line(side_effect)
    assert not analysis.straight_line(writes_attribute)
    assert not analysis.straight_line(lambda x: x)
    assert not analysis.straight_line(torch.tanh)


def test_discovery_follows_containers_and_control_flow_functions():
    found = {f.__name__ for f in analysis.discover(run)}
    assert found == {"cell", "reads_value"}


def test_auto_blocks_match_eager_and_record_one_node_per_cell_call():
    rng = random.Random(0)
    seqs = [[torch.randn(4) for _ in range(rng.randint(1, 6))] for _ in range(8)]
    with torch.no_grad():
        stats = check_map(run, seqs)
        with acrobat.config.override(AUTO_BLOCKS=False):
            per_op = check_map(run, seqs)
    calls = sum(len(s) for s in seqs)
    assert stats.by_op["block:cell"][1] == calls
    assert stats.nodes < per_op.nodes
    # reads_value demands a value: it fell back to per-op recording and still matches
    assert "block:reads_value" not in stats.by_op


def test_code_is_restored_after_map_and_after_errors():
    original = cell.__code__

    @acrobat.autobatch
    def boom(x):
        cell(x, x)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        boom.map([torch.randn(4)])
    assert cell.__code__ is original
    run.map([[torch.randn(4)]])
    assert cell.__code__ is original
    # and the function still works eagerly, with its own code
    x = torch.ones(4)
    torch.testing.assert_close(cell(x, torch.zeros(4)), run.eager([x])[0][0])


def test_side_effects_are_not_coarsened():
    @acrobat.autobatch
    def f(x):
        return side_effect(torch.tanh(x))

    COUNTER.clear()
    f.map([torch.randn(3) for _ in range(4)])
    assert len(COUNTER) == 4  # once per instance, as in the eager loop


def draws_noise(x):
    return x + torch.randn(4)


def uses_python_random(x):
    return x * random.random()


def test_random_functions_are_not_coarsened():
    assert not analysis.straight_line(draws_noise)
    assert not analysis.straight_line(uses_python_random)
