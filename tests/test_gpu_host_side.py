"""The host-side logic of the GPU paths, checked on any machine.

A round's value reads on a GPU (fibers._copy_demanded) group the demanded rows by the
batch output they come from and copy each output to the host whole or by its rows;
here the outputs are CPU tensors (which the same code reads without a device wait).

The driver launch (acrobat_kernels/cuda_launch.py) packs a kernel's arguments into a
preallocated block whose addresses it hands to ``cuLaunchKernel``; here a stand-in for
the driver call reads them back. The page-locked ring (acrobat.tensor.IndexRing) stages
index arrays and per-instance data; here a ring over CPU tensors, with its copies done
by torch, checks the bytes, the positions and the wrap. On a GPU, tests/test_gpu.py runs
both for real.
"""

from __future__ import annotations

import ctypes
from array import array
from types import SimpleNamespace as NS

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from acrobat import fibers, tensor
from acrobat_kernels import cuda_launch

_u64, _i64 = ctypes.c_uint64, ctypes.c_int64

_SIGNATURE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)  # fmt: skip


class _Function:
    """A cupy RawKernel's stand-in: ``kernel.ptr`` is the CUfunction handle."""

    def __init__(self, ptr: int):
        self.kernel = type("F", (), {"ptr": ptr})()


def _fake_driver(calls: list, types: list, rc: int = 0):
    """A cuLaunchKernel stand-in recording (function, grid, block, stream, arguments)."""

    def launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        values = [t.from_address(pointers[i]).value for i, t in enumerate(types)]
        calls.append((f, (gx, gy, gz), (bx, by, bz), shared, stream, values, extra))
        return rc

    return _SIGNATURE(launch)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                       st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**40)),
             min_size=1, max_size=4),
    st.integers(1, 2**31 - 1), st.integers(1, 1024), st.integers(0, 2**48),
)  # fmt: skip
def test_launcher_hands_the_driver_each_calls_arguments(launches, grid, block, stream):
    calls: list = []
    types = [_u64, _u64, _i64, _i64]
    driver = _fake_driver(calls, types)
    old = cuda_launch._driver
    cuda_launch._driver = driver
    try:
        launch = cuda_launch.launcher(_Function(0xABC0), types)
        assert launch is not None
        for args in launches:  # (one block reused: each call's values, not the first's)
            launch(grid, block, stream, *args)
    finally:
        cuda_launch._driver = old
    assert len(calls) == len(launches)
    for (f, g, b, shared, s, values, extra), args in zip(calls, launches):
        assert f == 0xABC0 and g == (grid, 1, 1) and b == (block, 1, 1)
        assert shared == 0 and (s or 0) == stream and extra is None  # (NULL: None)
        assert values == list(args)


def test_launcher_raises_the_drivers_error():
    calls: list = []
    old = cuda_launch._driver
    cuda_launch._driver = _fake_driver(calls, [_u64], rc=719)
    try:
        launch = cuda_launch.launcher(_Function(1), [_u64])
        with pytest.raises(RuntimeError, match="CUresult 719"):
            launch(1, 32, 0, 5)
    finally:
        cuda_launch._driver = old


def test_launcher_is_none_without_a_driver():
    old = cuda_launch._driver
    cuda_launch._driver = False  # (libcuda could not be loaded)
    try:
        assert cuda_launch.launcher(_Function(1), [_u64]) is None
    finally:
        cuda_launch._driver = old


