"""Doubly-recurrent neural network (Alvarez-Melis & Jaakkola, 2017): top-down tree generation.

Every node has an ancestral state ``h_a`` (from its parent) and a fraternal state
``h_f`` (from its previous sibling). The node cell combines them::

    h     = tanh(U_a h_a + U_f h_f + b)
    p     = sigmoid(u . h + c)        # two heads: p[0] = has children, p[1] = has a next sibling
    label = W_o h + b_o               # the node's label logits

A node gets children iff ``p[0] > 0.5`` and its depth is below ``MAX_DEPTH``; the
first child's ancestral state is ``tanh(W_a [h; h_a] + b_a)`` and its fraternal
state zero. A node gets a next sibling iff ``p[1] > 0.5`` and fewer than
``MAX_SIBLINGS`` siblings exist; the sibling shares ``h_a`` and gets
``h_f' = tanh(W_f [h; h_f] + b_f)``. The root has ``h_a = tanh(W_in x + b_in)``
for the instance's random input vector ``x``, ``h_f = 0`` and no siblings.

The decisions read tensor values (``.tolist()`` of ``p > 0.5``), so each instance
suspends at every node. The subtree under a node does not feed its later
siblings, so it is generated with :func:`acrobat.fork` while the sibling chain
goes on: subtrees of one instance, and of different instances, can batch.

With PyTorch's default init the state cells are contractive: all nodes of a tree
converge to one state and take the same decisions, so trees come out either as a
single node or full (121 nodes). At init, the state cells' weights are therefore
scaled by ``STATE_GAIN`` (past the edge of chaos, so that states keep varying
from node to node), the decision heads' weights by ``TOPOLOGY_GAIN``, and their
biases set to ``CHILD_BIAS`` and ``SIBLING_BIAS``. With depth cap 4 and 3
siblings, a batch of 64 then has trees of 1 to about 80 nodes, median about 15,
mean about 18, a few single nodes, for every seed tried (0 to 3) at both sizes.

The output of one instance is ``(logits, parents)``: the (nodes, NUM_LABELS)
label logits in preorder and, for each node, the preorder index of its parent
(-1 for the root) as Python ints.

>>> task = make_task("small", batch=2)
>>> logits, parents = task.fn.eager(task.inputs[0], **task.kwargs)
>>> logits.shape[0] == len(parents) and parents[0] == -1
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

import acrobat
from models.common import Task, seeded

SIZES = {"small": 256, "large": 512}
NUM_LABELS = 10
MAX_DEPTH = 4  # the root has depth 0; nodes at depth MAX_DEPTH get no children
MAX_SIBLINGS = 3  # at most this many children per node
STATE_GAIN = 3.0  # scales the state cells' random weights at init
TOPOLOGY_GAIN = 2.0  # scales the decision heads' random weights at init
CHILD_BIAS = 1.0  # the has-children logit's bias at init
SIBLING_BIAS = 0.0  # the has-sibling logit's bias at init


class DRNN(nn.Module):
    def __init__(self, hidden: int, num_labels: int = NUM_LABELS):
        super().__init__()
        self.hidden = hidden
        self.root = nn.Linear(hidden, hidden)  # input vector -> root's ancestral state
        self.pred_a = nn.Linear(hidden, hidden)  # U_a and b
        self.pred_f = nn.Linear(hidden, hidden, bias=False)  # U_f
        self.topology = nn.Linear(hidden, 2)  # logits of (has children, has next sibling)
        self.label = nn.Linear(hidden, num_labels)
        self.ancestral = nn.Linear(2 * hidden, hidden)  # [h; h_a] -> first child's h_a
        self.fraternal = nn.Linear(2 * hidden, hidden)  # [h; h_f] -> next sibling's h_f
        with torch.no_grad():
            for layer in (self.pred_a, self.pred_f, self.ancestral, self.fraternal):
                layer.weight *= STATE_GAIN
            self.topology.weight *= TOPOLOGY_GAIN
            self.topology.bias.copy_(torch.tensor([CHILD_BIAS, SIBLING_BIAS]))


class Node(NamedTuple):
    """A generated node: its label logits and its children, in order."""

    logits: torch.Tensor
    children: list


def root_cell(model: DRNN, x: torch.Tensor) -> torch.Tensor:
    """The root's ancestral state from the input vector."""
    return torch.tanh(model.root(x))


