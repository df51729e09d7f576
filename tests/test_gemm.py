"""The linear kernel (acrobat_kernels/gemm.py) against torch, on one thread and split over
torch's OpenMP threads (acrobat_kernels/parallel.py), and the runtime's
online choice between it and torch's GEMM (acrobat.ops.batched_linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import acrobat
from acrobat import choice, config, ops
from acrobat_kernels import gemm, parallel


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, gemm.MAX_ROWS),
    k=st.integers(1, 70),
    n=st.integers(1, 40),
    spare=st.integers(0, 9),  # extra columns of W's storage: W is a column view
    bias=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_kernel_matches_torch(rows, k, n, spare, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    storage = torch.randn(n, k + spare, generator=gen)
    w = storage[:, spare:]  # rows k + spare apart, each contiguous
    b = torch.randn(n, generator=gen) if bias else None
    y = torch.randn(rows, n, generator=gen)
    assert gemm.usable_linear(x, w, b) and gemm.usable_addmm(y, x, w)
    tol = dict(rtol=1e-5, atol=1e-5 * k)  # the sum over k is reassociated
    torch.testing.assert_close(gemm.run_linear(x, w, b), F.linear(x, w, b), **tol)
    torch.testing.assert_close(gemm.run_addmm(y, x, w), torch.addmm(y, x, w.t()), **tol)


@pytest.mark.skipif(not parallel.available(), reason="torch's OpenMP runtime is not libgomp")
@pytest.mark.parametrize("rows", [2, 6, 9, 63, 200, 1001])
@pytest.mark.parametrize("by", ["rows", "columns"])
def test_products_split_over_torchs_threads_match_torch(rows, by, monkeypatch):
    """Every row range (or column range of W) of the split (uneven, not a multiple of
    eight, fewer rows than threads' blocks) is computed once, with its own part of a
    per-row addend and of the bias."""
    launches = []
    real = parallel.run
    monkeypatch.setattr(parallel, "run", lambda *a: launches.append(a) or real(*a))
    monkeypatch.setattr(gemm, "PARALLEL_WORK", 0)
    monkeypatch.setattr(gemm, "COLUMNS_BELOW", 1 << 30 if by == "columns" else 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, 257, generator=gen)
        w = torch.randn(129, 260, generator=gen)[:, 3:]  # a column view: rows spaced
        b, y = torch.randn(129, generator=gen), torch.randn(rows, 129, generator=gen)
        tol = dict(rtol=1e-5, atol=3e-3)
        torch.testing.assert_close(gemm.run_linear(x, w, b), F.linear(x, w, b), **tol)
        torch.testing.assert_close(gemm.run_linear(x, w, None), F.linear(x, w), **tol)
        torch.testing.assert_close(gemm.run_addmm(y, x, w), torch.addmm(y, x, w.t()), **tol)
    finally:
        torch.set_num_threads(threads)
    # by rows, up to one block of four rows: one thread
    assert len(launches) == (3 if rows > 4 or by == "columns" else 0)


def test_a_linear_layer_over_sequences_runs_on_their_rows():
    gen = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((5, 7, 16), (9, 16), (9,)))
    assert gemm.usable_linear(x, w, b) and gemm.usable_linear(x[None], w, None)
    torch.testing.assert_close(gemm.run_linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gemm.run_linear(x[None], w, None), F.linear(x[None], w))
    assert not gemm.usable_linear(x.transpose(0, 1), w, b)  # not contiguous
    assert not gemm.usable_addmm(torch.randn(35, 9), x, w)  # addmm: matrices only
    big = torch.randn(2, gemm.MAX_ROWS // 2 + 1, 16)
    assert not gemm.usable_linear(big, w, b)  # more rows than MAX_ROWS in all


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 40),
    k=st.integers(1, 50),
    n=st.integers(1, 30),
    spare=st.integers(0, 5),
    addend=st.sampled_from(["none", "bias", "rows"]),
    seed=st.integers(0, 1000),
)
def test_the_kernels_backward_gives_torchs_gradients(rows, k, n, spare, addend, seed):
    """Under autograd (grad_ok) the product keeps the kernel and its backward runs the
    kernel on transposed copies or torch's ops, as the online choice tries each: every
    call's gradients, for x, a column view of W (through to its storage) and the addend,
    are torch's."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).requires_grad_()
    storage = torch.randn(n, k + spare, generator=gen).requires_grad_()
    w = storage[:, spare:]
    c = {"none": None, "bias": torch.randn(n, generator=gen), "rows": torch.randn(rows, n)}
    c = c[addend].requires_grad_() if c[addend] is not None else None
    g = torch.randn(rows, n, generator=gen)
    inputs = [t for t in (x, storage, c) if t is not None]
    if addend == "rows":
        assert gemm.usable_addmm(c, x, w, grad_ok=True) and not gemm.usable_addmm(c, x, w)
        want = torch.autograd.grad(torch.addmm(c, x, w.t()), inputs, g)
    else:
        assert gemm.usable_linear(x, w, c, grad_ok=True) and not gemm.usable_linear(x, w, c)
        want = torch.autograd.grad(F.linear(x, w, c), inputs, g)
    tol = dict(rtol=1e-5, atol=1e-5 * max(k, rows, n))
    for _ in range(9):  # warm-ups and trials of both backward variants, then the choice
        out = gemm.run_addmm(c, x, w) if addend == "rows" else gemm.run_linear(x, w, c)
        assert out.grad_fn is not None and "Product" in type(out.grad_fn).__name__
        for got, expected in zip(torch.autograd.grad(out, inputs, g), want):
            torch.testing.assert_close(got, expected, **tol)


def test_transposed_weights_are_kept_until_the_weight_changes(monkeypatch):
    monkeypatch.setattr(gemm, "_transposed", type(gemm._transposed)())
    w = torch.nn.Parameter(torch.randn(6, 9))
    first = gemm.transposed(w)
    assert torch.equal(first, w.detach().t()) and first.is_contiguous()
    assert gemm.transposed(w) is first  # unchanged: the same copy
    with torch.no_grad():
        w.add_(1.0)  # an optimizer step, in place
    second = gemm.transposed(w)
    assert second is not first and torch.equal(second, w.detach().t())
    view = torch.randn(6, 12)[:, 3:]  # a column view: its own key
    assert torch.equal(gemm.transposed(view), view.t())
    monkeypatch.setattr(gemm, "TRANSPOSED_BYTES", 2 * second.nbytes)
    for _ in range(4):
        gemm.transposed(torch.randn(6, 9))
    assert sum(e[2].nbytes for e in gemm._transposed.values()) <= 2 * second.nbytes


def test_the_kernels_gradients_are_differentiable_again():
    """create_graph: the backward is torch's ops, so a gradient of a gradient is exact."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=gen).requires_grad_()
    w = torch.randn(3, 7, generator=gen).requires_grad_()
    got = []
    for product in (gemm.run_linear(x, w, None), F.linear(x, w)):
        (gx,) = torch.autograd.grad(product.pow(2).sum(), x, create_graph=True)
        got.append(torch.autograd.grad(gx.pow(2).sum(), w)[0])
    torch.testing.assert_close(got[0], got[1])


def test_kernels_compile_without_a_cache_location():
    """gemm._jit caches on disk where numba can; a function without a source file (no
    cache location, as in a read-only install) still compiles, uncached."""
    namespace: dict = {}
    exec("def add_one(a):\n    return a + 1\n", namespace)
    compiled = gemm._jit(namespace["add_one"])
    assert compiled(41) == 42
    assert type(compiled._cache).__name__ == "NullCache"
    gemm._run(torch.randn(3, 4), torch.randn(2, 4), None, 0)  # the module's kernels
    assert type(gemm._kernel._cache).__name__ != "NullCache"


def test_kernel_takes_only_what_it_computes_exactly():
    x, w, b = torch.randn(4, 8), torch.randn(5, 8), torch.randn(5)
    with torch.no_grad():  # parameters are tensors too
        assert gemm.usable_linear(x, torch.nn.Parameter(w), b)
    assert not gemm.usable_linear(x.double(), w.double(), b.double())
    assert not gemm.usable_linear(torch.randn(8, 4).t(), w, b)  # x not contiguous
    assert not gemm.usable_linear(x, torch.randn(8, 5).t(), b)  # W's rows strided
    assert not gemm.usable_linear(torch.randn(gemm.MAX_ROWS + 1, 8), w, b)
    assert not gemm.usable_linear(x, w, torch.randn(4))  # a bias of the wrong length
    assert not gemm.usable_addmm(torch.randn(5), x, w)  # addend not (rows, N)
    with torch.enable_grad():
        assert not gemm.usable_linear(x, w.requires_grad_(), b)  # autograd: torch's GEMM
    # what is not usable still gets torch's answer
    xd, wd = torch.randn(3, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(gemm.linear(xd, wd), F.linear(xd, wd))


def test_runtime_chooses_per_shape_and_keeps_the_choice(monkeypatch):
    monkeypatch.setattr(ops, "_GEMM_DECIDED", {})
    monkeypatch.setattr(choice, "CHOOSER", choice.Chooser())
    calls = {"kernel": 0}
    real = gemm.run_linear

    def counted(x, w, b):
        calls["kernel"] += 1
        return real(x, w, b)

    monkeypatch.setattr(gemm, "run_linear", counted)
    x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    want = F.linear(x, w, b)
    with config.override(FAST_GEMM=True):
        for _ in range(2 * (choice.TRIALS + 1) + 3):  # warm-up and trials, then decided
            torch.testing.assert_close(ops.batched_linear(x, w, b), want)
    (key,) = ops._GEMM_DECIDED
    assert key[:4] == ("linear", choice.bucket(3), w.shape, False)
    assert ops._GEMM_DECIDED[key] in ("kernel", "torch")
    assert calls["kernel"] >= choice.TRIALS + 1  # the kernel ran its trials on real work
    with config.override(FAST_GEMM=False):
        before = calls["kernel"]
        ops.batched_linear(x, w, b)
        assert calls["kernel"] == before


@pytest.mark.parametrize("fast", [True, False])
def test_maps_match_eager_with_and_without_the_kernel(fast):
    from models import stackrnn

    task = stackrnn.make_task("small", 6)
    with config.override(FAST_GEMM=fast), torch.no_grad():
        got = task.fn.map(task.inputs, **task.kwargs)
        want = [task.fn.eager(x, **task.kwargs) for x in task.inputs]
    for (actions, h), (actions_e, h_e) in zip(got, want):
        assert torch.equal(actions, actions_e)  # the same decisions
        torch.testing.assert_close(h, h_e, rtol=1e-4, atol=1e-4)


def test_gradients_flow_through_torch_gemm_under_autograd():
    @acrobat.autobatch
    def step(x, layer):
        return torch.tanh(layer(x)).sum()

    layer = torch.nn.Linear(6, 4)
    xs = [torch.randn(6) for _ in range(3)]
    with config.override(FAST_GEMM=True):
        torch.stack(step.map(xs, layer=layer)).sum().backward()
    grad = layer.weight.grad.clone()
    layer.zero_grad()
    torch.stack([step.eager(x, layer=layer) for x in xs]).sum().backward()
    torch.testing.assert_close(grad, layer.weight.grad)


def test_nan_and_infinities_propagate_as_in_torch():
    x = torch.randn(5, 20)
    x[1, 3], x[2, 4], x[3, 0] = float("nan"), float("inf"), -float("inf")
    w, b = torch.randn(7, 20), torch.randn(7)
    got, want = gemm.run_linear(x, w, b), F.linear(x, w, b)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[got.isinf()].sign(), want[want.isinf()].sign())
    finite = ~want.isnan() & ~want.isinf()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 300),
    k=st.integers(1, 70),
    n=st.integers(1, 40),
    bias=st.booleans(),
    split=st.sampled_from(["none", "rows", "columns"]),
    seed=st.integers(0, 1000),
)
def test_tanh_epilogue_equals_the_kernel_then_tanh(rows, k, n, bias, split, seed):
    """``run_linear_tanh`` / ``run_addmm_tanh`` (the tanh on each thread's finished rows,
    in place) give bit for bit what the product and then ``unary.tanh`` give, on one
    thread and split over torch's threads; and tanh(F.linear) up to rounding."""
    from acrobat_kernels import unary

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k + 2, generator=gen)[:, 2:]
    b = torch.randn(n, generator=gen) if bias else None
    y = torch.randn(rows, n, generator=gen)
    threads = torch.get_num_threads()
    old = gemm.PARALLEL_WORK, gemm.COLUMNS_BELOW
    gemm.PARALLEL_WORK = 1 << 62 if split == "none" else 0
    gemm.COLUMNS_BELOW = 1 << 30 if split == "columns" else 0
    torch.set_num_threads(1 if split == "none" else 2)
    try:
        got, got_mm = gemm.run_linear_tanh(x, w, b), gemm.run_addmm_tanh(y, x, w)
        want, want_mm = gemm.run_linear(x, w, b), gemm.run_addmm(y, x, w)
    finally:
        torch.set_num_threads(threads)
        gemm.PARALLEL_WORK, gemm.COLUMNS_BELOW = old
    assert torch.equal(got, unary._forward(want))
    assert torch.equal(got_mm, unary._forward(want_mm))
    tol = dict(rtol=1e-5, atol=1e-5 * k)
    torch.testing.assert_close(got, torch.tanh(F.linear(x, w, b)), **tol)
    torch.testing.assert_close(got_mm, torch.tanh(torch.addmm(y, x, w.t())), **tol)


