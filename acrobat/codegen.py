"""A traced block's program as one generated Python function.

``Trace.run_ops`` interprets a block's program: per op it looks operands up in an env
dict, builds a list and calls the op's batching rule, which re-parses the op's
arguments (which are lazy, which dims) on every batch. All of that is static per trace,
so it is decided once here and the program becomes straight-line Python that calls torch
directly — ``v2 = F_linear(v1, w2, b2)`` — about 1-2 µs less per op and batch (a
NestedRNN map runs ~15k block ops). Ops without an emitter here call their rule from
the generated code, so every program compiles; the source is kept on the function
(``run.source``) for debugging.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from acrobat import config, rows
from acrobat.graph import LazyTensor
from acrobat.ops import (
    BATCHED_FUNCS,
    LOOKUP_ROWS,
    JoinedLinear,
    StackedLinear,
    batched_addmm,
    batched_addmm_tanh,
    batched_linear,
    batched_linear_tanh,
    batched_lookup_linear,
    batched_tanh,
    cat_rule,
    elementwise_rule,
    linear_operands,
    linear_rule,
    matmul_rule,
    promotion,
    split_rule,
)


class _Emitter:
    def __init__(self):
        self.consts: dict = {"torch": torch}

    def const(self, name: str, value) -> str:
        self.consts[name] = value
        return name


def _operand(e: _Emitter, a, var: dict, name: str, n_dims=None):
    """Source for argument ``a``: its variable if lazy (reshaped to broadcast like the
    unbatched op when it has fewer dims than the output), else a constant."""
    if type(a) is LazyTensor:
        v = var[(id(a.node), a.idx)]
        k = len(a.shape)
        if n_dims is not None and k < n_dims:
            dims = ", ".join(["n"] + ["1"] * (n_dims - k) + [str(d) for d in a.shape])
            return f"{v}.reshape({dims})"
        return v
    if type(a) in (list, tuple) and any(type(x) is LazyTensor for x in a):
        return None  # nested operands: the rule's job
    return e.const(name, a)


def _emit_elementwise(e, nd, var, k):
    out_nd = len(nd.info.metas[0][0])
    pr = promotion(nd.func, nd.args, nd.kwargs)  # (0-dim operands cast as ops._promoted)
    cast, out, skip = pr if pr is not None else (None, None, None)
    to = f".to({e.const(f'dt{k}', cast)})" if cast is not None else ""

    def casted(src, a, at):  # (where's condition, positional or keyword, is left)
        keep = at == skip or at == "condition" or type(a) is not LazyTensor or a.shape
        return src if keep or not to else src + to

    parts = []
    for j, a in enumerate(nd.args):
        src = _operand(e, a, var, f"c{k}_{j}", out_nd)
        if src is None:
            return None
        parts.append(casted(src, a, j))
    for key, a in (nd.kwargs or {}).items():
        if key == "memory_format":  # (for the instance's rank: see ops.elementwise_rule)
            continue
        src = _operand(e, a, var, f"c{k}_{key}", out_nd)
        if src is None:
            return None
        parts.append(f"{key}={casted(src, a, key)}")
    func = BATCHED_FUNCS.get(nd.func, nd.func)
    call = f"{e.const(f'f{k}', func)}({', '.join(parts)})"
    return call if out is None else f"{call}.to({e.const(f'do{k}', out)})"


def _emit_linear(e, nd, var, k):
    operands = linear_operands(nd)
    if operands is None:
        return None
    x, w, bias = operands
    xv = var[(id(x.node), x.idx)]
    lin = e.const("linear", batched_linear)
    return f"{lin}({xv}, {e.const(f'w{k}', w)}, {e.const(f'b{k}', bias)})"


def _emit_cat(e, nd, var, k):
    if nd.op.name != "cat" or nd.kwargs or not nd.args:
        return None
    parts = nd.args[0]
    dim = nd.args[1] if len(nd.args) > 1 else 0
    if type(parts) not in (list, tuple) or not all(type(p) is LazyTensor for p in parts):
        return None
    if type(dim) is not int:
        return None
    nd_in = parts[0].ndim
    d = (dim + nd_in if dim < 0 else dim) + 1
    names = ", ".join(var[(id(p.node), p.idx)] for p in parts)
    return f"torch.cat([{names}], {d})"


def _emit_chunk(e, nd, var, k):
    if nd.op.name != "chunk" or nd.kwargs or len(nd.args) not in (2, 3):
        return None
    x, chunks = nd.args[0], nd.args[1]
    dim = nd.args[2] if len(nd.args) == 3 else 0
    if type(x) is not LazyTensor or type(chunks) is not int or type(dim) is not int:
        return None
    d = (dim + x.ndim if dim < 0 else dim) + 1
    out = f"{var[(id(x.node), x.idx)]}.chunk({chunks}, {d})"
    return out if len(nd.info.metas) == chunks else None  # torch may return fewer


_EMITTERS: dict[Callable, Callable] = {
    elementwise_rule: _emit_elementwise,
    linear_rule: _emit_linear,
    cat_rule: _emit_cat,
    split_rule: _emit_chunk,
}


EPILOGUES = True  # peepholes: linear(x, W) + y as addmm, W @ cat([A, B]) as bmm + baddbmm
TANH_EPILOGUES = True  # tanh(linear(...)) / tanh(addmm(...)) as one kernel call
_ADDS = (torch.add, torch.Tensor.add, torch.Tensor.__add__)


def _uses(nodes: list, outputs: list) -> dict[int, int]:
    """id(node) -> how many times the program reads it (an output counts twice: it is
    always materialized, so nothing may fuse it away)."""
    uses: dict[int, int] = {}
    for nd in nodes:
        for t in nd.inputs:
            uses[id(t.node)] = uses.get(id(t.node), 0) + 1
    for t in outputs:
        uses[id(t.node)] = uses.get(id(t.node), 0) + 2
    return uses


def _gemm_epilogues(nodes: list, uses: dict) -> dict:
    """``linear(x, W) + y`` with no bias, the linear read only by the add: the pair
    becomes one ``addmm(y, x, W.t())`` (the add rides on the GEMM). Returns the linear
    nodes so fused, by id (their values: filled in with their index while emitting)."""
    linears = {}
    for nd in nodes:
        if nd.op.rule is linear_rule and uses.get(id(nd)) == 1 and _plain_linear(nd):
            linears[id(nd)] = nd
    fused: dict = {}
    for nd in nodes:
        if nd.op.rule is not elementwise_rule or nd.func not in _ADDS or nd.kwargs:
            continue
        if len(nd.args) != 2 or not all(type(a) is LazyTensor for a in nd.args):
            continue
        a, b = nd.args
        if a.shape != b.shape or len(a.shape) != 1 or a.node is b.node:
            continue
        for t in (a, b):
            if id(t.node) in linears and id(t.node) not in fused:
                fused[id(t.node)] = None
                break
    return fused


def _plain_linear(nd) -> bool:
    """linear(x, W) of a per-instance vector x, a real 2-D W and no bias."""
    return _tensor_linear(nd, plain=True)


def _tanh_epilogues(nodes: list, uses: dict, into_add: dict, taken: set) -> dict:
    """``tanh(linear(x, W, b))`` and ``tanh(linear(x, W) + y)`` (an addmm epilogue), the
    product read only by the ``tanh``: the GEMM kernel applies the ``tanh`` to its rows
    (ops.batched_linear_tanh / batched_addmm_tanh). ``taken``: nodes other peepholes
    emit. Returns {id(tanh node): (kind, product node)}, kind "linear" or "addmm"."""
    by_id = {id(nd): nd for nd in nodes}
    found = {}
    for nd in nodes:
        if nd.op.rule is not elementwise_rule or BATCHED_FUNCS.get(nd.func) is not batched_tanh:
            continue
        if len(nd.args) != 1 or nd.kwargs or type(nd.args[0]) is not LazyTensor:
            continue
        src = by_id.get(id(nd.args[0].node))
        if src is None or uses.get(id(src)) != 1 or id(src) in taken or id(src) in into_add:
            continue
        if src.op.rule is linear_rule and _tensor_linear(src):
            found[id(nd)] = ("linear", src)
        elif src.op.rule is elementwise_rule and _fused_add(src, into_add):
            found[id(nd)] = ("addmm", src)
    return found


def _tensor_linear(nd, plain: bool = False) -> bool:
    """linear(x, W, b) of a per-instance x, a real 2-D W and a real bias or none (with
    ``plain``: a vector x and no bias)."""
    operands = linear_operands(nd)
    if operands is None:
        return False
    x, w, bias = operands
    if plain and (bias is not None or len(x.shape) != 1):
        return False
    if bias is not None and not isinstance(bias, torch.Tensor):
        return False
    return isinstance(w, torch.Tensor) and w.ndim == 2


def _fused_add(nd, into_add: dict) -> bool:
    """Whether the add ``nd`` is emitted as an addmm (one operand a fused linear)."""
    if nd.func not in _ADDS or len(nd.args) != 2 or nd.kwargs:
        return False
    return any(type(a) is LazyTensor and id(a.node) in into_add for a in nd.args)


def _emit_tanh_epilogue(e, kind, src, var, into_add, k):
    if kind == "linear":
        x, w, bias = linear_operands(src)
        fn = e.const("linear_tanh", batched_linear_tanh)
        xv = var[(id(x.node), x.idx)]
        return f"{fn}({xv}, {e.const(f'w{k}', w)}, {e.const(f'b{k}', bias)})"
    return _emit_addmm(e, src, var, into_add, batched_addmm_tanh, "addmm_tanh")


def _emit_addmm(e, nd, var, into_add, fn=batched_addmm, name="addmm"):
    if nd.func not in _ADDS or len(nd.args) != 2 or nd.kwargs:
        return None
    a, b = nd.args
    if type(a) is not LazyTensor or type(b) is not LazyTensor:
        return None
    for lin, other in ((a, b), (b, a)):
        k = into_add.get(id(lin.node))
        if k is not None:
            x, weight, _ = linear_operands(lin.node)
            w = e.const(f"w{k}", weight)
            y = var[(id(other.node), other.idx)]
            addmm = e.const(name, fn)
            return f"{addmm}({y}, {var[(id(x.node), x.idx)]}, {w})"
    return None


def _lookups_through_linear(nodes: list, uses: dict) -> dict:
    """``linear(cat([embedding(i, E), h]), W, b)`` (or ``cat([h, embedding(i, E)])``) of a
    per-instance index ``i`` into a real table ``E`` of at most ``LOOKUP_ROWS`` rows, each
    of the embedding and the cat read only by the next: the looked-up part's product
    ``E W_e^T + b`` is precomputed per table (ops.batched_lookup_linear), so each batch
    multiplies only ``h`` (a parser's action-history RNN: W_x a_t over 3 actions). Returns
    {id(linear node): (embedding node, cat node, position of the embedding in the cat)}."""
    by_id = {id(nd): nd for nd in nodes}
    found = {}
    for nd in nodes:
        if nd.op.rule is not linear_rule or not _tensor_linear(nd):
            continue
        x = linear_operands(nd)[0]
        if len(x.shape) != 1:
            continue
        cat = by_id.get(id(x.node))
        if cat is None or cat.op.name != "cat" or cat.kwargs or uses.get(id(cat)) != 1:
            continue
        parts = cat.args[0]
        dim = cat.args[1] if len(cat.args) > 1 else 0
        if type(parts) not in (list, tuple) or len(parts) != 2 or dim not in (0, -1):
            continue
        if not all(type(p) is LazyTensor and len(p.shape) == 1 for p in parts):
            continue
        for pos in (0, 1):
            emb = by_id.get(id(parts[pos].node))
            if emb is not None and _small_lookup(emb) and uses.get(id(emb)) == 1:
                found[id(nd)] = (emb, cat, pos)
                break
    return found


_EMBEDDING_OPTIONS = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")


def _embedding_options(nd) -> dict | None:
    """F.embedding's options of an ``embedding(i, E, ...)`` node by name, or None if its
    input and weight are not the first two positional arguments."""
    if nd.op.name != "embedding" or not 2 <= len(nd.args) <= 7:
        return None
    options = dict(zip(_EMBEDDING_OPTIONS, nd.args[2:]))
    for key, value in (nd.kwargs or {}).items():
        if key not in _EMBEDDING_OPTIONS or key in options:
            return None
        options[key] = value
    return options


def _small_lookup(nd) -> bool:
    """``embedding(i, E)`` of a per-instance scalar index into a real table of at most
    ``LOOKUP_ROWS`` rows, without max_norm (which writes the table)."""
    options = _embedding_options(nd)
    if options is None or options.get("max_norm") is not None:
        return False
    idx, table = nd.args[0], nd.args[1]
    if type(idx) is not LazyTensor or len(idx.shape) != 0 or type(table) is LazyTensor:
        return False
    return isinstance(table, torch.Tensor) and table.ndim == 2 and table.shape[0] <= LOOKUP_ROWS


def _emit_lookup_linear(e, nd, found, var, k):
    emb, cat, pos = found
    _, w, bias = linear_operands(nd)
    idx = emb.args[0]
    rest = cat.args[0][1 - pos]
    d = emb.args[1].shape[1]
    start, stop = (0, d) if pos == 0 else (w.shape[1] - d, w.shape[1])
    fn = e.const("lookup_linear", batched_lookup_linear)
    table = e.const(f"t{k}", emb.args[1])
    extra = e.const(f"a{k}", _embedding_options(emb))
    return (
        f"{fn}({var[(id(idx.node), idx.idx)]}, {table}, {e.const(f'w{k}', w)}, "
        f"{e.const(f'b{k}', bias)}, {start}, {stop}, {var[(id(rest.node), rest.idx)]}, {extra})"
    )


def _cat_dim0_parts(nd):
    """The parts of ``cat(parts, dim=0)`` of per-instance matrices with equal trailing
    dims, else None."""
    if nd.op.name != "cat" or not nd.args:
        return None
    parts = nd.args[0]
    dim = nd.args[1] if len(nd.args) > 1 else (nd.kwargs or {}).get("dim", 0)
    if set(nd.kwargs or ()) - {"dim"} or dim not in (0, -2):
        return None
    if type(parts) not in (list, tuple) or len(parts) < 2:
        return None
    if not all(type(p) is LazyTensor and len(p.shape) == 2 for p in parts):
        return None
    if len({p.shape[1] for p in parts}) != 1:
        return None
    return parts


def _matmuls_over_cat(nodes: list, uses: dict) -> dict:
    """``W @ cat([A, B], 0)`` with W real and 2-D, the cat read only by the matmul: the
    product is ``W[:, :a] @ A + W[:, a:] @ B`` (a bmm and a baddbmm), so the batch of
    concatenated matrices is never made (MV-RNN's ``W_M @ cat([A, B])``). Returns
    {id(matmul node): cat node}."""
    by_id = {id(nd): nd for nd in nodes}
    found = {}
    for nd in nodes:
        if nd.op.rule is not matmul_rule or nd.kwargs or len(nd.args) != 2:
            continue
        w, x = nd.args
        if not isinstance(w, torch.Tensor) or type(w) is LazyTensor or w.ndim != 2:
            continue
        if type(x) is not LazyTensor or x.idx != 0 or uses.get(id(x.node)) != 1:
            continue
        cat = by_id.get(id(x.node))
        if cat is not None and _cat_dim0_parts(cat) is not None:
            found[id(nd)] = cat
    return found


def _weight_slices(e, nd, cat, var, k) -> list:
    """``(W's column slice, its width, the part's variable)`` per part of ``W @ cat``; the
    slices are sliced per batch in the generated code (views made under the current grad
    mode)."""
    w = e.const(f"w{k}", nd.args[0])
    slices, start = [], 0
    for p in _cat_dim0_parts(cat):
        height = p.shape[0]
        slices.append((f"{w}[:, {start}:{start + height}]", height, var[(id(p.node), p.idx)]))
        start += height
    return slices


def _emit_matmul_over_cat(e, nd, cat, var, k):
    expr = None
    for wp, height, pv in _weight_slices(e, nd, cat, var, k):
        wp = f"{wp}.expand(n, {nd.args[0].shape[0]}, {height})"
        expr = f"torch.bmm({wp}, {pv})" if expr is None else f"torch.baddbmm({expr}, {wp}, {pv})"
    return expr


def _product_operands(nd):
    """``(x, y)`` of a matmul that ``rows.matmul`` can run: per-instance operands of 1 or
    2 dims or one real 2-D CPU tensor shared by all, not two vectors, not two shared,
    one float dtype; else None."""
    if nd.op.rule is not matmul_rule or nd.kwargs or len(nd.args) != 2:
        return None
    x, y = nd.args
    dims, dtypes = [], set()
    for a in (x, y):
        if type(a) is LazyTensor:
            dims.append(len(a.shape))
        elif isinstance(a, torch.Tensor) and a.ndim == 2 and a.device.type == "cpu":
            dims.append(0)  # shared
        else:
            return None
        dtypes.add(a.dtype)
    if dims == [1, 1] or dims == [0, 0] or (0 in dims and 1 in dims):
        return None  # (a shared matrix with a vector: one GEMM over the batch already)
    if len(dtypes) != 1 or dtypes.pop() not in (torch.float32, torch.float64):
        return None
    return x, y


def row_operands(placeholders: list, nodes: list, outputs: list, cat_of: dict) -> set:
    """Positions of the placeholders that only matrix products read (see acrobat/rows.py):
    the executor may pass them as ``rows.Rows``, their addresses, instead of gathering
    them. ``cat_of``: _matmuls_over_cat's finding (their cats' parts qualify too)."""
    if not rows.available():
        return set()
    readers: dict[int, bool] = {}  # id(placeholder) -> every reader so far is a product
    metas: dict[int, LazyTensor] = {}
    products = {id(cat) for cat in cat_of.values()}
    for mm in nodes:
        if id(mm) in cat_of and _product_operands(mm) is None:
            products.discard(id(cat_of[id(mm)]))
    for nd in nodes:
        ok = id(nd) in products or _product_operands(nd) is not None
        for t in nd.inputs:
            readers[id(t.node)] = readers.get(id(t.node), True) and ok
            metas[id(t.node)] = t
    for t in outputs:
        readers[id(t.node)] = False
    found = set()
    for i, ph in enumerate(placeholders):
        t = metas.get(id(ph))
        if t is None or not readers[id(ph)] or t.dtype not in (torch.float32, torch.float64):
            continue
        if len(t.shape) in (1, 2) and t.shape.numel() >= rows.MIN_NUMEL:
            found.add(i)
    return found


def joined_cats(placeholders: list, nodes: list, uses: dict) -> dict:
    """``{id(cat node): positions}`` for each ``cat([a, b, ...], -1)`` of per-instance
    vectors that are block inputs nothing else reads: the executor may gather them
    straight into their columns of one (n, total) buffer (executor._join), so the
    concatenation costs no second copy; the program then gets that buffer at the first
    position and None at the others. ``uses``: _uses of the program."""
    position: dict[int, int] = {}
    for i, ph in enumerate(placeholders):
        position.setdefault(id(ph), i)
    found: dict[int, tuple] = {}
    claimed: set[int] = set()
    for nd in nodes:
        if nd.op.name != "cat" or nd.op.rule is not cat_rule or nd.kwargs or not nd.args:
            continue
        parts = nd.args[0]
        if nd.args[1:] not in ((), (0,), (-1,)) or type(parts) not in (list, tuple):
            continue
        if len(parts) < 2 or not all(
            type(p) is LazyTensor and p.idx == 0 and id(p.node) in position and len(p.shape) == 1
            for p in parts
        ):
            continue
        ids = [id(p.node) for p in parts]
        if len(set(ids)) != len(ids) or claimed.intersection(ids):
            continue
        if any(uses.get(i) != 1 for i in ids) or len({p.dtype for p in parts}) != 1:
            continue
        found[id(nd)] = tuple(position[i] for i in ids)
        claimed.update(ids)
    return found


#: Largest concatenated weight (bytes) a joined linear may have. Up to 1 MiB (half this
#: CPU's L2) the one GEMM was faster or equal at every row count tried (121 x 512 -> 256
#: with its tanh 197 against 225 µs, 4 rows 15 against 48); at 2 MiB it gained nothing
#: (280 x 1024 -> 512: 1694 against 1752 µs, 121 rows 771 against 747).
JOINED_WEIGHT_MAX = 1 << 20


def joined_linears(placeholders: list, nodes: list, uses: dict, claimed: set) -> dict:
    """``{id(add node): (linear a, linear b, position a, position b)}`` for each
    ``linear(x, W_x[, b_x]) + linear(h, W_h[, b_h])`` whose inputs ``x`` and ``h`` are two
    block inputs (per-instance vectors of one dtype) that nothing else reads, each linear
    read only by the add: the executor gathers ``x`` and ``h`` as one buffer ``[x, h]``
    (executor._join) and the program runs one GEMM over it with the concatenated weights
    (ops.JoinedLinear), in place of two (the GEMM epilogue turns them into linear + addmm).
    ``claimed``: placeholder positions another join has (joined_cats)."""
    position: dict[int, int] = {}
    for i, ph in enumerate(placeholders):
        position.setdefault(id(ph), i)
    by_id = {id(nd): nd for nd in nodes}
    found: dict[int, tuple] = {}
    taken = set(claimed)
    for nd in nodes:
        if nd.op.rule is not elementwise_rule or nd.func not in _ADDS or nd.kwargs:
            continue
        if len(nd.args) != 2 or not all(type(a) is LazyTensor for a in nd.args):
            continue
        lins = [by_id.get(id(a.node)) for a in nd.args]
        if any(lin is None or lin.op.rule is not linear_rule for lin in lins):
            continue
        if lins[0] is lins[1] or any(uses.get(id(lin)) != 1 for lin in lins):
            continue
        if not all(_tensor_linear(lin) for lin in lins):
            continue
        (x, wx, bx), (h, wh, bh) = (linear_operands(lin) for lin in lins)
        if x.idx or h.idx or id(x.node) not in position or id(h.node) not in position:
            continue
        px, ph = position[id(x.node)], position[id(h.node)]
        if px == ph or px in taken or ph in taken:
            continue
        if uses.get(id(x.node)) != 1 or uses.get(id(h.node)) != 1:
            continue
        if len(x.shape) != 1 or len(h.shape) != 1 or x.dtype != h.dtype:
            continue
        tensors = [t for t in (wx, wh, bx, bh) if t is not None]
        if len({(t.dtype, t.device) for t in tensors}) != 1 or wx.shape[0] != wh.shape[0]:
            continue
        if (wx.numel() + wh.numel()) * wx.element_size() > JOINED_WEIGHT_MAX:
            continue
        found[id(nd)] = (lins[0], lins[1], px, ph)
        taken.update((px, ph))
    return found


def _emit_joined(e, pair, k, tanh: bool) -> str:
    """The one GEMM of a joined pair over the buffer at its first position."""
    a, b, pa, _ = pair
    (_, wx, bx), (_, wh, bh) = linear_operands(a), linear_operands(b)
    weights = e.const(f"jw{k}", JoinedLinear((wx, wh), (bx, bh)))
    fn = e.const("linear_tanh", batched_linear_tanh) if tanh else e.const("linear", batched_linear)
    return f"{fn}(p{pa}, *{weights}())"


STACK_MAX = 8  # most layers in one stacked GEMM (bounded, as Dali bounds fusion groups)


def stacked_linears(nodes: list, outputs: list) -> list[list]:
    """Groups of 2 to ``STACK_MAX`` linear nodes of real 2-D weights of one dtype that read
    the same per-instance value (a textbook LSTM cell's per-gate ``W_i x``, ``W_f x``, ...):
    each group is one GEMM over the stacked weights (ops.StackedLinear), in program order.
    Stacked, 4 x (121 x 256 -> 256) took 387 against 402 µs; 4 x (8 x 256 -> 256) 42
    against 64; 4 x (280 x 512 -> 512) 3186 against 3275."""
    groups: dict = {}
    for nd in nodes:
        if nd.op.rule is not linear_rule or not _tensor_linear(nd):
            continue
        x, w, _ = linear_operands(nd)
        key = (id(x.node), x.idx, w.dtype, w.device)
        group = groups.setdefault(key, [[]])
        if len(group[-1]) == STACK_MAX:
            group.append([])
        group[-1].append(nd)
    return [g for parts in groups.values() for g in parts if len(g) >= 2]


def _emit_stacked(e, group, var, outputs, k) -> str:
    x = linear_operands(group[0])[0]
    leaving = {id(t.node) for t in outputs}
    stack = StackedLinear(
        tuple(linear_operands(nd)[1] for nd in group),
        tuple(linear_operands(nd)[2] for nd in group),
        tuple(id(nd) in leaving for nd in group),
    )
    return f"{e.const(f'stk{k}', stack)}({var[(id(x.node), x.idx)]})"


def _if_usable(e, fast: str, slow: str, operands, var) -> str:
    """``fast`` (products over addresses) where rows.usable says so at run time."""
    names = ", ".join(dict.fromkeys(var[(id(t.node), t.idx)] for t in operands))
    return f"{fast} if {e.const('rows_usable', rows.usable)}({names}) else {slow}"


def _emit_row_product(e, nd, var, k):
    x, y = _product_operands(nd)
    args = []
    for j, a in enumerate((x, y)):
        if type(a) is LazyTensor:
            args += [var[(id(a.node), a.idx)], "False"]
        else:
            args += [e.const(f"w{k}_{j}", a), "True"]
    return f"{e.const('rows_matmul', rows.matmul)}({', '.join(args)}, n)"


def _emit_row_products_over_cat(e, nd, cat, var, k):
    terms = [f"({wp}, True, {pv}, False)" for wp, _, pv in _weight_slices(e, nd, cat, var, k)]
    return f"{e.const('rows_matmul_sum', rows.matmul_sum)}([{', '.join(terms)}], n)"


def _read_by(plan) -> set:
    """ids of the nodes the members of a fused region read."""
    return {id(t.node) for nd in plan.members for t in nd.inputs}


def _emit_region(e: _Emitter, plan, make_and_fallback, var: dict, chunked: dict, lines: list):
    """``plan``'s members as one call of the fused kernel; its outputs get their
    variables (``(n, *shape)`` views of the kernel's ``(n, F)`` outputs). Inputs that
    are chunks of one batched matrix (a GEMM's gates) are passed as that matrix once,
    each read from its columns."""
    make_call, fallback = make_and_fallback
    args: list[str] = []
    layout = []
    for t in plan.inputs:
        source = chunked.get(id(t.node))
        if source is None:
            name, offset = var[(id(t.node), t.idx)], None
        else:
            name, offset = source[0], t.idx * source[1]
        if name not in args:
            args.append(name)
        layout.append((args.index(name), offset))
    call = make_call(tuple(layout))
    lines.append(f"    region = {e.const('fused_call', call)}(n, {', '.join(args)})")
    lines.append("    if region is None:")
    lines.append(f"        return {e.const('unfused', fallback)}(xs, n)")
    for m, nd in enumerate(plan.outputs):
        view = f"region[{m}]"
        if len(plan.shape) != 1:
            view += f".view(n, {', '.join(str(d) for d in plan.shape)})"
        var[(id(nd), 0)] = view


def _chunk_source(nd, var: dict):
    """(variable, columns per chunk) of a ``chunk`` node emitted by :func:`_emit_chunk`
    over a batch of vectors: its outputs are column ranges of that matrix."""
    x, chunks = nd.args[0], nd.args[1]
    if len(x.shape) != 1:
        return None
    return var[(id(x.node), x.idx)], -(-x.shape[0] // chunks)


def compile_program(
    placeholders: list, nodes: list, outputs: list, name: str, fused=None
) -> Callable:
    """``run(xs, n) -> tuple of outputs`` for a block program (see the module doc).

    ``fused``: ``(plan, make_call, fallback)``, the program's elementwise region
    (fusion.Plan) run as one kernel call, ``outs = call(n, *args)`` with ``call =
    make_call(layout)`` (``acrobat_kernels.elementwise.cpu_caller``'s): the nodes before
    the region, the call, then the nodes after it. Where ``call`` declines (None),
    ``fallback(xs, n)`` runs the whole program op by op instead."""
    e = _Emitter()
    var: dict = {}
    lines = ["def run(xs, n):"]
    for i, ph in enumerate(placeholders):
        if (id(ph), 0) not in var:
            var[(id(ph), 0)] = f"p{i}"
            lines.append(f"    p{i} = xs[{i}]")
    order = nodes
    members: set = set()
    read_outside: set = set()  # nodes read by a non-member or returned
    if fused is not None:
        plan, region_call = fused[0], fused[1:]
        members = {id(nd) for nd in plan.members}
        order = [*plan.before, None, *plan.after]  # None: where the region's call goes
        read_outside = {id(t.node) for nd in nodes if id(nd) not in members for t in nd.inputs}
        read_outside |= {id(t.node) for t in outputs}
    uses = _uses(nodes, outputs)
    stacks = stacked_linears(nodes, outputs) if config.STACK_LINEARS else []
    stacked = {id(nd): (group, j) for group in stacks for j, nd in enumerate(group)}
    into_add = _gemm_epilogues(nodes, uses) if EPILOGUES else {}
    into_add = {key: v for key, v in into_add.items() if key not in stacked}
    if members:  # (a product added by a member of the region is the region's input)
        region_reads = _read_by(plan)
        into_add = {key: v for key, v in into_add.items() if key not in region_reads}
    cat_of = _matmuls_over_cat(nodes, uses) if EPILOGUES else {}
    split_cats = {id(cat) for cat in cat_of.values()}
    lookups = _lookups_through_linear(nodes, uses) if EPILOGUES else {}
    lookups = {key: v for key, v in lookups.items() if key not in stacked}
    for key in [key for key in lookups if key in into_add]:
        del lookups[key]  # (an addmm epilogue has it already)
    folded = {id(n) for emb, cat, _ in lookups.values() for n in (emb, cat)}
    taken = folded | set(lookups) | set(cat_of) | split_cats | set(stacked)
    squash = _tanh_epilogues(nodes, uses, into_add, taken) if TANH_EPILOGUES and EPILOGUES else {}
    squash = {key: v for key, v in squash.items() if key not in members}
    folded |= {id(src) for _, src in squash.values()}
    in_place = row_operands(placeholders, nodes, outputs, cat_of)
    row_nodes = {id(placeholders[i]) for i in in_place}
    joins = joined_cats(placeholders, nodes, uses)
    claimed = {i for group in joins.values() for i in group}
    pairs = joined_linears(placeholders, nodes, uses, claimed) if config.JOIN_LINEARS else {}
    # each linear of a pair runs only when its inputs came apart (the else branch)
    pair_of = {id(lin): pair for pair in pairs.values() for lin in pair[:2]}
    for add, pair in pairs.items():
        if add in members:  # the region reads both products: given the joined buffer
            # (the executor joins for the op-by-op program), the program runs op by op
            lines.append(f"    if p{pair[3]} is None:")
            lines.append(f"        return {e.const('unfused', fused[2])}(xs, n)")
    stack_var: dict = {}  # id(group's first node) -> the variable holding its results
    chunked: dict = {}  # id(chunk node) -> (its matrix's variable, columns per chunk)
    for k, nd in enumerate(order):
        if nd is None:  # the fused region: one kernel call
            _emit_region(e, plan, region_call, var, chunked, lines)
            continue
        if id(nd) in stacked:  # one GEMM for the group, at its first member
            group, j = stacked[id(nd)]
            if j == 0:
                stack_var[id(group[0])] = f"s{k}"
                lines.append(f"    s{k} = {_emit_stacked(e, group, var, outputs, k)}")
            var[(id(nd), 0)] = f"{stack_var[id(group[0])]}[{j}]"
            continue
        if id(nd) in into_add:  # emitted by its consumer, as torch.addmm
            into_add[id(nd)] = k
            continue
        if id(nd) in split_cats or id(nd) in folded:  # emitted by their consumer
            continue
        emit = _EMITTERS.get(nd.op.rule)
        expr = None
        if id(nd) in joins:  # gathered joined by the executor, where it could
            first, second = (f"p{i}" for i in joins[id(nd)][:2])
            expr = f"{first} if {second} is None else {_emit_cat(e, nd, var, k)}"
        elif id(nd) in cat_of:
            expr = _emit_matmul_over_cat(e, nd, cat_of[id(nd)], var, k)
            parts = _cat_dim0_parts(cat_of[id(nd)])
            if any(id(p.node) in row_nodes for p in parts):
                fast = _emit_row_products_over_cat(e, nd, cat_of[id(nd)], var, k)
                expr = _if_usable(e, fast, expr, parts, var)
        elif any(id(t.node) in row_nodes for t in nd.inputs):  # a product (row_operands)
            rule = e.const(f"rule{k}", nd.op.rule)
            ins = ", ".join(var[(id(t.node), t.idx)] for t in nd.inputs)
            slow = f"{rule}({e.const(f'node{k}', nd)}, [{ins}], n)[0]"
            expr = _if_usable(e, _emit_row_product(e, nd, var, k), slow, nd.inputs, var)
        if id(nd) in lookups:
            expr = _emit_lookup_linear(e, nd, lookups[id(nd)], var, k)
        if id(nd) in squash:
            kind, src = squash[id(nd)]
            expr = _emit_tanh_epilogue(e, kind, src, var, into_add, k)
        if expr is None and nd.op.rule is elementwise_rule and into_add:
            expr = _emit_addmm(e, nd, var, into_add)
        if expr is None and emit is not None:
            expr = emit(e, nd, var, k)
            if emit is _emit_chunk and expr is not None and members:
                source = _chunk_source(nd, var)
                if source is not None:
                    chunked[id(nd)] = source
                    if id(nd) not in read_outside:  # the region reads it by columns only
                        continue
        src = squash[id(nd)][1] if id(nd) in squash else nd  # (a tanh: its sum's pair)
        joined = pairs.get(id(src))
        if joined is not None and expr is not None:  # one GEMM where the inputs are joined
            fused = _emit_joined(e, joined, k, tanh=src is not nd)
            expr = f"{fused} if p{joined[3]} is None else {expr}"
        single = nd.info.single
        if expr is None:  # the op's own rule, called from the generated code
            rule = e.const(f"rule{k}", nd.op.rule)
            node = e.const(f"node{k}", nd)
            ins = ", ".join(var[(id(t.node), t.idx)] for t in nd.inputs)
            expr = f"{rule}({node}, [{ins}], n)"
            single = False  # rules return tuples
        pair = pair_of.get(id(nd))
        if pair is not None:
            expr = f"({expr}) if p{pair[3]} is not None else None"
        lines.append(f"    v{k} = {expr}")
        for j in range(len(nd.info.metas)):
            var[(id(nd), j)] = f"v{k}" if single else f"v{k}[{j}]"
    outs = "".join(f"{var[(id(t.node), t.idx)]}, " for t in outputs)
    lines.append(f"    return ({outs})")
    source = "\n".join(lines) + "\n"
    exec(compile(source, f"<acrobat {name}>", "exec"), e.consts)
    run = e.consts.pop("run")  # (left in its own globals, a reference cycle)
    run.source = source
    run.row_args = frozenset(in_place)  # placeholders the executor may pass as rows.Rows
    run.joins = (*joins.values(), *((pa, pb) for _, _, pa, pb in pairs.values()))
    # (placeholders it may gather as one buffer)
    return run
