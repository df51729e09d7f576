"""acrobat on a device other than the CPU.

On a machine with a CUDA device (and cupy for the generated kernels) every benchmark
model runs batched on the GPU against its eager loop there, plain code and blocks, with
value reads (DRNN, Berxit, StackRNN), with the generated CUDA kernels of a block's
elementwise tail, and in training. Elsewhere those tests skip; the device plumbing is
still checked on torch's ``meta`` device (shapes without values), where a tensor the
runtime made on the CPU by mistake meets the model's meta tensors and fails.
"""

from __future__ import annotations

import importlib
import math
import shutil
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import acrobat
from models.common import flatten, outputs_close, run_eager

# The test modules whose models these tests borrow make module-level tensors (CONV, QUERY,
# INDEX...) with CPU generators: imported here, before a test makes cuda the default device
# (imported inside such a test, torch.randn(generator=cpu) raised on the cuda default).
from tests import (  # noqa: F401
    test_hoisting,
    test_item_writes,
    test_padding,
    test_ragged_rows,
    test_weight_lookups,
)
from tests.helpers import check_grads

ALL = ["treelstm", "mvrnn", "birnn", "nestedrnn", "drnn", "berxit", "stackrnn"]
PURE = ["treelstm", "mvrnn", "birnn", "nestedrnn"]  # no value reads: complete on meta

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def default_device(request):
    """torch's default device set to ``request.param`` for the test (models, inputs and
    the instances' ``torch.tensor(word_id)`` are made there, as a user's GPU run would)."""
    torch.set_default_device(request.param)
    try:
        yield torch.device(request.param)
    finally:
        torch.set_default_device(None)


def _task(name: str, batch: int, blocks: bool, size: str = "small"):
    return importlib.import_module(f"models.{name}").make_task(size, batch, blocks=blocks)


def _map_and_eager(task) -> tuple[list, list]:
    """The task batched and its eager loop, without gradients (in the caller's context:
    a default device, an autocast, a config override)."""
    with torch.no_grad():
        return task.fn.map(task.inputs, **task.kwargs), run_eager(task)


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in flatten(tree) if isinstance(x, torch.Tensor)]


# --- meta: the device plumbing, on any machine ---------------------------------------------


@pytest.mark.parametrize("default_device", ["meta"], indirect=True)
@pytest.mark.parametrize("blocks", [False, True], ids=["plain", "blocks"])
@pytest.mark.parametrize("name", PURE)
def test_models_stay_on_the_maps_device(name, blocks, default_device):
    task = _task(name, 4, blocks)
    outs = task.fn.map(task.inputs, **task.kwargs)
    refs = run_eager(task)
    got, want = _tensors(outs), _tensors(refs)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        assert g.device.type == "meta" and g.shape == w.shape and g.dtype == w.dtype


@pytest.mark.parametrize("default_device", ["meta"], indirect=True)
def test_instance_data_is_made_on_the_default_device(default_device):
    """``torch.tensor(list)`` / ``torch.tensor(n)`` inside an instance (data nodes, batched
    for all instances) are made where eager makes them: on the default device."""
    seen = []

    @acrobat.autobatch
    def f(x, k):
        seen.append(x.device)
        mask = torch.tensor([1.0, 0.0, float(k)])
        return x * mask + torch.tensor(float(k)) + torch.zeros(3).sum()

    xs = [torch.randn(3) for _ in range(5)]
    outs = f.map(xs, list(range(5)))
    assert all(o.device.type == "meta" and o.shape == (3,) for o in outs)
    assert seen and all(d.type == "meta" for d in seen)


def test_the_maps_device_is_its_inputs(monkeypatch):
    """Lazy tensors report the device of the map's tensors (its inputs, else the first
    module's parameters), not the default device."""
    seen = []

    @acrobat.autobatch
    def f(x, lin):
        seen.append(x.device)
        return lin(x)

    lin = torch.nn.Linear(3, 2, device="meta")
    outs = f.map([torch.randn(3, device="meta") for _ in range(3)], lin=lin)
    assert all(o.device.type == "meta" for o in outs)
    assert [d.type for d in seen] == ["meta"] * 3


