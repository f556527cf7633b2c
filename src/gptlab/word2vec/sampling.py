"""What word2vec trains on: words, a frequency-sorted vocabulary, frequent-word subsampling, dynamic windows and
negatives drawn from the unigram distribution raised to the 3/4 power.

Mikolov et al. 2013, "Efficient Estimation of Word Representations in Vector Space" (CBOW, skip-gram) and
"Distributed Representations of Words and Phrases and their Compositionality" (negative sampling, subsampling).
Where the papers leave a detail open, the reference implementation (word2vec.c, and gensim which follows it) is
followed, so that results can be compared with gensim: the subsampling formula, the window shrunk by a random
amount at every position, and words dropped by subsampling removed before the windows are taken.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from gptlab.data.tokenizers import word_split
from gptlab.errors import DataError

_HAS_WORD_CHARACTER = re.compile(r"\w")


def tokenize(text: str, lowercase: bool = True, keep_punctuation: bool = False) -> list[str]:
    """The project's word tokenizer (``gptlab.data.tokenizers.word_split``), optionally lower-cased; tokens
    without a letter or digit (punctuation) are dropped unless ``keep_punctuation``."""
    words = word_split(text.lower() if lowercase else text)
    if keep_punctuation:
        return words
    return [w for w in words if _HAS_WORD_CHARACTER.search(w)]


@dataclass
class Vocabulary:
    """Words sorted by count, most frequent first (ties alphabetically): id 0 is the most frequent word, as in
    word2vec.c and gensim, and the order of the word2vec text format."""

    words: list[str]
    counts: np.ndarray  # (V,) int64

    def __post_init__(self) -> None:
        self.index = {w: i for i, w in enumerate(self.words)}

    def __len__(self) -> int:
        return len(self.words)

    @classmethod
    def build(cls, documents: Iterable[list[str]], min_count: int) -> Vocabulary:
        counter: Counter[str] = Counter()
        for words in documents:
            counter.update(words)
        kept = sorted(((w, c) for w, c in counter.items() if c >= min_count), key=lambda wc: (-wc[1], wc[0]))
        if not kept:
            raise DataError(
                f"No word occurs word2vec.min_count={min_count} times in the corpus ({sum(counter.values())} "
                f"words, {len(counter)} distinct): lower word2vec.min_count or give more text."
            )
        return cls([w for w, _ in kept], np.array([c for _, c in kept], dtype=np.int64))

    def encode(self, documents: Iterable[list[str]]) -> tuple[np.ndarray, np.ndarray]:
        """The corpus as one flat array of word ids and, beside it, the document each position belongs to.
        Words outside the vocabulary are left out (as word2vec.c does), so windows close over them."""
        ids: list[int] = []
        docs: list[int] = []
        for d, words in enumerate(documents):
            row = [self.index[w] for w in words if w in self.index]
            ids.extend(row)
            docs.extend([d] * len(row))
        return np.asarray(ids, dtype=np.int64), np.asarray(docs, dtype=np.int64)


def keep_probabilities(counts: np.ndarray, sample: float) -> np.ndarray:
    """The chance that each occurrence of a word is kept. The paper discards a word with probability
    1 - sqrt(t / f); word2vec.c (and gensim) keep it with probability (sqrt(f / t) + 1) * t / f, f the word's
    share of the corpus and t = ``sample``, which is what this returns. ``sample <= 0`` keeps every word."""
    counts = np.asarray(counts, dtype=np.float64)
    if sample <= 0:
        return np.ones_like(counts)
    threshold = sample * counts.sum()
    return np.minimum(1.0, (np.sqrt(counts / threshold) + 1.0) * threshold / counts)


def noise_cdf(counts: np.ndarray, power: float = 0.75) -> np.ndarray:
    """The cumulative noise distribution P_n(w) ~ count(w)^power (3/4 in the paper): rarer words are drawn
    more often than their frequency, frequent ones less."""
    weights = np.asarray(counts, dtype=np.float64) ** power
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def draw_negatives(cdf: np.ndarray, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Word ids drawn from the noise distribution (inverse-CDF sampling)."""
    return np.minimum(np.searchsorted(cdf, rng.random(shape), side="right"), len(cdf) - 1)


