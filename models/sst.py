"""Stanford Sentiment Treebank (SST) trees: parsing, vocabulary, tree helpers.

The shipped files ``models/data/{test,dev}.txt`` hold one PTB-bracketed tree per
line, every node labelled with a sentiment class 0..4, every internal node with
exactly two children::

    (3 (2 It) (4 (2 's) (3 lovely)))

>>> tree = parse_tree("(3 (2 It) (4 (2 's) (3 lovely)))")
>>> [leaf.word for leaf in leaves(tree)], height(tree), tree.right.label
(['It', "'s", 'lovely'], 2, 4)

Tokens are kept exactly as written (PTB escapes such as ``-LRB-`` included).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
SPLITS = ("test", "dev")

# An opening or closing bracket, or a run of anything else that is not a space.
_TOKEN = re.compile(r"\(|\)|[^\s()]+")


class Tree:
    """A node of a binary sentiment tree: a leaf holds a word, an internal node two children.

    ``word_id`` is filled in from a :class:`Vocab` (0, the unknown word, otherwise).
    """

    __slots__ = ("label", "left", "right", "word", "word_id")

    def __init__(
        self,
        label: int,
        word: str | None = None,
        left: Tree | None = None,
        right: Tree | None = None,
        word_id: int = 0,
    ):
        self.label = label
        self.word = word
        self.left = left
        self.right = right
        self.word_id = word_id

    @property
    def is_leaf(self) -> bool:
        return self.left is None

    def __repr__(self) -> str:
        if self.is_leaf:
            return f"({self.label} {self.word})"
        return f"({self.label} {self.left!r} {self.right!r})"


def parse_tree(line: str) -> Tree:
    """Parses one bracketed line into a :class:`Tree`; raises ValueError unless strictly binary."""
    tokens = _TOKEN.findall(line)
    # Each open bracket pushes [label, word, children]; its ")" turns it into a Tree.
    stack: list[list] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "(":
            stack.append([int(tokens[i + 1]), None, []])
            i += 2
            continue
        if token == ")":
            if not stack:
                raise ValueError(f"unbalanced ')' in SST line: {line[:80]!r}")
            label, word, children = stack.pop()
            if word is not None and not children:
                node = Tree(label, word=word)
            elif word is None and len(children) == 2:
                node = Tree(label, left=children[0], right=children[1])
            else:
                raise ValueError(f"SST node is neither a word nor binary: {line[:80]!r}")
            if not stack:
                if i != len(tokens) - 1:
                    raise ValueError(f"trailing text after SST tree: {line[:80]!r}")
                return node
            stack[-1][2].append(node)
        else:
            if not stack or stack[-1][1] is not None:
                raise ValueError(f"unexpected token {token!r} in SST line: {line[:80]!r}")
            stack[-1][1] = token
        i += 1
    raise ValueError(f"unbalanced '(' in SST line: {line[:80]!r}")


@functools.cache
def _split_lines(split: str) -> tuple[str, ...]:
    if split not in SPLITS:
        raise ValueError(f"unknown SST split {split!r}; expected one of {SPLITS}")
    text = (DATA_DIR / f"{split}.txt").read_text(encoding="utf-8")
    return tuple(line for line in text.splitlines() if line.strip())


def load_trees(
    split: str = "test", limit: int | None = None, vocab: Vocab | None = None
) -> list[Tree]:
    """The first ``limit`` trees (all when None) of an SST split, in file order.

    Every call returns freshly built trees; with ``vocab`` their leaves get word ids.
    """
    trees = [parse_tree(line) for line in _split_lines(split)[:limit]]
    if vocab is not None:
        for tree in trees:
            vocab.index(tree)
    return trees


def first_trees(batch: int, vocab: Vocab, split: str = "test") -> list[Tree]:
    """The first ``batch`` trees of ``split``, with word ids from ``vocab``."""
    if not 0 < batch <= len(_split_lines(split)):
        raise ValueError(
            f"batch must be in 1..{len(_split_lines(split))} for SST {split}, got {batch}"
        )
    return load_trees(split, limit=batch, vocab=vocab)


def leaves(tree: Tree) -> list[Tree]:
    """The leaves of ``tree`` from left to right."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        if node.is_leaf:
            out.append(node)
        else:
            todo += (node.right, node.left)  # left is popped first
    return out


def sentence_ids(tree: Tree) -> list[int]:
    """The word ids of the sentence of ``tree``, left to right."""
    return [leaf.word_id for leaf in leaves(tree)]


def height(tree: Tree) -> int:
    """Edges on the longest path down to a leaf: 0 for a leaf."""
    if tree.is_leaf:
        return 0
    return 1 + max(height(tree.left), height(tree.right))


def num_nodes(tree: Tree) -> int:
    """Number of nodes, leaves included (``2 * len(leaves(tree)) - 1`` for binary trees)."""
    if tree.is_leaf:
        return 1
    return 1 + num_nodes(tree.left) + num_nodes(tree.right)


class Vocab:
    """Word to id map; id 0 is the unknown word, the rest are ordered by falling frequency.

    >>> vocab = Vocab(["a", "b", "a", "c", "a", "b"], max_size=2)
    >>> len(vocab), vocab["a"], vocab["b"], vocab["c"], vocab.words[0]
    (3, 1, 2, 0, '<unk>')
    """

    UNK = "<unk>"

    def __init__(self, words: Iterable[str], max_size: int | None = None):
        counts = Counter(words)
        # Ties broken by the word itself so that the ids never depend on hash order.
        ranked = sorted(counts, key=lambda word: (-counts[word], word))[:max_size]
        self.words = [self.UNK, *ranked]
        self.ids = {word: i for i, word in enumerate(self.words)}

    @classmethod
    def from_trees(cls, trees: Iterable[Tree], max_size: int | None = None) -> Vocab:
        return cls((leaf.word for tree in trees for leaf in leaves(tree)), max_size)

    def __len__(self) -> int:
        return len(self.words)

    def __getitem__(self, word: str) -> int:
        return self.ids.get(word, 0)

    def index(self, tree: Tree) -> Tree:
        """Sets ``word_id`` on every leaf of ``tree`` (in place) and returns the tree."""
        for leaf in leaves(tree):
            leaf.word_id = self[leaf.word]
        return tree


@functools.cache
def split_vocab(split: str = "test", max_size: int | None = None) -> Vocab:
    """The vocabulary of a whole split, built once per process."""
    return Vocab.from_trees(load_trees(split), max_size)
