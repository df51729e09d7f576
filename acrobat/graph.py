"""The dataflow graph, built one node per recorded op, with everything the scheduler
needs computed inline at record time (no later pass over the graph):

* depth  = 1 + max(depth of the pending inputs in the same phase) (ACRoBat section 4.1);
           inputs computed by an earlier flush count as depth 0
* phase  = max(the fiber's phase, the inputs' phases)       (program phases, A.3)
* taint  = a LazyTensor operand depends on per-instance data; a real ``torch.Tensor``
           operand (a parameter, or a value computed from parameters and constants only)
           is shared by every instance and is reused, not gathered (section 5.1)
* signature = (op, static attributes, per-instance shapes/dtypes, identity of each
           reused operand). Nodes with equal (phase, depth, signature) form one batch; the
           node is appended to that bucket right away, so forming batches costs a dict
           lookup per node.

``record`` is the hot path of graph construction; keep it lean.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from types import NoneType
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from acrobat import config
from acrobat.errors import AcrobatError, LazyValueError, ShapeError, UnsupportedOpError, user_line
from acrobat.tensor import LazyTensor, _native, type_key


class _NodeFields:
    """Node's fields (``_native.NodeBase`` holds the same ones in C)."""

    __slots__ = (
        "op",
        "func",
        "args",
        "kwargs",
        "inputs",
        "info",
        "sig",
        "depth",
        "phase",
        "instance",
        "rt",
        "data",
        "outs",
        "row",
        "slot",
        "height",
        "used",
        "used_at",
        "demanded",
    )

    def __init__(self, op, func, args, kwargs, inputs, info, sig, depth, phase, instance, rt):
        self.op = op  # the ops.Op row
        self.func = func  # the torch callable the user called (an alias of op)
        self.args = args  # call arguments, LazyTensors in place (the batch's template)
        self.kwargs = kwargs
        self.inputs = inputs  # the LazyTensor operands, in argument order
        self.info = info  # shared per signature: output shapes/dtypes and structure
        self.sig = sig
        self.depth = depth
        self.phase = phase
        self.instance = instance
        self.rt = rt
        self.data = None  # per-node payload of data ops (a Python value, an index)
        self.outs = None  # after execution: the batch's output tensors
        self.row = 0  # ... and this node's row in them
        self.slot = 0  # ... as one int (executor.gather)
        self.height = 0  # longest path to a sink of its flush (scheduler.relevel)
        self.used = 0  # operands of nodes recorded since that read an output (ops.in_place)
        self.used_at = None  # or {output index > 0: how many of those read it} (readers)
        self.demanded = False  # a fiber has waited for its value (scheduler.unneeded)


if TYPE_CHECKING:
    _NodeBase = _NodeFields
else:
    _NodeBase = _native.NodeBase if _native is not None else _NodeFields


class Node(_NodeBase):
    """One recorded op of one instance. Plain data; operations live in the stage modules.
    Fields: see ``_NodeFields`` (``depth``, ``phase``, ``instance``, ``row``, ``slot``
    and ``height`` are ints; the others any object, ``data`` and ``outs`` None at first)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return (
            f"%{id(self) & 0xFFFF:04x} = {self.op.name}(inst={self.instance}, "
            f"phase={self.phase}, depth={self.depth}, in={len(self.inputs)})"
        )


if _native is not None:  # freed in one pass, not through subtype_dealloc (see _native.c)
    _native.fast_dealloc(Node)


class Info:
    """What a signature's shape rule produced: per-output (shape, dtype) and how the
    outputs are packaged (a single tensor, a tuple, or a torch.return_types namedtuple)."""

    __slots__ = ("keys", "metas", "single", "struct")

    def __init__(self, metas, single, struct):
        self.metas = metas
        self.single = single
        self.struct = struct
        self.keys = tuple(type_key(s, d) for s, d in metas)


#: id(tensor) -> the tensor, for the real outputs of block traces that a pure factory
#: made while tracing (``h = torch.zeros(n)`` in a region that returns it). A trace
#: outlives its map and gives that same tensor to the calls of every later map, where
#: ``factory_keys`` (this map's factories) does not know it: a loop state that starts as
#: it would run its first step alone there instead of as a shared constant read as a row
#: (analysis.ScanBlock asks both). The tensors are held here (their ids stay theirs), at
#: most TRACE_FACTORIES_MAX of them, the oldest dropped first.
TRACE_FACTORIES: dict[int, torch.Tensor] = {}
TRACE_FACTORIES_MAX = 1024


def note_trace_factory(rt: Runtime, out) -> None:
    """Remember ``out``, a real output of a block trace, if this map's factory made it."""
    if id(out) not in rt.factory_keys or id(out) in TRACE_FACTORIES:
        return
    while len(TRACE_FACTORIES) >= TRACE_FACTORIES_MAX:
        del TRACE_FACTORIES[next(iter(TRACE_FACTORIES))]
    TRACE_FACTORIES[id(out)] = out


