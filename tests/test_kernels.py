"""Tests of acrobat_kernels: gather-fused elementwise kernels against the torch reference.

The oracle is ``run(..., backend="torch")`` (index_select, then one torch op per node),
itself checked against hand-written torch for the LSTM cell tail. numba compiles each
program once per process (about 1 s), so property tests draw their programs from a small
fixed pool (random programs from the same generator, fixed seeds) and only the data
at random; tests that need no compiled kernel run on freshly drawn programs.
"""

from __future__ import annotations

import itertools
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import acrobat_kernels.elementwise as ew
from acrobat_kernels import OPS, OPS_TABLE, Program, cuda_source, lstm_cell_tail, numba_source, run

TOL = {"atol": 1e-5, "rtol": 1e-5, "equal_nan": True}


# ---- random programs ------------------------------------------------------------------


def random_program(rng: random.Random, dtype: str = "float32") -> Program:
    """A random SSA DAG over the whole op set: 1-3 inputs, 0-2 shared, 1-2 outputs.

    log/sqrt/rsqrt arguments and div denominators are usually moved into [0.5, inf) by
    ``abs(x) + 0.5`` first, so most outputs are finite numbers rather than NaN; the rest
    keep their NaNs, which must then agree too.
    """
    n_inputs, n_shared = rng.randint(1, 3), rng.randint(0, 2)
    values = [("in", k) for k in range(n_inputs)] + [("sh", k) for k in range(n_shared)]
    ops: list = []

    def emit(name, args):
        ops.append((name, tuple(args)))
        return ("op", len(ops) - 1)

    def away_from_zero(arg):
        return emit("add", [emit("abs", [arg]), 0.5]) if isinstance(arg, tuple) else arg

    for _ in range(rng.randint(1, 8)):
        name = rng.choice(sorted(OPS))
        row = OPS_TABLE[name]
        args: list = []
        for pos in range(row.arity):
            if name == "leaky_relu" and pos == 1:
                args.append(round(rng.uniform(0.01, 0.3), 3))
            elif name == "clamp" and pos > 0:
                args.append(round(rng.uniform(-1.0, 0.0) if pos == 1 else rng.uniform(0.0, 1.0), 3))
            elif pos > 0 and rng.random() < 0.25:
                args.append(round(rng.uniform(-2.0, 2.0), 3))
            else:
                # Prefer recent values, so programs are deep rather than wide.
                args.append(rng.choice(values[-2:] if rng.random() < 0.6 else values))
        if name in ("log", "sqrt", "rsqrt") and rng.random() < 0.8:
            args[0] = away_from_zero(args[0])
        if name == "div" and rng.random() < 0.8:
            args[1] = away_from_zero(args[1])
        values.append(emit(name, args))
    outputs = [len(ops) - 1]
    if rng.random() < 0.5:
        outputs.insert(0, rng.randrange(len(ops)))
    return Program(n_inputs, n_shared, tuple(ops), tuple(outputs), dtype)


programs = st.builds(
    random_program, st.randoms(use_true_random=False), st.sampled_from(["float32", "float64"])
)

# Compiled once each, shared by every example of the numba property test.
POOL = (
    [lstm_cell_tail()]
    + [random_program(random.Random(seed)) for seed in range(4)]
    + [random_program(random.Random(seed), "float64") for seed in (4, 5)]
)


# ---- random batches -------------------------------------------------------------------


