"""Whether a training run fits the memory of the device it will train on, decided before any weight exists.

The planner's estimate (:mod:`gptlab.planning.planner`) for the run as configured (model, `strategy=`,
devices, precision, micro-batch, context, activation checkpointing) is compared with what the device has:
a CUDA GPU's memory, or on a CPU the RAM available now, shared by the run's processes on this machine. A run
estimated above the planner's fit fraction of it is refused with a :class:`OverMemoryError` that names the
estimate, the device and the changes that would fit, instead of being killed by the kernel's out-of-memory
killer minutes later with no word. ``allow_over_memory=true`` runs it anyway, for when the estimate is wrong.

Pure arithmetic on the typed config (no model is built): it answers for a 175B model in milliseconds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gptlab.errors import ConfigError
from gptlab.model.counting import human, parameter_counts
from gptlab.planning.planner import (
    BYTES,
    FIT_FRACTION,
    GiB,
    MemoryEstimate,
    TrainingPlan,
    available_host_memory,
    device_memory_bytes,
    distinct_choices,
    fitting_options,
    memory_per_device,
)

if TYPE_CHECKING:
    from gptlab.config import GPTRunConfig


log = logging.getLogger(__name__)


class OverMemoryError(ConfigError):
    """A run whose estimated memory exceeds what its device has, refused before it starts."""


@dataclass(frozen=True)
class DeviceMemory:
    """What one training process may use: ``bytes`` of ``kind`` ("cuda" or "cpu"), described for a message."""

    kind: str
    bytes: float
    description: str


def training_plan(settings: GPTRunConfig) -> tuple[TrainingPlan, int]:
    """The run's plan as the planner takes it, and its processes on this machine."""
    from gptlab.parallel.hardware import devices_per_node

    trainer = settings.trainer
    try:
        local = max(1, devices_per_node(trainer))
    except (TypeError, ValueError):  # a malformed trainer.devices: Lightning names it
        local = 1
    nodes = trainer.get("num_nodes") or 1
    precision = str(trainer.get("precision"))
    plan = TrainingPlan(
        strategy=settings.strategy,
        n_devices=local * (int(nodes) if isinstance(nodes, int) else 1),
        precision=precision if precision in BYTES else "32-true",  # a plugin's own name: fp32, the safe side
        micro_batch=settings.loader.batch_size,
        context=settings.block_size,
        activation_checkpointing=settings.parallel.activation_checkpointing,
    )
    return plan, local


def device_memory(device_type: str, processes: int) -> DeviceMemory:
    """The memory one training process has: its GPU's, or its share of the host's available RAM."""
    if device_type == "cuda":
        total, name = device_memory_bytes("cuda")
        name = name.split(",")[0]  # the description's size is said here
        return DeviceMemory("cuda", total, f"the GPU has {total / GiB:,.1f} GiB ({name})")
    available = available_host_memory()
    share = (
        f", shared by {processes} training processes: {available / processes / GiB:,.1f} GiB each"
        if processes > 1
        else ""
    )
    return DeviceMemory(
        "cpu", available / processes, f"this machine has {available / GiB:,.1f} GiB of RAM available{share}"
    )


def runnable_strategies(settings: GPTRunConfig, n_devices: int) -> list[str]:
    """The `strategy=` choices that can run on this run's hardware (their own check passes)."""
    from gptlab.parallel import strategy_choice

    names = []
    for name, _ in distinct_choices(n_devices):
        try:
            strategy_choice(name).check(settings.trainer)
        except ConfigError:
            continue
        names.append(name)
    return names


def check_memory(settings: GPTRunConfig, vocab_size: int | None = None) -> MemoryEstimate:
    """Refuse the run (:class:`OverMemoryError`) when its estimated memory per device exceeds what its device
    has, unless ``allow_over_memory=true``. ``vocab_size``: the tokenizer's, once known; before it is, a
    vocabulary taken from the tokenizer counts as one id, so the estimate is a lower bound and a refusal is
    certain. Returns the estimate."""
    from gptlab.preflight import training_device_type

    if int(os.environ.get("LOCAL_RANK", "0") or 0) != 0:
        # a process that Lightning or torchrun started beside local rank 0, which decided for this machine
        # (its free memory now counts what the others hold: it would answer otherwise)
        return memory_per_device(settings.model, training_plan(settings)[0])
    model = settings.model
    if vocab_size is not None:
        model = dataclasses.replace(model, vocab_size=vocab_size)
    plan, local = training_plan(settings)
    estimate = memory_per_device(model, plan)
    kind = training_device_type(settings.trainer)
    if kind not in ("cuda", "cpu"):
        return estimate  # no figure for other devices (MPS shares the host's memory in its own way)
    device = device_memory(kind, local)
    needed = estimate.total + (estimate.host if kind == "cpu" else 0.0)
    if needed <= FIT_FRACTION * device.bytes:
        return estimate
    if settings.run.allow_over_memory:
        log.warning(
            "allow_over_memory=true: this run needs about %s per device, more than %.0f%% of the %s its "
            "device has; starting it anyway",
            _gib(needed),
            100 * FIT_FRACTION,
            _gib(device.bytes),
        )
        return estimate
    accumulate = settings.trainer.get("accumulate_grad_batches") or 1
    strategies = runnable_strategies(settings, plan.n_devices)
    raise OverMemoryError(refusal(model, plan, estimate, device, strategies, int(accumulate)))


def refusal(
    model: Any,
    plan: TrainingPlan,
    estimate: MemoryEstimate,
    device: DeviceMemory,
    strategies: list[str],
    accumulate: int = 1,
) -> str:
    """The message: the estimate and its parts, the device, what would fit, and the escape."""
    parts = (
        f"weights {_gib(estimate.weights)}, gradients {_gib(estimate.gradients)}, AdamW "
        f"{_gib(estimate.optimizer)}, activations {_gib(estimate.activations)}"
    )
    if estimate.buffers:
        parts += f", buffers {_gib(estimate.buffers)}"
    if estimate.host:
        parts += f"; offloaded to the host {_gib(estimate.host)}"
    checkpointing = ", activation checkpointing" if plan.activation_checkpointing else ""
    head = (
        f"This run needs about {_gib(estimate.total + (estimate.host if device.kind == 'cpu' else 0))} per "
        f"device ({human(parameter_counts(model)['total'])} parameters, strategy={estimate.strategy} on "
        f"{estimate.n_devices} device(s), {estimate.precision}, micro-batch {estimate.micro_batch} x "
        f"{estimate.context}{checkpointing}: {parts}), but {device.description} "
        f"(a run may plan on {FIT_FRACTION:.0%} of it)."
    )
    options = fitting_options(
        model, device.bytes, plan, strategies, host_is_device=device.kind == "cpu", accumulate=accumulate
    )
    if options:
        fix = (
            "Would fit: "
            + "; or ".join(f"{overrides} ({_gib(e.total)} per device)" for overrides, e in options)
            + "."
        )
    else:
        fix = (
            "Nothing fits on this device, whatever the micro-batch, strategy or activation checkpointing: use "
            "more or larger devices, or a smaller model or context (the memory under every strategy: python "
            "scripts/model_card.py with the same overrides)."
        )
    return f"{head} {fix} If the estimate is wrong for this run, allow_over_memory=true starts it anyway."


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB" if n >= 0.1 * GiB else f"{n / 2**20:,.0f} MiB"


__all__ = ["OverMemoryError", "check_memory", "training_plan"]