class Runtime:
    """State of one ``f.map`` call: pending buckets, the hoisting cache, fibers, stats.
    Slots: the C record path reads its fields at their offsets (``_native``'s slot
    caches) instead of through a dict lookup each."""

    __slots__ = (
        "id", "buckets", "sig_info", "hoisted", "hoist_keepalive", "hoisted_versions",
        "device", "default_device", "mode", "grad_mode", "autocast", "stats", "fiber",
        "tracer", "ready", "blocked", "main", "pool", "failed", "all_fibers", "live", "phased",
        "thread", "nodes", "deferred", "py_rows", "shared", "kept", "split_seen", "freed",
        "poisoned",
        "take_tables", "tables", "read_from", "used_splits", "memo_blocks", "factory_keys",
        "constants",
        "grad_regions", "grad_resume", "object_inputs", "object_owner", "fresh", "built",
        "write_lines", "sunk",
        "__weakref__",
    )  # fmt: skip
    _ids = itertools.count(1)

    def __init__(self, stats):
        self.id = next(Runtime._ids)
        self.buckets: dict[tuple, list[Node]] = {}
        self.sig_info: dict[tuple, Info] = {}
        self.hoisted: dict[tuple, Any] = {}
        self.hoist_keepalive: list[Any] = []
        self.hoisted_versions: list[tuple] = []  # (shared result, its _version, op)
        self.write_lines: dict = {}  # id -> (real tensor, the line of a write into it)
        self.device = torch.device("cpu")  # the map's (fibers.map_device)
        self.default_device = torch.device("cpu")  # torch's default when the map began
        self.mode = None  # the map's fibers.RecordMode
        self.grad_mode = True  # torch's grad mode when the map began (its batches run so)
        self.autocast = None  # (device type, dtype) of the autocast the map runs in, or None
        self.stats = stats
        self.fiber = None  # the running fiber (fibers.Fiber)
        self.tracer = None  # a block.Tracer while a block body is being traced
        self.ready: deque = deque()
        self.blocked: list = []
        self.main = None  # the scheduler's greenlet
        self.pool: list = []  # the thread's parked worker greenlets (fibers._pool)
        self.failed = None  # a fiber whose code raised: the driver re-raises its error
        self.all_fibers: list = []
        self.live: list = []  # fibers not known to be done (pruned at each flush)
        self.phased = False  # acrobat.phase entered: flushes bound by the fibers' phases
        self.thread = threading.get_ident()  # map runs on one thread; others see no runtime
        self.nodes = 0
        self.deferred = 0  # deferred constants not queued (yet): see record_data
        self.sunk = False  # a demand flush left sinks pending (scheduler.unneeded)
        self.py_rows: dict[int, list] = {}  # id(batch output) -> its tolist(), per flush
        self.take_tables: dict[int, tuple] = {}  # id(table) -> (rows, row shape, dtype, sig)
        self.tables: set[int] = set()  # id(outs) of batches whose outputs are a real
        # tensor's rows in place (executor: row lookups, row-wise views of them)
        self.shared: set[int] = set()  # id(outs) of batches some of whose rows several
        # nodes may read as their own (tables in place, executor._distinct's batches)
        self.kept: list = []  # ... their outputs tuples, alive for the map (ids unique)
        # config.VERIFY: the outputs released while the map runs, kept to its end, and how
        # many of them executor.poison_freed has filled with NaN (None: not watched)
        self.freed: list | None = None
        self.poisoned = 0
        # id(data node) -> (the node, the lazy tensor whose read value it was made from):
        # x[mask]'s positions (ops._rows_where), for ops._readers_within's walk
        self.read_from: dict[int, tuple] = {}
        self.used_splits: list = []  # hoisting.Split objects whose memo holds this run
        # (id(trace), position, id(argument's node), its output) -> that node, for the calls
        # a trace counts toward a cut (hoisting.split_call; the node held, so its id names
        # no other; not the lazy tensor, which would keep the value from being freed)
        self.split_seen: dict = {}
        self.memo_blocks: list = []  # blocks that remember cache hits of this run (C)
        # id(hoisted factory result) -> its hoist key: a block called with torch.zeros(h)
        # keys its trace by how the constant was made, not by the per-run object
        self.factory_keys: dict[int, tuple] = {}
        # id(shared constant) -> a computed LazyTensor of it (executor.constant)
        self.constants: dict[int, LazyTensor] = {}
        # fibers inside a grad-mode region of their own (torch.no_grad() in instance code);
        # while there are any, grad_resume (fibers._resume_grad) is called whenever a fiber
        # resumes, to put the thread's grad mode back to that fiber's
        self.grad_regions = 0
        self.grad_resume: Any = None
        # (instance, id(tensor)) -> (tensor, its lazy input), for tensors read from the
        # attributes of the user's objects (acrobat/objects.py); id(tensor) -> the first
        # instance that read it
        self.object_inputs: dict = {}
        self.object_owner: dict = {}
        # id(hoisted new tensor) -> (its hoist key, the recording stamp when it was made),
        # while no other instance has it and nothing has read it: in-place writes may still
        # build it (construct); id(built tensor) -> its _version after the last such write
        self.fresh: dict[int, tuple] = {}
        self.built: dict[int, int] = {}


class GradTag:
    """The grad mode a node was recorded in, where it is not its map's (instance code
    inside ``torch.no_grad()`` or ``torch.enable_grad()``): its signature is ``(tag,
    signature)``, so it batches only with nodes of the same mode, and the executor runs
    its batch in that mode (``fibers._set_grad_enabled``)."""

    __slots__ = ("enabled",)

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __repr__(self) -> str:
        return "GRAD_ON" if self.enabled else "GRAD_OFF"


GRAD_OFF, GRAD_ON = GradTag(False), GradTag(True)


