"""Gradient norm and model FLOPs utilisation: the figures they are built from."""

import csv
import json
import time

import lightning as L
import pytest
import torch
from conftest import strict_json
from torch.utils.data import DataLoader, TensorDataset

from gptlab.model import counting
from gptlab.tracking.loggers import csv_logger
from gptlab.training import peak
from gptlab.training.metrics import GradientNorm, TrainingThroughput
from gptlab.training.module import GPTLitModule
from gptlab.training.peak import chip_peak, datasheet_flops, measure_matmul_peak, record_calibration


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


def test_without_a_configured_peak_a_cpu_is_calibrated(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path / "cache"))
    throughput = TrainingThroughput(window=2)
    _, rows = fit_tiny(tmp_path, throughput, max_steps=3)
    # the best figure measured on this machine so far: this process's, the only one in a new cache
    assert throughput.available_flops == measure_matmul_peak("cpu")
    assert "best fp32 matmul measured on this CPU" in throughput._source
    logged = [float(r["model/peak_flops_per_device"]) for r in rows if r.get("model/peak_flops_per_device")]
    assert logged == [throughput.available_flops]


def test_cpu_peak_is_measured_once_per_process(monkeypatch):
    figure = measure_matmul_peak("cpu")
    assert 1e8 < figure < 1e14

    def measured_again(*args, **kwargs):
        raise AssertionError("the peak was measured a second time in this process")

    # the second call times no product (not a wall-clock bound: a loaded machine can stall any call)
    monkeypatch.setattr(peak.time, "perf_counter", measured_again)
    assert measure_matmul_peak("cpu") == figure


def test_the_calibration_keeps_the_best_figure_ever_measured(tmp_path):
    """A figure measured under load (lower) never replaces a higher one; a higher one does."""
    path = tmp_path / "peak_flops.json"
    key = peak.cpu_calibration_key()
    assert record_calibration(path, key, 326e9) == 326e9
    assert record_calibration(path, key, 41e9) == 326e9  # a busy machine's reading
    assert strict_json(path)[key]["flops"] == 326e9  # strict JSON (gptlab.runs.jsonfile)
    assert record_calibration(path, key, 400e9) == 400e9
    # another thread count is another figure
    other = peak.cpu_calibration_key(threads=torch.get_num_threads() + 1)
    assert other != key and record_calibration(path, other, 50e9) == 50e9
    # a damaged file counts as empty and is rewritten whole
    path.write_text('{"truncated": ')
    assert record_calibration(path, key, 41e9) == 41e9
    assert json.loads(path.read_text())[key]["flops"] == 41e9


def test_a_later_process_reuses_the_calibration_and_never_lowers_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))
    first, source = peak.cpu_peak_flops()
    assert str(tmp_path / "peak_flops.json") in source
    # a later process: its own measurement, against the file the first left
    monkeypatch.setattr(peak, "_measured", {})
    second, _ = peak.cpu_peak_flops()
    remeasured = measure_matmul_peak("cpu")
    assert second == max(first, remeasured) >= first
    stored = json.loads((tmp_path / "peak_flops.json").read_text())
    assert stored[peak.cpu_calibration_key()]["flops"] == second


def test_a_bf16_run_on_a_cpu_is_measured_against_the_cpus_bf16_peak(tmp_path, monkeypatch):
    """A CPU with bf16 units (AMX) multiplies bf16 several times faster than fp32: a bf16-mixed run's MFU
    against the fp32 peak could read above 100%. Each dtype has its own measurement and calibration entry."""
    monkeypatch.setenv("GPTLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak, "_measured", {})
    bf16, source = peak.device_peak_flops(torch.device("cpu"), torch.bfloat16)
    assert "bf16 matmul" in source
    assert bf16 == measure_matmul_peak("cpu", torch.bfloat16)
    fp32, fp32_source = peak.device_peak_flops(torch.device("cpu"), torch.float32)
    assert "fp32 matmul" in fp32_source and fp32 == measure_matmul_peak("cpu", torch.float32)
    stored = json.loads((tmp_path / "peak_flops.json").read_text())
    bf16_key, fp32_key = peak.cpu_calibration_key(dtype=torch.bfloat16), peak.cpu_calibration_key()
    assert bf16_key != fp32_key
    assert stored[bf16_key]["flops"] == bf16 and stored[fp32_key]["flops"] == fp32


@pytest.mark.parametrize(
    "name, chip, bf16",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4e12),
        ("NVIDIA H200", "H200 SXM", 989.4e12),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.5e12),
        ("NVIDIA H100 NVL", "H100 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
        ("NVIDIA A100 80GB PCIe", "A100", 312e12),
        ("NVIDIA L40S", "L40S", 362e12),
        ("NVIDIA L4", "L4", 121e12),
    ],
)
def test_a_gpus_peak_is_its_dense_datasheet_figure_by_name(name, chip, bf16):
    found = chip_peak(name)
    assert found is not None and found.name == chip and found.bf16 == bf16
    assert datasheet_flops(name, torch.bfloat16, tf32=True) == (bf16, f"{chip} bf16")


