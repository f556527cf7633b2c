"""Gradient norm and model FLOPs utilisation: the figures they are built from."""

import csv
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gptlab.lit.metrics import (
    GradientNorm,
    ModelFlopsUtilization,
    gpu_peak_flops,
    measure_matmul_peak,
)
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
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        **trainer_options,
    )
    trainer.fit(module, train_dataloaders=loader)
    with open(tmp_path / "csv" / "metrics.csv") as f:
        return module, list(csv.DictReader(f))


def test_mfu_counts_the_model_cards_flops_per_token(tmp_path):
    mfu = ModelFlopsUtilization(window=2, peak_flops=1e11)
    module, rows = fit_tiny(tmp_path, mfu, max_steps=3)
    assert mfu.flops_per_token == counting.flops_per_token(module.model_config)["training"]
    rates = [float(r["train/mfu"]) for r in rows if r.get("train/mfu")]
    achieved = [float(r["train/flops_per_second"]) for r in rows if r.get("train/flops_per_second")]
    assert rates and all(0 < v < 1 for v in rates)
    assert rates[-1] == pytest.approx(achieved[-1] / 1e11, rel=1e-4)


@pytest.mark.parametrize(
    "name,precision,tf32,tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", False, 989.4),
        ("NVIDIA H100 PCIe", "bf16-mixed", False, 756.0),
        ("NVIDIA H200", "bf16-mixed", False, 989.4),
        ("NVIDIA A100-SXM4-80GB", "16-mixed", False, 312.0),
        ("NVIDIA A100-SXM4-80GB", "32-true", False, 19.5),
        ("NVIDIA A100-SXM4-80GB", "32-true", True, 156.0),
        ("Tesla V100-SXM2-16GB", "16-mixed", False, 125.0),
    ],
)
def test_gpu_peaks_are_the_datasheet_dense_figures(name, precision, tf32, tflops):
    assert gpu_peak_flops(name, precision, tf32) == pytest.approx(tflops * 1e12)
    assert gpu_peak_flops("Some Future GPU", precision, tf32) is None


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
