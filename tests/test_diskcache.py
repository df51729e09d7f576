"""The kernels' disk cache (acrobat_kernels/diskcache.py, acrobat_kernels/loops.py): a later
process loads the linear and Elman loops and their thread-split entries instead of
compiling them, and they compute what torch computes; the stamp covers every kernel file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from acrobat_kernels import diskcache, parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs in a fresh process: compiles or loads the kernels, checks them against torch (both
# split over torch's two threads), prints where each came from.
_PROBE = textwrap.dedent(
    """
    import json, torch
    import torch.nn.functional as F
    from acrobat_kernels import gemm, loops, parallel, recurrence
    torch.manual_seed(0)
    torch.set_num_threads(2)
    gemm.PARALLEL_WORK = recurrence.PARALLEL_WORK = 0
    linear, linear_entry = loops.linear_kernels()
    elman, elman_entry = loops.elman_kernels()
    x, w, b = torch.randn(40, 24), torch.randn(33, 24), torch.randn(33)
    for split_rows in (True, False):  # by rows of x, by rows of W (few rows)
        gemm.COLUMNS_BELOW = 0 if split_rows else 1 << 20
        torch.testing.assert_close(gemm.run_linear(x, w, b), F.linear(x, w, b))
        torch.testing.assert_close(
            gemm.run_linear_tanh(x, w, b), torch.tanh(F.linear(x, w, b)), atol=1e-6, rtol=1e-5
        )
    h0, u = torch.randn(9, 16), torch.randn(16, 16) / 4
    c = torch.randn(9, 16)
    states, final = recurrence.run(h0, c, u, None, [9, 9], [0, 9], False)
    h1 = torch.tanh(h0 @ u.T + c)
    torch.testing.assert_close(states[:9], h1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, torch.tanh(h1 @ u.T + c), atol=1e-5, rtol=1e-5)
    hits = lambda d: sum(d.stats.cache_hits.values())
    print(json.dumps({
        "linear": hits(linear), "elman": hits(elman),
        "entries": {k: f.cache_hits for k, f in loops.ENTRIES.items()},
        "threaded": bool(linear_entry and elman_entry),
    }))
    """
)


def _probe(cache_dir) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir), PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not parallel.available(), reason="torch's OpenMP runtime is not libgomp")
def test_a_later_process_loads_the_loops_and_their_entries_from_the_cache(tmp_path):
    first = _probe(tmp_path)
    assert first["threaded"]
    assert first["linear"] == 0 and first["elman"] == 0  # compiled: an empty cache
    assert first["entries"] == {"_linear_part": 0, "_elman_part": 0}
    entries = _cached_objects(tmp_path)
    second = _probe(tmp_path)  # same results (checked inside), now from the cache
    assert second["linear"] == 1 and second["elman"] == 1
    assert second["entries"] == {"_linear_part": 1, "_elman_part": 1}
    assert _cached_objects(tmp_path) == entries  # a hit adds nothing to the cache


def _cached_objects(directory) -> int:
    return sum(name.endswith(".nbc") for _, _, names in os.walk(directory) for name in names)


def test_the_stamp_changes_with_any_kernel_file_and_only_then(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not a source\n")
    stamp = diskcache.sources_stamp(str(tmp_path))
    assert diskcache.sources_stamp(str(tmp_path)) == stamp
    (tmp_path / "notes.txt").write_text("changed, still not a source\n")
    assert diskcache.sources_stamp(str(tmp_path)) == stamp
    (tmp_path / "b.py").write_text("y = 3\n")  # a callee's file
    changed = diskcache.sources_stamp(str(tmp_path))
    assert changed != stamp
    (tmp_path / "c.py").write_text("")  # a new file
    assert diskcache.sources_stamp(str(tmp_path)) not in (stamp, changed)


def test_the_package_locators_take_this_package_only():
    diskcache.install()
    diskcache.install()  # once per process
    impl = diskcache.cache_impl()
    ours = [c for c in impl._locator_classes if c.__name__.startswith("Acrobat")]
    assert len(ours) == 3 and impl._locator_classes[:3] == ours

    def f():
        return 1

    here = os.path.join(diskcache.HERE, "loops.py")
    for cls in ours:
        assert cls.from_function(f, __file__) is None  # another directory: numba's own
    in_tree = next(c for c in ours if "InTree" in c.__name__).from_function(f, here)
    if in_tree is not None:  # (None where the package's __pycache__ cannot be written)
        assert in_tree.get_source_stamp() == diskcache.sources_stamp()


def test_without_numbas_hook_nothing_is_installed(monkeypatch):
    from numba.core import caching

    monkeypatch.setattr(diskcache, "_installed", None)
    monkeypatch.delattr(caching, "UserWideCacheLocator")
    before = list(diskcache.cache_impl()._locator_classes)
    assert diskcache.install() is False  # the kernels then compile without the cache
    assert diskcache.cache_impl()._locator_classes == before


# The generated elementwise kernels (acrobat_kernels/elementwise.py): a module file per
# program in ACROBAT_CACHE_DIR, compiled once and loaded by later processes.
_EW_PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from acrobat_kernels import elementwise as ew
    torch.manual_seed(0)
    p = ew.lstm_cell_tail()
    n, F = 6, 40
    gates, c = torch.randn(10, 4 * F), torch.randn(7, F)
    rows, c_rows = torch.randint(0, 10, (n,)), torch.randint(0, 7, (n,))
    sources = [(gates[:, k * F:(k + 1) * F], rows) for k in range(4)] + [(c, c_rows)]
    want = ew.run(p, n, F, sources, backend="torch")
    got = ew.run(p, n, F, sources, backend="numba")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    kernel = ew._numba_kernels[p]
    modules = [m for m in sys.modules if m.startswith("acrobat_kernels.generated.")]
    print(json.dumps({"hits": kernel.cache_hits, "modules": modules}))
    """
)


def test_a_later_process_loads_the_generated_elementwise_kernels(tmp_path):
    env = dict(os.environ, ACROBAT_CACHE_DIR=str(tmp_path / "acrobat"),
               NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=ROOT)  # fmt: skip

    def probe() -> dict:
        done = subprocess.run([sys.executable, "-c", _EW_PROBE], env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = probe(), probe()
    assert first["hits"] == 0 and second["hits"] >= 1  # compiled once, then loaded
    (module,) = first["modules"]  # the program's module, imported from its file
    (folder,) = (tmp_path / "acrobat").iterdir()  # one folder per stamp of the sources
    assert folder.name == "kernels-" + diskcache.sources_stamp()[:16]
    assert [f.name for f in folder.glob("ew_*.py")] == [module.rsplit(".", 1)[1] + ".py"]