def make_source(data, n: int, F: int, dtype: torch.dtype, gen: torch.Generator):
    """A (buf, idx) pair with a randomly chosen layout and index pattern."""
    index = data.draw(st.sampled_from(["none", "permutation", "duplicates"]))
    layout = data.draw(st.sampled_from(["contiguous", "column-slice", "expanded"]))
    rows = n + data.draw(st.integers(0, 5))
    if layout == "contiguous":
        buf = torch.rand(rows, F, generator=gen, dtype=dtype) * 4 - 2
    elif layout == "column-slice":  # a gate of a wider matmul output: row stride 3F
        wide = torch.rand(rows, 3 * F, generator=gen, dtype=dtype) * 4 - 2
        buf = wide[:, F : 2 * F]
    else:  # one row broadcast to every instance: row stride 0
        buf = (torch.rand(1, F, generator=gen, dtype=dtype) * 4 - 2).expand(rows, F)
    if index == "none":
        return buf, None
    if index == "permutation":
        return buf, torch.randperm(rows, generator=gen)[:n]
    return buf, torch.randint(0, rows, (n,), generator=gen)


def make_batch(data, program: Program, max_n: int = 40, max_F: int = 70):
    dtype = ew._DTYPES[program.dtype]
    n, F = data.draw(st.integers(1, max_n), label="n"), data.draw(st.integers(1, max_F), label="F")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    sources = [make_source(data, n, F, dtype, gen) for _ in range(program.n_inputs)]
    shared = [
        torch.rand(
            (F,) if data.draw(st.booleans(), label=f"shared{k} is a vector") else (),
            generator=gen,
            dtype=dtype,
        )
        * 4
        - 2
        for k in range(program.n_shared)
    ]
    return n, F, sources, shared


def check_backend(program, n, F, sources, shared, backend):
    want = run(program, n, F, sources, shared, backend="torch")
    got = run(program, n, F, sources, shared, backend=backend)
    assert len(got) == len(want) == len(program.outputs)
    for m, (g, w) in enumerate(zip(got, want)):
        assert g.shape == (n, F) and g.dtype == w.dtype and g.is_contiguous()
        torch.testing.assert_close(g, w, **TOL, msg=lambda text, m=m: f"output {m}: {text}")


# ---- numba against torch --------------------------------------------------------------


@given(data=st.data())
def test_numba_matches_torch_on_random_programs(data):
    program = data.draw(st.sampled_from(POOL), label="program")
    note(str(program))
    check_backend(program, *make_batch(data, program), backend="numba")


def test_lstm_cell_tail_reference_and_numba():
    n, F = 13, 37
    gen = torch.Generator().manual_seed(0)
    gates = torch.randn(20, 4 * F, generator=gen)
    c_arena = torch.randn(30, F, generator=gen)
    rows = torch.randint(0, 20, (n,), generator=gen)
    c_rows = torch.randint(0, 30, (n,), generator=gen)
    sources = [(gates[:, k * F : (k + 1) * F], rows) for k in range(4)] + [(c_arena, c_rows)]
    i, f, u, o = gates[rows].chunk(4, dim=1)
    c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(f) * c_arena[c_rows]
    h = torch.sigmoid(o) * torch.tanh(c)
    program = lstm_cell_tail()
    for backend in ("torch", "numba"):
        got_c, got_h = run(program, n, F, sources, backend=backend)
        torch.testing.assert_close(got_c, c, **TOL)
        torch.testing.assert_close(got_h, h, **TOL)


def test_parallel_kernel(monkeypatch):
    from acrobat_kernels import parallel

    if torch.get_num_threads() < 2 or not parallel.available():
        pytest.skip("one torch thread, or no OpenMP team of torch's to split the rows over")
    monkeypatch.setattr(ew, "PARALLEL_MIN_ELEMENTS", 0)
    launched = []
    real_launch = parallel.launch
    monkeypatch.setattr(
        parallel, "launch", lambda *a: (launched.append(a[2]), real_launch(*a))[1]
    )
    gen = torch.Generator().manual_seed(1)
    n, F = 37, 21
    sources = [
        (torch.randn(50, F, generator=gen), torch.randint(0, 50, (n,), generator=gen))
        for _ in range(5)
    ]
    check_backend(lstm_cell_tail(), n, F, sources, [], backend="numba")
    assert launched and min(launched) == torch.get_num_threads()  # split over the team


