"""Fusion inside a block: the elementwise tail of a traced block (an LSTM cell's gates,
a TreeLSTM's c/h update) becomes ONE generated kernel (``acrobat_kernels``) that reads
its per-instance operands through gather index arrays (gather fusion, ACRoBat 5.2).

``plan(trace)`` picks the region once per trace: the fusible elementwise nodes of the most
common output shape whose operands are region members, same-shape per-instance values,
shared 0-d/1-D parameters of the same length, or Python numbers; a member may not depend
on a non-member that itself depends on the region (the region runs as one step). Block
arguments read only by the region are not gathered by the executor: the kernel reads
their rows in place (``Source``).

Whether the fused kernel or the per-op torch program runs is decided online per trace and
batch-size bucket (``choice.py``), and only without autograd (the kernels record none).
"""

from __future__ import annotations

import threading

import torch

from acrobat import choice, config
from acrobat.tensor import LazyTensor

# acrobat op name -> kernel op name (acrobat_kernels.elementwise.OPS)
KERNEL_OPS = {
    "neg": "neg", "abs": "abs", "add": "add", "sub": "sub", "mul": "mul", "div": "div",
    "sigmoid": "sigmoid", "tanh": "tanh", "relu": "relu", "exp": "exp", "log": "log",
    "sqrt": "sqrt", "rsqrt": "rsqrt", "square": "square", "maximum": "maximum",
    "minimum": "minimum", "gelu": "gelu", "silu": "silu",
}  # fmt: skip
_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
MIN_REGION = 3  # fewer ops than this are not worth a kernel call
#: Most ops in one fused region (the first ones in program order; the rest run op by op
#: after it). The kernel stays faster than torch's ops at any size measured (64 x 256
#: elements, random programs: 32 ops 209 against 325 µs, 192 ops 913 against 1855), but
#: numba's compile time grows with it (8 ops 1.6 s, 32 ops 2.5 s, 96 ops 10.6 s, 192 ops
#: 16.4 s, in a background thread that competes with the map for this 2-core CPU).
MAX_REGION = 32


class Source:
    """A block argument the fused kernel reads in place: rows ``idx`` (or the first n
    rows, ``idx is None``) of a 2-D ``buf``. ``materialize()`` gathers it for torch."""

    __slots__ = ("buf", "idx", "shape")

    def __init__(self, buf, idx, shape):
        self.buf = buf
        self.idx = idx
        self.shape = shape

    def materialize(self, n: int) -> torch.Tensor:
        rows = self.buf if self.idx is None else self.buf.index_select(0, self.idx)
        return rows.reshape(n, *self.shape)


class Plan:
    """A fused region of one trace."""

    def __init__(
        self, program, members, before, after, inputs, shared, outputs, shape, source_args
    ):
        self.program = program
        self.members = members  # inner nodes fused (program order)
        self.before = before  # non-members to run first
        self.after = after  # non-members that read the region
        self.inputs = inputs  # per-instance operand LazyTensors (kernel "in" order)
        self.shared = shared  # shared operands (kernel "sh" order)
        self.outputs = outputs  # (member node) per kernel output
        self.shape = shape  # per-instance shape of every member
        self.source_args = source_args  # placeholder positions read in place


def _operands(node):
    """The positional operands of an elementwise node, or None if it has options we do
    not fuse (alpha=, out=, approximate='tanh', ...)."""
    if node.kwargs:
        if node.op.name == "gelu" and dict(node.kwargs) == {"approximate": "none"}:
            return list(node.args)
        return None
    return list(node.args)