def test_tanh_in_place_is_vectorised_kernel_output():
    """The in-place tanh (one pointer) equals the two-pointer kernel's output, specials
    included."""
    from acrobat_kernels import unary

    x = torch.tensor([0.0, -0.0, 1e-8, -3.0, 20.0, float("inf"), -float("inf"), float("nan")])
    x = torch.cat([x, torch.randn(2000)])
    want = unary._forward(x)
    y = x.clone()
    unary.tanh_in_place()(y.data_ptr(), y.numel())
    torch.testing.assert_close(y, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("rows", range(1, 25))
def test_every_row_count_makes_its_rows_and_no_others(rows):
    """Each way the kernel groups rows per pass over W (eights, a padded last pass of six or
    seven, a padded pass of two to four, a single row) computes x @ W.T, and the rows a
    padded pass repeats are not written: the output buffer past the last row keeps its
    sentinel."""
    gen = torch.Generator().manual_seed(rows)
    k, n = 37, 11  # an odd n: the lone last row of W too
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    out = torch.full((rows + 8, n), 7.0)
    gemm.rows_product()(x.numpy(), w.reshape(-1).numpy(), k, out.numpy(), rows, k, n)
    torch.testing.assert_close(out[:rows], x @ w.T, atol=1e-5, rtol=1e-5)
    assert bool((out[rows:] == 7.0).all())


def _zero_ends(x, head, tail, keep_head, keep_tail):
    """``x`` with rows ``0..head-1`` zero past column ``keep_head`` and the last ``tail`` rows
    zero past ``keep_tail`` (a zero state gathered beside real ones, or joined after them)."""
    x = x.clone()
    if head:
        x[:head, keep_head:] = 0
    if tail:
        x[x.shape[0] - tail :, keep_tail:] = 0
    return x


def test_zero_runs_finds_the_rows_ending_in_zeros_at_either_end():
    from acrobat_kernels import loops

    runs = loops.zero_runs
    x = torch.randn(10, 128)
    assert runs(x.data_ptr(), 10, 128) == (0, 0, 10, 0)  # no row ends in zeros
    x = torch.randn(30, 128)
    assert runs(x.data_ptr(), 30, 128) == (0, 0, 30, 0)  # no row ends in zeros
    z = _zero_ends(x, 8, 9, 64, 0)
    assert runs(z.data_ptr(), 30, 128) == (8, 64, 21, 0)
    z = _zero_ends(x, 0, 10, 0, 40)  # cut at a chunk's edge: its chunk counts whole
    assert runs(z.data_ptr(), 30, 128) == (0, 0, 20, 64)
    z = _zero_ends(x, 0, 10, 0, 100)  # past three quarters of the columns: not cut
    assert runs(z.data_ptr(), 30, 128) == (0, 0, 30, 0)
    z = _zero_ends(x, 7, 7, 0, 0)  # runs of fewer than MIN_RUN rows beside wide ones
    assert loops.MIN_RUN == 8 and runs(z.data_ptr(), 30, 128) == (0, 0, 30, 0)
    z = torch.zeros(12, 128)
    z[3, 127] = float("nan")  # a NaN is not zero
    assert runs(z.data_ptr(), 12, 128) == (0, 0, 4, 0)
    z[3, 127], z[3, 5] = 0.0, float("nan")  # in the first chunk: the row keeps 32 columns
    assert runs(z.data_ptr(), 12, 128) == (0, 0, 0, 32)
    assert runs(z.data_ptr(), 3, 128) == (0, 0, 0, 0)  # a whole batch: any size


@pytest.mark.skipif(not parallel.available(), reason="torch's OpenMP runtime is not libgomp")
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 150),
    k=st.integers(1, 300),
    n=st.integers(1, 70),
    head=st.integers(0, 150),
    tail=st.integers(0, 150),
    keep=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    c=st.sampled_from(["bias", "addend", "none"]),
    act=st.booleans(),
    by=st.sampled_from(["rows", "columns"]),
    seed=st.integers(0, 1000),
)
def test_rows_ending_in_zeros_are_cut_and_match_the_whole_product(
    rows, k, n, head, tail, keep, c, act, by, seed
):
    """Split over the threads, rows at either end whose last columns are zero are
    multiplied over their other columns only (CUT_ZEROS): the same result as the uncut
    product up to the grouping of rows, and as torch's; a zero row gives the bias or the
    addend (+0.0) exactly."""
    gen = torch.Generator().manual_seed(seed)
    head, tail = min(head, rows), min(tail, rows - min(head, rows))
    x = _zero_ends(
        torch.randn(rows, k, generator=gen), head, tail, int(keep[0] * k), int(keep[1] * k)
    )
    w = torch.randn(n, k + 1, generator=gen)[:, 1:]
    cv = {"bias": torch.randn(n, generator=gen), "addend": torch.randn(rows, n, generator=gen)}
    cv["none"] = None
    c_rows = {"bias": 1, "addend": rows, "none": 0}[c]
    threads, old = torch.get_num_threads(), (gemm.PARALLEL_WORK, gemm.COLUMNS_BELOW)
    gemm.PARALLEL_WORK, gemm.COLUMNS_BELOW = 0, (1 << 30 if by == "columns" else 0)
    torch.set_num_threads(2)
    try:
        got = gemm._run(x, w, cv[c], c_rows, act=int(act))
        gemm.CUT_ZEROS = False
        whole = gemm._run(x, w, cv[c], c_rows, act=int(act))
    finally:
        torch.set_num_threads(threads)
        gemm.PARALLEL_WORK, gemm.COLUMNS_BELOW = old
        gemm.CUT_ZEROS = True
    want = x.double() @ w.double().t()
    if cv[c] is not None:
        want = want + cv[c].double()
    if act:
        want = torch.tanh(want)
    tol = dict(rtol=1e-5, atol=1e-5 * k)
    torch.testing.assert_close(got, whole, **tol)
    torch.testing.assert_close(got.double(), want, **tol)
    zero = (x == 0).all(1)
    if zero.any() and cv[c] is not None:
        base = cv[c].expand(rows, n)[zero] + 0.0
        from acrobat_kernels import unary

        assert torch.equal(got[zero], unary._forward(base) if act else base)


