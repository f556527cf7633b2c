"""A run larger than its device is refused before any weight exists, with the estimate, what the device has and
what would fit; ``allow_over_memory=true`` lets it start. The estimates are the planner's (test_model_card.py
checks them against built models); here: the decision, its message, and that its suggestions are real
overrides that fit."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gptlab import planning
from gptlab.config import parse_gpt
from gptlab.errors import ConfigError
from gptlab.planning import OverMemoryError, check_memory, training_plan
from gptlab.tasks.gpt import run

GiB = 1024**3
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's RAM is the device here")


@cpu_only
def test_gpt3_is_refused_in_seconds_before_anything_exists(make_cfg, tmp_path):
    out = tmp_path / "run"
    cfg = make_cfg("model=gpt3", "logger=wandb", f"paths.output_dir={out}")
    # The plan builds its layers on the meta device, whose first use imports torch's symbolic machinery (about
    # 800 modules: 10 s, 20 s on a loaded machine) once per process: done before the clock starts, the bound
    # below is on the refusal's own work, which takes about a second
    torch.nn.Embedding(2, 2, device="meta")
    t0 = time.perf_counter()
    with pytest.raises(OverMemoryError) as refused:
        run(cfg)  # the task's own entry, as `python train.py model=gpt3` calls it
    seconds = time.perf_counter() - t0
    message = str(refused.value)
    available = planning.available_host_memory() / GiB
    assert message.startswith(
        "This run needs about 3,758.4 GiB per device (174.60B parameters, strategy=auto"
    )
    assert "micro-batch 8 x 2048" in message and "weights 650.5 GiB" in message
    # what the device has: this machine's available RAM, as the kernel reports it now (within 2 GiB of it)
    stated = float(message.split("this machine has ")[1].split(" GiB")[0].replace(",", ""))
    assert abs(stated - available) < 2
    assert "Nothing fits on this device" in message
    assert "allow_over_memory=true starts it anyway" in message
    assert seconds < 30, seconds  # arithmetic on the config: no weight, no data (the OOM came after 164 s)
    # nothing started: no run directory contents, no W&B run, no token cache
    assert not (out / "wandb").exists() and not (out / "checkpoints").exists()
    assert not any((Path(cfg.paths.root_dir)).rglob("*.bin"))


@cpu_only
def test_allow_over_memory_lets_the_run_past_the_check(make_cfg, caplog):
    refused = parse_gpt(make_cfg("model=gpt3"))
    with pytest.raises(OverMemoryError):
        check_memory(refused)
    allowed = parse_gpt(make_cfg("model=gpt3", "allow_over_memory=true"))
    assert allowed.run.allow_over_memory is True
    with caplog.at_level("WARNING", logger="gptlab.planning"):
        estimate = check_memory(allowed)  # passes, and still says what the run needs
    assert estimate.total > 3_000 * GiB
    assert "allow_over_memory=true: this run needs about 3,758.4 GiB per device" in caplog.text


def test_allow_over_memory_must_be_true_or_false(make_cfg):
    with pytest.raises(ConfigError, match=r"allow_over_memory='yes' must be true or false"):
        parse_gpt(make_cfg("allow_over_memory=yes"))


def test_the_default_and_the_tiny_runs_fit(make_cfg):
    from conftest import TINY

    for overrides in ([], TINY):
        estimate = check_memory(parse_gpt(make_cfg(*overrides)))
        assert estimate.total < 2 * GiB


@cpu_only
def test_the_vocabulary_learned_from_the_data_is_checked_again(make_cfg):
    """Before the tokenizer exists its vocabulary counts as one id (a lower bound); build() checks again with
    the real size. A vocabulary whose logits alone exceed the RAM is refused then."""
    settings = parse_gpt(make_cfg("model=tiny", "data.batch_size=8"))
    assert settings.vocab_from_tokenizer
    check_memory(settings)
    check_memory(settings, vocab_size=50257)
    # per id on a CPU (loss.impl=auto: chunked, 8 rows a chunk at such a vocabulary): the tied embedding's
    # weight, gradient and AdamW state, 16 x 128 bytes, the head's fp32 weight gradient, 4 x 128, and its
    # chunk, 8 rows of fp32
    too_many = int(2 * planning.available_host_memory() / (20 * 128 + 8 * 4))
    with pytest.raises(OverMemoryError, match="This run needs about"):
        check_memory(settings, vocab_size=too_many)


@cpu_only
def test_what_would_fit_is_a_set_of_overrides_that_fits(make_cfg):
    """Each suggestion, applied as the overrides it names, gives the plan whose estimate fits."""
    settings = parse_gpt(make_cfg("model=gpt2-medium", "data.batch_size=256"))
    memory = planning.available_host_memory()
    with pytest.raises(OverMemoryError) as refused:
        check_memory(settings)
    message = str(refused.value)
    suggestions = message.split("Would fit: ")[1].split(". If the estimate")[0].split("; or ")
    assert any("data.batch_size=" in s for s in suggestions)
    assert any("activation_checkpointing=true" in s for s in suggestions)
    for suggestion in suggestions:
        overrides = suggestion.split(" (")[0].split()
        if "trainer.accumulate_grad_batches" in suggestion:  # the same sequences per optimizer step
            batch = int(next(o for o in overrides if o.startswith("data.batch_size=")).split("=")[1])
            accumulate = int(next(o for o in overrides if o.startswith("trainer.accumulate")).split("=")[1])
            assert batch * accumulate == 256
        fixed = parse_gpt(make_cfg("model=gpt2-medium", "data.batch_size=256", *overrides))
        estimate = check_memory(fixed)  # not refused
        assert estimate.total <= planning.FIT_FRACTION * memory
        plan, _ = training_plan(fixed)
        assert planning.memory_per_device(fixed.model, plan) == estimate


def test_fitting_options_on_a_given_device():
    """The planner's side, on a device of a given size: gpt2-medium, 16 GiB, micro-batch 64."""
    from gptlab.model.config import GPTConfig

    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024)
    plan = planning.TrainingPlan(micro_batch=64)
    assert not planning.memory_per_device(config, plan).fits(16 * GiB)
    options = planning.fitting_options(config, 16 * GiB, plan, ["fsdp", "deepspeed_stage_2"])
    names = [o for o, _ in options]
    # the largest micro-batch that fits, with as many sequences per optimizer step
    assert names[0] == "data.batch_size=4 trainer.accumulate_grad_batches=16"
    assert not planning.memory_per_device(config, replace(plan, micro_batch=8)).fits(16 * GiB)
    assert names[1].endswith("activation_checkpointing=true")
    for _, estimate in options:
        assert estimate.fits(16 * GiB)
    # on one device a sharded strategy shards nothing: it is never what makes a run fit there
    assert not any(o.startswith("strategy=") for o in names)


