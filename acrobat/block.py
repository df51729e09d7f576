"""Static blocks (ACRoBat's grain-size coarsening, appendix A.2).

``@acrobat.block`` marks a function without tensor-dependent control flow (an LSTM/GRU
cell, a TreeLSTM composition). Inside ``f.map`` its first call per signature traces the
body once into a small program of op nodes; every call after that records ONE node, and a
batch of those nodes runs the program's ops batched. Fewer, larger nodes: less recording
and scheduling per instance, and fewer, larger kernels.

The signature of a call is the per-instance shapes/dtypes of its tensor arguments, the
identity of real tensors and other objects (a module) and the values of Python scalars. A
block must be a pure function of those: it may read parameters of the modules it is given
(the trace refers to the parameter tensors, so training updates are seen) but not mutable
global state.
"""

from __future__ import annotations

import dis
import functools
import types
import warnings
from collections import OrderedDict

import torch
from torch import nn

from acrobat import codegen, config, fusion, graph, hoisting, padding
from acrobat.errors import AcrobatError, LazyValueError, NoInstanceWork, user_line
from acrobat.graph import (
    Info,
    LazyTensor,
    Node,
    add_node,
    infer,
    mark_read,
    signature,
    type_key,
    wrap_outputs,
)
from acrobat.ops import ROW_VIEWS, Op, lookup_table, vmap_rule
from acrobat.tensor import _native

ARG = Op("arg", vmap_rule, "data", doc="a block's per-instance argument (placeholder)")


class Tracer:
    """Records a block body into a list of nodes instead of the runtime's buckets."""

    def __init__(self, rt, name: str):
        self.rt = rt
        self.name = name
        self.nodes: list[Node] = []
        self.own: set[int] = set()
        self.sources: list[tuple] = []  # (real tensor, _version) read by hoisted ops
        self.needs_grad = False

    def placeholder(self, lazy: LazyTensor) -> LazyTensor:
        node = Node(ARG, None, (), None, (), None, None, 0, 0, -1, self.rt)
        self.own.add(id(node))
        return LazyTensor(node, 0, lazy.shape, lazy.dtype)

    def record(self, op, func, args, kwargs):
        inputs: list[LazyTensor] = []
        sig = signature(func, args, kwargs, inputs)
        for t in inputs:
            mark_read(t)
            if id(t.node) not in self.own:
                raise AcrobatError(
                    f"block {self.name} uses a lazy tensor it did not receive as an argument "
                    f"(at {user_line(3)}); pass every per-instance tensor to the block explicitly"
                )
        info = self.rt.sig_info.get(sig)
        if info is None:
            info = self.rt.sig_info[sig] = infer(op, func, args, kwargs, self.rt)
        node = Node(op, func, args, kwargs, inputs, info, sig, 0, 0, -1, self.rt)
        self.nodes.append(node)
        self.own.add(id(node))
        return wrap_outputs(node, info)

    def note_hoist(self, args, kwargs, out) -> None:
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                self.sources.append((a, a._version))
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            # (an autograd graph of this run; a view of a parameter made under no_grad
            # requires grad but has none: nothing to go stale)
            self.needs_grad = True