def node_cell(
    model: DRNN, h_a: torch.Tensor, h_f: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, decisions, logits) of one node; ``decisions`` is the bool pair (children, sibling)."""
    h = torch.tanh(model.pred_a(h_a) + model.pred_f(h_f))
    p = torch.sigmoid(model.topology(h))
    return h, p > 0.5, model.label(h)


def ancestral_cell(model: DRNN, h: torch.Tensor, h_a: torch.Tensor) -> torch.Tensor:
    """The ancestral state of the children of a node with state ``h``."""
    return torch.tanh(model.ancestral(torch.cat([h, h_a])))


def fraternal_cell(model: DRNN, h: torch.Tensor, h_f: torch.Tensor) -> torch.Tensor:
    """The fraternal state of the next sibling of a node with state ``h``."""
    return torch.tanh(model.fraternal(torch.cat([h, h_f])))


class Cells(NamedTuple):
    root: Callable
    node: Callable
    ancestral: Callable
    fraternal: Callable


PLAIN = Cells(root_cell, node_cell, ancestral_cell, fraternal_cell)
BLOCKS = Cells(*(acrobat.block(cell) for cell in PLAIN))


def siblings(model: DRNN, cells: Cells, h_a: torch.Tensor, depth: int, limit: int) -> list[Node]:
    """A chain of at most ``limit`` siblings sharing ``h_a``, each with its subtree."""
    h_f = torch.zeros(model.hidden)
    chain = []  # (logits, future of the children or None)
    while True:
        h, decisions, logits = cells.node(model, h_a, h_f)
        has_children, has_sibling = decisions.tolist()  # suspends until the values exist
        children = None
        if has_children and depth < MAX_DEPTH:
            child_h_a = cells.ancestral(model, h, h_a)
            children = acrobat.fork(siblings, model, cells, child_h_a, depth + 1, MAX_SIBLINGS)
        chain.append((logits, children))
        if not has_sibling or len(chain) == limit:
            break
        h_f = cells.fraternal(model, h, h_f)
    return [Node(logits, [] if kids is None else kids.result()) for logits, kids in chain]


def preorder(nodes: list[Node], parent: int, logits: list, parents: list[int]) -> None:
    """Appends the nodes of a forest in preorder to ``logits`` and ``parents``."""
    for node in nodes:
        index = len(parents)
        logits.append(node.logits)
        parents.append(parent)
        preorder(node.children, index, logits, parents)


def generate(x: torch.Tensor, model: DRNN, cells: Cells) -> tuple[torch.Tensor, list[int]]:
    """(preorder label logits, preorder parent indices) of the tree generated from ``x``."""
    root = siblings(model, cells, cells.root(model, x), depth=0, limit=1)
    logits: list[torch.Tensor] = []
    parents: list[int] = []
    preorder(root, -1, logits, parents)
    return torch.stack(logits), parents


@acrobat.autobatch
def generate_blocks(x: torch.Tensor, model: DRNN) -> tuple[torch.Tensor, list[int]]:
    """The tree generated from ``x``, each cell an ``acrobat.block``."""
    return generate(x, model, BLOCKS)


@acrobat.autobatch
def generate_plain(x: torch.Tensor, model: DRNN) -> tuple[torch.Tensor, list[int]]:
    """Same as :func:`generate_blocks` with the cells' ops recorded one by one."""
    return generate(x, model, PLAIN)


def make_inputs(batch: int, hidden: int, seed: int) -> list[torch.Tensor]:
    """``batch`` standard normal input vectors."""
    generator = torch.Generator().manual_seed(seed)
    return list(
        torch.randn(batch, hidden, generator=generator, device="cpu")
        .to(torch.get_default_device())
        .unbind(0)
    )


def make_task(size: str, batch: int, seed: int = 0, blocks: bool = True) -> Task:
    """``batch`` random input vectors and a DRNN of the given size."""
    hidden = SIZES[size]
    with seeded(seed):
        model = DRNN(hidden).eval()
    inputs = make_inputs(batch, hidden, seed)
    fn = generate_blocks if blocks else generate_plain
    return Task("drnn", size, batch, fn, inputs, {"model": model}, model, seed, blocks)
