"""The numbers a run shows, each recomputed here by hand (torch, numpy, scipy) from the run's own weights and
data, and compared: the training loss of a step, the validation loss and bits per byte over which tokens, the
learning rate at each step, and what the final line says was left unscored."""

import copy
import csv
import json
import math
import runpy

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, TINY, run_train
from torch.utils.data import DataLoader, TensorDataset

from gptlab.data.tokenizers import GPT2Tokenizer
from gptlab.model import counting
from gptlab.tracking.loggers import csv_logger
from gptlab.training.metrics import TrainingThroughput
from gptlab.training.module import GPTLitModule
from gptlab.training.spikes import SpikeDetector

# ---- the training loss of a step --------------------------------------------------------------------------


def test_an_accumulated_steps_train_loss_is_the_mean_over_its_micro_batches(tmp_path):
    # trainer.accumulate_grad_batches=2: one optimizer step over two micro-batches, whose gradient is that of
    # the mean of their two losses. The logged train/loss is that mean, not the last micro-batch's alone, and
    # so is the loss the spike detector tests.
    torch.manual_seed(0)
    module = GPTLitModule(
        model=dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16),
        optim={"lr": 1e-2, "warmup_steps": 0},
        loss={"z_loss": 1e-3},
    )
    tokens = torch.randint(0, 64, (16, 9))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)  # in order
    weights = []  # the model before each optimizer step

    class Snapshot(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % 2 == 0:
                weights.append(copy.deepcopy(pl_module.model))

    # the spike detector tests the same loss (with the z-loss: the loss the step optimizes); its warning names
    # train/loss
    detector = SpikeDetector(monitor="loss", window=8, min_history=8)
    # tokens: both micro-batches of each step, 2 x 4 x 8; MFU: tokens per second x FLOPs per token / peak
    throughput = TrainingThroughput(window=1, peak_flops=1e11)
    trainer = L.Trainer(
        max_steps=2, accumulate_grad_batches=2, callbacks=[Snapshot(), detector, throughput],
        logger=csv_logger(str(tmp_path)), log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    with open(tmp_path / "csv" / "metrics.csv") as f:
        logged = list(csv.DictReader(f))
    rates = [r for r in logged if r.get("train/tokens_per_second")]
    assert [float(r["train/tokens"]) for r in rates] == [64, 128]
    flops_per_token = counting.flops_per_token(module.model_config, 8)["training"]
    seconds, tokens_so_far = 0.0, 0.0  # each rate covers the step since the one before, from the start
    for r in rates:
        rate = float(r["train/tokens_per_second"])
        time, length = float(r["train/time"]), float(r["train/lengths"])
        assert rate == pytest.approx((length - tokens_so_far) / (time - seconds), rel=1e-6)
        assert float(r["train/mfu"]) == pytest.approx(rate * flops_per_token / 1e11, rel=1e-6)
        seconds, tokens_so_far = time, length
    rows = [r for r in logged if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [0, 1]  # one row per optimizer step
    watched = list(detector.windows["loss"].values)
    for step, row in enumerate(rows):
        model = weights[step]
        cross_entropy, z_loss = [], []
        for micro in range(2):
            rows_of_batch = tokens[8 * step + 4 * micro : 8 * step + 4 * micro + 4]
            x, y = rows_of_batch[:, :-1], rows_of_batch[:, 1:]
            with torch.no_grad():
                logits, _ = model(x)
            logits = logits.double().flatten(0, 1)
            cross_entropy.append(F.cross_entropy(logits, y.flatten()).item())
            z_loss.append(1e-3 * (torch.logsumexp(logits, dim=-1) ** 2).mean().item())
        assert cross_entropy[0] != pytest.approx(cross_entropy[1], rel=1e-3)  # the mean differs from either
        assert float(row["train/loss"]) == pytest.approx(sum(cross_entropy) / 2, rel=1e-5)
        assert float(row["train/z_loss"]) == pytest.approx(sum(z_loss) / 2, rel=1e-4)
        assert watched[step] == pytest.approx((sum(cross_entropy) + sum(z_loss)) / 2, rel=1e-5)


# ---- the validation loss over two processes ---------------------------------------------------------------


def gpt2_ids(n: int) -> np.ndarray:
    """``n`` real GPT-2 ids of the standard library's reference text, documents ended by <|endoftext|>."""
    from pydoc_data import topics

    tok = GPT2Tokenizer()
    ids: list[int] = []
    for key in sorted(topics.topics):
        ids += [*tok.encode(topics.topics[key]), tok.eot_id]
        if len(ids) >= n:
            return np.asarray(ids[:n], dtype=np.uint16)
    raise AssertionError("the corpus is shorter than asked")


def window_losses(model, windows: np.ndarray) -> list[float]:
    """The summed next-token loss of each window (``block_size + 1`` ids a row), in nats, in float64."""
    rows = torch.from_numpy(windows.astype(np.int64))
    with torch.no_grad():
        logits, _ = model(rows[:, :-1])
    each = F.cross_entropy(logits.double().transpose(1, 2), rows[:, 1:], reduction="none")
    return each.sum(1).tolist()


@pytest.mark.slow
def test_two_processes_log_the_mean_over_both_and_score_each_validation_window_once(tmp_path):
    # Two ranks, a batch of one window each. Training holds two windows, A and B: each step one rank trains on
    # A and the other on B, so the step's loss is the mean of the two, whichever rank drew which. Validation
    # holds three: Lightning's DistributedSampler gives rank 1 a copy of window 0 so that both run two. The
    # validation loss is over the three windows, each once; the final line says which tokens were left out.
    block, tail = 32, 11
    data = tmp_path / "tokens"
    data.mkdir()
    ids = gpt2_ids(2 * block + 1 + 3 * block + 1 + tail)
    train, val = ids[: 2 * block + 1], ids[2 * block + 1 :]
    train.tofile(data / "train.bin")
    val.tofile(data / "val.bin")
    run = tmp_path / "run"
    args = [
        *TINY, f"model.block_size={block}", "data.batch_size=1", "trainer.max_steps=2",
        "trainer.val_check_interval=1", "trainer.limit_val_batches=null", "trainer.log_every_n_steps=1",
        "callbacks.model_checkpoint.save_top_k=-1", "tokenizer=gpt2", f"data.path={data}", "strategy=ddp",
        "trainer.accelerator=cpu", "trainer.devices=2", "callbacks.sample_generation.max_new_tokens=0",
        "logger=csv", f"hydra.run.dir={run}",
    ]  # fmt: skip
    proc = run_train(args, cwd=tmp_path)
    metrics = json.loads((run / "result.json").read_text())["metrics"]

    import gptlab

    # the second step (logged at step 2: a run logs a step's training metrics once it is done) trained the
    # weights saved after the first on A and B, one on each rank
    after_first = gptlab.load_run(next((run / "checkpoints").glob("best-step000001-*.ckpt"))).model.eval()
    both = np.stack([train[:-block], train[block:]])
    expected = sum(window_losses(after_first, both)) / (2 * block)
    with open(next(run.glob("csv/**/metrics.csv"))) as f:
        logged = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    assert sorted(logged) == [1, 2] and logged[2] == pytest.approx(expected, rel=1e-5)

    final = gptlab.load_run(run, which="last").model.eval()
    windows = np.stack([val[i * block : i * block + block + 1] for i in range(3)])
    nats = sum(window_losses(final, windows))
    assert metrics["val/tokens"] == 3 * block
    assert metrics["val/loss"] == pytest.approx(nats / (3 * block), rel=1e-5)
    # bits per byte: over the UTF-8 bytes of the text the 96 targets decode to (<|endoftext|> covers none)
    tok = GPT2Tokenizer()
    n_bytes = sum(len(tok.decode(row[1:].tolist()).replace("<|endoftext|>", "").encode()) for row in windows)
    assert metrics["val/bpb"] == pytest.approx(nats / (n_bytes * math.log(2)), rel=1e-5)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("Final validation loss"))
    # the unigram entropy is the validation split's (as for a prepared cache), and the line says so
    counts = np.bincount(val)
    p = counts[counts > 0] / len(val)
    assert metrics["unigram_entropy"] == pytest.approx(-(p * np.log(p)).sum(), rel=1e-9)
    assert f"; unigram entropy of the validation split {metrics['unigram_entropy']:.4f} nats (" in line
    assert line.endswith(
        f"It scored 96 of the {len(val)} validation tokens, leaving out the first (nothing precedes it) and the "
        f"last {tail} (short of a window)"
    ), line


def test_the_final_line_counts_the_windows_scored_where_targets_inside_them_are_ignored(tmp_path):
    # Five validation windows of 8 targets and a 3-token tail; batches of two windows, the first two batches
    # validated (trainer.limit_val_batches=2), and the first window of each batch with 5 of its targets
    # ignored (as a loss that skips targets inside a window would). The line counts the windows the validation
    # scored (4) and says which targets it ignored: read off the targets (22 // 8), 2 windows would be "cut".
    from types import SimpleNamespace

    from torch.utils.data import default_collate

    from gptlab.data.datamodule import TokenWindows
    from gptlab.data.shards import Shard, TokenShards
    from gptlab.tasks.gpt import validation_coverage

    block, tail = 8, 3
    path = tmp_path / "val.bin"
    (np.arange(5 * block + 1 + tail) % 64).astype(np.uint16).tofile(path)
    windows = TokenWindows(TokenShards([Shard(str(path), 5 * block + 1 + tail)], np.uint16), block, block)
    assert len(windows) == 5

    def ignore_inside_the_first_window(samples):
        x, y = default_collate(samples)
        y[0, :5] = -1
        return x, y

    module = GPTLitModule(model=dict(vocab_size=64, block_size=block, n_layer=1, n_head=2, n_embd=16))
    trainer = L.Trainer(
        limit_val_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu",
    )  # fmt: skip
    trainer.validate(module, DataLoader(windows, batch_size=2, collate_fn=ignore_inside_the_first_window))
    assert (module.val_tokens, module.val_windows) == (4 * block - 2 * 5, 4)
    line = validation_coverage(module.val_tokens, module.val_windows, SimpleNamespace(val_set=windows), 2)
    assert line == (
        f"It scored 22 of the {5 * block + 1 + tail} validation tokens, leaving out the first (nothing precedes "
        f"it) and the last {tail} (short of a window), and 1 of the 5 windows (trainer.limit_val_batches=2), "
        "and 10 targets inside the windows scored, which the loss ignores"
    )


# ---- the learning rate at each step -------------------------------------------------------------------------


def scheduled_rate(step: int, peak: float, warmup: int, max_steps: int, low: float, schedule: str) -> float:
    """The documented schedule, written out: linear warmup from peak / warmup to the peak over ``warmup``
    steps; cosine down to ``low`` x peak at max_steps, or WSD with a 1 - sqrt decay over the last 20%."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "cosine":
        progress = (step - warmup) / (max_steps - warmup)
        return peak * (low + (1 - low) * (1 + math.cos(math.pi * progress)) / 2)
    decay_start = max_steps - round(0.2 * max_steps)
    if step < decay_start:
        return peak
    return peak * (low + (1 - low) * (1 - math.sqrt((step - decay_start) / (max_steps - decay_start))))


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_the_logged_rate_is_the_one_each_adamw_step_applied_and_the_schedules(tmp_path, schedule):
    # Adam's update of a parameter without weight decay is -lr x m_hat / (sqrt(v_hat) + eps): from the
    # gradients of each step (recorded before the step) the rate each step applied is read off the update,
    # and compared with the logged lr and with the schedule written out above.
    torch.manual_seed(0)
    peak, warmup, max_steps, low = 1e-2, 3, 10, 0.1
    module = GPTLitModule(
        model=dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16),
        optim={"lr": peak, "warmup_steps": warmup, "min_lr_ratio": low, "schedule": schedule},
    )
    tokens = torch.randint(0, 64, (40, 9))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    bias = module.model.transformer.h[0].mlp.c_fc.bias  # a bias: AdamW's group without weight decay
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (gradient, parameter) before each step

    class Record(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append((bias.grad.detach().clone(), bias.detach().clone()))

    trainer = L.Trainer(
        max_steps=max_steps, callbacks=[Record()], logger=csv_logger(str(tmp_path)), log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    with open(tmp_path / "csv" / "metrics.csv") as f:
        logged = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f) if r.get("lr")}
    assert sorted(logged) == list(range(max_steps))
    after = [p for _, p in seen[1:]] + [bias.detach()]
    beta1, beta2, eps = 0.9, 0.95, 1e-8
    m = torch.zeros_like(bias, dtype=torch.float64)
    v = torch.zeros_like(bias, dtype=torch.float64)
    for step, ((grad, before), now) in enumerate(zip(seen, after, strict=True)):
        g = grad.double()
        m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        direction = (m / (1 - beta1 ** (step + 1))) / ((v / (1 - beta2 ** (step + 1))).sqrt() + eps)
        big = direction.abs() > 0.1  # where the ratio is well defined
        applied = ((before.double() - now.double())[big] / direction[big]).median().item()
        expected = scheduled_rate(step, peak, warmup, max_steps, low, schedule)
        assert applied == pytest.approx(expected, rel=1e-4), step
        assert logged[step] == pytest.approx(expected, rel=1e-6), step


# ---- FLOPs per token (MFU's numerator) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [{}, {"n_kv_head": 1}, {"activation": "swiglu"}, {"tie_weights": False}, {"bias": False, "pos": "rope"}],
    ids=["default", "gqa", "swiglu", "untied", "no-bias-rope"],
)
def test_the_dense_flops_per_token_are_those_torch_counts_in_a_training_step(variant):
    # 6N: torch's FLOP counter over one forward and backward pass of the real model counts every matrix
    # product (the tied head's included, the embedding lookup not); attention's 12 L T d is the rest.
    from torch.utils.flop_counter import FlopCounterMode

    from gptlab.model.config import GPTConfig
    from gptlab.model.counting import flops_per_token
    from gptlab.model.gpt import GPT

    config = GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32, **variant)
    model = GPT(config)
    x = torch.randint(0, 97, (2, 16))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(x, x)
        loss.backward()
    counted = counter.get_flop_counts()["Global"]
    matmuls = sum(n for op, n in counted.items() if "attention" not in str(op))
    figures = flops_per_token(config, 16)
    # the plain head multiplies by every stored row (97 padded to 128: model.vocab_multiple); MFU counts the
    # vocabulary's 97 (model/counting.py): the difference is the padding's forward and backward products
    padding = 6 * (config.padded_vocab_size - config.vocab_size) * config.n_embd
    assert figures["dense"] + padding == matmuls / x.numel()
    assert figures["attention"] == 12 * config.n_layer * 16 * config.n_head * config.head_dim


# ---- word-vector benchmarks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["wordsim353.tsv", "simlex999.txt"])
def test_word_pair_scores_are_spearman_over_the_pairs_in_the_vocabulary(name):
    # random vectors for 70% of the benchmark's words, every fifth in capitals: rho and r recomputed with scipy
    # from cosine similarities, over the pairs whose two words are in, whatever their case
    from gensim.test.utils import datapath
    from scipy import stats

    from gptlab.word2vec import evaluation

    with open(datapath(name), encoding="utf8") as f:
        pairs = [line.rstrip("\n").split("\t") for line in f if line.strip() and not line.startswith("#")]
    words = sorted({w.lower() for a, b, _ in pairs for w in (a, b)})
    rng = np.random.default_rng(0)
    kept = [w for w in words if rng.random() < 0.7]
    vocabulary = [w.upper() if i % 5 == 0 else w for i, w in enumerate(kept)]
    vectors = rng.normal(size=(len(vocabulary), 16)).astype(np.float32)
    score = evaluation.word_pairs_score(evaluation.keyed_vectors(vocabulary, vectors), name)
    row = {w.lower(): i for i, w in enumerate(vocabulary)}
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    inside = [(a.lower(), b.lower(), float(h)) for a, b, h in pairs if a.lower() in row and b.lower() in row]
    cosine = [float(unit[row[a]] @ unit[row[b]]) for a, b, _ in inside]
    human = [h for _, _, h in inside]
    assert score["pairs"] == len(inside) and score["coverage"] == len(inside) / len(pairs)
    assert score["spearman"] == pytest.approx(stats.spearmanr(cosine, human).statistic, abs=1e-6)
    assert score["pearson"] == pytest.approx(stats.pearsonr(cosine, human).statistic, abs=1e-5)


# ---- the length study ---------------------------------------------------------------------------------------


def test_the_length_studys_losses_are_over_each_contexts_whole_windows_and_the_table_says_which():
    from gptlab.evaluation import length
    from gptlab.model.config import GPTConfig
    from gptlab.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=1, n_head=2, n_embd=16, pos="rope")).eval()
    tokens = np.random.default_rng(1).integers(0, 40, 200)
    options = length.LengthEvalOptions(factors=[1, 2, 4], max_tokens=150, rope_scalings=[], batch_tokens=48)
    result = length.evaluate_lengths(model, tokens, 16, options)
    studied = torch.as_tensor(tokens[:150])
    for factor, scored in (("1", 144), ("2", 128), ("4", 128)):  # 9, 4 and 2 windows of 149 targets
        context = 16 * int(factor)
        entry = result["variants"]["rope"][factor]
        with torch.no_grad():
            nats = sum(
                F.cross_entropy(model(w[None, :-1])[0][0].double(), w[1:], reduction="sum").item()
                for w in studied.unfold(0, context + 1, context)
            )
        assert entry["tokens"] == scored and entry["loss"] == pytest.approx(nats / scored, rel=1e-6)
        assert entry["ppl"] == pytest.approx(math.exp(nats / scored), rel=1e-6)
    assert length.format_table(result).splitlines()[-1] == (
        "Tokens scored at each context, its whole windows (the first token and the tail after the last window "
        "are not): 1x 144, 2x 128, 4x 128, of the first 150 of the 200 validation tokens (eval_length.max_tokens)"
    )


# ---- the comparison table ------------------------------------------------------------------------------------


def test_a_run_whose_mfu_went_above_its_peak_shows_no_mfu_in_the_table(tmp_path, capsys):
    # A peak far too low (1 MFLOP/s): every window measures more than 100%, which the run logs as
    # train/mfu_above_peak and never as train/mfu. The table's MFU cell says the figure is invalid, with the
    # note saying why, rather than a median of the windows that stayed below the peak (or a bare "-").
    import gptlab

    gptlab.train(
        *TINY, "tokenizer=char", "trainer.max_steps=4", "trainer.log_every_n_steps=2", "logger=csv",
        "callbacks.throughput.peak_flops=1e6", f"paths.root_dir={tmp_path}", run_dir=tmp_path / "runs" / "low",
    )  # fmt: skip
    with open(next((tmp_path / "runs" / "low").glob("csv/**/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("train/mfu_above_peak") for r in rows) and not any(r.get("train/mfu") for r in rows)
    capsys.readouterr()
    compare = runpy.run_path(str(ROOT / "scripts" / "compare.py"))["main"]
    assert compare([str(tmp_path / "runs"), "--source", "csv"]) == 0
    out = capsys.readouterr().out
    header, row = (
        [c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line[:2] == "| "
    )
    cells = dict(zip(header, row, strict=True))
    assert cells["MFU"] == "invalid (>100%)"
    assert "MFU `invalid (>100%)`: a run measured more FLOP/s than the peak" in out


def test_the_scaling_fit_is_the_least_squares_one_scipy_finds():
    # L(N) = E + A N^-alpha on a noisy ladder (5 sizes x 3 seeds): the fit's E, A, alpha and rmse against
    # scipy's bounded nonlinear least squares over the same points
    from scipy.optimize import least_squares

    from gptlab.comparison.scaling import fit_power_law

    rng = np.random.default_rng(3)
    n = np.repeat([1e5, 3e5, 1e6, 3e6, 1e7], 3)
    loss = 1.8 + 40 * n**-0.3 + rng.normal(0, 0.02, len(n))
    fit = fit_power_law(n, loss)
    scale = float(np.exp(np.mean(np.log(n))))  # N / its geometric mean: the solver's conditioning
    found = least_squares(
        lambda p: p[0] + p[1] * (n / scale) ** -p[2] - loss,
        x0=[1.0, 1.0, 0.5], bounds=([0, 0, 0.01], [np.inf, np.inf, 3]), xtol=1e-14, ftol=1e-14,
    )  # fmt: skip
    E, A, alpha = found.x[0], found.x[1] * scale ** found.x[2], found.x[2]
    assert (fit.E, fit.A, fit.alpha) == pytest.approx((E, A, alpha), rel=1e-5)
    assert fit.rmse == pytest.approx(math.sqrt(np.mean(found.fun**2)), rel=1e-9)