def test_kernel_without_a_writable_cache_dir(monkeypatch):
    """Where no cache folder can be written, the kernel module is executed from its source
    (compiled in this process, numba's disk cache off) and computes the same."""
    monkeypatch.setattr(ew, "cache_dir", lambda: None)
    program = Program(2, 1, (("mul", (("in", 0), ("sh", 0))), ("sub", (("op", 0), ("in", 1)))),
                      (1,))  # fmt: skip
    monkeypatch.setattr(ew, "_numba_kernels", {})
    gen = torch.Generator().manual_seed(3)
    sources = [(torch.randn(9, 5, generator=gen), torch.tensor([8, 0, 3, 3])),
               (torch.randn(4, 5, generator=gen), None)]  # fmt: skip
    check_backend(program, 4, 5, sources, [torch.randn(5, generator=gen)], backend="numba")
    assert ew._numba_kernels[program].cache_hits == 0


# Every op of the table, one output each, on inputs with the awkward values.
ALL_OPS = sorted(OPS)


def all_ops_program(dtype: str) -> Program:
    ops = []
    for name in ALL_OPS:
        args = {
            1: (("in", 0),),
            2: (("in", 0), ("in", 1)),
            3: (("in", 2), ("in", 0), ("in", 1)),
        }[OPS[name]]
        if name == "leaky_relu":
            args = (("in", 0), 0.125)
        elif name == "clamp":
            args = (("in", 0), -0.5, 0.75)
        ops.append((name, args))
    return Program(3, 0, tuple(ops), tuple(range(len(ops))), dtype)


SPECIAL = [
    float("nan"),
    float("inf"),
    -float("inf"),
    0.0,
    -0.0,
    1e-30,
    -1e-30,
    1e-4,
    -1e-4,
    0.6249,
    0.625,
    -0.625,
    1.0,
    -1.0,
    9.0,
    -9.0,
    20.0,
    -20.0,
    88.0,
    89.0,
    -88.0,
    -103.0,
    -104.0,
    100.0,
    -100.0,
]


@pytest.fixture(scope="module", params=["float32", "float64"])
def all_ops_results(request):
    dtype = ew._DTYPES[request.param]
    gen = torch.Generator().manual_seed(2)
    n, F = 9, 41
    x = torch.cat(
        [
            torch.tensor(SPECIAL, dtype=dtype),
            torch.randn(n * F - len(SPECIAL), generator=gen, dtype=dtype) * 3,
        ]
    )
    y = x[torch.randperm(n * F, generator=gen)]
    cond = torch.randint(0, 2, (n * F,), generator=gen).to(dtype)
    cond[:3] = torch.tensor([float("nan"), 0.5, -0.0])
    sources = [(t.reshape(n, F), None) for t in (x, y, cond)]
    program = all_ops_program(request.param)
    got = run(program, n, F, sources, backend="numba")
    want = run(program, n, F, sources, backend="torch")
    return dict(zip(ALL_OPS, zip(got, want))), x.reshape(n, F)


@pytest.mark.parametrize("name", ALL_OPS)
def test_each_op_matches_torch_on_special_values(all_ops_results, name):
    results, x = all_ops_results
    got, want = results[name]
    if name == "gelu" and x.dtype == torch.float32:
        # torch's float32 CPU gelu gives NaN at +inf (its vectorized erf does); the
        # kernels give inf, as torch does in float64.
        assert torch.equal(got[x == float("inf")], x[x == float("inf")])
        got, want = got[x != float("inf")], want[x != float("inf")]
    torch.testing.assert_close(got, want, **TOL)


VECMATH = ["exp", "tanh", "log", "erf"]


