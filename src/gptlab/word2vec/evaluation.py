"""How good are word vectors: nearest neighbours by cosine similarity, WordSim-353 and SimLex-999 (Spearman's
rho against human judgements), the word-analogy questions of Mikolov et al. 2013 (``questions-words.txt``), each
with the share of the benchmark the vocabulary covers, and a 2-D PCA picture of chosen words.

The benchmark files are the ones gensim ships in its wheel (``gensim.test.utils.datapath``), scored by gensim's
``KeyedVectors.evaluate_word_pairs`` / ``evaluate_word_analogies``: nothing is downloaded.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

EMBEDDINGS_FILE = "embeddings.txt"
# Words whose neighbours are shown, where the vocabulary has them: everyday words of news text and of the
# Python reference text (the embedded corpus).
NEIGHBOUR_WORDS = (
    "man", "woman", "king", "city", "government", "police", "water", "day", "money", "war",
    "function", "class", "string", "list", "file", "number", "error", "value", "module", "loop",
)  # fmt: skip
PLOT_WORDS = (
    "man", "woman", "king", "queen", "boy", "girl", "father", "mother", "city", "country",
    "australia", "sydney", "police", "army", "monday", "tuesday", "one", "two", "three", "four",
    "string", "integer", "list", "dictionary", "function", "method", "class", "object", "file", "module",
)  # fmt: skip


def _quiet_gensim() -> None:
    """gensim's INFO records (a lifecycle event per table loaded, the toy dictionary that importing
    ``gensim.test.utils`` builds) off a run's console and log; its warnings stay. Called before each import."""
    logging.getLogger("gensim").setLevel(logging.WARNING)


def keyed_vectors(words: list[str], vectors: np.ndarray):
    """A gensim ``KeyedVectors`` of ``words`` (in this order) and their (V, dim) ``vectors``."""
    _quiet_gensim()
    from gensim.models import KeyedVectors

    kv = KeyedVectors(vector_size=vectors.shape[1], count=0, dtype=np.float32)
    kv.add_vectors(list(words), np.asarray(vectors, dtype=np.float32))
    return kv


def write_embeddings(path: Path, words: list[str], vectors: np.ndarray) -> Path:
    """The word2vec text format: a "<count> <dim>" line, then one "word v1 v2 ..." line per word (written
    here, as gensim writes it, without importing gensim). Written beside ``path`` and renamed over it: a
    process killed meanwhile leaves the earlier file or none, never a part of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vectors = np.asarray(vectors, dtype=np.float32)
    row = " ".join(["%.6g"] * vectors.shape[1])
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(f"{len(words)} {vectors.shape[1]}\n")
            f.writelines(f"{w} {row % tuple(v)}\n" for w, v in zip(words, vectors.tolist()))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def whole_word_vectors(kv):
    """The vectors of GPT-2 byte-level tokens (``Ġking``) that are a space and letters, keyed by the word
    (``king``), lower-cased, a word's first (most frequent) token standing for it: what the word benchmarks
    can score."""
    words, rows, seen = [], [], set()
    for i, token in enumerate(kv.index_to_key):
        if token.startswith("\u0120") and token[1:].isalpha() and token[1:].isascii():
            word = token[1:].lower()
            if word not in seen:
                seen.add(word)
                words.append(word)
                rows.append(i)
    if not words:
        raise ValueError("no token of these vectors is a whole word (a space and letters)")
    return keyed_vectors(words, kv.vectors[rows])


def load_embeddings(path: str | Path):
    """Word vectors from a word2vec text file, a word2vec run directory (its embeddings.txt), or a GPT run
    directory / checkpoint (the rows of its token embedding table that are whole words)."""
    _quiet_gensim()
    from gensim.models import KeyedVectors

    path = Path(path)
    if path.is_dir() and (path / EMBEDDINGS_FILE).is_file():
        path = path / EMBEDDINGS_FILE
    if path.is_file() and path.suffix != ".ckpt":
        return KeyedVectors.load_word2vec_format(str(path), binary=False)
    return gpt_word_vectors(path)


def gpt_word_vectors(path: str | Path):
    """The token embeddings (``wte``) of a GPT run for the tokens that are whole words: GPT-2 byte-pair tokens
    that are a space followed by letters only (" king" -> "king"), or the word tokenizer's alphabetic tokens.
    Lower-cased words keep their first (lowest-id, for GPT-2 the most often merged) spelling."""
    from gptlab.runs.trained import load_run

    run = load_run(path)
    table = run.model.transformer.wte.weight.detach().float().cpu().numpy()
    tok = run.tokenizer
    words: list[str] = []
    rows: list[int] = []
    seen: set[str] = set()
    for i in range(min(tok.vocab_size, table.shape[0])):
        if i == tok.eot_id:
            continue
        text = tok.decode([i])
        if tok.words_after_space:
            if not (text.startswith(" ") and text[1:].isalpha() and text[1:].isascii()):
                continue
            text = text[1:]
        elif not (text.isalpha() and text.isascii()):
            continue
        word = text.lower()
        if word not in seen:
            seen.add(word)
            words.append(word)
            rows.append(i)
    if not words:
        raise ValueError(f"{path}: no token of its {tok.name} tokenizer is a whole word")
    log.info("%s: %d whole-word tokens of %d", path, len(words), tok.vocab_size)
    return keyed_vectors(words, table[rows])


def word_pairs_score(kv, name: str) -> dict[str, float]:
    """Spearman's rho (and Pearson's r) between cosine similarity and human scores, on the pairs whose both
    words are in the vocabulary; ``coverage`` is the share of the benchmark's pairs that are."""
    _quiet_gensim()
    from gensim.test.utils import datapath

    path = datapath(name)
    total = sum(1 for line in open(path, encoding="utf8") if line.strip() and not line.startswith("#"))
    try:
        pearson, spearman, oov = kv.evaluate_word_pairs(path, restrict_vocab=len(kv), case_insensitive=True)
        rho, r = float(spearman.statistic), float(pearson.statistic)
    except (ValueError, ZeroDivisionError, IndexError):  # no pair in the vocabulary
        rho, r, oov = math.nan, math.nan, 100.0
    covered = round(total * (1 - oov / 100))
    return {"spearman": rho, "pearson": r, "pairs": covered, "coverage": covered / total}


