"""The field's library beside ours: gensim's ``Word2Vec`` trained on the same words with the same settings, and
the figures that compare the two (benchmark scores, agreement of nearest neighbours, words per second).

Two gensim runs that differ only in their seed do not agree on every neighbour either: their overlap is the
noise floor against which our agreement with gensim is read.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from gptlab.word2vec import evaluation
from gptlab.word2vec.config import Word2VecOptions

log = logging.getLogger(__name__)


def gensim_arguments(options: Word2VecOptions, seed: int, workers: int) -> dict[str, Any]:
    """Our options in gensim's names. gensim counts training in epochs, so max_steps has no counterpart. gensim's
    learning rate is an SGD step: beside a ``sparse_adam`` run gensim keeps its own default (0.025 to 0.0001)."""
    if options.max_steps:
        raise ValueError(
            "the gensim comparison needs a run trained for word2vec.epochs, not word2vec.max_steps"
        )
    if options.objective == "softmax":
        raise ValueError("gensim has no full softmax: compare word2vec.objective=negative or hierarchical")
    hierarchical = options.objective == "hierarchical"
    return {
        "vector_size": options.dim,
        "window": options.window,
        "negative": 0 if hierarchical else options.negatives,
        "ns_exponent": options.noise_power,
        "min_count": options.min_count,
        "sample": options.sample,
        "alpha": options.lr if options.optimizer == "sgd" else 0.025,
        "min_alpha": options.lr_min if options.optimizer == "sgd" else 0.0001,
        "epochs": options.epochs,
        "sg": 1 if options.mode == "skipgram" else 0,
        "cbow_mean": 1,
        "hs": 1 if hierarchical else 0,
        "seed": seed,
        "workers": workers,
    }


@dataclass
class GensimRun:
    vectors: Any  # KeyedVectors
    seconds: float
    words: int  # corpus words in the vocabulary x epochs: what "words per second" divides

    @property
    def words_per_second(self) -> float:
        return self.words / self.seconds if self.seconds > 0 else math.nan


def train_gensim(
    documents: list[list[str]], options: Word2VecOptions, seed: int, workers: int = 1
) -> GensimRun:
    from gensim.models import Word2Vec

    logging.getLogger("gensim").setLevel(logging.WARNING)
    # gensim's trainer reads at most 10,000 words of one sentence (MAX_WORDS_IN_BATCH): longer documents are
    # handed to it in pieces, so that it trains on every word as ours does.
    limit = 10_000
    documents = [words[i : i + limit] for words in documents for i in range(0, max(len(words), 1), limit)]
    model = Word2Vec(**gensim_arguments(options, seed, workers))
    model.build_vocab(documents)
    start = time.perf_counter()
    model.train(documents, total_examples=model.corpus_count, epochs=model.epochs)
    seconds = time.perf_counter() - start
    in_vocab = sum(1 for words in documents for w in words if w in model.wv.key_to_index)
    return GensimRun(model.wv, seconds, in_vocab * options.epochs)


def compare(
    ours,
    documents: list[list[str]],
    options: Word2VecOptions,
    seed: int,
    our_words_per_second: float = math.nan,
    top_words: int = 100,
    topn: int = 10,
    workers: int = 1,
) -> dict[str, Any]:
    """Train gensim twice (seeds ``seed`` and ``seed + 1``) and compare: scores of all three, the overlap of
    the ``topn`` neighbours of the ``top_words`` most frequent words (ours vs gensim, gensim vs gensim)."""
    first = train_gensim(documents, options, seed, workers)
    second = train_gensim(documents, options, seed + 1, workers)
    words = evaluation.frequent_words(first.vectors, top_words)
    result = {
        "ours": evaluation.evaluate(ours)["metrics"],
        "gensim": evaluation.evaluate(first.vectors)["metrics"],
        "gensim_seed2": evaluation.evaluate(second.vectors)["metrics"],
        "overlap/ours_vs_gensim": evaluation.neighbour_overlap(ours, first.vectors, words, topn),
        "overlap/gensim_vs_gensim": evaluation.neighbour_overlap(first.vectors, second.vectors, words, topn),
        "words_per_second/ours": our_words_per_second,
        "words_per_second/gensim": (first.words + second.words) / (first.seconds + second.seconds),
        "gensim_workers": workers,
        "top_words": len(words),
        "topn": topn,
    }
    floor = result["overlap/gensim_vs_gensim"]
    result["overlap/ratio"] = result["overlap/ours_vs_gensim"] / floor if floor else math.nan
    return result


def format_comparison(result: dict[str, Any], label: str = "") -> str:
    rows = [
        ("WordSim-353 Spearman", "wordsim353/spearman", "+.3f"),
        ("  pairs in vocabulary", "wordsim353/pairs", "d"),
        ("SimLex-999 Spearman", "simlex999/spearman", "+.3f"),
        ("  pairs in vocabulary", "simlex999/pairs", "d"),
        ("analogy accuracy", "analogy/accuracy", ".3f"),
        ("  questions in vocabulary", "analogy/questions", "d"),
        ("vocabulary", "vocab_size", "d"),
    ]
    lines = [
        f"gptlab word2vec vs gensim {label}".rstrip(),
        f"{'':28} {'gptlab':>10} {'gensim':>10} {'gensim s2':>10}",
    ]
    for title, key, fmt in rows:
        values = [result[k][key] for k in ("ours", "gensim", "gensim_seed2")]
        lines.append(f"{title:28} " + " ".join(f"{_fmt(v, fmt):>10}" for v in values))
    lines += [
        f"top-{result['topn']} neighbour overlap, {result['top_words']} most frequent words:",
        f"  gptlab vs gensim            {result['overlap/ours_vs_gensim']:.3f}",
        f"  gensim seed 1 vs seed 2     {result['overlap/gensim_vs_gensim']:.3f}  (noise floor)",
        f"  ratio                       {result['overlap/ratio']:.2f}",
        f"words/s: gptlab {result['words_per_second/ours']:,.0f}, "
        f"gensim {result['words_per_second/gensim']:,.0f} ({result['gensim_workers']} worker thread(s))",
    ]
    return "\n".join(lines)


def _fmt(value: float, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(int(value) if fmt == "d" else value, fmt)


def run_settings(run_dir: Path) -> tuple[Any, Word2VecOptions, int]:
    """(data spec, word2vec options, seed) of a ``task=word2vec`` run directory."""
    from omegaconf import DictConfig, OmegaConf

    from gptlab.word2vec.corpus import data_spec

    path = Path(run_dir) / "config_resolved.yaml"
    if not path.is_file():
        raise FileNotFoundError(
            f"{run_dir} has no config_resolved.yaml: pass the directory of a task=word2vec run"
        )
    cfg = OmegaConf.load(path)
    assert isinstance(cfg, DictConfig)  # a run's saved config is a mapping
    if cfg.get("task") != "word2vec":
        raise ValueError(
            f"{run_dir} is a task={cfg.get('task')} run: --against-gensim needs a task=word2vec run"
        )
    options = Word2VecOptions.from_dict(
        cast(dict[str, Any], OmegaConf.to_container(cfg.word2vec, resolve=True))
    )
    return data_spec(cfg.data), options, int(cfg.seed)
