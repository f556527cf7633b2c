"""Gradient norm and model FLOPs utilisation: the figures they are built from."""

import csv
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gptlab.lit.metrics import GradientNorm, TrainingThroughput, measure_matmul_peak
from gptlab.lit.module import GPTLitModule
from gptlab.model import counting
from gptlab.tracking.loggers import csv_logger


def fit_tiny(
    tmp_path, callback: L.Callback, max_steps: int, **trainer_options
) -> tuple[GPTLitModule, list[dict]]:
    """Fit a tiny model on random tokens with ``callback``; returns the module and the CSV metric rows."""
    torch.manual_seed(0)
    config = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    module = GPTLitModule(model=config, optim={"lr": 1e-3, "warmup_steps": 0})
    tokens = torch.randint(0, 64, (8, 9))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    trainer = L.Trainer(
        max_steps=max_steps,
        callbacks=[callback],
        logger=csv_logger(str(tmp_path)),
        log_every_n_steps=trainer_options.pop("log_every_n_steps", 1),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        **trainer_options,
    )
    trainer.fit(module, train_dataloaders=loader)
    with open(tmp_path / "csv" / "metrics.csv") as f:
        return module, list(csv.DictReader(f))


def test_throughput_logs_tokens_per_second_and_mfu_from_the_model_cards_flops(tmp_path):
    throughput = TrainingThroughput(window=2, peak_flops=1e11)
    module, rows = fit_tiny(tmp_path, throughput, max_steps=4)
    rows = [r for r in rows if r.get("train/tokens_per_second")]
    assert len(rows) >= 3  # every logged step once the window (2 steps) is full
    flops_per_token = counting.flops_per_token(module.model_config, 8)["training"]
    for r in rows:
        rate = float(r["train/tokens_per_second"])
        assert rate > 0
        # Lightning's figures, from the module's flops_per_batch: FLOP/s = tokens/s x FLOPs per token
        assert float(r["train/device/flops_per_sec"]) == pytest.approx(rate * flops_per_token, rel=1e-6)
        assert float(r["train/mfu"]) == pytest.approx(rate * flops_per_token / 1e11, rel=1e-6)
        assert float(r["train/mfu"]) == float(r["train/device/mfu"])
    assert [float(r["train/tokens"]) for r in rows][-1] == 4 * 32  # 4 steps of 4 x 8 tokens
    assert throughput.state_dict() == {"tokens_seen": 128}


def test_without_a_configured_peak_a_cpu_is_measured(tmp_path):
    throughput = TrainingThroughput(window=2)
    _, rows = fit_tiny(tmp_path, throughput, max_steps=3)
    assert throughput.available_flops == measure_matmul_peak("cpu")  # Lightning has no CPU figure
    peak = [float(r["model/peak_flops_per_device"]) for r in rows if r.get("model/peak_flops_per_device")]
    assert peak == [throughput.available_flops]


def test_cpu_peak_is_measured_once_per_process():
    peak = measure_matmul_peak("cpu")
    assert 1e8 < peak < 1e14
    t0 = time.perf_counter()
    assert measure_matmul_peak("cpu") == peak
    assert time.perf_counter() - t0 < 0.01


def test_gradient_norm_is_taken_before_clipping(tmp_path):
    clip = 1e-3
    _, rows = fit_tiny(tmp_path, GradientNorm(), max_steps=4, gradient_clip_val=clip)
    norms = [float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")]
    assert len(norms) == 4
    # an untrained model's gradient norm is far above the clipping threshold: the logged norm is the raw one
    assert min(norms) > 100 * clip


def test_gradient_norm_is_computed_on_the_steps_that_are_logged(tmp_path):
    # the norm is a full pass over the gradients: steps whose metrics reach no logger skip it
    _, rows = fit_tiny(tmp_path, GradientNorm(), max_steps=6, gradient_clip_val=1.0, log_every_n_steps=2)
    logged = [r["step"] for r in rows if r.get("train/loss")]
    assert [r["step"] for r in rows if r.get("train/grad_norm")] == logged == ["1", "3", "5"]