class Trace:
    """One traced signature of a block: its program and how outputs are packaged. The
    fields a block call reads in C are slots (read at their offsets there)."""

    __slots__ = ("call_fast", "run_id", "op", "info", "sig", "__dict__", "__weakref__")

    def __init__(self, op, placeholders, nodes, out_spec, info, sources, needs_grad, keep):
        self.op = op
        self.placeholders = placeholders
        self.nodes = nodes
        self.out_spec = out_spec
        self.info = info
        self.sources = sources
        self.needs_grad = needs_grad
        self.keep = keep  # objects whose ids are in the cache key
        self.run_id = 0
        self.autocast = None  # the map's autocast when traced (graph.Runtime.autocast)
        self.out_lazies: list[LazyTensor] = []  # the program's computed outputs
        self.out_sources: list[tuple] = []  # per output leaf: ("out"|"arg"|"real", which)
        self.out_alias: tuple = ()  # (j, i): output j is output i's tensor (returned twice)
        self.call_fast = None  # (op, sig, info, kind, may_split) for the C call path, made
        # there on first use and dropped when plain_tuple or may_split change
        self._plain_tuple = False
        self.fusion: fusion.Plan | None = None
        self.compiled = None  # run_ops as generated code, made on the first batch
        self.compiled_fused: dict = {}  # backend -> run_fused's code, made on first use
        self.sig: tuple = ()
        # hoisting out of the block (hoisting.split_call): positions it cuts at / observes
        self._may_split: tuple = ()
        self.split_on: tuple = ()
        self.observe: tuple = ()
        self.splits: dict = {}  # position -> Split
        self.split_counts: dict = {}  # position -> (calls, calls that reused the argument)
        self.decided: dict = {}  # position -> whether it cuts there (decided for good)
        self.owner = None  # the Block whose cache holds it (its padding family's traces)
        self.seen_run = 0  # the map run whose calls it counts (rt.split_seen: arguments)
        # per argument: its per-instance shape and dtype; the padding family's view
        # (acrobat/padding.py)
        self.arg_shapes: tuple = ()
        self.arg_dtypes: tuple = ()
        self.pad_view = None
        self.scan = None  # scan.Scan running this program as a loop body; False: cannot
        self.deps: tuple | None = None  # what its constants came from (_dependencies)
        self.grad_built = torch.is_grad_enabled()  # autograd on while it was traced

    @property
    def plain_tuple(self) -> bool:
        """Outputs are exactly a tuple of out_lazies."""
        return self._plain_tuple

    @plain_tuple.setter
    def plain_tuple(self, value: bool) -> None:
        self._plain_tuple = value
        self.call_fast = None

    @property
    def may_split(self) -> tuple:
        """split_on + observe: the call path checks this only (hoisting.split_call)."""
        return self._may_split

    @may_split.setter
    def may_split(self, value: tuple) -> None:
        self._may_split = value
        self.call_fast = None

    def valid_for(self, rt) -> bool:
        if self.run_id == rt.id:
            return True
        if self.needs_grad:
            return False  # hoisted values carry last run's autograd graph: retrace
        if self.sources and not self.grad_built and torch.is_grad_enabled():
            return False  # hoisted values computed without autograd: retrace to train
        for t, version in self.sources:
            if t._version != version:
                return False
        if self.deps is not None and not _deps_hold(self.deps, rt.id):
            return False  # a module's layer or parameter replaced, a global rebound
        if self.autocast != rt.autocast:
            return False  # traced under another autocast: other dtypes
        self.run_id = rt.id
        return True

    def run(self, node, xs, n):
        """The block op's batching rule: run the program with batched operands (the
        fused elementwise region as one kernel, when the online choice says so)."""
        plan = self.fusion
        device = None
        x = next((x for x in xs if x is not None), None)  # (None: a joined buffer's part)
        if x is not None:
            device = x.buf.device if type(x) is fusion.Source else x.device
        if plan is not None and fusion.use_fused(self, device):
            if device is None or device.type == "cpu":  # (operands gathered as usual)
                fused = lambda: self.run_fused(xs, n)
                unfused = lambda: self.run_ops(xs, n)
            else:  # (the device's kernel reads the operands the executor left in place)
                fused = lambda: fusion.run(self, plan, {}, xs, n)
                unfused = lambda: self.run_ops(_materialized(xs, n), n)
            return fusion.choose(self, n, fused, unfused, device)
        return self.run_ops(_materialized(xs, n), n)

    def run_ops(self, xs, n):
        """The program op by op, as generated straight-line code (acrobat/codegen.py)."""
        run = self.compiled
        if run is None:
            run = self.compiled = self._generate()
            cpu = next((x.device.type == "cpu" for x in xs if type(x) is torch.Tensor), True)
            if self.fusion is None or cpu:  # (the GPU's fused kernel reads tensors)
                self.op.row_args = getattr(run, "row_args", frozenset())
                self.op.joins = getattr(run, "joins", ())
        return run(xs, n)

    def step_runner(self, device):
        """What a loop calls for each of its steps (acrobat/scan.py): :meth:`run_fused`
        where this program's region runs fused on the CPU, else :meth:`run_ops`. (With
        ``KERNEL_BACKEND="online"`` steps run op by op: a choice per step would cost more
        than the kernel saves.)"""
        cpu = device is None or device.type == "cpu"
        fused = self.fusion is not None and cpu and config.KERNEL_BACKEND != "online"
        if fused and fusion.use_fused(self, device):
            return self.run_fused
        return self.run_ops

    def run_fused(self, xs, n):
        """The program with its elementwise region as one numba kernel call (CPU; with
        ``KERNEL_BACKEND="torch"`` the kernels' torch reference), as generated code like
        :meth:`run_ops`'s, which it falls back to where the kernel declines its operands."""
        backend = "torch" if config.KERNEL_BACKEND == "torch" else "numba"
        run = self.compiled_fused.get(backend)
        if run is None:
            from acrobat_kernels import elementwise

            plan = self.fusion

            def make_call(layout):
                return elementwise.cpu_caller(
                    plan.program, plan.shape, plan.shared, layout, backend
                )

            run = self.compiled_fused[backend] = self._generate((plan, make_call, self.run_ops))
        return run(xs, n)

    def _generate(self, fused=None):
        try:
            return codegen.compile_program(
                self.placeholders, self.nodes, self.out_lazies, self.op.name, fused
            )
        except Exception as exc:  # an optimisation must not break a map: interpret
            if config.VERIFY:
                raise
            warnings.warn(
                f"acrobat: could not generate code for {self.op.name} ({exc!r}); "
                "running its program op by op. Please report this.",
                RuntimeWarning,
                stacklevel=3,
            )
            return self.interpret

    def interpret(self, xs, n):
        """The program op by op, each op's batched rule in turn (codegen's reference)."""
        env = {}
        for ph, x in zip(self.placeholders, xs):
            env[ph] = (x,)
        for inner in self.nodes:
            ins = [env[t.node][t.idx] for t in inner.inputs]
            env[inner] = inner.op.rule(inner, ins, n)
        return tuple(env[t.node][t.idx] for t in self.out_lazies)


