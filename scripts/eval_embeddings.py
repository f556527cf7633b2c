"""Evaluate word vectors: nearest neighbours, WordSim-353, SimLex-999, the analogy questions (with the share of
each benchmark the vocabulary covers) and a PCA plot of chosen words.

    python scripts/eval_embeddings.py outputs/runs/<date>/<time>             # a task=word2vec run (embeddings.txt)
    python scripts/eval_embeddings.py vectors.txt                            # any word2vec text file
    python scripts/eval_embeddings.py outputs/runs/<gpt run>                 # a GPT run: its wte rows that are words
    python scripts/eval_embeddings.py <word2vec run> --against-gensim        # gensim on the same words and settings
    python scripts/eval_embeddings.py --export-lee outputs/corpora/lee.jsonl # gensim's Lee corpus as a data.path file

``--against-gensim`` trains gensim's Word2Vec twice (the run's seed and the next) on the run's corpus, tokenized
as the run was, with its settings, and prints both side by side: scores, the overlap of the 10 nearest
neighbours of the most frequent words (and gensim's own seed-to-seed overlap, the noise floor), words/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from gptlab.cli import ArgumentParser


def export_lee(path: Path) -> Path:
    """gensim's lee_background.cor (300 news articles, one per line) as JSON lines with a ``text`` field."""
    from gensim.test.utils import datapath

    path.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(datapath("lee_background.cor"), encoding="utf8") as src,
        open(path, "w", encoding="utf8") as out,
    ):
        for line in src:
            if line.strip():
                out.write(json.dumps({"text": line.strip()}) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "path", nargs="?", help="a word2vec or GPT run directory, an embeddings file or a .ckpt"
    )
    parser.add_argument("--against-gensim", action="store_true", help="train gensim with the run's settings")
    parser.add_argument("--top-words", type=int, default=100, help="most frequent words for the overlap")
    parser.add_argument("--workers", type=int, default=1, help="gensim worker threads")
    parser.add_argument("--words", nargs="+", default=None, help="words whose neighbours are printed")
    parser.add_argument("--plot-words", nargs="+", default=None, help="words of the PCA plot")
    parser.add_argument("--out", default=None, help="folder for pca.png and the JSON results")
    parser.add_argument("--export-lee", default=None, help="write gensim's Lee corpus as JSON lines here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    if args.export_lee:
        print(f"Wrote {export_lee(Path(args.export_lee))}: train on it with data.path={args.export_lee}")
        if not args.path:
            return 0
    if not args.path:
        parser.error("give a run directory or an embeddings file")
    from gptlab.errors import ConfigError
    from gptlab.runs.jsonfile import figure_as_json, figures_as_json, read_figure, write_json
    from gptlab.word2vec import evaluation

    source = Path(args.path)
    out = Path(args.out) if args.out else (source if source.is_dir() else source.parent)
    try:
        kv = evaluation.load_embeddings(source)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"eval_embeddings: error: {e}", file=sys.stderr)
        return 2
    result = evaluation.evaluate(kv, args.words)
    print(evaluation.format_report(result, str(source)))
    plot = evaluation.pca_plot(kv, out / "pca.png", args.plot_words, title=source.name)
    if plot:
        print(f"PCA plot: {plot}")
    if args.against_gensim:
        from gptlab.word2vec import reference
        from gptlab.word2vec.corpus import tokenized_documents

        run_dir = source if source.is_dir() else source.parent
        try:
            spec, options, seed = reference.run_settings(run_dir)
        except (FileNotFoundError, ValueError) as e:
            print(f"eval_embeddings: error: {e}", file=sys.stderr)
            return 2
        metrics_file = run_dir / "metrics.json"
        ours_speed = (
            read_figure(json.loads(metrics_file.read_text()).get("train/words_per_second"))
            if metrics_file.is_file()
            else None
        )
        comparison = reference.compare(
            kv,
            list(tokenized_documents(spec, options)),
            options,
            seed,
            our_words_per_second=float("nan") if ours_speed is None else ours_speed,
            top_words=args.top_words,
            workers=args.workers,
        )
        label = f"({options.mode}, {spec.describe()}, dim={options.dim}, epochs={options.epochs})"
        print(reference.format_comparison(comparison, label))
        # strict JSON: a figure that is not finite (no speed of ours known, no overlap) as "nan"
        figures = {
            k: figures_as_json(v) if isinstance(v, dict) else figure_as_json(v) for k, v in comparison.items()
        }
        write_json(out / "against_gensim.json", figures)
        print(f"Results: {out / 'against_gensim.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
