"""task=word2vec: sampling, the negative-sampling loss, training from the CLI and a sweep, the word2vec text
file gensim reads, a resume that ends where an uninterrupted run ends, evaluation and the gensim comparison."""

from __future__ import annotations

import json
import math
import os
import runpy
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, run_train
from gensim.models import KeyedVectors

from gptlab.data.corpus import DataSpec
from gptlab.errors import ConfigError, DataError
from gptlab.tracking.wandb_files import find_runs, read_run
from gptlab.word2vec import evaluation, reference, sampling
from gptlab.word2vec.config import Word2VecOptions
from gptlab.word2vec.datamodule import Word2VecDataModule
from gptlab.word2vec.model import Word2Vec

SMALL = [
    "task=word2vec",
    "word2vec.dim=16",
    "word2vec.epochs=1",
    "word2vec.batch_size=512",
    "word2vec.threads=1",
]


# ---- sampling ------------------------------------------------------------------------------------------


def test_tokenize_uses_the_project_word_splitter_and_drops_punctuation():
    assert sampling.tokenize('The "cat" sat, (quietly).') == ["the", "cat", "sat", "quietly"]
    assert sampling.tokenize("The cat.", lowercase=False, keep_punctuation=True) == ["The", "cat", "."]


def test_vocabulary_is_sorted_by_count_and_drops_rare_words():
    docs = [["b", "a", "b", "c"], ["b", "a", "d"]]
    vocab = sampling.Vocabulary.build(docs, min_count=2)
    assert vocab.words == ["b", "a"] and vocab.counts.tolist() == [3, 2]
    ids, doc = vocab.encode(docs)
    assert ids.tolist() == [0, 1, 0, 0, 1] and doc.tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(DataError, match="min_count=5"):
        sampling.Vocabulary.build(docs, min_count=5)


def test_subsampling_keeps_rare_words_and_thins_frequent_ones_by_word2vecs_formula():
    counts = np.array([100_000, 1_000, 10])
    keep = sampling.keep_probabilities(counts, 1e-3)
    t = 1e-3 * counts.sum()
    assert keep[0] == pytest.approx((math.sqrt(counts[0] / t) + 1) * t / counts[0])
    assert keep[0] < 0.2 and keep[2] == 1.0
    assert (sampling.keep_probabilities(counts, 0) == 1).all()


def test_negatives_follow_the_unigram_distribution_to_the_three_quarters():
    counts = np.array([1000, 100, 10, 1])
    draws = sampling.draw_negatives(sampling.noise_cdf(counts), (200_000,), np.random.default_rng(0))
    observed = np.bincount(draws, minlength=4) / len(draws)
    expected = counts**0.75 / (counts**0.75).sum()
    np.testing.assert_allclose(observed, expected, atol=0.005)
    assert observed[0] < counts[0] / counts.sum() - 0.05  # frequent words drawn less than their frequency


def test_windows_stay_inside_documents_and_the_drawn_radius():
    ids = np.arange(8)
    docs = np.array([0, 0, 0, 0, 0, 1, 1, 1])
    radius = np.array([2, 1, 2, 2, 1, 2, 2, 2])
    plan = sampling.EpochPlan(0, ids, docs, radius, 1)
    ctx = sampling.context_matrix(plan, 0, 8, window=2)  # columns: -2, -1, +1, +2
    assert ctx[0].tolist() == [-1, -1, 1, 2]
    assert ctx[1].tolist() == [-1, 0, 2, -1]  # radius 1: only the adjacent words
    assert ctx[4].tolist() == [-1, 3, -1, -1]  # the document ends after position 4
    assert ctx[5].tolist() == [-1, -1, 6, 7]


# ---- the model -----------------------------------------------------------------------------------------