class Lookup:
    """A program that takes one per-instance index and only looks rows up by it
    (embedding rows of real tables of one height, and row-wise views of those): a batch
    of its calls needs no copy (executor._lookup_in_place). ``outputs()`` are the
    program's outputs over every row of the tables."""

    def __init__(self, size: int, placeholder, nodes: list, out_lazies: list):
        self.size = size
        self.placeholder = placeholder
        self.nodes = nodes
        self.out_lazies = out_lazies

    def outputs(self) -> tuple:
        env: dict = {}
        for inner in self.nodes:
            src = inner.inputs[0]
            if src.node is self.placeholder:
                env[inner] = (lookup_table(inner),)
            else:
                env[inner] = inner.op.rule(inner, [env[src.node][src.idx]], self.size)
        return tuple(env[t.node][t.idx] for t in self.out_lazies)


def _lookup(trace: Trace) -> Lookup | None:
    """The trace's Lookup, if its program is one."""
    if len(trace.placeholders) != 1 or not trace.nodes:
        return None
    ph = trace.placeholders[0]
    size = 0
    seen: set = set()
    with torch._C.DisableTorchFunction():  # tensor attributes dispatch to the mode
        for inner in trace.nodes:
            if len(inner.inputs) != 1:
                return None
            src = inner.inputs[0].node
            if src is ph:
                table = lookup_table(inner)
                if table is None or table.ndim < 1 or inner.info.metas[0][0] != table.shape[1:]:
                    return None  # not one row per index (an index of several ids)
                if size and table.shape[0] != size:
                    return None
                size = table.shape[0]
            elif id(src) not in seen or inner.op.name not in ROW_VIEWS:
                return None
            seen.add(id(inner))
    return Lookup(size, ph, trace.nodes, trace.out_lazies)


def _materialized(xs, n):
    return [x.materialize(n) if type(x) is fusion.Source else x for x in xs]


def is_namedtuple(a) -> bool:
    return isinstance(a, tuple) and hasattr(type(a), "_fields")


def _key(a, keep: list, inputs: list):
    """Cache key of a block argument. Unlike graph.freeze, objects are keyed by identity
    and kept alive by the cache entry, so an id is never recycled under a live entry."""
    t = type(a)
    if t is LazyTensor:
        inputs.append(a)
        return a.key
    if t is int or t is str or a is None:
        return a
    if t is float or t is bool:
        return (t, a)
    if t is tuple or t is list:
        return (t, tuple(_key(x, keep, inputs) for x in a))
    if t is dict:
        return (t, tuple((k, _key(v, keep, inputs)) for k, v in a.items()))
    if is_namedtuple(a) and _holds_lazy(a):  # (an LSTM's State(h, c))
        return (t, tuple(_key(x, keep, inputs) for x in a))
    keep.append(a)  # (a namedtuple of functions or modules, as the C call path keys it)
    return ("id", id(a))


def _by_structure(a) -> bool:
    """Whether a block argument is keyed by its structure (:func:`_key`'s containers), not
    by its identity: a tuple, list or dict, or a namedtuple holding a lazy tensor."""
    t = type(a)
    return t is tuple or t is list or t is dict or (is_namedtuple(a) and _holds_lazy(a))