def test_zero_rows_times_an_infinite_weight_give_nan_as_in_torch(monkeypatch):
    """Rows are cut only where W is all finite (0 * inf is NaN), checked again after an
    in-place change of W."""
    monkeypatch.setattr(gemm, "PARALLEL_WORK", 0)
    monkeypatch.setattr(gemm, "COLUMNS_BELOW", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(40, 64)
        x[20:] = 0
        w, b = torch.randn(16, 64), torch.randn(16)
        assert torch.equal(gemm.run_linear(x, w, b)[20:], b.expand(20, 16) + 0.0)
        with torch.no_grad():
            w[3, 60] = float("inf")
        got, want = gemm.run_linear(x, w, b), F.linear(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got.isnan(), want.isnan()) and got[20:, 3].isnan().all()


@pytest.mark.skipif(not parallel.available(), reason="torch's OpenMP runtime is not libgomp")
def test_kernels_started_by_the_c_extension_match_the_ctypes_start(monkeypatch):
    """parallel.run starts a split kernel through the C extension (acrobat._native.omp_run)
    where it is built, else through ctypes: the same parameter block, the same results."""
    from acrobat.tensor import _native

    if _native is None:
        pytest.skip("the C extension is not built")
    assert parallel._run is _native.omp_run
    monkeypatch.setattr(gemm, "PARALLEL_WORK", 0)
    gen = torch.Generator().manual_seed(5)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((37, 96), (40, 96), (40,)))
    y = torch.randn(37, 40, generator=gen)
    def products():
        return [gemm.run_linear_tanh(x, w, b), gemm.run_addmm(y, x, w), gemm.run_linear(x, w, None)]

    by_c = products()
    monkeypatch.setattr(parallel, "_run", None)
    by_ctypes = products()
    for got, want in zip(by_c, by_ctypes):
        assert torch.equal(got, want)
    torch.testing.assert_close(by_c[1], torch.addmm(y, x, w.t()), atol=1e-4, rtol=1e-4)
    with pytest.raises(TypeError, match="at most 14 ints"):
        _native.omp_run(gemm._parallel, 2, *range(15))