def read_analogies(path: str | Path) -> list[tuple[str, str, str, str]]:
    """The questions of ``questions-words.txt``, lower-cased, section headers (": capital-common-countries")
    dropped."""
    out = []
    with open(path, encoding="utf8") as f:
        for line in f:
            if line.strip() and not line.startswith(":"):
                a, b, c, d = line.lower().split()
                out.append((a, b, c, d))
    return out


def analogy_score(kv, chunk: int = 1024) -> dict[str, float]:
    """Accuracy on the analogy questions a : b :: c : d whose four words are in the vocabulary, answered by the
    word nearest in cosine to b - a + c other than a, b and c (3CosAdd, Mikolov et al. 2013); ``coverage``:
    the share of all questions that are in the vocabulary. Case-insensitive, a spelling's most frequent form
    standing for the word.

    The same rule as gensim's ``evaluate_word_analogies`` (a test checks they agree), computed as one matrix
    product per chunk of questions: gensim answers one question at a time in Python, minutes for a vocabulary
    of GPT-2's size."""
    _quiet_gensim()
    from gensim.test.utils import datapath

    questions = read_analogies(datapath("questions-words.txt"))
    group: dict[str, int] = {}
    for i, w in enumerate(kv.index_to_key):
        group.setdefault(w.lower(), i)  # the first (most frequent) spelling of each word
    col_group = np.array([group[w.lower()] for w in kv.index_to_key])
    asked = np.array([[group[w] for w in q] for q in questions if all(w in group for w in q)], dtype=np.int64)
    if len(asked) == 0:
        return {"accuracy": math.nan, "questions": 0, "coverage": 0.0}
    unit = kv.get_normed_vectors().astype(np.float32)  # (V, dim)
    correct = 0
    for start in range(0, len(asked), chunk):
        a, b, c, d = asked[start : start + chunk].T
        target = unit[b] + unit[c] - unit[a]  # (Q, dim)
        scores = target @ unit.T  # (Q, V)
        for given in (a, b, c):
            scores[col_group[None, :] == given[:, None]] = -np.inf
        correct += int((col_group[scores.argmax(1)] == d).sum())
    return {
        "accuracy": correct / len(asked),
        "questions": len(asked),
        "coverage": len(asked) / len(questions),
    }


def nearest_neighbours(
    kv, words: list[str] | None = None, topn: int = 10
) -> dict[str, list[tuple[str, float]]]:
    """The ``topn`` words of highest cosine similarity to each word (cos(a, b) = a . b / (|a| |b|))."""
    chosen = [w for w in (words or NEIGHBOUR_WORDS) if w in kv.key_to_index]
    if not chosen:
        chosen = frequent_words(kv, 8)
    return {w: [(n, float(s)) for n, s in kv.most_similar(w, topn=topn)] for w in chosen}


