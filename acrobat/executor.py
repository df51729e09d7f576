"""Runs batches. A batch's outputs are consecutive rows of one tensor per output, so a
consumer whose operands are consecutive rows of one producer batch reads a view; any other
operand is collected with one gather (``index_select``, or a ``cat`` of per-source
``index_select``s when the rows come from several producer batches).

Nothing is written in place into a tensor autograd may need: gathers make new tensors,
outputs are fresh results of the batched ops, so gradients flow through a batched run the
way they flow through the eager loop.
"""

from __future__ import annotations

import itertools
import sys
import time
from array import array

import torch

from acrobat import config, padding
from acrobat.errors import AcrobatError, InstanceIndexError, UnsupportedOpError
from acrobat.fusion import reads_in_place
from acrobat.graph import LazyTensor, grad_tag
from acrobat.ops import (
    DATA_OPS,
    NEUTRAL,
    PICK,
    ROW_VIEWS,
    TAKE,
    TENSOR,
    keeps_operands,
    neutral_value,
    picks,
    ragged_picks,
    ragged_put_rule,
    reshape_rule,
    whole_padded,
    whole_rows,
    whole_rule,
)
from acrobat.rows import rows_of
from acrobat.scan import looping
from acrobat.tensor import _native, index_array, index_tensor
from acrobat_kernels import cuda_gather
from acrobat_kernels.gather import gather_rows

# Where a computed value lives, as one int per (node, output): the batch's number, the
# output's index and the node's row, ``batch << 44 | idx << 24 | row``. A column of
# operands becomes a list of ints, and whether it is one source, a range of rows or
# scattered is answered by min/max and list comparisons in C instead of a Python loop
# over the operands.
_ROW_BITS = 24
_IDX_SHIFT = 24
_BATCH_SHIFT = 44
_ROW_MASK = (1 << _ROW_BITS) - 1
_batches = itertools.count(1)


def reset_slots() -> None:
    """Restart batch numbering (each map: keeps the slot ints small)."""
    global _batches
    _batches = itertools.count(1)
    _bases.clear()
    _cuda_bases.clear()
    _reused.clear()


# The address of row 0 of each (batch, output) a fast gather has read, keyed like a slot
# without its row (``slot >> _ROW_BITS``); None for a source torch must read (not a
# contiguous CPU tensor). Batch numbers are unique within a map and an entry is only read
# while a LazyTensor of that batch, and so its buffer, is alive.
_bases: dict[int, int | None] = {}
_cuda_bases: dict[int, int | None] = {}  # the same for GPU tensors (never read in C)
_CPU = torch.device("cpu")


def constant(rt, value: torch.Tensor):
    """A LazyTensor of a real tensor that every instance shares (a hoisted ``torch.zeros``),
    as a node computed already: a batch reads it as the same row for every instance. A
    loop whose state starts at such a constant then runs its first step with the others
    instead of alone (analysis.ScanBlock)."""
    hit = rt.constants.get(id(value))
    if hit is not None:  # every instance after the first
        return hit
    from acrobat.graph import Info, Node
    from acrobat.ops import INPUT

    with torch._C.DisableTorchFunction():  # (attribute reads dispatch to the mode)
        shape, dtype = value.shape, value.dtype
        outs = (value.unsqueeze(0),)
    info = Info(((shape, dtype),), True, None)
    node = Node(INPUT, None, (), None, [], info, None, 0, 0, -1, rt)
    node.outs = outs
    # made between flushes: value reads cache a flush's outputs by id (rt.py_rows), and
    # this tensor may have the id of one freed since, whose cached rows it would be served
    rt.py_rows.pop(id(outs[0]), None)
    node.row = 0
    node.slot = next(_batches) << _BATCH_SHIFT
    rt.constants[id(value)] = out = LazyTensor(node, 0, shape, dtype, info.keys[0])
    return out


def _slots(ts: list) -> list:
    """Where each computed LazyTensor of ``ts`` lives, as one int (see above)."""
    return [t.node.slot + (t.idx << _IDX_SHIFT) for t in ts]


# The last gather of each operand column, ``(op, operand) -> (slots, tensor)``, for the
# duration of one flush: a column that reads the same rows as last time reuses the copy.
# A loop's hoisted part (NestedRNN's ``W x`` of every inner step) is read with the same
# rows at every step until an instance leaves the loop. Batched rules never
# write into their operands (views of producer outputs are shared the same way).
_reused: dict = {}


def gather(ts: list, n: int, stats, column=None, slots=None) -> torch.Tensor:
    """Stack the values of LazyTensors ``ts`` (all computed) along a new leading dim;
    ``column`` (hashable) names the operand column for reusing the previous gather;
    ``slots``: ``_slots(ts)`` if the caller has it."""
    if slots is None:
        slots = _slots(ts)
    lo = slots[0]
    hi = slots[-1]
    if hi - lo == n - 1 and slots == list(range(lo, hi + 1)):  # consecutive rows
        t0 = ts[0]
        buf = t0.node.outs[t0.idx]
        r0 = lo & _ROW_MASK
        if r0 == 0 and buf.shape[0] == n:
            return buf
        return buf[r0 : r0 + n]
    if column is not None:
        last = _reused.get(column)  # (a copy made in the other grad mode differs: a no_grad
        if last is not None and last[0] == slots and last[2] == torch.is_grad_enabled():
            return last[1]  # region's copy has no autograd history)
    out = None
    if _native is not None and config.FAST_GATHER and not torch.is_grad_enabled():
        t0 = ts[0]
        if n * t0.shape.numel() * t0.dtype.itemsize >= SPAN_VIEW_BYTES:
            out = _span_view(ts, slots, n)
            if out is not None:
                return out
        # the C copy of the rows by address, from one source or several (rows of one
        # source too: it takes the addresses from the slots directly, where numba's
        # address list cost more than index_select saved. NestedRNN small b64 gather
        # 59.8 -> 55.8 ms, large 159 -> 136, TreeLSTM/MV-RNN/BiRNN within noise,
        # in-process alternation, 1 thread)
        out = _native_copy(ts, slots)
        if out is not None:
            stats.gathers += 1
            stats.gather_bytes += out.nbytes
    if out is None:
        out = _copy_rows(ts, slots, n, stats)
    if column is not None:
        _reused[column] = (slots, out, torch.is_grad_enabled())
    return out


def _copy_rows(ts: list, slots: list, n: int, stats) -> torch.Tensor:
    """``gather`` of rows that are not consecutive rows of one producer batch, where the
    C copy did not take them (not built, autograd on, a source torch must read)."""
    lo, hi = min(slots), max(slots)
    one_source = lo >> _ROW_BITS == hi >> _ROW_BITS
    out = None
    if (
        _native is None
        and config.FAST_GATHER
        and not torch.is_grad_enabled()
        and not one_source  # (one source: index_select, faster than numba's addresses)
    ):
        out = _fast_gather(ts, slots)
        stats.gathers += out is not None
    if out is None and not one_source and _cuda_gather_ok(ts[0]):
        out = _cuda_gather(ts, slots)
        stats.gathers += out is not None
    if out is None and one_source:  # rows in any order
        t0 = ts[0]
        buf = t0.node.outs[t0.idx]
        base = lo & ~_ROW_MASK
        index = index_tensor([s - base for s in slots], buf.device)
        out = buf.index_select(0, index)
        stats.gathers += 1
    elif out is None:
        out = _gather_sources(ts, slots, n, stats)
    stats.gather_bytes += out.numel() * out.element_size()
    return out