def test_skipgram_loss_is_the_negative_sampling_objective():
    torch.manual_seed(0)
    model = Word2Vec(10, 4, "skipgram")
    torch.nn.init.normal_(model.output.weight)
    centre, context, negatives = torch.tensor([3]), torch.tensor([5]), torch.tensor([[1, 7]])
    v, u = model.input.weight, model.output.weight
    expected = -(
        torch.log(torch.sigmoid(v[3] @ u[5]))
        + torch.log(torch.sigmoid(-v[3] @ u[1]))
        + torch.log(torch.sigmoid(-v[3] @ u[7]))
    )
    assert torch.allclose(model(centre, context, negatives), expected.unsqueeze(0), atol=1e-6)
    # a negative that is the target itself is skipped, as word2vec.c skips it
    only_positive = -torch.log(torch.sigmoid(v[3] @ u[5]))
    assert torch.allclose(
        model(centre, context, torch.tensor([[5, 5]])), only_positive.unsqueeze(0), atol=1e-6
    )


def test_cbow_averages_the_context_and_gives_each_context_word_the_whole_gradient():
    torch.manual_seed(0)
    model = Word2Vec(10, 4, "cbow")
    torch.nn.init.normal_(model.output.weight)
    context = torch.tensor([[2, 4, -1, 6]])  # one empty slot
    h = model.input.weight[[2, 4, 6]].mean(0)
    assert torch.allclose(model.hidden(context)[0], h, atol=1e-6)
    loss = model(context, torch.tensor([1]), torch.tensor([[8]])).sum()
    loss.backward()
    grad = model.input.weight.grad.to_dense()
    hh = h.detach().requires_grad_()
    u = model.output.weight.detach()
    (-(torch.log(torch.sigmoid(hh @ u[1])) + torch.log(torch.sigmoid(-hh @ u[8])))).backward()
    for row in (2, 4, 6):  # word2vec.c / gensim cbow_mean=1: dL/dh added to every context vector
        assert torch.allclose(grad[row], hh.grad, atol=1e-6)
    assert grad[0].abs().sum() == 0  # the padding slot trains nothing


def test_options_are_checked_with_the_fix_in_the_message():
    with pytest.raises(ConfigError, match="word2vec.mode='glove'"):
        Word2VecOptions(mode="glove")
    with pytest.raises(ConfigError, match="windw -> window"):
        Word2VecOptions.from_dict({"windw": 3})
    with pytest.raises(ConfigError, match="lr_min"):
        Word2VecOptions(lr=0.01, lr_min=0.1)


def test_a_resumed_epoch_continues_with_the_same_batches():
    options = Word2VecOptions(batch_size=300, epochs=2, min_count=3)
    dm = Word2VecDataModule(DataSpec(), options, seed=3)
    dm.setup()
    n0 = dm.batches_in_epoch(0)
    assert dm.locate(n0 + 2) == (1, 2)
    again = Word2VecDataModule(DataSpec(), options, seed=3)
    again.setup()
    a, b = dm.batch(dm.plan(1), 2), again.batch(again.plan(1), 2)
    assert np.array_equal(a.inputs, b.inputs) and np.array_equal(a.negatives, b.negatives)
    assert 0.5 < a.progress < 1.0


# ---- training from the CLI -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """`python train.py -m task=word2vec word2vec.mode=cbow,skipgram` on the embedded corpus."""
    root = tmp_path_factory.mktemp("w2v_sweep")
    run_train(
        [
            "-m",
            *SMALL,
            "word2vec.mode=cbow,skipgram",
            f"paths.root_dir={root}",
            f"hydra.sweep.dir={root}/sweep",
        ],
        cwd=root,
    )
    return root / "sweep"