# --- CUDA ----------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
@pytest.mark.parametrize("blocks", [False, True], ids=["plain", "blocks"])
@pytest.mark.parametrize("name", ALL)
def test_models_on_cuda_match_eager(name, blocks, default_device):
    task = _task(name, 8, blocks)
    outs, refs = _map_and_eager(task)
    assert all(t.device.type == "cuda" for t in _tensors(outs))
    check = outputs_close(outs, refs, atol=1e-4, rtol=1e-4)
    assert check, check.message


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
@pytest.mark.parametrize("name", ["treelstm", "drnn", "stackrnn"])
def test_models_on_cuda_batch_64(name, default_device):
    task = _task(name, 64, False)
    outs, refs = _map_and_eager(task)
    check = outputs_close(outs, refs, atol=1e-4, rtol=1e-4)
    assert check, check.message


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
@pytest.mark.parametrize("name", ["treelstm", "nestedrnn"])  # (blocks with a fused tail)
@pytest.mark.parametrize("blocks", [False, True], ids=["plain", "blocks"])
@pytest.mark.parametrize("driver", [True, False], ids=["driver", "cupy"])
def test_generated_cuda_kernels_in_models(name, blocks, driver, default_device, monkeypatch):
    """Fused regions run as generated CUDA kernels reading their operands in place when
    asked for, launched through the driver or through cupy."""
    from acrobat_kernels import elementwise

    if elementwise._cupy() is None:
        pytest.skip("needs cupy")
    if driver:  # (where it cannot, the launch falls back to cupy: that must not hide here)
        assert elementwise._driver_launcher(elementwise.lstm_cell_tail(), torch.device("cuda", 0))
    monkeypatch.setattr(elementwise, "DRIVER_LAUNCH", driver)
    calls = []
    real = elementwise._launch_cuda
    monkeypatch.setattr(elementwise, "_launch_cuda", lambda *a: calls.append(1) or real(*a))
    task = _task(name, 8, blocks)
    with acrobat.config.override(KERNEL_BACKEND="cuda"):
        outs, refs = _map_and_eager(task)
    check = outputs_close(outs, refs, atol=1e-4, rtol=1e-4)
    assert check, check.message
    assert calls, "no generated CUDA kernel ran"


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
@pytest.mark.parametrize("blocks", [False, True], ids=["plain", "blocks"])
def test_training_on_cuda_gradients_match_eager(blocks, default_device):
    task = _task("treelstm", 8, blocks)
    params = [p for p in task.model.parameters() if p.requires_grad]

    def grads(run):
        task.model.zero_grad()
        total = sum(t.sum() for t in _tensors(run()))
        total.backward()
        return [p.grad.clone() for p in params]

    want = grads(lambda: run_eager(task))
    got = grads(lambda: task.fn.map(task.inputs, **task.kwargs))
    check = outputs_close(got, want, atol=1e-4, rtol=1e-4)
    assert check, check.message


@needs_cuda
def test_cuda_inputs_with_value_reads():
    """Per-instance CUDA tensors with the default device left on the CPU: the map runs
    where its inputs are, and a value read (a branch) copies the values to the host."""

    @acrobat.autobatch
    def f(x):
        y = torch.tanh(x * 2)
        steps = 0
        while y.sum() > 0 and steps < 4:  # tensor-dependent: suspends every iteration
            y = y - 0.5
            steps += 1
        return y, torch.tensor(float(steps), device=x.device)

    xs = [torch.randn(5, device="cuda") for _ in range(16)]
    with torch.no_grad():
        outs = f.map(xs)
        refs = [f.eager(x) for x in xs]
    assert all(o[0].device.type == "cuda" for o in outs)
    check = outputs_close(outs, refs, atol=1e-5, rtol=1e-5)
    assert check, check.message


@needs_cuda
@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([3, 5, 20000]), min_size=1, max_size=12),
    every=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_cuda_value_reads_copy_outputs_whole_or_their_rows(sizes, every, seed):
    """A round's reads come from several batch outputs: small ones are copied to the host
    whole, large ones (20000 floats a row) that only some instances read have just
    those rows gathered on the device first (fibers._copy_demanded). Every kind of read
    (bool, int, float, tolist) gets eager's value, in every instance."""

    @acrobat.autobatch
    def f(x, k):
        y = x * 2 - 1
        out = [bool(y[0] > 0), int((y > 0).sum())]
        if k % every == 0:  # only some instances read their whole row
            out.append(y.tolist()[-1])
        out.append(float(y.max()))
        while y.max() > 0 and len(out) < 8:  # reads in later rounds too
            y = y - 0.75
            out.append(float(y.sum()))  # (a sum's order may differ: close, not equal)
        return out

    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g).cuda() for n in sizes]
    ks = list(range(len(xs)))
    with torch.no_grad():
        got = f.map(xs, ks)
        want = [f.eager(x, k) for x, k in zip(xs, ks)]
    for a, b in zip(got, want):
        assert len(a) == len(b)
        assert all(math.isclose(u, v, rel_tol=1e-4, abs_tol=0.05) for u, v in zip(a, b)), (a, b)