def plan(trace) -> Plan | None:
    try:
        from acrobat_kernels import elementwise
    except ImportError:  # pragma: no cover - the kernels package ships with acrobat
        return None
    nodes = trace.nodes
    candidates = []
    for nd in nodes:
        name = KERNEL_OPS.get(nd.op.name)
        if name is None or not nd.info.single:
            continue
        shape, dtype = nd.info.metas[0]
        if dtype not in _DTYPES or elementwise.OPS[name] != len(nd.args):
            continue
        ops = _operands(nd)
        if ops is None or not all(_operand_ok(a, shape, dtype) for a in ops):
            continue
        candidates.append(nd)
    if not candidates:
        return None
    # the most common (shape, dtype) among candidates
    groups: dict = {}
    for nd in candidates:
        groups.setdefault(nd.info.metas[0], []).append(nd)
    (shape, dtype), members = max(groups.items(), key=lambda kv: len(kv[1]))
    members = members[:MAX_REGION]  # (a prefix in program order reads no later member)
    member_set = set(members)
    # fixpoint: drop members that depend on a non-member depending on the region
    while True:
        tainted = set()  # nodes (members or not) that depend on the region
        for nd in nodes:
            if nd in member_set or any(
                t.node in tainted or t.node in member_set for t in nd.inputs
            ):
                tainted.add(nd)
        bad = {
            nd
            for nd in members
            if any(t.node in tainted and t.node not in member_set for t in nd.inputs)
        }
        if not bad:
            break
        members = [nd for nd in members if nd not in bad]
        member_set = set(members)
    if len(members) < MIN_REGION:
        return None
    before = [nd for nd in nodes if nd not in member_set and nd not in tainted]
    after = [nd for nd in nodes if nd not in member_set and nd in tainted]
    # operands and outputs of the region
    inputs: list[LazyTensor] = []
    input_index: dict = {}
    shared: list[torch.Tensor] = []
    shared_index: dict = {}
    position = {nd: j for j, nd in enumerate(members)}
    ops = []
    for nd in members:
        refs: list = []
        for a in _operands(nd) or ():
            if type(a) is LazyTensor:
                if a.node in member_set:
                    refs.append(("op", position[a.node]))
                else:
                    key = (id(a.node), a.idx)
                    if key not in input_index:
                        input_index[key] = len(inputs)
                        inputs.append(a)
                    refs.append(("in", input_index[key]))
            elif isinstance(a, torch.Tensor):
                if id(a) not in shared_index:
                    shared_index[id(a)] = len(shared)
                    shared.append(a)
                refs.append(("sh", shared_index[id(a)]))
            else:
                refs.append(float(a))
        ops.append((KERNEL_OPS[nd.op.name], tuple(refs)))
    used_outside = {t.node for nd in after for t in nd.inputs} | {t.node for t in trace.out_lazies}
    outputs = [nd for nd in members if nd in used_outside]
    if not outputs:
        return None
    program = elementwise.Program(
        n_inputs=len(inputs), n_shared=len(shared), ops=tuple(ops),
        outputs=tuple(position[nd] for nd in outputs), dtype=_DTYPES[dtype],
    )  # fmt: skip
    # block arguments read by nothing but the region (and passed once): the kernel reads
    # their rows in place instead of the executor gathering them
    readers = {id(t.node) for nd in before + after for t in nd.inputs}
    readers |= {id(t.node) for t in trace.out_lazies}
    region_inputs = {id(t.node) for t in inputs}
    ph_ids = [id(ph) for ph in trace.placeholders]
    source_args = {
        k
        for k, ph in enumerate(ph_ids)
        if ph in region_inputs and ph not in readers and ph_ids.count(ph) == 1
    }
    return Plan(
        program, members, before, after, inputs, shared, outputs, shape, frozenset(source_args)
    )


def _operand_ok(a, shape, dtype) -> bool:
    if type(a) is LazyTensor:
        return a.shape == shape and a.dtype == dtype
    if isinstance(a, torch.Tensor):
        if a.dtype != dtype or (a.requires_grad and torch.is_grad_enabled()):
            return False
        return a.ndim == 0 or (a.ndim == 1 and len(shape) == 1 and a.shape == shape)
    return type(a) in (int, float)


