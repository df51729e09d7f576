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

import functools
from collections import OrderedDict

import torch

from acrobat import codegen, config, fusion, graph
from acrobat.errors import AcrobatError, LazyValueError, user_line
from acrobat.graph import (
    Info,
    LazyTensor,
    Node,
    add_node,
    infer,
    signature,
    wrap_outputs,
)
from acrobat.ops import Op, vmap_rule

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
        if isinstance(out, torch.Tensor) and out.requires_grad:
            self.needs_grad = True


class Trace:
    """One traced signature of a block: its program and how outputs are packaged."""

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
        self.out_lazies: list[LazyTensor] = []  # the program's computed outputs
        self.out_sources: list[tuple] = []  # per output leaf: ("out"|"arg"|"real", which)
        self.plain_tuple = False  # outputs are exactly a tuple of out_lazies
        self.fusion: fusion.Plan | None = None
        self.compiled = None  # run_ops as generated code, made on the first batch
        self.sig: tuple = ()
        # hoisting out of the block (_split_call): positions it cuts at / still observes
        self.may_split: tuple = ()  # split_on + observe: the call path checks this only
        self.split_on: tuple = ()
        self.observe: tuple = ()
        self.splits: dict = {}  # position -> Split
        self.split_counts: dict = {}  # position -> (calls, calls that reused the argument)
        self.seen: set = set()  # (position, id(argument)) seen in map run seen_run
        self.seen_run = 0

    def valid_for(self, rt) -> bool:
        if self.run_id == rt.id:
            return True
        if self.needs_grad:
            return False  # hoisted values carry last run's autograd graph: retrace
        for t, version in self.sources:
            if t._version != version:
                return False
        self.run_id = rt.id
        return True

    def run(self, node, xs, n):
        """The block op's batching rule: run the program with batched operands (the
        fused elementwise region as one kernel, when the online choice says so)."""
        plan = self.fusion
        device = None
        if xs:
            device = xs[0].buf.device if type(xs[0]) is fusion.Source else xs[0].device
        if plan is not None and fusion.use_fused(self, device):
            return fusion.choose(
                self, n,
                lambda: fusion.run(self, plan, {}, xs, n),
                lambda: self.run_ops(_materialized(xs, n), n),
                device,
            )  # fmt: skip
        return self.run_ops(_materialized(xs, n), n)

    def run_ops(self, xs, n):
        """The program op by op, as generated straight-line code (acrobat/codegen.py)."""
        run = self.compiled
        if run is None:
            run = self.compiled = codegen.compile_program(
                self.placeholders, self.nodes, self.out_lazies, self.op.name
            )
        return run(xs, n)

    def interpret(self, xs, n):
        """The program op by op, each op's batched rule in turn (codegen's reference)."""
        env = {}
        for ph, x in zip(self.placeholders, xs):
            env[ph] = (x,)
        for inner in self.nodes:
            ins = [env[t.node][t.idx] for t in inner.inputs]
            env[inner] = inner.op.rule(inner, ins, n)
        return tuple(env[t.node][t.idx] for t in self.out_lazies)


def _materialized(xs, n):
    return [x.materialize(n) if type(x) is fusion.Source else x for x in xs]


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
    keep.append(a)
    return ("id", id(a))


def _kept(args, kwargs) -> list:
    """The objects a trace's cache key names by identity: kept alive with the trace, so
    an id is never recycled under a live entry."""
    keep: list = []
    _key(args, keep, [])
    if kwargs:
        _key(kwargs, keep, [])
    return keep


def _flatten_out(value, leaves: list):
    """Output pytree -> spec with leaf positions; leaves collected in ``leaves``."""
    t = type(value)
    if t is LazyTensor or isinstance(value, torch.Tensor):
        leaves.append(value)
        return ("leaf", len(leaves) - 1)
    if t is tuple or t is list:
        return (t, [_flatten_out(v, leaves) for v in value])
    if t is dict:
        return (t, {k: _flatten_out(v, leaves) for k, v in value.items()})
    if value is None or t in (int, float, bool, str):
        return ("const", value)
    raise AcrobatError(f"a block returned a {t.__name__}; return tensors or tuples of tensors")


def _unflatten(spec, leaves):
    kind = spec[0]
    if kind == "leaf":
        return leaves[spec[1]]
    if kind == "const":
        return spec[1]
    if kind is dict:
        return {k: _unflatten(v, leaves) for k, v in spec[1].items()}
    return kind(_unflatten(v, leaves) for v in spec[1])