def _holds_lazy(a) -> bool:
    """Whether a container holds a LazyTensor (then its structure keys a trace; others,
    namedtuples of cells included, are keyed by identity, as the C call path keys them:
    keyed by structure, StackRNN's Cells missed the C path on every call, +15 ms a map)."""
    t = type(a)
    if t is LazyTensor:
        return True
    if isinstance(a, (tuple, list)):
        return any(_holds_lazy(x) for x in a)
    if t is dict:
        return any(_holds_lazy(x) for x in a.values())
    return False


# ---- what a trace's constants came from --------------------------------------------
# A trace folds in the tensors the function reached when it was traced: ``m.head.weight``
# of a module argument, a global ``W``. The cache key names a module by identity, so
# replacing one of its layers or parameters (``m.head = nn.Linear(...)``, loading a new
# model into a global name) left the trace computing with the old tensors, silently.
# Each trace records the identities it depended on, checked when a map first uses it
# (valid_for; in-place updates are seen anyway, the tensors are the same objects).
# Rebinding during a map is not seen.

_DEPTH = 3  # functions followed from the traced one through the globals they name


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


_PLAIN_ATTRS = (int, float, bool, str, type(None))


def _module_state(m: nn.Module) -> tuple:
    """Per submodule (``m`` and every module under it, in order): its identity, its
    ``training`` flag (a trace made in eval mode has no dropout), the identities of its
    own parameters and buffers, the handles of its hooks (a trace runs the hooks it met
    when traced) and its plain attributes (``self.temperature = 2.0``: a trace folds the
    number in). Read from each module's own dicts in one pass; with the C extension, one
    flat tuple made in C (``_native.module_state``: a 65-module transformer encoder 196
    -> 40 µs, read once per map by the traces that depend on it)."""
    if _native is not None:
        return _native.module_state(m, _HOOKS, _PLAIN_ATTRS)
    state = []
    seen = set()
    todo = [m]
    while todo:  # (m.modules()'s order, depth first, without its generators and prefixes:
        mod = todo.pop()  # 3x faster over a transformer layer's tree)
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        d = mod.__dict__
        params, buffers = d.get("_parameters", {}), d.get("_buffers", {})
        state.append((
            id(mod),
            mod.training,
            tuple([id(p) for p in params.values()]),
            tuple([id(b) for b in buffers.values()]),
            tuple([tuple(d.get(name, ())) for name in _HOOKS]),
            tuple([(k, v) for k, v in d.items() if k[:1] != "_" and type(v) in _PLAIN_ATTRS]),
        ))  # fmt: skip
        children = d.get("_modules")
        if children:
            todo.extend([c for c in reversed(children.values()) if c is not None])
    return tuple(state)


def _dependencies(fn, keep: list) -> tuple | None:
    """``(modules, globals)``: each module among the key's objects, the globals ``fn``
    (and the functions it names, a few levels deep) reads, the modules among them, with
    what they were; None if nothing to check."""
    modules = {id(m): m for m in keep if isinstance(m, nn.Module)}
    names: list[tuple] = []
    seen: set = set()
    todo = [(fn, 0)]
    while todo:
        f, depth = todo.pop()
        f = STANDS_FOR.get(getattr(f, "__code__", None), f)  # (in a map: a trampoline's)
        code = getattr(f, "__code__", None)
        scope = getattr(f, "__globals__", None)
        if code is None or scope is None or code in seen:
            continue
        seen.add(code)
        for name in _code_names(code):
            if name not in scope:
                continue
            value = scope[name]
            names.append((scope, name, value))
            if isinstance(value, nn.Module):
                modules.setdefault(id(value), value)
            elif isinstance(value, types.FunctionType) and depth < _DEPTH:
                todo.append((value, depth + 1))
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, nn.Module):
                modules.setdefault(id(value), value)
    states = tuple((m, _intern_state(m, _module_state(m))) for m in modules.values())
    if not states and not names:
        return None
    return states, _intern_names(tuple(names))


_STATES: dict = {}  # id(module) -> the last state a trace took of it (ids and plain values)


def _intern_state(m: nn.Module, state: tuple) -> tuple:
    """The state object an earlier trace took of ``m`` where it equals ``state``: the
    traces of one block (one per shape) then share one object, which a map compares with
    the module's state once (:func:`_deps_hold`: 78 traces of a 500-entry state, 3.1 ->
    ~0.5 µs a check)."""
    last = _STATES.get(id(m))  # (equal states are interchangeable: keyed by id only,
    if last is not None and last == state:  # no module is kept alive here)
        return last
    if len(_STATES) > 4096:
        _STATES.clear()
    _STATES[id(m)] = state
    return state


