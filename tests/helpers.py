"""Shared test helpers: the map == [eager] oracle and schedule-shape checks."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch


def random_rows(sizes: list[int], seed: int, dim: int) -> list:
    """One standard normal (n, dim) tensor per n of ``sizes``, from ``seed``: ragged rows."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=g) for n in sizes]


def assert_close_tree(got, want, atol=1e-5, rtol=1e-5, path="out"):
    """Nested tuples/lists/dicts of tensors and Python values are equal up to tolerance."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: got {type(got).__name__}, want a tensor"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        if want.dtype.is_floating_point:
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=path)
        else:
            assert torch.equal(got, want), f"{path}: {got} != {want}"
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close_tree(g, w, atol, rtol, f"{path}[{i}]")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), f"{path}: keys differ"
        for k in want:
            assert_close_tree(got[k], want[k], atol, rtol, f"{path}[{k!r}]")
    elif isinstance(want, float):
        assert isinstance(got, float), f"{path}: {got!r} is not a float"
        assert math.isclose(got, want, rel_tol=rtol, abs_tol=atol), f"{path}: {got} != {want}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def check_map(f, inputs, atol=1e-5, rtol=1e-5, **shared):
    """The contract: f.map(inputs) == [f.eager(x) for x in inputs]. Returns the stats."""
    got, stats = f.map(inputs, stats=True, **shared)
    want = [f.eager(x, **shared) for x in inputs]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close_tree(g, w, atol, rtol, path=f"instance {i}")
    return stats


def check_schedule(stats, *, batches=None, max_batches=None, launches=None, suspensions=None):
    """Assert the schedule's shape, not only the values (catches correct-but-slow changes)."""
    if batches is not None:
        assert stats.batches == batches, f"{stats.batches} batches, expected {batches}: {stats}"
    if max_batches is not None:
        assert stats.batches <= max_batches, f"{stats.batches} batches > {max_batches}: {stats}"
    if launches is not None:
        assert stats.launches == launches, f"{stats.launches} launches != {launches}: {stats}"
    if suspensions is not None:
        assert stats.suspensions == suspensions, f"{stats.suspensions} suspensions: {stats}"


def check_grads(f, inputs, module, atol=1e-6, rtol=1e-5, **shared):
    """Training: the gradients of ``module``'s parameters after a backward through
    ``f.map(inputs)`` equal those through the eager loop (loss: the sum of every output's
    squares). Returns the map's stats."""

    def loss(outputs):
        return torch.stack([o.square().sum() for o in outputs]).sum()

    module.zero_grad()
    outputs, stats = f.map(inputs, stats=True, **shared)
    loss(outputs).backward()
    got = {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    loss([f.eager(x, **shared) for x in inputs]).backward()
    want = {k: p.grad for k, p in module.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}"
        )
    return stats


class TreeNet(torch.nn.Module):
    """A leaf layer and a two-child mix of width ``hidden``: the cells of the small tree
    models the tests write (tests/test_type_checks.py, tests/test_objects.py)."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.leaf = torch.nn.Linear(hidden, hidden)
        self.mix = torch.nn.Linear(2 * hidden, hidden)


@contextlib.contextmanager
def outlined_with(fn, **flags):
    """``fn`` (a function, or an autobatched one) outlined afresh with acrobat.analysis's
    ``flags`` set (``LOOP_ROW_WRITES=False``...), and afresh again after: what analysis
    does with a rewrite off."""
    from acrobat import analysis

    key = analysis._code_key(getattr(fn, "fn", fn))

    def forget():  # (its outlines for every set of the map's flow names: outline's keys)
        for k in [k for k in analysis._OUTLINED if k[:2] == key]:
            del analysis._OUTLINED[k]

    forget()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in flags.items():
                mp.setattr(analysis, name, value)
            yield
    finally:
        forget()