class Block:
    """A function traced once per signature and recorded as one node per call."""

    def __init__(self, fn):
        self.fn = fn
        self.cache: OrderedDict = OrderedDict()
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        rt = graph.RT
        if rt is None or rt.tracer is not None or rt.fiber is None:
            return self.fn(*args, **kwargs)  # eager, or inlined into an enclosing block
        inputs: list[LazyTensor] = []
        parts = []
        made = rt.factory_keys
        for a in args:  # flat loop first: block arguments are mostly tensors and modules
            t = type(a)
            if t is LazyTensor:
                inputs.append(a)
                parts.append(a.key)
            elif t is tuple or t is list or t is dict:
                parts.append(_key(a, [], inputs))
            elif t is int or t is str or a is None:
                parts.append(a)
            elif t is float or t is bool:
                parts.append((t, a))
            else:  # a module or other object: by identity (kept alive by the trace)
                # a constant made by a pure factory (torch.zeros(h)) is a new object
                # every map: keyed by how it was made, the trace outlives the map
                parts.append(made.get(id(a)) or ("id", id(a)) if made else ("id", id(a)))
        key = (tuple(parts), _key(kwargs, [], inputs) if kwargs else None)
        if not inputs:
            return self.fn(*args, **kwargs)  # nothing per-instance: hoisted op by op
        trace = self.cache.get(key)
        if trace is None or (trace.run_id != rt.id and not trace.valid_for(rt)):
            trace = self._trace(rt, args, kwargs, inputs, _kept(args, kwargs))
            self.cache[key] = trace
            if len(self.cache) > config.BLOCK_CACHE_SIZE:
                self.cache.popitem(last=False)
        node = None
        if trace.may_split:
            node = _split_call(rt, trace, inputs)
        if node is None:
            node = add_node(rt, trace.op, None, None, None, inputs, trace.info, trace.sig)
        outs = wrap_outputs(node, trace.info)
        if trace.plain_tuple:
            return outs
        if trace.info.single:
            if trace.out_spec[0] == "leaf":
                return outs
            outs = (outs,)
        leaves = []
        for src in trace.out_sources:
            kind, v = src
            leaves.append(outs[v] if kind == "out" else inputs[v] if kind == "arg" else v)
        return _unflatten(trace.out_spec, leaves)

    def _trace(self, rt, args, kwargs, inputs, keep) -> Trace:
        tracer = Tracer(rt, getattr(self.fn, "__qualname__", "block"))
        placeholders = {}
        for t in inputs:
            if id(t) not in placeholders:
                placeholders[id(t)] = tracer.placeholder(t)

        def sub(a):
            ta = type(a)
            if ta is LazyTensor:
                return placeholders[id(a)]
            if ta is tuple or ta is list:
                return ta(sub(x) for x in a)
            if ta is dict:
                return {k: sub(v) for k, v in a.items()}
            return a

        rt.tracer = tracer
        try:
            out = self.fn(*sub(args), **sub(kwargs))
        finally:
            rt.tracer = None
        leaves: list = []
        spec = _flatten_out(out, leaves)
        ph_nodes = [placeholders[id(t)].node for t in inputs]
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
        if not out_lazies:
            raise LazyValueError(
                f"block {tracer.name} computes no per-instance tensor; call it without @block"
            )
        info = Info(tuple(metas), len(metas) == 1, None)
        name = f"block:{getattr(self.fn, '__name__', 'fn')}"
        trace = Trace(
            None, ph_nodes, tracer.nodes, spec, info, tracer.sources, tracer.needs_grad, keep
        )
        trace.out_lazies = out_lazies
        trace.out_sources = out_sources
        # outputs are exactly a tuple of the block's computed tensors, in order
        trace.plain_tuple = (
            spec[0] is tuple
            and len(out_lazies) > 1
            and all(s == ("out", k) for k, s in enumerate(out_sources))
            and all(sub == ("leaf", k) for k, sub in enumerate(spec[1]))
        )
        _finish(trace, name, tracer, f"{len(tracer.nodes)} ops traced from {tracer.name}")
        trace.observe = trace.may_split = _may_split(trace)
        trace.run_id = rt.id
        return trace