def calls_record(rt: Runtime | None) -> TypeGuard[Runtime]:
    """Whether a block, region or loop called now records as one node (a fiber of the map
    ``rt`` runs, no block is being traced, and the fiber is not inside a grad-mode region
    of its own, where calls run op by op); else the dispatcher runs its function as it
    is. ``_native.recording_rt`` is the same check in C."""
    return (
        rt is not None and rt.fiber is not None and rt.tracer is None and rt.fiber.grad is None
    )


def grad_tag(sig):
    """The :class:`GradTag` of a node's signature, or None (its map's grad mode)."""
    return sig[0] if type(sig) is tuple and sig and type(sig[0]) is GradTag else None


RT: Runtime | None = None  # the active runtime (set by fibers.run_map)

_SCALARS = {int, str, NoneType, bool, float, complex}
_STATIC = (torch.dtype, torch.device, torch.layout, torch.memory_format, type(Ellipsis))


def freeze(a, inputs: list):
    """Hashable batching key of one argument; appends LazyTensor operands to ``inputs``.

    LazyTensor -> (shape, dtype); real tensor -> ('T', id) (identity of a reused operand);
    floats and bools are tagged so that 1, 1.0 and True do not share a signature."""
    t = type(a)
    if t is LazyTensor:
        inputs.append(a)
        return a.key
    if t is int or t is str or a is None:
        return a
    if t is float or t is bool:
        return (t, a)
    if isinstance(a, torch.Tensor):
        return ("T", id(a))
    if t is tuple or t is list or t is torch.Size:
        return (t, tuple([freeze(x, inputs) for x in a]))
    if t is slice:
        return (slice, freeze(a.start, inputs), freeze(a.stop, inputs), freeze(a.step, inputs))
    if isinstance(a, _STATIC):
        return a
    if isinstance(a, tuple):  # namedtuple
        return (t, tuple([freeze(x, inputs) for x in a]))
    try:
        hash(a)
    except TypeError:
        raise UnsupportedOpError(
            f"cannot record an argument of type {t.__name__} (at {user_line(3)})"
        ) from None
    return (t, a)


def freeze_kwargs(kwargs: dict, inputs: list):
    return tuple([(k, freeze(v, inputs)) for k, v in kwargs.items()])


def substitute(a, it):
    """``a`` with every LazyTensor replaced by the next item of iterator ``it``."""
    t = type(a)
    if t is LazyTensor:
        return next(it)
    if t is tuple or t is list:
        return t([substitute(x, it) for x in a])
    if t is slice:
        return slice(substitute(a.start, it), substitute(a.stop, it), substitute(a.step, it))
    return a


def has_lazy(a) -> bool:
    t = type(a)
    if t is LazyTensor:
        return True
    if t is tuple or t is list:
        for x in a:
            if has_lazy(x):
                return True
    elif t is slice:
        return has_lazy(a.start) or has_lazy(a.stop) or has_lazy(a.step)
    elif t is dict:
        return any(has_lazy(x) for x in a.values())
    return False


# ---- shape rules -------------------------------------------------------------------
# Shape/dtype inference evaluates the op on meta tensors once per signature. The result
# depends only on shapes and dtypes, so a second cache keyed by those alone is shared
# across map calls (the per-run cache holds identities of reused tensors, which may be
# recycled after the run).

_SHAPE_CACHE: dict[tuple, Info] = {}


def _meta_of(a):
    t = type(a)
    if t is LazyTensor:
        return torch.empty(a.shape, dtype=a.dtype, device="meta")
    if isinstance(a, torch.Tensor):
        return torch.empty(a.shape, dtype=a.dtype, device="meta")
    if t is tuple or t is list:
        return t([_meta_of(x) for x in a])
    if t is dict:
        return {k: _meta_of(v) for k, v in a.items()}
    if t is slice:
        return slice(_meta_of(a.start), _meta_of(a.stop), _meta_of(a.step))
    return a


def _filled(a, value, device, index_value=None):
    """Tensors as real ones of their shape and dtype filled with ``value`` on ``device``
    (contiguous: ``x.view`` needs them so); with ``index_value``, 0-d integer lazy
    tensors filled with that instead (see _value_shaped)."""
    t = type(a)
    if t is LazyTensor or isinstance(a, torch.Tensor):
        if index_value is not None and t is LazyTensor and index_like(a):
            value = index_value
        return torch.full(a.shape, value, dtype=a.dtype, device=device)
    if t is tuple or t is list:
        return t([_filled(x, value, device, index_value) for x in a])
    if t is dict:
        return {k: _filled(v, value, device, index_value) for k, v in a.items()}
    return a


def _tensors(a):
    """The tensors (lazy or real) among an argument pytree (tuples, lists, dicts)."""
    t = type(a)
    if t is LazyTensor or isinstance(a, torch.Tensor):
        yield a
    elif t is tuple or t is list:
        for x in a:
            yield from _tensors(x)
    elif t is dict:
        for x in a.values():
            yield from _tensors(x)


def _shape_key(a):
    t = type(a)
    if t is LazyTensor or isinstance(a, torch.Tensor):
        return ("S", tuple(a.shape), a.dtype)
    if t is tuple or t is list:
        return (t, tuple([_shape_key(x) for x in a]))
    if t is slice:
        return (slice, _shape_key(a.start), _shape_key(a.stop), _shape_key(a.step))
    if t is float or t is bool:
        return (t, a)
    try:
        hash(a)
    except TypeError:
        return (t, id(a))
    return a


