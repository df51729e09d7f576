"""Loops as one node per instance (automatic coarsening of loops).

``analysis`` outlines a loop whose body is straight-line assignments and
``out.append(value)`` calls into a body function ``step([x,] *carried, *free) ->
(*carried, *appended)`` and calls it through an ``analysis.ScanBlock``: a counted loop
``for _ in range(k)`` (its counter unread), or a loop over a sequence ``for x in xs``
(each element an input of its step). Inside ``f.map`` the whole loop records ONE node,
with the trip count as the node's data: NestedRNN's inner loop of 20-40 Elman steps is
one node instead of 20-40, an RNN over a sentence one node instead of one per word.

A batch of such nodes (one program, any trip counts) runs like a hand-batched masked
loop without the masks: its rows are sorted by trip count, longest first, so the
instances still looping are always a prefix of the rows. Step ``t`` runs the body's
batched program on that prefix (views, no gathers); a row whose count is reached drops
out with its final carried values. A sequence's elements are gathered once, step-major,
so step ``t`` reads a slice. The part of the body that depends on one input alone is
computed once, before the loop (``hoisting.build_split``): for all elements of all rows
at once (an RNN's input projection ``W_x x_t``), or for a loop-invariant input once per
row (``W_x x`` of NestedRNN's inner loop).

Node outputs: the final carried values (indices ``0..k-1``), then per step ``t`` the
appended values (index ``k + t * m + j``), each a tensor of the rows still looping at
``t``; a row's node reads its own row of each.
"""

from __future__ import annotations

import itertools

import torch

from acrobat import config, graph, hoisting
from acrobat.ops import Op
from acrobat.tensor import _native, index_tensor, to_device
from acrobat_kernels import recurrence

#: A loop's hoisted part runs once per distinct element (Scan._repeats) where at most
#: this share of its elements are distinct: below it, the saved rows pay for the two
#: row copies (the distinct elements, then every element's row of the result).
DISTINCT_SHARE = 0.9
#: ... and at least this many elements repeat (fewer: the copies and the search cost
#: about what they save; BiRNN small b8, 36 of 132 words repeated, measured 0.95x).
DISTINCT_SAVED = 64


def _index(values: list, device: torch.device) -> torch.Tensor:
    """An index tensor of its own on ``device`` (not a slice of a GPU's index ring, which
    later gathers may rewrite before the loop reads it)."""
    t = index_tensor(values, _CPU)
    return t if device.type == "cpu" else t.to(device)


_CPU = torch.device("cpu")


def looping(counts: list) -> list[int]:
    """Rows still looping at each step, for trip ``counts`` sorted longest first: rows
    ``0..looping(counts)[t]-1`` take step ``t``."""
    active = []
    a = len(counts)
    for t in range(counts[0] if counts else 0):
        while counts[a - 1] <= t:  # counts[0] > t: a stays >= 1
            a -= 1
        active.append(a)
    return active