_NAMES: dict = {}  # (id(scope), name, id(value)) per entry -> the one tuple of those names


def _intern_names(names: tuple) -> tuple:
    """One tuple object for equal global-name dependencies (the traces of one function
    for many shapes), so a map checks each such tuple once (:func:`_deps_hold`)."""
    key = tuple([(id(scope), name, id(value)) for scope, name, value in names])
    found = _NAMES.get(key)
    if found is None:
        if len(_NAMES) > 4096:
            _NAMES.clear()
        found = _NAMES[key] = names
    return found


_GLOBAL_NAMES: dict = {}  # code object -> the global names it loads
# trampoline code (analysis.auto_blocks swaps it in while a map runs) -> a function with
# the code it stands for, whose globals a trace calling it depends on
STANDS_FOR: dict = {}


def _code_names(code) -> frozenset:
    """The global names a code object (and the code nested in it) loads (LOAD_GLOBAL:
    not attribute names, which co_names also holds)."""
    names = _GLOBAL_NAMES.get(code)
    if names is None:
        found = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found |= _code_names(const)
        names = _GLOBAL_NAMES[code] = frozenset(found)
    return names


def _deps_hold(deps: tuple, run_id: int) -> bool:
    """Whether the globals and modules a trace depended on are as they were; a module's
    state is read once per map (run ``run_id``) for all the traces that depend on it."""
    states, names = deps
    if _states_read[0] != run_id:
        _states_read[:] = [run_id, {}]
    memo = _states_read[1]
    if names:
        held = memo.get(id(names))  # (interned: one check per map for equal names)
        if held is None:
            held = memo[id(names)] = all(
                scope.get(name, _MISSING) is value for scope, name, value in names
            )
        if not held:
            return False
    for m, state in states:
        seen = memo.get(id(state))  # (compared once per map per state object: the
        if seen is None:  # traces of one block share few; kept, so its id stays its own)
            now = memo.get(id(m))
            if now is None:
                now = memo[id(m)] = _module_state(m)
            seen = memo[id(state)] = (state, now == state)
        if not seen[1]:
            return False
    return True


# [run id, {id(module): its _module_state in that run, id(names): whether they hold,
# id(a trace's module state): (that state, whether it is the module's now)}]
_states_read: list = [None, {}]


_MISSING = object()


def _kept(args, kwargs) -> list:
    """The objects a trace's cache key names by identity: kept alive with the trace, so
    an id is never recycled under a live entry."""
    keep: list = []
    _key(args, keep, [])
    if kwargs:
        _key(kwargs, keep, [])
    return keep


def _flatten_out(value, leaves: list, seen: set | None = None):
    """Output pytree -> spec with leaf positions; leaves collected in ``leaves``. A call
    returns lists and dicts built anew from the spec, so one the outputs hold twice, or
    one the arguments hold (``seen``: their ids), would no longer be one object: another
    name for it would not see it change (``out = xs`` in a run, then ``out.append(h)``
    read as ``xs[t]``). Such a block cannot be traced: an automatic one runs as written."""
    if seen is None:
        seen = set()
    t = type(value)
    if t is LazyTensor or isinstance(value, torch.Tensor):
        leaves.append(value)
        return ("leaf", len(leaves) - 1)
    if t is list or t is dict:
        if id(value) in seen:
            raise LazyValueError(  # (an automatic block then runs its code as written)
                f"a block returned a {t.__name__} it was given, or the same one twice; "
                "return a new one"
            )
        seen.add(id(value))
    if t is tuple or t is list:
        return (t, [_flatten_out(v, leaves, seen) for v in value])
    if t is dict:
        return (t, {k: _flatten_out(v, leaves, seen) for k, v in value.items()})
    if value is None or t in (int, float, bool, str):
        return ("const", value)
    if isinstance(value, tuple) and hasattr(t, "n_fields"):  # torch.return_types (max, sort)
        return (t, [_flatten_out(v, leaves, seen) for v in value])
    if is_namedtuple(value):  # built by field
        return (("fields", t), [_flatten_out(v, leaves, seen) for v in value])
    raise LazyValueError(  # (an automatic block then runs its code as written)
        f"a block returned a {t.__name__}; return tensors or (named) tuples, lists or "
        "dicts of them"
    )


def _containers(value, ids: set) -> set:
    """``ids`` with the ids of the lists and dicts inside ``value`` (a block's arguments)."""
    t = type(value)
    if t is list or t is dict:
        ids.add(id(value))
    if t is list or t is tuple:
        for v in value:
            _containers(v, ids)
    elif t is dict:
        for v in value.values():
            _containers(v, ids)
    return ids


