"""task=word2vec: sampling, the Huffman tree, each objective's loss, the fast update against the autograd
reference, training from the CLI and a sweep, trainer limits, token folders, the word2vec text file gensim
reads, a resume that ends where an uninterrupted run ends, evaluation and the gensim comparison."""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import runpy
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, needs_gensim, run_train, signal_when_held, strict_json

from gptlab.data.corpus import DataSpec
from gptlab.errors import ConfigError, DataError
from gptlab.tracking.wandb_runs import find_runs, read_run
from gptlab.word2vec import evaluation, fast, native, objectives, reference, sampling
from gptlab.word2vec.config import Word2VecOptions
from gptlab.word2vec.corpus import read_corpus
from gptlab.word2vec.model import Word2Vec
from gptlab.word2vec.schedule import Schedule


def keyed_vectors():
    """gensim's reader of the word2vec text format, imported where used: the module (and its CUDA test) then
    collects where gensim is not installed, as on a GPU machine that has only the wheels gptlab needs."""
    from gensim.models import KeyedVectors

    return KeyedVectors


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


def test_vocabulary_is_sorted_by_count_and_drops_rare_words(tmp_path):
    (tmp_path / "a.txt").write_text("b a b c")
    (tmp_path / "b.txt").write_text("b a d")
    corpus = read_corpus(DataSpec(path=str(tmp_path)), Word2VecOptions(min_count=2))
    assert corpus.vocab.words == ["b", "a"] and corpus.vocab.counts.tolist() == [3, 2]
    # one flat int array: words out of the vocabulary (-1) and document ends (-2) marked, no Python lists
    ids = corpus.read(*corpus.chunks(1 << 20)[0])
    assert isinstance(ids, np.ndarray) and ids.tolist() == [0, 1, 0, -1, -2, 0, 1, -1, -2]
    with pytest.raises(DataError, match="min_count=5"):
        read_corpus(DataSpec(path=str(tmp_path)), Word2VecOptions(min_count=5))


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


def test_tokenize_gives_word_splits_tokens_with_a_word_character():
    """The one-pass tokenizer against word_split and a filter, on strings of separators, dashes,
    underscores, unusual whitespace and non-ASCII letters."""
    from gptlab.data.tokenizers import word_split

    rng = np.random.default_rng(0)
    alphabet = list("aZ1-_,.:;?!\"()' \t\n\x0b\x1c\u00a0\u2003&$#\u00e9\u03a3\u200b") + ["--", "---"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(0, 16))))
        expected = [w for w in word_split(text.lower()) if any(c.isalnum() or c == "_" for c in w)]
        assert sampling.tokenize(text) == expected, repr(text)


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


# ---- objectives, the fast update and its autograd reference ---------------------------------------------


def test_huffman_codes_match_a_hand_built_tree():
    """counts 5, 3, 2, 1: word2vec.c merges 1+2 (node 0), then 3 with node 0 (a tie goes to the merged node,
    which is picked first; the second pick takes bit 1), then 5 with node 1; the root is node 2."""
    codes, points = objectives.huffman_codes(np.array([5, 3, 2, 1]))
    assert codes == [[0], [1, 1], [1, 0, 1], [1, 0, 0]]
    assert points == [[2], [2, 1], [2, 1, 0], [2, 1, 0]]
    hs = objectives.HierarchicalSoftmax(np.array([5, 3, 2, 1]))
    t = hs.targets(np.array([2]), np.random.default_rng(0))
    assert t.rows.tolist() == [[2, 1, 0]] and t.labels.tolist() == [[0, 1, 0]] and t.mask.sum() == 3
    given = objectives.HierarchicalSoftmax(np.array([5, 3, 2, 1]), (codes, points))
    assert np.array_equal(given.rows, hs.rows) and np.array_equal(given.labels, hs.labels)


def test_huffman_ties_go_as_in_word2vec_c():
    """counts 4, 2, 2, 1, 1, worked through word2vec.c's CreateBinaryTree by hand: 1+1 -> node 0 (count 2);
    then word 2 (count 2) against node 0 (count 2): not strictly less, so node 0 is picked first, word 2 takes
    bit 1 -> node 1 (4); word 1 (2) and node 1 -> node 2 (6); word 0 (4) and node 2 -> the root, node 3. The
    most frequent word gets a one-bit code; gensim's heap, which breaks ties by word index, gives it two bits
    (a tree of the same expected code length, 22 bits for these counts)."""
    counts = np.array([4, 2, 2, 1, 1])
    codes, points = objectives.huffman_codes(counts)
    assert codes == [[0], [1, 0], [1, 1, 1], [1, 1, 0, 1], [1, 1, 0, 0]]
    assert points == [[3], [3, 2], [3, 2, 1], [3, 2, 1, 0], [3, 2, 1, 0]]
    assert sum(c * len(code) for c, code in zip(counts, codes)) == 22


def _window_batch(objective, mode, rng, vocab=12, windows=5, slots=4):
    inputs = rng.integers(0, vocab, size=(windows, slots))
    inputs[rng.random(inputs.shape) < 0.3] = -1
    inputs[:, 0] = rng.integers(0, vocab, size=windows)  # every window has a context word
    target = rng.integers(0, vocab, size=windows)
    return fast.WindowBatch(inputs, target, objective.targets(target, rng), 1.0, 0.0)


OBJECTIVE_CASES = [(m, o) for m in ("skipgram", "cbow") for o in objectives.OBJECTIVES]


def softmax_uses(model: Word2Vec, batch, mode: str) -> np.ndarray:
    """Each output row's uses in a full-softmax batch: the sum over the batch's pairs (skip-gram: a context
    word and its centre word; CBOW: a window's mean and its centre word) of |onehot(target) - p|."""
    with torch.no_grad():
        x = model.input.weight[torch.from_numpy(np.maximum(batch.inputs, 0))]  # (G, C, d)
        present = torch.from_numpy(batch.inputs >= 0)
        target = torch.from_numpy(batch.target)
        if mode == "cbow":
            hidden = (x * present[:, :, None]).sum(1) / present.sum(1, keepdim=True).clamp(min=1)
        else:
            hidden, target = x[present], target[:, None].expand(present.shape)[present]
        coefficients = -torch.softmax(hidden @ model.output.weight.T, dim=1)
        coefficients[torch.arange(len(target)), target] += 1
        return coefficients.abs().sum(0).double().numpy()


