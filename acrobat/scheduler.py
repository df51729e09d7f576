"""Turns the pending graph into an ordered list of batches.

Nodes were bucketed by (phase, depth, signature) as they were recorded, so scheduling is a
sort of the bucket keys by (phase, depth): every input of a node is either computed already
or lives in an earlier (phase, depth) bucket. Only phases up to ``max_phase`` run, so a
flush forced by one instance's value demand does not split the next phase's batches
(ACRoBat's program phases: a phase runs once every instance has finished the previous one).
"""

from __future__ import annotations

from acrobat import config
from acrobat.graph import Runtime, lint
from acrobat.tensor import _native


def _order(key):
    return key[0], key[1]


def schedule(rt: Runtime, max_phase: float = float("inf")) -> list[list]:
    """Pop the runnable buckets of ``rt`` and return them as batches, in execution order."""
    buckets = rt.buckets
    if config.VERIFY or config.DEBUG >= 3:
        lint(buckets)
    keys = sorted(buckets, key=_order)
    if keys and keys[-1][0] > max_phase:
        run = [k for k in keys if k[0] <= max_phase]
        batches = [buckets.pop(k) for k in run]
    else:
        batches = [buckets[k] for k in keys]
        rt.buckets = {}
    return batches


def relevel(batches: list[list]) -> list[list]:
    """The same nodes levelled as late as possible, if that makes fewer batches.

    A node's height is the longest path from it to a node nothing in this flush reads;
    within a phase, batches run by decreasing height (a topological order: a producer
    is higher than its consumers). Depth levelling aligns where instances' work starts,
    height levelling where it ends, which is the value each instance demands; the one
    with fewer (phase, level, signature) groups wins, depth levelling on a tie."""
    if len({(nodes[0].phase, nodes[0].sig) for nodes in batches}) == len(batches):
        return batches  # no signature at two depths: nothing to merge (DRNN, Berxit)
    if _native is not None and type(batches) is list:
        _native.heights(batches)  # the loop below, in C
    else:
        for nodes in reversed(batches):  # ASAP order reversed: consumers before producers
            for nd in nodes:
                h = nd.height + 1
                for t in nd.inputs:
                    p = t.node
                    if p.height < h and p.outs is None:
                        p.height = h
    groups: dict = {}
    for nodes in batches:  # a depth bucket: one phase and signature, mostly one height
        n0 = nodes[0]
        if len({nd.height for nd in nodes}) == 1:
            groups.setdefault((n0.phase, -n0.height, n0.sig), []).extend(nodes)
        else:
            for nd in nodes:
                groups.setdefault((n0.phase, -nd.height, n0.sig), []).append(nd)
    if len(groups) >= len(batches):
        return batches
    return [groups[k] for k in sorted(groups, key=_order)]


def lower_bound(batches: list[list]) -> int:
    """Fewest batches any schedule of these nodes needs: for each signature, the longest
    dependency chain through nodes of that signature (no two of them can share a batch),
    summed over signatures. A diagnostic (a pass over the graph), run when
    ``config.VERIFY`` or ``config.DEBUG`` is on."""
    chains: dict[int, dict] = {}  # node -> {signature: longest same-signature chain}
    best: dict = {}
    for nodes in batches:
        for nd in nodes:
            merged: dict = {}
            for t in nd.inputs:
                for sig, length in chains.get(id(t.node), {}).items():
                    if length > merged.get(sig, 0):
                        merged[sig] = length
            length = merged.get(nd.sig, 0) + 1
            merged[nd.sig] = length
            chains[id(nd)] = merged
            if length > best.get(nd.sig, 0):
                best[nd.sig] = length
    return sum(best.values())


def describe(batches: list[list]) -> str:
    """A readable listing of a schedule (``print(acrobat.explain(...))`` / DEBUG >= 2)."""
    lines = []
    for nodes in batches:
        n0 = nodes[0]
        shapes = ", ".join("x".join(map(str, t.shape)) or "()" for t in n0.inputs)
        lines.append(
            f"phase {n0.phase:>2} depth {n0.depth:>4}  {n0.op.name:<14} x{len(nodes):<5} ({shapes})"
        )
    return "\n".join(lines)