def _linear_shape(args: tuple, kwargs: dict):
    """``F.linear``'s output (shape, dtype) when it is plain (one dtype, fitting shapes),
    else None: its meta kernel is a Python decomposition whose first call imports
    torch._dynamo (~0.8 s of a fresh process's first map)."""
    if kwargs or not 2 <= len(args) <= 3:
        return None
    x, w = args[0], args[1]
    b = args[2] if len(args) == 3 else None
    if not (_has_shape(x) and _has_shape(w)) or (b is not None and not _has_shape(b)):
        return None
    xs, ws = x.shape, w.shape
    if len(xs) < 1 or len(ws) != 2 or xs[-1] != ws[1] or w.dtype != x.dtype:
        return None
    if not x.dtype.is_floating_point:
        return None
    if b is not None and (b.dtype != x.dtype or tuple(b.shape) not in ((ws[0],), ())):
        return None
    return torch.Size((*xs[:-1], ws[0])), x.dtype


def _has_shape(a) -> bool:
    return type(a) is LazyTensor or isinstance(a, torch.Tensor)


def index_like(t) -> bool:
    """A 0-d integer tensor: one torch would also take as a Python number (a dim, a
    size, a start), so a per-instance one may make each instance a program of its own."""
    return t.shape == () and not t.dtype.is_floating_point and t.dtype is not torch.bool


def _shapes(out):
    if isinstance(out, torch.Tensor):
        return out.shape
    if isinstance(out, (tuple, list)):
        return tuple(_shapes(o) for o in out)
    return None


def _value_shaped(func, args, kwargs, out) -> bool:
    """Whether ``out``'s shape (computed with ones) depends on the value of a 0-d integer
    lazy operand: ``x.reshape(n, -1)``, ``x.unsqueeze(d)``, ``x.repeat(k, 1)`` with a
    per-instance ``n``, ``d``, ``k`` (torch reads such a tensor as the number). Run again
    with twos there: another shape means the recorded one would be wrong for some
    instances. (An error with twos, ``x[i]`` past a 2-row ``x``, says nothing.)"""
    operands = (*_tensors(args), *_tensors(kwargs))
    if not any(type(t) is LazyTensor and index_like(t) for t in operands):
        return False
    cpu = torch.device("cpu")
    try:
        again = func(*_filled(args, 1, cpu, 2), **_filled(kwargs, 1, cpu, 2))
    except Exception:
        return False
    return _shapes(again) != _shapes(out)


def _varied(a):
    """Lazy tensors as real ones of their shape and dtype on the CPU holding varied values
    (0 to 6, repeating), real tensors moved to the CPU (see _value_sized)."""
    t = type(a)
    if t is LazyTensor:
        n = math.prod(a.shape)
        values = torch.arange(n, dtype=torch.float64).remainder(7).reshape(a.shape)
        return values.to(a.dtype) if a.dtype != torch.bool else values > 2
    if isinstance(a, torch.Tensor):
        return a.cpu()
    if t is tuple or t is list:
        return t([_varied(x) for x in a])
    if t is dict:
        return {k: _varied(v) for k, v in a.items()}
    return a


def _value_sized(func, args, kwargs, out) -> bool:
    """Whether a generic op's result (``out``, inferred) has another shape where its lazy
    operands hold other values (``torch.unique``-like: no batch can hold it): run on CPU
    with varied values, an error saying nothing."""
    try:
        with torch._C.DisableTorchFunction():
            again = func(*_varied(args), **_varied(kwargs))
    except Exception:
        return False
    return _shapes(again) != _shapes(out)


#: Shapes and dtypes are inferred by running the op on CPU ones where every tensor
#: operand has at most CPU_SHAPES_MAX elements: torch's meta kernels
#: of most ops (elementwise, cat, stack...) are Python references whose first call
#: imports torch._dynamo (~0.8 s of a process's first map), where the CPU kernels are
#: ready and run in microseconds at such sizes. An error there (an index the ones do not
#: fit) falls back to the meta kernels. Not for the ops named in IMPURE_OPS (filled by
#: acrobat.ops: random draws would move the generator).
CPU_SHAPES_MAX = 1 << 16
IMPURE_OPS: set[str] = set()
#: Ops that read a 0-d integer operand as an index or a class (a loss's target, a
#: lookup), never as a size: _value_shaped does not run them again with twos, which may
#: be out of range there (filled by acrobat.ops): a segfault inside torch's cross_entropy
#: under _value_shaped (classes = 2, target filled with 2) was seen once in a test run.
INDEX_OPS: set[str] = set()


def _small(args: tuple, kwargs: dict) -> bool:
    operands = (*_tensors(args), *_tensors(kwargs))
    return all(t.shape.numel() <= CPU_SHAPES_MAX for t in operands)


def _number_error(op, rt, what: str, example: str) -> UnsupportedOpError:
    """A per-instance 0-d tensor given where torch reads a Python number."""
    inst = rt.fiber.instance if rt.fiber is not None else None
    return UnsupportedOpError(
        f"{op.name} given a per-instance tensor where torch needs a Python number ({what}"
        f"instance {inst}, at {user_line(4)}): read it first with int(t) (a value read), "
        f"e.g. {example}"
    )