def _fast_gather(ts: list, slots: list) -> torch.Tensor | None:
    """Rows from several producer batches, each copied from its address, in one numba
    kernel call (config.FAST_GATHER, without the C extension: with it, _native_copy);
    None if a source is not a contiguous CPU tensor."""
    addresses = _row_addresses(ts, slots, _bases, _CPU)
    if addresses is None:
        return None
    t0 = ts[0]
    return gather_rows(addresses, t0.shape, t0.dtype, t0.shape.numel() * t0.dtype.itemsize)


def _row_addresses(ts: list, slots: list, bases: dict, device: torch.device) -> array | None:
    """The address of every row of ``slots`` (its batch's row 0, from ``bases``, plus the
    row's offset), sources read for the first time entered in ``bases``; None if a
    source is not a contiguous tensor of such rows on ``device``."""
    t0 = ts[0]
    shape, dtype = t0.shape, t0.dtype
    nbytes = shape.numel() * dtype.itemsize
    try:
        return array("q", [bases[s >> _ROW_BITS] + (s & _ROW_MASK) * nbytes for s in slots])
    except KeyError:  # a source read for the first time
        _note_bases(ts, slots, shape, dtype, bases, device)
        return _row_addresses(ts, slots, bases, device)
    except TypeError:  # a source torch must read (None + int)
        return None


def _cuda_gather_ok(t0) -> bool:
    """Whether a gather's rows may be copied by the CUDA kernel of acrobat_kernels.cuda_gather
    (a GPU map, no autograd, cupy present: checked once per process)."""
    global _CUDA_GATHER
    if not config.CUDA_GATHER or t0.node.outs[t0.idx].is_cpu or torch.is_grad_enabled():
        return False
    if _CUDA_GATHER is None:
        _CUDA_GATHER = cuda_gather.available()
    return _CUDA_GATHER


_CUDA_GATHER: bool | None = None


def _cuda_gather(ts: list, slots: list) -> torch.Tensor | None:
    """Rows from several producer batches on a GPU in one kernel, each read from its
    device address (``_cuda_bases``, kept apart from the C copy's ``_bases``); None if a
    source is not a contiguous tensor of such rows (then torch gathers)."""
    t0 = ts[0]
    device = t0.node.outs[t0.idx].device  # (every source on it: one kernel reads them all)
    addresses = _row_addresses(ts, slots, _cuda_bases, device)
    if addresses is None:
        return None
    shape, dtype = t0.shape, t0.dtype
    nbytes = shape.numel() * dtype.itemsize
    return cuda_gather.gather_rows(index_array(addresses, device), shape, dtype, nbytes)


#: Fewest bytes of rows from several producer outputs for which a gather first asks
#: whether they lie back to back in one buffer (``_span_view``); below, copying them
#: costs about as much as the question and the view.
SPAN_VIEW_BYTES = 1 << 15


