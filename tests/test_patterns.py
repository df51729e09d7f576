"""Every pattern of bench/patterns.py (plain per-instance code as users write it) maps to
the eager loop's outputs on a few instances of mixed sizes, and its training step gives
the eager gradients: the bench times them, this keeps them right."""

from __future__ import annotations

import pytest
import torch

import acrobat
from bench import patterns


@pytest.mark.parametrize("name", sorted(patterns.PATTERNS))
def test_pattern_map_equals_eager(name):
    p = patterns.PATTERNS[name]
    model = patterns.Model().eval()
    data = patterns.make_data(p.data, 6, seed=3)
    f = acrobat.autobatch(p.fn)
    with torch.no_grad():
        want = [p.fn(x, model) for x in data]
        for _ in range(2):  # (the second map runs what the first decided: cuts, padding)
            got = f.map(data, m=model)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    if p.train:
        outs = f.map(data, m=model)
        torch.stack(outs).sum().backward()
        grads = {k: q.grad.clone() for k, q in model.named_parameters() if q.grad is not None}
        model.zero_grad()
        torch.stack([p.fn(x, model) for x in data]).sum().backward()
        for k, q in model.named_parameters():
            if q.grad is not None:
                torch.testing.assert_close(grads[k], q.grad, atol=1e-4, rtol=1e-4, msg=k)