def test_launchers_are_built_once_per_key_and_current_device(monkeypatch):
    """cuda_launch.for_current_device: built once per (key, device) in that device's turn,
    None (kept, not rebuilt) where the build found no driver, and nothing for a device
    that is not the thread's current one (the driver launches in the current context)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    built: list = []

    def build(index, tag):
        built.append((index, tag))
        return None if tag == "none" else f"launcher {tag}@{index}"

    cache: dict = {}
    get = cuda_launch.for_current_device
    assert get(cache, "a", torch.device("cuda", 1), build, "a") == "launcher a@1"
    assert get(cache, "a", torch.device("cuda", 1), build, "a") == "launcher a@1"
    assert get(cache, "none", torch.device("cuda", 1), build, "none") is None
    assert get(cache, "none", torch.device("cuda", 1), build, "none") is None
    assert get(cache, "a", torch.device("cuda", 0), build, "a") is None  # not current
    assert get(cache, "a", torch.device("cuda"), build, "a") is None  # (no index)
    assert built == [(1, "a"), (1, "none")]


def _cpu_ring(size: int) -> tensor.IndexRing:
    """An IndexRing over CPU tensors whose copies torch does (the path without cupy)."""
    ring = object.__new__(tensor.IndexRing)
    ring.SIZE = size
    ring.device = torch.device("cpu")
    ring.host = torch.zeros(size, dtype=torch.int64)
    ring.dev = torch.zeros(size, dtype=torch.int64)
    ring.host_ptr, ring.dev_ptr = ring.host.data_ptr(), ring.dev.data_ptr()
    ring.pos = ring.wraps = 0
    ring.memcpy = None
    return ring


_CODES = {"q": torch.int64, "d": torch.float64, "f": torch.float32}


@settings(max_examples=40, deadline=None)
@given(
    items=st.lists(
        st.one_of(
            st.tuples(st.just("index"), st.lists(st.integers(-(2**40), 2**40), max_size=20)),
            st.tuples(st.sampled_from(["q", "d", "f"]),
                      st.lists(st.integers(-1000, 1000), max_size=21)),
        ),
        min_size=1, max_size=30,
    )
)  # fmt: skip
def test_ring_stages_and_puts_the_bytes_and_waits_when_it_wraps(items):
    syncs: list = []
    old = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: syncs.append(device)  # (a wrap's wait)
    try:
        _stage_and_put(items, syncs)
    finally:
        torch.cuda.synchronize = old


def _stage_and_put(items: list, syncs: list) -> None:
    ring = _cpu_ring(64)
    used = 0
    for kind, values in items:
        entries = len(values) if kind in ("index", "q", "d") else -(-len(values) // 2)
        taken = entries <= ring.SIZE // 4  # (a larger one is refused: nothing reserved)
        if taken and used + entries > ring.SIZE:  # it wraps: the ring waits for the device
            used = 0
        if kind == "index":
            view = ring.put(array("q", values))
            if not taken:
                assert view is None
                continue
            assert view.tolist() == values
        else:
            packed = array(kind, values)
            out = torch.empty(len(values), dtype=_CODES[kind])
            ok = ring.stage(packed, out)
            if not taken:
                assert not ok
                continue
            assert ok and out.tolist() == [float(v) if kind != "q" else v for v in values]
        used += entries
        assert ring.pos == used
    assert len(syncs) == ring.wraps


def test_ring_stage_refuses_a_mismatched_output():
    ring = _cpu_ring(64)
    assert not ring.stage(array("q", [1, 2, 3]), torch.empty(2, dtype=torch.int64))
    assert ring.pos == 0


@settings(max_examples=40, deadline=None)
@given(
    outputs=st.lists(st.tuples(st.integers(1, 40), st.sampled_from([3, 1000])),
                     min_size=1, max_size=4),
    data=st.data(),
)  # fmt: skip
def test_demanded_rows_reach_each_fiber_from_whole_outputs_or_their_rows(outputs, data):
    """Small outputs (and ones most of whose rows are read) are copied whole, large ones
    (1000 floats a row, over 64 KB) by their demanded rows; every fiber gets its row."""
    bufs = [torch.randn(rows, width) for rows, width in outputs]
    nodes = {}
    blocked = []
    for b, buf in enumerate(bufs):
        rows = data.draw(st.lists(st.integers(0, buf.shape[0] - 1), max_size=buf.shape[0],
                                  unique=True))  # fmt: skip
        for row in rows:
            key = (b, row)
            nodes[key] = NS(outs=(torch.empty(0), buf), row=row)  # (output 1: the buffer)
            blocked.append(NS(waiting=NS(node=nodes[key], idx=1), host=None, want=buf[row]))
    order = data.draw(st.permutations(range(len(blocked))))
    blocked = [blocked[i] for i in order]  # (fibers of several outputs interleaved)
    host_rows = data.draw(st.booleans(), label="HOST_ROWS")
    old, fibers.HOST_ROWS = fibers.HOST_ROWS, host_rows
    try:
        fibers._copy_demanded(blocked, torch.device("cuda"))
    finally:
        fibers.HOST_ROWS = old
    for fb in blocked:
        # small rows of an output copied whole: converted once, each read a list's row
        converted = host_rows and fb.want.numel() <= fibers._PY_ROWS_MAX and (
            fb.waiting.node.outs[1].nbytes <= fibers._WHOLE_BYTES
            or 2 * sum(f.waiting.node.outs[1] is fb.waiting.node.outs[1] for f in blocked)
            >= fb.waiting.node.outs[1].shape[0]
        )
        assert (type(fb.host) is fibers.HostRow) == converted
        got = fb.host.tensor() if converted else fb.host
        assert torch.equal(got, fb.want)
        value = fibers._host_list(fb.host)  # what t.tolist() returns
        assert value == fb.want.tolist()
        if converted:  # (a list of its own: the caller may mutate it)
            assert value is not fb.host.value and value == fb.host.value