def _unflatten(spec, leaves):
    kind = spec[0]
    if kind == "leaf":
        return leaves[spec[1]]
    if kind == "const":
        return spec[1]
    if kind is dict:
        return {k: _unflatten(v, leaves) for k, v in spec[1].items()}
    if type(kind) is tuple:  # ("fields", namedtuple class)
        return kind[1](*[_unflatten(v, leaves) for v in spec[1]])
    return kind([_unflatten(v, leaves) for v in spec[1]])


def _finish_call(trace: Trace, node: Node, inputs: list):
    """What a block call returns: its node's outputs packaged as the body returned them."""
    info = trace.info
    if info.single:  # wrap_outputs, inlined for the common one-output block
        shape, dtype = info.metas[0]
        out = LazyTensor(node, 0, shape, dtype, info.keys[0])
        if trace.out_spec[0] == "leaf":
            return out
        outs: tuple = (out,)
        if trace.plain_tuple:
            return outs
    else:
        outs = wrap_outputs(node, info)
        if trace.out_alias:  # one tensor returned in two places: one handle, so that an
            listed = list(outs)  # in-place update through one shows in the other, as eager
            for j, i in trace.out_alias:
                listed[j] = listed[i]
            outs = tuple(listed)
        if trace.plain_tuple:
            return outs
    leaves = []
    for src in trace.out_sources:
        kind, v = src
        leaves.append(outs[v] if kind == "out" else inputs[v] if kind == "arg" else v)
    return _unflatten(trace.out_spec, leaves)


_MISS = object()  # the C block call's "this call takes the Python path"
_KWARGS = object()  # separates a call key's keyword part: never an argument's key


# The call's fast path in C where the extension is built: a C tp_call makes __call__'s
# checks and the trace cache's hit without a Python frame, and calls _call otherwise.
_CallBase: type = _native.BlockBase if _native is not None else object