@pytest.fixture(scope="module")
def vecmath_results():
    """vecmath's functions applied to a dense float32 grid plus special values."""
    import numba

    from acrobat_kernels import vecmath

    @numba.njit(error_model="numpy")
    def apply_all(x, out):
        for j in range(x.shape[0]):
            out[0, j] = vecmath.exp_f32(x[j])
            out[1, j] = vecmath.tanh_f32(x[j])
            out[2, j] = vecmath.log_f32(x[j])
            out[3, j] = vecmath.erf_f32(x[j])

    magnitudes = np.geomspace(1e-45, 3e38, 20001)
    x = np.concatenate(
        [
            np.linspace(-110, 110, 200001),
            magnitudes,
            -magnitudes,
            1 + np.linspace(-1e-3, 1e-3, 2001),
            SPECIAL,
        ]
    ).astype(np.float32)
    out = np.empty((len(VECMATH), len(x)), np.float32)
    apply_all(x, out)
    return torch.from_numpy(x), dict(zip(VECMATH, torch.from_numpy(out)))


@pytest.mark.parametrize("name", VECMATH)
def test_vecmath_float32_functions_are_within_2_5_ulp(vecmath_results, name):
    """The vectorizable float32 math the numba kernels use, against float64 torch."""
    x, results = vecmath_results
    got = results[name]
    exact = getattr(torch, name)(x.double())
    # Where the float32 result overflows, underflows or is NaN, compare values, not ulps.
    normal = torch.isfinite(exact.float()) & (exact.abs() > 1.2e-38)
    # (a float32 ulp computed in float64: np.spacing gives 0 for the smallest normals
    # in a process with denormals flushed, as after DyNet's import in the same run)
    exponent = torch.frexp(exact[normal].float())[1]
    ulp = torch.pow(2.0, (exponent - 24).double())
    err = (got[normal].double() - exact[normal]).abs() / ulp
    assert err.max() <= 2.5, f"{name}: {err.max():.2f} ulp at x = {x[normal][err.argmax()]}"
    torch.testing.assert_close(
        got[~normal], exact[~normal].float(), atol=1e-44, rtol=0, equal_nan=True
    )


def test_auto_backend_and_index_variants():
    program = lstm_cell_tail()
    gen = torch.Generator().manual_seed(3)
    n, F = 6, 5
    buf = torch.randn(8, F, generator=gen)
    sources = [
        (buf, torch.tensor([7, 0, 0, 3, 3, 3], dtype=torch.int32)),  # int32 indices
        (buf.t().contiguous().t(), None),  # column-major: copied
        (buf, torch.arange(6, 0, -1)),
        (torch.randn(1, F, generator=gen).expand(n, F), None),
        (buf[::2], torch.tensor([0, 1, 2, 3, 0, 1])),  # row stride 2F
    ]
    check_backend(program, n, F, sources, [], backend="auto")
    check_backend(program, n, F, sources, [], backend="numba")


def test_shared_operands_and_constant_only_outputs():
    program = Program(
        1,
        2,
        (
            ("add", (("in", 0), ("sh", 0))),  # per-instance + vector
            ("mul", (("sh", 0), ("sh", 1))),  # only shared: broadcast to every instance
            ("exp", (-1.5,)),  # only a constant
        ),
        (0, 1, 2, 1),
    )
    gen = torch.Generator().manual_seed(4)
    n, F = 4, 3
    sources = [(torch.randn(n, F, generator=gen), None)]
    shared = [torch.randn(F, generator=gen), torch.tensor(2.0)]
    check_backend(program, n, F, sources, shared, backend="numba")
    outs = run(program, n, F, sources, shared, backend="torch")
    assert outs[1].data_ptr() != outs[3].data_ptr()
    torch.testing.assert_close(outs[2], torch.full((n, F), float(np.exp(np.float32(-1.5)))))


def test_empty_batch():
    outs = run(lstm_cell_tail(), 0, 8, [(torch.zeros(0, 8), None)] * 5, backend="numba")
    assert [o.shape for o in outs] == [(0, 8), (0, 8)]