@pytest.mark.parametrize("job,mode", [(0, "cbow"), (1, "skipgram")])
def test_a_sweep_trains_both_modes_and_writes_vectors_gensim_reads(sweep, job, mode):
    run_dir = sweep / str(job)
    kv = KeyedVectors.load_word2vec_format(str(run_dir / "embeddings.txt"), binary=False)
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["hyper_parameters"]["word2vec"]["mode"] == mode
    vocab = ckpt["word2vec_vocab"]["words"]
    assert kv.index_to_key == vocab and kv.vector_size == 16
    weights = ckpt["state_dict"]["model.input.weight"].numpy()
    np.testing.assert_allclose(kv.vectors, weights, atol=1e-5)  # the text file holds the trained vectors
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["train/words_per_second"] > 0
    assert 0 < metrics["eval/wordsim353/coverage"] < 1
    assert (run_dir / "pca.png").stat().st_size > 10_000
    (wandb_file,) = find_runs(run_dir)
    logged = read_run(wandb_file)
    losses = [v for _, v in logged.metric("train/loss")]
    assert len(losses) >= 2 and losses[-1] < losses[0]  # the negative-sampling loss falls
    assert logged.metric("train/words_per_second")
    assert "eval/analogy/coverage" in logged.summary
    assert logged.config["word2vec"]["mode"] == mode