def test_fp32_on_a_gpu_is_tf32_where_torch_allows_it_and_unknown_gpus_have_no_figure():
    assert datasheet_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=True) == (156e12, "A100 tf32")
    assert datasheet_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=False) == (19.5e12, "A100 fp32")
    assert datasheet_flops("Tesla T4", torch.bfloat16, tf32=True) is None  # no bf16 unit: measured instead
    assert datasheet_flops("Tesla T4", torch.float16, tf32=True) == (65e12, "T4 fp16")
    assert chip_peak("NVIDIA A10G") is None and chip_peak("NVIDIA GeForce GTX 1080") is None


@pytest.mark.gpu
def test_a_gpus_datasheet_peak_is_above_what_it_measures():
    device = torch.device("cuda")
    figure, source = peak.device_peak_flops(device, torch.bfloat16)
    if chip_peak(torch.cuda.get_device_name(device)) is None:
        pytest.skip(f"{torch.cuda.get_device_name(device)} is not in the datasheet table")
    assert source.startswith("datasheet")
    measured = measure_matmul_peak(device, torch.bfloat16)
    assert 0.5 * figure < measured <= figure, (measured, figure)


def test_an_mfu_above_one_is_never_logged_as_mfu(tmp_path, caplog):
    # a peak far below what the tiny model does: every window is above 100%
    throughput = TrainingThroughput(window=2, peak_flops=1.0)
    with caplog.at_level("WARNING", logger="gptlab.training.metrics"):
        _, rows = fit_tiny(tmp_path, throughput, max_steps=4)
    rated = [r for r in rows if r.get("train/tokens_per_second")]
    assert rated
    assert not any(r.get("train/mfu") or r.get("train/device/mfu") for r in rows)
    assert all(float(r["train/mfu_above_peak"]) > 1 for r in rated)
    warnings = [r.getMessage() for r in caplog.records if "above 100%" in r.getMessage()]
    assert len(warnings) == 1 and "the peak is too low" in warnings[0] and "configured" in warnings[0]


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


class Pauses(L.Callback):
    """Time spent outside the steps: ``in_training`` seconds after step 3 (as a checkpoint save would take),
    ``after_validation`` seconds at the end of each validation (as the best-checkpoint save does)."""

    def __init__(self, in_training: float, after_validation: float) -> None:
        self.in_training, self.after_validation = in_training, after_validation
        self.validations = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            time.sleep(self.in_training)

    def on_validation_end(self, trainer, pl_module):
        self.validations += 1
        time.sleep(self.after_validation)


def test_logged_rates_tile_the_training_time_and_leave_validation_out(tmp_path):
    torch.manual_seed(0)
    config = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    module = GPTLitModule(model=config, optim={"lr": 1e-3, "warmup_steps": 0})
    tokens = torch.randint(0, 64, (8, 9))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    pauses = Pauses(in_training=0.3, after_validation=0.4)
    trainer = L.Trainer(
        max_steps=8,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[TrainingThroughput(peak_flops=1e11), pauses],
        logger=csv_logger(str(tmp_path)),
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    t0 = time.perf_counter()
    trainer.fit(module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    fit_seconds = time.perf_counter() - t0
    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/tokens_per_second")]
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]  # a rate at every logged step, the first too
    # each rate covers the 2 steps (2 x 32 tokens) since the previous one: together, the whole training time
    seconds = sum(64 / float(r["train/tokens_per_second"]) for r in rows)
    training = float(rows[-1]["train/time"])
    assert seconds == pytest.approx(training, rel=1e-6)
    assert float(rows[-1]["train/lengths"]) == 8 * 32
    # the pause between steps is training time; the validation, to its end, is not
    assert pauses.validations == 2
    assert 0.3 < training < fit_seconds - 2 * 0.4
    assert 64 / float(rows[1]["train/tokens_per_second"]) > 0.3  # steps 3-4 hold the pause


def test_measuring_the_peak_leaves_the_runs_random_stream_alone():
    peak._measured.clear()
    before = torch.get_rng_state()
    peak.measure_matmul_peak("cpu")
    assert torch.equal(torch.get_rng_state(), before)
