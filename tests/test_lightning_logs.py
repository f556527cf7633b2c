"""What a GPU run shows of Lightning's advice on fp32 matrix products: Lightning's own check, at its CUDA
accelerator's device setup, run through gptlab's routing of Lightning's log. Only the GPU is mocked (torch's
queries answer as an H100 does: compute capability 9.0, tensor cores); everything else is Lightning's code."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.fabric.accelerators import cuda as fabric_cuda
from lightning.pytorch.accelerators import CUDAAccelerator

from gptlab.tasks.skeleton import matmul_advice_for, route_lightning_logs

ADVICE = "that has Tensor Cores. To properly utilize them, you should set `torch.set_float32_matmul_precision"
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def h100(monkeypatch, caplog):
    """torch.cuda answering as on one H100 (the GPU this machine lacks); Lightning's log routed as a run
    routes it, and caught at the root logger, where Hydra's console and log-file handlers read it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert torch.get_float32_matmul_precision() == "highest"  # torch's default: Lightning's check speaks
    route_lightning_logs()
    fabric_cuda._check_cuda_matmul_precision.cache_clear()  # as a fresh process has it
    with caplog.at_level(logging.INFO):
        yield caplog
    fabric_cuda._check_cuda_matmul_precision.cache_clear()


def start_run(caplog: pytest.LogCaptureFixture, precision: str) -> list[str]:
    """One run's device setup at ``precision``, as its fit makes it; the lines it logged."""
    caplog.clear()
    with matmul_advice_for(precision):
        CUDAAccelerator().setup_device(torch.device("cuda", 0))
    return [r.getMessage() for r in caplog.records]


def advice_shown(lines: list[str]) -> bool:
    return any(ADVICE in line and H100 in line for line in lines)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_the_advice_on_fp32_products_is_dropped_where_the_products_run_in_half_precision(h100, precision):
    assert not advice_shown(start_run(h100, precision))


def test_a_32_true_run_shows_lightnings_advice_as_it_is(h100):
    (line,) = start_run(h100, "32-true")
    assert advice_shown([line]) and "torch.set_float32_matmul_precision('medium' | 'high')" in line


def test_runs_of_one_process_each_decide_for_their_own_precision(h100):
    """A sweep's runs share the process: a bf16 run's filter does not outlive it, and Lightning's check,
    which it makes once a process, is made again for each run (so each run's log file says it)."""
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    filters_before = list(rank_zero.filters)
    assert not advice_shown(start_run(h100, "bf16-mixed"))
    assert rank_zero.filters == filters_before
    assert advice_shown(start_run(h100, "32-true"))
    assert advice_shown(start_run(h100, "32-true"))
    assert not advice_shown(start_run(h100, "bf16-mixed"))


def test_lightnings_other_lines_pass_in_a_bf16_run(h100):
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    h100.clear()
    with matmul_advice_for("bf16-mixed"):
        rank_zero_info("GPU available: True (cuda), used: True")
    assert [r.getMessage() for r in h100.records] == ["GPU available: True (cuda), used: True"]


def test_lightnings_lines_show_only_a_device_that_is_there_and_an_early_stop(caplog):
    """A CPU machine's "GPU available: False, used: False" and "TPU available: False" go (the model card names
    the device), and so does the end of a fit that trained its steps; a GPU that is there stays said, used or
    not (Lightning then also warns that it is idle), and so does a fit stopped by its time limit."""
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    route_lightning_logs()
    lines = (
        "GPU available: False, used: False",
        "TPU available: False, using: 0 TPU cores",
        "`Trainer.fit` stopped: `max_steps=30` reached.",  # gptlab's "Trained 30 steps in ..." follows
        "GPU available: True (cuda), used: False",
        "GPU available: True (cuda), used: True",
        "`Trainer.fit` stopped: `max_time={'minutes': 5}` reached.",
    )
    with caplog.at_level(logging.INFO):
        for line in lines:
            rank_zero_info(line)
    assert [r.getMessage() for r in caplog.records] == list(lines[3:])