def test_bad_task_and_options_fail_at_config_time(tmp_path):
    proc = run_train(["task=glove", f"paths.root_dir={tmp_path}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "task='glove'" in proc.stderr
    proc = run_train(
        [*SMALL, "word2vec.min_count=1000000", f"paths.root_dir={tmp_path}"], cwd=tmp_path, check=False
    )
    assert proc.returncode == 2 and "lower word2vec.min_count" in proc.stderr


def test_a_stopped_run_resumes_and_ends_with_the_uninterrupted_vectors(tmp_path, make_cfg):
    """SIGTERM stops training with a checkpoint of the current step; resuming from it ends with exactly the
    vectors of the run that was never stopped (the batches and negatives of a step depend on the step alone)."""
    from gptlab.word2vec.task import run

    base = [
        *SMALL,
        "word2vec.epochs=2",
        "word2vec.checkpoint_every=5",
        "word2vec.evaluate=false",
        "logger=none",
    ]
    whole = run(make_cfg(*base, f"paths.output_dir={tmp_path / 'whole'}"))
    out = tmp_path / "stopped"
    ckpt = out / "checkpoints" / "last.ckpt"

    def send_sigterm() -> None:
        deadline = time.monotonic() + 120
        while not ckpt.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send_sigterm, daemon=True).start()
    run(make_cfg(*base, f"paths.output_dir={out}"))
    stopped = torch.load(ckpt, weights_only=True)["global_step"]
    assert 5 <= stopped < whole["train/steps"]
    resumed = run(make_cfg(*base, f"paths.output_dir={out}", f"resume={out}"))
    assert resumed["train/steps"] == whole["train/steps"]
    a = KeyedVectors.load_word2vec_format(str(tmp_path / "whole" / "embeddings.txt"))
    b = KeyedVectors.load_word2vec_format(str(out / "embeddings.txt"))
    assert a.index_to_key == b.index_to_key
    np.testing.assert_allclose(b.vectors, a.vectors, atol=1e-5)


@pytest.mark.slow
def test_a_killed_run_resumes_and_ends_with_the_uninterrupted_vectors(tmp_path):
    args = [
        *SMALL,
        "word2vec.epochs=2",
        "word2vec.checkpoint_every=5",
        "word2vec.evaluate=false",
        "logger=csv",
        f"paths.root_dir={tmp_path}",
    ]
    run_train([*args, f"hydra.run.dir={tmp_path}/whole"], cwd=tmp_path)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={killed}"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpt = killed / "checkpoints" / "last.ckpt"
    deadline = time.time() + 120
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (killed / "embeddings.txt").exists()
    step = torch.load(ckpt, weights_only=True)["global_step"]
    out = run_train([*args, f"hydra.run.dir={killed}", f"resume={killed}"], cwd=tmp_path)
    assert f"step {step}" in out.stdout + out.stderr
    whole = KeyedVectors.load_word2vec_format(str(tmp_path / "whole" / "embeddings.txt"))
    resumed = KeyedVectors.load_word2vec_format(str(killed / "embeddings.txt"))
    assert whole.index_to_key == resumed.index_to_key
    np.testing.assert_allclose(resumed.vectors, whole.vectors, atol=1e-5)


# ---- evaluation and the comparison with gensim -------------------------------------------------------


def test_benchmarks_report_scores_and_coverage():
    words = ["king", "queen", "man", "woman", "cat", "tiger", "car", "train", "love", "sex"]
    rng = np.random.default_rng(0)
    kv = evaluation.keyed_vectors(words, rng.normal(size=(len(words), 8)))
    m = evaluation.evaluate(kv)["metrics"]
    assert m["wordsim353/pairs"] >= 3 and 0 < m["wordsim353/coverage"] < 0.05
    assert m["analogy/questions"] >= 1  # man : woman :: king : queen
    assert m["vocab_size"] == len(words)


def test_our_skipgram_agrees_with_gensim_about_as_well_as_gensim_agrees_with_itself(tmp_path, make_cfg):
    """On the embedded corpus with the same words and settings, the 10 nearest neighbours of the frequent words
    overlap with gensim's at least 0.7 times as much as two gensim seeds overlap with each other."""
    from gptlab.word2vec.task import run

    cfg = make_cfg(
        "task=word2vec",
        "word2vec.dim=32",
        "word2vec.epochs=3",
        "word2vec.evaluate=false",
        "logger=none",
        f"paths.output_dir={tmp_path}",
    )
    run(cfg)
    ours = evaluation.load_embeddings(tmp_path)
    spec, options, seed = reference.run_settings(tmp_path)
    from gptlab.word2vec.datamodule import tokenized_documents

    result = reference.compare(ours, tokenized_documents(spec, options), options, seed, top_words=50)
    assert result["overlap/gensim_vs_gensim"] > 0.2
    assert result["overlap/ours_vs_gensim"] >= 0.7 * result["overlap/gensim_vs_gensim"], result
    assert result["ours"]["vocab_size"] == result["gensim"]["vocab_size"]


def test_eval_script_reads_a_gpt_runs_whole_word_token_embeddings(tmp_path, capsys):
    run_train(
        [*TINY, "logger=csv", f"paths.root_dir={tmp_path}", f"hydra.run.dir={tmp_path}/gpt"], cwd=tmp_path
    )
    kv = evaluation.load_embeddings(tmp_path / "gpt")
    assert 10_000 < len(kv) < 50_257 and kv.vector_size == 32
    assert "king" in kv.key_to_index and " king" not in kv.key_to_index
    script = runpy.run_path(str(ROOT / "scripts" / "eval_embeddings.py"))
    assert script["main"]([str(tmp_path / "gpt")]) == 0
    printed = capsys.readouterr().out
    assert "wordsim353" in printed and f"{len(kv)} words" in printed
    assert (tmp_path / "gpt" / "pca.png").is_file()


def test_batched_analogies_answer_as_gensims_evaluate_word_analogies():
    from gensim.test.utils import datapath

    questions = evaluation.read_analogies(datapath("questions-words.txt"))[:1500]
    words = sorted({w for q in questions for w in q})
    rng = np.random.default_rng(0)
    base = {w: rng.normal(size=24) for w in words}
    # structure the answers can be found from: d = c + (b - a), plus noise
    for a, b, c, d in questions[:600]:
        base[d] = base[c] + (base[b] - base[a]) + rng.normal(scale=0.5, size=24)
    kv = evaluation.keyed_vectors(words, np.stack([base[w] for w in words]))
    ours = evaluation.analogy_score(kv)
    _, sections = kv.evaluate_word_analogies(datapath("questions-words.txt"), restrict_vocab=len(kv))
    total = sections[-1]
    answered = len(total["correct"]) + len(total["incorrect"])
    assert ours["questions"] == answered and 0 < len(total["correct"]) < answered
    assert ours["accuracy"] == pytest.approx(len(total["correct"]) / answered)