def run(trace, p: Plan, env: dict, xs: list, n: int):
    """Run a trace with its fused region: ``xs`` holds tensors or ``Source``s."""
    from acrobat_kernels import elementwise

    for ph, x in zip(trace.placeholders, xs):
        env[ph] = (x,)

    def value(t):
        v = env[t.node][t.idx]
        return v.materialize(n) if type(v) is Source else v

    for inner in p.before:
        env[inner] = inner.op.rule(inner, [value(t) for t in inner.inputs], n)
    F = 1
    for s in p.shape:
        F *= s
    sources = []
    for t in p.inputs:
        v = env[t.node][t.idx]
        if type(v) is Source:
            sources.append((v.buf, v.idx))
        else:
            sources.append((v.reshape(n, F) if v.is_contiguous() else _rows(v, n, F), None))
    backend = config.KERNEL_BACKEND
    backend = "auto" if backend == "online" else backend  # (elementwise's auto: the device's)
    outs = elementwise.run_built(p.program, n, F, sources, p.shared, backend=backend)
    for nd, out in zip(p.outputs, outs):
        env[nd] = (out.reshape(n, *p.shape),)
    for inner in p.after:
        env[inner] = inner.op.rule(inner, [value(t) for t in inner.inputs], n)
    return tuple(value(t) for t in trace.out_lazies)


def _rows(v, n, F):
    """A (n, F) view of a batched operand whose rows have unit inner stride (a chunk of a
    GEMM output), without copying; else a contiguous copy."""
    if v.ndim == 2 and v.stride(1) == 1:
        return v
    return v.reshape(n, F)


def use_fused(trace, device) -> bool:
    """Whether this call runs the fused region (or, with "online", may: the variant is
    then chosen online). "auto": on the CPU once its numba kernel is compiled (1-2 s, in
    the background, the per-op program running meanwhile; then numba's disk cache), on a
    GPU op by op (the CUDA kernel measured level there: config.KERNEL_BACKEND)."""
    backend = config.KERNEL_BACKEND
    if trace.fusion is None or backend == "off" or torch.is_grad_enabled():
        return False
    cpu = device is None or device.type == "cpu"
    if backend == "auto" and not cpu:
        return False
    if backend in ("auto", "online") and cpu:
        return kernel_ready(trace.fusion.program)
    return True


def choose(trace, n: int, fused, unfused, device):
    if config.KERNEL_BACKEND != "online":
        return fused()
    key = ("fusion", id(trace), choice.bucket(n))
    return choice.CHOOSER.run(key, {"fused": fused, "torch": unfused}, device, work=n)


def reads_in_place(device) -> bool:
    """Whether a batch on ``device`` passes the fused region's in-place operands as
    :class:`Source` (rows read by the kernel where they are): where the region may run
    through :func:`run`, a device's kernel fed by the executor's operands as they are;
    on the CPU the region runs inside the block's generated code, its operands gathered
    (Trace.run_fused)."""
    backend = config.KERNEL_BACKEND
    if backend in ("off", "auto") or torch.is_grad_enabled():
        return False
    return device.type != "cpu"


_READY: dict = {}  # program -> True (compiled) | False (compiling) | None (failed)
_THREADS: list[threading.Thread] = []


def kernel_ready(program) -> bool:
    state = _READY.get(program, "new")
    if state == "new":
        _READY[program] = False
        thread = threading.Thread(target=_compile, args=(program,), daemon=True)
        _THREADS.append(thread)
        thread.start()
        return False
    return bool(state)


def wait_compiled() -> None:
    """Block until every kernel compile started in the background has finished."""
    while _THREADS:
        _THREADS.pop().join()


def _compile(program) -> None:
    try:
        from acrobat_kernels import elementwise

        elementwise._numba_kernel(program)
        _READY[program] = True
    except Exception:  # no numba, or a compile failure: never use the kernel
        _READY[program] = None