def _on_device(op, func, args, kwargs, rt, fill: int):
    """``func`` on real tensors of the operands' shapes filled with ``fill`` on the map's
    device; a failure is a ShapeError naming the op, the instance and the user's line (or
    the number error for a lazy tensor where torch reads a number)."""
    try:
        return func(*_filled(args, fill, rt.device), **_filled(kwargs, fill, rt.device))
    except Exception as exc:
        if isinstance(exc, LazyValueError):  # a lazy tensor where a number goes
            raise _number_error(op, rt, "", "x[int(i):]") from exc
        inst = rt.fiber.instance if rt.fiber is not None else None
        raise ShapeError(
            f"{op.name}: operands do not fit (instance {inst}, at {user_line(4)}): {exc}"
        ) from exc


_LINEAR = torch.nn.functional.linear
_SHAPE_RULES = {_LINEAR: _linear_shape}  # functions whose meta kernel is costly to reach


def infer(op, func, args, kwargs, rt) -> Info:
    key: tuple = (
        op.name, func, _shape_key(args), _shape_key(tuple(kwargs.items())) if kwargs else None
    )  # fmt: skip
    if rt.autocast is not None:  # (dtypes as autocast makes them: inferred on the device)
        key = (*key, rt.autocast)
    info = _SHAPE_CACHE.get(key)
    if info is not None:
        return info
    if rt.autocast is None:
        rule = _SHAPE_RULES.get(func)
        meta = rule(args, kwargs) if rule is not None else None
        if meta is not None:
            info = _SHAPE_CACHE[key] = Info((meta,), True, None)
            return info
    with torch._C.DisableTorchFunction():
        out = None
        if rt.autocast is not None:
            # dtypes as autocast makes them: on ones of the map's device (autocast casts per
            # device type; meta tensors, CPU ones for another device's map and the shape
            # rules would keep the operands' dtypes)
            out = _on_device(op, func, args, kwargs, rt, 1)
        elif op.name not in IMPURE_OPS and _small(args, kwargs):
            cpu = torch.device("cpu")
            try:
                out = func(*_filled(args, 1, cpu), **_filled(kwargs, 1, cpu))
            except Exception:
                out = None
            if (
                out is not None
                and op.name not in INDEX_OPS
                and _value_shaped(func, args, kwargs, out)
            ):
                raise _number_error(
                    op, rt, "a size, a dim or a count: the result's shape would depend on "
                    "its value; ", "x.reshape(int(n), -1)",
                )  # fmt: skip
        try:
            if out is None:
                out = func(*_meta_of(args), **_meta_of(kwargs))
        except Exception:
            # No meta kernel, or one that reads values (a 0-d index tensor): evaluate on
            # zeros of the right shapes instead; a real shape error raises here too.
            out = _on_device(op, func, args, kwargs, rt, 0)
    if op.extra.get("generic") and _value_sized(func, args, kwargs, out):
        raise UnsupportedOpError(
            f"{getattr(func, '__name__', op.name)} on lazy tensors (at {user_line(4)}): the "
            "shape of its result depends on its operands' values, which cannot be batched; "
            "compute it on real tensors outside f.map"
        )
    if isinstance(out, torch.Tensor):
        info = Info(((out.shape, out.dtype),), True, None)
    elif isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        struct = type(out) if type(out) not in (tuple, list) else None
        info = Info(tuple((o.shape, o.dtype) for o in out), False, struct)
    else:
        raise UnsupportedOpError(f"{op.name} returned {type(out).__name__}, not tensors")
    if len(_SHAPE_CACHE) > 100_000:
        _SHAPE_CACHE.clear()
    _SHAPE_CACHE[key] = info
    return info


def wrap_outputs(node: Node, info: Info):
    metas = info.metas
    if info.single:
        shape, dtype = metas[0]
        return LazyTensor(node, 0, shape, dtype, info.keys[0])
    keys = info.keys
    outs = tuple([LazyTensor(node, k, s, d, keys[k]) for k, (s, d) in enumerate(metas)])
    return info.struct(outs) if info.struct is not None else outs


# ---- recording ---------------------------------------------------------------------


def _check_inputs(inputs, rt):
    for t in inputs:
        if t.node.rt is not rt:
            raise LazyValueError(
                f"a LazyTensor from another f.map call was used (at {user_line(4)}); "
                "lazy tensors only live inside the f.map call that made them"
            )


def signature(func, args: tuple, kwargs: dict, inputs: list) -> tuple:
    """The batching signature of a call; appends its LazyTensor operands to ``inputs``.

    ``func`` (not the op row) is part of it: aliases of a row may differ in dtype or
    randomness (``x & y`` vs ``logical_and``, ``rand_like`` vs ``randn_like``)."""
    parts = []
    for a in args:  # freeze, with its commonest cases inlined: this is the hot path
        t = type(a)
        if t is LazyTensor:
            inputs.append(a)
            parts.append(a.key)
        elif t is int or a is None:
            parts.append(a)
        else:
            parts.append(freeze(a, inputs))
    if kwargs:
        return (func, tuple(parts), freeze_kwargs(kwargs, inputs))
    return (func, tuple(parts))


def record(op, func, args: tuple, kwargs: dict):
    """Record one op call; returns its LazyTensor output(s). The hot path."""
    rt = RT
    if rt is None:
        raise LazyValueError(
            f"{op.name} on a LazyTensor outside f.map (at {user_line(2)}): lazy tensors only "
            "live inside the f.map call that made them"
        )
    if rt.tracer is not None:
        return rt.tracer.record(op, func, *copy_lists(args, kwargs))
    if _native is not None and type(args) is tuple:  # the same steps in C
        return _native.record_node(rt, op, func, args, kwargs)
    args, kwargs = copy_lists(args, kwargs)
    inputs: list[LazyTensor] = []
    sig = signature(func, args, kwargs, inputs)
    info = rt.sig_info.get(sig)
    if info is None:
        info = rt.sig_info[sig] = infer(op, func, args, kwargs, rt)
    return wrap_outputs(add_node(rt, op, func, args, kwargs, inputs, info, sig), info)