def test_torch_backend_autograd_and_auto_picks_torch():
    program = lstm_cell_tail("float64")
    gen = torch.Generator().manual_seed(5)
    bufs = [
        torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(5)
    ]
    idx = torch.tensor([4, 0, 0])

    def fn(*bufs):
        return tuple(run(program, 3, 3, [(b, idx) for b in bufs], backend="auto"))

    assert torch.autograd.gradcheck(fn, bufs)
    with pytest.raises(ValueError, match="autograd"):
        run(program, 3, 3, [(b, idx) for b in bufs], backend="numba")


# ---- programs and sources (no compilation) --------------------------------------------


@given(program=programs)
def test_random_programs_generate_valid_sources(program):
    note(str(program))
    assert hash(program) == hash(
        Program(
            program.n_inputs,
            program.n_shared,
            list(program.ops),
            list(program.outputs),
            program.dtype,
        )
    )
    compile(numba_source(program), "<numba_source>", "exec")
    source = cuda_source(program)
    assert source.count("__global__") == 1 and ew._cuda_kernel_name(program) in source
    n, F = 3, 4
    dtype = ew._DTYPES[program.dtype]
    sources = [(torch.rand(n, F, dtype=dtype), None) for _ in range(program.n_inputs)]
    shared = [torch.rand(F, dtype=dtype) for _ in range(program.n_shared)]
    outs = run(program, n, F, sources, shared, backend="torch")
    assert [o.shape for o in outs] == [(n, F)] * len(program.outputs)


def test_program_listing_and_normalisation():
    program = Program(1, 0, [["mul", [["in", 0], 2]], ("exp", (("op", 0),))], [1])
    assert program.ops == (("mul", (("in", 0), 2.0)), ("exp", (("op", 0),)))
    assert str(program) == "program(in0) -> (%1) float32:\n  %0 = mul in0, 2.0\n  %1 = exp %0"
    assert program == Program(1, 0, (("mul", (("in", 0), 2.0)), ("exp", (("op", 0),))), (1,))


def test_dead_ops_are_not_generated():
    program = Program(1, 0, (("exp", (("in", 0),)), ("tanh", (("in", 0),))), (1,))
    assert "exp" not in numba_source(program).split("def kernel")[0].split("for j")[1]
    assert "expf" not in cuda_source(program).split("{", 1)[1]


# ---- CUDA source ----------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_cuda_sources_compile_with_nvcc(tmp_path):
    """One nvcc call compiles every kernel: LSTM and all-ops in both dtypes, the pool."""
    chosen = [
        lstm_cell_tail("float32"),
        lstm_cell_tail("float64"),
        all_ops_program("float32"),
        all_ops_program("float64"),
        *POOL[1:],
    ]
    path = tmp_path / "kernels.cu"
    path.write_text("\n".join(cuda_source(p) for p in dict.fromkeys(chosen)))
    result = subprocess.run(
        ["nvcc", "-ptx", "-arch=sm_80", "-o", str(tmp_path / "kernels.ptx"), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    ptx = (tmp_path / "kernels.ptx").read_text()
    for p in dict.fromkeys(chosen):
        assert f".entry {ew._cuda_kernel_name(p)}(" in ptx


def _cuda_usable() -> bool:
    return torch.cuda.is_available() and ew._cupy() is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_usable(), reason="needs a CUDA device and cupy")
@pytest.mark.parametrize(
    "program",
    [lstm_cell_tail("float32"), all_ops_program("float32"), all_ops_program("float64"), *POOL[1:]],
    ids=str,
)
@pytest.mark.parametrize("driver", [True, False], ids=["driver", "cupy"])
def test_cuda_matches_torch(program, driver, monkeypatch):
    monkeypatch.setattr(ew, "DRIVER_LAUNCH", driver)
    if driver:
        assert ew._driver_launcher(program, torch.device("cuda", 0)) is not None
    gen = torch.Generator().manual_seed(6)
    dtype = ew._DTYPES[program.dtype]
    n, F = 33, 70
    sources = []
    for k in range(program.n_inputs):
        buf = (torch.randn(n + 5, 2 * F, generator=gen, dtype=dtype) * 2)[:, :F].cuda()
        idx = None if k % 2 else torch.randint(0, n + 5, (n,), generator=gen).cuda()
        sources.append((buf, idx))
    shared = [torch.randn(F, generator=gen, dtype=dtype).cuda() for _ in range(program.n_shared)]
    check_backend(program, n, F, sources, shared, backend="cuda")
    # run_built: the same launch without run()'s checks (its callers build the operands)
    got = ew.run_built(program, n, F, sources, shared, backend="auto")
    want = run(program, n, F, sources, shared, backend="torch")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.skipif(_cuda_usable(), reason="a CUDA device and cupy are present")
def test_cuda_backend_without_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"needs cupy .* and a CUDA device"):
        run(lstm_cell_tail(), 2, 3, [(torch.zeros(2, 3), None)] * 5, backend="cuda")


