"""Pad-and-mask batches of a block traced at several sizes of one per-instance dim.

A block is traced once per signature, and a signature holds its operands' shapes: called
on per-instance tensors whose sizes differ along one dim (a sentence's ``n`` tokens, the
``n`` vectors an instance attends over) it has a trace per size, and each trace's calls
were a batch of their own. Attention over 3-20 vectors per instance ran as 17 batches of
~4, slower than the eager loop. Traces of one block that are one program up to that size
form a :class:`Family`: the scheduler joins their batches at one level
(``scheduler.family``) and the executor runs them padded to the largest size
(``executor._run_padded``), in chunks that bound the padding's extra work
(:func:`chunks`). Loops over a family's traces pad the same way
(``executor._run_padded_scans``).

Ragged dims. Compared between two traces of the family, a dim whose size differs is
ragged (:class:`Ragged`), of size ``n + offset`` with one ``n`` per member (``n + 1`` after
``cat([cls, x])``, ``n - 1`` after ``x[1:]``); a second size of its own keeps a trace
out. A later trace joins if its fixed dims are the family's and its ragged dims fit one
``n``. A list argument the block stacks at once is one argument of ``n`` rows
(:class:`View`).

Pad entries may hold anything: zeros at the inputs, then whatever the ops make of them
(NaN too). Correct results need only that no real entry reads a pad entry, which is
decided per op of the program once, when the family forms (:func:`_action`):

* elementwise and layout ops (``transpose``, ``unsqueeze``, ``stack``...) read entries at
  their own position: nothing to do, unless one broadcasts along a ragged dim;
* reductions and contractions over a ragged dim (``sum``, ``softmax``, ``a @ v``) get the
  op's neutral value at the pads of their ragged operands first (``torch.where``, so a
  NaN cannot leak): 0 for sums and products of matrices, -inf for maxima and softmax,
  +inf for minima, 1 for ``prod``; a mean is then scaled by padded / true count;
* reshapes may only regroup the fixed dims after the last ragged one; ``chunk``,
  ``split``, ``narrow`` and ``select`` act only along fixed dims, a ``cat`` along a ragged
  dim only where its last part alone is ragged; indexing takes a ragged dim whole, from
  an index >= 0 (``x[k:]``, ``x[:k]``, ``x[k]``), or alone at ``-k`` (each row's own
  ``n - k``);
* an embedding of ragged indices reads its pads as index 0 (``one_hot`` makes class 0 of
  them); scaled_dot_product_attention
  and multi-head attention over ragged keys get a mask of the real keys; a sequence module
  over ragged sequences packs them by their true lengths;
* any other op given a ragged operand keeps the trace out of a family (its calls batch
  per size, as before).

Training. Pads are zeroed again after every op while autograd records (each op's backward
then adds nothing from them: a linear layer's weight gradient sums over every row, pads
included). A family whose elementwise op broadcasts a tensor over a ragged dim with a
derivative that is not finite at zero (``q / x``) runs per size when gradients are on.
"""

from __future__ import annotations

import inspect
import math

import torch

from acrobat import config
from acrobat.graph import LazyTensor, substitute
from acrobat.ops import (
    _ORIGINAL_FORWARD,
    NEUTRAL,
    _align,
    _arg,
    _batched_hx,
    _sequence_form,
    neutral_value,
)

_F = torch.nn.functional

# ops that only move entries (each output entry is one input entry, or a copy of one)
_LAYOUT = frozenset(
    {"transpose", "t", "permute", "unsqueeze", "squeeze", "expand", "contiguous", "clone",
     "detach", "stack", "to", "float", "double", "half", "long", "int", "bool", "type_as"}
)  # fmt: skip
_RESHAPES = frozenset({"reshape", "view", "flatten", "unflatten", "reshape_as", "view_as"})
# op -> (position, keyword, default) of the dim it acts along
_ALONG = {
    "chunk": (2, "dim", 0),
    "split": (2, "dim", 0),
    "unbind": (1, "dim", 0),
    "narrow": (1, "dim", None),
    "select": (1, "dim", None),
    "cat": (1, "dim", 0),
}
# elementwise ops whose pads may raise (an integer division by a zero pad)
_DIVIDING = frozenset({"floor_divide", "remainder"})  # elementwise but for their divisor


# What the padded rows of a floating-point argument hold (tests set NaN: a pad that
# reached a real entry would show there).
FILL = 0.0