def _finish(trace: Trace, name: str, tracer: Tracer, doc: str) -> None:
    """Give a trace its op row and fusion plan; detach its nodes from the run."""
    trace.op = Op(name, trace.run, "block", launches=len(tracer.nodes), doc=doc)
    trace.sig = (trace.op,)  # the batching signature of its calls
    trace.fusion = fusion.plan(trace)
    if trace.fusion is not None:
        trace.op.source_args = trace.fusion.source_args
    for nd in tracer.nodes + trace.placeholders:
        nd.rt = None  # the trace outlives this run; don't keep the run alive


# ---- hoisting out of blocks ----------------------------------------------------------
# A block call is one node at 1 + the depth of its deepest argument. The part of the
# body that depends only on a shallow argument (the input projection W_x x_t of an RNN
# cell, x an embedding row or a per-instance input) need not wait that long: cut out, it
# runs at depth 1 as ONE batch for every token of every instance (ACRoBat appendix A.1),
# and a loop that passes the same x at every step (NestedRNN's inner RNN) computes it
# once. ``linear(cat([x, h]), W, b)`` is rewritten to ``linear(x, W_x, b) + linear(h,
# W_h)`` (column views of W, so in-place parameter updates are seen) to expose the cut.

_GEMMS = frozenset({"linear", "matmul", "mm", "mv", "addmm", "addmv", "bilinear", "einsum"})


def _linear_over_cat(nd: Node, by_id: dict, inv: set):
    """If ``nd`` is ``linear(cat(parts, -1), W, b)`` whose parts are an invariant prefix
    or suffix and a variant rest: (parts, number of invariant parts, invariant first)."""
    if nd.op.name != "linear" or nd.kwargs or not 2 <= len(nd.args) <= 3:
        return None
    x, w = nd.args[0], nd.args[1]
    bias = nd.args[2] if len(nd.args) == 3 else None
    if type(x) is not LazyTensor or not isinstance(w, torch.Tensor) or w.ndim != 2:
        return None
    if bias is not None and not isinstance(bias, torch.Tensor):
        return None
    cat = by_id.get(id(x.node))
    if cat is None or cat.op.name != "cat" or cat.kwargs:
        return None
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else 0
    if type(parts) not in (list, tuple) or not all(type(p) is LazyTensor for p in parts):
        return None
    if dim not in (-1, x.ndim - 1):
        return None
    flags = [id(p.node) in inv for p in parts]
    m = sum(flags)
    if m == 0 or m == len(parts):
        return None
    if flags[:m] == [True] * m:
        return parts, m, True
    if flags[-m:] == [True] * m:
        return parts, m, False
    return None


def _classify(trace: Trace, k: int):
    """Node ids invariant under placeholder ``k`` and the linear-over-cat nodes to cut."""
    by_id = {id(nd): nd for nd in trace.nodes}
    inv = {id(trace.placeholders[k])}
    cuts = {}
    for nd in trace.nodes:
        if nd.inputs and all(id(t.node) in inv for t in nd.inputs):
            inv.add(id(nd))
            continue
        cut = _linear_over_cat(nd, by_id, inv)
        if cut is not None:
            cuts[id(nd)] = cut
    return inv, cuts


def _may_split(trace: Trace) -> tuple:
    """Argument positions whose invariant part holds a GEMM (worth cutting out)."""
    found = []
    seen = set()
    for k, ph in enumerate(trace.placeholders):
        if id(ph) in seen:
            continue
        seen.add(id(ph))
        inv, cuts = _classify(trace, k)
        if cuts or any(id(nd) in inv and nd.op.name in _GEMMS for nd in trace.nodes):
            found.append(k)
    return tuple(found)