@dataclass
class EpochPlan:
    """One epoch's text after subsampling: the kept word ids, their documents, the window radius drawn at each
    position (1..window: word2vec.c shrinks the window by a random amount at every position, which weights
    near words more than far ones), and the number of batches of ``batch_words`` centre words."""

    epoch: int
    ids: np.ndarray  # (n_kept,)
    docs: np.ndarray  # (n_kept,)
    radius: np.ndarray  # (n_kept,)
    n_batches: int


def plan_epoch(
    ids: np.ndarray,
    docs: np.ndarray,
    keep_prob: np.ndarray,
    window: int,
    batch_words: int,
    seed: int,
    epoch: int,
) -> EpochPlan:
    """Subsample the corpus for one epoch, deterministically from (seed, epoch), so a resumed run sees the
    same text as an uninterrupted one."""
    rng = np.random.default_rng([seed, epoch])
    kept = rng.random(len(ids)) < keep_prob[ids]
    k_ids, k_docs = ids[kept], docs[kept]
    radius = window - rng.integers(0, window, size=len(k_ids))
    n_batches = max(1, -(-len(k_ids) // batch_words))
    return EpochPlan(epoch, k_ids, k_docs, radius, n_batches)


def context_matrix(plan: EpochPlan, start: int, stop: int, window: int) -> np.ndarray:
    """(stop - start, 2 * window) context word ids of the centre positions start..stop-1, -1 where the slot is
    empty (beyond the drawn radius, before or after the document, outside the corpus). Columns: offsets -window
    .. -1, then 1 .. window."""
    n = len(plan.ids)
    centre = np.arange(start, stop)
    out = np.full((stop - start, 2 * window), -1, dtype=np.int64)
    offsets = [*range(-window, 0), *range(1, window + 1)]
    for col, off in enumerate(offsets):
        other = centre + off
        inside = (other >= 0) & (other < n)
        other_c = np.clip(other, 0, n - 1)
        valid = inside & (plan.radius[centre] >= abs(off)) & (plan.docs[other_c] == plan.docs[centre])
        out[valid, col] = plan.ids[other_c[valid]]
    return out


@dataclass
class Batch:
    """What one optimizer step trains on. skip-gram: ``inputs`` (N,) centre words, ``targets`` (N,) one
    context word each. CBOW: ``inputs`` (N, 2 * window) context words (-1: empty), ``targets`` (N,) the
    centre words. ``negatives`` (N, K). ``words``: corpus positions this batch covers (before subsampling);
    ``progress``: the share of the whole training done before it (drives the learning-rate decay)."""

    inputs: np.ndarray
    targets: np.ndarray
    negatives: np.ndarray
    words: float
    progress: float


def make_batch(
    plan: EpochPlan,
    index: int,
    mode: str,
    window: int,
    batch_words: int,
    cdf: np.ndarray,
    negatives: int,
    seed: int,
    corpus_words: int,
    epochs: int,
) -> Batch:
    """Batch ``index`` of an epoch: the centre words ``index * batch_words`` up to the next batch, with their
    windows, and negatives drawn from (seed, epoch, index)."""
    start = index * batch_words
    stop = min(start + batch_words, len(plan.ids))
    ctx = context_matrix(plan, start, stop, window)
    centre = plan.ids[start:stop]
    if mode == "skipgram":
        rows, cols = np.nonzero(ctx >= 0)
        inputs, targets = centre[rows], ctx[rows, cols]
    else:
        has_context = (ctx >= 0).any(axis=1)
        inputs, targets = ctx[has_context], centre[has_context]
    rng = np.random.default_rng([seed, plan.epoch, index, 1])
    neg = draw_negatives(cdf, (len(targets), negatives), rng)
    words = corpus_words / plan.n_batches
    progress = (plan.epoch + index / plan.n_batches) / epochs if epochs > 0 else 0.0
    return Batch(inputs, targets, neg, words, min(progress, 1.0))
