"""Shape and dtype inference (graph.infer): what a recorded op's outputs will be, without
computing them. Sources, in order: a rule (F.linear), the op on CPU ones when its
operands are small, torch's meta kernels, zeros of the real shapes. Each must give what
eager torch gives; the cheap ones must keep torch._dynamo out of a first map."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from acrobat import graph
from acrobat.errors import ShapeError
from acrobat.ops import FUNCS, TABLE

ROOT = Path(__file__).resolve().parent.parent
_DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool]
_FUNCS = [torch.add, torch.mul, torch.where, torch.maximum, torch.div, torch.tanh, torch.eq]
_FUNCS += [torch.cat, torch.stack]


_RT = SimpleNamespace(device=torch.device("cpu"), fiber=None, autocast=None)  # what infer reads


def _info(func, *args, **kwargs):
    graph._SHAPE_CACHE.clear()
    return graph.infer(FUNCS[func], func, args, kwargs, _RT)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    lead=st.lists(st.integers(1, 3), max_size=2),
    dtypes=st.tuples(st.sampled_from(_DTYPES), st.sampled_from(_DTYPES)),
    func=st.sampled_from(_FUNCS),
)
def test_inferred_outputs_are_eagers(shape, lead, dtypes, func):
    a = torch.ones(shape, dtype=dtypes[0])
    b = torch.ones([*lead, *shape], dtype=dtypes[1])
    if func is torch.where:
        args = (a > 0, a, b)
    elif func is torch.tanh:
        args = (b,)
    elif func in (torch.cat, torch.stack):
        args = ([a, a.to(dtypes[1])],)
    else:
        args = (a, b)
    try:
        want = func(*args)
    except Exception:
        with pytest.raises(ShapeError):
            _info(func, *args)
        return
    info = _info(func, *args)
    assert info.metas == ((want.shape, want.dtype),)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_rule_matches_torch(bias, dtype):
    x, w = torch.ones(2, 3, 5, dtype=dtype), torch.ones(4, 5, dtype=dtype)
    b = torch.ones(4, dtype=dtype) if bias else None
    want = F.linear(x, w, b)
    assert _info(F.linear, x, w, b).metas == ((want.shape, want.dtype),)
    with pytest.raises(ShapeError):  # not plain: the generic path and its error
        _info(F.linear, x, torch.ones(4, 6, dtype=dtype))
    assert graph._linear_shape((x, w.to(torch.float16)), {}) is None  # mixed: generic path
    assert graph._linear_shape((x, w), {"bias": b}) is None


def test_ones_that_do_not_fit_fall_back_to_meta():
    x = torch.ones(1, 3)
    index = torch.zeros(1, 2, dtype=torch.long)  # ones would index row 1 of 1
    info = _info(torch.gather, x, 0, index)
    assert info.metas == ((torch.Size([1, 2]), torch.float32),)


def test_large_operands_and_random_ops_do_not_run():
    big = torch.ones(graph.CPU_SHAPES_MAX + 1)
    state = torch.get_rng_state()
    assert _info(torch.tanh, big).metas == ((big.shape, big.dtype),)
    op = TABLE["rand_like"]
    graph._SHAPE_CACHE.clear()
    info = graph.infer(op, torch.rand_like, (torch.ones(3),), {}, _RT)
    assert info.metas == ((torch.Size([3]), torch.float32),)
    assert torch.equal(torch.get_rng_state(), state)  # no draw from the generator


def test_a_first_map_does_not_import_dynamo():
    code = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, {root!r})
        if "torch._dynamo" in sys.modules:
            print("SKIP")
            raise SystemExit
        from models import treelstm
        task = treelstm.make_task("small", 4, blocks=False)
        with torch.no_grad():
            task.fn.map(task.inputs, **task.kwargs)
        print("torch._dynamo" in sys.modules)
        """
    ).format(root=str(ROOT))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.strip().splitlines()[-1]
    if out == "SKIP":
        pytest.skip("this torch imports torch._dynamo with torch")
    assert out == "False"
