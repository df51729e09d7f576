"""Every op of torch's OpInfo database (``op_db``: ~700 ops, their sample inputs) on
per-instance tensors: ``f.map`` equals the eager loop, or raises UnsupportedOpError.
``bench/op_sweep.py`` runs the sweep (in a process of its own: torch's testing internals
read the command line and set state at import); a mismatch is a wrong result."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("expecttest")  # (torch.testing._internal imports it)

ROOT = Path(__file__).resolve().parents[1]


# the four sweeps, by the flags they run with, and the test that reads each
SWEEPS = {
    (): "test_every_opinfo_sample_batches_as_eager_or_says_it_cannot",
    ("--ragged",): "test_every_opinfo_sample_of_varying_lengths_batches_as_eager",
    ("--grad",): "test_every_opinfo_sample_trains_as_eager",
    ("--grad", "--ragged"): "test_every_opinfo_sample_of_varying_lengths_trains_as_eager",
}


@pytest.fixture(scope="module")
def sweeps(request, tmp_path_factory) -> Iterator[dict]:
    """The sweeps the session's selected tests read, two at a time (each is mostly one
    Python thread: on two cores two take the time of one), as futures of their
    (return code, stderr, output path) by their flags."""
    selected = {item.name for item in request.session.items}
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {}
    for flags, test in SWEEPS.items():
        if test in selected:
            out = tmp_path_factory.mktemp("sweep") / "sweep"
            futures[flags] = pool.submit(_run_sweep, out, flags)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def _run_sweep(out: Path, flags: tuple) -> tuple:
    command = [sys.executable, "-m", "bench.op_sweep", "--samples", "2", "--out", str(out)]
    run = subprocess.run(
        [*command, *flags], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    return run.returncode, run.stderr, out


def _sweep(sweeps: dict, *flags) -> Counter:
    returncode, stderr, out = sweeps[flags].result()
    assert returncode == 0, stderr[-3000:]
    records = json.loads(out.with_suffix(".json").read_text())
    wrong = [r["detail"] for r in records if r["outcome"] in ("mismatch", "error")]
    assert not wrong, "\n".join(wrong)
    return Counter(r["outcome"] for r in records)


def test_every_opinfo_sample_batches_as_eager_or_says_it_cannot(sweeps):
    counts = _sweep(sweeps)
    # session 42: 685 of 1922 samples (3 an op) batched before the generic vmap rows, 1628
    # after; with 2 an op, about 1100. Fewer means ops that batched stopped batching.
    assert counts["ok"] >= 1000, counts


def test_every_opinfo_sample_of_varying_lengths_batches_as_eager(sweeps):
    """The op in an explicit block, instances whose first dims have three lengths: its
    traces join a padding family where the op's padding allows (112 ops ran padded
    batches in session 42's run), the others run a batch per length."""
    counts = _sweep(sweeps, "--ragged")
    assert counts["ok"] >= 800, counts


def test_every_opinfo_sample_trains_as_eager(sweeps):
    """Training: gradients of a loss over the outputs, for every instance's input and the
    sample's shared float tensors, equal the eager loop's (torch.vmap's backward of
    select_scatter gave its shared source 5x its gradient: generic rows that autograd
    records run instance by instance)."""
    counts = _sweep(sweeps, "--grad")
    assert counts["ok"] >= 800, counts


def test_every_opinfo_sample_of_varying_lengths_trains_as_eager(sweeps):
    """Training over padded runs: gradients equal eager's (pads take no gradient)."""
    counts = _sweep(sweeps, "--grad", "--ragged")
    assert counts["ok"] >= 600, counts
