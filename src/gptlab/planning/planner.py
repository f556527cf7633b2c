"""The memory a training run needs per device, before it runs: the planner behind the model card.

Pure arithmetic on a :class:`GPTConfig` and a `strategy=` choice (no weights, no processes), so it answers for a
175B model on a laptop. What each device holds comes from the choice's own `placement`
(`gptlab.parallel.strategies`), the one description of each strategy that training also builds from.

Memory per device, in bytes, for one optimizer step of AdamW:

- weights, gradients, optimizer state per parameter by precision (``BYTES``): fp32 4 + 4 + 8 (two moments);
  mixed precision with fp32 master weights 4 + 4 + 8 (Lightning's autocast, FSDP) or, under DeepSpeed,
  2 + 2 + 12 (16-bit weights and gradients, fp32 master copy and moments; Rajbhandari et al. 2020, "ZeRO",
  section 3.1); pure bf16 2 + 2 + 4.
- sharding over N devices (Rajbhandari et al. 2020), as each strategy's `Placement` says: DDP none (plus its gradient buckets, one more copy of
  the gradients); ZeRO-1 the optimizer state / N; ZeRO-2 also the gradients / N; ZeRO-3 and FSDP also the
  weights / N, plus the gathered weights and gradients of about two blocks at a time; offload moves the
  optimizer state (ZeRO-3: also the weights) to host memory.
- activations kept for the backward pass, per token and layer, in the activation dtype of p bytes
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.1,
  adapted to fused attention, which keeps no T x T scores): the two norm inputs 2h, the QKV input h, Q, K, V
  (h + 2 n_kv_head head_dim), the attention output h, the MLP input h, and the MLP's hidden tensors (2f, or
  4f gated: the doubled projection, f(gate) and the product), plus 1 byte per element of each dropout mask
  when dropout > 0; QK-norm's normalised queries and keys and their inputs, 2 (h + n_kv_head head_dim); the
  sandwich's two output-norm inputs, 2h. For GPT-2 in 16 bits this is 34 h bytes, the paper's figure without
  its 5 a T term. A masked or capped layer on the dense (CPU) route also keeps its T x T weights, as the bias
  schemes' do: not counted, since on CUDA FlexAttention keeps none.
  Outside the layers: the embedding output and final-norm input (2 p h) and the logits, p V + 4 V (the loss
  is taken on an fp32 copy). Activation checkpointing keeps only each block's input (p h) plus one block's
  activations during its recomputation. Data parallelism does not shard activations: each device holds its
  own micro-batch.

Estimates, not measurements: allocator slack, the CUDA context (about 0.5-1 GiB) and temporary buffers come
on top, so a run is called a fit only below 90% of the device memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from gptlab.errors import ConfigError
from gptlab.model.config import GPTConfig
from gptlab.model.counting import parameter_counts
from gptlab.model.gpt import mlp_hidden_width
from gptlab.parallel.strategies import Placement, StrategyChoice, strategy_choice, strategy_choices

GiB = 1024**3
FIT_FRACTION = 0.9  # the share of device memory an estimate may fill and still be called a fit

# bytes per parameter (weights, gradients, AdamW state) and per activation value, by Lightning precision name.
BYTES: dict[str, dict[str, int]] = {
    "64-true": {"weights": 8, "gradients": 8, "optimizer": 16, "activations": 8},
    "32-true": {"weights": 4, "gradients": 4, "optimizer": 8, "activations": 4},
    "32": {"weights": 4, "gradients": 4, "optimizer": 8, "activations": 4},
    "bf16-mixed": {"weights": 4, "gradients": 4, "optimizer": 8, "activations": 2},
    "16-mixed": {"weights": 4, "gradients": 4, "optimizer": 8, "activations": 2},
    "bf16-true": {"weights": 2, "gradients": 2, "optimizer": 4, "activations": 2},
    "16-true": {"weights": 2, "gradients": 2, "optimizer": 4, "activations": 2},
}
# 16-bit weights and gradients with an fp32 master copy inside the optimizer state (DeepSpeed's mixed precision).
SIXTEEN_BIT_MASTER = {"weights": 2, "gradients": 2, "optimizer": 12, "activations": 2}


@dataclass(frozen=True)
class TrainingPlan:
    """How a model is to be trained, as far as its memory goes: the `strategy=` choice (a name, a strategy
    config node or a `StrategyChoice`), ``n_devices`` data-parallel devices, the Lightning ``precision``,
    ``micro_batch`` sequences of ``context`` tokens per device (None: the model's block size), and whether
    activations are recomputed in the backward pass."""

    strategy: str | dict[str, Any] | StrategyChoice | None = "auto"
    n_devices: int = 1
    precision: str = "32-true"
    micro_batch: int = 1
    context: int | None = None
    activation_checkpointing: bool = False


MIXED = ("bf16-mixed", "16-mixed")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device for one training step; ``total`` is the estimated peak."""

    strategy: str
    n_devices: int
    precision: str
    micro_batch: int
    context: int
    activation_checkpointing: bool
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float  # DDP's gradient buckets; FSDP/ZeRO-3's gathered blocks
    host: float  # state offloaded to host (CPU) memory, per device

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    def describe(self) -> str:
        host = f", plus {self.host / GiB:,.1f} GiB of host memory" if self.host else ""
        return f"about {self.total / GiB:,.1f} GiB per device{host}"

    def fits(self, device_memory: float) -> bool:
        return self.total <= FIT_FRACTION * device_memory


def activation_bytes_per_token(
    config: GPTConfig, bytes_per_value: int, activation_checkpointing: bool = False
) -> float:
    """Bytes of activations kept for the backward pass per token of a micro-batch (see the module doc)."""
    h, p, L = config.n_embd, bytes_per_value, config.n_layer
    f = mlp_hidden_width(config)
    kv = config.kv_heads * config.head_dim
    hidden = 4 * f if config.gated else 2 * f
    per_layer = p * (2 * h + h + (h + 2 * kv) + h + h + hidden)
    if config.dropout > 0:
        per_layer += 2 * h  # a 1-byte mask after attention and after the MLP
    if config.attention.qk_norm != "none":
        per_layer += p * 2 * (h + kv)  # q and k before and after their norms (no longer views of one QKV)
    if config.norm_placement == "sandwich":
        per_layer += p * 2 * h  # the inputs of the norms on the sublayers' outputs
    outside = 2 * p * h + p * config.vocab_size + 4 * config.vocab_size
    if activation_checkpointing:
        return L * p * h + per_layer + outside
    return L * per_layer + outside


def memory_per_device(config: GPTConfig, plan: TrainingPlan = TrainingPlan()) -> MemoryEstimate:
    """The memory one device needs to train ``config`` with AdamW as ``plan`` says."""
    n_devices, precision, micro_batch = plan.n_devices, plan.precision, plan.micro_batch
    if n_devices < 1 or micro_batch < 1:
        raise ConfigError(f"n_devices={n_devices} and micro_batch={micro_batch} must be at least 1.")
    choice = strategy_choice(plan.strategy)
    placement = choice.placement(n_devices)
    if precision not in BYTES:
        raise ConfigError(f"Unknown precision {precision!r}. Choose one of: {', '.join(BYTES)}.")
    size = dict(
        SIXTEEN_BIT_MASTER if placement.sixteen_bit_master and precision in MIXED else BYTES[precision]
    )
    n = parameter_counts(config)["total"]
    T = plan.context or config.block_size
    shards = n_devices

    weights = n * size["weights"] / (shards if placement.shards_weights else 1)
    gradients = n * size["gradients"] / (shards if placement.shards_gradients else 1)
    optimizer = n * size["optimizer"] / (shards if placement.shards_optimizer else 1)
    host = 0.0
    if placement.offload_optimizer:
        host, optimizer = host + optimizer, 0.0
    if placement.offload_gradients:
        host, gradients = host + gradients, 0.0
    if placement.offload_weights:
        host, weights = host + weights, 0.0
    buffers = 0.0
    if placement.gradient_buckets and n_devices > 1:
        buffers = n * size["gradients"]
    if placement.shards_weights and shards > 1:
        # Two blocks gathered at a time (the current one and the prefetched next), weights and gradients,
        # in the activation dtype.
        per_layer = parameter_counts(config)["per_layer"]
        buffers = 2 * per_layer * 2 * size["activations"]
    acts = (
        micro_batch
        * T
        * activation_bytes_per_token(config, size["activations"], plan.activation_checkpointing)
    )
    return MemoryEstimate(
        strategy=choice.label,
        n_devices=n_devices,
        precision=precision,
        micro_batch=micro_batch,
        context=T,
        activation_checkpointing=plan.activation_checkpointing,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=acts,
        buffers=buffers,
        host=host,
    )


def distinct_choices(n_devices: int) -> list[tuple[str, Placement]]:
    """Every `strategy=` choice with a placement of its own on ``n_devices`` devices (``auto`` is DDP's on
    several, and named after DDP then; ``ddp_spawn`` is DDP's), from the least communication to the most."""
    seen: dict[Placement, str] = {}
    choices = [strategy_choice(name) for name in strategy_choices()]
    for choice in sorted(choices, key=lambda c: (c.lightning_decides, c.label)):
        name, placement = choice.label, choice.placement(n_devices)
        if n_devices == 1 and placement.gradient_buckets:
            continue  # one device: data parallelism is the single device
        seen.setdefault(placement, name)
    return sorted(((name, p) for p, name in seen.items()), key=lambda item: (item[1].cost_rank(), item[0]))


def device_memory_bytes(accelerator: str | None = None) -> tuple[float, str]:
    """The memory of the device a run would use: the first CUDA GPU if there is one (or ``accelerator`` says
    so), otherwise the host's RAM. Returns (bytes, a description)."""
    if accelerator != "cpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{props.name}, {props.total_memory / GiB:.0f} GiB"
    try:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX hosts
        ram = 16.0 * GiB
    return ram, f"CPU, {ram / GiB:.0f} GiB of RAM"


def available_host_memory() -> float:
    """Bytes of RAM this machine can give a new process now (``MemAvailable``: free memory plus the page
    cache it can drop); the physical RAM where the kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024  # the kernel reports KiB
    except OSError:  # pragma: no cover - not Linux
        pass
    return device_memory_bytes("cpu")[0]


def fitting_options(
    config: GPTConfig,
    device_memory: float,
    plan: TrainingPlan,
    strategies: list[str],
    host_is_device: bool = False,
    accumulate: int = 1,
    limit: int = 3,
) -> list[tuple[str, MemoryEstimate]]:
    """Up to ``limit`` changes of ``plan`` on the same devices that would fit ``device_memory``, the least
    intrusive first, each as (the overrides that make it, its estimate): a smaller micro-batch, activation
    checkpointing, one of ``strategies`` (the choices that can run here), and their combinations.
    ``host_is_device``: the devices are the host's own memory (CPU training), so state offloaded to the host
    counts against it too. ``accumulate``: the run's ``trainer.accumulate_grad_batches``, raised where the
    micro-batch shrinks so that each optimizer step sees as many sequences."""

    def fits(e: MemoryEstimate) -> bool:
        return (e.total + (e.host if host_is_device else 0.0)) <= FIT_FRACTION * device_memory

    smaller = []
    b = plan.micro_batch
    while b > 1:
        b //= 2
        smaller.append(b)
    batches = [plan.micro_batch, *smaller]
    current = strategy_choice(plan.strategy).label
    checkpointing = plan.activation_checkpointing
    # One option of each kind, the first of its kind that fits: the largest micro-batch that fits as it is;
    # activation checkpointing; another strategy (with checkpointing and a smaller micro-batch if need be).
    kinds: list[list[tuple[str | None, int, bool]]] = [
        [(None, b, checkpointing) for b in smaller],
        [(None, b, True) for b in batches] if not checkpointing else [],
        [
            (name, b, c)
            for c in sorted({checkpointing, True})
            for b in batches
            for name in strategies
            if name != current
        ],
    ]
    found: list[tuple[str, MemoryEstimate]] = []
    for kind in kinds:
        for name, batch, with_checkpointing in kind:
            candidate = replace(
                plan,
                strategy=name or plan.strategy,
                micro_batch=batch,
                activation_checkpointing=with_checkpointing,
            )
            estimate = memory_per_device(config, candidate)
            if not fits(estimate):
                continue
            if name and fits(memory_per_device(config, replace(candidate, strategy=plan.strategy))):
                continue  # the strategy is not what makes it fit: the other kinds say it plainly
            overrides = [f"strategy={name}"] if name else []
            if batch != plan.micro_batch:
                overrides.append(f"data.batch_size={batch}")
                # the same batch per optimizer step, in more micro-batches
                overrides.append(f"trainer.accumulate_grad_batches={accumulate * plan.micro_batch // batch}")
            if with_checkpointing != checkpointing:
                overrides.append(f"activation_checkpointing={str(with_checkpointing).lower()}")
            found.append((" ".join(overrides), estimate))
            break
    return found[:limit]


def advise(config: GPTConfig, device_memory: float, plan: TrainingPlan = TrainingPlan()) -> str | None:
    """None when the run fits its device; otherwise a warning naming the strategy (and, if needed, the number
    of devices, activation checkpointing or a smaller micro-batch) that would fit."""
    n_devices, micro_batch = plan.n_devices, plan.micro_batch
    est = memory_per_device(config, plan)
    if est.fits(device_memory):
        return None
    head = (
        f"WARNING: this run needs about {est.total / GiB:,.1f} GiB per device under strategy={est.strategy} on "
        f"{n_devices} device(s), more than {FIT_FRACTION:.0%} of the {device_memory / GiB:,.0f} GiB it has."
    )

    def first_fit(devices: int, batch: int, checkpointing: bool) -> tuple[str, MemoryEstimate] | None:
        for config_name, _ in distinct_choices(devices):
            candidate = memory_per_device(
                config,
                replace(
                    plan,
                    strategy=config_name,
                    n_devices=devices,
                    micro_batch=batch,
                    activation_checkpointing=checkpointing,
                ),
            )
            if candidate.fits(device_memory):
                return config_name, candidate
        return None

    found = first_fit(n_devices, micro_batch, plan.activation_checkpointing)
    if found:
        name, fit = found
        return f"{head} strategy={name} would fit: {fit.describe()}."
    found = first_fit(n_devices, micro_batch, True)
    if found:
        name, fit = found
        return f"{head} strategy={name} with activation checkpointing would fit: {fit.describe()}."
    for batch in sorted({micro_batch, 1}, reverse=True):
        devices = 1
        while devices <= 2**20:
            for checkpointing in (False, True):
                found = first_fit(devices, batch, checkpointing)
                if found and devices > n_devices:
                    name, fit = found
                    extra = " with activation checkpointing" if checkpointing else ""
                    extra += f" and micro-batch {batch}" if batch != micro_batch else ""
                    return (
                        f"{head} strategy={name} on {devices:,} devices{extra} would fit: {fit.describe()}."
                    )
            devices *= 2
    return f"{head} No strategy fits it on devices of this size; shrink the model or the context."
