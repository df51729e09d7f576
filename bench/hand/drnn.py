"""Hand-batched DRNN: every open sibling chain of every instance advances one node per step.

The frontier holds the chains that will generate a node in the next step: a root
per instance at first, then, after each step, the continuing sibling chains and
a new chain for the children of every node that decided to have some. One step
runs the node cell on the whole frontier at once, reads all decisions with one
``tolist()``, and computes the new chains' states in two more batched calls
(ancestral for new child chains, fraternal for continuing ones). The trees are
assembled from parent pointers at the end, in the eager preorder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common import Task
from models.drnn import DRNN, MAX_DEPTH, MAX_SIBLINGS


@dataclass
class Chain:
    """A sibling chain waiting for its next node."""

    instance: int
    parent: int  # global id of the parent node, -1 for a root
    depth: int
    made: int  # nodes generated in this chain so far
    limit: int


def preorder(node: int, children: list[list[int]], order: list[int]) -> None:
    order.append(node)
    for child in children[node]:
        preorder(child, children, order)


@torch.no_grad()
def run(task: Task) -> list[tuple[torch.Tensor, list[int]]]:
    """[(preorder logits, preorder parents)] for ``task.inputs``, equal to the eager outputs."""
    model: DRNN = task.model
    batch = len(task.inputs)
    h_a = torch.tanh(model.root(torch.stack(task.inputs)))
    h_f = torch.zeros_like(h_a)
    frontier = [Chain(b, -1, 0, 0, 1) for b in range(batch)]

    logits_steps: list[torch.Tensor] = []
    parents: list[int] = []  # per global node id, in creation order
    roots: list[int] = [0] * batch
    while frontier:
        h = torch.tanh(model.pred_a(h_a) + model.pred_f(h_f))
        decisions = (torch.sigmoid(model.topology(h)) > 0.5).tolist()
        logits_steps.append(model.label(h))

        child_rows, child_chains, sibling_rows, sibling_chains = [], [], [], []
        for row, (chain, (has_children, has_sibling)) in enumerate(zip(frontier, decisions)):
            node = len(parents)
            parents.append(chain.parent)
            if chain.parent < 0:
                roots[chain.instance] = node
            if has_children and chain.depth < MAX_DEPTH:
                child_rows.append(row)
                child_chains.append(Chain(chain.instance, node, chain.depth + 1, 0, MAX_SIBLINGS))
            if has_sibling and chain.made + 1 < chain.limit:
                sibling_rows.append(row)
                chain.made += 1
                sibling_chains.append(chain)

        parts_a, parts_f = [], []
        if child_rows:
            rows = torch.tensor(child_rows)
            h_rows, h_a_rows = h[rows], h_a[rows]
            parts_a.append(torch.tanh(model.ancestral(torch.cat([h_rows, h_a_rows], dim=1))))
            parts_f.append(torch.zeros_like(h_rows))
        if sibling_rows:
            rows = torch.tensor(sibling_rows)
            h_rows, h_f_rows = h[rows], h_f[rows]
            parts_a.append(h_a[rows])
            parts_f.append(torch.tanh(model.fraternal(torch.cat([h_rows, h_f_rows], dim=1))))
        frontier = child_chains + sibling_chains
        if frontier:
            h_a, h_f = torch.cat(parts_a), torch.cat(parts_f)

    logits = torch.cat(logits_steps)
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)  # creation order = sibling order
    outputs = []
    for root in roots:
        order: list[int] = []
        preorder(root, children, order)
        index = {node: i for i, node in enumerate(order)}
        tree_parents = [index[parents[node]] if parents[node] >= 0 else -1 for node in order]
        outputs.append((logits[torch.tensor(order)], tree_parents))
    return outputs