@cpu_only
def test_processes_on_one_machine_share_its_ram_and_rank_zero_decides(make_cfg, monkeypatch):
    overrides = ("model=gpt3", "trainer.accelerator=cpu", "trainer.devices=2", "strategy=ddp")
    settings = parse_gpt(make_cfg(*overrides))
    with pytest.raises(OverMemoryError, match=r"shared by 2 training processes: [\d.,]+ GiB each"):
        check_memory(settings)
    # the second process (LOCAL_RANK=1, started once rank 0 passed) does not decide again
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert check_memory(settings).n_devices == 2


@cpu_only
def test_a_run_is_sized_by_the_head_it_takes(make_cfg):
    """The output layer and loss count as the run computes them: with loss.impl=auto (chunked on a CPU) a
    vocabulary of a fifth of the RAM's worth of embedding fits, where loss.impl=plain, holding the whole
    logits and their gradients for 64 x 128 tokens, is refused and says that the head is what it counted."""
    vocab = int(0.2 * planning.available_host_memory() / (20 * 128 + 8 * 4))  # per id: as above
    chunked = parse_gpt(make_cfg("model=tiny", "data.batch_size=64"))
    assert training_plan(chunked)[0].head.impl == "chunked"
    estimate = check_memory(chunked, vocab_size=vocab)  # not refused
    # chunked holds the (V, h) fp32 gradient of the weight, one 8-row chunk and the (N, h) hidden gradient: a
    # fifth of what the weights, their gradients and AdamW take
    assert estimate.head < 0.25 * estimate.total
    plain = parse_gpt(make_cfg("model=tiny", "data.batch_size=64", "loss.impl=plain"))
    with pytest.raises(OverMemoryError) as refused:
        check_memory(plain, vocab_size=vocab)
    head = str(refused.value).split("output layer and loss ")[1]
    assert head.split(" GiB")[1].startswith(" (loss.impl=plain, the whole logits)")
    # 12 bytes per token and id: the log-probabilities, their gradient and the logits'
    assert float(head.split(" GiB")[0].replace(",", "")) == pytest.approx(
        12 * 64 * 128 * vocab / GiB, abs=0.1
    )


@pytest.mark.parametrize("triton", [True, False])
def test_a_cuda_run_in_bf16_counts_the_chunked_pass_it_takes(monkeypatch, triton):
    """loss.impl=chunked on CUDA in bf16 takes the fused pass where triton is importable (head_loss.
    fused_by_default): its estimate counts a bf16 chunk that the gradient overwrites, not the eager pass's fp32
    chunk beside a bf16 gradient, twice the eager pass's rows in the same bytes, and the card says which it
    counted. In fp32 and on a CPU: the eager pass."""
    from gptlab.model import head_loss
    from gptlab.model.config import GPTConfig
    from gptlab.model.head_loss import HeadLoss

    monkeypatch.setattr(head_loss, "_triton_available", lambda: triton)
    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    tokens, V, h = 8192, 50257, 768
    rows = 4168 if triton else 2080  # 400 MiB of bf16 logits, or of fp32 ones
    head = planning.HeadPlan.of(HeadLoss("chunked"), "cuda", "bf16-mixed")
    assert head.fused is triton and head.rows(config) == rows
    gradients = tokens * h * 4 + V * h * 4  # the fp32 gradients of the hidden states and of the weight
    if triton:
        assert head.bytes(config, tokens) == rows * V * 2 + gradients + V * h * 8
        assert (
            head.describe(config)
            == "loss.impl=chunked, 4,168 rows per chunk, fused (one compiled kernel a chunk)"
        )
    else:
        assert head.bytes(config, tokens) == rows * V * (4 + 2) + gradients + V * h * 8
        assert head.describe(config) == "loss.impl=chunked, 2,080 rows per chunk"
    for device_type, precision in (("cuda", "32-true"), ("cpu", "bf16-mixed")):
        assert not planning.HeadPlan.of(HeadLoss("chunked"), device_type, precision).fused
