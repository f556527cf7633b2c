"""The spike detector: a synthetic spike is found, logged, and (when asked) its update is not applied."""

from __future__ import annotations

import csv
import math
import random

import pytest
import torch
from conftest import ROOT, TINY, run_train

from gptlab.errors import ConfigError
from gptlab.training.spikes import SpikeDetector, SpikeWindow


def test_a_value_six_sigma_above_the_window_mean_is_a_spike_and_noise_is_not():
    rng = random.Random(0)
    window = SpikeWindow(window=128, sigma=6.0, min_history=32)
    noise = [3.0 + rng.gauss(0, 0.05) for _ in range(300)]
    assert not any(window.is_spike(v) for v in noise)  # 6 sigma: no false alarm in 300 Gaussian steps
    mean, std = window.stats()
    assert len(window.values) == 128 and std == pytest.approx(0.05, rel=0.2)
    assert window.is_spike(mean + 7 * std)
    assert not window.is_spike(mean + 5 * std)
    assert window.is_spike(float("nan"))
    # a spike does not enter the window: the same spike is caught again
    assert window.is_spike(mean + 7 * std) and window.stats()[1] < 0.07


def test_no_test_before_min_history_values():
    window = SpikeWindow(window=8, sigma=6.0, min_history=4)
    assert [window.is_spike(v) for v in (1.0, 1.0, 1.0, 100.0)] == [False] * 4


def _rows(path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_a_spike_in_training_is_logged_and_its_update_skipped(tmp_path):
    # A synthetic spike (tests/spiking_train.py): the loss of step 12 is backpropagated times 1e4.
    run_dir = tmp_path / "run"
    run_train(
        [
            *TINY,
            "tokenizer=char",
            "trainer.max_steps=14",
            "trainer.val_check_interval=14",
            "trainer.log_every_n_steps=1",
            "trainer.gradient_clip_val=0",
            "callbacks.sample_generation.max_new_tokens=0",
            "callbacks.spike_detector.monitor=[grad_norm]",
            "callbacks.spike_detector.min_history=8",
            "callbacks.spike_detector.skip_step=true",
            "logger=csv",
            f"paths.root_dir={tmp_path}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env={"GPTLAB_TEST_SPIKE_AT_STEP": "12"},
        script=ROOT / "tests" / "spiking_train.py",
    )
    rows = _rows(run_dir / "csv" / "metrics.csv")
    spikes = {int(r["step"]): float(r["train/spike"]) for r in rows if r.get("train/spike")}
    count = [float(r["train/spike_count"]) for r in rows if r.get("train/spike_count")]
    skipped = [float(r["train/skipped_steps"]) for r in rows if r.get("train/skipped_steps")]
    assert [s for s, v in spikes.items() if v > 0] == [12], spikes  # the 12th step
    assert count[-1] == 1 and skipped[-1] == 1
    # Skipped: the weights after step 12 equal those after step 11 (saved by the script).
    before = torch.load(run_dir / "weights_step11.pt")
    after = torch.load(run_dir / "weights_step12.pt")
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)
    loss = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    assert all(math.isfinite(v) for v in loss.values()) and loss[14] < loss[1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"monitor": ["loss", "lr"]}, r"monitor=\['loss', 'lr'\]: choose from \['loss', 'grad_norm'\]"),
        ({"sigma": 0}, r"sigma=0 must be a positive number"),
        ({"window": 16, "min_history": 32}, r"min_history=32 exceeds window=16"),
    ],
)
def test_bad_detector_options_name_the_value_and_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SpikeDetector(**kwargs)