def _split_call(rt, trace: Trace, inputs: list):
    """Record a block call as its hoisted part and the rest, once the trace cuts at an
    argument position; None: record the call as one node.

    Whether to cut at position ``k`` is learned online, per trace: a cut pays when calls
    pass a lazy tensor there that earlier calls passed too (NestedRNN's inner loop reads
    the same ``x`` at every step), so its hoisted part is computed once and reused. A
    cut for arguments that never come back only moves the same work into another batch
    and records an extra node (measured: BiRNN slower). The decision is per trace, not
    per argument, so all calls of a trace keep one signature and batch together (cutting
    only the calls that reuse made a parser's scorer, StackRNN, slower). The first
    ``SPLIT_CALLS`` calls of a trace are observed; then it cuts or stops looking."""
    for k in trace.split_on:
        split = trace.splits[k]
        if split.run_id != rt.id:  # first use in this map
            if split.per_run:
                split = trace.splits[k] = build_split(trace, k, rt, inputs)
                assert split is not None  # the same trace cut the same way before
            split.memo = {}
            split.run_id = rt.id
        arg = inputs[k]
        memo = split.memo.get(id(arg))
        if memo is None:
            inv = split.inv
            hoisted = add_node(rt, inv.op, None, None, None, [arg], inv.info, inv.sig)
            memo = wrap_outputs(hoisted, inv.info)
            if inv.info.single:
                memo = (memo,)
            split.memo[id(arg)] = memo  # holds arg (the hoisted node's input): no id reuse
        var_inputs = [inputs[j] for j in split.arg_pos]
        var_inputs += memo
        var = split.var
        return add_node(rt, var.op, None, None, None, var_inputs, trace.info, var.sig)
    if trace.seen_run != rt.id:
        trace.seen = set()
        trace.seen_run = rt.id
    seen = trace.seen
    for k in trace.observe:
        key = (k, id(inputs[k]))
        calls, reused = trace.split_counts.get(k, (0, 0))
        calls += 1
        if key in seen:
            reused += 1
        else:
            seen.add(key)
        trace.split_counts[k] = calls, reused
        if calls >= SPLIT_CALLS:
            trace.observe = tuple(j for j in trace.observe if j != k)
            if reused >= SPLIT_REUSE * calls:
                split = build_split(trace, k, rt, inputs)
                if split is not None:
                    trace.splits[k] = split
                    trace.split_on = (k,)
        trace.may_split = trace.split_on + trace.observe
    return None


SPLIT_CALLS = 32  # calls a trace observes before it decides whether to cut ...
SPLIT_REUSE = 0.5  # ... and the share of them that must have reused their argument


class Split:
    """A trace cut at argument ``k``: ``inv`` computes the part that depends on that
    argument alone, ``var`` the rest from the other arguments and ``inv``'s outputs."""

    __slots__ = ("inv", "var", "var_inputs", "arg_pos", "per_run", "run_id", "memo")

    def __init__(self, inv, var, var_inputs, per_run, run_id):
        self.arg_pos = tuple(w for kind, w in var_inputs if kind == "arg")
        self.memo: dict = {}  # id(argument) -> hoisted outputs, in map run run_id
        self.inv = inv
        self.var = var
        self.var_inputs = var_inputs  # ("arg", position) | ("inv", output index)
        self.per_run = per_run  # holds autograd views of parameters: this run only
        self.run_id = run_id


def _replay(tracer: Tracer, nd: Node, new_inputs: list):
    """Record ``nd`` again into ``tracer`` with its LazyTensor operands replaced."""
    it = iter(new_inputs)
    args = graph.substitute(nd.args, it)
    kwargs = {k: graph.substitute(v, it) for k, v in (nd.kwargs or {}).items()}
    out = tracer.record(nd.op, nd.func, args, kwargs)
    return (out,) if nd.info.single else tuple(out)


def _columns(w: torch.Tensor, start: int, length: int) -> torch.Tensor:
    with torch._C.DisableTorchFunction():
        return w.narrow(1, start, length)


