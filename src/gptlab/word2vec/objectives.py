"""What word2vec predicts the target word with (``word2vec.objective``): each objective turns a batch's target
words into rows of the output table to score, a label for each (1: should score high, 0: low) and a mask.

The score of an output row ``u`` against the hidden vector ``h`` is ``s = u . h``; every sigmoid objective
maximises ``sum mask * [label * log sigma(s) + (1 - label) * log sigma(-s)]``, so one batched step serves
both negative sampling and hierarchical softmax. The full softmax normalises over the whole vocabulary and
has its own step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gptlab.errors import ConfigError
from gptlab.word2vec import sampling

OBJECTIVES = ("negative", "hierarchical", "softmax")
# Above this vocabulary the full softmax is refused: ``scripts/benchmark_word2vec.py --softmax`` measured
# 1,300 centre words/s at 2,000 words (0.9% of negative sampling's speed) and 480 at 5,000 on one core here.
MAX_SOFTMAX_VOCAB = 2_000
NOISE_TABLE = 1 << 22


@dataclass
class Targets:
    """(G, M) output rows, labels and mask for G target words."""

    rows: np.ndarray  # int64
    labels: np.ndarray  # float32
    mask: np.ndarray  # float32


class NegativeSampling:
    """Negative sampling (Mikolov et al. 2013b, "Distributed Representations of Words and Phrases and their
    Compositionality"): the target's output vector should score high and ``negatives`` noise words, drawn from
    the unigram distribution to the 3/4 power, low. The noise words are drawn once per window and shared by
    all of its pairs, which makes a window one small matrix product (Ji et al. 2016, "Parallelizing Word2Vec
    in Shared and Distributed Memory"); a noise word equal to the target is masked, as word2vec.c skips it."""

    name = "negative"

    def __init__(self, counts: np.ndarray, negatives: int, noise_power: float = 0.75) -> None:
        self.negatives = negatives
        self.cdf = sampling.noise_cdf(counts, noise_power)
        self.output_rows = len(counts)
        # word2vec.c's unigram table: word w fills its share of the noise distribution's cells, so that a
        # draw is one lookup
        edges = np.round(self.cdf * NOISE_TABLE).astype(np.int64)
        self.table = np.repeat(np.arange(len(counts), dtype=np.int32), np.diff(edges, prepend=0))

    def width(self, target: np.ndarray) -> None:
        return None

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """(n, negatives) noise words for n windows."""
        return self.table[rng.integers(0, NOISE_TABLE, size=(n, self.negatives))]

    def outputs(self, target: np.ndarray, draws: np.ndarray | None) -> Targets:
        """The windows' output rows: the target, then its noise words (``draws``)."""
        assert draws is not None
        g = len(target)
        rows = np.empty((g, 1 + self.negatives), dtype=np.int64)
        rows[:, 0] = target
        rows[:, 1:] = draws
        labels = np.zeros(rows.shape, dtype=np.float32)
        labels[:, 0] = 1.0
        mask = np.ones(rows.shape, dtype=np.float32)
        np.not_equal(draws, target[:, None], out=mask[:, 1:])
        return Targets(rows, labels, mask)

    def targets(self, target: np.ndarray, rng: np.random.Generator) -> Targets:
        return self.outputs(target, self.draw(len(target), rng))


def huffman_codes(counts: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """(codes, points) of a Huffman tree over ``counts`` (sorted most frequent first), built as word2vec.c's
    ``CreateBinaryTree`` builds it: the two least frequent nodes are merged, the second of them taking bit 1
    (a tie goes to the merged node); inner node ``V + a`` is the a-th merge and its output row is ``a``, so
    the root is row ``V - 2``. ``codes[w]`` are the bits from the root down to word w; ``points[w]`` the
    output rows of the inner nodes on that path, root first."""
    v = len(counts)
    if v < 2:
        return [[0]], [[0]]
    count = np.concatenate([np.asarray(counts, dtype=np.float64), np.full(v, 1e15)])
    parent = np.zeros(2 * v, dtype=np.int64)
    binary = np.zeros(2 * v, dtype=np.int64)
    pos1, pos2 = v - 1, v
    for a in range(v - 1):
        picked = []
        for _ in range(2):
            if pos1 >= 0 and count[pos1] < count[pos2]:
                picked.append(pos1)
                pos1 -= 1
            else:
                picked.append(pos2)
                pos2 += 1
        count[v + a] = count[picked[0]] + count[picked[1]]
        parent[picked[0]] = parent[picked[1]] = v + a
        binary[picked[1]] = 1
    root = 2 * v - 2
    codes, points = [], []
    for w in range(v):
        bits, nodes = [], []
        b = w
        while b != root:
            bits.append(int(binary[b]))
            b = int(parent[b])
            nodes.append(b - v)
        codes.append(bits[::-1])
        points.append(nodes[::-1])
    return codes, points


class HierarchicalSoftmax:
    """Hierarchical softmax (Morin & Bengio 2005, "Hierarchical Probabilistic Neural Network Language Model";
    over a Huffman tree as in Mikolov et al. 2013a/b): p(w | h) is the product of the sigmoid decisions on the
    path from the root to w, ``prod_j sigma((1 - 2 code_j) u_{n_j} . h)``, about log2 V output rows per target
    instead of V. In the labels' terms: inner node n_j should score high where code_j is 0."""

    name = "hierarchical"

    def __init__(
        self, counts: np.ndarray, tree: tuple[list[list[int]], list[list[int]]] | None = None
    ) -> None:
        """``tree``: (codes, points) of another construction of the tree (e.g. gensim's, to compare with it);
        by default word2vec.c's (``huffman_codes``)."""
        codes, points = tree if tree is not None else huffman_codes(counts)
        depth = max(len(c) for c in codes)
        v = len(counts)
        self.rows = np.zeros((v, depth), dtype=np.int64)
        self.labels = np.zeros((v, depth), dtype=np.float32)
        self.mask = np.zeros((v, depth), dtype=np.float32)
        for w, (c, p) in enumerate(zip(codes, points)):
            self.rows[w, : len(p)] = p
            self.labels[w, : len(c)] = 1 - np.asarray(c)
            self.mask[w, : len(c)] = 1
        self.output_rows = max(v - 1, 1)
        self.depth = depth
        self.code_length = np.array([len(c) for c in codes], dtype=np.int64)

    def width(self, target: np.ndarray) -> np.ndarray:
        """Output rows each target needs (its path length): windows are batched by it."""
        return self.code_length[target]

    def draw(self, n: int, rng: np.random.Generator) -> None:
        return None

    def outputs(self, target: np.ndarray, draws: np.ndarray | None = None) -> Targets:
        """The windows' output rows: the inner nodes on each target's path, as many columns as the longest
        path of the batch."""
        m = int(self.code_length[target].max()) if len(target) else 1
        return Targets(self.rows[target, :m], self.labels[target, :m], self.mask[target, :m])

    def targets(self, target: np.ndarray, rng: np.random.Generator) -> Targets:
        return self.outputs(target)


class FullSoftmax:
    """The softmax over the whole vocabulary, the model as first posed (Mikolov et al. 2013a, "Efficient
    Estimation of Word Representations in Vector Space"): ``p(t | h) = exp(u_t . h) / sum_w exp(u_w . h)``.
    Exact, and V dot products per pair: only for small vocabularies (at most ``MAX_SOFTMAX_VOCAB``)."""

    name = "softmax"

    def __init__(self, vocab_size: int) -> None:
        if vocab_size > MAX_SOFTMAX_VOCAB:
            raise ConfigError(
                f"word2vec.objective=softmax over a vocabulary of {vocab_size:,} words: the full softmax costs "
                f"{vocab_size:,} dot products per pair and is refused above {MAX_SOFTMAX_VOCAB:,} words. Use "
                "word2vec.objective=hierarchical (normalised over a tree: about log2 V per pair) or negative, or shrink the "
                "vocabulary with a larger word2vec.min_count."
            )
        self.output_rows = vocab_size

    def width(self, target: np.ndarray) -> None:
        return None

    def draw(self, n: int, rng: np.random.Generator) -> None:
        return None

    def outputs(self, target: np.ndarray, draws: np.ndarray | None = None) -> Targets:
        ones = np.ones((len(target), 1), dtype=np.float32)
        return Targets(target[:, None], ones, ones)

    def targets(self, target: np.ndarray, rng: np.random.Generator) -> Targets:
        return self.outputs(target)


Objective = NegativeSampling | HierarchicalSoftmax | FullSoftmax


def build(name: str, counts: np.ndarray, negatives: int, noise_power: float) -> Objective:
    if name == "negative":
        return NegativeSampling(counts, negatives, noise_power)
    if name == "hierarchical":
        return HierarchicalSoftmax(counts)
    if name == "softmax":
        return FullSoftmax(len(counts))
    raise ConfigError(
        f"word2vec.objective={name!r} is not one of {OBJECTIVES} (e.g. word2vec.objective=negative)."
    )