def copy_lists(args: tuple, kwargs):
    """``(args, kwargs)`` with every list in them copied (nested ones too): a node keeps
    the arguments its batch runs with until the flush, and the instance may change a
    list it passed in the meantime (``x[chosen]``, then ``chosen.append(i)``; a
    ``permute(dims)`` list reversed afterwards), which eager has already used."""
    if any(type(a) is list or type(a) is tuple for a in args):
        args = tuple([_copied(a) for a in args])
    if kwargs and any(type(v) is list or type(v) is tuple for v in kwargs.values()):
        kwargs = {k: _copied(v) for k, v in kwargs.items()}
    return args, kwargs


def _copied(a):
    t = type(a)
    if t is list:
        return [_copied(x) for x in a]
    if t is tuple:
        return tuple([_copied(x) for x in a])
    return a


def mark_read(t) -> None:
    """Count a recorded operand that reads the lazy ``t`` (``node.used``, and
    ``node.used_at`` for an output after the first: :func:`readers`)."""
    node = t.node
    node.used += 1
    idx = t.idx
    if idx:  # (assigned, not updated in place: NodeBase's used_at gives a new dict)
        at = node.used_at or {}
        at[idx] = at.get(idx, 0) + 1
        node.used_at = at


def readers(node, idx: int) -> int:
    """How many recorded operands read output ``idx`` of ``node`` (:func:`mark_read`): a
    reader of another output holds another tensor, which an update of this one leaves."""
    at = node.used_at
    if not at:
        return 0 if idx else node.used
    return at.get(idx, 0) if idx else node.used - sum(at.values())


def add_node(rt, op, func, args, kwargs, inputs, info, sig) -> Node:
    """Create the node, compute its phase and depth inline, and queue it in its bucket."""
    fiber = rt.fiber
    phase = fiber.phase
    if fiber.grad is not None:  # recorded in a grad mode other than the map's: its batches
        sig = (fiber.grad, sig)  # are its own (GradTag)
    depth = 0
    for t in inputs:
        producer = t.node
        mark_read(t)
        if producer.depth < 0:  # a deferred constant: its value is needed after all
            queue(rt, producer)
        if producer.outs is not None:
            # Computed by an earlier flush: depth restarts after each flush, so instances
            # that resume from a value demand line up again however long their histories.
            if producer.rt is not rt:
                _check_inputs(inputs, rt)
            continue
        p = producer.phase
        if p == phase:
            if producer.depth > depth:
                depth = producer.depth
        elif p > phase:
            phase = p
            depth = producer.depth
    node = Node(op, func, args, kwargs, inputs, info, sig, depth + 1, phase, fiber.instance, rt)
    _enqueue(rt, node)
    return node


def _enqueue(rt, node) -> None:
    """Append ``node`` to its (phase, depth, signature) bucket: forming batches is this."""
    buckets = rt.buckets
    key = (node.phase, node.depth, node.sig)
    bucket = buckets.get(key)
    if bucket is None and node.depth and config.ALIGN_WINDOW:
        bucket = _later_bucket(buckets, node, config.ALIGN_WINDOW)
    if bucket is None:
        buckets[key] = [node]
    else:
        bucket.append(node)


def _later_bucket(buckets: dict, node, window: int) -> list | None:
    """The nearest bucket of ``node``'s signature at most ``window`` levels deeper, with
    ``node`` moved to its depth (config.ALIGN_WINDOW); None if there is none."""
    phase, sig = node.phase, node.sig
    for d in range(node.depth + 1, node.depth + window + 1):
        bucket = buckets.get((phase, d, sig))
        if bucket is not None:
            node.depth = d
            return bucket
    return None


def record_data(op, sig, data, shape, dtype, deferred: bool = False):
    """Record a data node (a per-instance constant, input or row lookup): no operands,
    depth 0, the value carried in ``node.data`` and batched by the op's rule.

    A ``deferred`` node (``torch.tensor(word_id)``) is queued only when something needs
    its value: an embedding lookup of it becomes one row lookup of the table instead
    (``ops._special_embedding``), so the constant never becomes a node of its own."""
    rt = RT
    assert rt is not None
    if _native is not None:  # the same in C, once the signature's Info exists
        out = _native.record_data(rt, op, sig, data, shape, dtype, deferred)
        if out is not None:
            return out
    fiber = rt.fiber
    info = rt.sig_info.get(sig)
    if info is None:
        info = rt.sig_info[sig] = Info(((shape, dtype),), True, None)
    node = Node(op, None, (), None, (), info, sig, 0, fiber.phase, fiber.instance, rt)
    node.data = data
    if deferred:
        node.depth = DEFERRED
        rt.deferred += 1
    else:
        queue(rt, node)
    return LazyTensor(node, 0, shape, dtype, info.keys[0])


DEFERRED = -1  # the depth of a data node that is not queued (yet)


def queue(rt, node) -> None:
    """Put a depth-0 data node into its bucket."""
    if node.depth == DEFERRED:
        rt.deferred -= 1
    node.depth = 0
    _enqueue(rt, node)