@pytest.mark.parametrize("mode,name", OBJECTIVE_CASES)
def test_fast_update_is_one_sgd_step_of_the_autograd_reference(mode, name):
    """Same tables, same batch (repeated words included): the fast step without autograd (numpy on the CPU,
    and the torch version the GPU runs) moves every row as one SGD step on the reference's summed loss; in
    the sigmoid objectives (skip-gram's and CBOW's, C step included), a row used k times with ``lr k > 1`` at
    a learning rate of 1 / k; a CBOW output row, whose use is one pair (a skip-gram one's is its window's C
    context words), with ``lr k > C`` at C / k."""
    rng = np.random.default_rng(0)
    counts = np.array([40, 30, 20, 12, 9, 7, 5, 4, 3, 2, 2, 1])
    objective = objectives.build(name, counts, negatives=3, noise_power=0.75)
    batch = _window_batch(objective, mode, rng)
    # large enough for the bounds to apply to the rows used a few times (C = 4 slots: CBOW's outputs at 2.5)
    lr = 2.5 if mode == "cbow" else 0.5
    reference_model = Word2Vec(12, 6, mode, objective.output_rows)
    torch.nn.init.normal_(reference_model.output.weight)
    torch.nn.init.normal_(reference_model.input.weight)
    t = batch.outputs
    loss = reference_model(
        *(torch.from_numpy(a) for a in (batch.inputs, t.rows, t.labels, t.mask, batch.target)),
        softmax=name == "softmax",
    )
    loss.backward()
    # the sigmoid steps bound each row's learning rate by 1 / (its uses in the batch): min(lr, 1 / k)
    # (the full softmax's: an output row's uses are the sizes of its coefficients, |onehot - p|, over the pairs)
    pairs = batch.inputs.shape[1] if mode == "cbow" and name != "softmax" else 1
    uses_in = np.bincount(batch.inputs[batch.inputs >= 0], minlength=12)
    if name == "softmax":
        uses_out = softmax_uses(reference_model, batch, mode)
    else:
        uses_out = np.bincount(
            t.rows.reshape(-1), weights=t.mask.reshape(-1), minlength=objective.output_rows
        )
    assert uses_in.max() * lr > 1 and uses_out.max() * lr > pairs, "both bounds apply in this batch"
    lr_in = torch.from_numpy(np.minimum(lr, 1 / np.maximum(uses_in, 1))).float()[:, None]
    # lr min(1, pairs / (lr k)); the softmax's k is fractional, and a row it uses less than once is bounded too
    lr_out = torch.from_numpy(np.minimum(lr, pairs / np.maximum(uses_out, 1e-12))).float()[:, None]
    expected_in = reference_model.input.weight.detach() - lr_in * reference_model.input.weight.grad.to_dense()
    expected_out = (
        reference_model.output.weight.detach() - lr_out * reference_model.output.weight.grad.to_dense()
    )
    steps = [fast.numpy_step, fast.torch_step]
    if mode == "cbow" and name != "softmax":
        lib = native.library()
        assert lib is not None, "cc builds CBOW's C step on this machine"
        steps.append(
            lambda tables, batch, lr, mode, with_loss: native.cbow_step(lib, tables, batch, lr, with_loss)
        )
    for step in steps:
        if step is fast.numpy_step and name == "softmax":
            continue  # the full softmax has the torch step only
        tables = fast.Tables(12, objective.output_rows, 6, seed=0)
        tables.input.copy_(reference_model.input.weight.detach())
        tables.output.copy_(reference_model.output.weight.detach())
        kwargs = {"softmax": True} if step is fast.torch_step and name == "softmax" else {}
        got = step(tables, batch, lr, mode, with_loss=True, **kwargs)
        assert got == pytest.approx(float(loss.detach()), rel=1e-5)
        torch.testing.assert_close(tables.input, expected_in, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tables.output, expected_out, atol=1e-5, rtol=1e-5)
        assert not torch.equal(tables.output, reference_model.output.weight.detach())  # it did move


def test_cbow_steps_in_one_c_call_are_the_steps_one_by_one(tmp_path):
    """CBOW's C step takes a block's steps in one call: the tables, the logged losses, the words and the
    progress of every step are exactly those of the steps one by one (a round cut in the middle of a block
    included), and hierarchical softmax, whose batches differ in width, keeps its steps one by one."""
    from gptlab.word2vec.task import Trainer

    options = Word2VecOptions(mode="cbow", batch_size=64, epochs=1, min_count=3, dim=16)
    corpus = read_corpus(DataSpec(), options)
    schedule = Schedule(corpus, options, objectives.build("negative", corpus.vocab.counts, 5, 0.75), seed=3)
    items = [item for item in schedule.steps(0)][:21]  # two whole blocks of 8 steps and part of a third
    assert [schedule.block_key(i) for i in items].count(schedule.block_key(items[-1])) == 5

    def trained(whole_blocks: bool) -> tuple[Trainer, list]:
        trainer = Trainer(schedule, options, torch.device("cpu"), tmp_path, [], seed=3, log_every=3)
        assert trainer.native_steps is not None, "cc builds CBOW's C step on this machine"
        if whole_blocks:
            cuts = [items[:8], items[8:13], items[13:16], items[16:]]  # rounds may end inside a block
            results = [r for cut in cuts for r in trainer.work_steps(cut)]
        else:
            results = [trainer.work(item) for item in items]
        return trainer, results

    (one_by_one, expected), (in_blocks, got) = trained(False), trained(True)
    assert got == expected
    assert sum(loss is not None for _, loss, _, _ in got) == 7 and all(w > 0 for _, _, w, _ in got)
    assert torch.equal(in_blocks.tables.input, one_by_one.tables.input)
    assert torch.equal(in_blocks.tables.output, one_by_one.tables.output)
    hs_options = Word2VecOptions(mode="cbow", objective="hierarchical", batch_size=64, min_count=3, dim=16)
    hs = Schedule(corpus, hs_options, objectives.build("hierarchical", corpus.vocab.counts, 5, 0.75), seed=3)
    trainer = Trainer(hs, hs_options, torch.device("cpu"), tmp_path, [], seed=3)
    assert trainer.native is not None and trainer.native_steps is None


@pytest.mark.parametrize("name", objectives.OBJECTIVES)
def test_each_objectives_loss_is_its_formula(name):
    """One skip-gram window, context words 3 and 5 predicting word 2, computed by hand from the tables."""
    counts = np.array([9, 7, 5, 4, 3, 2, 1])
    objective = objectives.build(name, counts, negatives=2, noise_power=0.75)
    rng = np.random.default_rng(1)
    targets = objective.targets(np.array([2]), rng)
    batch = fast.WindowBatch(np.array([[3, 5, -1]]), np.array([2]), targets, 1.0, 0.0)
    tables = fast.Tables(7, objective.output_rows, 4, seed=0)
    torch.manual_seed(0)
    tables.output.normal_()
    x, u = tables.input.double(), tables.output.double()
    logsig = torch.nn.functional.logsigmoid
    expected = 0.0
    for c in (3, 5):
        if name == "negative":
            noise = targets.rows[0, 1:]
            expected -= float(logsig(x[c] @ u[2]))
            expected -= sum(float(logsig(-x[c] @ u[k])) for k in noise if k != 2)
        elif name == "hierarchical":
            codes, points = objectives.huffman_codes(counts)
            expected -= sum(
                float(logsig((1 - 2 * bit) * (x[c] @ u[node]))) for bit, node in zip(codes[2], points[2])
            )
        else:
            expected -= float(torch.log_softmax(u @ x[c], dim=0)[2])
    step = fast.torch_step if name == "softmax" else fast.numpy_step
    kwargs = {"softmax": True} if name == "softmax" else {}
    assert step(tables, batch, 0.0, "skipgram", with_loss=True, **kwargs) == pytest.approx(expected, rel=1e-5)