class Scan:
    """A traced loop body (``block.Trace``) run as a loop over batches of instances."""

    def __init__(self, trace, carried: int, appends: int, sequences: int, inputs: list, values=()):
        self.trace = trace
        self.carried = carried  # k: the first outputs, and inputs after the elements
        self.appends = appends  # m: outputs appended to lists at every step
        # s: elements per step (the program's first s inputs); 0 for a counted loop
        self.sequences = sequences
        self.counted = sequences == 0
        self.fixed = len(inputs) - sequences  # a node's inputs before its elements
        # sequences of Python numbers (each element read as torch.tensor(x)): a node
        # keeps them in node.args, in this order, and a batch makes one tensor of each;
        # the others' elements are the node's inputs after the fixed ones, step-major
        self.values = tuple(values)
        self.value_dtypes = tuple(inputs[j].dtype for j in self.values)
        self.lazy = tuple(j for j in range(sequences) if j not in self.values)
        name = trace.op.name.replace("block:", "", 1)
        self.op = Op(
            f"scan:{name}",
            self.rule,
            "scan",
            launches=trace.op.launches,
            doc=f"a loop over {trace.op.name}",
        )
        self.op.extra["scan"] = self
        self.sig = (self.op,)
        self.split: hoisting.Split | None = None  # the part cut out of the loop, if any
        self.split_tried = False
        self.elman: tuple = (None, None)  # (split, its recurrence operands or None)
        self.hoisted_pos = 0  # the program input the split hoists

    @staticmethod
    def make(
        trace, carried: int, appends: int, sequences: int, args: tuple, inputs: list, values=()
    ):
        """A Scan for ``trace`` if it can loop: it returns its ``carried`` state
        arguments' successors, each with the argument's shape and dtype, then the
        appended values; else None."""
        spec = trace.out_spec
        total = carried + appends
        if not (
            spec[0] is tuple
            and len(spec[1]) == total
            and all(sub == ("leaf", i) for i, sub in enumerate(spec[1]))
            and all(src == ("out", i) for i, src in enumerate(trace.out_sources))
            and len(trace.out_lazies) == total
        ):
            return None
        first = sequences
        if any(inputs[j] is not args[j] for j in range(first)):
            return None
        for i in range(carried):
            a = args[first + i]
            if inputs[first + i] is not a or trace.info.keys[i] != a.key:
                return None  # a carried value is not a lazy tensor that keeps its type
        return Scan(trace, carried, appends, sequences, inputs, values)

    def prepare(self, rt, inputs: list) -> None:
        """Cut the part that depends on one input alone out of the body: once, again
        for each map run while the split holds autograd views (hoisting.Split.stale).
        A sequence's element first: that part then runs once for all steps."""
        split = self.split
        if self.split_tried and (split is None or split.run_id == rt.id or not split.stale()):
            return
        self.split_tried = True
        if split is not None:  # stale, from an earlier map: no pending node runs it
            split.retire()
        self.split = None
        if not self.carried and not self.counted:
            return  # steps independent of each other run all at once: nothing to cut
        first = self.sequences
        for pos in list(range(first)) + list(range(first + self.carried, len(inputs))):
            split = hoisting.build_split(self.trace, pos, rt, inputs[pos])
            if split is not None:
                self.split = split
                self.hoisted_pos = pos
                return

    def record(self, rt, inputs: list, seqs: list, count: int, lists: tuple) -> tuple:
        """Record the loop as one node (its inputs: the fixed ones, then the elements
        of ``seqs`` step-major); append its per-step outputs to ``lists`` and return its
        final carried values."""
        self.prepare(rt, inputs)
        s = self.sequences
        lazy = self.lazy
        if s == 0:
            node_inputs = inputs
        elif len(lazy) == 1:
            node_inputs = inputs[s:] + list(seqs[lazy[0]])
        else:
            steps = zip(*[seqs[j] for j in lazy])
            node_inputs = inputs[s:] + [x for step in steps for x in step]
        # (copies: the instance may change its list of numbers before the loop runs)
        values = tuple([tuple(seqs[j]) for j in self.values]) if self.values else None
        info = self.trace.info
        node = graph.add_node(rt, self.op, None, values, None, node_inputs, info, self.sig)
        node.data = count
        metas, keys = info.metas, info.keys
        k, m = self.carried, self.appends
        LazyTensor = graph.LazyTensor
        if m == 1 or len({id(out) for out in lists}) == m:  # each output its own list
            for j, out in enumerate(lists):
                (shape, dtype), key = metas[k + j], keys[k + j]
                if _native is not None:
                    out.extend(_native.lazy_range(node, k + j, k + count * m, m, shape, dtype, key))
                else:
                    positions = range(k + j, k + count * m, m)
                    out.extend([LazyTensor(node, i, shape, dtype, key) for i in positions])
        else:  # several appends to one list: in step order
            for t in range(count):
                base = k + t * m
                for j, out in enumerate(lists):
                    shape, dtype = metas[k + j]
                    out.append(LazyTensor(node, base + j, shape, dtype, keys[k + j]))
        return tuple(LazyTensor(node, i, metas[i][0], metas[i][1], keys[i]) for i in range(k))

    def rule(self, node, xs, n):
        """The batching rule for one trip count (``node.data``) on every row: used to
        re-run a node on its own when a batch fails."""
        count = node.data
        fixed = xs[: self.fixed]
        if self.counted:
            return self.run(fixed, [n] * count)
        if n != 1:  # pragma: no cover - a batch's rows differ in their elements
            raise ValueError(f"{self.op.name}: one node at a time")
        f, width = self.fixed, len(self.lazy)
        columns = iter([torch.cat(list(xs[f + i :: width])) for i in range(width)])
        elements = self.elements([node], [1] * count, lambda column, rows, slots: next(columns))
        return self.run(fixed, [1] * count, elements)

    def elements(self, nodes: list, active: list, gather, repeats=None) -> list:
        """Per sequence, the elements of step t of the rows still looping (the first
        ``active[t]`` of ``nodes``), step-major: lazy ones by ``gather(column, rows,
        slots)`` (slots: executor._slots of the column, or None),
        Python numbers made one tensor. ``repeats``, a dict, gets the hoisted sequence's
        repeated elements (:meth:`_repeats`) as index tensors ``(rep, inverse)`` and the
        number of elements not computed; where only the hoisted part reads that
        sequence, only its distinct elements are gathered (``rep`` None then)."""
        lazy = self.lazy
        first = self.fixed
        width = len(lazy)
        out: list = [None] * self.sequences
        if _native is not None and type(nodes) is list:  # operands and slots: C loops
            for i, j in enumerate(lazy):
                column, slots = _native.scan_column(nodes, first, width, i, active)
                found = None
                if repeats is not None and j == self.hoisted_pos:
                    found = self._repeats(column)
                if found is None:
                    out[j] = gather(column, len(column), slots)
                    continue
                rep, inverse = found
                device = column[0].node.outs[0].device
                inverse_t = _index(inverse, device)
                assert self.split is not None  # (repeats_wanted)
                if j in self.split.arg_pos:  # the rest of the step reads them too: all
                    out[j] = gather(column, len(column), slots)
                    repeats[j] = (_index(rep, device), inverse_t, len(column) - len(rep))
                else:  # the distinct ones alone
                    out[j] = gather([column[r] for r in rep], len(rep), [slots[r] for r in rep])
                    repeats[j] = (None, inverse_t, len(column) - len(rep))
        else:
            columns: list = [[] for _ in lazy]
            for t, a in enumerate(active):
                base = first + t * width
                for i, column in enumerate(columns):
                    column.extend([nd.inputs[base + i] for nd in nodes[:a]])
            for j, column in zip(lazy, columns):
                out[j] = gather(column, len(column), None)
        device = nodes[0].rt.default_device  # (where torch.tensor(x) makes them)
        for i, (j, dtype) in enumerate(zip(self.values, self.value_dtypes)):
            flat = [nd.args[i][t] for t, a in enumerate(active) for nd in nodes[:a]]
            values = torch.tensor(flat, dtype=dtype)
            out[j] = values if device.type == "cpu" else to_device(values, device)
        return out

    @property
    def value_map(self) -> bool:
        """Whether each step's one appended value is a pure function of the step's Python
        int alone (``[emb(torch.tensor(w)) for w in word_ids]``): equal ints, equal
        values, in every node of this loop."""
        return (
            self.carried == 0
            and self.appends == 1
            and self.sequences == 1
            and self.values == (0,)
            and self.fixed == 0
            and self.value_dtypes == (torch.int64,)
            and bool(self.trace.op.extra.get("pure"))
        )

    def repeats_wanted(self) -> bool:
        """Whether the part hoisted out of this loop reads a sequence of lazy elements
        and draws nothing per element (no dropout of the input): then elements made
        from equal ints are worth finding (:meth:`elements`' ``repeats``)."""
        split = self.split
        return (
            split is not None
            and self.hoisted_pos in self.lazy
            and _native is not None
            and bool(split.inv.op.extra.get("pure"))
        )

    def _repeats(self, column: list):
        """``(rep, inverse)`` lists for a column of the hoisted sequence's elements (step-
        major) made by a :attr:`value_map` loop, where equal ints make equal elements:
        ``rep`` the position of the first element of each distinct int, ``inverse`` each
        element's index into ``rep``; None where the elements are not of such a loop or
        too few repeat to pay for the two row copies (DISTINCT_SHARE, DISTINCT_SAVED)."""
        if not column or type(column) is not list:
            return None
        op = column[0].node.op
        source = op.extra.get("scan") if op.kind == "scan" else None
        if source is None or not source.value_map:
            return None
        found = _native.element_repeats(column, op)
        if found is None:
            return None
        kept, rows = len(found[0]), len(column)
        if kept > rows * DISTINCT_SHARE or rows - kept < DISTINCT_SAVED:
            return None
        return found

    def recurrence(self, split) -> tuple | None:
        """``(W, b)`` when the loop body past ``split`` is exactly an Elman step,
        ``tanh(linear(h, W, b) + c)`` with ``h`` the one carried state and ``c`` the one
        hoisted value, returning the new state as the carried value (and as the appended
        one, if any): then a batch's steps on a few rows run in one kernel call
        (acrobat_kernels/recurrence.py). Matched once per split."""
        cached, found = self.elman
        if cached is split:
            return found
        found = None
        if self.carried == 1 and self.appends <= 1:
            found = _elman_step(split.var, self.sequences, split.arg_pos)
        self.elman = (split, found)
        return found

    def run(self, xs: list, active: list, elements=None, repeats=None, padded=None) -> tuple:
        """Outputs of rows whose fixed operands are ``xs``, rows ``0..active[t]-1``
        taking step t (``looping``); over sequences, ``elements[j]`` holds sequence j's
        elements of those rows, step after step (``elements``); ``repeats``: what
        :meth:`elements` found of the hoisted sequence's repeats, or None. ``padded``:
        (family, trace, true sizes per row) where the rows are loops of several traces of
        one padding family, their operands padded (executor._run_padded_scans); the
        steps then run that trace's program padded (acrobat/padding.py)."""
        k = self.carried
        carry = list(xs[:k])
        if not active:
            return tuple(carry)
        first = self.sequences
        free = list(xs[k:])
        offsets = list(itertools.accumulate(active, initial=0)) if first else []
        if not k and first:
            return self._run_all(free, active, elements, offsets, padded)
        n = xs[0].shape[0]  # every row, those that take no step included
        split = self.split
        per_step = False
        if split is not None:
            pos = self.hoisted_pos
            per_step = pos < first
            source = elements[pos] if per_step else xs[pos - first]
            rows = source.shape[0]
            found = repeats.get(pos) if per_step and repeats else None
            if found is not None:  # once per distinct element, then every element's row
                rep, inverse, _ = found
                if rep is not None:
                    source = source.index_select(0, rep)
                once = split.inv.run_ops([source], source.shape[0])
                hoisted = [h.index_select(0, inverse) for h in once]
            else:
                hoisted = list(split.inv.run_ops([source], rows))
            arg_pos = split.arg_pos
            if padded is None:
                step = split.var.step_runner(source.device)
                elman = self.recurrence(split) if config.FAST_RECURRENCE else None
            else:  # the rest of each step padded (its family: padding.split_family)
                elman = None
                step = padded[0].stepper(padded[1], padded[2])
        elif padded is not None:
            elman = None
            step = padded[0].stepper(padded[1], padded[2])
        else:
            elman = None
            # the program as generated code (its elementwise region as one kernel call
            # where that runs on the CPU): its operands are views of the carried state and
            # sliced inputs, so gather-fused kernels have nothing to save
            step = self.trace.step_runner(xs[0].device)
        pieces: list[list] = [[] for _ in range(k)]
        step_outs: list = []
        done = n  # rows still looping before this step
        for t, a in enumerate(active):
            if a < done:  # rows a..active-1 are done: their carry is final
                for i in range(k):
                    pieces[i].append(carry[i][a:done])
                carry = [c[:a] for c in carry]
                done = a
            if elman is not None and a <= recurrence.MAX_ROWS:
                c = hoisted[0][offsets[t] :] if per_step else hoisted[0][:a]
                w, b = elman
                if recurrence.usable(carry[0], c, w, b):  # the remaining steps in one call
                    rest = active[t:]
                    starts = list(itertools.accumulate(rest[:-1], initial=0))
                    states, final = recurrence.run(carry[0], c, w, b, rest, starts, per_step)
                    if self.appends:
                        step_outs.extend(states[o : o + r] for o, r in zip(starts, rest))
                    carry = [final]
                    break
                elman = None  # (what it refused holds for the later steps too)
            values = carry + [f[:a] for f in free] if a < n else carry + free
            if first:
                off = offsets[t]
                values = [*(e[off : off + a] for e in elements), *values]
            if split is not None:
                if per_step:
                    off = offsets[t]
                    parts = [h[off : off + a] for h in hoisted]
                else:
                    parts = [h[:a] for h in hoisted]
                ins = [values[j] for j in arg_pos] + parts
            else:
                ins = values
            out = step(ins, a)
            carry = list(out[:k])
            step_outs.extend(out[k:])
        outs = []
        for i in range(k):
            parts = [carry[i], *reversed(pieces[i])]
            outs.append(parts[0] if len(parts) == 1 else torch.cat(parts))
        return (*outs, *step_outs)

    def _run_all(
        self, free: list, active: list, elements: list, offsets: list, padded=None
    ) -> tuple:
        """A loop without state (a comprehension): its steps do not depend on each
        other, so the body runs once over every element of every row, each row's free
        operands repeated for its elements; step t's outputs are views of the result."""
        index = None
        if free or padded is not None:
            rows = [r for a in active for r in range(a)]
            index = index_tensor(rows, elements[0].device)
            free = [f.index_select(0, index) for f in free]
        if padded is not None:
            fam, trace, lens = padded
            ins = [*elements, *free]
            outs = fam.run(trace, ins, lens.index_select(0, index), elements[0].shape[0])
        else:
            outs = self.trace.run_ops([*elements, *free], elements[0].shape[0])
        step_outs: list = []
        for off, a in zip(offsets, active):
            step_outs.extend(out[off : off + a] for out in outs)
        return tuple(step_outs)