# Factories whose value is a function of their Python arguments alone (not torch.empty)
PURE_FACTORIES = frozenset(
    {torch.zeros, torch.ones, torch.full, torch.arange, torch.eye, torch.linspace}
)


def hoist(func, args, kwargs):
    """Run an op whose operands are all real (parameters, constants) once per map call:
    the cache makes every instance share one result (ACRoBat's hoisting, A.1)."""
    rt = RT
    if not kwargs and len(args) == 1 and type(args[0]) is int:  # torch.zeros(h): the key
        hit = rt.hoisted.get((func, args, ()))  # freeze makes, without the calls
        if hit is not None:
            return _hoisted_hit(rt, args, kwargs, hit)
    try:
        inputs: list = []
        key = (func, tuple([freeze(a, inputs) for a in args]), freeze_kwargs(kwargs, inputs))
        fiber = rt.fiber
        if fiber is not None and fiber.grad is not None:  # computed in the fiber's grad
            key = (fiber.grad, key)  # mode: shared only within that mode
        hit = rt.hoisted.get(key)
    except (AcrobatError, TypeError):
        key, hit = None, None
    if hit is not None:
        return _hoisted_hit(rt, args, kwargs, hit)
    if rt.fresh:
        _read(rt, args, kwargs)
    out = func(*args, **kwargs)
    if key is not None:
        rt.hoisted[key] = out
        if func in PURE_FACTORIES and isinstance(out, torch.Tensor) and not out.requires_grad:
            rt.factory_keys[id(out)] = key
        rt.hoist_keepalive.append(args)  # ids in the key must stay unique during the run
        if isinstance(out, torch.Tensor):
            rt.hoisted_versions.append((out, out._version, func))
            if func in ALLOCATING:
                rt.fresh[id(out)] = (key, _stamp(rt))
    if rt.tracer is not None:
        rt.tracer.note_hoist(args, kwargs, out)
    return out


def _hoisted_hit(rt, args, kwargs, hit):
    """A value hoisted earlier in the map, given again. A trace that reads it must know it
    as much as the trace that made it: one traced without autograd, a view of a parameter
    there, was reused by later maps that train, and the parameter got no gradient."""
    if rt.tracer is not None:
        rt.tracer.note_hoist(args, kwargs, hit)
    if rt.fresh:
        rt.fresh.pop(id(hit), None)  # another instance (or use) has it now
    return hit


# ---- constants built in place ---------------------------------------------------------
# ``m = torch.zeros(n, n); m[0] = 1``, ``torch.zeros_like(mask, dtype=f).masked_fill_(mask,
# -inf)`` (nn.MultiheadAttention's bool masks): a new tensor written in place right after it
# is made, all operands real. The hoisting cache would hand the one tensor to every instance,
# so the writes of one would show in all. While the tensor is fresh (no other instance got it
# from the cache, no hoisted op read it, nothing was recorded since it was made: no lazy op
# can read it yet, and no trace was entered or left), a write makes it this instance's own
# (it leaves the cache) and the result is cached under how it was built: (how it was made,
# the write). An instance that builds the same value gets the first one back from the write
# (the in-place op's result), so the ops that read it still batch across instances. Any
# other write into a shared constant is refused at the end of the map (check_hoisted).

# ops whose results are new tensors
ALLOCATING = PURE_FACTORIES | {
    torch.empty, torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like,
}  # fmt: skip

# in-place methods and functions that are not writes of values into the tensor, or draw them
_NOT_BUILDING = frozenset(
    {"requires_grad_", "share_memory_", "detach_", "set_", "resize_", "resize_as_",
     "as_strided_", "squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_",
     "normal_", "uniform_", "bernoulli_", "random_", "exponential_", "cauchy_",
     "geometric_", "log_normal_", "retain_grad"}
)  # fmt: skip
_AUGMENTED = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
     "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}
)  # fmt: skip


def _stamp(rt) -> tuple:
    """What has been recorded so far: unchanged while no node was recorded (and the same
    block, or none, is being traced)."""
    tracer = rt.tracer
    count = sum(map(len, rt.buckets.values())) + rt.nodes + rt.deferred
    return (count, tracer, len(tracer.nodes) if tracer is not None else 0)


def _read(rt, args, kwargs) -> None:
    """A hoisted op reads ``args``: the fresh tensors among them are fresh no more (the op's
    cached result must not go stale)."""
    fresh = rt.fresh
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            fresh.pop(id(a), None)
        elif type(a) is tuple or type(a) is list:
            _read(rt, a, {})


def builds(rt, func, args) -> bool:
    """Whether ``func(*args)`` (no lazy operand) writes into a fresh tensor: see construct."""
    return bool(args) and id(args[0]) in rt.fresh


def buildable(rt, target) -> bool:
    """Whether a write into ``target`` now would build it (see construct): it is fresh
    and nothing was recorded since it was made."""
    entry = rt.fresh.get(id(target))
    return entry is not None and _stamp(rt) == entry[1]