def test_full_softmax_is_refused_for_large_vocabularies():
    counts = np.ones(objectives.MAX_SOFTMAX_VOCAB + 1)
    with pytest.raises(
        ConfigError, match=r"objective=softmax over a vocabulary of 2,001 words.*hierarchical"
    ):
        objectives.build("softmax", counts, negatives=5, noise_power=0.75)
    with pytest.raises(ConfigError, match="word2vec.objective='nce'"):
        Word2VecOptions(objective="nce")


def test_without_a_c_compiler_cbow_runs_the_numpy_step(monkeypatch, caplog):
    """No compiler: library() says so and gives None (the trainer then runs the numpy step); a compiler
    builds the library once and later calls reuse it."""
    monkeypatch.setenv("CC", "no-such-cc-for-gptlab")
    with caplog.at_level(logging.INFO, logger="gptlab"):
        assert native.library() is None
    assert "no C compiler (no-such-cc-for-gptlab)" in caplog.text
    monkeypatch.delenv("CC")
    assert native.library() is native.library() is not None


def test_options_are_checked_with_the_fix_in_the_message():
    with pytest.raises(ConfigError, match="word2vec.mode='glove'"):
        Word2VecOptions(mode="glove")
    with pytest.raises(ConfigError, match=r"word2vec.windw.*Did you mean word2vec.window\?"):
        Word2VecOptions.from_dict({"windw": 3})
    with pytest.raises(ConfigError, match="lr_min"):
        Word2VecOptions(lr=0.01, lr_min=0.1)
    with pytest.raises(ConfigError, match="word2vec.native='yes' must be true"):
        Word2VecOptions(native="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("setting", "cuda", "batch", "device", "why"),
    [
        ("auto", True, 256, "cpu", "batch 256 is below 1,024, where a CUDA GPU trained slower than the CPU"),
        ("auto", True, 1023, "cpu", "batch 1,023 is below 1,024"),
        ("auto", True, 1024, "cuda", "a CUDA GPU at batch 1,024: from 1,024 it trained faster than the CPU"),
        ("auto", True, 4096, "cuda", "a CUDA GPU at batch 4,096"),
        ("auto", False, 4096, "cpu", "word2vec.device=auto: no CUDA GPU"),
        ("cuda", True, 256, "cuda", "word2vec.device=cuda"),
        ("cpu", True, 4096, "cpu", "word2vec.device=cpu"),
    ],
)
def test_device_auto_takes_the_gpu_from_the_batch_size_where_it_measured_faster(
    setting, cuda, batch, device, why
):
    from gptlab.word2vec.task import choose_device

    chosen, reason = choose_device(setting, cuda, batch)
    assert chosen == device and why in reason, reason


def test_the_log_says_which_device_word2vec_took_and_why(caplog):
    from gptlab.word2vec.task import choose_device, pick_device

    with caplog.at_level(logging.INFO, logger="gptlab"):
        assert pick_device(Word2VecOptions(device="cpu")) == torch.device("cpu")
    assert "word2vec: training on the CPU (word2vec.device=cpu)" in caplog.text
    with pytest.raises(ConfigError, match="word2vec.device=cuda, but torch sees no CUDA GPU"):
        choose_device("cuda", False, 256)


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        ({"mode": "cbw"}, "Did you mean word2vec.mode=cbow?"),
        ({"objective": "hierarchichal"}, "Did you mean word2vec.objective=hierarchical?"),
        ({"optimizer": "sparse-adam"}, "Did you mean word2vec.optimizer=sparse_adam?"),
        ({"parallel": "thread"}, "Did you mean word2vec.parallel=threads?"),
        ({"dim": 0}, "word2vec.dim=0 must be a positive integer (e.g. word2vec.dim=100)."),
    ],
)
def test_a_mistyped_choice_or_a_bad_size_gets_the_fix(options, shown):
    with pytest.raises(ConfigError) as refused:
        Word2VecOptions(**options)
    assert shown in str(refused.value)


def test_the_evaluation_without_gensim_is_refused_before_training_with_both_fixes(monkeypatch, tmp_path):
    """Where gensim is not installed (a GPU image given only the wheels gptlab's GPU paths need), the evaluation
    that reads the vectors with it is refused when the config is checked, not after the training; a run that
    leaves the evaluation out goes ahead."""
    import gptlab

    monkeypatch.setitem(sys.modules, "gensim", None)  # as an environment without gensim finds it
    root = f"paths.root_dir={tmp_path}"
    with pytest.raises(ConfigError) as refused:
        gptlab.compose(*SMALL, root)
    message = str(refused.value)
    assert "word2vec.evaluate=true needs gensim" in message and "is not installed here" in message
    assert "pip install 'gensim>=4.4,<4.5'" in message and "add word2vec.evaluate=false" in message
    assert gptlab.compose(*SMALL, root, "word2vec.evaluate=false").word2vec.evaluate is False


