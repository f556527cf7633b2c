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

# word_split's separators as spaces ("_" is a separator with a word character: a word of its own)
_SEPARATORS = str.maketrans({c: " " for c in ",.:;?!\"()'"} | {"_": " _ "})
_WORD = re.compile(r"\S*\w\S*")  # a whitespace-separated token with a letter or digit


def tokenize(text: str, lowercase: bool = True, keep_punctuation: bool = False) -> list[str]:
    """The project's word tokenizer (``gptlab.data.tokenizers.word_split``), optionally lower-cased; tokens
    without a letter or digit (punctuation) are dropped unless ``keep_punctuation``. Without punctuation the
    same tokens come from one pass: the separators become spaces and a regular expression picks the tokens
    with a word character (a test holds it to word_split's)."""
    if lowercase:
        text = text.lower()
    if keep_punctuation:
        return word_split(text)
    return _WORD.findall(text.replace("--", " ").translate(_SEPARATORS))


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
    """One chunk of one epoch's text after subsampling, as the windows it trains, in text order: the kept
    word ids (each a window's centre), their documents, the window radius drawn at each position (1..window:
    word2vec.c shrinks the window by a random amount at every position, which weights near words more than
    far ones), ``span`` (the words of the vocabulary, before subsampling, from each window's position to
    the next one's: what a batch covers), ``positions`` (each window's place in the whole corpus) and the
    number of batches of ``batch_words`` windows. The context words are taken a block of batches at a time
    (``context_matrix``)."""

    epoch: int
    ids: np.ndarray  # (n,)
    docs: np.ndarray  # (n,)
    radius: np.ndarray  # (n,)
    n_batches: int
    chunk: int = 0
    span: np.ndarray | None = None  # (n,)
    positions: np.ndarray | None = None  # (n,)
    _padded: tuple[int, np.ndarray, np.ndarray] | None = None

    def padded(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """ids (int32) and documents with ``window`` slots of -1 on both sides: a window's neighbours are
        slices, the chunk's edges empty slots."""
        if self._padded is None or self._padded[0] != window:
            pad = np.full(window, -1)
            ids = np.concatenate([pad, self.ids, pad]).astype(np.int32)
            self._padded = (window, ids, np.concatenate([pad, self.docs, pad]))
        return self._padded[1], self._padded[2]


SORT_BLOCK_BATCHES = 8


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
    same text as an uninterrupted one. Windows never cross a document end or the chunk's edges; a position
    without any context word (the only kept word of its document) trains nothing and is left out."""
    rng = np.random.default_rng([seed, epoch, chunk])
    draws = rng.random(len(ids))
    in_vocab = ids >= 0
    docs = np.cumsum(ids == -2)
    kept = in_vocab & (draws < keep_prob[np.maximum(ids, 0)])
    where = np.flatnonzero(kept)
    words = np.concatenate([[0], np.cumsum(in_vocab)])
    radius = (window - rng.integers(0, window, size=len(where))).astype(np.int32)
    kept_docs = docs[where]
    # words covered from each window to the next (the chunk's first window also covers the words before it)
    covered = np.diff(np.concatenate([words[where], [words[-1]]]))
    if len(covered):
        covered[0] += words[where[0]]
    # every radius is at least 1: a window has context words when a neighbour is in its document
    same = kept_docs[1:] == kept_docs[:-1]
    has_context = np.zeros(len(where), dtype=bool)
    has_context[1:] |= same
    has_context[:-1] |= same
    if not has_context.all():
        # a dropped window's words go to the window before it (or, at the start, to the first one kept)
        keep = np.flatnonzero(has_context)
        owner = np.maximum(np.cumsum(has_context) - 1, 0)
        covered = np.bincount(owner, weights=covered, minlength=len(keep)).astype(np.int64)[: len(keep)]
        where, radius, kept_docs = where[keep], radius[keep], kept_docs[keep]
    return EpochPlan(
        epoch,
        ids[where].astype(np.int64),
        kept_docs,
        radius,
        -(-len(where) // batch_words),
        chunk,
        covered,
        where + start,
    )


def context_matrix(plan: EpochPlan, start: int, stop: int, window: int) -> np.ndarray:
    """(stop - start, 2 * window) int32 context word ids of the windows start..stop-1, -1 where the slot is
    empty (beyond the drawn radius, before or after the document, outside the chunk). Columns: offsets
    -window .. -1, then 1 .. window: radius r is the 2r middle columns."""
    ids, docs = plan.padded(window)
    centre_docs, radius = plan.docs[start:stop], plan.radius[start:stop]
    out = np.full((2 * window, stop - start), -1, dtype=np.int32)  # one row per offset, then transposed
    offsets = [*range(-window, 0), *range(1, window + 1)]
    for col, off in enumerate(offsets):
        lo = window + start + off  # slices of the padded arrays: no gather
        valid = (radius >= abs(off)) & (docs[lo : lo + stop - start] == centre_docs)
        np.copyto(out[col], ids[lo : lo + stop - start], where=valid)
    return out.T
