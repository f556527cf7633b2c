"""The model card: what a model is (parameters, FLOPs per token) and what training it takes (memory per
device under each `strategy=` choice, and whether the run fits its devices). Printed at the start of every
training run (short form) and by `scripts/model_card.py` (full form)."""

from __future__ import annotations

from dataclasses import replace

from gptlab.model.config import GPTConfig
from gptlab.model.counting import flops_per_token, human, parameter_counts
from gptlab.model.gpt import mlp_hidden_width
from gptlab.model.head_loss import HeadLoss
from gptlab.planning.planner import (
    BYTES,
    GiB,
    MemoryEstimate,
    TrainingPlan,
    advise,
    device_memory_bytes,
    distinct_choices,
    memory_per_device,
)


def model_card(
    config: GPTConfig,
    plan: TrainingPlan | None = None,
    device_memory: float | None = None,
    device_name: str = "",
    short: bool = False,
    loss: HeadLoss | None = None,
) -> str:
    """The card as text: the short form (printed at training start) or the full one with every strategy.
    ``loss``: the run's loss node, described when it adds a term to the cross-entropy."""
    c, plan = config, plan or TrainingPlan()
    counts = parameter_counts(c)
    flops = flops_per_token(c, plan.context)
    T = plan.context or c.block_size
    lines = _model_lines(c, counts, flops, T)
    described = loss.describe() if loss is not None else None
    if described:
        lines.append(described)
    est = memory_per_device(c, plan)
    lines.append(_memory_line(est, plan, T, device_name))
    warning = advise(c, device_memory, plan) if device_memory else None
    if short:
        return "\n".join(lines + ([warning] if warning else []))

    lines.append(
        f"Compute-optimal training tokens (about 20 per parameter, Hoffmann et al. 2022): "
        f"{human(20 * counts['total'])}, {20 * counts['total'] * flops['training']:.2e} FLOPs"
    )
    lines.append("")
    for with_checkpointing in (False, True):
        lines += _strategy_table(
            c, replace(plan, activation_checkpointing=with_checkpointing), T, device_memory
        )
    if device_memory:
        lines.append(f"Device: {device_name or f'{device_memory / GiB:,.0f} GiB'}")
        lines.append(
            warning or f"strategy={est.strategy} fits: {_gib(est.total)} of {_gib(device_memory)} per device."
        )
    return "\n".join(lines)


def _model_lines(c: GPTConfig, counts: dict[str, int], flops: dict[str, float], T: int) -> list[str]:
    """The card's first lines: the architecture, the parameter counts and the training FLOPs per token."""
    gqa = f", {c.kv_heads} key/value heads" if c.kv_heads != c.n_head else ""
    return [
        f"Model: {c.n_layer} layers x {c.n_head} heads{gqa} x {c.n_embd} wide, MLP {mlp_hidden_width(c)} wide, "
        f"context {c.block_size}, vocabulary {c.vocab_size}; pos={c.pos.name}, activation={c.activation.name}, "
        f"norm={c.norm.name} ({c.norm_placement}), bias {'on' if c.bias else 'off'}, head "
        f"{'tied to' if c.tie_weights else 'separate from'} the token embedding"
        + ("" if c.attention.is_default else f"; attention: {c.attention.describe()}"),
        f"Parameters: total {counts['total']:,} ({human(counts['total'])}), embedding {counts['embedding']:,}, "
        f"non-embedding {counts['non_embedding']:,}",
        f"Training FLOPs per token at context {T}: {human(flops['training'])} (6N + 12 L h T: dense "
        f"{human(flops['dense'])}, attention {human(flops['attention'])})",
    ]


def _memory_line(est: MemoryEstimate, plan: TrainingPlan, T: int, device_name: str) -> str:
    """The one-line memory breakdown per device of the chosen strategy."""
    checkpointing = ", activation checkpointing" if plan.activation_checkpointing else ""
    return (
        f"Memory per device ({est.strategy}, {plan.n_devices} device(s), {plan.precision}, micro-batch "
        f"{plan.micro_batch} x "
        f"{T}{checkpointing}): {_gib(est.total)} = weights {_gib(est.weights)} + gradients {_gib(est.gradients)} + AdamW "
        f"{_gib(est.optimizer)} + activations {_gib(est.activations)}"
        + (f" + buffers {_gib(est.buffers)}" if est.buffers else "")
        + (f"; on the host {_gib(est.host)}" if est.host else "")
        + (f"; device: {device_name}" if device_name else "")
    )


def _strategy_table(c: GPTConfig, plan: TrainingPlan, T: int, device_memory: float | None) -> list[str]:
    """The memory table of every distinct strategy (title, header, one row each, a blank line)."""
    lines = [
        f"Memory per device over {plan.n_devices} device(s), {plan.precision}, micro-batch {plan.micro_batch} x {T}"
        + (", activation checkpointing" if plan.activation_checkpointing else "")
        + " (GiB):",
        f"{'strategy':<26} {'weights':>10} {'grads':>10} {'AdamW':>10} {'activ.':>10} {'buffers':>10} {'total':>10}",
    ]
    for name, _ in distinct_choices(plan.n_devices):
        e = memory_per_device(c, replace(plan, strategy=name))
        lines.append(_strategy_row(name, e, device_memory))
    lines.append("")
    return lines


def _strategy_row(name: str, e: MemoryEstimate, device_memory: float | None) -> str:
    """One strategy's row of the memory table, with whether it fits the device when its memory is known."""
    fit = ""
    if device_memory:
        fit = "  fits" if e.fits(device_memory) else "  too big"
    return (
        f"{name:<26} {e.weights / GiB:>10,.2f} {e.gradients / GiB:>10,.2f} {e.optimizer / GiB:>10,.2f} "
        f"{e.activations / GiB:>10,.2f} {e.buffers / GiB:>10,.2f} {e.total / GiB:>10,.2f}{fit}"
    )


def startup_card(
    config: GPTConfig, plan: TrainingPlan, on_cpu: bool = True, loss: HeadLoss | None = None
) -> str:
    """The short card for the start of a training run, sized against the memory of the device it runs on."""
    memory, device = device_memory_bytes("cpu" if on_cpu else "cuda")
    if plan.precision not in BYTES:  # a precision plugin's own name: count it as fp32, the safe side
        plan = replace(plan, precision="32-true")
    return model_card(config, plan, memory, device, short=True, loss=loss)


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if n >= 0.01 * GiB else f"{n / 2**20:,.1f} MiB"


__all__ = ["MemoryEstimate", "TrainingPlan", "model_card", "startup_card"]
