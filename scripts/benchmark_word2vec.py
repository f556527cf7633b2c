"""gptlab's word2vec against gensim's: whole processes, training rate, agreement and benchmark scores.

    python scripts/benchmark_word2vec.py                               # skip-gram and CBOW, default logger
    python scripts/benchmark_word2vec.py --logger default,csv,none --mode cbow --corpus line
    python scripts/benchmark_word2vec.py --mode cbow --objective hierarchical --repeats 3
    python scripts/benchmark_word2vec.py --logger default,csv --before /tmp/w2v-before   # and another checkout
    python scripts/benchmark_word2vec.py --memory --memory-mb 100 --before /tmp/gptlab-main   # peak RSS
    python scripts/benchmark_word2vec.py --softmax                     # the full softmax's cost by vocabulary
    python scripts/benchmark_word2vec.py --objectives --min-count 30   # each objective against gensim hs=1

The corpus is text8-style (lower-case words separated by spaces): gensim's ``lee_background.cor`` (300 news
articles), cut into words by gptlab's word tokenizer and repeated ``--copies`` times (6: 364k words), as one
line (``--corpus line``) or as lines of 1,300 words (``--corpus lines``, the default: 281 lines, the shape of a
corpus a user brings). ``--mode skipgram,cbow`` (the default) measures both models, one after the other, and
ends with one table: per model and logger, the whole process's seconds on both sides, their ratio round by
round (min / median / max), and the quality figures beside. Both sides read that file: ``python train.py task=word2vec data.path=<file> ...`` and a gensim script
(``Text8Corpus`` -> ``Word2Vec(workers=threads)`` -> ``save_word2vec_format``), each a fresh process, timed
whole (imports, reading, vocabulary, training, writing the vectors), interleaved repeat by repeat so that
both meet the same load; the CPU seconds of each process (user + system, all its threads and processes) are
reported beside the wall-clock seconds, and the machine's load average before and after. Our side runs with
each logger of ``--logger`` in turn (``default``: the config's own, W&B, offline without a login; ``csv``;
``none``), each interleaved with gensim. The training rate
is corpus words in the vocabulary x epochs over the training time. Quality: the overlap of the 10 nearest
neighbours of the 100 most frequent words with gensim's (seed 1337), against gensim's own seed-to-seed
overlap (1337 vs 1338), and WordSim-353 / SimLex-999 Spearman for each.

``--objectives`` trains each of our objectives (negative sampling, hierarchical softmax, and the full softmax
where the vocabulary allows it) and reads each against gensim's hierarchical softmax (``hs=1``); beside them,
our hierarchical softmax trained in this process over gensim's own Huffman tree. The two libraries build
equally good trees that differ where words tie in count (word2vec.c's construction, ours, against gensim's
heap with its vocabulary order), and neighbours learnt through different trees agree less: that row
separates the tree from the training.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

GENSIM_SCRIPT = r"""
import json, sys, time
start = time.perf_counter()
import logging
from gensim.models import Word2Vec
from gensim.models.word2vec import Text8Corpus
logging.getLogger("gensim").setLevel(logging.WARNING)
path, out, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = Word2Vec(**settings)
corpus = Text8Corpus(path)
model.build_vocab(corpus)
t0 = time.perf_counter()
model.train(corpus, total_examples=model.corpus_count, epochs=model.epochs)
seconds = time.perf_counter() - t0
model.wv.save_word2vec_format(out)
words = int(sum(model.wv.get_vecattr(w, "count") for w in model.wv.index_to_key)) * model.epochs
print(json.dumps({"train_seconds": seconds, "words": words}))
"""


WORDS_PER_LINE = 1_300  # --corpus lines: text8's words in lines of about the length of a news article's


def lee_corpus(path: Path, copies: int, lines: bool = False) -> Path:
    """``lee_background.cor`` in words, ``copies`` times: one line, or (``lines``) lines of
    :data:`WORDS_PER_LINE` words. The same words in the same order either way."""
    from gensim.test.utils import datapath

    from gptlab.word2vec.sampling import tokenize

    words: list[str] = []
    with open(datapath("lee_background.cor"), encoding="utf8") as f:
        for line in f:
            words += tokenize(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    words = words * copies
    if lines:
        rows = [" ".join(words[i : i + WORDS_PER_LINE]) for i in range(0, len(words), WORDS_PER_LINE)]
        path.write_text("\n".join(rows) + "\n")
    else:
        path.write_text(" ".join(words))
    return path


def corpus_for(work: Path, args: argparse.Namespace) -> Path:
    return lee_corpus(work / f"lee_x{args.copies}_{args.corpus}.txt", args.copies, args.corpus == "lines")


def env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def timed(cmd: list[str], cwd: Path, environment: dict | None = None) -> tuple[float, str, float]:
    """(wall seconds, stdout, CPU seconds) of a whole process: user + system time of it and its children
    (this script runs one at a time)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=environment or env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = proc.communicate()
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return seconds, out, cpu