def test_run_built_is_run_off_the_gpu():
    """``run_built`` (fused regions' entry, unchecked on a GPU) is ``run`` elsewhere: the
    same results, and the same errors for what the program cannot take."""
    gen = torch.Generator().manual_seed(3)
    program, n, F = lstm_cell_tail(), 6, 5
    sources = [(torch.randn(9, F, generator=gen), torch.randint(0, 9, (n,), generator=gen))
               for _ in range(program.n_inputs)]  # fmt: skip
    for backend in ("auto", "torch"):
        got = ew.run_built(program, n, F, sources, [], backend=backend)
        for g, w in zip(got, run(program, n, F, sources, [], backend="torch")):
            torch.testing.assert_close(g, w, **TOL)
    doubles = [(buf.double(), idx) for buf, idx in sources]
    with pytest.raises(ValueError, match=r"buf has dtype torch\.float64"):
        ew.run_built(program, n, F, doubles, [], backend="auto")


# ---- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        (
            (("sigmoidd", (("in", 0),)),),
            r"ops\[0\]: unknown op 'sigmoidd'; supported ops: abs, add",
        ),
        ((("add", (("in", 0),)),), r"ops\[0\]: add takes 2 argument\(s\)"),
        (
            (("exp", (("op", 0),)),),
            r"ops\[0\]: argument 0 refers to \('op', 0\), but an op can use only the results of "
            r"ops before it",
        ),
        ((("exp", (("in", 1),)),), r"refers to \('in', 1\), but the program has 1 input"),
        ((("exp", (("x", 0),)),), r"must be a number or \('in'\|'sh'\|'op', int\)"),
        ((("leaky_relu", (("in", 0), ("in", 0))),), r"argument 1 of leaky_relu must be a number"),
    ],
)
def test_malformed_programs(ops, message):
    with pytest.raises(ValueError, match=message):
        Program(1, 0, ops, (0,))


def test_malformed_program_fields():
    with pytest.raises(ValueError, match=r"dtype: expected one of"):
        Program(1, 0, (("exp", (("in", 0),)),), (0,), dtype="float16")
    with pytest.raises(ValueError, match=r"outputs: 3 is not an index into ops"):
        Program(1, 0, (("exp", (("in", 0),)),), (3,))


