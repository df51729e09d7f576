"""Model code as people write it, not as acrobat's own models do: the classic Child-Sum
TreeLSTM (Tai et al., 2015) in the style of its widely copied PyTorch port, a module whose
``forward`` recurses over a tree object, stores each node's state on the node, reads rows
of a per-sentence input matrix by position, makes zero states with ``new_zeros``, and calls a
``node_forward`` method with ``torch.split``, ``.repeat`` and ``size()``. Run batched it must
equal the eager loop, with every cell call one node."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import acrobat
from tests.helpers import check_grads, check_map


class Tree:
    def __init__(self, idx):
        self.idx = idx
        self.children = []
        self.num_children = 0
        self.state = None

    def add_child(self, child):
        self.children.append(child)
        self.num_children += 1


class ChildSumTreeLSTM(nn.Module):
    def __init__(self, in_dim, mem_dim):
        super().__init__()
        self.in_dim = in_dim
        self.mem_dim = mem_dim
        self.ioux = nn.Linear(self.in_dim, 3 * self.mem_dim)
        self.iouh = nn.Linear(self.mem_dim, 3 * self.mem_dim)
        self.fx = nn.Linear(self.in_dim, self.mem_dim)
        self.fh = nn.Linear(self.mem_dim, self.mem_dim)

    def node_forward(self, inputs, child_c, child_h):
        child_h_sum = torch.sum(child_h, dim=0, keepdim=True)
        iou = self.ioux(inputs) + self.iouh(child_h_sum)
        i, o, u = torch.split(iou, iou.size(1) // 3, dim=1)
        i, o, u = torch.sigmoid(i), torch.sigmoid(o), torch.tanh(u)
        f = torch.sigmoid(self.fh(child_h) + self.fx(inputs).repeat(len(child_h), 1))
        fc = torch.mul(f, child_c)
        c = torch.mul(i, u) + torch.sum(fc, dim=0, keepdim=True)
        h = torch.mul(o, torch.tanh(c))
        return c, h

    def forward(self, tree, inputs):
        for idx in range(tree.num_children):
            self.forward(tree.children[idx], inputs)
        if tree.num_children == 0:
            child_c = inputs[0].detach().new_zeros(1, self.mem_dim)
            child_h = inputs[0].detach().new_zeros(1, self.mem_dim)
        else:
            child_c, child_h = zip(*map(lambda x: x.state, tree.children))
            child_c, child_h = torch.cat(child_c, dim=0), torch.cat(child_h, dim=0)
        tree.state = self.node_forward(inputs[tree.idx].unsqueeze(0), child_c, child_h)
        return tree.state


MODEL = ChildSumTreeLSTM(5, 4)


@acrobat.autobatch
def sentence_state(example, model):
    tree, inputs = example  # a tree object and its sentence's word vectors
    _, h = model(tree, inputs)
    return h.squeeze(0)


def build(parents: list[int]) -> Tree:
    """A tree of len(parents) + 1 nodes: node k + 1's parent is ``parents[k]`` (< k + 1)."""
    nodes = [Tree(0)]
    for k, p in enumerate(parents):
        nodes.append(Tree(k + 1))
        nodes[p % (k + 1)].add_child(nodes[-1])
    return nodes[0]


@settings(max_examples=15, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 30), max_size=8), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_child_sum_treelstm_matches_eager_with_one_node_per_cell(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    trees = [build(parents) for parents in shapes]
    inputs = [torch.randn(len(p) + 1, 5, generator=gen) for p in shapes]
    with torch.no_grad():
        stats = check_map(sentence_state, list(zip(trees, inputs)), model=MODEL)
    assert stats.by_op["block:ChildSumTreeLSTM.node_forward"][1] == sum(len(p) + 1 for p in shapes)


def test_child_sum_treelstm_trains_like_eager():
    gen = torch.Generator().manual_seed(0)
    shapes = [[0, 0, 1], [], [0, 1, 1, 0, 3]]
    examples = [(build(p), torch.randn(len(p) + 1, 5, generator=gen)) for p in shapes]
    model = ChildSumTreeLSTM(5, 4)
    check_grads(sentence_state, examples, model, model=model)


SENTENCE = torch.nn.Linear(3, 3)


@acrobat.autobatch
def encode_document(doc, lin=SENTENCE):
    """A document's sentences padded into one tensor (nn.utils.rnn.pad_sequence), pooled
    per sentence, then over the document."""
    padded = torch.nn.utils.rnn.pad_sequence([torch.tanh(lin(s)) for s in doc], batch_first=True)
    return padded.max(1).values.mean(0)


@given(st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=4), min_size=1, max_size=5))
def test_pad_sequence_of_an_instances_own_sentences(docs):
    g = torch.Generator().manual_seed(len(docs))
    data = [[torch.randn(n, 3, generator=g) for n in doc] for doc in docs]
    with torch.no_grad():
        check_map(encode_document, data)
    check_grads(encode_document, data, SENTENCE, atol=1e-5)
