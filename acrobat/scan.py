"""Counted loops as one node per instance (automatic coarsening of loops).

``analysis`` outlines a loop ``for _ in range(k): <straight-line assignments>`` whose
counter is not read into a body function ``step(*carried, *free) -> carried`` and calls
it through an ``analysis.ScanBlock``. Inside ``f.map`` the whole loop records ONE node,
with the trip count as the node's data: NestedRNN's inner loop of 20-40 Elman steps is
one node instead of 20-40.

A batch of such nodes (one program, any trip counts) runs like a hand-batched masked
loop without the masks: its rows are sorted by trip count, longest first, so the
instances still looping are always a prefix of the rows. Step ``t`` runs the body's
batched program on that prefix (views, no gathers); a row whose count is reached drops
out with its final carried values. When the body's loop-invariant operand feeds a GEMM
(``linear(cat([x, r]))``), that part is computed once for all rows before the loop
(``hoisting.build_split``), as a hand-written RNN computes ``W_x x`` up front.
"""

from __future__ import annotations

import torch

from acrobat import hoisting
from acrobat.ops import Op


class Scan:
    """A traced loop body (``block.Trace``) run as a loop over batches of instances."""

    def __init__(self, trace, carried: int):
        self.trace = trace
        self.carried = carried  # the first `carried` inputs and all outputs: the state
        name = trace.op.name.replace("block:", "", 1)
        self.op = Op(
            f"scan:{name}",
            self.rule,
            "scan",
            launches=trace.op.launches,
            doc=f"a counted loop over {trace.op.name}",
        )
        self.op.extra["scan"] = self
        self.sig = (self.op,)
        self.split: hoisting.Split | None = None  # the loop-invariant part, if cut out
        self.split_tried = False
        self.hoisted_pos = 0  # the input position the split hoists

    @staticmethod
    def make(trace, carried: int, args: tuple, rt, inputs: list) -> Scan | None:
        """A Scan for ``trace`` if it can loop: it returns exactly its ``carried`` first
        arguments' successors, each with the argument's shape and dtype; else None."""
        spec = trace.out_spec
        if not (
            spec[0] is tuple
            and len(spec[1]) == carried
            and all(sub == ("leaf", i) for i, sub in enumerate(spec[1]))
            and all(src == ("out", i) for i, src in enumerate(trace.out_sources))
            and len(trace.out_lazies) == carried
        ):
            return None
        for i in range(carried):
            if inputs[i] is not args[i] or trace.info.keys[i] != args[i].key:
                return None  # a carried value is not a lazy tensor that keeps its type
        return Scan(trace, carried)

    def prepare(self, rt, inputs: list) -> None:
        """Cut the loop-invariant part out of the body: once, again for each map run
        while the split holds autograd views (hoisting.Split.stale)."""
        split = self.split
        if self.split_tried and (split is None or split.run_id == rt.id or not split.stale()):
            return
        self.split_tried = True
        self.split = None
        for pos in range(self.carried, len(inputs)):
            split = hoisting.build_split(self.trace, pos, rt, inputs)
            if split is not None:
                self.split = split
                self.hoisted_pos = pos
                return

    def rule(self, node, xs, n):
        """The batching rule for one trip count (``node.data``) on every row: used to
        re-run a node on its own when a batch fails."""
        return self.run(xs, [node.data] * n)

    def run(self, xs: list, counts: list) -> tuple:
        """Final carried values of rows whose operands are ``xs``, row i looping
        ``counts[i]`` times; ``counts`` must be non-increasing."""
        k = self.carried
        n = len(counts)
        carry = list(xs[:k])
        if not counts or counts[0] == 0:
            return tuple(carry)
        free = list(xs[k:])
        split = self.split
        if split is not None:
            pos = self.hoisted_pos
            hoisted = list(split.inv.run(None, [xs[pos]], n))
            step = split.var.run
            arg_pos = split.arg_pos
        else:
            step = self.trace.run
        pieces: list[list] = [[] for _ in range(k)]
        active = n
        for t in range(counts[0]):
            a = active
            while counts[a - 1] <= t:  # counts[0] > t: a stays >= 1
                a -= 1
            if a < active:  # rows a..active-1 are done: their carry is final
                for i in range(k):
                    pieces[i].append(carry[i][a:active])
                carry = [c[:a] for c in carry]
                active = a
            if split is not None:
                values = carry + [f[:a] for f in free] if a < n else carry + free
                ins = [values[j] for j in arg_pos] + [h[:a] for h in hoisted]
            else:
                ins = carry + [f[:a] for f in free] if a < n else carry + free
            carry = list(step(None, ins, a))
        outs = []
        for i in range(k):
            parts = [carry[i], *reversed(pieces[i])]
            outs.append(parts[0] if len(parts) == 1 else torch.cat(parts))
        return tuple(outs)