@needs_cuda
def test_cuda_instance_data_survives_the_staging_ring(monkeypatch):
    """A batch of per-instance data (``torch.tensor(values)``) goes up through the
    page-locked ring (tensor.stage_array) into a tensor of its own: outputs made of it
    stay intact while later maps wrap the ring many times over."""
    from acrobat import tensor

    monkeypatch.setattr(tensor.IndexRing, "SIZE", 128)  # wraps every few maps
    monkeypatch.setattr(tensor, "_RINGS", {})
    torch.set_default_device("cuda")
    try:

        @acrobat.autobatch
        def f(k):
            ids = torch.tensor([k, k + 1, 2 * k])  # int64 data
            scale = torch.tensor([0.5 * k, -1.0])  # float32 data
            return ids, scale * 2, ids * 3

        kept = []
        for m in range(60):
            ks = [m * 100 + i for i in range(1 + m % 7)]
            with torch.no_grad():
                kept.append((ks, f.map(ks)))
        for ks, outs in kept:
            for k, (ids, scaled, tripled) in zip(ks, outs):
                assert ids.tolist() == [k, k + 1, 2 * k]
                assert scaled.tolist() == [float(k), -2.0]
                assert tripled.tolist() == [3 * k, 3 * k + 3, 6 * k]
        # (40 maps with SIZE 256 wrapped twice on an H100: these wrap several times)
        assert tensor._RINGS[torch.device("cuda", 0)].wraps >= 2
    finally:
        torch.set_default_device(None)


