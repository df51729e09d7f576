"""Turns the pending graph into an ordered list of batches.

Nodes were bucketed by (phase, depth, signature) as they were recorded, so scheduling is a
sort of the bucket keys by (phase, depth): every input of a node is either computed already
or lives in an earlier (phase, depth) bucket. Only phases up to ``max_phase`` run, so a
flush forced by one instance's value demand does not split the next phase's batches
(ACRoBat's program phases: a phase runs once every instance has finished the previous one).
"""

from __future__ import annotations

import sys

from acrobat import config, executor, padding
from acrobat.graph import IMPURE_OPS, Runtime, lint
from acrobat.tensor import _native


def _order(key):
    return key[0], key[1]


def schedule(rt: Runtime, max_phase: float = float("inf"), demand: bool = False) -> list[list]:
    """Pop the runnable buckets of ``rt`` and return them as batches, in execution order;
    for a flush forced by value demands (``demand``), those of graph sinks no fiber waits
    for stay pending (:func:`unneeded`)."""
    buckets = rt.buckets
    if config.VERIFY or config.DEBUG >= 3:
        lint(buckets)
    keys = sorted(buckets, key=_order)
    if keys and keys[-1][0] > max_phase:
        keys = [k for k in keys if k[0] <= max_phase]
        batches = [buckets.pop(k) for k in keys]
    else:
        batches = [buckets[k] for k in keys]
        rt.buckets = {}
    del buckets  # (the batches hold the buckets alone: prune_dead frees what it drops)
    if demand and config.DEFER_UNNEEDED and len(batches) > 1:
        idle = (_native.unneeded if _native is not None else unneeded)(batches)
        if idle and len(idle) < len(batches):  # (something is always needed: else all run)
            for i in reversed(idle):
                if batches[i][0].op.name not in IMPURE_OPS:  # (draws keep their order)
                    rt.buckets[keys[i]] = batches.pop(i)
                    rt.sunk = True
    rt.nodes += sum(map(len, batches))  # every recorded node passes here once
    if config.PRUNE_DEAD:
        dead = (_native.prune_dead if _native is not None else prune_dead)(batches)
        if dead:
            rt.stats.dead += dead
            batches = [nodes for nodes in batches if nodes]
    return batches


def unneeded(batches: list[list]) -> list[int]:
    """The indices of ``batches`` whose nodes no recorded node reads (``node.used``) and no
    fiber has waited for (``node.demanded``): sinks of the graph so far. A flush forced by
    value demands leaves them pending, to run with the nodes of their bucket recorded
    later, in a later flush: what an instance computes last and returns without reading
    (DRNN's stack of its nodes' logits, made as each instance ends: 11 batches over a
    map's flushes at b64) runs as one batch at the end. A bucket runs whole or waits
    whole: deferring part of one would split a batch. Only sinks: a walk up from the
    demanded values to find every node they need cost more per flush than it saved.
    ``_native.unneeded`` is the same in C."""
    return [
        i for i, nodes in enumerate(batches) if not any(nd.used or nd.demanded for nd in nodes)
    ]


def _bucket_only() -> int:
    """What ``sys.getrefcount`` says, in prune_dead's comprehension, of an object one list
    alone holds (3 on CPython 3.11: the list, the loop variable, the argument; measured,
    not assumed, as interpreters count stack references differently)."""
    probe = [object()]
    return [sys.getrefcount(x) for x in probe][0]  # noqa: RUF015 (a list one, as there)


_BUCKET_ONLY = _bucket_only()


def prune_dead(batches: list[list]) -> int:
    """Drop the nodes nothing can read from ``batches`` (in execution order); how many.

    A pending node is referenced by its bucket, by every LazyTensor of its outputs and by
    nothing else that matters: its consumers hold those LazyTensors (``node.inputs``),
    and so does user code that may still use them. A node only its bucket references can
    never be read (``y = x.detach()`` never used; a value computed for a branch not
    taken). Consumers first: dropping one releases its operands, so a chain of dead
    nodes goes at once. ``_native.prune_dead`` is the same loop in C."""
    dead = 0
    for i in range(len(batches) - 1, -1, -1):
        nodes = batches[i]
        live = [nd for nd in nodes if sys.getrefcount(nd) > _BUCKET_ONLY]
        if len(live) < len(nodes):
            dead += len(nodes) - len(live)
            batches[i] = live
            del nodes  # (the old bucket: the dead nodes go with it)
    return dead


