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
from dataclasses import dataclass

import numpy as np

from gptlab.data.tokenizers import word_split

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
    """One chunk of one epoch's text after subsampling: the kept word ids, their documents, the window radius
    drawn at each position (1..window: word2vec.c shrinks the window by a random amount at every position,
    which weights near words more than far ones), ``words_before`` (words of the vocabulary in the chunk
    before each kept position, then the chunk's total: what a batch covers, before subsampling),
    ``positions`` (each kept word's place in the whole corpus) and the number of batches of ``batch_words``
    centre words."""

    epoch: int
    ids: np.ndarray  # (n_kept,)
    docs: np.ndarray  # (n_kept,)
    radius: np.ndarray  # (n_kept,)
    n_batches: int
    chunk: int = 0
    words_before: np.ndarray | None = None  # (n_kept + 1,)
    positions: np.ndarray | None = None  # (n_kept,)
    context: np.ndarray | None = None  # (n_kept, 2 * window) int32: context_matrix of the whole chunk


def plan_chunk(
    ids: np.ndarray,
    keep_prob: np.ndarray,
    window: int,
    batch_words: int,
    seed: int,
    epoch: int,
    chunk: int = 0,
    start: int = 0,
) -> EpochPlan:
    """Subsample one chunk of the corpus (vocabulary ids, negative markers for words outside it and for
    document ends) for one epoch, deterministically from (seed, epoch, chunk), so that a resumed run sees the
    same text as an uninterrupted one. Windows never cross a document end or the chunk's edges."""
    rng = np.random.default_rng([seed, epoch, chunk])
    draws = rng.random(len(ids))
    in_vocab = ids >= 0
    docs = np.cumsum(ids == -2)
    kept = in_vocab & (draws < keep_prob[np.maximum(ids, 0)])
    where = np.flatnonzero(kept)
    words = np.concatenate([[0], np.cumsum(in_vocab)])
    radius = window - rng.integers(0, window, size=len(where))
    n_batches = -(-len(where) // batch_words)
    plan = EpochPlan(
        epoch,
        ids[where].astype(np.int64),
        docs[where],
        radius,
        n_batches,
        chunk,
        np.concatenate([words[where], [words[-1]]]),
        where + start,
    )
    # the windows of the whole chunk at once: a few operations on long arrays instead of many on short ones
    plan.context = context_matrix(plan, 0, len(where), window).astype(np.int32)
    return plan


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