_KINDS = {  # gemm_call's kind -> (ops function, its arguments from (x, W, c), torch's answer)
    0: (ops.batched_linear, lambda x, w, c: (x, w, c), lambda x, w, c: F.linear(x, w, c)),
    1: (
        ops.batched_linear_tanh,
        lambda x, w, c: (x, w, c),
        lambda x, w, c: torch.tanh(F.linear(x, w, c)),
    ),
    2: (ops.batched_addmm, lambda x, w, c: (c, x, w), lambda x, w, c: torch.addmm(c, x, w.t())),
    3: (
        ops.batched_addmm_tanh,
        lambda x, w, c: (c, x, w),
        lambda x, w, c: torch.tanh(torch.addmm(c, x, w.t())),
    ),
}

needs_c_gemm = pytest.mark.skipif(
    ops._gemm_call is None or not parallel.available(),
    reason="needs the C extension and torch's libgomp",
)


@needs_c_gemm
@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(sorted(_KINDS)),
    rows=st.integers(1, 300),
    k=st.sampled_from([1, 7, 64, 256, 512]),
    n=st.sampled_from([1, 3, 12, 64, 256]),
    spare=st.integers(0, 3),
    bias=st.booleans(),
    zero_tail=st.booleans(),  # rows ending in zeros: the split products cut them
    seed=st.integers(0, 1000),
)
def test_c_gemm_call_is_the_python_path(kind, rows, k, n, spare, bias, zero_tail, seed):
    """``_native.gemm_call`` (the four batched GEMMs' decided case in C) gives gemm._run's
    result bit for bit, and torch's within the reassociation of the sums."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    if zero_tail and k >= 4:
        x[rows // 2 :, k // 2 :] = 0
    w = torch.randn(n, k + spare, generator=gen)[:, spare:]  # W's rows may be spaced
    c = torch.randn(n, generator=gen) if bias else None
    if kind >= 2:
        c = torch.randn(rows, n, generator=gen)
    fn, args, reference = _KINDS[kind]
    key_w = ("linear", "linear_tanh", "addmm", "addmm_tanh")[kind]
    with torch.no_grad(), config.override(FAST_GEMM=True, FAST_TANH=True):
        b, threads = choice.bucket(rows), torch.get_num_threads()
        key = (
            (key_w, b, w.shape, c is None, threads, False) if kind == 0
            else (key_w, b, w.shape, c is None, threads) if kind == 1
            else (key_w, b, w.shape, threads, False) if kind == 2
            else (key_w, b, w.shape, threads)
        )  # fmt: skip  (ops' keys)
        decided = {key: "kernel"}
        saved = ops._GEMM_DECIDED
        ops._GEMM_DECIDED = decided
        try:
            out = ops._gemm_call(kind, x, w, c)
            via_ops = fn(*args(x, w, c))
        finally:
            ops._GEMM_DECIDED = saved
        c_rows = 0 if c is None else (1 if kind < 2 else rows)
        want = gemm._run(x, w, c, c_rows, act=kind & 1)
    assert isinstance(out, torch.Tensor) and out.shape == (rows, n)
    assert torch.equal(out, want) and torch.equal(via_ops, want)
    tol = dict(rtol=1e-5, atol=1e-5 * k)
    torch.testing.assert_close(out, reference(x, w, c), **tol)


@needs_c_gemm
def test_c_gemm_call_leaves_other_calls_to_python(monkeypatch):
    """None (the Python path decides) wherever gemm._usable fails, autograd records or the
    key is not decided; "torch" where the choice took torch's GEMM, which ops then runs."""
    x, w, b = torch.randn(5, 8), torch.randn(4, 8), torch.randn(4)
    key = ("linear", choice.bucket(5), w.shape, False, torch.get_num_threads(), False)
    monkeypatch.setattr(ops, "_GEMM_DECIDED", {key: "kernel"})
    with torch.no_grad():
        assert isinstance(ops._gemm_call(0, x, w, b), torch.Tensor)
        assert ops._gemm_call(0, x.double(), w, b) is None  # not float32
        assert ops._gemm_call(0, torch.randn(8, 5).t(), w, b) is None  # x not contiguous
        assert ops._gemm_call(0, x, torch.randn(8, 4).t(), b) is None  # W's rows strided
        assert ops._gemm_call(0, x, w, torch.randn(3)) is None  # a bias of the wrong length
        assert ops._gemm_call(0, x.reshape(5, 2, 4), w, b) is None  # not 2-D: Python's
        assert ops._gemm_call(0, x[:0], w, b) is None  # no rows
        assert ops._gemm_call(0, x, w, None) is None  # another key: not decided
        assert ops._gemm_call(2, x, w, None) is None  # addmm without its addend
    with torch.enable_grad():
        assert ops._gemm_call(0, x, w.clone().requires_grad_(), b) is None  # autograd records
        assert isinstance(ops._gemm_call(0, x, w, b), torch.Tensor)  # nothing requires grad
    ops._GEMM_DECIDED[key] = "torch"
    with torch.no_grad():
        assert ops._gemm_call(0, x, w, b) == "torch"
        calls = []
        monkeypatch.setattr(gemm, "_run", lambda *a, **k: calls.append(a))  # not the kernel
        with config.override(FAST_GEMM=True):
            torch.testing.assert_close(ops.batched_linear(x, w, b), F.linear(x, w, b))
        assert calls == []
