"""Hoisting out of blocks (ACRoBat appendix A.1, for coarse nodes).

A block call is one node at 1 + its deepest argument's depth, so the part of the body
that depends on one argument alone waits for the others. When calls of a traced block
keep passing the same lazy tensor at a position (NestedRNN's inner loop reads the same
``x`` at every step), the trace is cut there (:func:`build_split`): the part that depends
on that argument alone runs once per argument, as one batch across instances, and the
rest reads its result. ``linear(cat([x, h]), W, b)`` is rewritten to ``linear(x, W_x, b) +
linear(h, W_h)`` (column views of ``W``, so in-place parameter updates are seen) to
expose the cut. Whether to cut is learned online per trace (:func:`split_call`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from acrobat import config, graph, padding
from acrobat.graph import Info, LazyTensor, Node, add_node, wrap_outputs
from acrobat.ops import FUNCS, linear_operands

# the torch functions as imported (while a map runs the namespaces hold stand-ins:
# ops.fast_functions); the nodes recorded here must batch with the user's
_LINEAR, _CAT, _ADD = F.linear, torch.cat, torch.add

_GEMMS = frozenset({"linear", "matmul", "mm", "mv", "addmm", "addmv", "bilinear", "einsum"})


def _linear_over_cat(nd: Node, by_id: dict, inv: set):
    """If ``nd`` is ``linear(cat(parts, -1), W, b)`` whose parts are an invariant prefix
    or suffix and a variant rest: (parts, number of invariant parts, invariant first)."""
    operands = linear_operands(nd) if nd.op.name == "linear" else None
    if operands is None:
        return None
    x, w, bias = operands
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
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


def _classify(trace, k: int):
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


def may_split(trace) -> tuple:
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


def split_call(rt, trace, inputs: list):
    """Record a block call as its hoisted part and the rest, once the trace cuts at an
    argument position; None: record the call as one node.

    Whether to cut at position ``k`` is learned online, per trace: a cut pays when calls
    pass a lazy tensor there that earlier calls passed too (NestedRNN's inner loop reads
    the same ``x`` at every step, a decoder attends over the same encoder states at every
    step), so its hoisted part is computed once and reused. A cut for arguments that
    never come back only moves the same work into another batch and records an extra
    node (measured: BiRNN slower). The decision is per trace, not per argument, so all
    calls of a trace keep one signature and batch together (cutting only the calls that
    reuse made a parser's scorer, StackRNN, slower), and one for all the traces of a
    padding family, so its sizes keep running as one batch (:func:`_decide`).

    A trace cuts as soon as ``SPLIT_CALLS`` calls have passed and ``SPLIT_REUSE`` of
    them reused their argument. It decides not to cut only on whole maps: where
    instances take turns (each suspends at a value read), a map's first calls are every
    instance's first step, none of them a reuse, however often each instance comes back
    later. So the share is judged at the first call of a later map, over every call
    counted so far (the family's calls pooled)."""
    for k in trace.split_on:
        split = trace.splits[k]
        if split.run_id != rt.id:  # first use in this map
            if split.stale():
                split.retire()  # (first use in this map: no node of it runs yet)
                split = trace.splits[k] = _cut(trace, k, rt)
                assert split is not None  # the same trace cut the same way before
            split.memo = {}
            split.run_id = rt.id
            rt.used_splits.append(split)  # its memo is cleared when the map ends
        arg = inputs[k]
        entry = split.memo.get(id(arg))
        if entry is not None and entry[1] is arg.node and entry[2] == arg.idx:
            memo = entry[3]
        else:  # (a handle an in-place update rebound since: its new value's own)
            inv = split.inv
            hoisted = add_node(rt, inv.op, None, None, None, [arg], inv.info, inv.sig)
            memo = wrap_outputs(hoisted, inv.info)
            if inv.info.single:
                memo = (memo,)
            split.memo[id(arg)] = (arg, arg.node, arg.idx, memo)  # (arg held: no id reuse)
        var_inputs = (
            [inputs[j] for j in split.arg_pos]
            if len(split.arg_pos) > 1
            else ([inputs[split.arg_pos[0]]] if split.arg_pos else [])
        )  # no comprehension frame for the common one-argument rest
        var_inputs += memo
        var = split.var
        return add_node(rt, var.op, None, None, None, var_inputs, trace.info, var.sig)
    if trace.seen_run != rt.id:
        if trace.seen_run:  # every call of the maps before is counted: judge the share
            for k in trace.observe:
                calls, reused = _pooled(trace, k)
                if calls >= SPLIT_CALLS:
                    _decide(trace, k, reused >= SPLIT_REUSE * calls, rt)
        trace.seen_run = rt.id
        if trace.split_on:
            return split_call(rt, trace, inputs)
    seen = rt.split_seen
    for k in trace.observe:
        arg = inputs[k]
        key = (id(trace), k, id(arg.node), arg.idx)
        calls, reused = trace.split_counts.get(k, (0, 0))
        calls += 1
        if key in seen:
            reused += 1
        else:
            seen[key] = arg.node
        trace.split_counts[k] = calls, reused
        if calls >= SPLIT_CALLS and reused >= SPLIT_REUSE * calls:
            _decide(trace, k, True, rt)
            if trace.split_on:
                return split_call(rt, trace, inputs)
    return None


SPLIT_CALLS = 32  # calls a trace observes before it may decide whether to cut ...
SPLIT_REUSE = 0.5  # ... and the share of them that must have reused their argument


def _family(trace) -> list:
    """``trace`` and the other traces of its block that its padding family runs with it."""
    entry = trace.op.extra.get("padded")
    owner = trace.owner
    if entry is None or owner is None:
        return [trace]
    fam = entry[0]
    return [trace] + [
        t
        for t in owner.cache.values()
        if t is not trace and t.op.extra.get("padded", (None,))[0] is fam
    ]


def _pooled(trace, k: int) -> tuple[int, int]:
    """(calls, reuses) at position ``k`` over ``trace``'s family."""
    calls = reused = 0
    for t in _family(trace):
        c, r = t.split_counts.get(k, (0, 0))
        calls += c
        reused += r
    return calls, reused


def _decide(trace, k: int, cut: bool, rt) -> None:
    """Cut (or never cut) at position ``k`` every trace of ``trace``'s family still
    watching it, so the family's sizes keep one program and run as one padded batch."""
    for t in _family(trace):
        if k in t.observe:
            _settle(t, k, cut, rt)


def _settle(trace, k: int, cut: bool, rt) -> None:
    trace.observe = tuple(j for j in trace.observe if j != k)
    trace.decided[k] = cut
    if cut and not trace.split_on:
        split = _cut(trace, k, rt)
        if split is not None:
            trace.splits[k] = split
            trace.split_on = (k,)
    trace.may_split = trace.split_on + trace.observe


def adopt(trace, old, rt) -> None:
    """A new trace takes the decisions of the trace it replaces (``old``, retraced for the
    same call key: hoisted values that carried autograd, a parameter replaced), else of
    the traces of its padding family, so neither learns again nor cuts apart."""
    if old is not None:
        trace.split_counts = dict(old.split_counts)
        decided = old.decided
    else:
        decided = {}
        for t in _family(trace)[1:]:
            decided = t.decided
            if decided:
                break
    for k, cut in decided.items():
        if k in trace.observe:
            _settle(trace, k, cut, rt)


class _Cuts:
    """The programs cut out of one block's traces at one position (their hoisted parts,
    or their rests): :func:`acrobat.padding.join` forms padding families among them as
    among a block's traces, so the hoisted parts and rests of a family's sizes run as
    one padded batch each, as the uncut calls would."""

    __slots__ = ("cache", "sizes_apart")

    def __init__(self):
        self.cache: dict = {}  # id(program) -> program
        self.sizes_apart = False


def _cut(trace, k: int, rt) -> Split | None:
    """:func:`build_split` at ``k``, its programs put in padding families beside those
    cut from the block's other traces."""
    like = LazyTensor(trace.placeholders[k], 0, trace.arg_shapes[k], trace.arg_dtypes[k])
    split = build_split(trace, k, rt, like)
    if split is None:
        return None
    rt.used_splits.append(split)  # its memo is cleared when the map ends
    owner = trace.owner
    if owner is not None and config.PAD_RAGGED:
        split.homes = []
        for part, program in (("inv", split.inv), ("var", split.var)):
            home = owner.cuts.get((k, part))
            if home is None:
                home = owner.cuts[(k, part)] = _Cuts()
            home.cache[id(program)] = program
            split.homes.append(home)
            padding.join(home, program)
    return split


class Split:
    """A trace cut at argument ``k``: ``inv`` computes the part that depends on that
    argument alone, ``var`` the rest from the other arguments and ``inv``'s outputs."""

    __slots__ = ("inv", "var", "arg_pos", "per_run", "run_id", "memo", "grad_built", "homes")

    def __init__(self, inv, var, arg_pos, per_run, run_id):
        self.memo: dict = {}  # id(argument) -> (it, its node, idx, hoisted outputs), in run run_id
        self.inv = inv
        self.var = var
        self.arg_pos = arg_pos  # var's inputs: the call's arguments at these positions,
        # then inv's outputs
        self.per_run = per_run  # holds autograd views of parameters: this run only
        self.grad_built = torch.is_grad_enabled()  # without autograd, its weight column
        # views give parameters no gradient: rebuilt for a run that trains
        self.run_id = run_id
        self.homes: list = []  # the _Cuts its programs were put in (a block's cut)

    def stale(self) -> bool:
        """Whether a new map run must build the split again."""
        return self.per_run or (not self.grad_built and torch.is_grad_enabled())

    def retire(self) -> None:
        """:func:`retire` both programs of a cut being replaced."""
        for home in self.homes:
            home.cache.pop(id(self.inv), None)
            home.cache.pop(id(self.var), None)
        self.homes = []
        retire(self.inv)
        retire(self.var)


def retire(trace) -> None:
    """Break a dropped trace's reference cycle (its op's rule is its bound ``run``): else
    every retrace (a trace that hoisted values carrying autograd is traced again every
    map) or rebuilt cut would leave its program to the cyclic collector, whose full
    passes then stall a later map. Only for a trace no pending node runs (nor its cuts'
    programs)."""
    trace.op.rule = _retired
    for split in trace.splits.values():
        split.retire()


def _retired(node, xs, n):  # pragma: no cover - a retired trace is never batched again
    raise AssertionError(f"internal: {node.op.name} ran after its trace was dropped")


def _replay(tracer, nd: Node, new_inputs: list):
    """Record ``nd`` again into ``tracer`` with its LazyTensor operands replaced."""
    it = iter(new_inputs)
    args = graph.substitute(nd.args, it)
    kwargs = {k: graph.substitute(v, it) for k, v in (nd.kwargs or {}).items()}
    out = tracer.record(nd.op, nd.func, args, kwargs)
    return (out,) if nd.info.single else tuple(out)


def _columns(w: torch.Tensor, start: int, length: int) -> torch.Tensor:
    with torch._C.DisableTorchFunction():
        return w.narrow(1, start, length)


def build_split(trace, k: int, rt, like: LazyTensor) -> Split | None:
    """Cut ``trace`` at argument ``k`` (see the section comment; ``like``: a lazy tensor of
    that argument's per-instance shape and dtype); None if nothing heavy depends on that
    argument alone or nothing is left for the rest."""
    from acrobat.block import Trace, Tracer, finish_trace  # block imports this module

    inv_ids, cuts = _classify(trace, k)
    ph_k = trace.placeholders[k]
    inv_tracer = Tracer(rt, trace.op.name + ":hoisted")
    var_tracer = Tracer(rt, trace.op.name)
    inv_ph = inv_tracer.placeholder(like)
    inv_env: dict = {(id(ph_k), 0): inv_ph}
    var_env: dict = {}
    inv_outs: list[LazyTensor] = []
    inv_out_at: dict = {}
    var_inputs: list[tuple] = []
    var_phs: list[Node] = []
    var_metas: list[tuple] = []  # (shape, dtype) per var placeholder
    per_run = [False]
    ph_pos: dict[int, int] = {}
    for j, ph in enumerate(trace.placeholders):
        ph_pos.setdefault(id(ph), j)
    linear, cat, add = FUNCS[_LINEAR], FUNCS[_CAT], FUNCS[_ADD]

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
        var_metas.append((like.shape, like.dtype))
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
            _, w, bias = linear_operands(nd)
            inv_parts, var_parts = (parts[:m], parts[m:]) if inv_first else (parts[-m:], parts[:-m])
            n_inv = sum(p.shape[-1] for p in inv_parts)
            n_var = w.shape[1] - n_inv
            inv_start, var_start = (0, n_inv) if inv_first else (n_var, 0)

            def joined(tr, ps):
                return ps[0] if len(ps) == 1 else tr.record(cat, _CAT, (list(ps), -1), {})

            xi = joined(inv_tracer, [get_inv(p) for p in inv_parts])
            hi = inv_tracer.record(
                linear, _LINEAR, (xi, weight_cols(w, inv_start, n_inv), bias), {}
            )
            xv = joined(var_tracer, [get_var(p) for p in var_parts])
            hv = var_tracer.record(linear, _LINEAR, (xv, weight_cols(w, var_start, n_var)), {})
            v = var_tracer.record(add, _ADD, (hv, from_inv(hi)), {})
        else:
            outs = _replay(var_tracer, nd, [get_var(u) for u in nd.inputs])
            for i, o in enumerate(outs):
                var_env[(id(nd), i)] = o
            return var_env[key]
        var_env[key] = v
        return v

    try:
        var_outs = [get_var(t) for t in trace.out_lazies]
    finally:
        # the recursive helpers above hold themselves through their cells: emptied, so
        # the cut's leftovers are freed now, not by a later pass of the cyclic collector
        # (off during a map, and slow when it comes); nor may they keep the run alive
        inv_tracer.rt = var_tracer.rt = None
        get_inv = get_var = None  # type: ignore[assignment]  # (their cells: emptied)
    heavy = any(nd.op.name in _GEMMS for nd in inv_tracer.nodes)
    var_ph_ids = {id(ph) for ph in var_phs}
    if not heavy or not inv_outs or any(id(t.node) in var_ph_ids for t in var_outs):
        return None  # nothing worth hoisting, or an output would be a bare argument

    def program(tracer, phs, metas, outs, name):
        info = Info(tuple((t.shape, t.dtype) for t in outs), len(outs) == 1, None)
        tr = Trace(None, phs, tracer.nodes, ("leaf", 0), info, [], False, [])
        tr.out_lazies = list(outs)
        finish_trace(tr, name, tracer, f"{len(tracer.nodes)} ops cut from {trace.op.name}")
        tr.arg_shapes = tuple(m[0] for m in metas)  # (acrobat/padding.py)
        tr.arg_dtypes = tuple(m[1] for m in metas)
        return tr

    # the rest's inputs: the call's arguments first, then the hoisted outputs in order,
    # so a call builds them as [inputs[j] for j in arg_pos] + hoisted
    order = sorted(
        range(len(var_inputs)), key=lambda i: (var_inputs[i][0] == "inv", var_inputs[i][1])
    )
    var_inputs = [var_inputs[i] for i in order]
    var_phs = [var_phs[i] for i in order]
    var_metas = [var_metas[i] for i in order]
    inv_metas = [(inv_ph.shape, inv_ph.dtype)]
    inv = program(inv_tracer, [inv_ph.node], inv_metas, inv_outs, f"{trace.op.name}:hoisted")
    var = program(var_tracer, var_phs, var_metas, var_outs, f"{trace.op.name}:rest")
    arg_pos = tuple(w for kind, w in var_inputs if kind == "arg")
    return Split(inv, var, arg_pos, per_run[0], rt.id)