def build_split(trace: Trace, k: int, rt, inputs: list) -> Split | None:
    """Cut ``trace`` at argument ``k`` (see the section comment); None if nothing heavy
    depends on that argument alone or nothing is left for the rest."""
    import torch.nn.functional as F

    from acrobat.ops import FUNCS

    inv_ids, cuts = _classify(trace, k)
    ph_k = trace.placeholders[k]
    inv_tracer = Tracer(rt, trace.op.name + ":hoisted")
    var_tracer = Tracer(rt, trace.op.name)
    inv_ph = inv_tracer.placeholder(inputs[k])
    inv_env: dict = {(id(ph_k), 0): inv_ph}
    var_env: dict = {}
    inv_outs: list[LazyTensor] = []
    inv_out_at: dict = {}
    var_inputs: list[tuple] = []
    var_phs: list[Node] = []
    per_run = [False]
    ph_pos: dict[int, int] = {}
    for j, ph in enumerate(trace.placeholders):
        ph_pos.setdefault(id(ph), j)
    linear, cat, add = FUNCS[F.linear], FUNCS[torch.cat], FUNCS[torch.add]

    def weight_cols(w, start, length):
        if w.requires_grad and torch.is_grad_enabled():
            per_run[0] = True
        return _columns(w, start, length)

    def get_inv(t: LazyTensor) -> LazyTensor:
        key = (id(t.node), t.idx)
        v = inv_env.get(key)
        if v is None:
            nd = t.node
            outs = _replay(inv_tracer, nd, [get_inv(u) for u in nd.inputs])
            for i, o in enumerate(outs):
                inv_env[(id(nd), i)] = o
            v = inv_env[key]
        return v

    def var_input(kind, which, like: LazyTensor) -> LazyTensor:
        ph = var_tracer.placeholder(like)
        var_inputs.append((kind, which))
        var_phs.append(ph.node)
        return ph

    def from_inv(v: LazyTensor) -> LazyTensor:
        """The var program's placeholder for inv program value ``v``."""
        key = id(v.node), v.idx
        ph = inv_out_at.get(key)
        if ph is None:
            inv_outs.append(v)
            ph = inv_out_at[key] = var_input("inv", len(inv_outs) - 1, v)
        return ph

    def get_var(t: LazyTensor) -> LazyTensor:
        key = (id(t.node), t.idx)
        v = var_env.get(key)
        if v is not None:
            return v
        nd = t.node
        if id(nd) in ph_pos:
            v = var_input("arg", ph_pos[id(nd)], t)
        elif id(nd) in inv_ids:
            v = from_inv(get_inv(t))
        elif id(nd) in cuts:
            parts, m, inv_first = cuts[id(nd)]
            w = nd.args[1]
            bias = nd.args[2] if len(nd.args) == 3 else None
            inv_parts, var_parts = (parts[:m], parts[m:]) if inv_first else (parts[-m:], parts[:-m])
            n_inv = sum(p.shape[-1] for p in inv_parts)
            n_var = w.shape[1] - n_inv
            inv_start, var_start = (0, n_inv) if inv_first else (n_var, 0)

            def joined(tr, ps):
                return ps[0] if len(ps) == 1 else tr.record(cat, torch.cat, (list(ps), -1), {})

            xi = joined(inv_tracer, [get_inv(p) for p in inv_parts])
            hi = inv_tracer.record(
                linear, F.linear, (xi, weight_cols(w, inv_start, n_inv), bias), {}
            )
            xv = joined(var_tracer, [get_var(p) for p in var_parts])
            hv = var_tracer.record(linear, F.linear, (xv, weight_cols(w, var_start, n_var)), {})
            v = var_tracer.record(add, torch.add, (hv, from_inv(hi)), {})
        else:
            outs = _replay(var_tracer, nd, [get_var(u) for u in nd.inputs])
            for i, o in enumerate(outs):
                var_env[(id(nd), i)] = o
            return var_env[key]
        var_env[key] = v
        return v

    var_outs = [get_var(t) for t in trace.out_lazies]
    heavy = any(nd.op.name in _GEMMS for nd in inv_tracer.nodes)
    var_ph_ids = {id(ph) for ph in var_phs}
    if not heavy or not inv_outs or any(id(t.node) in var_ph_ids for t in var_outs):
        return None  # nothing worth hoisting, or an output would be a bare argument

    def program(tracer, phs, outs, name):
        info = Info(tuple((t.shape, t.dtype) for t in outs), len(outs) == 1, None)
        tr = Trace(None, phs, tracer.nodes, ("leaf", 0), info, [], False, [])
        tr.out_lazies = list(outs)
        _finish(tr, name, tracer, f"{len(tracer.nodes)} ops cut from {trace.op.name}")
        return tr

    # the rest's inputs: the call's arguments first, then the hoisted outputs in order,
    # so a call builds them as [inputs[j] for j in arg_pos] + hoisted
    order = sorted(
        range(len(var_inputs)), key=lambda i: (var_inputs[i][0] == "inv", var_inputs[i][1])
    )
    var_inputs = [var_inputs[i] for i in order]
    var_phs = [var_phs[i] for i in order]
    inv = program(inv_tracer, [inv_ph.node], inv_outs, f"{trace.op.name}:hoisted")
    var = program(var_tracer, var_phs, var_outs, f"{trace.op.name}:rest")
    return Split(inv, var, tuple(var_inputs), per_run[0], rt.id)


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
