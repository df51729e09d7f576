"""The models with tensor-dependent control flow: NestedRNN, DRNN, Berxit, StackRNN.

Each model's eager outputs must be well-formed, and every other way of running
it (hand-batched PyTorch, ``fn.map``, DyNet) must take the same control
decisions (tree shapes, exit layers, parser actions) and compute the same values
up to float tolerance.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from bench.dynet_models import available as dynet_available
from models import berxit, drnn, nestedrnn, stackrnn
from models.common import outputs_close, run_eager

MODELS = ["nestedrnn", "drnn", "berxit", "stackrnn"]
ATOL = RTOL = 1e-4


def make_task(name: str, batch: int, blocks: bool = True, seed: int = 0):
    return importlib.import_module(f"models.{name}").make_task("small", batch, seed, blocks)


def decisions(name: str, output) -> object:
    """The control decisions an output records (None for NestedRNN, which reads no values)."""
    if name == "drnn":
        return list(output[1])  # parent of each node: the tree's shape
    if name == "berxit":
        return int(output[1])  # layers used
    if name == "stackrnn":
        return [int(a) for a in output[0]]  # parser actions
    return None


def assert_same_run(name: str, got: list, want: list) -> None:
    """``got`` takes the decisions of ``want`` and matches its values within tolerance."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert decisions(name, g) == decisions(name, w), f"instance {i}: control decisions differ"
    check = outputs_close(got, want, atol=ATOL, rtol=RTOL)
    assert check, check.message


@pytest.fixture(scope="module")
def eager_small_8() -> dict:
    """Tasks (blocks) and eager outputs at batch 8, shared by the tests of this file."""
    cache = {}
    for name in MODELS:
        task = make_task(name, batch=8)
        with torch.no_grad():
            cache[name] = (task, run_eager(task))
    return cache


# --- eager outputs -----------------------------------------------------------------------


def test_nestedrnn_eager_outputs(eager_small_8):
    task, outputs = eager_small_8["nestedrnn"]
    for instance, g in zip(task.inputs, outputs):
        assert g.shape == (task.model.hidden,) and torch.isfinite(g).all()
        assert nestedrnn.MIN_TRIPS <= len(instance.trips) <= nestedrnn.MAX_TRIPS
        assert all(nestedrnn.MIN_TRIPS <= k <= nestedrnn.MAX_TRIPS for k in instance.trips)


def test_drnn_eager_outputs_are_trees_within_the_caps(eager_small_8):
    _, outputs = eager_small_8["drnn"]
    for logits, parents in outputs:
        assert logits.shape == (len(parents), drnn.NUM_LABELS) and torch.isfinite(logits).all()
        assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i > 0)
        depth = [0] * len(parents)
        for i, p in enumerate(parents[1:], start=1):
            depth[i] = depth[p] + 1
        assert max(depth) <= drnn.MAX_DEPTH
        assert max(parents.count(p) for p in set(parents)) <= drnn.MAX_SIBLINGS
    sizes = {len(parents) for _, parents in outputs}
    assert len(sizes) >= 3, f"tree sizes should vary, got {sorted(sizes)}"


def test_berxit_eager_outputs_exit_at_varied_depths(eager_small_8):
    _, outputs = eager_small_8["berxit"]
    for logits, layers in outputs:
        assert isinstance(layers, int) and 1 <= layers <= berxit.MAX_LAYERS
        assert logits.shape == (berxit.NUM_CLASSES,) and torch.isfinite(logits).all()
        confident = torch.softmax(logits, -1).max() > berxit.THRESHOLD
        assert confident or layers == berxit.MAX_LAYERS
    assert len({layers for _, layers in outputs}) >= 3


def test_stackrnn_eager_outputs_are_valid_parses(eager_small_8):
    task, outputs = eager_small_8["stackrnn"]
    used = set()
    for words, (actions, h) in zip(task.inputs, outputs):
        assert actions.dtype == torch.int64 and len(actions) == 2 * len(words) - 1
        assert h.shape == (task.model.hidden,) and torch.isfinite(h).all()
        stack = shifted = 0
        for action in actions.tolist():
            if action == stackrnn.SHIFT:
                shifted, stack = shifted + 1, stack + 1
            else:
                assert stack >= 2, "an arc needs two stack elements"
                stack -= 1
            assert shifted <= len(words)
        assert (shifted, stack) == (len(words), 1)
        used.update(actions.tolist())
    assert used == {stackrnn.SHIFT, stackrnn.LEFT_ARC, stackrnn.RIGHT_ARC}


@pytest.mark.parametrize("name", MODELS)
def test_make_task_is_deterministic(name):
    a, b = make_task(name, batch=2), make_task(name, batch=2, blocks=False)
    with torch.no_grad():
        assert outputs_close(run_eager(a), run_eager(b), atol=0, rtol=0)
    other_seed = make_task(name, batch=2, seed=1)
    assert not torch.equal(next(other_seed.model.parameters()), next(a.model.parameters()))


# --- baselines and the batched run -------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_hand_batched_matches_eager(name, eager_small_8):
    task, want = eager_small_8[name]
    hand = importlib.import_module(f"bench.hand.{name}")
    with torch.no_grad():
        got = hand.run(task)
    assert_same_run(name, got, want)


def test_drnn_floor_variants_take_the_eager_decisions(eager_small_8):
    """bench/floor.py's variants (decisions from a table, no forks, stubbed tensors) build
    the eager trees: the floor they measure is the model's."""
    from bench import floor

    task, want = eager_small_8["drnn"]
    tables = floor.decision_tables(task)
    with torch.no_grad():
        for fn in (floor.no_reads, floor.no_reads_no_forks):
            got, stats = fn.map(task.inputs, tables, model=task.model, stats=True)
            assert_same_run("drnn", got, want)
            assert stats.flushes == 1  # nothing read before the end
    assert floor.user_python(task, tables) == [parents for _, parents in want]


@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "plain"])
@pytest.mark.parametrize("name", MODELS)
def test_map_matches_eager(name, blocks, eager_small_8):
    task = make_task(name, batch=8, blocks=blocks)
    with torch.no_grad():
        got = task.fn.map(task.inputs, **task.kwargs)
    assert_same_run(name, got, eager_small_8[name][1])


@pytest.mark.skipif(not dynet_available(), reason="DyNet (dynet38) is not installed")
@pytest.mark.parametrize("name", MODELS)
def test_dynet_matches_eager(name):
    from bench.dynet_models import configure

    configure(autobatch=1, mem="256")  # once per process: DyNet reads it at first import
    dynet_model = importlib.import_module(f"bench.dynet_models.{name}")
    task = make_task(name, batch=4)
    with torch.no_grad():
        want = run_eager(task)
    assert_same_run(name, dynet_model.run(task), want)