def relevel(rt: Runtime, batches: list[list], late: bool = True) -> list[list]:
    """The same nodes levelled as late as possible, if that makes fewer batches, with
    lifted constants' batches merged (:func:`family`) at either levelling.

    A node's height is the longest path from it to a node nothing in this flush reads;
    within a phase, batches run by decreasing height (a topological order: a producer
    is higher than its consumers). Depth levelling aligns where instances' work starts,
    height levelling where it ends, which is the value each instance demands; the one
    with fewer (phase, level, family) groups wins, depth levelling on a tie. ``late``
    False: depth levelling only (the map's last flush: nothing is demanded, unless a
    demand flush left sinks pending for it)."""
    families = [family(nodes) for nodes in batches]
    by_depth = {(nodes[0].phase, nodes[0].depth, f) for nodes, f in zip(batches, families)}
    if not late or len({(nodes[0].phase, f) for nodes, f in zip(batches, families)}) == len(
        by_depth
    ):  # no family at two depths: nothing for late levelling to merge (DRNN, Berxit)
        return _by_depth(rt, batches, families, by_depth)
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
    for nodes, f in zip(batches, families):  # a depth bucket: mostly one height
        n0 = nodes[0]
        if len({nd.height for nd in nodes}) == 1:
            groups.setdefault((n0.phase, -n0.height, f), []).append(nodes)
        else:
            split: dict = {}
            for nd in nodes:
                split.setdefault(nd.height, []).append(nd)
            for h, part in split.items():
                groups.setdefault((n0.phase, -h, f), []).append(part)
    if len(groups) >= len(by_depth):
        return _by_depth(rt, batches, families, by_depth)
    return [_join(rt, groups[k], k[2]) for k in sorted(groups, key=_order)]


def family(nodes: list):
    """The signature a batch merges under: its own, or for a block called with a shared
    constant (``cell(x, torch.zeros(h))``, a trace with the constant folded in) that of
    the same block given a per-instance tensor there, if that trace exists
    (block._note_lift). Where both kinds sit at one level they run as one batch, the
    constant read as a row (``executor.constant``): a parser's reduce steps on an empty
    buffer with the other instances' steps. Where they do not (a loop's first step), the
    folded trace skips the work on zeros."""
    n0 = nodes[0]
    extra = n0.op.extra
    if config.PAD_RAGGED:  # a padded family's traces, or loops over them
        scan = n0.op.kind == "scan"
        padded = (extra["scan"].trace.op.extra if scan else extra).get("padded")
        if padded is not None and n0.sig[0] is n0.op:  # (not in a grad mode of its own)
            return padded[0].loops if scan else padded[0]
    lift = extra.get("lift") if config.MERGE_LIFTED else None
    if lift is None:
        return n0.sig
    trace = lift[0].cache.get(lift[1])
    return n0.sig if trace is None else trace.sig


def _by_depth(rt: Runtime, batches: list[list], families: list, keys: set) -> list[list]:
    """The depth buckets ``batches`` with those of one (phase, depth, family) joined, in
    order; ``keys`` holds those triples (as many as ``batches``: nothing to join)."""
    if len(keys) == len(batches):
        return batches
    groups: dict = {}
    for nodes, f in zip(batches, families):
        groups.setdefault((nodes[0].phase, nodes[0].depth, f), []).append(nodes)
    return [_join(rt, parts, k[2]) for k, parts in groups.items()]


def _join(rt: Runtime, parts: list[list], sig) -> list:
    """One batch of ``parts`` (node lists of one level), each node of a lifted trace
    rewritten as a call of the trace whose signature is ``sig``."""
    for nodes in parts:
        n0 = nodes[0]
        if n0.sig is sig or n0.sig == sig or type(sig) in (padding.Family, padding.Loops):
            continue  # (a padded family's traces run as they are: executor._run_padded)
        block, key, inserts = n0.op.extra["lift"]
        trace = block.cache[key]
        consts = [(pos, executor.constant(rt, rt.hoisted[made])) for pos, made in inserts]
        op, info = trace.op, trace.info
        if _native is not None and type(nodes) is list and len(consts) <= 16:
            _native.relift(nodes, op, sig, info, consts)  # the loop below, in C
            continue
        for nd in nodes:
            inputs = list(nd.inputs)
            for pos, c in consts:
                inputs.insert(pos, c)
            nd.inputs, nd.op, nd.sig, nd.info = inputs, op, sig, info
    if len(parts) == 1:
        return parts[0]
    return [nd for nodes in parts for nd in nodes]


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
