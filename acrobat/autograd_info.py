"""``x.requires_grad`` and ``x.is_leaf`` of a lazy tensor, answered from the graph.

Eager torch sets ``requires_grad`` on an op's result when grad mode is on where the op
runs and one of its tensor operands requires grad. The recorded graph holds the same
facts: each node's grad mode (its map's, or its :class:`graph.GradTag` inside a region
of the instance's own), its lazy operands and the real tensors it read (parameters,
hoisted values, a per-instance argument). The answer is a search from the tensor back
through nodes recorded with gradients on for a real tensor that requires grad; a node
recorded without gradients, ``detach``, and results that are not floating point (a
comparison, an index) cut it. A block call is followed into its trace, output by output
(an output that reads only the block's non-grad arguments does not require grad), and
its placeholders back to the call's operands. Nothing is computed, and no value is read.
"""

from __future__ import annotations

import torch

from acrobat.errors import LazyValueError, user_line
from acrobat.graph import _tensors, grad_tag
from acrobat.ops import INPUT
from acrobat.tensor import LazyTensor


def requires_grad(t: LazyTensor) -> bool:
    """What eager's ``t.requires_grad`` would be."""
    rt = t.node.rt
    if rt is not None and rt.tracer is not None:  # a block's body: traced once and replayed
        raise LazyValueError(  # for calls whose operands differ (an automatic block falls
            f"a block asked a tensor's requires_grad (at {user_line(3)}): a block is traced "
            "once for every call; ask outside the block"  # back to op by op, as at a read)
        )
    if not _differentiable(t):
        return False
    stack: list[tuple] = [(t, None, rt.grad_mode if rt is not None else torch.is_grad_enabled())]
    seen: set[tuple] = set()  # (node, output, block call's placeholder map): by id, so
    kept: list = []  # every map stays alive for the search (an id is not reused)
    while stack:
        lazy, places, mode = stack.pop()
        node = lazy.node
        key = (id(node), lazy.idx, id(places))
        if key in seen:
            continue
        seen.add(key)
        if places is not None and id(node) in places:  # a block's argument: the call's
            outer, outer_places, outer_mode = places[id(node)]
            stack.append((outer, outer_places, outer_mode))
            continue
        if node.op is INPUT:  # a per-instance argument: its own flag, in any mode
            if isinstance(node.data, torch.Tensor) and node.data.requires_grad:
                return True
            continue
        tag = grad_tag(node.sig)
        enabled = tag.enabled if tag is not None else (
            node.rt.grad_mode if node.rt is not None else mode
        )
        if not enabled or node.op.name == "detach":
            continue
        if _reads_grad_tensor(node):
            return True
        inner = _block_output(node, lazy.idx, places, enabled)
        if inner is not None:
            if inner is True:
                return True
            kept.extend(item[1] for item in inner)
            stack.extend(inner)
            continue
        stack.extend((x, places, enabled) for x in node.inputs if _differentiable(x))
    return False


def is_leaf(t: LazyTensor) -> bool:
    """What eager's ``t.is_leaf`` would be: not requiring grad, or a per-instance argument
    that is a leaf itself."""
    node = t.node
    if node.op is INPUT and isinstance(node.data, torch.Tensor):
        return node.data.is_leaf
    return not requires_grad(t)


def _differentiable(t) -> bool:
    return type(t) is LazyTensor and (t.dtype.is_floating_point or t.dtype.is_complex)


def _reads_grad_tensor(node) -> bool:
    """Whether the node's call read a real tensor that requires grad (a parameter, a value
    hoisted from parameters, a parameter's rows)."""
    reads = (*_tensors(node.args), *_tensors(node.kwargs), *_tensors(node.data))
    return any(type(a) is not LazyTensor and a.requires_grad for a in reads)


def _block_output(node, idx, places, mode):
    """For a block call's node: the trace's nodes that output ``idx`` is (to search, with
    the trace's placeholders mapped to the call's operands), True for a real output that
    requires grad; None for any other node. A node whose op keeps its program elsewhere
    (a loop, a split call) is searched whole: every node of the program and every operand
    of the call."""
    trace = getattr(node.op.rule, "__self__", None)
    program = getattr(trace, "trace", trace)  # (a loop's Scan holds its body's trace)
    nodes = getattr(program, "nodes", None)
    holders = getattr(program, "placeholders", None)
    if nodes is None or holders is None:
        return None
    inner_places = {
        id(ph): (x, places, mode) for ph, x in zip(holders, node.inputs) if _differentiable(x)
    }
    sources = getattr(program, "out_sources", None)
    outs = getattr(program, "out_lazies", None)
    if program is trace and sources is not None and outs is not None and idx < len(sources):
        kind, what = sources[idx]
        if kind == "arg":
            x = node.inputs[what] if what < len(node.inputs) else None
            return [(x, places, mode)] if _differentiable(x) else []
        if kind == "real":
            return True if isinstance(what, torch.Tensor) and what.requires_grad else []
        return [(outs[what], inner_places, mode)]
    # the whole program: any node reading a grad tensor, and every operand
    if any(_reads_grad_tensor(nd) for nd in nodes):
        return True
    return [(x, places, mode) for x in node.inputs if _differentiable(x)]