def ours(
    corpus: Path,
    run_dir: Path,
    args: argparse.Namespace,
    seed: int,
    logger: str | None = None,
    root: Path = ROOT,
) -> dict:
    """``python train.py task=word2vec ...`` with ``logger`` (``default``: no ``logger=`` override, the
    config's own W&B logger, offline here; by default the first of ``--logger``), in the checkout ``root``."""
    from gptlab.runs.jsonfile import read_figure

    logger = logger or args.logger.split(",")[0]
    cmd = [
        sys.executable,
        str(root / "train.py"),
        "task=word2vec",
        f"data.path={corpus}",
        f"word2vec.mode={args.mode}",
        f"word2vec.objective={args.objective}",
        f"word2vec.threads={args.threads}",
        f"word2vec.parallel={args.parallel}",
        f"word2vec.epochs={args.epochs}",
        f"word2vec.batch_size={args.batch_size}",
        f"word2vec.min_count={args.min_count}",
        "word2vec.evaluate=false",
        f"seed={seed}",
        *([] if logger == "default" else [f"logger={logger}"]),
        f"hydra.run.dir={run_dir}",
    ]
    seconds, _, cpu = timed(cmd, root, {**env(), "PYTHONPATH": str(root / "src")})
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {
        "process_seconds": seconds,
        "cpu_seconds": cpu,
        # metrics.json writes a non-finite figure as "nan" (gptlab.runs.jsonfile)
        "train_seconds": read_figure(metrics["train/seconds"]),
        "words_per_second": read_figure(metrics["train/words_per_second"]),
        "vectors": str(run_dir / "embeddings.txt"),
    }


def gensim_settings(args: argparse.Namespace, seed: int) -> dict:
    """gensim has no full softmax: beside ours it runs its hierarchical softmax (hs=1)."""
    hierarchical = args.gensim == "hs" or (args.gensim == "auto" and args.objective != "negative")
    return {
        "vector_size": 100,
        "window": 5,
        "negative": 0 if hierarchical else 5,
        "hs": 1 if hierarchical else 0,
        "min_count": args.min_count,
        "sample": 1e-3,
        "alpha": 0.025,
        "min_alpha": 0.0001,
        "epochs": args.epochs,
        "sg": 1 if args.mode == "skipgram" else 0,
        "cbow_mean": 1,
        "seed": seed,
        "workers": args.threads,
    }


def gensim(corpus: Path, out: Path, args: argparse.Namespace, seed: int) -> dict:
    cmd = [
        sys.executable,
        "-c",
        GENSIM_SCRIPT,
        str(corpus),
        str(out),
        json.dumps(gensim_settings(args, seed)),
    ]
    seconds, stdout, cpu = timed(cmd, ROOT)
    reported = json.loads(stdout.strip().splitlines()[-1])
    return {
        "process_seconds": seconds,
        "cpu_seconds": cpu,
        "train_seconds": reported["train_seconds"],
        "words_per_second": reported["words"] / reported["train_seconds"],
        "vectors": str(out),
    }


def quality(ours_path: str, gensim_path: str, gensim2_path: str) -> dict:
    from gptlab.word2vec import evaluation

    a, g1, g2 = (evaluation.load_embeddings(p) for p in (ours_path, gensim_path, gensim2_path))
    words = evaluation.frequent_words(g1, 100)
    scores = {}
    for name, kv in (("ours", a), ("gensim", g1), ("gensim_seed2", g2)):
        m = evaluation.evaluate(kv)["metrics"]
        scores[name] = {k: m[k] for k in ("wordsim353/spearman", "simlex999/spearman", "vocab_size")}
    overlap = evaluation.neighbour_overlap(a, g1, words, 10)
    floor = evaluation.neighbour_overlap(g1, g2, words, 10)
    return {
        "scores": scores,
        "overlap_ours_gensim": overlap,
        "overlap_gensim_gensim": floor,
        "ratio": overlap / floor,
    }