def construct(rt, func, args, kwargs):
    """Run ``func(*args, **kwargs)``, an in-place write into the fresh tensor ``args[0]``,
    all operands real (see the section comment); returns its result."""
    target = args[0]
    made, stamp = rt.fresh.pop(id(target))
    name = getattr(func, "__name__", "")
    if name in _RANDOM_FILLS and rt.tracer is None and _stamp(rt) == stamp:
        return _draw(rt, func, args, kwargs, made)
    building = name in _AUGMENTED or (
        name.endswith("_") and not name.startswith("_") and name not in _NOT_BUILDING
    )
    if not building or _stamp(rt) != stamp:
        return func(*args, **kwargs)  # as before this: check_hoisted tells if it was shared
    rest = args[1:]
    if rt.fresh:
        _read(rt, rest, kwargs)
    try:
        inputs: list = []
        key = ("built", made, func, tuple([freeze(a, inputs) for a in rest]))
        key += freeze_kwargs(kwargs, inputs)
    except (AcrobatError, TypeError):
        return func(*args, **kwargs)
    _leave_cache(rt, target, made)
    out = func(*args, **kwargs)
    rt.built[id(target)] = target._version
    rt.hoist_keepalive.append(args)
    if out is not target and out is not None:  # (x[i] = v returns None)
        return out
    rt.fresh[id(target)] = (key, stamp)  # its instance may go on building it
    same = rt.hoisted.get(key)
    if same is None:
        rt.hoisted[key] = target
    elif out is not None:  # built the same way by another instance: that one, shared
        rt.fresh.pop(id(same), None)
        return same
    return out


# random fills of a constant right after it is made: eager draws per instance
_RANDOM_FILLS = frozenset(
    {"normal_", "uniform_", "bernoulli_", "exponential_", "cauchy_", "geometric_",
     "log_normal_", "random_"}
)  # fmt: skip
_OWN = -1  # rt.built's mark of a tensor an instance drew into: its own, any version


def _draw(rt, func, args, kwargs, made):
    """``torch.empty(n).normal_()`` (torch.distributions' ``rsample``, Gumbel noise): the
    constant leaves the cache and becomes this instance's own, filled with its own
    draws, as eager draws per instance; the result is a per-instance data node over it,
    so the ops that read it batch across instances."""
    from acrobat.ops import INPUT  # (ops imports this module)

    target = args[0]
    _leave_cache(rt, target, made)
    func(*args, **kwargs)
    rt.built[id(target)] = _OWN
    rt.hoist_keepalive.append(args)
    with torch._C.DisableTorchFunction():
        shape, dtype, device = target.shape, target.dtype, target.device
    return record_data(INPUT, (INPUT, shape, dtype, device), target, shape, dtype)


def _leave_cache(rt, target, made) -> None:
    """The constant ``target`` (made as ``made`` says) becomes the writing instance's own:
    the next instance that makes it gets a new one, and a trace keys it by identity."""
    if rt.hoisted.get(made) is target:
        del rt.hoisted[made]
    rt.factory_keys.pop(id(target), None)


def note_write(rt, func, args) -> None:
    """Remember where instance code first wrote in place into a real tensor (its line),
    for check_hoisted's error."""
    name = getattr(func, "__name__", "")
    if args and (name in _AUGMENTED or (name.endswith("_") and not name.startswith("_"))):
        target = args[0]
        if isinstance(target, torch.Tensor) and id(target) not in rt.write_lines:
            rt.write_lines[id(target)] = (target, user_line(3))


def check_hoisted(rt) -> None:
    """A hoisted result is shared by every instance: writing into it in place (``h[0] = 1``
    on a ``torch.zeros`` made inside the instance, after an op read it) would leak into the
    other instances. Writes that built a fresh tensor (construct) are not such writes."""
    built = rt.built
    for tensor, version, func in rt.hoisted_versions:
        own = built.get(id(tensor))
        if tensor._version != version and tensor._version != own and own != _OWN:
            name = getattr(func, "__name__", str(func))
            written = rt.write_lines.get(id(tensor))
            at = f" (at {written[1]})" if written is not None and written[0] is tensor else ""
            raise AcrobatError(
                f"a tensor made by {name}(...) inside instance code was modified in place{at} "
                "after it was shared or read. acrobat computes values that depend only on "
                "parameters and constants once for the whole map (all instances share them), "
                "so such a write would change every instance's value. A new tensor may be "
                "written in place right after it is made (before an op reads it); otherwise "
                "build it without in-place writes (torch.where, torch.cat, torch.tensor(list)) "
                "or pass it as a per-instance argument."
            )


def lint(buckets: dict) -> None:
    """Verify the pending graph: one signature per batch, inputs scheduled earlier (in
    (phase, depth) order) or already computed, no node queued twice."""
    seen = set()
    for (phase, depth, sig), nodes in buckets.items():
        for node in nodes:
            assert id(node) not in seen, f"node queued twice: {node}"
            seen.add(id(node))
            assert node.sig == sig and node.phase == phase and node.depth == depth, node
            assert node.outs is None, f"pending node already computed: {node}"
            for t in node.inputs:
                p = t.node
                assert p.outs is not None or (p.phase, p.depth) < (phase, depth), (
                    f"{node} reads {p} which is scheduled at the same time or later"
                )


# The C record path (config.NATIVE): the same add_node, bound in place of the Python one
# (``_py_add_node`` stays for reference and tests).
_py_add_node = add_node
if _native is not None:
    _native.setup(Node, LazyTensor, _check_inputs, config, type_key)
    _native.setup_record(freeze, freeze_kwargs, infer, wrap_outputs, copy_lists)
    _native.setup_shortcuts(record)
    has_lazy = _native.has_lazy
    add_node = _native.add_node  # type: ignore[assignment]


__all__ = [
    "RT",
    "Info",
    "Node",
    "Runtime",
    "add_node",
    "hoist",
    "infer",
    "lint",
    "record",
    "record_data",
]