class Block(_CallBase):  # type: ignore[valid-type, misc]
    """A function traced once per signature and recorded as one node per call."""

    def __init__(self, fn):
        self.fn = fn
        self.cache: OrderedDict = OrderedDict()
        self.run_traces = 0  # traces made during the map run self.traces_run
        self.traces_run = 0
        # two traces were one program up to two sizes that vary apart (padding.SizesApart)
        self.sizes_apart = False
        self.cuts: dict = {}  # (position, part) -> hoisting._Cuts of its traces' cuts
        # keys whose trace computed nothing per-instance (NoInstanceWork), not traced again
        # -> the objects the key names by identity
        self.idle_keys: dict = {}
        functools.update_wrapper(self, fn)

    def _call(self, *args, **kwargs):
        """The call (``__call__`` without the C extension; with it, what its fast path
        leaves: no map, a new or stale trace, keyword arguments)."""
        rt = graph.RT
        if not graph.calls_record(rt):  # eager, inlined into an enclosing block, or inside
            return self.fn(*args, **kwargs)  # a grad-mode region of the instance's own
        trace, inputs = self.trace_for(rt, args, kwargs)
        if trace is None:
            return self.fn(*args, **kwargs)  # nothing per-instance: hoisted op by op
        node = None
        if trace.may_split:
            node = hoisting.split_call(rt, trace, inputs)
        if node is None:
            node = add_node(rt, trace.op, None, None, None, inputs, trace.info, trace.sig)
        return _finish_call(trace, node, inputs)

    def trace_for(self, rt, args: tuple, kwargs: dict | None = None):
        """(the trace for this call's signature, traced now if missing or stale; the
        call's LazyTensor operands), or (None, []) when no argument is per-instance."""
        if _native is not None and not kwargs:  # a cache hit of this map: found in C
            hit = _native.trace_hit(self, args, rt)
            if hit is not None:
                return hit
        inputs: list[LazyTensor] = []
        parts = []
        made = rt.factory_keys
        for a in args:  # flat loop first: block arguments are mostly tensors and modules
            t = type(a)
            if t is LazyTensor:
                inputs.append(a)
                parts.append(a.key)
            elif _by_structure(a):
                parts.append(_key(a, [], inputs))
            elif t is int or t is str or a is None:
                parts.append(a)
            elif t is float or t is bool:
                parts.append((t, a))
            else:  # a module or other object: by identity (kept alive by the trace)
                # a constant made by a pure factory (torch.zeros(h)) is a new object
                # every map: keyed by how it was made, the trace outlives the map
                parts.append(made.get(id(a)) or ("id", id(a)))
        key = (tuple(parts), _KWARGS, _key(kwargs, [], inputs)) if kwargs else tuple(parts)
        if not inputs:
            return None, inputs
        trace = self.cache.get(key)
        if trace is None or (trace.run_id != rt.id and not trace.valid_for(rt)):
            if key in self.idle_keys:
                name = _display_name(self.fn)
                raise NoInstanceWork(f"block {name} computes no per-instance tensor")
            try:
                trace = self._trace(rt, args, kwargs or {}, inputs, _kept(args, kwargs))
            except NoInstanceWork:
                if len(self.idle_keys) < config.BLOCK_CACHE_SIZE:
                    # (the objects the key names by id kept alive, as a trace keeps them:
                    # an id is never recycled under an entry)
                    self.idle_keys[key] = _kept(args, kwargs)
                raise
            if not kwargs:
                _note_lift(self, trace, args, parts, made)
            if self.traces_run != rt.id:
                self.traces_run, self.run_traces = rt.id, 0
            if "padded" not in trace.op.extra:  # (sizes of one padding family are no
                self.run_traces += 1  # sign of a scalar keying a trace per call)
            old = self.cache.get(key)
            self.cache[key] = trace
            if trace.observe:  # what its predecessor or its family decided about cuts
                hoisting.adopt(trace, old, rt)
            if old is not None:
                _retire(old, rt)
            if len(self.cache) > config.BLOCK_CACHE_SIZE:
                _retire(self.cache.popitem(last=False)[1], rt)
        return trace, inputs

    def _trace(self, rt, args, kwargs, inputs, keep) -> Trace:
        tracer = Tracer(rt, getattr(self.fn, "__qualname__", "block"))
        # One placeholder per argument position, even where a call passes one tensor
        # twice (``cell(x, x)``): the trace is cached by shapes and reused by calls that
        # pass two different tensors there.
        placeholders = [tracer.placeholder(t) for t in inputs]
        in_order = iter(placeholders)  # _sub walks the arguments in the order _key did
        given_args, given_kwargs = _sub(args, in_order), _sub(kwargs, in_order)
        given = _containers((given_args, given_kwargs), set())
        rt.tracer = tracer
        try:
            out = self.fn(*given_args, **given_kwargs)
        finally:
            rt.tracer = None
        leaves: list = []
        spec = _flatten_out(out, leaves, given)
        ph_nodes = [ph.node for ph in placeholders]
        ph_index = {id(n): i for i, n in enumerate(ph_nodes)}
        out_lazies: list[LazyTensor] = []
        out_sources: list[tuple] = []
        metas: list[tuple] = []
        for leaf in leaves:
            if type(leaf) is LazyTensor and id(leaf.node) in ph_index:
                out_sources.append(("arg", ph_index[id(leaf.node)]))
            elif type(leaf) is LazyTensor:
                out_sources.append(("out", len(out_lazies)))
                out_lazies.append(leaf)
                metas.append((leaf.shape, leaf.dtype))
            else:
                out_sources.append(("real", leaf))
                if isinstance(leaf, torch.Tensor):
                    graph.note_trace_factory(rt, leaf)
        if not out_lazies:
            raise NoInstanceWork(
                f"block {tracer.name} computes no per-instance tensor; call it without @block"
            )
        info = Info(tuple(metas), len(metas) == 1, None)
        name = f"block:{_display_name(self.fn)}"
        trace = Trace(
            None, ph_nodes, tracer.nodes, spec, info, tracer.sources, tracer.needs_grad, keep
        )
        trace.out_lazies = out_lazies
        trace.out_sources = out_sources
        first: dict = {}
        trace.out_alias = tuple(
            (j, first.setdefault((id(t.node), t.idx), j))
            for j, t in enumerate(out_lazies)
            if first.setdefault((id(t.node), t.idx), j) != j
        )
        # outputs are exactly a tuple of the block's computed tensors, in order
        trace.plain_tuple = (
            not trace.out_alias
            and spec[0] is tuple
            and len(out_lazies) >= 1  # a region's (x,): one output is a tuple too
            and all(s == ("out", k) for k, s in enumerate(out_sources))
            and all(sub == ("leaf", k) for k, sub in enumerate(spec[1]))
        )
        finish_trace(trace, name, tracer, f"{len(tracer.nodes)} ops traced from {tracer.name}")
        trace.observe = trace.may_split = hoisting.may_split(trace)
        trace.owner = self
        code = getattr(self.fn, "__code__", None)
        if code is not None and "(" not in name:  # (an outlined run's name says where)
            where = f"{code.co_filename.rsplit('/', 1)[-1]}, line {code.co_firstlineno}"
            trace.op.extra["where"] = f"{self.fn.__qualname__} ({where})"
        lookup = _lookup(trace)
        if lookup is not None:
            trace.op.extra["lookup"] = lookup
        trace.deps = _dependencies(self.fn, keep)
        trace.autocast = rt.autocast  # (its dtypes are autocast's)
        trace.run_id = rt.id
        trace.arg_shapes = tuple(t.shape for t in inputs)  # (acrobat/padding.py)
        trace.arg_dtypes = tuple(t.dtype for t in inputs)
        if config.PAD_RAGGED:
            padding.join(self, trace)
        return trace