def speed(args: argparse.Namespace) -> dict:
    """Whole processes, interleaved round by round: ours with each logger of ``--logger``, then gensim."""
    work = Path(tempfile.mkdtemp(prefix="w2v-bench-"))
    corpus = corpus_for(work, args)
    loggers = args.logger.split(",")
    sides = [f"logger={name}" for name in loggers]
    checkouts = [(name, side, ROOT) for name, side in zip(loggers, sides)]
    if args.before:  # the same commands in another checkout, e.g. the code before a change
        for name in loggers:
            sides.append(f"before, logger={name}")
            checkouts.append((name, sides[-1], Path(args.before)))
    runs: dict[str, list[dict]] = {**{side: [] for side in sides}, "gensim": []}
    load_before = os.getloadavg()
    for r in range(args.repeats):
        for i, (name, side, root) in enumerate(checkouts):
            runs[side].append(ours(corpus, work / f"ours{i}_{name}_{r}", args, 1337, name, root))
        runs["gensim"].append(gensim(corpus, work / f"gensim{r}.txt", args, 1337 + r))
        print(
            f"round {r}: whole process "
            + ", ".join(
                f"{side} {runs[side][-1]['process_seconds']:.2f} s ({runs[side][-1]['cpu_seconds']:.2f} CPU s)"
                for side in [*sides, "gensim"]
            ),
            flush=True,
        )
    if args.repeats < 2:
        runs["gensim"].append(gensim(corpus, work / "gensim1.txt", args, 1338))
    load_after = os.getloadavg()
    med = lambda side, key: statistics.median(x[key] for x in runs[side])  # noqa: E731
    # each round's ratio: our process over the gensim process of the same round (the same load, about)
    ratios = {
        side: [o["process_seconds"] / g["process_seconds"] for o, g in zip(runs[side], runs["gensim"])]
        for side in sides
    }
    words = len(corpus.read_text().split())
    lines = len(corpus.read_text().splitlines())
    columns = [*sides, "gensim"]
    result = {
        "corpus": f"lee_background.cor x{args.copies} ({words:,} words in {lines:,} line(s), text8-style)",
        "settings": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "load_average": {"before": load_before, "after": load_after},
        **{
            key: {side: med(side, key) for side in columns}
            for key in ("process_seconds", "cpu_seconds", "train_seconds", "words_per_second")
        },
        "process_ratios": ratios,
        "process_ratio_median": {side: statistics.median(ratios[side]) for side in sides},
        "runs": runs,
        "quality": quality(
            runs[sides[0]][0]["vectors"], runs["gensim"][0]["vectors"], runs["gensim"][1]["vectors"]
        ),
    }
    q = result["quality"]
    parallel = f", {args.parallel}" if args.threads > 1 else ""
    print(
        f"\n{result['corpus']}; {args.mode}, {args.objective} (gensim "
        f"{'hs=1' if gensim_settings(args, 0)['hs'] else 'negative=5'}), {args.threads} thread(s){parallel}, "
        f"{args.epochs} epochs, min_count {args.min_count}, vocabulary {q['scores']['ours']['vocab_size']}; "
        f"{args.repeats} rounds; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )
    print(f"{'':34}" + "".join(f" {side:>16}" for side in columns))
    for key, label, fmt in (
        ("process_seconds", "whole process, s (median)", ".2f"),
        ("cpu_seconds", "whole process, CPU s (median)", ".2f"),
        ("train_seconds", "training, s (median)", ".2f"),
        ("words_per_second", "training words/s (median)", ",.0f"),
    ):
        print(f"{label:34}" + "".join(f" {result[key][side]:>16{fmt}}" for side in columns))
    for side in sides:
        print(
            f"whole process gptlab {side} / gensim, per round: {', '.join(f'{x:.2f}' for x in ratios[side])}; "
            f"median {result['process_ratio_median'][side]:.2f}"
        )
    for key in ("wordsim353/spearman", "simlex999/spearman"):
        s = q["scores"]
        print(
            f"{key:34} {s['ours'][key]:>+10.3f} {s['gensim'][key]:>+10.3f}  (gensim seed 2 {s['gensim_seed2'][key]:+.3f})"
        )
    print(
        f"neighbour overlap with gensim {q['overlap_ours_gensim']:.3f}, gensim seed to seed "
        f"{q['overlap_gensim_gensim']:.3f}: ratio {q['ratio']:.2f}"
    )
    return result


def speed_all(args: argparse.Namespace) -> dict:
    """:func:`speed` for each model of ``--mode``, then one table of them all."""
    results = {}
    for mode in args.mode.split(","):
        results[mode] = speed(argparse.Namespace(**{**vars(args), "mode": mode}))
        print(flush=True)
    print(summary_table(results))
    return results


def summary_table(results: dict[str, dict]) -> str:
    """Model, logger, whole-process seconds (medians), the ratio per round, CPU seconds, and quality."""
    width = max(len(side.removeprefix("logger=")) for r in results.values() for side in r["process_ratios"])
    width = max(width, 6)
    head = (
        f"{'model':9} {'logger':{width}} {'gptlab s':>9} {'gensim s':>9} {'ratio min/med/max':>18} "
        f"{'CPU s gptlab/gensim':>20} {'WordSim g/G':>12} {'SimLex g/G':>12} {'overlap/floor':>14}"
    )
    lines = [head, "-" * len(head)]
    for mode, r in results.items():
        q = r["quality"]
        s = q["scores"]
        for side, ratios in r["process_ratios"].items():
            logger = side.removeprefix("logger=")
            lines.append(
                f"{mode:9} {logger:{width}} {r['process_seconds'][side]:>9.2f} {r['process_seconds']['gensim']:>9.2f} "
                f"{min(ratios):>6.2f}/{statistics.median(ratios):.2f}/{max(ratios):.2f} "
                f"{r['cpu_seconds'][side]:>10.2f}/{r['cpu_seconds']['gensim']:<9.2f} "
                f"{s['ours']['wordsim353/spearman']:>+6.3f}/{s['gensim']['wordsim353/spearman']:<+6.3f} "
                f"{s['ours']['simlex999/spearman']:>+6.3f}/{s['gensim']['simlex999/spearman']:<+6.3f} "
                f"{q['overlap_ours_gensim']:>7.3f}/{q['overlap_gensim_gensim']:.3f}"
            )
    lines.append(
        "ratio: gptlab's whole process over gensim's in the same round; g/G: gptlab / gensim (seed 1337); "
        "overlap: of the 10 nearest neighbours of the 100 most frequent words, gptlab with gensim / gensim's "
        "two seeds (the floor); quality from the first logger's first round"
    )
    return "\n".join(lines)


def hierarchical_over_gensims_tree(corpus: Path, out: Path, args: argparse.Namespace, seed: int) -> str:
    """Our hierarchical softmax, trained in this process (one thread) over the Huffman tree gensim builds
    for the same corpus: the codes and inner nodes of each word as gensim's vocabulary gives them."""
    import torch
    from gensim.models import Word2Vec
    from gensim.models.word2vec import Text8Corpus

    from gptlab.data.sources import DataSpec
    from gptlab.word2vec import evaluation, fast, objectives
    from gptlab.word2vec.config import Word2VecOptions
    from gptlab.word2vec.corpus import read_corpus
    from gptlab.word2vec.schedule import Schedule

    torch.set_num_threads(1)
    options = Word2VecOptions(
        mode=args.mode,
        objective="hierarchical",
        min_count=args.min_count,
        epochs=args.epochs,
        batch_size=args.batch_size,
    )
    words = read_corpus(DataSpec(path=str(corpus)), options)
    model = Word2Vec(vector_size=8, min_count=args.min_count, hs=1, negative=0)
    model.build_vocab(Text8Corpus(str(corpus)))
    codes, points = (
        [[int(x) for x in model.wv.get_vecattr(w, key)] for w in words.vocab.words]
        for key in ("code", "point")
    )
    objective = objectives.HierarchicalSoftmax(words.vocab.counts, (codes, points))
    schedule = Schedule(words, options, objective, seed)
    tables = fast.Tables(len(words.vocab), objective.output_rows, options.dim, seed)
    for item in schedule.steps(0):
        batch = schedule.batch(*item)
        lr = options.lr - (options.lr - options.lr_min) * batch.progress
        fast.sgd_step(tables, batch, lr, options.mode)
    return str(evaluation.write_embeddings(out, words.vocab.words, tables.input.numpy()))


def objectives_quality(args: argparse.Namespace) -> dict:
    """Each objective of ours against gensim's hierarchical softmax (hs=1, seeds 1337 and 1338), beside
    gensim's own negative sampling against it (what another objective agrees with hs=1)."""
    from gptlab.word2vec.objectives import MAX_SOFTMAX_VOCAB, OBJECTIVES

    work = Path(tempfile.mkdtemp(prefix="w2v-objectives-"))
    corpus = corpus_for(work, args)
    hs = argparse.Namespace(**{**vars(args), "gensim": "hs", "objective": "hierarchical"})
    g1 = gensim(corpus, work / "gensim_hs_1337.txt", hs, 1337)["vectors"]
    g2 = gensim(corpus, work / "gensim_hs_1338.txt", hs, 1338)["vectors"]
    vocab = int(Path(g1).read_text().split(maxsplit=1)[0])
    rows: dict[str, dict] = {}
    for objective in OBJECTIVES:
        if objective == "softmax" and vocab > MAX_SOFTMAX_VOCAB:
            print(
                f"softmax left out: vocabulary {vocab:,} > {MAX_SOFTMAX_VOCAB:,} (raise --min-count)",
                flush=True,
            )
            continue
        run = ours(
            corpus,
            work / f"ours_{objective}",
            argparse.Namespace(**{**vars(args), "objective": objective}),
            1337,
        )
        rows[objective] = {**run, **quality(run["vectors"], g1, g2)}
        print(
            f"{objective}: {run['process_seconds']:.1f} s, {run['words_per_second']:,.0f} words/s", flush=True
        )
    ns = argparse.Namespace(**{**vars(args), "gensim": "ns", "objective": "negative"})
    gensim_ns = gensim(corpus, work / "gensim_ns_1337.txt", ns, 1337)
    rows["gensim negative=5"] = {**gensim_ns, **quality(gensim_ns["vectors"], g1, g2)}
    start = time.perf_counter()
    path = hierarchical_over_gensims_tree(corpus, work / "ours_hs_gensim_tree.txt", args, 1337)
    rows["hierarchical, gensim's tree"] = {
        "train_seconds": time.perf_counter() - start,
        **quality(path, g1, g2),
    }
    first = next(iter(rows.values()))
    print(
        f"\n{args.mode}, {args.threads} thread(s), {args.epochs} epochs, min_count {args.min_count}, vocabulary "
        f"{vocab:,}; against gensim hs=1 (seed 1337; gensim's seed-to-seed overlap "
        f"{first['overlap_gensim_gensim']:.3f})"
    )
    print(f"{'run':30} {'overlap':>8} {'ratio':>6} {'WordSim':>8} {'SimLex':>8}")
    for name, row in rows.items():
        s = row["scores"]["ours"]
        print(
            f"{name:30} {row['overlap_ours_gensim']:>8.3f} {row['ratio']:>6.2f} "
            f"{s['wordsim353/spearman']:>+8.3f} {s['simlex999/spearman']:>+8.3f}"
        )
    g = first["scores"]["gensim"]
    print(
        f"{'gensim hs=1':30} {'':>8} {'':>6} {g['wordsim353/spearman']:>+8.3f} {g['simlex999/spearman']:>+8.3f}"
    )
    return {
        "vocabulary": vocab,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "rows": rows,
    }


def memory(args: argparse.Namespace) -> dict:
    """Peak RSS of ``train.py task=word2vec`` reading a corpus of ``--memory-mb`` MB (one step of training),
    for this checkout and, with ``--before``, another one (e.g. the code before the bounded reader)."""
    work = Path(tempfile.mkdtemp(prefix="w2v-mem-"))
    base = lee_corpus(work / "lee.txt", 1).read_text()
    corpus = work / f"big_{args.memory_mb}mb.txt"
    with open(corpus, "w") as f:
        while f.tell() < args.memory_mb * 1_000_000:
            f.write(base + " ")
    result = {"corpus_mb": corpus.stat().st_size / 1e6}
    for name, root in (("this checkout", ROOT), ("before", args.before)):
        if root is None:
            continue
        root = Path(root)
        cmd = [
            sys.executable,
            str(root / "train.py"),
            "task=word2vec",
            f"data.path={corpus}",
            "word2vec.max_steps=1",
            "word2vec.evaluate=false",
            "logger=none",
            f"hydra.run.dir={work / name.replace(' ', '_')}",
        ]
        environment = {**env(), "PYTHONPATH": str(root / "src")}
        code = (
            "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"
        )
        seconds, out, _ = timed([sys.executable, "-c", code, *cmd], root, environment)
        result[name] = {"peak_rss_mib": float(out.strip().splitlines()[-1]), "seconds": seconds}
        print(
            f"{name:14} peak RSS {result[name]['peak_rss_mib']:,.0f} MiB, {seconds:.1f} s ({root})",
            flush=True,
        )
    print(f"corpus: {result['corpus_mb']:.0f} MB of text ({corpus})")
    return result


def softmax_cost(args: argparse.Namespace) -> dict:
    """Words/s of one step of the full softmax against negative sampling, by vocabulary size."""
    import numpy as np
    import torch

    from gptlab.word2vec import fast, objectives

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    result = {}
    for vocab in (1_000, 2_000, 5_000, 10_000, 20_000):
        counts = np.sort(rng.zipf(1.5, vocab))[::-1]
        inputs = rng.integers(0, vocab, size=(256, 10))
        target = rng.integers(0, vocab, size=256)
        rates = {}
        batch = fast.WindowBatch(
            inputs, target, objectives.NegativeSampling(counts, 5).targets(target, rng), 256, 0
        )
        for name in ("negative", "softmax"):
            tables = fast.Tables(vocab, vocab, 100, 0)
            softmax = name == "softmax"
            fast.sgd_step(tables, batch, 0.01, "skipgram", softmax=softmax)  # warm-up
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < 1.0:
                fast.sgd_step(tables, batch, 0.01, "skipgram", softmax=softmax)
                n += 1
            rates[name] = 256 * n / (time.perf_counter() - start)
        result[vocab] = {**rates, "share": rates["softmax"] / rates["negative"]}
        print(
            f"vocabulary {vocab:>6,}: softmax {rates['softmax']:>9,.0f} centre words/s, negative sampling "
            f"{rates['negative']:>9,.0f} ({100 * result[vocab]['share']:.1f}%)",
            flush=True,
        )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--mode",
        default="skipgram,cbow",
        help="skipgram, cbow, or both comma-separated (speed: each in turn)",
    )
    p.add_argument("--objective", default="negative", choices=["negative", "hierarchical", "softmax"])
    p.add_argument("--min-count", type=int, default=5)
    p.add_argument(
        "--gensim",
        default="auto",
        choices=["auto", "hs", "ns"],
        help="gensim's objective (auto: ours, hs for softmax)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parallel", default="processes", choices=["processes", "threads"], help="our workers")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--copies", type=int, default=6, help="lee_background.cor copies in the corpus")
    p.add_argument(
        "--corpus", default="lines", choices=["line", "lines"], help="one line, or lines of 1,300 words"
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds: ours with each logger, then gensim")
    p.add_argument(
        "--logger",
        default="default",
        help="our runs' logger= in turn, comma-separated: default (the config's: W&B, offline here), csv, none",
    )
    p.add_argument("--memory", action="store_true", help="peak RSS while reading a large corpus instead")
    p.add_argument("--memory-mb", type=int, default=100)
    p.add_argument(
        "--before",
        default=None,
        help="another checkout to measure beside this one (speed: with each logger of --logger)",
    )
    p.add_argument("--softmax", action="store_true", help="the full softmax's speed by vocabulary instead")
    p.add_argument(
        "--objectives", action="store_true", help="each objective's quality against gensim hs=1 instead"
    )
    p.add_argument("--json", default=None, help="write the result here as JSON")
    args = p.parse_args(argv)
    modes = args.mode.split(",")
    if not modes or any(m not in ("skipgram", "cbow") for m in modes):
        p.error(f"--mode {args.mode}: give skipgram, cbow or skipgram,cbow")
    if len(modes) > 1 and (args.memory or args.softmax or args.objectives):
        args.mode = modes[0]  # these measure one model: the first
    if args.memory:
        result = memory(args)
    elif args.softmax:
        result = softmax_cost(args)
    elif args.objectives:
        result = objectives_quality(args)
    else:
        result = speed_all(args)
    if args.json:
        from gptlab.runs.jsonfile import all_figures_as_json, write_json

        # strict JSON (gptlab.runs.jsonfile), whole: a score a benchmark could not give (NaN) as "nan"
        write_json(args.json, all_figures_as_json(result, default=str))
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
