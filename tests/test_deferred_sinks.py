"""Sinks a demand flush leaves pending (scheduler.unneeded, config.DEFER_UNNEEDED): what
an instance computes and reads neither itself nor through another op (a summary it
returns) waits for a later flush and batches with the other instances' there; map ==
eager either way, and a deferred value read later is computed when it is needed."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import acrobat
from acrobat import scheduler
from acrobat.graph import Node
from acrobat.tensor import _native
from tests.helpers import check_map

torch.manual_seed(0)
W = torch.randn(5, 5) / 2


@acrobat.autobatch
def walk(x, limit):
    """Steps while a value says so; each instance ends at its own round and returns its
    states joined (recorded as it ends, read by nothing) and a summary it reads."""
    states = [x]
    while len(states) <= limit and float(states[-1].sum()) > -1.0:
        states.append(torch.tanh(states[-1] @ W))
    joined = torch.cat(states)  # a sink
    summary = torch.stack(states).mean(0)  # read at once
    return joined, float(summary.sum()), len(states)


def _inputs(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, generator=g) * 2 for _ in range(n)]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 7), limit=st.integers(0, 6))
def test_deferred_sinks_keep_map_equal_to_eager(seed, n, limit):
    xs = _inputs(seed, n)
    for defer in (True, False):
        with torch.no_grad(), acrobat.config.override(DEFER_UNNEEDED=defer):
            check_map(walk, xs, limit=limit)


def _ends(xs, limit):
    return len({walk.eager(x, limit=limit)[2] for x in xs})


def test_returned_sinks_of_instances_ending_apart_run_as_one_batch():
    xs = _inputs(3, 8)
    assert _ends(xs, 6) >= 3  # instances end in different rounds: a stack at each
    with torch.no_grad(), acrobat.config.override(AUTO_BLOCKS=False):
        on = check_map(walk, xs, limit=6)
        with acrobat.config.override(DEFER_UNNEEDED=False):
            off = check_map(walk, xs, limit=6)
    # the returned cats wait for the last flush; the summaries' stacks are read (their
    # means are), so they run where each instance ends, as before
    assert off.batches_of("cat") == _ends(xs, 6)
    assert on.batches_of("cat") == 1
    assert on.batches_of("stack") == off.batches_of("stack") == _ends(xs, 6)
    assert on.nodes == off.nodes and on.flushes == off.flushes


def test_a_deferred_node_read_later_is_computed_first():
    @acrobat.autobatch
    def late(x, rounds):
        side = torch.sigmoid(x)  # read by nothing until the last round
        for _ in range(rounds):
            x = torch.tanh(x @ W)
            if float(x.sum()) > 10:  # (a value read per round: a flush per round)
                break
        return float((side * x).sum())

    xs = _inputs(5, 6)
    with torch.no_grad():
        stats = check_map(late, xs, rounds=4)
    assert stats.flushes >= 4


def _node(used=0, demanded=False):
    nd = Node(None, None, (), {}, [], None, None, 0, 0, 0, None)
    nd.used, nd.demanded = used, demanded
    return nd


@pytest.mark.parametrize("native", [False, True])
def test_unneeded_picks_buckets_of_unread_undemanded_nodes(native):
    if native and _native is None:
        pytest.skip("acrobat._native is not built")
    find = _native.unneeded if native else scheduler.unneeded
    batches = [
        [_node(), _node()],  # sinks nobody waits for: pending
        [_node(), _node(used=1)],  # one is read: the bucket runs whole
        [_node(demanded=True), _node()],  # one is waited for
        [_node(used=2)],
        [_node()],
    ]
    assert find(batches) == [0, 4]
    assert find([]) == []