def _lstm_sources(n=3, F=4, rows=5):
    return [(torch.zeros(rows, F), torch.zeros(n, dtype=torch.int64)) for _ in range(5)]


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (
            lambda s, sh: (s[:4], sh),
            ValueError,
            r"takes 5 per-instance source\(s\) \(buf, idx\), got 4",
        ),
        (lambda s, sh: (s, [torch.zeros(4)]), ValueError, r"takes 0 shared operand\(s\), got 1"),
        (
            lambda s, sh: ([(torch.zeros(5, 4, 1), None)] + s[1:], sh),
            ValueError,
            r"sources\[0\]: buf must be a 2-D tensor \(rows, F=4\), got shape \(5, 4, 1\)",
        ),
        (
            lambda s, sh: ([(torch.zeros(5, 4), torch.zeros(2, dtype=torch.int64))] + s[1:], sh),
            ValueError,
            r"sources\[0\]: idx must be a 1-D tensor of length n=3, got shape \(2,\)",
        ),
        (
            lambda s, sh: ([(torch.zeros(5, 6), None)] + s[1:], sh),
            ValueError,
            r"buf rows have length 6, expected F=4",
        ),
        (
            lambda s, sh: ([(torch.zeros(5, 4, dtype=torch.float64), None)] + s[1:], sh),
            ValueError,
            r"buf has dtype torch.float64, the program is float32",
        ),
        (
            lambda s, sh: ([(torch.zeros(2, 4), None)] + s[1:], sh),
            ValueError,
            r"idx is None \(rows 0..2\), but buf has only 2 rows",
        ),
        (
            lambda s, sh: ([(torch.zeros(5, 4), torch.tensor([0, 5, 1]))] + s[1:], sh),
            IndexError,
            r"sources\[0\]: idx\[1\] = 5 is out of range for a buf with 5 rows",
        ),
    ],
)
def test_bad_arguments(change, error, message):
    sources, shared = change(_lstm_sources(), [])
    for backend in ("numba", "torch") if error is ValueError else ("numba",):
        with pytest.raises(error, match=message):
            run(lstm_cell_tail(), 3, 4, sources, shared, backend=backend)


def test_bad_shared_and_backend():
    program = Program(1, 1, (("add", (("in", 0), ("sh", 0))),), (0,))
    src = [(torch.zeros(3, 4), None)]
    with pytest.raises(ValueError, match=r"shared\[0\]: expected a 0-d tensor or a 1-D tensor"):
        run(program, 3, 4, src, [torch.zeros(2, 4)])
    with pytest.raises(ValueError, match=r"unknown backend 'tvm'"):
        run(program, 3, 4, src, [torch.zeros(4)], backend="tvm")


