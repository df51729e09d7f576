"""Matrix-vector recursive neural network, MV-RNN (Socher et al., 2012), over SST trees.

Every word and every phrase is a pair (vector a of shape (n,), matrix A of shape
(n, n)). Two children (a, A) and (b, B) compose into::

    p = tanh(W @ cat([B @ a, A @ b]) + bias)      W: (n, 2n)
    P = W_M @ cat([A, B], dim=0)                  W_M: (n, 2n), so P is (n, n)

The result is the root vector p and 5-class logits from it.

>>> task = make_task("small", batch=2)
>>> p, logits = task.fn.eager(task.inputs[0], **task.kwargs)
>>> tuple(p.shape), tuple(logits.shape)
((64,), (5,))
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import acrobat
from models.common import Task, seeded
from models.sst import Tree, first_trees, split_vocab

SIZES = {"small": 64, "large": 128}  # n: word vector size (word matrices are n x n)
NUM_CLASSES = 5
MAX_VOCAB = 1000  # most frequent test words, plus UNK: bounds the n*n word matrices


class MVRNN(nn.Module):
    def __init__(self, vocab_size: int, dim: int, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.dim = dim
        eye = torch.eye(dim)
        self.vec = nn.Embedding(vocab_size, dim)
        # Word matrices, flattened row-major; near the identity so that products of
        # matrices along a deep tree neither explode nor vanish.
        matrices = eye.flatten() + 0.01 * torch.randn(vocab_size, dim * dim)
        self.mat = nn.Embedding.from_pretrained(matrices, freeze=False)
        self.compose = nn.Linear(2 * dim, dim)  # W and bias
        # W_M, near [I I] / 2: P starts close to the mean of the children's matrices.
        self.compose_matrix = nn.Parameter(
            0.5 * torch.cat([eye, eye], 1) + 0.01 * torch.randn(dim, 2 * dim)
        )
        self.out = nn.Linear(dim, num_classes)


def word(model: MVRNN, word_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(vector, matrix) of a word."""
    index = torch.tensor(word_id)
    return model.vec(index), model.mat(index).reshape(model.dim, model.dim)


def compose_cell(
    model: MVRNN, a: torch.Tensor, A: torch.Tensor, b: torch.Tensor, B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, P) of a phrase from its left child (a, A) and right child (b, B)."""
    p = torch.tanh(model.compose(torch.cat([B @ a, A @ b])))
    P = model.compose_matrix @ torch.cat([A, B], dim=0)
    return p, P


def phrase(tree: Tree, model: MVRNN, compose: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """(vector, matrix) of the phrase spanned by ``tree``, by recursion."""
    if tree.is_leaf:
        return word(model, tree.word_id)
    a, A = phrase(tree.left, model, compose)
    b, B = phrase(tree.right, model, compose)
    return compose(model, a, A, b, B)


compose_block = acrobat.block(compose_cell)


@acrobat.autobatch
def encode_blocks(tree: Tree, model: MVRNN) -> tuple[torch.Tensor, torch.Tensor]:
    """Root vector and logits of one tree, the composition an ``acrobat.block``."""
    p, _ = phrase(tree, model, compose_block)
    with acrobat.phase("output"):  # every root's classifier: one batch
        return p, model.out(p)


@acrobat.autobatch
def encode_plain(tree: Tree, model: MVRNN) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`encode_blocks` with the composition's ops recorded one by one."""
    p, _ = phrase(tree, model, compose_cell)
    with acrobat.phase("output"):  # every root's classifier: one batch
        return p, model.out(p)


def make_task(size: str, batch: int, seed: int = 0, blocks: bool = True) -> Task:
    """The first ``batch`` SST test trees and an MV-RNN of the given size."""
    vocab = split_vocab("test", max_size=MAX_VOCAB)
    trees = first_trees(batch, vocab)
    with seeded(seed):
        model = MVRNN(len(vocab), SIZES[size]).eval()
    fn = encode_blocks if blocks else encode_plain
    return Task("mvrnn", size, batch, fn, trees, {"model": model}, model, seed, blocks)