def test_an_epochs_batches_train_every_kept_window_once_in_blocks_ordered_by_radius():
    """Each batch holds windows of a block of batches sorted by radius, its context matrix as wide as its
    largest radius; over an epoch every window of the plan is trained once and the batches cover every
    corpus word of the vocabulary."""
    options = Word2VecOptions(batch_size=64, epochs=1, min_count=3)
    corpus = read_corpus(DataSpec(), options)
    schedule = Schedule(corpus, options, objectives.build("negative", corpus.vocab.counts, 5, 0.75), seed=3)
    plan = schedule.plan(0, 0)
    targets, words = [], 0.0
    for step, epoch, chunk, index in schedule.steps(0):
        if epoch or chunk:
            break
        batch = schedule.batch(step, epoch, chunk, index)
        block = schedule.block(epoch, chunk, index // sampling.SORT_BLOCK_BATCHES)
        assert (np.diff(block.radius) >= 0).all()
        width = batch.inputs.shape[1]
        assert (batch.inputs[:, [0, -1]] >= 0).any() and width <= 2 * options.window
        assert ((batch.inputs >= 0).sum(1) >= 1).all()
        assert batch.outputs.rows.shape == (len(batch.target), 1 + 5)
        targets.append(batch.target)
        words += batch.words
    assert sorted(np.concatenate(targets).tolist()) == sorted(plan.ids.tolist())
    assert len(schedule.chunks) == 1 and words == (corpus.read(*schedule.chunks[0]) >= 0).sum()
    # CBOW under hierarchical softmax: a block's windows by path length, a batch as wide as its longest path
    options = Word2VecOptions(mode="cbow", objective="hierarchical", batch_size=64, epochs=1, min_count=3)
    hs = objectives.build("hierarchical", corpus.vocab.counts, 5, 0.75)
    schedule = Schedule(corpus, options, hs, seed=3)
    block = schedule.block(0, 0, 0)
    assert (np.diff(hs.code_length[block.ids]) >= 0).all()
    batch = schedule.batch(0, 0, 0, 0)
    assert batch.outputs.rows.shape[1] == hs.code_length[batch.target].max() < hs.depth


def test_a_word_alone_in_its_document_is_no_window():
    """Documents of one word (ids -2 end a document) give no window; a chunk of only such words no batch."""
    ids = np.array([3, -2, 1, 2, 1, -2, 4, -2])
    plan = sampling.plan_chunk(ids, np.ones(5), window=2, batch_words=4, seed=0, epoch=0)
    assert plan.ids.tolist() == [1, 2, 1] and plan.n_batches == 1
    assert plan.span is not None and plan.span.sum() == 5  # every word of the vocabulary is covered
    alone = sampling.plan_chunk(
        np.array([3, -2, 4, -2]), np.ones(5), window=2, batch_words=4, seed=0, epoch=0
    )
    assert len(alone.ids) == 0 and alone.span is not None and len(alone.span) == 0 and alone.n_batches == 0
    unknown = sampling.plan_chunk(
        np.array([-1, -1, -2]), np.ones(5), window=2, batch_words=4, seed=0, epoch=0
    )
    assert len(unknown.ids) == 0 and unknown.n_batches == 0


def test_a_resumed_epoch_continues_with_the_same_batches():
    options = Word2VecOptions(batch_size=300, epochs=2, min_count=3)
    corpus = read_corpus(DataSpec(), options)
    counts = corpus.vocab.counts

    def schedule():
        return Schedule(
            corpus, options, objectives.build("negative", counts, 5, 0.75), seed=3, chunk_positions=20_000
        )

    first = schedule()
    n0 = sum(first.batches_in(0, c) for c in range(len(first.chunks)))
    assert len(first.chunks) > 1 and first.locate(n0 + 2) == (1, 0, 2)
    steps = list(first.steps(0))
    assert len(steps) == n0 + sum(first.batches_in(1, c) for c in range(len(first.chunks)))
    again = schedule()
    a, b = first.batch(*steps[n0 + 2]), again.batch(*list(again.steps(n0 + 2))[0])
    assert np.array_equal(a.inputs, b.inputs) and np.array_equal(a.outputs.rows, b.outputs.rows)
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


@needs_gensim
@pytest.mark.parametrize("job,mode", [(0, "cbow"), (1, "skipgram")])
def test_a_sweep_trains_both_modes_and_writes_vectors_gensim_reads(sweep, job, mode):
    run_dir = sweep / str(job)
    kv = keyed_vectors().load_word2vec_format(str(run_dir / "embeddings.txt"), binary=False)
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


def test_compare_skips_a_word2vec_run_saying_what_it_is_and_what_scores_it(sweep):
    from gptlab.comparison.records import read_run_dir

    with pytest.raises(DataError) as skipped:
        read_run_dir(sweep / "0")
    assert str(skipped.value) == (
        f"{sweep / '0'} is a task=word2vec run: its word vectors have no val/loss to compare (python "
        f"scripts/eval_embeddings.py {sweep / '0'} scores them)"
    )


def test_trainer_max_steps_on_the_command_line_caps_the_run(tmp_path):
    out = run_train(
        [
            *SMALL,
            "trainer.max_steps=3",
            "word2vec.evaluate=false",
            "logger=csv",
            f"hydra.run.dir={tmp_path}/run",
        ],
        cwd=tmp_path,
    )
    assert "Trained 3 steps" in out.stdout
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["global_step"] == 3 and result["finished"]
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    assert "train/loss" in (tmp_path / "run" / "csv" / "metrics.csv").read_text()
    # a cap, not a target: a run whose epochs end first ends with them
    out = run_train(
        [
            *SMALL,
            "trainer.max_steps=100000",
            "word2vec.evaluate=false",
            "logger=none",
            f"hydra.run.dir={tmp_path}/cap",
        ],
        cwd=tmp_path,
    )
    steps = json.loads((tmp_path / "cap" / "result.json").read_text())["global_step"]
    assert 10 < steps < 1000 and f"Trained {steps} steps" in out.stdout
    proc = run_train(
        [*SMALL, "trainer.max_steps=0", "logger=none", f"hydra.run.dir={tmp_path}/bad"],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2 and "trainer.max_steps=0" in proc.stderr


def _gpt2_documents() -> list[np.ndarray]:
    from pydoc_data import topics

    from gptlab.data.tokenizers import GPT2Tokenizer

    tok = GPT2Tokenizer.create(GPT2Tokenizer.Options())
    texts = [topics.topics[k] for k in sorted(topics.topics)[:30]]
    return [np.array([*tok.encode(t), tok.eot_id], dtype=np.uint16) for t in texts]


@needs_gensim
def test_word2vec_reads_nanogpt_token_folders_and_scores_whole_word_tokens(tmp_path):
    docs = _gpt2_documents()
    folder = tmp_path / "nanogpt"
    folder.mkdir()
    np.concatenate(docs[:25]).tofile(folder / "train.bin")
    np.concatenate(docs[25:]).tofile(folder / "val.bin")
    run_dir = tmp_path / "run"
    out = run_train([*SMALL, f"data.path={folder}", "logger=none", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert "GPT-2 token ids" in out.stdout + out.stderr
    kv = keyed_vectors().load_word2vec_format(str(run_dir / "embeddings.txt"))
    assert "\u0120the" in kv.key_to_index and "\u010a" in kv.key_to_index  # " the" and a newline
    assert all(" " not in w for w in kv.index_to_key)
    scored = json.loads((run_dir / "evaluation.json").read_text())
    assert 0 < scored["metrics"]["vocab_size"] < len(kv)  # the whole-word tokens (" the" -> "the")


def test_llmc_shards_give_the_vocabulary_of_the_same_tokens(tmp_path):
    from gptlab.data.shards import LLMC_HEADER_INTS, LLMC_MAGIC, LLMC_VERSION

    docs = _gpt2_documents()
    tokens = {"train": np.concatenate(docs[:25]), "val": np.concatenate(docs[25:])}
    llmc, nanogpt = tmp_path / "llmc", tmp_path / "nanogpt"
    llmc.mkdir()
    nanogpt.mkdir()
    for split, ids in tokens.items():
        header = np.zeros(LLMC_HEADER_INTS, dtype=np.int32)
        header[:3] = LLMC_MAGIC, LLMC_VERSION, len(ids)
        with open(llmc / f"corpus_{split}_000000.bin", "wb") as f:
            f.write(header.tobytes() + ids.tobytes())
        ids.tofile(nanogpt / f"{split}.bin")
    options = Word2VecOptions(min_count=3)
    a, b = read_corpus(DataSpec(path=str(llmc)), options), read_corpus(DataSpec(path=str(nanogpt)), options)
    assert a.vocab.words == b.vocab.words and a.vocab.counts.tolist() == b.vocab.counts.tolist()
    assert a.n_raw == b.n_raw == sum(len(d) for d in docs)  # both splits, every token
    assert isinstance(a.sources[0].read(0, 10), np.memmap)  # read from the files as they are, not copied


def test_a_streamed_corpus_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="data.streaming=false"):
        read_corpus(DataSpec(name="some/dataset", streaming=True), Word2VecOptions())


def test_trainer_max_time_is_parsed_as_lightning_writes_it():
    from gptlab.word2vec.task import parse_max_time

    assert parse_max_time("00:01:30:05") == 5405 and parse_max_time({"minutes": 2}) == 120
    with pytest.raises(ConfigError, match="DD:HH:MM:SS"):
        parse_max_time("90 minutes")


def test_bad_task_and_options_fail_at_config_time(tmp_path):
    proc = run_train(["task=glove", f"paths.root_dir={tmp_path}"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "task='glove'" in proc.stderr
    proc = run_train(
        [*SMALL, "word2vec.min_count=1000000", "word2vec.evaluate=false", f"paths.root_dir={tmp_path}"],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2 and "lower word2vec.min_count" in proc.stderr


@needs_gensim
def test_a_stopped_run_resumes_and_ends_with_the_uninterrupted_vectors(tmp_path, make_cfg):
    """SIGTERM stops training with a checkpoint of the current step; resuming from it ends with exactly the
    vectors of the run that was never stopped (the batches and negatives of a step depend on the step alone)."""
    from gptlab.tasks.word2vec import run

    base = [
        *SMALL,
        "word2vec.epochs=2",
        "word2vec.checkpoint_every=5",
        "word2vec.evaluate=false",
        "logger=none",
    ]
    gc.unfreeze()  # as a fresh process: nothing frozen
    whole = run(make_cfg(*base, f"paths.output_dir={tmp_path / 'whole'}"))
    # training froze what was there before it for its workers' sake, and handed it back: a notebook or a test
    # process that calls it goes on collecting its garbage
    assert gc.get_freeze_count() == 0
    out = tmp_path / "stopped"
    ckpt = out / "checkpoints" / "last.ckpt"

    def send_sigterm() -> None:
        # as long as a loaded machine needs to get there; never a signal before the checkpoint: the
        # test's assertions then say the run was not stopped
        deadline = time.monotonic() + 600
        while not ckpt.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if ckpt.exists():
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send_sigterm, daemon=True).start()
    run(make_cfg(*base, f"paths.output_dir={out}"))
    stopped = torch.load(ckpt, weights_only=True)["global_step"]
    assert 5 <= stopped < whole["train/steps"]
    result = json.loads((out / "result.json").read_text())
    assert result["stopped_during"] == "training" and result["stop_signal"] == "SIGTERM"
    assert result["stopped_by_signal"] is True and "evaluation_missing" not in result  # evaluate=false
    resumed = run(make_cfg(*base, f"paths.output_dir={out}", f"resume={out}"))
    assert resumed["train/steps"] == whole["train/steps"]
    a = keyed_vectors().load_word2vec_format(str(tmp_path / "whole" / "embeddings.txt"))
    b = keyed_vectors().load_word2vec_format(str(out / "embeddings.txt"))
    assert a.index_to_key == b.index_to_key
    np.testing.assert_allclose(b.vectors, a.vectors, atol=1e-5)


@pytest.mark.parametrize(
    "mode,parallel",
    [("skipgram", "processes"), ("skipgram", "threads"), ("cbow", "processes"), ("cbow", "threads")],
)
@needs_gensim
def test_hogwild_workers_train_every_step_of_the_schedule_once(tmp_path, make_cfg, mode, parallel):
    """Two workers (forked processes on shared tables, or threads) train the steps and words one worker
    trains, and move the shared vectors the parent then writes (CBOW: its C step, in each worker)."""
    from gptlab.tasks.word2vec import run

    base = [
        *SMALL[:-1],
        f"word2vec.mode={mode}",
        "word2vec.epochs=2",
        "word2vec.evaluate=false",
        "logger=none",
    ]
    one = run(make_cfg(*base, "word2vec.threads=1", f"paths.output_dir={tmp_path / 'one'}"))
    two = run(
        make_cfg(
            *base,
            "word2vec.threads=2",
            f"word2vec.parallel={parallel}",
            f"paths.output_dir={tmp_path / 'two'}",
        )
    )
    assert two["train/steps"] == one["train/steps"] and two["train/words"] == one["train/words"]
    assert math.isfinite(two["train/loss"]) and two["train/loss"] < math.log(2) * 6
    a = keyed_vectors().load_word2vec_format(str(tmp_path / "one" / "embeddings.txt"))
    b = keyed_vectors().load_word2vec_format(str(tmp_path / "two" / "embeddings.txt"))
    assert a.index_to_key == b.index_to_key
    assert 0.5 < np.linalg.norm(b.vectors) / np.linalg.norm(a.vectors) < 2  # trained as much, not identical
    ckpt = torch.load(tmp_path / "two" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == one["train/steps"]
    np.testing.assert_allclose(ckpt["state_dict"]["model.input.weight"].numpy(), b.vectors, atol=1e-5)


def _embedded_corpus_run(make_cfg, run_dir, *overrides):
    """Skip-gram on the embedded corpus (64,583 words, vocabulary 1,406), one worker, in this process."""
    from gptlab.tasks.word2vec import run

    return run(
        make_cfg(
            "task=word2vec",
            "word2vec.device=cpu",
            "word2vec.threads=1",
            "word2vec.evaluate=false",
            "logger=none",
            f"paths.output_dir={run_dir}",
            *overrides,
        )
    )


def test_a_large_batch_trains_as_far_as_a_small_one_instead_of_diverging(tmp_path, make_cfg):
    """Batches of 4,096 windows use a frequent word hundreds of times a step; summed at its old value, their
    steps overshot and this run ended at a loss of 104,490 per pair. Bounded per row, it ends near the loss of
    batches of 256, and result.json says it did not diverge."""
    base = ["word2vec.dim=50", "word2vec.epochs=2"]
    small = _embedded_corpus_run(make_cfg, tmp_path / "small", *base, "word2vec.batch_size=256")
    large = _embedded_corpus_run(make_cfg, tmp_path / "large", *base, "word2vec.batch_size=4096")
    assert large["train/steps"] < small["train/steps"] / 10  # the large batches are what they say
    assert math.isfinite(large["train/loss"]) and large["train/loss"] < 1.1 * small["train/loss"]
    assert json.loads((tmp_path / "large" / "result.json").read_text())["diverged"] is False


def test_a_large_cbow_batch_at_a_larger_rate_trains_instead_of_diverging_and_is_warned_of(
    tmp_path, make_cfg, caplog
):
    """CBOW at lr 0.1 (word2vec.c's CBOW default is 0.05): with batches of 4,096 its summed steps overshot
    and this run ended at a loss of 9e20 per pair. Bounded per row in its C step too, it ends near the loss
    of batches of 256; the configuration is warned of before training, with a batch size that keeps the
    vectors close to small batches'."""
    caplog.set_level(logging.WARNING, logger="gptlab")
    base = ["word2vec.mode=cbow", "word2vec.lr=0.1", "word2vec.dim=50", "word2vec.epochs=2"]
    small = _embedded_corpus_run(make_cfg, tmp_path / "small", *base, "word2vec.batch_size=256")
    assert not caplog.records  # 256 x 0.1 = 25.6: small batches' vectors
    large = _embedded_corpus_run(make_cfg, tmp_path / "large", *base, "word2vec.batch_size=4096")
    assert large["train/steps"] < small["train/steps"] / 10
    assert math.isfinite(large["train/loss"]) and large["train/loss"] < 1.1 * small["train/loss"]
    assert json.loads((tmp_path / "large" / "result.json").read_text())["diverged"] is False
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(
        "word2vec.batch_size=4096 at word2vec.lr=0.1 (batch_size x lr = 409.6, above 25.6)"
    )
    assert warning.endswith("word2vec.batch_size=256 keeps them close.")


def test_a_large_full_softmax_batch_trains_instead_of_diverging(tmp_path, make_cfg):
    """The full softmax steps every output row for every pair: with batches of 4,096 windows (lr 0.1 decayed
    over 11 steps) the summed steps overshot and this run's loss passed 2x its start (ln 1,406 = 7.25 per pair)
    by step 10, as 2 epochs at the default lr 0.025 did. Bounded per row as the sigmoid objectives' steps, its
    loss falls and result.json says it did not diverge."""
    base = ["word2vec.objective=softmax", "word2vec.dim=50", "word2vec.lr=0.1", "word2vec.max_steps=11"]
    large = _embedded_corpus_run(make_cfg, tmp_path / "large", *base, "word2vec.batch_size=4096")
    result = json.loads((tmp_path / "large" / "result.json").read_text())
    assert result["diverged"] is False and large["train/steps"] == 11
    assert math.isfinite(large["train/loss"]) and large["train/loss"] < math.log(1406)


def test_a_diverging_run_says_so_where_its_loss_is_shown(tmp_path, make_cfg, caplog, capsys):
    """A learning rate far too large: the log warns as the loss passes twice its start, the closing line
    shows the final loss beside the start's, and result.json says diverged: true with the numbers."""
    caplog.set_level(logging.WARNING, logger="gptlab")
    metrics = _embedded_corpus_run(
        make_cfg, tmp_path, "word2vec.dim=16", "word2vec.epochs=1", "word2vec.lr=5"
    )
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["diverged"] is True
    divergence = result["divergence"]
    start, bad = divergence["start_loss"], divergence["train/loss"]
    # the untrained vectors' loss: 1 + 5 negatives, each scored 0 (ln 2), less the noise words equal to the
    # target (masked)
    assert 5.5 * math.log(2) < start <= 6 * math.log(2)
    assert bad in ("nan", "inf") or bad > 2 * start
    warnings = [r.getMessage() for r in caplog.records if "word2vec diverged" in r.getMessage()]
    assert len(warnings) == 2  # as training logs the loss, and again at the end with the final one
    assert f"step {divergence['step']}, more than 2x its {start:.4g} at the start" in warnings[0]
    assert "Lower word2vec.lr or word2vec.batch_size" in warnings[0]
    assert f"(final {metrics['train/loss']:.4g})" in warnings[1]
    closing = f"final loss {metrics['train/loss']:.4g} per pair ({start:.4g} at the start)"
    assert closing in capsys.readouterr().out
    # a resumed run is judged against the same start
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["word2vec_start_loss"] == start


@pytest.mark.gpu
def test_the_gpu_step_matches_the_cpu_step_and_trains_from_the_cli(tmp_path):
    rng = np.random.default_rng(0)
    counts = np.arange(40, 0, -1)
    for mode in ("skipgram", "cbow"):
        objective = objectives.build("negative", counts, negatives=3, noise_power=0.75)
        batch = _window_batch(objective, mode, rng, vocab=40, windows=64, slots=6)
        cpu, gpu = fast.Tables(40, 40, 8, seed=0), fast.Tables(40, 40, 8, seed=0, device="cuda")
        for t in (cpu, gpu):
            t.output.copy_(torch.linspace(-1, 1, 320).view(40, 8))
        fast.sgd_step(cpu, batch, 0.05, mode)
        fast.sgd_step(gpu, batch, 0.05, mode)
        torch.testing.assert_close(gpu.input.cpu(), cpu.input, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(gpu.output.cpu(), cpu.output, atol=1e-5, rtol=1e-4)
    out = run_train(
        [
            *SMALL,
            "word2vec.device=cuda",
            "word2vec.evaluate=false",
            "logger=none",
            f"hydra.run.dir={tmp_path}/run",
        ],
        cwd=tmp_path,
    )
    assert "cuda" in out.stdout and (tmp_path / "run" / "embeddings.txt").is_file()


@needs_gensim
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
    # killed once its first checkpoint is written, the run held there: the kill cannot come after its end
    ready = ("word2vec checkpoint written at step",)
    status, output = signal_when_held(
        [*args, f"hydra.run.dir={killed}"], tmp_path, "hold_after_word2vec_checkpoint", ready, signal.SIGKILL
    )
    assert status == -signal.SIGKILL and not (killed / "embeddings.txt").exists(), output[-3000:]
    step = torch.load(killed / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert step == 5  # word2vec.checkpoint_every
    out = run_train([*args, f"hydra.run.dir={killed}", f"resume={killed}"], cwd=tmp_path)
    assert f"step {step}" in out.stdout + out.stderr
    whole = keyed_vectors().load_word2vec_format(str(tmp_path / "whole" / "embeddings.txt"))
    resumed = keyed_vectors().load_word2vec_format(str(killed / "embeddings.txt"))
    assert whole.index_to_key == resumed.index_to_key
    np.testing.assert_allclose(resumed.vectors, whole.vectors, atol=1e-5)


def stop_during_evaluation(args: list[str], cwd, signum: int) -> tuple[int, str]:
    """Run ``python train.py <args>`` (through tests/faults.py, which holds word2vec's evaluation open once it
    has begun) and send ``signum`` when the process says its evaluation is under way: (exit status, output)."""
    ready = ("word2vec evaluation under way",)
    return signal_when_held(args, cwd, "hold_word2vec_evaluation", ready, signum, timeout=400)


@needs_gensim
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm-run", "ctrl_c-sweep"])
def test_a_stop_signal_during_the_evaluation_keeps_the_vectors_and_records_the_missing_scores(
    tmp_path, signum
):
    """A signal once training is over and the vectors are scored: the run ends as a stop during training
    does (status 0 alone; a sweep stops with 128 + the signal's number), with the vectors kept, result.json
    saying where it stopped and which scores are missing (null, none carried over), and a message saying
    how to get them. SIGTERM: a single run, then the message's resume=auto, which scores them; Ctrl-C: the
    first job of a sweep, the second never started."""
    from pydoc_data import topics

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(topics.topics[k] for k in sorted(topics.topics)[:20]))
    args = [*SMALL, "word2vec.dim=8", f"data.path={corpus}", "logger=csv", f"paths.root_dir={tmp_path}"]
    sweep = signum == signal.SIGINT
    if sweep:
        run_dir = tmp_path / "sweep" / "0"
        status, output = stop_during_evaluation(
            ["-m", *args, "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path, signum
        )
    else:
        run_dir = tmp_path / "run"
        status, output = stop_during_evaluation([*args, f"hydra.run.dir={run_dir}"], tmp_path, signum)
    name = "Ctrl-C" if sweep else "SIGTERM"
    assert status == (128 + signum if sweep else 0), output[-3000:]
    assert "Traceback" not in output
    assert (
        f"Stopped by {name} during the evaluation, after training to step " in output
        and f"python scripts/eval_embeddings.py {run_dir} (prints the scores)" in output
    ), output[-3000:]

    result = json.loads((run_dir / "result.json").read_text())
    missing = [f"eval/{m}" for m in evaluation.METRICS]
    assert result["stopped_by_signal"] is True and result["finished"] is False
    assert result["stopped_during"] == "evaluation" and result["stop_signal"] == name
    assert result["evaluation_missing"] == missing
    assert all(result["metrics"][k] is None for k in missing)
    assert [p["status"] for p in result["parts"]] == ["stopped"]
    # training's figures are there, and the vectors of its last step are kept in both forms
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert result["global_step"] == result["checkpoint_step"] == saved["global_step"] > 0
    assert result["metrics"]["train/steps"] == saved["global_step"]
    assert math.isfinite(result["metrics"]["train/loss"])
    kv = keyed_vectors().load_word2vec_format(str(run_dir / "embeddings.txt"))
    assert kv.index_to_key == saved["word2vec_vocab"]["words"]
    np.testing.assert_allclose(kv.vectors, saved["state_dict"]["model.input.weight"].numpy(), atol=1e-5)
    assert not (run_dir / "evaluation.json").exists()
    if sweep:
        assert f"{name} stopped the sweep in job #0 (" in output and not (tmp_path / "sweep" / "1").exists()
        return

    # the message's way to the scores: the same command with resume=auto trains nothing and evaluates
    out = run_train([*args, f"hydra.run.dir={run_dir}", "resume=auto"], cwd=tmp_path)
    assert f"Nothing left to train at step {saved['global_step']}" in out.stdout
    resumed = json.loads((run_dir / "result.json").read_text())
    assert resumed["finished"] is True and resumed["stopped_by_signal"] is False
    assert "evaluation_missing" not in resumed
    assert [p["status"] for p in resumed["parts"]] == ["stopped", "finished"]
    scores = json.loads((run_dir / "evaluation.json").read_text())["metrics"]
    assert resumed["metrics"]["eval/vocab_size"] == scores["vocab_size"] == len(kv)
    # the part that trained nothing left training's figures as they were
    for key in ("train/loss", "train/words", "train/words_per_second"):
        assert resumed["metrics"][key] == result["metrics"][key]


@needs_gensim
def test_a_stop_signal_while_the_vectors_are_written_lets_them_be_written_whole(
    tmp_path, make_cfg, monkeypatch
):
    """SIGTERM as embeddings.txt is being written (the run in this process): the file is written whole, the
    evaluation does not start, and result.json names the scores it misses; the handlers are put back."""
    from gptlab.tasks.word2vec import run

    write = evaluation.write_embeddings

    def write_under_a_signal(path, words, vectors):
        os.kill(os.getpid(), signal.SIGTERM)  # handled before the first line is written
        return write(path, words, vectors)

    monkeypatch.setattr(evaluation, "write_embeddings", write_under_a_signal)
    handler_before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "run"
    metrics = run(make_cfg(*SMALL, "word2vec.dim=8", "logger=none", f"paths.output_dir={out}"))
    assert signal.getsignal(signal.SIGTERM) == handler_before
    result = json.loads((out / "result.json").read_text())
    assert result["stopped_during"] == "evaluation" and result["stop_signal"] == "SIGTERM"
    assert result["evaluation_missing"] == [f"eval/{m}" for m in evaluation.METRICS]
    assert all(math.isnan(metrics[k]) for k in result["evaluation_missing"])
    assert not (out / "evaluation.json").exists()
    kv = keyed_vectors().load_word2vec_format(str(out / "embeddings.txt"))
    saved = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert kv.index_to_key == saved["word2vec_vocab"]["words"]
    assert not list(out.glob(".embeddings.txt.tmp-*"))


def tiny_corpus(tmp_path):
    """A corpus of Python's documentation: its vocabulary covers no analogy question and no WordSim-353 pair,
    so two of its scores are NaN."""
    from pydoc_data import topics

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(topics.topics[k] for k in sorted(topics.topics)[:20]))
    return corpus


@needs_gensim
def test_every_json_file_of_a_word2vec_run_is_strict_json_with_missing_and_non_finite_scores(
    tmp_path, make_cfg, monkeypatch
):
    """A run whose evaluation a stop signal ended, then resumed to score its vectors on benchmarks its
    vocabulary misses: each JSON file of the run is strict JSON; the scores not measured are null and named
    (evaluation_missing), the NaN ones "nan"; the Python API reads them as missing and as NaN."""
    from gptlab.api import TrainResult
    from gptlab.comparison.records import result_metric
    from gptlab.tasks.word2vec import run

    out = tmp_path / "run"
    args = [*SMALL, "word2vec.dim=8", f"data.path={tiny_corpus(tmp_path)}", "logger=csv"]
    evaluate = evaluation.evaluate

    def evaluate_under_a_signal(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)  # the evaluation under way: it ends at once
        return evaluate(*a, **kw)

    monkeypatch.setattr(evaluation, "evaluate", evaluate_under_a_signal)
    run(make_cfg(*args, f"paths.output_dir={out}"))
    missing = [f"eval/{m}" for m in evaluation.METRICS]
    files = sorted(out.rglob("*.json"))
    assert {p.name for p in files} >= {"result.json", "metrics.json", "run.json"}
    for path in files:
        strict_json(path)
    result = strict_json(out / "result.json")
    assert result["stopped_during"] == "evaluation" and result["evaluation_missing"] == missing
    # its environment as it trained: one thread on the CPU (word2vec's own choice), no trainer precision
    assert (result["environment"]["torch_threads"], result["environment"]["precision"]) == (1, None)
    assert all(result["metrics"][k] is None for k in missing)
    read = TrainResult.read(out)
    assert sorted(read.missing) == sorted(missing) and not set(missing) & set(read.metrics)
    assert read.metrics["train/steps"] == result["global_step"] > 0
    assert result_metric(result, "eval/analogy/accuracy") is None  # missing, not 0

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    run(make_cfg(*args, f"paths.output_dir={out}", "resume=auto"))
    for path in sorted(out.rglob("*.json")):
        strict_json(path)
    result, metrics = strict_json(out / "result.json"), strict_json(out / "metrics.json")
    scores = strict_json(out / "evaluation.json")["metrics"]
    assert "evaluation_missing" not in result and result["finished"] is True
    for name in ("analogy/accuracy", "wordsim353/spearman"):  # no question, no pair in the vocabulary
        assert scores[name] == metrics[f"eval/{name}"] == result["metrics"][f"eval/{name}"] == "nan"
    assert scores["analogy/questions"] == 0 and scores["wordsim353/pairs"] == 0
    assert result["metrics"]["eval/simlex999/pairs"] == scores["simlex999/pairs"] > 0
    read = TrainResult.read(out)
    assert read.missing == () and math.isnan(read.metrics["eval/analogy/accuracy"])
    assert read.metrics["eval/vocab_size"] == scores["vocab_size"] > 0


@needs_gensim
def test_result_json_carries_scores_only_of_the_vectors_it_ends_with(tmp_path, make_cfg, monkeypatch):
    """Scores describe the vectors of one step. A part resumed with word2vec.evaluate=false keeps the earlier
    scores while it trains no step (the same vectors), and drops them once it trains on, whether it then
    finishes or a stop signal ends it: result.json never shows the scores of other vectors."""
    from gptlab.tasks.word2vec import run
    from gptlab.word2vec.task import Trainer

    out = tmp_path / "run"
    args = [*SMALL, "word2vec.dim=8", "word2vec.checkpoint_every=1", f"data.path={tiny_corpus(tmp_path)}"]
    args += ["logger=none", f"paths.output_dir={out}"]

    def scores(result):
        return {k: v for k, v in result["metrics"].items() if k.startswith("eval/")}

    run(make_cfg(*args, "word2vec.max_steps=3"))
    first = strict_json(out / "result.json")
    assert first["finished"] and first["global_step"] == 3
    assert set(scores(first)) == {f"eval/{m}" for m in evaluation.METRICS}

    # nothing left to train: the vectors are those the scores were measured on
    run(make_cfg(*args, "word2vec.max_steps=3", "word2vec.evaluate=false", "resume=auto"))
    same = strict_json(out / "result.json")
    assert same["global_step"] == 3 and scores(same) == scores(first)

    # trained on to step 6 and finished: the scores of step 3 are gone
    run(make_cfg(*args, "word2vec.max_steps=6", "word2vec.evaluate=false", "resume=auto"))
    finished = strict_json(out / "result.json")
    assert finished["finished"] and finished["global_step"] == 6
    assert scores(finished) == {} and "evaluation_missing" not in finished
    assert not any(k.startswith("eval/") for k in strict_json(out / "metrics.json"))
    assert [p["status"] for p in finished["parts"]] == ["finished", "finished", "finished"]

    # scored again at step 6, then trained on with the evaluation off and stopped by SIGTERM at step 7
    run(make_cfg(*args, "word2vec.max_steps=6", "resume=auto"))
    assert set(scores(strict_json(out / "result.json"))) == {f"eval/{m}" for m in evaluation.METRICS}
    save = Trainer.save_checkpoint

    def save_then_sigterm(self):
        path = save(self)
        os.kill(os.getpid(), signal.SIGTERM)  # noted: training stops after this round
        return path

    monkeypatch.setattr(Trainer, "save_checkpoint", save_then_sigterm)
    run(make_cfg(*args, "word2vec.max_steps=9", "word2vec.evaluate=false", "resume=auto"))
    stopped = strict_json(out / "result.json")
    assert stopped["stopped_during"] == "training" and 6 < stopped["global_step"] < 9
    assert scores(stopped) == {} and "evaluation_missing" not in stopped


# ---- evaluation and the comparison with gensim -------------------------------------------------------


@needs_gensim
def test_benchmarks_report_scores_and_coverage():
    words = ["king", "queen", "man", "woman", "cat", "tiger", "car", "train", "love", "sex"]
    rng = np.random.default_rng(0)
    kv = evaluation.keyed_vectors(words, rng.normal(size=(len(words), 8)))
    m = evaluation.evaluate(kv)["metrics"]
    assert tuple(m) == evaluation.METRICS  # the names a stopped evaluation lists as missing
    assert m["wordsim353/pairs"] >= 3 and 0 < m["wordsim353/coverage"] < 0.05
    assert m["analogy/questions"] >= 1  # man : woman :: king : queen
    assert m["vocab_size"] == len(words)


@needs_gensim
@pytest.mark.parametrize("mode", ["skipgram", "cbow"])
def test_our_vectors_agree_with_gensim_about_as_well_as_gensim_agrees_with_itself(tmp_path, make_cfg, mode):
    """On the embedded corpus with the same words and settings, the 10 nearest neighbours of the frequent words
    overlap with gensim's at least 0.7 times as much as two gensim seeds overlap with each other (CBOW: its C
    step, against gensim's cbow_mean=1)."""
    from gptlab.tasks.word2vec import run

    cfg = make_cfg(
        "task=word2vec",
        f"word2vec.mode={mode}",
        "word2vec.dim=32",
        "word2vec.epochs=3",
        "word2vec.evaluate=false",
        "logger=none",
        f"paths.output_dir={tmp_path}",
    )
    run(cfg)
    ours = evaluation.load_embeddings(tmp_path)
    spec, options, seed = reference.run_settings(tmp_path)
    from gptlab.word2vec.corpus import tokenized_documents

    result = reference.compare(ours, list(tokenized_documents(spec, options)), options, seed, top_words=50)
    assert result["overlap/gensim_vs_gensim"] > 0.2
    assert result["overlap/ours_vs_gensim"] >= 0.7 * result["overlap/gensim_vs_gensim"], result
    assert result["ours"]["vocab_size"] == result["gensim"]["vocab_size"]


@needs_gensim
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


@needs_gensim
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


def test_overrides_a_word2vec_run_does_not_read_are_named_once_with_word2vecs_own(
    tmp_path, monkeypatch, capfd
):
    """`python train.py task=word2vec model=small optim.lr=0.5 ...`: the language model's settings change
    nothing in a word2vec run, and the run says so before it trains, naming word2vec's own option where one
    does what was meant; a preset (debug=fast) is not named, and the run still trains."""
    from hydra.core.global_hydra import GlobalHydra

    args = [
        *SMALL,
        "debug=fast",
        "model=small",
        "optim.lr=0.5",
        "trainer.precision=bf16",
        "trainer.max_steps=2",
        "word2vec.evaluate=false",
        "logger=none",
        f"hydra.run.dir={tmp_path}/run",
    ]
    GlobalHydra.instance().clear()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "train.py"), *args])
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    finally:
        GlobalHydra.instance().clear()
    printed = "".join(capfd.readouterr())
    warning = (
        "task=word2vec does not read model=small, optim.lr=0.5, trainer.precision=bf16: they change nothing in "
        "this run. Set word2vec.lr=0.5 for optim.lr=0.5; word2vec's options are under word2vec.*"
    )
    assert printed.count(warning) == 1, printed
    assert "Trained 2 steps" in printed
    assert json.loads((tmp_path / "run" / "result.json").read_text())["global_step"] == 2


def test_only_what_a_word2vec_run_ignores_counts_as_unread():
    from gptlab.tasks.word2vec import unread_overrides

    read = [
        "word2vec.lr=0.05",
        "seed=1",
        "data.path=x.txt",
        "trainer.max_steps=3",
        "trainer.max_time=00:00:01:00",
    ]
    read += ["debug=fast", "logger=csv", "hydra.run.dir=out", "task=word2vec"]
    unread = [
        "pos=rope",
        "+trainer.max_epochs=2",
        "data.batch_size=64",
        "attention.window=8",
        "~callbacks.progress_bar",
    ]
    assert unread_overrides(read + unread) == unread


@needs_gensim
def test_reading_and_scoring_vectors_leaves_gensims_info_records_out_of_the_run(tmp_path, caplog):
    """A word2vec run's evaluation loads its vectors and the benchmarks with gensim, which logs a lifecycle
    event per table and (on importing its benchmark files' module) a toy dictionary: not a run's lines."""
    rng = np.random.default_rng(0)
    words = ["king", "queen", "man", "woman", "city"]
    path = evaluation.write_embeddings(tmp_path / "embeddings.txt", words, rng.normal(size=(5, 8)))
    with caplog.at_level(logging.INFO):
        kv = evaluation.load_embeddings(path)
        evaluation.word_pairs_score(kv, "wordsim353.tsv")
    assert kv.index_to_key == words
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("gensim")]