def _retire(trace: Trace, rt) -> None:
    """:func:`hoisting.retire` a trace the cache drops, unless this map's nodes may still
    run it."""
    if trace.run_id != rt.id:
        hoisting.retire(trace)


def _sub(a, placeholders):
    """``a`` with each LazyTensor replaced by the next of ``placeholders`` (an iterator),
    through tuples, lists and dicts (a module-level function: a recursive closure is a
    reference cycle)."""
    ta = type(a)
    if ta is LazyTensor:
        return next(placeholders)
    if ta is tuple or ta is list:
        return ta(_sub(x, placeholders) for x in a)
    if ta is dict:
        return {k: _sub(v, placeholders) for k, v in a.items()}
    if is_namedtuple(a):  # rebuilt by field
        return ta(*[_sub(x, placeholders) for x in a])
    return a


def _note_lift(block: Block, trace: Trace, args: tuple, parts: list, made: dict) -> None:
    """If the call passes constants made by a pure factory (``torch.zeros(h)``) as
    top-level arguments, note on its op how the same call reads with those constants as
    per-instance operands: the cache key of that trace and where each constant goes among
    its inputs. The scheduler merges a batch of this trace into one of that trace at the
    same level, if there is one (:func:`acrobat.scheduler.family`)."""
    inserts: list[tuple] = []
    lazy_key = list(parts)
    n_inputs = 0
    for i, a in enumerate(args):
        t = type(a)
        if t is LazyTensor:
            n_inputs += 1
        elif _by_structure(a):
            return  # a container's lazies: positions would need its walk
        elif id(a) in made:
            with torch._C.DisableTorchFunction():  # (attribute reads dispatch to the mode)
                lazy_key[i] = type_key(a.shape, a.dtype)
            inserts.append((n_inputs + len(inserts), made[id(a)]))
    if inserts:
        trace.op.extra["lift"] = (block, tuple(lazy_key), tuple(inserts))


def finish_trace(trace: Trace, name: str, tracer: Tracer, doc: str) -> None:
    """Give a trace its op row and fusion plan; detach its nodes from the run."""
    trace.op = Op(name, trace.run, "block", launches=len(tracer.nodes), doc=doc)
    # no random draw: calls with the same operand rows have the same results
    # (executor._distinct runs such a batch once per distinct row of operands)
    trace.op.extra["pure"] = not any(nd.op.name in graph.IMPURE_OPS for nd in tracer.nodes)
    trace.sig = (trace.op,)  # the batching signature of its calls
    trace.call_fast = None
    trace.fusion = fusion.plan(trace)
    if trace.fusion is not None:
        trace.op.source_args = trace.fusion.source_args
    for nd in tracer.nodes + trace.placeholders:
        nd.rt = None  # the trace outlives this run; don't keep the run alive


def block(fn):
    """Mark ``fn`` as a static block: traced once per signature, recorded as one node.

    >>> @acrobat.block
    ... def cell(model, x, h):
    ...     return torch.tanh(model.wx(x) + model.wh(h))

    Outside ``f.map`` (and in ``f.eager``) the function runs as written.
    """
    if isinstance(fn, Block):
        return fn
    return Block(fn)


if _native is not None:
    _native.setup_block(_key, _finish_call, hoisting.split_call, _MISS)
    # (the modules the call slots read, acrobat.graph's RT included, are handed over by
    # acrobat.analysis: _native.setup_calls)
else:
    Block.__call__ = Block._call  # type: ignore[method-assign]


def _display_name(fn) -> str:
    """A block's name in stats and messages: the function's name, with its class for a
    method (``Cell.forward``: every module's ``forward`` is a block of its own)."""
    name = getattr(fn, "__name__", "fn")
    qualname = getattr(fn, "__qualname__", name)
    owner, _, last = qualname.rpartition(".")
    if owner and "<" not in owner and last == name:
        return f"{owner.rpartition('.')[2]}.{name}"
    return name