# --- the CUDA row gather ---------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_cuda_gather_source_compiles_with_nvcc(tmp_path):
    from acrobat_kernels import cuda_gather

    path = tmp_path / "gather.cu"
    path.write_text(cuda_gather.SOURCE)
    ptx = tmp_path / "gather.ptx"
    done = subprocess.run(["nvcc", "-ptx", str(path), "-o", str(ptx)], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    text = ptx.read_text()
    assert all(f".entry {name}(" in text for name in cuda_gather.KERNELS)


@needs_cuda
@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=5),  # rows of each source
    st.sampled_from([(3,), (4, 5), (7,), (1,)]),
    st.sampled_from([torch.float32, torch.float16, torch.int64, torch.uint8]),
    st.booleans(),
    st.data(),
)
def test_cuda_gather_rows_match_indexing(sizes, shape, dtype, driver, data):
    """Both launches (the driver's, acrobat_kernels/cuda_launch.py, and cupy's) copy the
    rows at the addresses, in the current stream's order."""
    from acrobat_kernels import cuda_gather

    if not cuda_gather.available():
        pytest.skip("needs cupy")
    if driver:  # (where it cannot, gather_rows falls back to cupy: that must not hide here)
        assert cuda_gather._driver_launchers(torch.device("cuda", 0)) is not None
    old, cuda_gather.DRIVER_LAUNCH = cuda_gather.DRIVER_LAUNCH, driver
    sources = [(torch.randn(k, *shape, device="cuda") * 50).to(dtype) for k in sizes]
    picks = data.draw(
        st.lists(st.tuples(st.integers(0, len(sizes) - 1), st.integers(0, 8)), min_size=1,
                 max_size=40)
    )  # fmt: skip
    picks = [(s, r % sizes[s]) for s, r in picks]
    nbytes = math.prod(shape) * sources[0].element_size()
    addresses = torch.tensor(
        [sources[s].data_ptr() + r * nbytes for s, r in picks], dtype=torch.int64, device="cuda"
    )
    stream = torch.cuda.Stream()  # (the kernel is launched in torch's current stream)
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            got = cuda_gather.gather_rows(addresses, shape, dtype, nbytes)
            want = torch.stack([sources[s][r] for s, r in picks])
            assert torch.equal(got, want)
    finally:
        cuda_gather.DRIVER_LAUNCH = old


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
@pytest.mark.parametrize("name", ["treelstm", "stackrnn"])
def test_models_gather_by_address_on_cuda(name, default_device, monkeypatch):
    """The models' multi-source gathers go through the kernel, and the results are eager's."""
    from acrobat_kernels import cuda_gather

    if not cuda_gather.available():
        pytest.skip("needs cupy")
    calls = []
    real = cuda_gather.gather_rows
    monkeypatch.setattr(cuda_gather, "gather_rows", lambda *a: calls.append(1) or real(*a))
    task = _task(name, 16, False)
    outs, refs = _map_and_eager(task)
    check = outputs_close(outs, refs, atol=1e-4, rtol=1e-4)
    assert check, check.message
    assert calls, "no gather by address ran"


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
@pytest.mark.parametrize("name", ["treelstm", "drnn"])
def test_models_on_cuda_under_autocast(name, default_device):
    """Under CUDA autocast a GPU map records autocast's dtypes (inferred on the device)
    and runs torch's kernels: eager's dtypes, values within float16's rounding."""
    task = _task(name, 8, False)
    with torch.autocast("cuda", dtype=torch.float16):
        outs, refs = _map_and_eager(task)
    got, want = _tensors(outs), _tensors(refs)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    check = outputs_close([t.float() for t in got], [t.float() for t in want], atol=2e-2, rtol=2e-2)
    assert check, check.message


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
def test_ops_sized_by_values_on_cuda(default_device):
    """nonzero, unique, bincount, masked_select and x[mask] on CUDA instances: the values
    their size depends on are read from the device, the results re-enter the graph there,
    and gradients through ``x[mask]`` equal eager's."""

    @acrobat.autobatch
    def f(x, w):
        h = torch.tanh(x @ w)
        mask = h > 0
        picked = h[mask]
        idx = torch.nonzero(mask).flatten()
        uniq = torch.unique((h * 3).round())
        counts = torch.bincount((h.abs() * 4).long().flatten())
        return picked.sum() + torch.masked_select(h, mask).sum(), idx, uniq, counts

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(6, 6, generator=gen, device="cpu").to("cuda").requires_grad_()
    sizes = (1, 3, 5, 2, 4, 4, 7, 1)
    xs = [torch.randn(n, 6, generator=gen, device="cpu").to("cuda") for n in sizes]
    got = f.map(xs, w=w)
    assert all(t.device.type == "cuda" for o in got for t in _tensors(o))
    (gw,) = torch.autograd.grad(sum(o[0] for o in got), w)
    want = [f.eager(x, w) for x in xs]
    (ew,) = torch.autograd.grad(sum(o[0] for o in want), w)
    check = outputs_close([tuple(t.detach() for t in o) for o in got],
                          [tuple(t.detach() for t in o) for o in want], atol=1e-5, rtol=1e-5)
    assert check, check.message
    assert torch.allclose(gw, ew, atol=1e-5, rtol=1e-5)


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
def test_grad_mode_regions_on_cuda(default_device):
    """``torch.no_grad()`` inside instances on a GPU (a read inside the region: the
    instance suspends there): values and gradients as eager's; torch's own switches (an
    ``nn.LSTM`` flattening its weights) pass."""
    w = torch.randn(5, 5).requires_grad_()

    @acrobat.autobatch
    def f(x, w):
        h = torch.tanh(x @ w)
        if float(h.sum()) > 0:
            with torch.no_grad():
                t = torch.sigmoid(h @ w)
                float(t.sum())
        else:
            t = h
        return (h * t).sum()

    xs = [torch.randn(3, 5) for _ in range(6)]
    got = f.map(xs, w=w)
    (gw,) = torch.autograd.grad(sum(got), w)
    want = [f.eager(x, w) for x in xs]
    (ew,) = torch.autograd.grad(sum(want), w)
    check = outputs_close([g.detach() for g in got], [e.detach() for e in want],
                          atol=1e-5, rtol=1e-5)  # fmt: skip
    assert check, check.message
    assert torch.allclose(gw, ew, atol=1e-5, rtol=1e-5)

    lstm = torch.nn.LSTM(4, 4)

    @acrobat.autobatch
    def g(x):
        return lstm(x)[0].sum()

    xs = [torch.randn(3, 1, 4) for _ in range(3)]
    got = g.map(xs)
    check = outputs_close(got, [g.eager(x) for x in xs], atol=1e-4, rtol=1e-4)
    assert check, check.message