def test_docstring_examples():
    import doctest

    result = doctest.testmod(ew, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ---- the lean CPU entry of block code (cpu_caller) -------------------------------------


def caller_operands(data, program: Program, n: int, F: int, gen: torch.Generator):
    """(args, layout, sources): the program's inputs as cpu_caller takes them (whole
    (n, F) tensors of any strides, or column ranges of one wide matrix, as a block
    passes a GEMM's chunks) and as ``run`` takes them."""
    dtype = ew._DTYPES[program.dtype]
    wide_chunks = data.draw(st.integers(1, 4), label="chunks of the wide matrix")
    wide = torch.rand(n, wide_chunks * F + 3, generator=gen, dtype=dtype) * 4 - 2
    args, layout, sources = [wide], [], []
    for _ in range(program.n_inputs):
        kind = data.draw(
            st.sampled_from(["columns", "contiguous", "slice", "expanded", "transposed"])
        )
        if kind == "columns":
            offset = F * data.draw(st.integers(0, wide_chunks - 1)) + data.draw(st.integers(0, 3))
            layout.append((0, offset))
            sources.append((wide[:, offset : offset + F], None))
            continue
        if kind == "contiguous":
            x = torch.rand(n, F, generator=gen, dtype=dtype) * 4 - 2
        elif kind == "slice":  # rows spaced apart
            x = (torch.rand(n, 2 * F, generator=gen, dtype=dtype) * 4 - 2)[:, F:]
        elif kind == "expanded":  # one row for every instance: row stride 0
            x = (torch.rand(1, F, generator=gen, dtype=dtype) * 4 - 2).expand(n, F)
        else:  # column-major: copied row-major by the caller
            x = (torch.rand(F, n, generator=gen, dtype=dtype) * 4 - 2).t()
        layout.append((len(args), None))
        args.append(x)
        sources.append((x.reshape(n, F), None))
    return args, tuple(layout), sources


@given(data=st.data())
def test_cpu_caller_matches_torch_on_random_programs(data):
    program = data.draw(st.sampled_from(POOL), label="program")
    note(str(program))
    n, F = data.draw(st.integers(1, 40), label="n"), data.draw(st.integers(1, 70), label="F")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    args, layout, sources = caller_operands(data, program, n, F, gen)
    dtype = ew._DTYPES[program.dtype]
    shared = [torch.rand(F, generator=gen, dtype=dtype), torch.rand((), dtype=dtype)]
    shared = shared[: program.n_shared]
    want = run(program, n, F, sources, shared, backend="torch")
    for backend in ("numba", "torch"):
        got = ew.cpu_caller(program, (F,), shared, layout, backend)(n, *args)
        assert len(got) == len(program.outputs)
        for m, (g, w) in enumerate(zip(got, want)):
            assert g.shape == (n, F) and g.dtype == w.dtype
            which = f"{backend}, output {m}"
            torch.testing.assert_close(g, w, **TOL, msg=lambda t, which=which: f"{which}: {t}")


def test_cpu_caller_splits_large_batches_over_threads(monkeypatch):
    from acrobat_kernels import parallel

    if not parallel.available():
        pytest.skip("no OpenMP team of torch's to split the rows over")
    launched = []
    real_launch = parallel.launch
    monkeypatch.setattr(parallel, "launch", lambda *a: (launched.append(a[2]), real_launch(*a))[1])
    program = lstm_cell_tail()
    gen = torch.Generator().manual_seed(3)
    n, F = 300, 128  # n * F >= PARALLEL_MIN_ELEMENTS
    gates = torch.randn(n, 4 * F, generator=gen)
    c = torch.randn(n, F, generator=gen)
    layout = ((0, 0), (0, F), (0, 2 * F), (0, 3 * F), (1, None))
    sources = [(gates[:, k * F : (k + 1) * F], None) for k in range(4)] + [(c, None)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = ew.cpu_caller(program, (F,), (), layout)(n, gates, c)
    finally:
        torch.set_num_threads(threads)
    assert launched == [2]
    want = run(program, n, F, sources, [], backend="torch")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_cpu_caller_declines_what_it_cannot_read():
    program = lstm_cell_tail()
    n, F = 3, 8
    ok = [torch.randn(n, F) for _ in range(5)]
    call = ew.cpu_caller(program, (F,))
    assert call(n, *ok) is not None
    assert call(n, *ok[:4], ok[4].double()) is None  # another dtype
    by_columns = ew.cpu_caller(program, (F,), (), ((0, 0), (0, F), (0, 2 * F), (0, 3 * F), (1, 0)))
    gates = torch.randn(n, 4 * F)
    assert by_columns(n, gates, ok[0]) is not None
    assert by_columns(n, gates.t().contiguous().t(), ok[0]) is None  # columns not unit-stride
    assert by_columns(n, gates.reshape(n, 4, F), ok[0]) is None  # not a matrix


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 5000), parts=st.integers(1, 8))
def test_thread_shares_cover_the_rows_in_balanced_whole_blocks(rows, parts):
    """loops.share, the row split of the thread-split kernels: contiguous ranges that
    cover every row once, each starting at a whole block, no thread more than one block
    (plus the rows past the last whole block, for the last thread) above another."""
    from acrobat_kernels import loops

    block = 8 if rows >= 16 else 4
    shares = [loops.share(rows, me, parts) for me in range(parts)]
    assert shares[0][0] == 0 and shares[-1][1] == rows
    for (a0, a1), (b0, _) in itertools.pairwise(shares):
        assert a1 == b0 and a0 <= a1
    blocks = [(r1 - r0) // block for r0, r1 in shares[:-1]]
    last_full = (shares[-1][1] - shares[-1][0]) // block
    assert all(r0 % block == 0 for r0, _ in shares)
    assert all(r1 % block == 0 for _, r1 in shares[:-1])
    counts = [*blocks, last_full]
    assert max(counts) - min(counts) <= 1
    assert last_full == min(counts)  # the tail goes to one of the fewest blocks