class Ragged:
    """A ragged dim's entry in a value's flags: truthy, its size ``n + offset`` (a value
    after ``cat([cls, x])`` is one longer than ``x``; ``x[1:]`` one shorter). ``sym``: which
    of the family's sizes ``n`` is (a graph's nodes 0, its edges 1: sizes that vary apart;
    a family of one size has only 0)."""

    __slots__ = ("offset", "sym")

    def __init__(self, offset: int = 0, sym: int = 0):
        self.offset = offset
        self.sym = sym

    def __bool__(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return type(other) is Ragged and other.offset == self.offset and other.sym == self.sym

    def __hash__(self) -> int:
        return hash((Ragged, self.offset, self.sym))

    def __repr__(self) -> str:
        name = "n" if self.sym == 0 else f"n{self.sym}"
        return f"{name}{self.offset:+d}" if self.offset else name


class Decline(Exception):
    """A program the family cannot pad (internal: the trace stays on its own)."""


class SizesApart(Decline):
    """Two traces that are one program up to two sizes that vary apart (a sentence pair's
    source and target lengths): no family; the block notes it (``Block.sizes_apart``)."""


class Action:
    """What one op of the program needs before / after its batched rule: its operands
    ``masked`` (positions among the op's inputs) set to the ``neutral`` value at their
    pads, and its output scaled by padded / true size of each ragged dim ``mean`` (the
    dims a mean averaged). ``keys``: a scaled_dot_product_attention whose keys are ragged, run
    with a mask of the real keys (the position of ``key`` among the op's inputs)."""

    __slots__ = ("masked", "neutral", "mean", "keys", "run", "bounds")

    def __init__(
        self, masked: tuple, neutral: str, mean: tuple = (), keys: int = -1, run=None,
        bounds: tuple | None = None,
    ):  # fmt: skip
        self.masked = masked
        self.neutral = neutral
        self.mean = mean
        self.keys = keys
        # run(inner, ins, lens, n) -> outputs, in place of the op's rule (an op that
        # needs the true sizes themselves: x[-1], a sequence module)
        self.run = run
        # (index operand, the Ragged dim it indexes, whether negative indices count from
        # the end): per-instance indices into a ragged dim, checked against each row's
        # true size (_in_bounds)
        self.bounds = bounds


class Family:
    """Traces of one block that are one program up to the size of their ragged dims."""

    def __init__(self, name: str, flags: dict, fixed: dict, in_flags: list, actions: list,
                 op_flags: list, train_safe: bool, out_flags: tuple, first: View):  # fmt: skip
        self.name = name
        self.flags = flags  # value -> per dim: ragged?
        self.fixed = fixed  # value -> its shape with None at the ragged dims
        self.in_flags = in_flags  # per program op: its operands' flags
        self.actions = actions  # per program op: an Action or None
        self.op_flags = op_flags  # per program op: its outputs' flags
        self.train_safe = train_safe  # whether gradients may run padded
        self.out_flags = out_flags  # per computed output of the block
        self.ragged_out = any(any(f) for f in out_flags)
        self.packed = first.packed[2] if first.packed is not None else -1  # the list's stack
        # per argument of the view: its ragged flags (the list: the stack's)
        self.arg_flags = [
            flags[("arg", v)] if i >= 0 else flags[(self.packed, 0)]
            for v, i in enumerate(first.args)
        ]
        # how many sizes vary apart (1: one n); per size, the ragged dims of the widest
        # value in it (a family of one size: that count alone)
        self.syms = 1 + max((d.sym for f in flags.values() for d in f if d), default=0)
        # sizes apart: per kind of value, its ragged dims in each size (an edge list's
        # (E, d) messages: (0, 1); a node-by-edge matrix: (1, 1)); a member's work is the
        # sum over them (_work: n + E where no value is ragged in both, not n * E)
        terms = {
            tuple(sum(1 for d in f if d and d.sym == s) for s in range(self.syms))
            for f in flags.values()
        }
        terms.discard((0,) * self.syms)
        self.rank: int | tuple = (
            max((t[0] for t in terms), default=0) if self.syms == 1 else tuple(sorted(terms))
        )
        # per program op: the one size its ragged operands and results have (what an
        # action's run is given the sizes of; several: an op without a run, any of them)
        self.op_sym: list[int] = []
        for f_in, f_out in zip(in_flags, op_flags):
            found = {d.sym for f in (*f_in, *f_out) for d in f if d}
            self.op_sym.append(min(found, default=0))
        self.loops = Loops(self)  # what loops over its traces batch under
        # real tensors hoisted at each size (pos(arange(n))): per (op, position), the
        # largest member's and its n; every member's is a prefix of it (_prefix_of), so a
        # batch's largest member's serves all its rows
        self.widest: dict = {}
        # (op, argument position) -> (offset, type) of a Python number that is n + offset
        self.numbers: dict = {}

    def fits(self, grown: list, n: int) -> bool:
        """Whether a new member of size ``n`` whose real tensors ``grown`` (from
        :func:`_same_program`) differ in shape from another member's fits the family:
        each one a prefix of the widest seen there, or that one a prefix of it."""
        update = {}
        for k, i, _, t in grown:
            if type(i) is tuple:  # a Python number of the size
                offset, kind, sym = self.numbers.get((k, i[1]), (None, None, 0))
                size = n[sym] if type(n) is tuple else n
                if offset is None or type(t) is not kind or t != size + offset:
                    return False
                continue
            found = self.widest.get((k, i))
            if found is None:
                return False  # (equal at the sizes seen so far: not one grown tensor)
            w, nw = found
            wider = _wider(w, nw, t, n)
            if wider is None:
                return False
            update[(k, i)] = wider
        self.widest.update(update)
        return True

    def stepper(self, trace, lens: torch.Tensor):
        """A loop's step (scan.Scan.run) as ``trace``'s program padded: its rows still
        looping are the first ``a`` of ``lens``."""

        def step(ins, a):
            return self.run(trace, ins, lens[:a], a)

        return step

    def shape(self, key, size) -> tuple:
        """The value ``key``'s per-instance shape at ragged size ``size`` (a tuple of sizes
        where they vary apart)."""
        if type(size) is tuple:
            return tuple(
                size[f.sym] + f.offset if d is None else d
                for d, f in zip(self.fixed[key], self.flags[key])
            )
        return tuple(
            size + f.offset if d is None else d for d, f in zip(self.fixed[key], self.flags[key])
        )

    def loops_pad(self, scan) -> bool:
        """Whether loops over this family's traces (``scan``: one of them) may run
        padded: no list packed, every element of a fixed shape (a part cut out of the
        body: :func:`split_family`). Ragged outputs (a state of n rows: a graph's node
        states, layer after layer) are cut to each row's size at the end
        (executor._cut_scan_outputs)."""
        return self.packed < 0 and not any(any(f) for f in self.arg_flags[: scan.sequences])

    def size_of(self, trace) -> int | tuple | None:
        """The trace's ragged size if it fits the family (fixed dims equal, ragged dims all
        one size), else None."""
        ns: list = [None] * self.syms
        for key, shape in view(trace).shapes.items():
            fixed = self.fixed.get(key)
            if fixed is None or len(fixed) != len(shape):
                return None
            for size, want, f in zip(shape, fixed, self.flags[key]):
                if want is None:
                    if ns[f.sym] is None:
                        ns[f.sym] = size - f.offset
                    elif size - f.offset != ns[f.sym]:
                        return None
                elif size != want:
                    return None
        if self.syms == 1:
            return ns[0]
        return None if None in ns else tuple(ns)

    def run(self, trace, xs: list, lens: torch.Tensor, n: int) -> tuple:
        """``trace``'s program (the chunk's largest member) on operands padded to its size,
        rows of true sizes ``lens``: op by op, each op's batched rule, masking per
        :attr:`actions`."""
        env: dict = {}
        masks: dict = {}
        clean = torch.is_grad_enabled()  # (pads kept zero: see the module's docstring)
        for i, x, flags in zip(view(trace).args, xs, self.arg_flags):
            if clean and any(flags):
                x = _clean(masks, flags, x, lens)
            if i >= 0:
                env[trace.placeholders[i]] = (x,)
            else:
                env[trace.nodes[self.packed]] = (x,)
        for k, (inner, flags, act) in enumerate(zip(trace.nodes, self.in_flags, self.actions)):
            if k == self.packed:
                continue
            ins = [env[t.node][t.idx] for t in inner.inputs]
            if act is not None:
                for j in act.masked:
                    x = ins[j]
                    neutral = neutral_value(act.neutral, x.dtype)
                    ins[j] = torch.where(_mask(masks, flags[j], x, lens), x, neutral)
                if act.bounds is not None:
                    _in_bounds(act.bounds, ins, lens, inner.op.name)
            if act is not None and act.keys >= 0:
                out = _attention(inner, ins, _mask(masks, flags[act.keys], ins[act.keys], lens), n)
            elif act is not None and act.run is not None:
                out = act.run(inner, ins, _column(lens, self.op_sym[k]), n)
            else:
                out = inner.op.rule(inner, ins, n)
            if act is not None and act.mean:
                o = out[0]
                ratio = torch.ones((), dtype=o.dtype, device=o.device)
                for d in act.mean:  # (padded / true count of each ragged dim it averaged)
                    true = _sizes(lens, flags[0][d]).to(o.dtype)
                    ratio = ratio * (ins[0].shape[d + 1] / true)
                out = (o * ratio.view(n, *(1,) * (o.ndim - 1)), *out[1:])
            if clean:
                out = tuple(
                    _clean(masks, f, o, lens) if any(f) else o
                    for o, f in zip(out, self.op_flags[k])
                )
            env[inner] = out
        return tuple(env[t.node][t.idx] for t in trace.out_lazies)


class OutOfRange(IndexError):
    """A per-instance index out of its instance's range in a padded batch (the executor
    then runs each size on its own, where the instance is found and named)."""


def _in_bounds(bounds: tuple, ins: list, lens, name: str) -> None:
    """Per-instance indices into a ragged dim, checked against each row's true size, not
    the padded one: an index past its instance's size would read or write a pad (eager
    raises), and a negative one would count from the padded end (eager counts from the
    instance's own: ``h[-1]`` its last row). Negative indices are made positive by the
    row's size where they count from the end (``wrap``); any index out of its row's range
    raises, and the batch runs each size on its own (executor._run_padded), where torch
    checks it against the true size and the executor names the instance."""
    j, dim, wrap = bounds
    idx = ins[j]
    if idx.device.type == "cpu" and idx.numel() <= _LISTED and _listed_in_bounds(idx, lens, dim):
        return  # (every index in its row's range, none negative: ins[j] as it is)
    sizes = _sizes(lens, dim).view(idx.shape[0], *(1,) * (idx.ndim - 1))
    if wrap:  # (x[i]: from -n_i on; torch would wrap what is left by the padded size)
        idx = torch.where(idx < 0, idx + sizes, idx)
        bad = (idx >= sizes) | (idx < 0)
    else:  # (gather, index_select, index_add: torch refuses a negative index itself,
        bad = idx >= sizes  # scatter_rule too, ops.check_range)
    # (the index's own pads are 0: fine, but where an instance's size is 0, which runs
    # each size on its own, as an error would)
    if bool(bad.any()):
        raise OutOfRange(f"{name}: an index is out of range of its instance's size")
    ins[j] = idx


_LISTED = 1024  # CPU indices up to this many are checked as Python ints: ~10 torch ops
# on a few dozen entries cost ~25 us, their lists ~3 us (pointer's padded steps)


def _listed_in_bounds(idx: torch.Tensor, lens: torch.Tensor, dim: Ragged) -> bool:
    """Whether every index of ``idx`` (one row per batch row) is in ``[0, size)`` of its
    row's ragged ``dim``, checked on Python ints. False where one is not (negative ones
    too: the caller's tensor check wraps or refuses them)."""
    sizes = _column(lens, dim.sym).tolist()
    offset = dim.offset
    if idx.ndim == 1:
        return all(0 <= i < s + offset for i, s in zip(idx.tolist(), sizes))
    rows = idx.reshape(idx.shape[0], -1).tolist()
    return all(0 <= i < s + offset for row, s in zip(rows, sizes) for i in row)


class Loops:
    """The batching family of loops (``scan.Scan``) over a Family's traces."""

    __slots__ = ("family",)

    def __init__(self, family: Family):
        self.family = family


def _sizes(lens: torch.Tensor, f: Ragged) -> torch.Tensor:
    """Each row's size of ragged dim ``f``: ``lens`` holds one size per row (a family of
    one size) or one column per size (sizes apart)."""
    column = _column(lens, f.sym)
    return column + f.offset if f.offset else column


def _column(lens: torch.Tensor, sym: int) -> torch.Tensor:
    """The sizes ``n`` of the family's size ``sym`` per row (``lens`` itself for one size)."""
    return lens if lens.ndim == 1 else lens[:, sym]


def _clean(masks: dict, flags: tuple, x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``x`` with zeros at its pads (autograd: see the module's docstring)."""
    return torch.where(_mask(masks, flags, x, lens), x, neutral_value("zero", x.dtype))


def cut(flags: tuple, size) -> tuple:
    """The index of one row's real entries in a padded value of ``flags`` (without the
    rows' dim), for a member of ragged size ``size`` (a tuple of sizes where they vary
    apart)."""
    if type(size) is tuple:
        return tuple(slice(0, size[f.sym] + f.offset) if f else slice(None) for f in flags)
    return tuple(slice(0, size + f.offset) if f else slice(None) for f in flags)


def blank(x: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A padded batch of ``shape`` like ``x``, filled with the pads' value (FILL, 0 for
    integers and booleans) where no row's entries go."""
    return x.new_full(shape, FILL if x.dtype.is_floating_point else 0)


def blank_as(t: LazyTensor, shape: tuple) -> torch.Tensor:
    """:func:`blank` for values like the LazyTensor ``t`` (its dtype, on its device)."""
    buf = t.node.outs[t.idx]
    fill = FILL if t.dtype.is_floating_point else 0
    return torch.full(shape, fill, dtype=t.dtype, device=buf.device)


def _mask(masks: dict, flags: tuple, x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """True at the real entries of the padded batch ``x`` whose ragged dims are ``flags``
    (cached per run by flags and shape)."""
    key = (flags, x.shape)
    m = masks.get(key)
    if m is not None:
        return m
    n = x.shape[0]
    for d, f in enumerate(flags):
        if f:
            size = x.shape[d + 1]
            shape = [n] + [1] * len(flags)
            shape[d + 1] = size
            real = _sizes(lens, f).view(n, 1)
            part = (torch.arange(size, device=x.device) < real).view(shape)
            m = part if m is None else m & part
    assert m is not None
    masks[key] = m
    return m


# ---- forming a family -----------------------------------------------------------------


def join(block, trace) -> None:
    """Put the new ``trace`` of ``block`` into a family with an existing trace of it that
    is the same program at another size (``trace.op.extra["padded"] = (family, n)``)."""
    if not _eligible(trace):
        return
    with torch._C.DisableTorchFunction():  # (tensor attributes dispatch to the map's mode)
        _join(block, trace)


def _join(block, trace) -> None:
    try:
        _join_among(trace, reversed(block.cache.values()))
    except SizesApart:
        if not (config.PAD_APART and _join_all(block, trace)):
            block.sizes_apart = True
        return
    if (
        "padded" not in trace.op.extra
        and config.PAD_APART
        and any("padded" in t.op.extra for t in block.cache.values() if t is not trace)
    ):
        _join_all(block, trace)


def _join_all(block, trace) -> bool:
    """The family formed anew over ``trace`` and every trace of ``block`` that is the
    same program (a dim seen fixed in the family's first two traces may vary in a later
    one: a pair's source length alike in the first two pairs); True if it formed. Sizes
    are told apart by how they vary over all the traces."""
    traces = [trace]
    grown: list = [[]]
    for t in block.cache.values():
        if t is trace or not _eligible(t) or t.arg_shapes == trace.arg_shapes:
            continue
        g: list = []
        if view(t).shapes.keys() == view(trace).shapes.keys() and _same_program(trace, t, g):
            traces.append(t)
            grown.append(g)
    if len(traces) < 2:
        return False
    try:
        formed = _form_many(traces, grown)
    except Decline:
        return False
    if formed is None:
        return False
    fam, sizes = formed
    for t, n in zip(traces, sizes):
        t.op.extra["padded"] = (fam, n)
    return True


def _form_many(traces: list, grown: list):
    """(a family of ``traces``, each one's size) or None: a dim is ragged where its size
    varies over the traces, and two ragged dims are one size where they differ by a
    constant in every trace (``grown[i]``: :func:`_same_program` of the first and the
    i-th)."""
    found = _ragged_flags([view(t).shapes for t in traces])
    if found is None:
        return None
    flags, fixed, bases = found
    syms = [(b[0], b[1]) for b in bases]
    formed = _form_flags(traces[0], traces[1], grown[1], flags, fixed, syms)
    if formed is None:
        return None
    fam = formed[0]
    sizes = [formed[1], formed[2]]
    for t, g in zip(traces[2:], grown[2:]):
        n = fam.size_of(t)
        if n is None or not fam.fits(g, n):
            return None
        sizes.append(n)
    return fam, sizes


def _join_among(trace, candidates) -> None:
    for other in candidates:
        if other is trace or not _eligible(other) or other.arg_shapes == trace.arg_shapes:
            continue
        entry = other.op.extra.get("padded")
        if entry is not None:
            fam = entry[0]
            n = fam.size_of(trace)
            grown: list = []
            if (
                n is not None
                and n != entry[1]
                and _same_program(other, trace, grown)
                and fam.fits(grown, n)
            ):
                trace.op.extra["padded"] = (fam, n)
                return
            continue
        try:
            formed = _form(other, trace)
        except SizesApart:
            raise
        except Decline:
            continue
        if formed is not None:
            fam, n_other, n_trace = formed
            other.op.extra["padded"] = (fam, n_other)
            trace.op.extra["padded"] = (fam, n_trace)
            return


def split_family(scans: list) -> Family | None:
    """The family of the programs left in the loops ``scans`` (each with a part cut out
    of its body, hoisting.Split; the first the largest) once the cut part runs: formed
    among them if it is not yet. None where they are not one family of the sizes the
    loops' own family gives them, or the cut parts are not one program of one shape."""
    splits = [s.split for s in scans]
    first = splits[0]
    pos = scans[0].hoisted_pos
    if any(s.hoisted_pos != pos for s in scans) or pos >= scans[0].sequences:
        return None  # (a loop-invariant cut of a ragged operand: not one program)
    with torch._C.DisableTorchFunction():
        for sp in splits[1:]:
            if not (
                _same_program(first.inv, sp.inv) and view(first.inv).shapes == view(sp.inv).shapes
            ):
                return None
        rests = [sp.var for sp in splits]
        for r in rests:
            if "padded" not in r.op.extra and _eligible(r):
                _join_among(r, [o for o in rests if o is not r])
    entries = [r.op.extra.get("padded") for r in rests]
    if any(e is None for e in entries) or len({id(e[0]) for e in entries}) != 1:
        return None
    sizes = [s.trace.op.extra["padded"][1] for s in scans]
    if [e[1] for e in entries] != sizes:
        return None
    return entries[0][0]


def _eligible(trace) -> bool:
    extra = trace.op.extra  # (random ops too: the pads draw, nothing reads them)
    return (
        "pure" in extra
        and "lookup" not in extra
        and "lift" not in extra
        and bool(trace.nodes)
        and bool(trace.arg_shapes)
    )


class View:
    """A trace as its family compares it. A list argument stacked at once
    (``torch.stack(xs)`` of a block's list of ``n`` tensors, each used only there) is one
    argument, the stack's value: traces given lists of other lengths are then one program
    with a ragged dim. ``packed``: (first placeholder, count, the stack's op index) or
    None; ``pos``: id(node) -> its value's name (("arg", i) an argument, k the k-th op);
    ``shapes``: value name -> per-instance shape."""

    __slots__ = ("packed", "pos", "shapes", "args")

    def __init__(self, trace):
        self.packed = _packed(trace)
        s, count, _ = self.packed or (len(trace.placeholders), 0, -1)
        self.pos = pos = {}
        self.shapes = shapes = {}
        self.args = []  # per argument of the view: its placeholder index (-1: the list)
        for i, (ph, shape) in enumerate(zip(trace.placeholders, trace.arg_shapes)):
            if s <= i < s + count:
                if i == s:
                    self.args.append(-1)
                continue
            v = len(self.args)
            self.args.append(i)
            pos[id(ph)] = ("arg", v)
            shapes[("arg", v)] = tuple(shape)
        for k, inner in enumerate(trace.nodes):
            pos[id(inner)] = k
            for j, (shape, _) in enumerate(inner.info.metas):
                shapes[(k, j)] = tuple(shape)

    def key(self, t: LazyTensor) -> tuple:
        """The value ``t`` of the program, as :attr:`shapes` names it."""
        p = self.pos[id(t.node)]
        return p if type(p) is tuple else (p, t.idx)


def view(trace) -> View:
    v = trace.pad_view
    if v is None:
        v = trace.pad_view = View(trace)
    return v


def _packed(trace) -> tuple | None:
    """(first placeholder, count, op index) of a stack along dim 0 of consecutive
    placeholders that nothing else reads, or None."""
    phs = {id(ph): i for i, ph in enumerate(trace.placeholders)}
    reads: dict = {}
    for inner in trace.nodes:
        for t in inner.inputs:
            reads[id(t.node)] = reads.get(id(t.node), 0) + 1
    for t in trace.out_lazies:
        reads[id(t.node)] = reads.get(id(t.node), 0) + 1
    for k, inner in enumerate(trace.nodes):
        if inner.op.name != "stack" or not inner.inputs:
            continue
        idx = [phs.get(id(t.node), -1) for t in inner.inputs]
        parts = _arg(inner, 0, "tensors")
        if (
            idx[0] >= 0
            and idx == list(range(idx[0], idx[0] + len(idx)))
            and all(reads[id(t.node)] == 1 for t in inner.inputs)
            and type(parts) in (list, tuple)
            and len(parts) == len(idx)
            and _arg(inner, 1, "dim", 0) == 0
            and not inner.kwargs
        ):
            return idx[0], len(idx), k
        return None
    return None


def _same_program(a, b, grown: list | None = None) -> bool:
    """Whether traces ``a`` and ``b`` run the same ops on the same arguments, up to the
    shapes of their per-instance values (and the length of a packed list). ``grown``, a
    list: real tensors of one rank that differ in shape (``pos(arange(n))``, hoisted per
    size) count as the same and are appended as (op, position, a's, b's), for
    :func:`_prefixes` to check."""
    va, vb = view(a), view(b)
    if len(a.nodes) != len(b.nodes) or len(va.args) != len(vb.args):
        return False
    if (va.packed is None) != (vb.packed is None) or (
        va.packed is not None and (va.packed[0], va.packed[2]) != (vb.packed[0], vb.packed[2])
    ):
        return False
    if [va.key(t) for t in a.out_lazies] != [vb.key(t) for t in b.out_lazies]:
        return False
    if [a.arg_dtypes[max(i, 0) if i >= 0 else va.packed[0]] for i in va.args] != [
        b.arg_dtypes[max(i, 0) if i >= 0 else vb.packed[0]] for i in vb.args
    ]:
        return False
    # a call's Python constants and real tensors among its results come from its own
    # trace (block._finish_call), so they may differ with the size (a region returning n
    # or its causal mask); only what the batch computes must be one program
    if not _same_spec(a.out_spec, b.out_spec) or [
        s if s[0] != "arg" else ("arg", va.args.index(s[1]) if s[1] in va.args else None)
        for s in a.out_sources if s[0] != "real"
    ] != [
        s if s[0] != "arg" else ("arg", vb.args.index(s[1]) if s[1] in vb.args else None)
        for s in b.out_sources if s[0] != "real"
    ]:  # fmt: skip
        return False
    if [s[0] == "real" for s in a.out_sources] != [s[0] == "real" for s in b.out_sources]:
        return False
    packed = va.packed[2] if va.packed is not None else -1
    for k, (x, y) in enumerate(zip(a.nodes, b.nodes)):
        if x.op is not y.op or x.func is not y.func:
            return False
        if k == packed:
            continue  # (a stack of the list: its length is the ragged size)
        if len(x.inputs) != len(y.inputs) or [d for _, d in x.info.metas] != [
            d for _, d in y.info.metas
        ]:
            return False
        start = len(grown) if grown is not None else 0
        xa, ya = x.args, y.args
        if grown is not None and x.op.name in _SIZED and (not x.kwargs or x.op.name == "pool"):
            sized = [
                p
                for p, (u, w) in enumerate(zip(xa, ya))
                if type(u) in (int, float) and type(w) is type(u) and u != w
            ]  # (a Python number of the size: x.sum(0) / len(xs))
            if sized:
                xa = tuple(None if p in sized else u for p, u in enumerate(xa))
                ya = tuple(None if p in sized else w for p, w in enumerate(ya))
        else:
            sized = []
        if not _same((xa, x.kwargs), (ya, y.kwargs), va.pos, vb.pos, grown):
            return False
        if grown is not None:
            grown[start:] = [(k, i, ta, tb) for i, (ta, tb) in enumerate(grown[start:])]
            grown.extend((k, ("number", p), x.args[p], y.args[p]) for p in sized)
    return True


def _same_spec(x, y) -> bool:
    """Whether two block output specs (block._unflatten's) package alike, their
    constants aside."""
    if x[0] == "const" or y[0] == "const":
        return x[0] == y[0]
    if x[0] != y[0]:
        return False
    if x[0] == "leaf":
        return x[1] == y[1]
    if x[0] is dict:
        return x[1].keys() == y[1].keys() and all(_same_spec(x[1][k], y[1][k]) for k in x[1])
    return len(x[1]) == len(y[1]) and all(_same_spec(u, v) for u, v in zip(x[1], y[1]))


_PLAIN = (int, float, bool, str, complex, type(None), type(Ellipsis), torch.dtype,
          torch.device, torch.layout, torch.memory_format)  # fmt: skip


def _same(x, y, px: dict, py: dict, grown: list | None = None) -> bool:
    tx = type(x)
    if tx is not type(y):
        return False
    if tx is LazyTensor:
        return x.idx == y.idx and px.get(id(x.node), 1) == py.get(id(y.node), 2)
    if isinstance(x, torch.Tensor):
        if x is y:
            return True
        if grown is not None and _grown(x, y):
            grown.append((x, y))
            return True
        return _equal_tensors(x, y)
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(_same(a, b, px, py, grown) for a, b in zip(x, y))
    if tx is dict:
        return x.keys() == y.keys() and all(_same(x[k], y[k], px, py, grown) for k in x)
    if tx is slice:
        return all(
            _same(a, b, px, py, grown)
            for a, b in ((x.start, y.start), (x.stop, y.stop), (x.step, y.step))
        )
    if isinstance(x, _PLAIN):
        return x == y
    return x is y


def _grown(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Two real tensors that may be one value hoisted at two sizes (rank, dtype, device
    and autograd alike, shapes not)."""
    with torch._C.DisableTorchFunction():
        return (
            x.shape != y.shape
            and x.ndim == y.ndim
            and x.dtype == y.dtype
            and x.device == y.device
            and x.requires_grad == y.requires_grad
        )


def _prefix_of(small: torch.Tensor, big: torch.Tensor, n_small, n_big) -> bool:
    """Whether real tensor ``small`` (of a member of size ``n_small``) is ``big`` (of one
    of size ``n_big`` >= it) cut to its shape, every dim that differs by n_big - n_small:
    then ``big`` serves both (a smaller member's pads read big's further entries, as
    they read any pad)."""
    with torch._C.DisableTorchFunction(), torch.no_grad():
        for p, q in zip(small.shape, big.shape):
            if p > q or (p != q and type(n_big) is not tuple and q - p != n_big - n_small):
                return False  # (sizes apart: which size a dim follows is not known here)
        return bool(torch.equal(small, big[tuple(slice(0, p) for p in small.shape)]))


def _wider(a: torch.Tensor, na, b: torch.Tensor, nb) -> tuple | None:
    """(the larger of real tensors ``a`` and ``b``, hoisted for members of sizes ``na`` and
    ``nb``, and its size) if the smaller is a prefix of it, else None. (Sizes apart, tuples:
    the larger by the tensors' shapes.)"""
    if type(na) is tuple:
        with torch._C.DisableTorchFunction():
            a_in_b = all(p <= q for p, q in zip(a.shape, b.shape))
        return (b, nb) if a_in_b and _prefix_of(a, b, na, nb) else _wider_apart(a, na, b, nb)
    if na <= nb:
        return (b, nb) if _prefix_of(a, b, na, nb) else None
    return (a, na) if _prefix_of(b, a, nb, na) else None


def _wider_apart(a: torch.Tensor, na: tuple, b: torch.Tensor, nb: tuple) -> tuple | None:
    """:func:`_wider` of sizes apart when ``b`` is not a prefix of ``a``'s shape: ``b``
    within ``a``, or None."""
    with torch._C.DisableTorchFunction():
        b_in_a = all(q <= p for p, q in zip(a.shape, b.shape))
    return (a, na) if b_in_a and _prefix_of(b, a, nb, na) else None


def _equal_tensors(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Two real tensors (values hoisted into each trace) with equal contents."""
    with torch._C.DisableTorchFunction(), torch.no_grad():
        return (
            x.shape == y.shape
            and x.dtype == y.dtype
            and x.device == y.device
            and x.requires_grad == y.requires_grad
            and bool(torch.equal(x, y))
        )


def _form(a, b):
    """A family of traces ``a`` and ``b`` ((family, n of a, n of b)), or None."""
    va, vb = view(a), view(b)
    sa, sb = va.shapes, vb.shapes
    grown: list = []
    if sa.keys() != sb.keys() or not _same_program(a, b, grown):
        return None
    found = _ragged_flags([sa, sb])
    if found is None:
        return None
    flags, fixed, bases = found
    syms = [(b[0], b[1]) for b in bases]  # per size: (its n in a, in b)
    try:
        return _form_flags(a, b, grown, flags, fixed, syms)
    except Decline as exc:
        if len(syms) > 1:  # (as before sizes apart could pad: the block goes op by op)
            raise SizesApart(str(exc)) from None
        raise


def _ragged_flags(shapes: list):
    """``(flags, fixed, bases)`` of the values named in ``shapes`` (each trace's view
    shapes, the same names): a dim is ragged where its size varies over the traces, two
    ragged dims are one size where they differ by a constant in every trace (a new size
    only among the arguments: sizes apart, with config.PAD_APART, else SizesApart); per
    size, its n in each trace. None where nothing varies, or an op's value varies in a
    size of its own (n * m)."""
    flags: dict = {}
    fixed: dict = {}
    bases: list = []  # per size: its n in each trace
    for key, x in shapes[0].items():
        column = [sh[key] for sh in shapes]
        if any(len(c) != len(x) for c in column):
            return None
        f: list = []
        for d in range(len(x)):
            sizes = [c[d] for c in column]
            if len(set(sizes)) == 1:
                f.append(False)
                continue
            sym = next(
                (s for s, b in enumerate(bases) if len({p - q for p, q in zip(sizes, b)}) == 1),
                -1,
            )
            if sym < 0:  # a ragged size of its own
                if bases and not (type(key) is tuple and key[0] == "arg"):
                    return None  # (made inside of two sizes, n * m: not padded)
                if bases and not config.PAD_APART:
                    raise SizesApart(key)
                bases.append(sizes)
                sym = len(bases) - 1
            f.append(Ragged(sizes[0] - bases[sym][0], sym))
        flags[key] = tuple(f)
        fixed[key] = tuple(None if fl else p for p, fl in zip(x, flags[key]))
    return (flags, fixed, bases) if bases else None


def _sym_of(syms: list, p: int, q: int) -> int:
    """The size among ``syms`` a dim of size ``p`` in one trace and ``q`` in the other is
    (at a constant offset from its n in both), or -1."""
    for s, (na, nb) in enumerate(syms):
        if p - na == q - nb:
            return s
    return -1


def _form_flags(a, b, grown: list, flags: dict, fixed: dict, syms: list):
    """:func:`_form` once the values' ragged dims are known: the family, or None."""
    va = view(a)
    apart = len(syms) > 1
    na = syms[0][0] if not apart else tuple(p for p, _ in syms)
    nb = syms[0][1] if not apart else tuple(q for _, q in syms)
    widest: dict = {}  # (op, position) -> (the largest member's real tensor there, its n)
    numbers: dict = {}  # op -> [(argument position, offset, type, size)]: n + offset there
    for k, i, ta, tb in grown:
        if type(i) is tuple:  # ("number", position)
            sym = _sym_of(syms, ta, tb)
            if sym < 0:
                return None  # (a number that is not n + a constant)
            numbers.setdefault(k, []).append((i[1], ta - syms[sym][0], type(ta), sym))
            continue
        wider = _wider(ta, na, tb, nb)
        if wider is None:
            return None  # (two different real tensors, not one at two sizes)
        widest[(k, i)] = wider
    packed = va.packed[2] if va.packed is not None else -1
    if packed >= 0 and apart:
        raise Decline("a packed list with sizes apart")
    if packed >= 0 and not flags[(packed, 0)][0]:
        return None  # (lists of one length: the size is another dim's)
    in_flags: list = []
    actions: list = []
    op_flags: list = []
    train_safe = True
    for k, inner in enumerate(a.nodes):
        op_flags.append([flags[(k, j)] for j in range(len(inner.info.metas))])
        if k == packed:
            in_flags.append([])
            actions.append(None)
            continue
        keys = [va.key(t) for t in inner.inputs]
        f_in = [flags[kk] for kk in keys]
        x_in = [fixed[kk] for kk in keys]
        f_out = [flags[(k, j)] for j in range(len(inner.info.metas))]
        x_out = [fixed[(k, j)] for j in range(len(inner.info.metas))]
        in_flags.append(f_in)
        if apart and k in numbers:  # (each number's size the op's one ragged size)
            found_syms = {d.sym for f in (*f_in, *f_out) for d in f if d}
            if len(found_syms) != 1 or any(e[3] not in found_syms for e in numbers[k]):
                raise Decline("a number of one size where another is ragged")
        if k in numbers and inner.op.name == "pool":  # (a window the whole ragged dim)
            found = numbers[k]
            if len(found) != 1 or found[0][0] != 1:
                raise Decline("a pool sized by n other than in its window")
            actions.append(_pool_action(inner, f_in, found[0][1]))
        elif k in numbers:  # (an elementwise op given the size as a Python number)
            actions.append(Action((), "zero", run=_sized(numbers[k])))
        else:
            actions.append(_action(inner, f_in, x_in, f_out, x_out))
        act = actions[-1]
        if (
            apart
            and act is not None
            and act.run is not None
            and len({d.sym for f in (*f_in, *f_out) for d in f if d}) > 1
        ):
            raise Decline(f"{inner.op.name} over sizes apart")  # (its run: one size)
        train_safe = train_safe and _train_safe(inner, f_in, f_out)
    out_flags = tuple(flags[va.key(t)] for t in a.out_lazies)
    fam = Family(a.op.name, flags, fixed, in_flags, actions, op_flags, train_safe, out_flags, va)
    fam.widest = widest
    fam.numbers = {
        (k, p): (c, kind, sym) for k, found in numbers.items() for p, c, kind, sym in found
    }
    return fam, na, nb


# elementwise ops that may take the size as a Python number (x / n, x * (1.0 / n)...)
_SIZED = frozenset({"add", "sub", "mul", "div", "pool"})  # (pool: a window of n)


def _sized(numbers: list):
    """The run of an elementwise op given each row's size as a Python number at
    ``numbers`` ((position, offset, type)): each row's own n + offset there, as a
    column of the op's output dtype."""

    def run(inner, ins, lens, n):
        shape, dtype = inner.info.metas[0]
        it = iter(ins)
        args = [_align(a, it, n, len(shape)) for a in inner.args]
        for pos, offset, _, _ in numbers:  # (lens: the sizes of the op's one ragged size)
            args[pos] = (lens + offset).to(dtype).view(n, *(1,) * len(shape))
        return (inner.func(*args),)

    return run


def _where(inner, t) -> int:
    """Position of the operand ``t`` among ``inner``'s inputs (-1: not an operand)."""
    for j, x in enumerate(inner.inputs):
        if x is t:
            return j
    return -1


def _dims(dim, rank: int) -> list:
    """A dim argument as non-negative ints (a Tensor or a bad dim: Decline)."""
    if type(dim) is int:
        dim = (dim,)
    if not isinstance(dim, (tuple, list)) or not all(type(d) is int for d in dim):
        raise Decline(f"dim {dim!r}")
    out = [d + rank if d < 0 else d for d in dim]
    if not all(0 <= d < rank for d in out):
        raise Decline(f"dim {dim!r}")
    return out


def _ragged_inputs(f_in: list) -> tuple:
    """The positions of the operands with a ragged dim (a tensor passed twice: both)."""
    return tuple(j for j, f in enumerate(f_in) if any(f))


def _broadcasts_ragged(f_in: list, f_out: tuple) -> bool:
    """Whether an elementwise op would broadcast a ragged dim of an operand (right-aligned
    against the output) into a fixed one."""
    for f in f_in:
        for i in range(1, len(f) + 1):
            if f[-i] and (i > len(f_out) or not f_out[-i]):
                return True
    return False


def _action(inner, f_in: list, x_in: list, f_out: list, x_out: list) -> Action | None:
    """What op ``inner`` needs to run padded (None: nothing), or Decline. ``f_*``: per
    operand / output, its ragged flags; ``x_*``: its shape, None at ragged dims."""
    ragged = _ragged_inputs(f_in)
    name, kind = inner.op.name, inner.op.kind
    if name == "scatter":  # (its base may be a real tensor hoisted at each size)
        return _scatter_action(inner, f_in, f_out)
    if name == "put":  # (likewise)
        return _put_action(inner, f_in, f_out)
    if not ragged:
        if any(any(f) for f in f_out):
            raise Decline(f"{name} makes a ragged value from fixed ones")
        return None
    if name in _LAYOUT:
        return None
    if kind in ("elementwise", "factory"):  # (dropout and rand_like draw for the pads
        # too: harmless, nothing reads them; no batch draws what the eager loop would)
        if name in _DIVIDING:  # (pads in the dividend stay in the pads; a pad divisor
            d = _arg(inner, 1, "other")  # of an integer tensor raises)
            if type(d) is LazyTensor and any(f_in[_where(inner, d)]):
                raise Decline(f"{name} by a ragged divisor")
        if _broadcasts_ragged(f_in, f_out[0]):
            raise Decline(name)
        return None
    x = _arg(inner, 0, "input")
    j = _where(inner, x)
    if name in _RESHAPES:
        if j < 0:
            raise Decline(name)
        last = max(d for d, f in enumerate(f_in[j]) if f)
        if (
            x_in[j][: last + 1] != x_out[0][: last + 1]
            or f_in[j][: last + 1] != f_out[0][: last + 1]
            or any(f_out[0][last + 1 :])
        ):
            raise Decline(f"{name} regroups a ragged dim")
        return None
    if name in _ALONG:
        pos, key, default = _ALONG[name]
        j = _first_lazy(inner, _arg(inner, 0, "tensors")) if name == "cat" else j
        if j < 0:
            raise Decline(name)
        dim = _arg(inner, pos, key, default)
        along = _dims(dim, len(f_in[j]))
        if name == "cat" and any(f_in[j][d] for d in along):
            _check_cat(inner, along[0], f_in)
            return None
        if any(f_in[j][d] for d in along):
            raise Decline(f"{name} along a ragged dim")
        return None
    if name == "getitem":
        if j < 0 or len(inner.inputs) != 1:
            return _tensor_index_action(inner, f_in)
        end = _check_index(inner.args[1], f_in[0])
        if end is None:
            return None
        d, k = end
        return Action((), "zero", run=_from_end(d, k + f_in[0][d].offset))
    if kind == "reduce":
        return _reduce_action(inner, name, j, f_in, f_out)
    if name == "linear":
        w = _arg(inner, 1, "weight")
        if j != 0 or (type(w) is LazyTensor and any(f_in[_where(inner, w)])):
            raise Decline("linear with a ragged weight")
        return Action(ragged, "zero") if f_in[0][-1] else None
    if name == "matmul":
        a, b = x, _arg(inner, 1, "other")
        ja, jb = j, _where(inner, b)
        contracted = (ja >= 0 and f_in[ja][-1]) or (
            jb >= 0 and f_in[jb][0 if len(f_in[jb]) == 1 else -2]
        )
        del a
        return Action(ragged, "zero") if contracted else None
    if name in _ORDERED:
        return _ordered_action(inner, name, j, f_in)
    if name == "addmm" and inner.func is torch.einsum:
        return _einsum_action(inner, f_in)
    if name in _ACTIONS:  # (ops with rules of their own, below)
        return _ACTIONS[name](inner, f_in)
    if name == "embedding":
        w = _arg(inner, 1, "weight")
        if j != 0 or type(w) is LazyTensor:
            raise Decline("embedding of a per-instance table")
        return Action((0,), "zero")  # (a pad's index may be anything: read row 0)
    if name == "one_hot":  # (each entry's row of classes; num_classes is given)
        if j != 0:
            raise Decline("one_hot")
        return Action((0,), "zero")  # (a pad's class may be anything: class 0)
    if name == "layer_norm":
        shape = _arg(inner, 1, "normalized_shape")
        k = 1 if type(shape) is int else len(shape)
        if j != 0 or any(f_in[0][-k:]) or len(ragged) != 1:
            raise Decline("layer_norm over a ragged dim")
        return None
    raise Decline(f"{name} ({kind}) of a ragged value")


# ---- lookups by per-instance indices (a tag's score: em.gather(1, tags[:, None]),
# transitions[tags[:-1], tags[1:]]): the indices' pads read entry 0, real ones read as in
# eager (a per-instance index is below its own sizes)


def _integer(t) -> bool:
    return type(t) is LazyTensor and not t.dtype.is_floating_point and t.dtype != torch.bool


def _tensor_index_action(inner, f_in: list) -> Action | None:
    """``table[i]`` / ``table[k, i, j]`` of a real tensor by per-instance integer indices
    ragged alike, and ``x[heads]`` of a per-instance tensor by one per-instance index
    tensor (a parser's head of each token): the indices' pads set to 0."""
    base, index = inner.args
    if type(base) is LazyTensor:  # x[heads]: rows of the instance's own tensor, each
        if not _integer(index):  # index below its own size (a pad's reads row 0)
            raise Decline("getitem of a per-instance tensor by other than one index tensor")
        ji, fb = _where(inner, index), f_in[_where(inner, base)]
        bounds = (ji, fb[0], True) if fb[0] else None  # (-1: the instance's last row)
        return _lookup_action(ji, f_in[ji], bounds)
    parts = index if type(index) is tuple else (index,)
    lazy = [p for p in parts if type(p) is LazyTensor]
    if not all(_integer(p) for p in lazy):
        raise Decline("getitem by other than integer tensors")
    flags = {f_in[_where(inner, p)] for p in lazy}
    if len(flags) != 1:
        raise Decline("indices ragged apart")
    return Action(_ragged_inputs(f_in), "zero")


def _gather_action(inner, f_in: list) -> Action | None:
    """``torch.gather(x, dim, index)`` and ``index_select(x, dim, index)`` by a
    per-instance index: its pads set to 0; a gather's index ragged where ``x`` is, but
    along ``dim``."""
    x, dim, index = _arg(inner, 0, "input"), _arg(inner, 1, "dim"), _arg(inner, 2, "index")
    if not _integer(index) or type(dim) is not int:
        raise Decline("a lookup by a real or non-integer index")
    ji = _where(inner, index)
    fi = f_in[ji]
    if inner.func in (torch.gather, torch.Tensor.gather):
        fx = f_in[_where(inner, x)] if type(x) is LazyTensor else (False,) * len(fi)
        d = _dims(dim, len(fx))[0]
        if len(fx) != len(fi) or any(a != b for k, (a, b) in enumerate(zip(fx, fi)) if k != d):
            raise Decline("a gather whose index is ragged apart from its input")
    bounds = None
    if type(x) is LazyTensor:  # (into the instance's own ragged dim: its true size)
        fx = f_in[_where(inner, x)]
        d = _dims(dim, len(fx))[0]
        bounds = (ji, fx[d], False) if fx[d] else None
    return _lookup_action(ji, fi, bounds)


def _lookup_action(ji: int, fi: tuple, bounds: tuple | None) -> Action | None:
    """A lookup by the per-instance index at ``ji`` (its flags ``fi``): its pads set to 0
    where it is ragged, its values checked by ``bounds`` where it indexes a ragged dim."""
    if not any(fi) and bounds is None:
        return None
    return Action((ji,) if any(fi) else (), "zero", bounds=bounds)


def _put_action(inner, f_in: list, f_out: list) -> Action | None:
    """``x[index] = value`` into a ragged ``x`` (analysis's ``put``; a pointer network's
    ``mask[i] = -inf`` at the row it chose): whole slices and ints >= 0 at fixed dims, a
    per-instance int scalar at any dim, checked against its instance's true size there
    (negative ones counted from that end); one value broadcast over what the index takes,
    fixed in size. Writes land in each instance's real part, the pads stay as they were.
    ``x`` may be a real tensor hoisted at each size (``mask = torch.zeros(n)``)."""
    _, index, value = inner.args
    fx = f_out[0]  # (x's flags: a put keeps its target's shape)
    if type(value) is LazyTensor and any(f_in[_where(inner, value)]):
        raise Decline("put of a ragged value")
    bounds = None
    for d, e in enumerate(index if type(index) is tuple else (index,)):
        if d >= len(fx):
            raise Decline("put by an index longer than its target's rank")
        if type(e) is slice and e == slice(None):
            continue
        if type(e) is LazyTensor and _integer(e) and e.ndim == 0:
            if fx[d]:
                if bounds is not None:
                    raise Decline("put at two ragged dims")
                bounds = (_where(inner, e), fx[d], True)
            continue
        if fx[d] or type(e) is not int or e < 0:
            raise Decline("put at a ragged dim other than by a per-instance int")
    return Action((), "zero", bounds=bounds) if bounds is not None else None


def _scatter_action(inner, f_in: list, f_out: list) -> Action | None:
    """``base.index_add(dim, index, source)`` / ``scatter_add(dim, index, src)`` (a graph's
    messages summed into its nodes, ``zeros_like(h).index_add(0, dst, msg)``): the pads
    of the index set to 0 and of the source to 0, so they add zeros to entry 0; a
    plain ``scatter`` declines (a pad would overwrite entry 0). The base may be ragged,
    or a real tensor hoisted at each size (its pads hold what it holds there)."""
    func = inner.func
    if func in (torch.index_add, torch.Tensor.index_add):
        names = ("input", "dim", "index", "source")
    elif func in (torch.scatter_add, torch.Tensor.scatter_add):
        names = ("input", "dim", "index", "src")
    else:
        raise Decline("scatter (not an add) over a ragged value")
    dim, index, src = (_arg(inner, k, name) for k, name in enumerate(names) if k > 0)
    if type(dim) is not int or (type(index) is LazyTensor and not _integer(index)):
        raise Decline("scatter by a real or non-integer index")
    masked = tuple(
        _where(inner, t)
        for t in (index, src)
        if type(t) is LazyTensor and any(f_in[_where(inner, t)])
    )
    bounds = None
    if type(index) is LazyTensor:  # into a ragged dim of the result (the base's, or a real
        d = _dims(dim, len(f_out[0]))[0]  # base's hoisted at each size): its true size
        bounds = (_where(inner, index), f_out[0][d], False) if f_out[0][d] else None
    return Action(masked, "zero", bounds=bounds) if masked or bounds else None


# ---- convolutions and pooling along a ragged dim (a CNN over a sentence's tokens) ---------


def _conv_action(inner, f_in: list) -> Action:
    """``F.conv1d`` / ``conv2d`` of one instance's input, ragged along a spatial dim, by
    real weights: the pads zeroed, as the convolution's own zero padding is, so every
    real output reads what it reads in eager (stride 1 there: its outputs are then
    ``n`` plus a constant, each row's real ones first)."""
    x = _arg(inner, 0, "input")
    if _where(inner, x) != 0 or len(inner.inputs) != 1:
        raise Decline("a convolution with per-instance weights")
    spatial = 1 if inner.func is _F.conv1d else 2
    flags = f_in[0]
    if any(flags[:-spatial]):
        raise Decline("a convolution ragged in its channels")
    stride = _arg(inner, 3, "stride", 1)
    strides = (stride,) * spatial if type(stride) is int else tuple(stride)
    if any(f and st != 1 for f, st in zip(flags[-spatial:], strides)):
        raise Decline("a strided convolution along a ragged dim")
    return Action((0,), "zero")


# pools over a whole ragged dim, one output: the pads' value and whether it is a mean
_WHOLE_POOLS = {
    _F.adaptive_max_pool1d: ("low", False), _F.adaptive_avg_pool1d: ("zero", True),
    _F.max_pool1d: ("low", False), _F.avg_pool1d: ("zero", True),
}  # fmt: skip


def _pool_action(inner, f_in: list, window: int | None = None) -> Action:
    """``F.adaptive_max_pool1d(h, 1)`` / ``adaptive_avg_pool1d(h, 1)`` over a ragged last
    dim, and ``F.max_pool1d(h, n)`` / ``avg_pool1d(h, n)`` whose window is the whole
    ragged dim (``window``: its offset from n, found when the family forms): a reduction
    of each row's real entries (pads -inf for a max, zero for a mean, rescaled)."""
    func = inner.func
    if (
        func not in _WHOLE_POOLS
        or len(inner.inputs) != 1
        or _where(inner, _arg(inner, 0, "input")) != 0
        or any(f_in[0][:-1])
    ):
        raise Decline("a pool along a ragged dim")
    flags: tuple = f_in[0]
    if func in (_F.adaptive_max_pool1d, _F.adaptive_avg_pool1d):
        size = _arg(inner, 1, "output_size")
        if size not in (1, (1,), [1]) or _arg(inner, 2, "return_indices", False):
            raise Decline("an adaptive pool to more than one entry")
    elif (
        window is None
        or window != flags[-1].offset
        or len(inner.args) != 2
        or _arg(inner, 2, "stride") is not None
        or _arg(inner, 3, "padding", 0) not in (0, (0,))
        or _arg(inner, 4, "dilation", 1) not in (1, (1,))
        or _arg(inner, 6, "return_indices", False)
    ):
        raise Decline("a pool whose window is not the whole ragged dim")
    neutral, mean = _WHOLE_POOLS[func]
    return Action((0,), neutral, (len(flags) - 1,) if mean else ())


# ---- losses over a ragged dim -------------------------------------------------------------
# A sequence's loss (``F.cross_entropy(logits, tokens[1:])``, ``F.mse_loss(y, target)``)
# with the tokens ragged: the per-entry losses of the padded batch (reduction "none"), the
# pads' inputs and targets set to harmless values first (a pad's target the ignored class)
# and their losses to zero, then summed per row and, for "mean", divided by the row's own
# count: its real, not ignored entries (weighted by their classes' weights where given).

_CLASS_LOSSES = frozenset({_F.cross_entropy, _F.nll_loss})
# elementwise losses and the value their pads get (a probability for binary cross entropy)
_ENTRY_LOSSES = {
    _F.mse_loss: 0.0, _F.l1_loss: 0.0, _F.smooth_l1_loss: 0.0, _F.huber_loss: 0.0,
    _F.binary_cross_entropy: 0.5, _F.binary_cross_entropy_with_logits: 0.0,
}  # fmt: skip


def _loss_action(inner, f_in: list) -> Action:
    func = inner.func
    try:
        bound = inspect.signature(func).bind(*inner.args, **(inner.kwargs or {}))
    except (TypeError, ValueError):
        raise Decline("a loss whose arguments do not bind") from None
    bound.apply_defaults()
    kw = dict(bound.arguments)
    x, target = kw.pop("input"), kw.pop("target")
    reduction = kw.get("reduction", "mean")
    if (
        type(x) is not LazyTensor
        or type(target) is not LazyTensor
        or reduction not in ("mean", "sum", "none")
        or kw.get("size_average") is not None
        or kw.get("reduce") is not None
        or any(type(v) is LazyTensor for v in kw.values())
    ):
        raise Decline("a loss with legacy, per-instance or unknown options")
    jx, jt = _where(inner, x), _where(inner, target)
    fx, ft = f_in[jx], f_in[jt]
    if func in _CLASS_LOSSES:
        if (
            x.ndim != 2
            or fx[1]
            or target.dtype.is_floating_point
            or ft != fx[:1]
        ):  # (label_smoothing: each row's loss is its own, reduced as the others)
            raise Decline("a class loss other than of (n, classes) scores and n classes")
        return Action((), "zero", run=_class_loss(func, kw, reduction, fx[0].offset, jx, jt))
    if func in _ENTRY_LOSSES:
        if fx != ft or x.shape != target.shape:
            raise Decline("an elementwise loss of operands ragged apart")
        return Action((), "zero", run=_entry_loss(func, kw, reduction, fx, jx, jt))
    raise Decline(f"{getattr(func, '__name__', func)} of a ragged value")


def _class_loss(func, kw: dict, reduction: str, offset: int, jx: int, jt: int):
    """The run of a class loss (scores and targets at operands ``jx``, ``jt``)."""
    ignore = kw.get("ignore_index", -100)
    weight = kw.get("weight")

    def run(inner, ins, lens, n):
        x, target = ins[jx], ins[jt]
        size = x.shape[1]
        real = torch.arange(size, device=x.device) < (lens + offset).view(n, 1)
        target = torch.where(real, target, ignore)  # (the scores' pads are not read)
        options = {**kw, "reduction": "none"}
        per = func(x.reshape(n * size, -1), target.reshape(-1), **options).view(n, size)
        per = torch.where(real, per, 0.0)
        if reduction == "none":
            return (per,)
        total = per.sum(1)
        if reduction == "sum":
            return (total,)
        counted = target != ignore
        if weight is None:
            return (total / counted.sum(1),)
        w = weight[torch.where(counted, target, 0)]
        return (total / torch.where(counted, w, 0.0).sum(1),)

    return run


def _entry_loss(func, kw: dict, reduction: str, flags: tuple, jx: int, jt: int):
    """The run of an elementwise loss (input and target at operands ``jx``, ``jt``)."""
    fill = _ENTRY_LOSSES[func]

    def run(inner, ins, lens, n):
        x, target = ins[jx], ins[jt]
        real = _mask({}, flags, x, lens)
        x, target = torch.where(real, x, fill), torch.where(real, target, fill)
        per = torch.where(real, func(x, target, **{**kw, "reduction": "none"}), 0.0)
        if reduction == "none":
            return (per,)
        dims = tuple(range(1, per.ndim))
        total = per.sum(dims)
        if reduction == "sum":
            return (total,)
        return (total / real.expand(per.shape).sum(dims),)

    return run


def _train_safe(inner, f_in: list, f_out: list) -> bool:
    """Whether the gradient of an operand that an elementwise op broadcasts over a ragged
    dim stays finite at the pads: its backward sums the op's local derivative over the
    pads, where the values are zero (``q / x``: 0 / 0 there, NaN in ``q``'s gradient)."""
    if inner.op.kind not in ("elementwise", "factory", "reduce") or not any(any(f) for f in f_out):
        return True
    fixed = [t for t, f in zip(inner.inputs, f_in) if not any(f)]
    fixed += [a for a in _tensors(inner.args) if type(a) is not LazyTensor and a.requires_grad]
    if not fixed:
        return True
    if inner.op.name in _LINEAR_IN_EACH:
        return True
    first = _arg(inner, 0, "input")
    return inner.op.name == "div" and all(t is not first for t in fixed)


# elementwise ops whose derivative in each operand is finite wherever the others are
_LINEAR_IN_EACH = frozenset(
    {"add", "sub", "mul", "where", "masked_fill", "maximum", "minimum", "max", "min", "neg",
     "clone", "contiguous", "detach", "to", "float", "double", "half", "type_as"}
)  # fmt: skip


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _attention_action(inner, f_in: list) -> Action | None:
    """``F.scaled_dot_product_attention``: ragged queries are rows
    (nothing to do); ragged keys and values are zeroed at their pads and the call gets a
    mask of the real keys (and-ed into a boolean ``attn_mask``, -inf in a float one); a
    causal call needs its queries and keys ragged alike (row i then reads keys up to i,
    all real)."""
    if inner.func is torch.nn.functional.multi_head_attention_forward:
        return _mha_action(inner, f_in)
    if inner.func is not torch.nn.functional.scaled_dot_product_attention:
        raise Decline(f"attention by {inner.func!r}")
    q, k, v = (_arg(inner, i, _SDPA[i]) for i in range(3))
    m = _arg(inner, 3, "attn_mask")
    if type(m) is LazyTensor and any(f_in[_where(inner, m)][:-2]):
        raise Decline("an attention mask ragged in a batch dim")
    if _arg(inner, 7, "enable_gqa", False):
        raise Decline("grouped-query attention")
    jq, jk, jv = (_where(inner, t) for t in (q, k, v))
    fq, fk, fv = ((f_in[j] if j >= 0 else None) for j in (jq, jk, jv))
    for f in (fq, fk, fv):
        if f is not None and any(f[:-2] + f[-1:]):
            raise Decline("attention ragged in a batch or feature dim")
    rows = bool(fq and fq[-2])
    keys = bool(fk and fk[-2]) or bool(fv and fv[-2])
    ragged = _ragged_inputs(f_in)
    if not keys:
        return None  # (ragged queries alone: rows)
    if fk is None or fv is None or not (fk[-2] and fv[-2]):
        raise Decline("attention with ragged keys but fixed values")
    if _arg(inner, 5, "is_causal", False):
        if not rows:
            raise Decline("causal attention with fixed queries over ragged keys")
        return Action(ragged, "zero")  # (row i reads keys up to i: all real)
    return Action(ragged, "zero", keys=jk)


# F.multi_head_attention_forward's arguments that must hold their defaults (position,
# name, default): no extra keys, no padding mask of its own, no static keys
_MHA_DEFAULTS = (
    (7, "bias_k", None), (8, "bias_v", None), (9, "add_zero_attn", False),
    (14, "key_padding_mask", None), (21, "static_k", None), (22, "static_v", None),
)  # fmt: skip


def _mha_action(inner, f_in: list) -> Action | None:
    """``nn.MultiheadAttention`` (``F.multi_head_attention_forward``) on one instance's
    unbatched ``(L, E)`` query and ``(S, E)`` keys and values, without masks: ragged keys
    run with a ``key_padding_mask`` of the pads (its batched form is sequence-first)."""
    for pos, name, default in _MHA_DEFAULTS:
        if _arg(inner, pos, name, default) is not default:
            raise Decline(f"multi-head attention with {name}")
    m = _arg(inner, 16, "attn_mask")
    if m is not None and (type(m) is LazyTensor or m.ndim != 2):
        raise Decline("multi-head attention with a per-instance or per-head mask")
    if m is None and _arg(inner, 24, "is_causal", False):
        raise Decline("multi-head attention causal without a mask")
    q, k, v = (_arg(inner, i, name) for i, name in enumerate(("query", "key", "value")))
    # one instance's (L, E) sequences, or a batch of one ((L, 1, E): the module given x[None])
    if not all(
        type(t) is LazyTensor and (t.ndim == 2 or (t.ndim == 3 and t.shape[1] == 1))
        and t.ndim == q.ndim
        for t in (q, k, v)
    ):  # fmt: skip
        raise Decline("multi-head attention of batched or real operands")
    fq, fk, fv = (f_in[_where(inner, t)] for t in (q, k, v))
    if any(any(f[1:]) for f in (fq, fk, fv)) or fk[0] != fv[0]:
        raise Decline("multi-head attention ragged in a feature dim")
    ragged = _ragged_inputs(f_in)
    return Action(ragged, "zero", keys=_where(inner, k)) if fk[0] else None


def _attention(inner, ins: list, key_mask: torch.Tensor, n: int) -> tuple:
    """A padded batch of scaled_dot_product_attention or multi-head attention, masked to
    the real keys."""
    if inner.func is torch.nn.functional.multi_head_attention_forward:
        one = ins[0].ndim == 4  # (n, L, 1, E): each instance a batch of one
        it = iter([(x[:, :, 0] if one else x).transpose(0, 1) for x in ins])  # (L, n, E)
        args = substitute(inner.args, it)
        kwargs = {k: substitute(v, it) for k, v in (inner.kwargs or {}).items()}
        pads = ~key_mask.flatten(2)[..., 0]  # (n, S): True at the keys to ignore
        given = _arg(inner, 16, "attn_mask")
        if given is not None and given.dtype.is_floating_point:  # (a mask of its type)
            pads = torch.zeros(pads.shape, dtype=given.dtype, device=pads.device).masked_fill(
                pads, -math.inf
            )
        if len(args) > 14:
            args = (*args[:14], pads, *args[15:])
        else:
            kwargs["key_padding_mask"] = pads
        out, weights = inner.func(*args, **kwargs)
        out = out.transpose(0, 1)
        if one:
            out = out.unsqueeze(2)
            weights = weights.unsqueeze(1) if weights is not None else None
        return (out, weights)
    it = iter(ins)
    parts = []
    for i in range(4):
        a = _arg(inner, i, _SDPA[i])
        if type(a) is LazyTensor:
            parts.append(next(it))
        elif i < 3:  # a real tensor (a learned query): the same for every row
            parts.append(a.expand(n, *a.shape))
        else:
            parts.append(a)
    q, k, v, given = parts
    mask = key_mask[..., 0].unsqueeze(-2)  # (n, ..., 1, keys): True at real keys
    if given is not None:
        if given.dtype == torch.bool:
            mask = given & mask
        else:
            mask = torch.where(mask, given, -math.inf)
    scale, p = _arg(inner, 6, "scale"), _arg(inner, 4, "dropout_p", 0.0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = sdpa(q, k, v, attn_mask=mask, dropout_p=p, scale=scale)
    return (out,)


def _sequences_action(inner, f_in: list) -> Action | None:
    """An ``nn.LSTM`` / ``GRU`` / ``RNN`` in the trace over one instance's unbatched
    ``(L, features)`` sequence, L ragged: the padded batch packed by its true lengths
    (``pack_padded_sequence``), so the final states are each sequence's own and the
    output's pads zero."""
    module, x = inner.args[0], inner.args[1]
    form = _sequence_form(module, x)  # (T, D), or a batch of one: (1, T, D) / (T, 1, D)
    if form is None:
        raise Decline("a sequence module over batched or real sequences")
    fx = f_in[_where(inner, x)]
    time = 1 if form == "batch_first" else 0
    if any(f for d, f in enumerate(fx) if d != time) or any(
        any(f) for t, f in zip(inner.inputs, f_in) if t is not x
    ):
        raise Decline("a sequence module with ragged features or states")
    if not fx[time]:
        return None
    offset = fx[time].offset

    def run(inner, ins, lens, n):
        return _sequences(inner, ins, lens + offset, n)

    return Action((), "zero", run=run)


def _pad_action(inner, f_in: list) -> Action | None:
    """``F.pad(x, pad, value=v)`` with constant padding along a ragged dim (a sentence's
    boundary positions before a convolution): the pads set to ``v`` first, so each row's
    own trailing padding is already in place after its real entries."""
    x, pad = _arg(inner, 0, "input"), _arg(inner, 1, "pad")
    if _where(inner, x) != 0 or len(inner.inputs) != 1 or not isinstance(pad, (tuple, list)):
        raise Decline("F.pad of other than one per-instance tensor")
    flags = f_in[0]
    dims = [len(flags) - 1 - k for k in range(len(pad) // 2)]  # (pairs from the last dim)
    if not any(flags[d] for d in dims if d >= 0):
        return None
    mode, value = _arg(inner, 2, "mode", "constant"), _arg(inner, 3, "value", None)
    if mode != "constant" or not all(type(p) is int and p >= 0 for p in pad):
        raise Decline("F.pad of a ragged dim other than by a constant")
    value = 0.0 if value is None else value

    def run(inner, ins, lens, n):
        x = ins[0]
        x = torch.where(_mask({}, flags, x, lens), x, value)
        return inner.op.rule(inner, [x], n)

    return Action((), "zero", run=run)


# op name -> its rule (inner, operand flags) -> Action | None, or Decline
_ACTIONS = {
    "attention": _attention_action, "sequence_batch": _sequences_action, "loss": _loss_action,
    "index_select": _gather_action, "conv": _conv_action, "pool": _pool_action,
    "pad": _pad_action,
}  # fmt: skip


def _sequences(inner, ins, lens, n):
    module, _, *states = inner.args
    rnn = torch.nn.utils.rnn
    X = ins[0]
    if X.ndim == 4:  # (a batch of one sequence each: (n, 1, T, D) or (n, T, 1, D))
        X = X.reshape(n, X.shape[2] if module.batch_first else X.shape[1], X.shape[-1])
    packed = rnn.pack_padded_sequence(X, lens.cpu(), batch_first=True, enforce_sorted=False)
    spec = tuple(None if type(h) is LazyTensor else h for h in states)
    out, state = _ORIGINAL_FORWARD[type(module)](module, packed, _batched_hx(spec, ins[1:], n))
    out, _ = rnn.pad_packed_sequence(out, batch_first=True, total_length=X.shape[1])
    finals = state if type(module) is torch.nn.LSTM else (state,)
    metas = inner.info.metas
    return (
        out.reshape(n, *metas[0][0]),
        *(s.transpose(0, 1).reshape(n, *m[0]) for s, m in zip(finals, metas[1:])),
    )


def _check_cat(inner, dim: int, f_in: list) -> None:
    """A cat along a ragged dim keeps the pads at the end only if its last part alone is
    ragged there (``cat([cls, x])``)."""
    parts = _arg(inner, 0, "tensors")
    flags = [f_in[_where(inner, t)] if type(t) is LazyTensor else None for t in parts]
    if flags[-1] is None or not flags[-1][dim]:
        raise Decline("a cat whose ragged part is not the last")
    if any(f is not None and f[dim] for f in flags[:-1]):
        raise Decline("a cat of two ragged parts")


_ORDERED = frozenset(
    {"cumsum", "cumprod", "cummax", "topk", "sort", "kthvalue", "tril", "triu", "outer",
     "norm", "normalize", "cosine_similarity", "flip", "roll"}
)  # fmt: skip


def _ordered_action(inner, name: str, j: int, f_in: list) -> Action | None:
    """Scans, orderings and norms along a dim. Along a fixed dim they read each row on
    its own (nothing to do). Along a ragged one: a cumulative op reads only entries
    before each (the pads come after: nothing to do); a sort, ``topk`` or ``kthvalue``
    gets the pads past every real entry (+inf ascending, -inf descending: the pads sort
    to the end, a stable sort keeping real infinities first); a p-norm gets zero pads."""
    if j != 0 or len(inner.inputs) > (2 if name in ("outer", "cosine_similarity") else 1):
        raise Decline(f"{name} of several ragged operands")
    flags = f_in[0]
    rank = len(flags)
    if name in ("tril", "triu", "outer"):
        return None  # (each entry from its own position)
    if name in ("flip", "roll"):  # (a ragged dim reversed or rotated would bring pads in)
        dims = _arg(inner, 1, "dims") if name == "flip" else _arg(inner, 2, "dims")
        if dims is None or any(flags[d] for d in _dims(dims, rank)):
            raise Decline(f"{name} along a ragged dim")
        return None
    if name in ("cumsum", "cumprod", "cummax"):
        _dims(_arg(inner, 1, "dim"), rank)
        return None
    if name == "sort":
        dim = _dims(_arg(inner, 1, "dim", -1), rank)[0]
        if not flags[dim]:
            return None
        descending = bool(_arg(inner, 2, "descending", False))
        indices_only = inner.func in (torch.argsort, torch.Tensor.argsort)
        run = _sorted(dim, descending, indices_only)
        return Action((0,), "low" if descending else "high", run=run)
    if name == "topk":
        dim = _dims(_arg(inner, 2, "dim", -1), rank)[0]
        return (
            Action((0,), "low" if _arg(inner, 3, "largest", True) else "high")
            if flags[dim]
            else None
        )
    if name == "kthvalue":
        if inner.func in (torch.median, torch.Tensor.median):
            dim = _arg(inner, 1, "dim")
            if dim is None or flags[_dims(dim, rank)[0]]:
                raise Decline("a median over a ragged dim")
            return None
        dim = _dims(_arg(inner, 2, "dim", -1), rank)[0]
        return Action((0,), "high") if flags[dim] else None
    # norm / normalize / cosine_similarity over dims
    if name == "norm":
        p = _arg(inner, 1, "p", _arg(inner, 1, "ord", 2))
        dim = _arg(inner, 2, "dim")
    elif name == "normalize":
        p, dim = _arg(inner, 1, "p", 2.0), _arg(inner, 2, "dim", 1)
    else:
        p, dim = 2, _arg(inner, 2, "dim", 1)
    reduced = list(range(rank)) if dim is None else _dims(dim, rank)
    if not any(flags[d] for d in reduced):
        return None
    if not (p == "fro" or (isinstance(p, (int, float)) and p >= 0)):
        raise Decline(f"{name} with p={p!r} over a ragged dim")  # (a zero pad counts)
    return Action(_ragged_inputs(f_in), "zero")


def _sorted(dim: int, descending: bool, indices_only: bool):
    def run(inner, ins, lens, n):
        values, indices = torch.sort(ins[0], dim=dim + 1, descending=descending, stable=True)
        return (indices,) if indices_only else (values, indices)

    return run


def _einsum_action(inner, f_in: list) -> Action | None:
    """``torch.einsum`` with an explicit output: a ragged label it sums over (one not in
    the output) gets zero pads in every ragged operand."""
    equation = inner.args[0]
    operands = inner.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if type(equation) is not str or "..." in equation or "->" not in equation:
        raise Decline("einsum without an explicit output")
    terms, out = equation.replace(" ", "").split("->")
    ragged_labels = set()
    for term, t in zip(terms.split(","), operands):
        if type(t) is not LazyTensor:
            continue
        flags = f_in[_where(inner, t)]
        if len(term) != len(flags) or len(set(term)) != len(term):
            raise Decline("einsum with a repeated label")
        ragged_labels |= {c for c, f in zip(term, flags) if f}
    if not ragged_labels - set(out):
        return None
    return Action(_ragged_inputs(f_in), "zero")


def _first_lazy(inner, tensors) -> int:
    for t in tensors:
        if type(t) is LazyTensor:
            return _where(inner, t)
    return -1


def _check_index(index, flags: tuple) -> tuple | None:
    """Decline an index that reads a ragged dim other than whole or at an index >= 0,
    except one that only takes a ragged dim at ``-k`` (``x[-1]``, ``x[:, -2]``): then
    (that dim, -k)."""
    parts = index if type(index) is tuple else (index,)
    ends = [(d, p) for d, p in enumerate(parts) if type(p) is int and p < 0 and d < len(flags)]
    if (
        len(ends) == 1
        and flags[ends[0][0]]
        and all(p == slice(None) for p in parts if not (type(p) is int and p < 0))
    ):
        return ends[0]
    if any(p is Ellipsis for p in parts):
        used = sum(1 for p in parts if p is not None and p is not Ellipsis)
        at = next(i for i, p in enumerate(parts) if p is Ellipsis)
        parts = parts[:at] + (slice(None),) * (len(flags) - used) + parts[at + 1 :]
    d = 0
    for p in parts:
        if p is None:
            continue
        if type(p) is int:
            if flags[d] and p < 0:
                raise Decline("a ragged dim indexed from its end")
        elif type(p) is slice:
            # a ragged dim whole, without a fixed prefix (x[k:]) or suffix (x[:-k],
            # x[k:-j]: sliced off the padded rows, the longest row loses its last j and
            # every other row's last j fall into its padding), or only its first k
            # entries (x[:k]; every member has them, or its shape would not fit)
            start, stop = p.start or 0, p.stop
            if flags[d] and not (
                p.step in (None, 1)
                and type(start) is int
                and start >= 0
                and (stop is None or (type(stop) is int and (stop < 0 or not start)))
            ):
                raise Decline("a ragged dim sliced from its end")
        else:
            raise Decline(f"index {p!r}")
        d += 1
    return None


def _from_end(dim: int, k: int):
    """The run of ``x[..., -k]`` along ragged ``dim``: each row's own n - k."""

    def run(inner, ins, lens, n):
        x = ins[0]
        shape = list(x.shape)
        shape[dim + 1] = 1
        at = (lens + k).clamp(min=0).view(n, *(1,) * (x.ndim - 1)).expand(shape)
        return (x.gather(dim + 1, at).squeeze(dim + 1),)

    return run


def _reduce_action(inner, name: str, j: int, f_in: list, f_out: list) -> Action | None:
    if j != 0:
        raise Decline(f"{name} of a ragged operand after the first")
    flags = f_in[0]
    rank = len(flags)
    dim = _arg(inner, 1, "dim")
    if name in ("softmax", "log_softmax"):
        if dim is None:
            raise Decline(f"{name} without a dim")
        reduced = _dims(dim, rank)
    elif type(dim) is LazyTensor or isinstance(dim, torch.Tensor):  # max(a, b): elementwise
        if _broadcasts_ragged(f_in, f_out[0]):
            raise Decline(name)
        return None
    elif dim is None or (isinstance(dim, (tuple, list)) and not dim):
        if name in ("argmax", "argmin") and rank != 1:  # (of one dim: an index there)
            raise Decline(f"{name} of the flattened value")  # an index into the padding
        reduced = list(range(rank))
    else:
        reduced = _dims(dim, rank)
    over = tuple(d for d in reduced if flags[d])
    if not over:
        return None
    if name not in NEUTRAL:
        raise Decline(name)
    return Action((0,), NEUTRAL[name], over if name == "mean" else ())


# ---- running ----------------------------------------------------------------------------


def volume(size) -> int:
    """A member's size as one number to order by: ``n``, or the product of its sizes
    apart."""
    return size if type(size) is not tuple else math.prod(size)


def _work(size, rank) -> int:
    """A member's work: ``n ** rank``; sizes apart, the sum over ``rank``'s terms of the
    product of each size to its exponent there (a term of plain ints: that product)."""
    if type(size) is not tuple:
        return size**rank
    if rank and type(rank[0]) is tuple:
        return sum(math.prod(n**e for n, e in zip(size, term)) for term in rank)
    return math.prod(n**r for n, r in zip(size, rank))


def chunks(sizes: list, rank) -> list:
    """``sizes`` (n, rows) of a batch's members, largest n first, cut into runs whose
    padded work (rows * n_max ** rank) stays within ``config.PAD_WASTE`` times the true
    work: lists of positions into ``sizes``. Sizes apart (tuples, ordered by
    :func:`volume`, ``rank`` per size): each run's first member is at least as large as
    every other of the run in every size (its program, its hoisted tensors, serve them
    all)."""
    if sizes and type(sizes[0][0]) is tuple:
        return _chunks_apart(sizes, rank)
    out: list = []
    run: list = []
    padded = true = 0
    top = 0
    for i, (n, rows) in enumerate(sizes):
        work = rows * n**rank
        if run and (padded + rows * top**rank) <= config.PAD_WASTE * (true + work):
            run.append(i)
            padded += rows * top**rank
            true += work
            continue
        if run:
            out.append(run)
        run, top, padded, true = [i], n, work, work
    out.append(run)
    return out


def _chunks_apart(sizes: list, rank: tuple) -> list:
    out: list = []
    left = list(range(len(sizes)))
    while left:
        top = sizes[left[0]][0]
        per_row = _work(top, rank)
        run = [left[0]]
        padded = true = sizes[left[0]][1] * per_row
        for i in left[1:]:
            size, rows = sizes[i]
            work = rows * _work(size, rank)
            if all(p <= q for p, q in zip(size, top)) and (
                padded + rows * per_row <= config.PAD_WASTE * (true + work)
            ):
                run.append(i)
                padded += rows * per_row
                true += work
        out.append(run)
        taken = set(run)
        left = [i for i in left if i not in taken]
    return out