def frequent_words(kv, n: int) -> list[str]:
    """The first ``n`` words of the vocabulary (the most frequent ones, in a frequency-sorted file)."""
    return list(kv.index_to_key[:n])


def neighbour_overlap(kv_a, kv_b, words: list[str], topn: int = 10) -> float:
    """Mean share of the ``topn`` nearest neighbours that two sets of vectors agree on, over ``words``."""
    shared = [w for w in words if w in kv_a.key_to_index and w in kv_b.key_to_index]
    if not shared:
        return math.nan
    total = 0.0
    for w in shared:
        a = {n for n, _ in kv_a.most_similar(w, topn=topn)}
        b = {n for n, _ in kv_b.most_similar(w, topn=topn)}
        total += len(a & b) / topn
    return total / len(shared)


def pca_plot(kv, path: Path, words: list[str] | None = None, title: str = "") -> Path | None:
    """The chosen words' vectors projected on their first two principal components, as a labelled PNG."""
    from gptlab.figures import pyplot, save_figure

    plt = pyplot()
    chosen = [w for w in (words or PLOT_WORDS) if w in kv.key_to_index]
    if len(chosen) < 3:
        chosen = frequent_words(kv, 30)
    if len(chosen) < 3:
        return None
    x = np.stack([kv[w] for w in chosen]).astype(np.float64)
    x = x / np.linalg.norm(x, axis=1, keepdims=True).clip(min=1e-12)  # cosine geometry
    x = x - x.mean(0)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    xy = x @ vt[:2].T
    explained = (s[:2] ** 2).sum() / max((s**2).sum(), 1e-12)
    fig, ax = plt.subplots(figsize=(8, 7))
    ax.scatter(xy[:, 0], xy[:, 1], s=12)
    for (px, py), w in zip(xy, chosen):
        ax.annotate(w, (px, py), fontsize=9, xytext=(3, 3), textcoords="offset points")
    ax.set_title(f"{title} PCA of {len(chosen)} words ({100 * explained:.0f}% of variance)".strip())
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    return save_figure(fig, path, dpi=110)


# The numbers evaluate() gives, in its order: the scores a stopped evaluation leaves missing.
METRICS = (
    "vocab_size",
    "wordsim353/spearman", "wordsim353/coverage", "wordsim353/pairs",
    "simlex999/spearman", "simlex999/coverage", "simlex999/pairs",
    "analogy/accuracy", "analogy/coverage", "analogy/questions",
)  # fmt: skip


def evaluate(kv, neighbour_words: list[str] | None = None) -> dict[str, Any]:
    """Every score above, as one flat dict of numbers (for loggers; its keys are :data:`METRICS`) plus the
    neighbours."""
    ws = word_pairs_score(kv, "wordsim353.tsv")
    sl = word_pairs_score(kv, "simlex999.txt")
    an = analogy_score(kv)
    metrics = {
        "vocab_size": len(kv),
        "wordsim353/spearman": ws["spearman"],
        "wordsim353/coverage": ws["coverage"],
        "wordsim353/pairs": ws["pairs"],
        "simlex999/spearman": sl["spearman"],
        "simlex999/coverage": sl["coverage"],
        "simlex999/pairs": sl["pairs"],
        "analogy/accuracy": an["accuracy"],
        "analogy/coverage": an["coverage"],
        "analogy/questions": an["questions"],
    }
    return {"metrics": metrics, "neighbours": nearest_neighbours(kv, neighbour_words)}


def format_report(result: dict[str, Any], label: str = "") -> str:
    m = result["metrics"]
    lines = [f"Word vectors{' ' + label if label else ''}: {m['vocab_size']} words"]
    for name in ("wordsim353", "simlex999"):
        lines.append(
            f"  {name:<11} Spearman {m[name + '/spearman']:+.3f} on {m[name + '/pairs']} pairs "
            f"({100 * m[name + '/coverage']:.0f}% of the benchmark in the vocabulary)"
        )
    lines.append(
        f"  analogies   accuracy {m['analogy/accuracy']:.3f} on {m['analogy/questions']} questions "
        f"({100 * m['analogy/coverage']:.1f}% of the benchmark in the vocabulary)"
    )
    lines.append("  nearest neighbours (cosine similarity):")
    for w, ns in result["neighbours"].items():
        lines.append(f"    {w:>12}: " + ", ".join(f"{n} {s:.2f}" for n, s in ns[:8]))
    return "\n".join(lines)