def _span_view(ts: list, slots: list, n: int) -> torch.Tensor | None:
    """The rows of ``slots`` as a view, where they lie back to back in the buffer of the
    first one's source (a loop's per-step outputs, views of one buffer, read step-major
    in the order the loop wrote them: a BiRNN's states read by its output layer), else
    None. Batched rules never write into their operands, so sharing is safe, as for the
    consecutive rows of one output."""
    t0 = ts[0]
    shape, dtype = t0.shape, t0.dtype
    nbytes = shape.numel() * dtype.itemsize
    if type(ts) is not list:
        ts = list(ts)
    first = _native.rows_span(slots, _bases, nbytes, ts, shape, dtype)
    if not first:
        return None
    buf = t0.node.outs[t0.idx]
    storage = buf.untyped_storage()
    start = first - storage.data_ptr()
    if start < 0 or start + n * nbytes > storage.nbytes() or start % dtype.itemsize:
        return None  # (rows of buffers that merely lie side by side)
    size = (n, *shape)
    strides = [1] * len(size)
    for d in range(len(size) - 2, -1, -1):
        strides[d] = strides[d + 1] * size[d + 1]
    return buf.as_strided(size, strides, start // dtype.itemsize)


def _native_copy(ts: list, slots: list) -> torch.Tensor | None:
    """The rows of ``slots`` copied by the C extension from their addresses (new sources
    entered in ``_bases``) in one call; None if a source is one torch must read."""
    t0 = ts[0]
    if not t0.node.outs[t0.idx].is_cpu:  # (a GPU map: torch gathers, no host buffer)
        return None
    shape, dtype = t0.shape, t0.dtype
    # (sizes as separate ints: a tuple is first tried as an int by torch's argument
    # parser, which raises and swallows a TypeError: +0.33 µs a call)
    out = torch.empty(len(slots), *shape, dtype=dtype, device=_CPU)  # (copied by address)
    if type(ts) is not list:
        ts = list(ts)
    nbytes = shape.numel() * dtype.itemsize
    done = _native.copy_rows(out.data_ptr(), slots, _bases, nbytes, ts, shape, dtype)
    return out if done else None


def _note_bases(ts: list, slots: list, shape: torch.Size, dtype: torch.dtype,
                bases: dict = _bases, device: torch.device = _CPU) -> None:
    """Enter the sources of ``slots`` missing from ``bases``: row 0's address, or None
    where a byte copy would not read the rows (not a contiguous tensor of them on
    ``device``)."""
    for key, t in {s >> _ROW_BITS: t for s, t in zip(slots, ts)}.items():
        if key not in bases:
            buf = t.node.outs[t.idx]
            readable = buf.device == device and buf.is_contiguous()
            if readable and buf.dtype == dtype and buf.shape[1:] == shape:
                bases[key] = buf.data_ptr()
            else:
                bases[key] = None


_ROW_VIEWS = 3  # a sparse source with at most this many rows is read as row views
_HOLE_BYTES = 1 << 16  # a source's covering range is copied if its unused rows are fewer
# than its used ones and at most this many bytes (vectors: yes; word matrices: no)


def _gather_sources(ts: list, slots: list, n: int, stats) -> torch.Tensor:
    """Rows from several producer batches, in 2 + (sparse sources) ops whatever their
    number: a source whose rows are dense (the previous step of most instances) gives
    its covering row range as a view, a sparse one (a parser's stack tops, spread over
    earlier decisions) an index_select of its rows (or row views, for a few rows: a
    tree generator's nodes come from many batches); one cat joins the parts and one
    index_select puts the rows in order (skipped when they already are)."""
    keys = [s >> _ROW_BITS for s in slots]
    t0 = ts[0]
    device = t0.node.outs[t0.idx].device
    parts = []
    shift: dict[int, int | None] = {}
    counter: dict[int, int] = {}  # sparse source -> position of its next row in the cat
    total = 0
    sparse = 0
    for key in dict.fromkeys(keys):  # the sources, in order of first use
        rows = [s & _ROW_MASK for s, k in zip(slots, keys) if k == key]
        lo, hi = min(rows), max(rows)
        t = ts[keys.index(key)]
        buf = t.node.outs[t.idx]
        holes = hi + 1 - lo - len(rows)
        if holes == 0 or (holes < len(rows) and holes * buf[0].nbytes <= _HOLE_BYTES):
            parts.append(buf[lo : hi + 1])
            shift[key] = total - lo
            total += hi + 1 - lo
        else:
            if len(rows) <= _ROW_VIEWS:  # a row view is cheaper than an index_select
                parts.extend([buf[r : r + 1] for r in rows])
            else:
                parts.append(buf.index_select(0, index_tensor(rows, device)))
                sparse += 1
            shift[key] = None
            counter[key] = total
            total += len(rows)
    if not counter:
        index = [(s & _ROW_MASK) + shift[k] for s, k in zip(slots, keys)]  # type: ignore[operator]
    else:
        index = []
        for s, k in zip(slots, keys):
            sh = shift[k]
            if sh is None:
                c = counter[k]
                index.append(c)
                counter[k] = c + 1
            else:
                index.append((s & _ROW_MASK) + sh)
    joined = torch.cat(parts)
    stats.gathers += 1 + sparse
    if total == n and index == list(range(n)):
        return joined
    stats.gathers += 1
    return joined.index_select(0, index_tensor(index, device))


def _is_range(values: list) -> bool:
    first = values[0]
    return values == list(range(first, first + len(values)))


def gather_source(ts: list, n: int, stats):
    """Like ``gather``, but for an operand a fused kernel reads in place: the rows stay
    where they are and the kernel gets (buffer, index); only operands spread over several
    producer batches are gathered first."""
    from acrobat.fusion import Source

    t0 = ts[0]
    node0 = t0.node
    buf = node0.outs[t0.idx]
    shape = t0.shape
    F = shape.numel()
    same = True
    for t in ts:
        if t.node.outs is not node0.outs or t.idx != t0.idx:
            same = False
            break
    if not same:
        return Source(gather(ts, n, stats).reshape(n, F), None, shape)
    rows = [t.node.row for t in ts]
    flat = buf.reshape(buf.shape[0], F)
    if rows == list(range(rows[0], rows[0] + n)):
        return Source(flat[rows[0] : rows[0] + n], None, shape)
    stats.gathers_fused += 1
    return Source(flat, index_tensor(rows, buf.device), shape)


def run_batch(nodes: list, stats) -> None:
    """Execute one batch (nodes of equal signature) and give every node its row."""
    n0 = nodes[0]
    op = n0.op
    n = len(nodes)
    t0 = time.perf_counter()
    if op in DATA_OPS:
        if op is TAKE and _take_in_place(nodes, n, stats, t0):
            return
        outs = op.rule(nodes)
        t1 = time.perf_counter()
    elif op.kind == "scan":
        if not (config.PAD_RAGGED and _run_padded_scans(nodes, stats)):
            _run_scan(nodes, n, stats, t0)
        return
    elif op.kind == "ragged":
        _run_ragged(nodes, n, stats, t0)
        return
    elif op.kind == "ragged_put":
        _run_ragged_put(nodes, n, stats, t0)
        return
    elif op.kind == "sequences":
        _run_sequences(nodes, n, stats, t0)
        return
    elif op is PICK:  # x[i], each node its own int i
        column = [nd.inputs[0] for nd in nodes]
        if _same_shapes(column):
            x = gather(column, n, stats, (op, 0))
            t1 = time.perf_counter()
            outs = (picks(nodes, x),)
        else:  # (config.RAGGED_ROWS: values of different leading sizes)
            rows = _native_picks(nodes, column, stats)
            if rows is not None:
                t1 = time.perf_counter()
                outs = (rows,)
            else:
                values = _values(column)
                t1 = time.perf_counter()
                outs = (ragged_picks(nodes, values),)
    elif op.kind == "whole":  # x.max() ... of values of any shapes (ops._special_whole)
        column = [nd.inputs[0] for nd in nodes]
        if _same_shapes(column):
            x = gather(column, n, stats, (op, 0))
            t1 = time.perf_counter()
            outs = (whole_rows(op.name, x.reshape(n, -1)),)
        else:
            X = _padded_flat(column, n, op.name, stats)
            if X is not None:
                t1 = time.perf_counter()
                outs = (whole_padded(op.name, X, column),)
            else:
                values = _values(column)
                t1 = time.perf_counter()
                outs = (whole_rule(nodes, values),)
    elif op.extra.get("lookup") and _lookup_in_place(nodes, op.extra["lookup"], stats, t0):
        return
    else:
        if "padded" in op.extra and _run_padded(nodes, stats):
            return
        flat = op.extra.get("flat")
        parts = flat(n0) if flat is not None else 0
        if parts and (parts > FLAT_PARTS or not _columns_are_views(nodes)):
            _run_flat(nodes, n, stats, t0)
            return
        if op.name in ROW_VIEWS and len(n0.inputs) == 1 and _view_in_place(nodes, n, stats, t0):
            return
        if (
            n > 1
            and op.extra.get("pure")
            and config.DISTINCT_ROWS
            and _reads_shared(n0)
            and _distinct(nodes, n, stats, t0)
        ):
            return
        _run_operands(nodes, n, stats, t0)
        return
    _finish_batch(nodes, outs, n, stats, t0, t1)


def _by_address(node) -> bool:
    """Whether values of ``node``'s map may be copied by the C extension from their
    addresses: a CPU map without autograd, config.FAST_GATHER on."""
    return (
        _native is not None
        and config.FAST_GATHER
        and not torch.is_grad_enabled()
        and node.rt.device.type == "cpu"
    )


def _native_picks(nodes: list, column: list, stats) -> torch.Tensor | None:
    """``x[i]`` of values of different leading sizes (``column``, each node its own int):
    each row copied by address in one C call (_native.pick_rows), where ops.ragged_picks
    takes a view of every value, their concatenation and one lookup. None where that
    cannot be done (autograd, no C extension, not a CPU map, a source not readable by
    address)."""
    t0 = column[0]
    if not _by_address(t0.node):
        return None
    dtype = t0.dtype
    item = dtype.itemsize
    rest = t0.shape[1:]
    rowbytes = rest.numel() * item
    shapes = [t.shape for t in column]
    nbytes = [shape.numel() * item for shape in shapes]
    offsets = [(nd.args[1] % shape[0]) * rowbytes for nd, shape in zip(nodes, shapes)]
    out = torch.empty(len(column), *rest, dtype=dtype, device=_CPU)  # (copied by address)
    if not _native.pick_rows(
        out.data_ptr(), rowbytes, _slots(column), _bases, column, dtype, shapes, nbytes, offsets
    ):
        return None
    stats.gathers += 1
    stats.gather_bytes += out.nbytes
    return out


def _same_shapes(column: list) -> bool:
    key = column[0].key
    return all(t.key == key for t in column)


def _padded_flat(column: list, n: int, name: str, stats) -> torch.Tensor | None:
    """The values of ``column`` (computed LazyTensors of different shapes, for a whole
    reduction ``name``) flattened into the rows of an (n, longest) matrix, padded with the
    reduction's neutral element: copied by address in one C call (_native.pad_parts, each
    value a part of its own; was a view, a reshape and ``pad_sequence``'s copy per value,
    then one call per shape); None where that cannot be done (autograd, no C extension,
    not a CPU map, a source not readable by address)."""
    t0 = column[0]
    if not _by_address(t0.node):
        return None
    dtype = t0.dtype
    longest = max(t.shape.numel() for t in column)
    X = torch.full((n, longest), neutral_value(NEUTRAL[name], dtype), dtype=dtype, device=_CPU)
    if _write_parts(X, column, [1] * n) is None:  # (each value a part of its own)
        return None
    stats.gathers += 1
    stats.gather_bytes += X.nbytes
    return X


def _values(column: list) -> list:
    """Each computed LazyTensor's own value (a row of its producer's batch output)."""
    return [t.node.outs[t.idx][t.node.row] for t in column]


def _run_padded(nodes: list, stats) -> bool:
    """A batch that joins calls of several traces of one padded family
    (acrobat/padding.py): each chunk of sizes (padding.chunks) padded to its largest
    member's size and run as one batch; a chunk of one trace runs as usual. False where
    the batch holds one trace (run as usual by the caller)."""
    groups = _by_op(nodes)
    if len(groups) == 1:
        return False
    by_size = sorted(groups.values(), key=lambda g: -padding.volume(g[0].op.extra["padded"][1]))
    fam = by_size[0][0].op.extra["padded"][0]
    if not fam.train_safe and torch.is_grad_enabled():
        for part in by_size:
            run_batch(part, stats)
        return True
    sizes = [(g[0].op.extra["padded"][1], len(g)) for g in by_size]
    for run in padding.chunks(sizes, fam.rank):
        parts = [by_size[i] for i in run]
        if len(parts) == 1:
            run_batch(parts[0], stats)
            continue
        try:
            _pad_run(fam, parts, stats)
        except Exception as exc:  # (an op padding cannot run, or an index out of its
            if config.VERIFY and type(exc) is not padding.OutOfRange:  # instance's range:
                raise  # each size on its own, as before, where torch checks the index)
            for part in parts:
                run_batch(part, stats)
    return True


def _by_op(nodes: list) -> dict:
    """``nodes`` grouped by op (a padded batch: one group per trace), in batch order."""
    groups: dict = {}
    for nd in nodes:
        groups.setdefault(nd.op, []).append(nd)
    return groups


def _pad_run(fam, parts: list, stats) -> None:
    """One padded batch of ``parts`` (node lists of one trace each, largest size first)."""
    t0 = time.perf_counter()
    trace = parts[0][0].op.rule.__self__  # (the largest member: its program at that size)
    nodes = [nd for part in parts for nd in part]
    n = len(nodes)
    ns = [part[0].op.extra["padded"][1] for part in parts]
    counts = [len(part) for part in parts]
    views = [padding.view(part[0].op.rule.__self__) for part in parts]
    xs = []
    for v, flags in enumerate(fam.arg_flags):
        if not any(flags):  # (fixed shape: one column; an argument before any list)
            xs.append(gather([nd.inputs[view.args[v]] for view, part in zip(views, parts)
                              for nd in part], n, stats))  # fmt: skip
            continue
        direct = _direct_pad(flags, nodes[0])
        if direct and not any(flags[1:]) and all(view.args[v] >= 0 for view in views):
            column = [nd.inputs[view.args[v]] for view, part in zip(views, parts)
                      for nd in part]  # fmt: skip
            out = _pad_parts(column, counts, stats)
            if out is not None:
                xs.append(out)
                continue
        out = None
        r = 0
        for part, size, view in zip(parts, ns, views):
            i = view.args[v]
            if i >= 0:
                column = [nd.inputs[i] for nd in part]
                if direct:
                    if out is None:  # (the first part is the largest)
                        out = padding.blank_as(column[0], (n, *column[0].shape))
                    if _pad_into(out, list(range(r, r + len(part))), column, stats):
                        r += len(part)
                        continue
                x = gather(column, len(part), stats)
            else:  # the list of a stack: its parts, row after row
                s, count, _ = view.packed
                column = [t for nd in part for t in nd.inputs[s : s + count]]
                x = gather(column, len(column), stats)
                x = x.reshape(len(part), count, *x.shape[1:])
            if out is None:  # (the first part is the largest)
                out = padding.blank(x, (n, *x.shape[1:]))
            out[(slice(r, r + len(part)), *padding.cut(flags, size))] = x
            r += len(part)
        assert out is not None
        xs.append(out)
    device = xs[0].device
    lens = _lens(ns, counts, device)
    t1 = time.perf_counter()
    outs = fam.run(trace, xs, lens, n)
    if not fam.ragged_out:
        _finish_batch(nodes, outs, n, stats, t0, t1)
        return
    _account(nodes, n, stats, t0, t1)
    cut = [  # per ragged output, its value at each size
        _cut(o, flags, counts, ns, nodes[0]) if any(flags) else None
        for o, flags in zip(outs, fam.out_flags)
    ]
    r = 0
    for p, part in enumerate(parts):  # each size its own rows
        rows = slice(r, r + len(part))
        _give(part, tuple(o[rows] if c is None else c[p] for o, c in zip(outs, cut)))
        r += len(part)


def _cut(o: torch.Tensor, flags: tuple, counts: list, ns: list, node) -> list:
    """A padded batch's ragged output ``o`` cut back to each part's size (``ns``;
    ``counts`` rows each): by address in one C copy where it can be (:func:`_cut_parts`),
    else part by part (an index and a copy each: autograd, the GPU)."""
    if _direct_pad(flags, node):
        parts = _cut_parts(o, flags, counts, ns)
        if parts is not None:
            return parts
    out, r = [], 0
    for c, size in zip(counts, ns):
        out.append(o[(slice(r, r + c), *padding.cut(flags, size))].contiguous())
        r += c
    return out


def _lens(ns: list, counts: list, device: torch.device) -> torch.Tensor:
    """The true size of each row of a padded batch (its part's ``ns`` entry, ``counts`` rows
    of each part): from a buffer where the sizes are ints (torch.tensor of a list of
    ints costs ~10 us)."""
    if type(ns[0]) is int:
        sizes = array("q")
        for size, c in zip(ns, counts):
            sizes.extend([size] * c)
        lens = torch.frombuffer(sizes, dtype=torch.int64)
        return lens if device.type == "cpu" else lens.to(device)
    return torch.tensor([size for size, c in zip(ns, counts) for _ in range(c)], device=device)


def _pad_parts(column: list, counts: list, stats) -> torch.Tensor | None:
    """A padded batch's argument ragged along its first dim alone: ``column`` holds the
    members of each part in turn (``counts``), the largest part first; all written by
    address to the start of their rows in one C call (_native.pad_parts), their pads left
    as :func:`padding.blank_as` fills them. None, nothing written, where a source cannot
    be read by address."""
    t0 = column[0]
    out = padding.blank_as(t0, (len(column), *t0.shape))
    written = _write_parts(out, column, counts)
    if written is None:
        return None
    stats.gathers += 1
    stats.gather_bytes += written
    return out


def _write_parts(out: torch.Tensor, column: list, counts: list) -> int | None:
    """The members of ``column`` (``counts`` of them a part, one shape a part) written by
    address to the start of the rows of ``out`` (a CPU tensor of rows wide enough), in
    order, in one C call (_native.pad_parts): the bytes written, or None, nothing
    written, where a source cannot be read by address."""
    item = out.element_size()
    shapes, nbytes = [], []
    k = 0
    for c in counts:
        shape = column[k].shape
        shapes.append(shape)
        nbytes.append(shape.numel() * item)
        k += c
    if not _native.pad_parts(
        out.data_ptr(), out.stride(0) * item, _slots(column), _bases, column, out.dtype,
        counts, shapes, nbytes,
    ):  # fmt: skip
        return None
    return sum(c * b for c, b in zip(counts, nbytes))


def _cut_parts(o: torch.Tensor, flags: tuple, counts: list, ns: list) -> list | None:
    """A padded batch's output ragged along its first dim alone (``flags``) cut back to
    each part's size (``ns``; ``counts`` rows each): one C copy of every row's real entries
    into one buffer (_native.unpad_parts), each part a contiguous view of it (``o`` made
    contiguous first where it is not: one copy, not one a part). None where ``o`` is not on
    the CPU (the caller cuts it part by part)."""
    if any(flags[1:]) or o.device.type != "cpu":
        return None
    o = o.contiguous()
    f = flags[0]
    rest = o.shape[2:]
    inner = rest.numel()
    lengths = [(size[f.sym] if type(size) is tuple else size) + f.offset for size in ns]
    numels = [c * length * inner for c, length in zip(counts, lengths)]
    flat = torch.empty(sum(numels), dtype=o.dtype, device=_CPU)
    item = o.element_size()
    nbytes = [length * inner * item for length in lengths]
    _native.unpad_parts(o.data_ptr(), o.stride(0) * item, flat.data_ptr(), counts, nbytes)
    return [
        piece.view(c, length, *rest)
        for piece, c, length in zip(flat.split(numels), counts, lengths)
    ]


def _direct_pad(flags: tuple, node) -> bool:
    """Whether a padded batch's argument of ``flags`` may be written by address
    (:func:`_pad_into`): ragged along its first dim, or its first two (an n x n
    adjacency), and no other, a CPU map without autograd."""
    return bool(flags) and bool(flags[0]) and not any(flags[2:]) and _by_address(node)


def _pad_into(out: torch.Tensor, rows: list, column: list, stats) -> bool:
    """The values of ``column`` (LazyTensors of one shape, ragged along their first dim
    only) copied by address to the start of rows ``rows`` of the padded batch ``out``,
    their pads left as they are: one C call instead of a gather and a copy into the
    padded batch (a batch of graphs of many sizes apart is a size per member). False,
    nothing copied, where a source cannot be read by address."""
    t0 = column[0]
    shape, dtype = t0.shape, t0.dtype
    nbytes = shape.numel() * dtype.itemsize
    stride = out.stride(0) * out.element_size()
    slots = _slots(column)
    dst = out.data_ptr()
    if len(shape) > 1 and out.shape[2] != shape[1]:  # (ragged in its first two dims:
        # each of its rows a piece of its own, at the padded row's stride)
        parts, inner = shape[0], out.stride(1) * out.element_size()
        done = _native.pad_rows(
            dst, stride, rows, slots, _bases, nbytes, column, shape, dtype, parts, inner
        )
    else:
        done = _native.pad_rows(dst, stride, rows, slots, _bases, nbytes, column, shape, dtype)
    if not done:
        return False
    stats.gathers += 1
    stats.gather_bytes += nbytes * len(rows)
    return True


def _run_operands(nodes: list, n: int, stats, t0: float) -> None:
    """A batch of an op whose rule takes the gathered operands (run_batch's common case)."""
    n0 = nodes[0]
    op = n0.op
    xs = []
    in_place = op.source_args
    if in_place and not reads_in_place(n0.rt.device):
        in_place = ()
    by_address = op.row_args
    if by_address and (torch.is_grad_enabled() or not config.ROW_OPERANDS):
        by_address = ()
    joined = _join(nodes, op.joins, n, stats) if op.joins else None
    for j in range(len(n0.inputs)):
        if joined is not None and j in joined:
            xs.append(joined[j])
        elif j in in_place:
            xs.append(gather_source([nd.inputs[j] for nd in nodes], n, stats))
        elif _native is not None and type(nodes) is list:  # operands, slots: one C loop
            column, slots = _native.column(nodes, j)
            x = None
            if j in by_address and not _is_range(slots):
                x = rows_of(column, slots, _bases)  # (None: a source torch must read)
                stats.gathers_fused += x is not None
            xs.append(gather(column, n, stats, (op, j), slots) if x is None else x)
        else:
            xs.append(gather([nd.inputs[j] for nd in nodes], n, stats, (op, j)))
    t1 = time.perf_counter()
    try:
        outs = op.rule(n0, xs, n)
    except Exception as exc:
        _explain_failure(nodes, exc)
        raise
    _finish_batch(nodes, outs, n, stats, t0, t1)


def _reads_shared(node) -> bool:
    """Whether an operand of ``node`` is a row that other nodes may read too (a table's row
    in place, a row of a batch run by :func:`_distinct`): where duplicates can be."""
    shared = node.rt.shared
    return any(id(t.node.outs) in shared for t in node.inputs)


def _distinct(nodes: list, n: int, stats, t0: float) -> bool:
    """Run a batch of a pure op (no random draw) once per distinct row of operands, if some
    nodes have the very same operand rows as another: the others get the first one's
    row (its slot too, so consumers gather it as the same row). False, running nothing,
    where every node's operands differ."""
    n0 = nodes[0]
    shared = n0.rt.shared
    # operands from rows no other node reads first: where one column's rows are all
    # distinct, so are the nodes (a recurrent state beside a word: one set, no keys)
    order = sorted(range(len(n0.inputs)), key=lambda j: id(n0.inputs[j].node.outs) in shared)
    columns = []
    for j in order:
        if _native is not None and type(nodes) is list:
            slots = _native.column(nodes, j)[1]
        else:
            slots = _slots([nd.inputs[j] for nd in nodes])
        if len(set(slots)) == n:
            return False
        columns.append(slots)
    keys = columns[0] if len(columns) == 1 else list(zip(*columns))
    first: dict = {}  # operand rows -> the first node reading them
    for nd, key in zip(nodes, keys):
        first.setdefault(key, nd)
    if len(first) == n:
        return False
    reps = list(first.values())
    _run_operands(reps, len(reps), stats, t0)
    _share(n0.rt, reps[0])
    for nd, key in zip(nodes, keys):
        rep = first[key]
        if rep is not nd:
            nd.outs, nd.row, nd.slot = rep.outs, rep.row, rep.slot
    stats.shared += n - len(reps)
    stats.by_op[n0.op.name][1] += n - len(reps)  # (its nodes, as recorded)
    return True


def _join(nodes: list, groups: tuple, n: int, stats) -> dict | None:
    """The operand groups of a block's concatenations (codegen.joined_cats) gathered each
    into one (n, total) buffer, every part's rows copied from their addresses straight
    into its columns: ``{first position: buffer, other positions: None}``. A group whose
    rows the C copy cannot all read (or with autograd on, or without the C extension) is
    left out: its parts are gathered one by one and the program concatenates them."""
    if _native is None or type(nodes) is not list or torch.is_grad_enabled():
        return None
    if not config.JOIN_GATHERS or not config.FAST_GATHER or nodes[0].rt.device.type != "cpu":
        return None
    joined: dict = {}
    inputs = nodes[0].inputs
    for group in groups:
        dtype = inputs[group[0]].dtype
        width = sum(inputs[j].shape[0] for j in group)
        out = torch.empty(n, width, dtype=dtype, device=_CPU)  # (copied by address)
        if _native.join_into(out.data_ptr(), width * dtype.itemsize, nodes, group, _bases):
            joined[group[0]] = out
            for j in group[1:]:
                joined[j] = None
            stats.gathers += 1
            stats.gather_bytes += out.nbytes
    return joined


def _trip_count(node) -> int:
    return -node.data


def _run_scan(nodes: list, n: int, stats, t0: float) -> None:
    """A batch of loops (acrobat/scan.py): rows sorted by trip count, longest first, so
    the rows still looping are always a prefix; a sequence's elements gathered once,
    step-major (step t's elements of the rows still looping are consecutive rows)."""
    nodes.sort(key=_trip_count)  # stable; rows are positions, so the order is the layout
    op = nodes[0].op
    scan = op.extra["scan"]
    xs = [gather([nd.inputs[j] for nd in nodes], n, stats, (op, j)) for j in range(scan.fixed)]
    active = looping([nd.data for nd in nodes])
    elements = None
    repeats: dict | None = {} if config.DISTINCT_ROWS and scan.repeats_wanted() else None
    if scan.sequences:
        elements = scan.elements(
            nodes, active, lambda c, rows, slots: gather(c, rows, stats, slots=slots), repeats
        )
    if repeats:
        stats.shared += sum(found[2] for found in repeats.values())
    t1 = time.perf_counter()
    try:
        outs = scan.run(xs, active, elements, repeats)
    except Exception as exc:
        _explain_failure(nodes, exc)
        raise
    if scan.carried or not scan.sequences:  # (a loop without state runs once)
        stats.launches += op.launches * max(len(active) - 1, 0)
    _finish_batch(nodes, outs, n, stats, t0, t1)


def _run_padded_scans(nodes: list, stats) -> bool:
    """A batch of loops over several traces of one padding family (scheduler.family):
    one scan with its ragged operands padded to the largest size, each step the
    family's padded program (Scan.run's ``padded``), sizes cut into runs whose padded
    work stays within config.PAD_WASTE as a block's (padding.chunks); where the loops
    cannot pad (padding.Family.loops_pad) one scan per trace. False where the batch holds
    loops of one trace (run as usual by the caller)."""
    groups = _by_op(nodes)
    if len(groups) == 1:
        return False
    scans = [op.extra["scan"] for op in groups]
    size = {op: s.trace.op.extra["padded"][1] for op, s in zip(groups, scans)}
    fam = scans[0].trace.op.extra["padded"][0]
    largest_first = sorted(groups, key=lambda op: -padding.volume(size[op]))
    runs = padding.chunks([(size[op], len(groups[op])) for op in largest_first], fam.rank)
    if len(runs) > 1:
        for run in runs:
            part = [nd for i in run for nd in groups[largest_first[i]]]
            if len(run) == 1:
                _run_scan(part, len(part), stats, time.perf_counter())
            else:
                _run_padded_scans(part, stats)  # (one run: padded as one)
        return True
    rest = fam  # (the family of the steps' programs: a split's rest where the body is cut)
    if scans[0].split is not None:
        split_all = all(s.split is not None for s in scans)
        rest = (
            padding.split_family([op.extra["scan"] for op in largest_first]) if split_all else None
        )
    if (
        rest is None
        or not fam.loops_pad(scans[0])
        or any((s.split is None) != (scans[0].split is None) for s in scans)
        or (not rest.train_safe and torch.is_grad_enabled())
    ):
        for part in groups.values():
            _run_scan(part, len(part), stats, time.perf_counter())
        return True
    t0 = time.perf_counter()
    rows = sorted(nodes, key=_trip_count)  # (longest first, as _run_scan)
    n = len(rows)
    top = largest_first[0]  # (one run: it is at least as large as every other member)
    scan = top.extra["scan"]
    big = size[top]
    sizes = [size[nd.op] for nd in rows]
    by_size: dict = {}  # size -> its rows
    for r, s in enumerate(sizes):
        by_size.setdefault(s, []).append(r)
    xs = []
    for j in range(scan.fixed):
        column = [nd.inputs[j] for nd in rows]
        flags = fam.arg_flags[scan.sequences + j]
        if not any(flags):
            xs.append(gather(column, n, stats))
            continue
        out = None
        direct = _direct_pad(flags, rows[0])
        for s, where in by_size.items():
            mine = [column[r] for r in where]
            if out is None:
                shape = fam.shape(("arg", scan.sequences + j), big)
                out = padding.blank_as(mine[0], (n, *shape))
            if direct and _pad_into(out, where, mine, stats):
                continue
            x = gather(mine, len(where), stats)
            out[(index_tensor(where, x.device), *padding.cut(flags, s))] = x
        assert out is not None
        xs.append(out)
    active = looping([nd.data for nd in rows])
    elements = None
    if scan.sequences:
        elements = scan.elements(
            rows, active, lambda c, k, slots: gather(c, k, stats, slots=slots), None
        )
    first = xs[0] if xs else elements[0] if elements else None
    lens = torch.tensor(sizes, device=first.device if first is not None else None)
    t1 = time.perf_counter()
    try:
        step = scan.trace if scan.split is None else scan.split.var
        outs = scan.run(xs, active, elements, None, (rest, step, lens))
    except Exception as exc:  # (a loop padding cannot run: one scan per trace, as before)
        if config.VERIFY and type(exc) is not padding.OutOfRange:
            raise
        for part in groups.values():
            _run_scan(part, len(part), stats, time.perf_counter())
        return True
    if scan.carried or not scan.sequences:
        stats.launches += top.launches * max(len(active) - 1, 0)
    if not rest.ragged_out:
        _finish_batch(rows, outs, n, stats, t0, t1)
        return True
    _account(rows, n, stats, t0, t1)
    _cut_scan_outputs(rows, outs, by_size, rest.out_flags, scan.carried)
    return True


def _cut_scan_outputs(rows: list, outs: tuple, by_size: dict, flags: tuple, k: int) -> None:
    """The outputs of a padded batch of loops (rows: its nodes, ``by_size``: each size's
    positions among them; the first ``k`` outputs the carried states, then each step's
    outputs, of the step program's ``flags``) given to the nodes by size: each size its
    own rows, ragged outputs cut to it. A step's output holds only the rows still looping
    then (rows sort longest loop first): a row past them reads row 0 there, a value its
    node never reads."""
    per = max(len(flags) - k, 1)
    out_flags = [flags[i] if i < k else flags[k + (i - k) % per] for i in range(len(outs))]
    device = outs[0].device if outs else torch.device("cpu")
    for size, where in by_size.items():
        index: dict = {}  # rows in an output -> the index of this size's rows there
        mine = []
        for o, f in zip(outs, out_flags):
            m = o.shape[0]
            if m not in index:
                index[m] = index_tensor([r if r < m else 0 for r in where], device)
            part = o.index_select(0, index[m])
            mine.append(part[(slice(None), *padding.cut(f, size))].contiguous() if any(f) else part)
        _give([rows[r] for r in where], tuple(mine))


def _run_ragged(nodes: list, n: int, stats, t0: float) -> None:
    """stack / cat nodes with any number of parts each (ops._special_flat): all parts of
    all nodes gathered as one column; each node's result is its own range of rows, so
    each node is a batch of one as far as its consumers' gathers know."""
    x = _flat_copy(nodes, stats)
    if x is None and _native is not None and type(nodes) is list:  # (all parts and their
        column, slots = _native.flat_column(nodes)  # slots: one C loop)
        x = gather(column, len(column), stats, slots=slots)
    elif x is None:
        column = [t for nd in nodes for t in nd.inputs]
        x = gather(column, len(column), stats)
    t1 = time.perf_counter()
    _own(nodes, [(out,) for out in nodes[0].op.rule(nodes, x)])
    _account(nodes, n, stats, t0, t1)


def _flat_copy(nodes: list, stats) -> torch.Tensor | None:
    """All parts of all ``nodes`` copied by address into one new buffer in one C call
    (_native.flat_into: no column of operands, no slot ints); None where gather's path
    applies instead: no C extension, autograd, not a CPU map, a source a byte copy cannot
    read, or rows back to back in memory already (gather takes a view of them)."""
    if _native is None or type(nodes) is not list or not _by_address(nodes[0]):
        return None
    t0 = nodes[0].inputs[0]
    shape, dtype = t0.shape, t0.dtype
    total = sum([len(nd.inputs) for nd in nodes])
    out = torch.empty(total, *shape, dtype=dtype, device=_CPU)  # (copied by address)
    nbytes = shape.numel() * dtype.itemsize
    if not _native.flat_into(out.data_ptr(), nodes, _bases, nbytes, shape, dtype):
        return None
    stats.gathers += 1
    stats.gather_bytes += out.nbytes
    return out


def _own(nodes: list, results: list) -> None:
    """Give each node its own ``results`` entry (a tuple of outputs with a leading dim of
    one): a batch of one as far as its consumers' gathers know."""
    for nd, outs in zip(nodes, results):
        nd.outs = outs
        nd.row = 0
        nd.slot = next(_batches) << _BATCH_SHIFT


def _run_ragged_put(nodes: list, n: int, stats, t0: float) -> None:
    """``x[i] = v`` (ops._ragged_put): where the x's differ in size, one write into a copy
    of all of them (ops.ragged_put_rule), each node's result its own view (a batch of one
    to its consumers' gathers); where they are of one size, put_rule's batch as usual."""
    column = [nd.inputs[0] for nd in nodes]
    if _same_shapes(column):
        _run_operands(nodes, n, stats, t0)
        return
    xs = _values(column)
    index = gather([nd.inputs[1] for nd in nodes], n, stats)
    value = nodes[0].args[2]
    lazy = type(value) is LazyTensor
    V = gather([nd.inputs[2] for nd in nodes], n, stats) if lazy else value
    t1 = time.perf_counter()
    outs = ragged_put_rule(xs, index, V, lazy)
    if outs is None:  # an index out of its instance's range: torch's error, named
        _explain_failure(nodes, IndexError("x[i] = v: an index out of range"))
        raise AcrobatError("x[i] = v: an index out of range, but no instance alone failed")
    _own(nodes, [(out,) for out in outs])
    _account(nodes, n, stats, t0, t1)


def _run_sequences(nodes: list, n: int, stats, t0: float) -> None:
    """Sequence modules over per-instance sequences of any lengths (ops.sequences_rule):
    one packed call; each node's results are its own (a batch of one to its consumers)."""
    xs = [[t.node.outs[t.idx][t.node.row] for t in nd.inputs] for nd in nodes]
    t1 = time.perf_counter()
    rule = nodes[0].op.rule
    try:
        results = rule(nodes, xs)
    except Exception as exc:
        _explain_failure(nodes, exc, alone=lambda nd, vals: rule([nd], [vals]))
        raise
    _own(nodes, results)
    _account(nodes, n, stats, t0, t1)


def _account(nodes: list, n: int, stats, t0: float, t1: float) -> None:
    """Add a batch run (gathers from t0, kernels from t1 until now) to the map's stats."""
    t2 = time.perf_counter()
    op = nodes[0].op
    stats.t_gather += t1 - t0
    stats.t_kernel += t2 - t1
    stats.batches += 1
    stats.launches += op.launches
    entry = stats.by_op.get(op.name)
    if entry is None:
        stats.by_op[op.name] = [1, n]
    else:
        entry[0] += 1
        entry[1] += n


def _finish_batch(nodes: list, outs, n: int, stats, t0: float, t1: float) -> None:
    """Account for a batch run and give every node its outputs, row and slot."""
    _account(nodes, n, stats, t0, t1)
    _give(nodes, outs)


def _give(nodes: list, outs) -> None:
    """Node i of a new batch gets ``outs``, row i and its slot."""
    base = next(_batches) << _BATCH_SHIFT
    if _native is not None and type(nodes) is list:
        _native.finish_rows(nodes, outs, base, config.FREE_OUTPUTS)
        return
    for i, nd in enumerate(nodes):
        nd.outs = outs
        nd.row = i
        nd.slot = base + i


def poison_freed(rt) -> None:
    """config.VERIFY: the outputs released since the last call (``rt.freed``, appended by
    ``_native.keep_freed``) filled with NaN (integers with -1, bools with True) where
    nothing else holds them or shares their memory (another batch whose output is the same
    tensor, a view's owner: those read it legitimately); they stay in ``rt.freed`` until
    the map ends, so their memory is not reused meanwhile."""
    freed = rt.freed
    use_count = torch._C._storage_Use_Count
    for i in range(rt.poisoned, len(freed)):
        t = freed[i]
        if t.requires_grad or t.device.type != "cpu":
            continue
        if sys.getrefcount(t) > 3:  # (the list, t, the call's argument)
            continue
        if use_count(t.untyped_storage()._cdata) != 2:  # (this tensor and the call's storage)
            continue
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        else:
            t.fill_(True if t.dtype is torch.bool else -1)
    rt.poisoned = len(freed)


def _share(rt, node) -> None:
    """Mark ``node``'s batch outputs as rows other nodes may read as their own
    (``rt.shared``): never released early (the readers are not counted), and the outputs
    tuple kept for the map, so its id names no other batch's."""
    outs = node.outs
    if _native is not None:
        _native.pin(node)
    rt.shared.add(id(outs))
    rt.kept.append(outs)


def _in_place_rows(nodes: list, outs, rows, stats, t0: float, t1: float) -> None:
    """Finish a batch whose outputs are a whole tensor (or views of one) with each node at
    its own row, not at its position in the batch."""
    rt = nodes[0].rt
    _finish_batch(nodes, outs, len(nodes), stats, t0, t1)
    _share(rt, nodes[0])
    rt.tables.add(id(nodes[0].outs))
    base = nodes[0].slot - nodes[0].row
    if _native is not None and type(nodes) is list and type(rows) is list:
        _native.place_rows(nodes, rows, base)
        return
    for nd, r in zip(nodes, rows):
        nd.row = r
        nd.slot = base + r


def _take_in_place(nodes: list, n: int, stats, t0: float) -> bool:
    """Row lookups of a real tensor (``emb(torch.tensor(i))``, ``W[i]``) copy nothing: the
    batch's output is the table itself and each node's row is its index, so a consumer
    gathers straight from the table (one copy instead of two: MV-RNN's word matrices).
    Tables too tall for a slot's row field take the copying rule."""
    table, spec = nodes[0].args
    if spec is not None or table.shape[0] > _ROW_MASK:  # (W[:, i]: a strided view)
        return False
    t1 = time.perf_counter()
    _in_place_rows(nodes, (table,), [nd.data for nd in nodes], stats, t0, t1)
    return True


def _lookup_in_place(nodes: list, lookup, stats, t0: float) -> bool:
    """A batch of a block that only looks rows up (``word(model, word_id)``: embedding
    rows of tables by the instance's number, and views of them) copies nothing, like
    ``_take_in_place``: its outputs are (views of) the whole tables and each node's row
    is its index. Only when every index is a Python number in range (else the block's
    program runs and reports a bad one)."""
    size = lookup.size
    if size > _ROW_MASK:
        return False
    if _native is not None and type(nodes) is list:  # the loop below, in C
        rows = _native.lookup_rows(nodes, size)
        if rows is None:
            return False
    else:
        rows = []
        for nd in nodes:
            src = nd.inputs[0].node
            i = src.data
            if src.op is not TENSOR or type(i) is not int or not 0 <= i < size:
                return False  # (embedding takes no negative index)
            rows.append(i)
    t1 = time.perf_counter()
    _in_place_rows(nodes, lookup.outputs(), rows, stats, t0, t1)
    return True


def _view_in_place(nodes: list, n: int, stats, t0: float) -> bool:
    """A row-wise view op over rows of one producer batch that are not consecutive (rows of
    a table, scattered rows) is applied to the producer's whole output, rows kept: a view
    of it, instead of a gather and a view of the copy."""
    first = nodes[0].inputs[0]
    outs, idx = first.node.outs, first.idx
    for nd in nodes:
        t = nd.inputs[0]
        if t.node.outs is not outs or t.idx != idx:
            return False
    rows = [nd.inputs[0].node.row for nd in nodes]
    if _is_range(rows):
        return False  # the plain path reads these rows as a view already
    buf = outs[idx]
    if nodes[0].op.rule is reshape_rule and not buf.is_contiguous():
        return False  # reshape would copy the whole output
    t1 = time.perf_counter()
    try:
        result = nodes[0].op.rule(nodes[0], [buf], buf.shape[0])
    except Exception:
        return False  # the per-batch path re-runs it and names the culprit if it fails
    _in_place_rows(nodes, result, rows, stats, t0, t1)
    return True


FLAT_PARTS = 2  # a stack / cat of more parts than this always takes the flat path


def _columns_are_views(nodes: list) -> bool:
    """Whether all operand columns but at most one are consecutive rows of one batch
    (views): then the op's own rule (at most one gather, then one stacking copy) copies
    no more than a flat gather (a cat and a reorder)."""
    gathers = 0
    for j in range(len(nodes[0].inputs)):
        if not _is_range(_slots([nd.inputs[j] for nd in nodes])):
            gathers += 1
            if gathers > 1:
                return False
    return True


def _run_flat(nodes: list, n: int, stats, t0: float) -> None:
    """stack/cat along the per-instance dim 0 of same-shape parts (ops.flat_parts): all
    parts of all nodes form one gathered column, reshaped into the batched result."""
    from acrobat.ops import flat_result

    n0 = nodes[0]
    k = len(n0.inputs)
    column = [t for nd in nodes for t in nd.inputs]
    x = gather(column, n * k, stats)
    t1 = time.perf_counter()
    outs = flat_result(n0, x, n)
    _finish_batch(nodes, outs, n, stats, t0, t1)


def _explain_failure(nodes: list, exc: Exception, alone=None) -> None:
    """A batched op failed: re-run each node on its own (eagerly, with its own operands,
    or by ``alone(node, operands)``); the first that fails names the culprit instance. If
    none fails, the batching rule is at fault, and the error says so."""
    from acrobat.graph import substitute

    for nd in nodes:
        vals = [t.node.outs[t.idx][t.node.row] for t in nd.inputs]
        try:
            if alone is not None:
                alone(nd, vals)
            elif nd.func is not None:
                it = iter(vals)
                args = substitute(nd.args, it)
                kwargs = {k: substitute(v, it) for k, v in (nd.kwargs or {}).items()}
                nd.func(*args, **kwargs)
            else:  # a block: its program on a batch of one
                nd.op.rule(nd, [v.unsqueeze(0) for v in vals], 1)
        except Exception as own:
            where = nd.op.extra.get("where")
            name = f"{nd.op.name} in {where}" if where else nd.op.name
            error = InstanceIndexError if isinstance(own, IndexError) else AcrobatError
            raise error(f"{name} failed for instance {nd.instance}: {own}") from own
    n0 = nodes[0]
    if ".item()" in str(exc) and any(
        t.shape == () and not t.dtype.is_floating_point for t in n0.inputs
    ):  # torch.vmap met a per-instance number: a dim, a shift, a count given as a tensor
        raise UnsupportedOpError(
            f"{n0.op.name} (instance {n0.instance} and others) was given a per-instance "
            "0-d tensor where torch needs a Python number (a dim, a shift, a count): each "
            "instance would need its own program; read it first with int(t) (a value "
            "read), e.g. x.sum(int(d))"
        ) from exc
    raise AcrobatError(
        f"batched {n0.op.name} over {len(nodes)} instances failed although every "
        f"instance runs alone: {exc} (please report this as an acrobat bug)"
    ) from exc


def execute(batches: list[list], stats) -> None:
    done = []  # batches run without autograd: their nodes let go of their operands
    free = config.FREE_OUTPUTS and _native is not None
    try:
        for nodes in batches:
            n0 = nodes[0]
            tag = grad_tag(n0.sig)
            if tag is None:
                run_batch(nodes, stats)
                enabled = n0.rt.grad_mode
            else:  # recorded inside torch.no_grad() (or enable_grad()): run in that mode
                with torch.set_grad_enabled(tag.enabled):
                    run_batch(nodes, stats)
                enabled = tag.enabled
            if free and not enabled and not keeps_operands(n0.op):
                done.append(nodes)
    finally:
        _reused.clear()  # frees the copies; slots stay unique until the map ends
    if done:
        _native.release_inputs(done)