def greedy_total(h, steps, w, u):
    """A greedy decoder's bookkeeping (module level: its runs are outlined as regions)."""
    total = torch.zeros(())
    for _ in range(steps):
        logp = torch.log_softmax(h @ w, -1)
        tok = int(logp.argmax())
        total = total + torch.exp(logp[tok]) * 2.0
        h = torch.tanh(u(h) + w[:, tok])
    return total, logp[tok]


greedy = acrobat.autobatch(greedy_total)


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
def test_picks_and_regions_of_user_code_on_cuda(default_device):
    """A greedy decoder's ``logp[tok]`` (a per-instance int: ops.PICK, read at a region's
    call too) on a GPU: values and gradients as eager's."""
    w = torch.randn(6, 9).requires_grad_()
    u = torch.nn.Linear(6, 6)
    gen = torch.Generator().manual_seed(3)
    hs = [torch.randn(6, generator=gen, device="cpu").to("cuda") for _ in range(7)]
    steps = [1, 3, 2, 4, 4, 1, 2]
    got, stats = greedy.map(hs, steps, stats=True, w=w, u=u)
    want = [greedy.eager(h, s, w, u) for h, s in zip(hs, steps)]
    assert all(t.device.type == "cuda" for o in got for t in o)
    assert "pick" in stats.by_op and any(n.startswith("block:greedy_total") for n in stats.by_op)
    (gw,) = torch.autograd.grad(sum(o[0] + o[1] for o in got), w)
    (ew,) = torch.autograd.grad(sum(o[0] + o[1] for o in want), w)
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            torch.testing.assert_close(x.detach(), y.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, ew, atol=1e-5, rtol=1e-5)


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
@pytest.mark.parametrize("style", ["method", "loop", "branchy"])
def test_token_lookups_of_user_code_on_cuda(default_device, style):
    """``W[:, tok]`` / ``self.W[tok]`` by a per-instance int (a take along a dim, a value
    parameter, a scan's numbers, a region's call) on a GPU: values and gradients as eager's."""
    from tests.test_weight_lookups import Reader, read

    torch.manual_seed(5)
    model = Reader(style)
    sentences = [[1, 2, 3], [4], [5, 0, 7, 8], [2, 2]]
    with torch.no_grad():
        got, stats = read.map(sentences, model=model, stats=True)
        want = [read.eager(s, model=model) for s in sentences]
    assert all(g.device.type == "cuda" for g in got)
    assert any(n.startswith(("block:", "scan:")) for n in stats.by_op)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    check_grads(read, sentences, model, atol=1e-5, model=model)


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
def test_padded_ragged_blocks_on_cuda(default_device):
    """Traces of one block at several sizes run as one padded batch on a GPU (its masks
    and true sizes made there): self-attention over token tensors and a stacked list,
    values and gradients as eager's."""
    from tests.test_padding import Attention, Pooled, block_batches

    torch.manual_seed(6)
    att, pool = Attention(), Pooled()

    @acrobat.autobatch
    def attend(tokens, model):
        h = model.emb(tokens)
        q, k, v = model.qkv(h).chunk(3, -1)
        a = torch.softmax(q @ k.T / math.sqrt(h.shape[-1]), -1)
        return model.head(torch.tanh((a @ v).mean(0)))

    tokens = [torch.randint(30, (n,)) for n in (3, 7, 5, 5, 2, 6)]
    lists = [[torch.randn(8) for _ in range(n)] for n in (2, 4, 4, 3, 6)]
    pooled = acrobat.autobatch(pool)
    with torch.no_grad():
        got, stats = attend.map(tokens, model=att, stats=True)
        want = [attend.eager(t, model=att) for t in tokens]
        got2, stats2 = pooled.map(lists, stats=True)
        want2 = [pool(x) for x in lists]
    assert all(g.device.type == "cuda" for g in got + got2)
    assert block_batches(stats) == 1 and block_batches(stats2) == 1, (stats.by_op, stats2.by_op)
    for a, b in zip(got + got2, want + want2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    check_grads(attend, tokens, att, atol=1e-5, model=att)
    check_grads(pooled, lists, pool, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
def test_padded_attention_modules_on_cuda(default_device):
    """Ragged keys masked on a GPU: SDPA (plain, causal, two heads), nn.MultiheadAttention
    and a TransformerEncoderLayer over per-instance token embeddings, one padded batch
    each, values and gradients as eager's."""
    from tests.test_padding import Encoder, Layer, block_batches, heads

    sdpa = torch.nn.functional.scaled_dot_product_attention
    cases = [
        lambda x: sdpa(x, x, x).sum(0),
        lambda x: sdpa(x, x * 2, x, is_causal=True).mean(0),
        lambda x: sdpa(*[heads(x)] * 3).sum(1).flatten(),
    ]
    data = [torch.randn(n, 8) for n in (2, 5, 3, 5, 1)]
    w = torch.nn.Parameter(torch.rand(8) + 0.5)
    holder = torch.nn.Module()
    holder.w = w
    for fn in cases:

        @acrobat.block
        def body(x, w, fn=fn):
            return fn(x * w)

        @acrobat.autobatch
        def f(x, w=w):
            return body(x, w)

        with torch.no_grad():
            got, stats = f.map(data, stats=True)
        assert block_batches(stats) == 1, stats.by_op
        for x, y in zip(data, got):
            torch.testing.assert_close(y, f.eager(x), atol=1e-5, rtol=1e-5)
        check_grads(f, data, holder, atol=1e-5)
    tokens = [torch.randint(30, (n,)) for n in (3, 6, 1, 6, 4, 2)]
    for cls in (Encoder, Layer):
        model = cls().eval()
        g = acrobat.autobatch(model)
        with torch.no_grad():
            got, stats = g.map(tokens, stats=True)
        assert block_batches(stats) == 1, stats.by_op
        for t, y in zip(tokens, got):
            torch.testing.assert_close(y, model(t), atol=1e-5, rtol=1e-5)
        check_grads(g, tokens, model, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
def test_padded_losses_and_bool_masks_on_cuda(default_device):
    """A language model's cross_entropy over its tokens (tokens[:-1] scored against
    tokens[1:]) as one padded batch on a GPU, and nn.MultiheadAttention given a bool mask
    made in the instance (a constant built in place there): values and gradients as
    eager's."""
    from tests.test_padding import LanguageModel, block_batches, class_loss

    torch.manual_seed(2)
    lm = LanguageModel()
    f = acrobat.autobatch(class_loss)
    data = [torch.randint(30, (n,)) for n in (3, 6, 2, 6, 4, 5)]
    shared = {"model": lm, "loss": torch.nn.functional.cross_entropy, "reduction": "mean"}
    with torch.no_grad():
        got, stats = f.map(data, weight=None, stats=True, **shared)
    assert block_batches(stats) == 1, stats.by_op
    for t, y in zip(data, got):
        assert y.device.type == "cuda"
        torch.testing.assert_close(y, f.eager(t, weight=None, **shared), atol=1e-5, rtol=1e-5)
    check_grads(f, data, lm, atol=1e-5, weight=None, **shared)

    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    @acrobat.autobatch
    def attend(x, attention):
        n = x.shape[0]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        return attention(x[None], x[None], x[None], attn_mask=causal)[0][0].sum(0)

    xs = [torch.randn(n, 8) for n in (4, 4, 2, 4)]
    check_grads(attend, xs, attention, atol=1e-5, attention=attention)


def _states_match_on_cuda(model, graphs):
    """``model``'s (y, h) per graph, batched on the GPU, equal its eager outputs."""
    f = acrobat.autobatch(model)
    with torch.no_grad():
        got = f.map(graphs)
    for (y, h), x in zip(got, graphs):
        want = model(x)
        assert y.device.type == "cuda"
        torch.testing.assert_close(y, want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h, want[1], atol=1e-5, rtol=1e-5)


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
def test_session_40_padding_rules_on_cuda(default_device):
    """The padding rules of session 40 on a GPU, each model's map == eager in one padded
    batch per block, values and gradients (tests/test_padding.py's models): a text CNN
    (convolution, whole-window pools), a gold-path score (gather, a table by index pairs),
    a head scorer (rows by per-instance indices, a tuple argument), a trained encoder layer
    (dropout 0 in training mode); then message passing (a loop carrying ragged states)."""
    from tests.test_padding import (
        GoldPath,
        GraphNet,
        HeadScorer,
        TextCNN,
        TrainedLayer,
        check_padded,
    )

    g = torch.Generator(device="cuda").manual_seed(22)
    data = [torch.randint(30, (n,), generator=g) for n in (3, 7, 5, 5, 2, 6, 4)]
    for model in (TextCNN().train(), GoldPath(), TrainedLayer(0.0).train()):
        check_padded(model, data)
    pairs = [
        (torch.randint(30, (n,), generator=g), torch.randint(n, (n,), generator=g))
        for n in (3, 7, 5, 5, 2, 6, 4)
    ]
    check_padded(HeadScorer(), pairs)
    graphs = [
        ((torch.rand(n, n, generator=g) < 0.4).float(), torch.randint(30, (n,), generator=g))
        for n in (3, 5, 4, 5, 2)
    ]
    _states_match_on_cuda(GraphNet(), graphs)


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
def test_sizes_apart_on_cuda(default_device):
    """Session 41's padding over sizes that vary apart on a GPU: a pair of lengths
    (values and gradients, batches as the CPU run's), an encoder-decoder over pairs
    (GRUs on a batch of one), an edge-list GNN loop (h[src], index_add into zeros_like:
    ops.scatter_rule), scatter_add / index_add along a ragged dim."""
    from torch import nn

    from tests.helpers import check_map
    from tests.test_padding import (
        APART,
        DIM,
        EdgeNet,
        Histogram,
        PairGRU,
        apart_runs,
        block_batches,
        check_padded,
        pair_cell,
    )

    lin = nn.Linear(DIM, DIM)
    f = acrobat.autobatch(pair_cell)
    lengths = [(1, 2), (3, 1), (2, 5), (4, 4), (2, 2), (5, 1), (4, 4)]
    data = [(torch.randn(s, DIM), torch.randn(t, DIM)) for s, t in lengths]
    with torch.no_grad():
        check_map(f, data, lin=lin)
        stats = check_map(f, data, lin=lin)
    assert block_batches(stats) == apart_runs(lengths, APART), stats.by_op
    check_grads(f, data, lin, atol=1e-5, lin=lin)
    g = torch.Generator(device="cuda").manual_seed(41)
    pairs = [
        (torch.randint(30, (s,), generator=g), torch.randint(30, (t,), generator=g))
        for s, t in ((3, 4), (5, 2), (1, 6), (4, 4), (2, 3))
    ]
    model = PairGRU()
    f = acrobat.autobatch(model)
    with torch.backends.cudnn.flags(allow_tf32=False):  # (cuDNN's GRU: TF32 by default)
        with torch.no_grad():
            check_map(f, pairs, atol=1e-5, rtol=1e-5)
        check_grads(f, pairs, model, atol=1e-5, rtol=1e-4)
    graphs = [
        (torch.randint(30, (n,), generator=g), torch.randint(n, (2, e), generator=g))
        for n, e in ((3, 5), (6, 2), (4, 7), (2, 2))
    ]
    _states_match_on_cuda(EdgeNet(), graphs)
    check_padded(Histogram(), [torch.randint(30, (n,), generator=g) for n in (3, 6, 1, 6, 4)])


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
def test_session_43_writes_sampling_and_cuts_on_cuda(default_device):
    """Session 43's work on a GPU: item writes (a buffer filled in a loop, with its
    gradients; a mask written after each read; real indices and masks), sampling
    (multinomial from each instance's own probabilities, Categorical), and a decoder
    whose attention cut runs one padded batch per step."""
    from tests.helpers import check_map
    from tests.test_hoisting import Attention, _hoisted_batches, _hoisted_nodes, greedy_decode
    from tests.test_item_writes import (
        CELL,
        SCORE,
        assorted_writes,
        columns_and_slices,
        count_labels,
        encode_into_buffer,
        point_in_turn,
    )

    for module in (CELL, SCORE):  # (those tests' module-level models)
        module.to("cuda")
    try:
        xs = [torch.randn(n, 5) for n in (3, 1, 6, 4, 6)]
        with torch.no_grad():
            check_map(encode_into_buffer, xs)
            check_map(columns_and_slices, xs)
            check_map(assorted_writes, [torch.randn(4) for _ in range(5)])
            check_map(count_labels, [torch.randint(4, (n,)) for n in (2, 5, 1)])
            points = [torch.randn(n, 5) for n in (2, 5, 3, 5)]
            for (order, h), p in zip(point_in_turn.map(points), points):
                want_order, want_h = point_in_turn.eager(p)
                assert torch.equal(order, want_order)
                torch.testing.assert_close(h, want_h, atol=1e-5, rtol=1e-5)
        check_grads(encode_into_buffer, xs, CELL, atol=1e-4, rtol=1e-4)
    finally:
        for module in (CELL, SCORE):
            module.to("cpu")

    @acrobat.autobatch
    def draw(x):
        return torch.multinomial(x.softmax(-1), 1), torch.bernoulli(x.sigmoid())

    sure = torch.tensor([0.0, -1e9, -1e9])
    for pick, coins in draw.map([sure] * 6):
        assert int(pick) == 0 and set(coins.tolist()) <= {0.0, 1.0}
    m = Attention(8)
    data = [(torch.randn(n, 8), 5) for n in [3, 6, 4, 6, 2, 5] * 3]
    with torch.no_grad():
        check_map(greedy_decode, data, m=m, atol=1e-4, rtol=1e-4)
        stats = check_map(greedy_decode, data, m=m, atol=1e-4, rtol=1e-4)
    assert _hoisted_nodes(stats) == len(data) and _hoisted_batches(stats) == 1, stats.by_op


@needs_cuda
@pytest.mark.parametrize("default_device", ["cuda"], indirect=True)
def test_session_44_ragged_rows_on_cuda(default_device):
    """Session 44 on a GPU: picks, whole reductions and writes over values of different
    sizes as one batch each (config.RAGGED_ROWS), a pointer network's step as one padded
    block with its write (the int per-instance data), an out-of-range int named; values
    and gradients as eager's."""
    from tests.helpers import check_map
    from tests.test_ragged_rows import (
        CELL,
        EMB,
        LAYER,
        batches,
        pick_row,
        pointer,
        whole,
        write_row,
    )

    for module in (CELL, EMB, LAYER):
        module.to("cuda")
    try:
        xs = [torch.randn(n, 4) for n in (3, 1, 5, 3, 6)]
        ints = [2, 0, -5, -1, 4]
        with torch.no_grad():
            got, stats = pick_row.map(xs, ints, stats=True)
            assert batches(stats, "pick") == 1, stats.by_op
            for g, x, i in zip(got, xs, ints):
                assert g.device.type == "cuda"
                torch.testing.assert_close(g, pick_row.eager(x, i))
            for name, dtype in (("sum", torch.float32), ("argmax", torch.int32),
                                ("any", torch.bool), ("mean", torch.float32)):  # fmt: skip
                stats = check_map(whole(name, dtype), xs)
                assert batches(stats, name) == 1, stats.by_op
            got, stats = write_row.map(xs, ints, stats=True)
            assert batches(stats, "put") == 1, stats.by_op
            for g, x, i in zip(got, xs, ints):
                torch.testing.assert_close(g, write_row.eager(x, i))
            f = acrobat.autobatch(pointer)
            tokens = [torch.randint(30, (n,)) for n in (3, 5, 2, 5, 4)]
            check_map(f, tokens, emb=EMB, cell=CELL)
            stats = check_map(f, tokens, emb=EMB, cell=CELL)
            assert "put" not in stats.by_op, stats.by_op
        check_grads(whole("amax", torch.float32), xs, LAYER, atol=1e-5)
        holder = torch.nn.Module()
        holder.emb, holder.cell = EMB, CELL
        check_grads(f, tokens, holder, atol=1e-5, emb=EMB, cell=CELL)

        @acrobat.autobatch
        def bad(x, i, layer=LAYER):
            h = torch.tanh(layer(x)).clone()
            h[i] = 0.0
            return h.sum(0) * 2

        bad.map(xs[:3], [0, 0, 0])
        with pytest.raises(IndexError, match=r"instance 2: index 5 is out of bounds"):
            bad.map(xs[:3], [1, -1, 5])

        @acrobat.autobatch
        def counts(x):  # (Poisson and binomial draws of each instance's own rates)
            tens = torch.full_like(x, 10.0)
            return torch.poisson(torch.exp(x)), torch.binomial(tens, x.sigmoid())

        rates = [torch.full((2000,), v) for v in (-1.0, 1.0, 3.0)]
        got, stats = counts.map(rates, stats=True)
        assert stats.by_op["poisson"][0] == 1 and stats.by_op["binomial"][0] == 1, stats.by_op
        for (p, b), r in zip(got, rates):
            assert p.device.type == "cuda" and b.device.type == "cuda"
            rate, prob = math.exp(float(r[0])), 1 / (1 + math.exp(-float(r[0])))
            assert abs(float(p.mean()) - rate) < 5 * math.sqrt(rate / 2000)
            assert abs(float(b.mean()) - 10 * prob) < 5 * math.sqrt(10 * prob * (1 - prob) / 2000)
    finally:
        for module in (CELL, EMB, LAYER):
            module.to("cpu")