def _elman_step(var, carry_pos: int, arg_pos: tuple) -> tuple | None:
    """(W, b) if ``var``'s program (inputs: the call's arguments at ``arg_pos``, then the
    hoisted values) is ``tanh(linear(h, W, b) + c)`` on the carried state ``h`` (argument
    ``carry_pos``) and one hoisted value ``c``, every output being that ``tanh``."""
    if len(arg_pos) != 1 or arg_pos[0] != carry_pos or len(var.placeholders) != 2:
        return None
    h, c = var.placeholders
    if len(var.nodes) != 3:
        return None
    lin, add, tanh = var.nodes
    if lin.op.name != "linear" or add.op.name != "add" or tanh.op.name != "tanh":
        return None
    if lin.kwargs or add.kwargs or tanh.kwargs or len(lin.args) not in (2, 3):
        return None
    w = lin.args[1]
    b = lin.args[2] if len(lin.args) == 3 else None
    tensors = (torch.Tensor, torch.nn.Parameter)
    if type(w) not in tensors or (b is not None and type(b) not in tensors):
        return None
    if [t.node for t in lin.inputs] != [h] or lin.inputs[0].idx != 0 or len(add.args) != 2:
        return None
    if {(id(t.node), t.idx) for t in add.inputs} != {(id(lin), 0), (id(c), 0)}:
        return None
    if len(add.inputs) != 2 or [(t.node, t.idx) for t in tanh.inputs] != [(add, 0)]:
        return None
    if len(tanh.args) != 1 or any(t.node is not tanh or t.idx != 0 for t in var.out_lazies):
        return None
    return w, b
