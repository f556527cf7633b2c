"""Know a model before running it: parameters, training FLOPs per token, and memory per device.

Pure arithmetic on a :class:`GPTConfig` (no Lightning, no weights), so it answers for a 175B model on a
laptop. The formulas, with h = n_embd, V = vocab_size, L = n_layer, T = context, f = MLP hidden width:

Parameters. Per layer: attention h (n_head + 2 n_kv_head) head_dim for Q, K, V plus h^2 for the output
projection; MLP h f (x2 for gated activations) plus f h; two norms; biases where ``bias`` is on. Plus the token
embedding V h, the positional scheme's own parameters, a final norm (pre-norm), and V h again for an untied
head. "Embedding" counts the token table and any learned position table (a tied head is counted there once).

Training FLOPs per token (Chowdhery et al. 2022, "PaLM", appendix B; the count behind nanoGPT's MFU):

    6 N + 12 L h T,    N = the weights of every matrix product: the layers' matrices and the head's V h,

i.e. 2 FLOPs per multiply-add, a backward pass twice the forward, and 2 matrix products of T x head_dim per
head and token for the attention scores and their weighted sum (counted over the full context, as is usual;
a causal kernel skips about half of that term). Kaplan et al. 2020 keep only 6 N (non-embedding).

Memory per device, in bytes, for one optimizer step of AdamW:

- weights, gradients, optimizer state per parameter by precision (``BYTES``): fp32 4 + 4 + 8 (two moments);
  mixed precision with fp32 master weights 4 + 4 + 8 (Lightning's autocast, FSDP) or, under DeepSpeed,
  2 + 2 + 12 (16-bit weights and gradients, fp32 master copy and moments; Rajbhandari et al. 2020, "ZeRO",
  section 3.1); pure bf16 2 + 2 + 4.
- sharding over N devices (Rajbhandari et al. 2020): DDP none (plus its gradient buckets, one more copy of
  the gradients); ZeRO-1 the optimizer state / N; ZeRO-2 also the gradients / N; ZeRO-3 and FSDP also the
  weights / N, plus the gathered weights and gradients of about two blocks at a time; offload moves the
  optimizer state (ZeRO-3: also the weights) to host memory.
- activations kept for the backward pass, per token and layer, in the activation dtype of p bytes
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.1,
  adapted to fused attention, which keeps no T x T scores): the two norm inputs 2h, the QKV input h, Q, K, V
  (h + 2 n_kv_head head_dim), the attention output h, the MLP input h, and the MLP's hidden tensors (2f, or
  4f gated: the doubled projection, f(gate) and the product), plus 1 byte per element of each dropout mask
  when dropout > 0. For GPT-2 in 16 bits this is 34 h bytes, the paper's figure without its 5 a T term.
  Outside the layers: the embedding output and final-norm input (2 p h) and the logits, p V + 4 V (the loss
  is taken on an fp32 copy). Activation checkpointing keeps only each block's input (p h) plus one block's
  activations during its recomputation. Data parallelism does not shard activations: each device holds its
  own micro-batch.

Estimates, not measurements: allocator slack, the CUDA context (about 0.5-1 GiB) and temporary buffers come
on top, so a run is called a fit only below 90% of the device memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from gptlab.errors import ConfigError
from gptlab.model import activations, norms, positional
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import mlp_hidden_width

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
# DeepSpeed keeps 16-bit weights and gradients and an fp32 master copy inside the optimizer state.
DEEPSPEED_MIXED = {"weights": 2, "gradients": 2, "optimizer": 12, "activations": 2}


@dataclass(frozen=True)
class Strategy:
    """How one strategy places the training state: which parts it shards over the devices."""

    name: str
    shard_optimizer: bool = False
    shard_gradients: bool = False
    shard_weights: bool = False
    offload_optimizer: bool = False
    offload_weights: bool = False
    deepspeed: bool = False
    gradient_buckets: bool = False  # DDP's communication buckets: one more copy of the gradients


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("single"),
        Strategy("ddp", gradient_buckets=True),
        Strategy("zero1", shard_optimizer=True, deepspeed=True),
        Strategy("zero2", shard_optimizer=True, shard_gradients=True, deepspeed=True),
        Strategy("zero2_offload", True, True, offload_optimizer=True, deepspeed=True),
        Strategy("fsdp", shard_optimizer=True, shard_gradients=True, shard_weights=True),
        Strategy("zero3", True, True, True, deepspeed=True),
        Strategy(
            "zero3_offload", True, True, True, offload_optimizer=True, offload_weights=True, deepspeed=True
        ),
    )
}
# The names a user types (`strategy=...` configs, Lightning strategy classes) -> the placements above.
ALIASES: dict[str, str] = {
    "auto": "single",
    "ddp_spawn": "ddp",
    "ddp_fork": "ddp",
    "ddp_notebook": "ddp",
    "ddpstrategy": "ddp",
    "singledevicestrategy": "single",
    "deepspeed_stage_1": "zero1",
    "deepspeed_stage_2": "zero2",
    "deepspeed_stage_2_offload": "zero2_offload",
    "deepspeed_stage_3": "zero3",
    "deepspeed_stage_3_offload": "zero3_offload",
    "fsdp2": "fsdp",
    "fsdpstrategy": "fsdp",
    "modelparallelstrategy": "fsdp",
}
# Which `strategy=` config to suggest for each placement, in the order tried when a run does not fit.
SUGGESTIONS: list[tuple[str, str]] = [
    ("ddp", "ddp"),
    ("zero1", "deepspeed_stage_1"),
    ("zero2", "deepspeed_stage_2"),
    ("fsdp", "fsdp"),
    ("zero3_offload", "deepspeed_stage_3_offload"),
]


def resolve_strategy(name: str, n_devices: int = 1) -> Strategy:
    """A strategy by config name (``ddp``, ``fsdp``, ``deepspeed_stage_2``...), placement name (``zero2``)
    or Lightning class name (``DDPStrategy``). ``auto`` is DDP on more than one device."""
    key = str(name).lower()
    key = ALIASES.get(key, key)
    if key == "single" and n_devices > 1:
        key = "ddp"
    if key not in STRATEGIES:
        choices = sorted(set(STRATEGIES) | set(ALIASES) - {k for k in ALIASES if k.endswith("strategy")})
        raise ConfigError(
            f"Unknown strategy {name!r} for the memory estimate. Choose one of: {', '.join(choices)}."
        )
    return STRATEGIES[key]


def strategy_name(strategy: dict | str | None) -> str:
    """The placement name for a ``strategy`` config node (``{"name": "deepspeed", "stage": 2, ...}``,
    ``{"name": "fsdp"}``, ``{"choice": "deepspeed_stage_3_offload"}``) or a plain name."""
    if strategy is None:
        return "auto"
    if isinstance(strategy, str):
        return strategy
    if strategy.get("choice"):
        return str(strategy["choice"])
    name = str(strategy.get("name", "auto"))
    if name == "deepspeed":
        offload = (
            "_offload" if strategy.get("offload_optimizer") or strategy.get("offload_parameters") else ""
        )
        return f"deepspeed_stage_{strategy.get('stage', 2)}{offload}"
    return name


# ---- parameters -------------------------------------------------------------------------------------


def positional_parameters(config: GPTConfig) -> int:
    """The positional scheme's own parameters (a learned table, relative-position buckets...), counted from
    the scheme built on the meta device: no memory, whatever its size."""
    with torch.device("meta"):
        scheme = positional.get(config.pos)(config)
    return sum(p.numel() for p in scheme.parameters())


def parameter_counts(config: GPTConfig) -> dict[str, int]:
    """total, embedding, non_embedding, and per_layer parameters, from the config alone."""
    h, V, bias = config.n_embd, config.vocab_size, int(config.bias)
    qkv_width = (config.n_head + 2 * config.kv_heads) * config.head_dim
    attention = h * qkv_width + qkv_width * bias + h * h + h * bias
    f = mlp_hidden_width(config)
    f_in = f * (2 if activations.is_gated(config.activation) else 1)
    mlp = h * f_in + f_in * bias + f * h + h * bias
    norm = norms.get(config.norm).parameter_count(config)
    per_layer = attention + mlp + 2 * norm
    embedding = V * h + positional_parameters(config)
    final_norm = norm if config.norm_placement == "pre" else 0
    head = 0 if config.tie_weights else V * h
    total = embedding + config.n_layer * per_layer + final_norm + head
    return {
        "total": total,
        "embedding": embedding,
        "non_embedding": total - embedding,
        "per_layer": per_layer,
    }


# ---- compute ----------------------------------------------------------------------------------------


def matmul_parameters(config: GPTConfig) -> int:
    """The weights that enter a matrix product per token: every layer's matrices and the output head (the
    input embedding is a lookup; biases and norm gains cost no multiply-adds worth counting)."""
    h = config.n_embd
    qkv_width = (config.n_head + 2 * config.kv_heads) * config.head_dim
    f = mlp_hidden_width(config)
    f_in = f * (2 if activations.is_gated(config.activation) else 1)
    per_layer = h * qkv_width + h * h + h * f_in + f * h
    return config.n_layer * per_layer + config.vocab_size * h


def flops_per_token(config: GPTConfig, context: int | None = None) -> dict[str, float]:
    """Training (forward + backward) FLOPs per token, 6 N + 12 L h T (PaLM, appendix B), and its parts;
    N = ``matmul_parameters``."""
    T = context or config.block_size
    dense = 6 * matmul_parameters(config)
    attention = 12 * config.n_layer * config.n_head * config.head_dim * T
    return {"training": float(dense + attention), "dense": float(dense), "attention": float(attention)}


# ---- memory -----------------------------------------------------------------------------------------


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
    hidden = 4 * f if activations.is_gated(config.activation) else 2 * f
    per_layer = p * (2 * h + h + (h + 2 * kv) + h + h + hidden)
    if config.dropout > 0:
        per_layer += 2 * h  # a 1-byte mask after attention and after the MLP
    outside = 2 * p * h + p * config.vocab_size + 4 * config.vocab_size
    if activation_checkpointing:
        return L * p * h + per_layer + outside
    return L * per_layer + outside


def memory_per_device(
    config: GPTConfig,
    strategy: str = "single",
    n_devices: int = 1,
    precision: str = "32-true",
    micro_batch: int = 1,
    context: int | None = None,
    activation_checkpointing: bool = False,
) -> MemoryEstimate:
    """The memory one device needs to train ``config`` with AdamW under ``strategy`` over ``n_devices``
    data-parallel devices, at ``precision`` (a Lightning precision name), ``micro_batch`` sequences of
    ``context`` tokens (default: the model's block size) per device."""
    if n_devices < 1 or micro_batch < 1:
        raise ConfigError(f"n_devices={n_devices} and micro_batch={micro_batch} must be at least 1.")
    plan = resolve_strategy(strategy, n_devices)
    if precision not in BYTES:
        raise ConfigError(f"Unknown precision {precision!r}. Choose one of: {', '.join(BYTES)}.")
    size = dict(BYTES[precision])
    if plan.deepspeed and precision in ("bf16-mixed", "16-mixed"):
        size = dict(DEEPSPEED_MIXED)
    n = parameter_counts(config)["total"]
    T = context or config.block_size
    shards = n_devices if plan.name != "single" else 1

    weights = n * size["weights"] / (shards if plan.shard_weights else 1)
    gradients = n * size["gradients"] / (shards if plan.shard_gradients else 1)
    optimizer = n * size["optimizer"] / (shards if plan.shard_optimizer else 1)
    host = 0.0
    if plan.offload_optimizer:
        host += optimizer
        optimizer = 0.0
    if plan.offload_weights:
        host += weights
        weights = 0.0
    buffers = 0.0
    if plan.gradient_buckets and n_devices > 1:
        buffers = n * size["gradients"]
    if plan.shard_weights and shards > 1:
        # Two blocks gathered at a time (the current one and the prefetched next), weights and gradients,
        # in the activation dtype.
        per_layer = parameter_counts(config)["per_layer"]
        buffers = 2 * per_layer * 2 * size["activations"]
    acts = micro_batch * T * activation_bytes_per_token(config, size["activations"], activation_checkpointing)
    return MemoryEstimate(
        strategy=plan.name,
        n_devices=n_devices,
        precision=precision,
        micro_batch=micro_batch,
        context=T,
        activation_checkpointing=activation_checkpointing,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=acts,
        buffers=buffers,
        host=host,
    )


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


def advise(
    config: GPTConfig,
    device_memory: float,
    strategy: str = "single",
    n_devices: int = 1,
    precision: str = "32-true",
    micro_batch: int = 1,
    context: int | None = None,
    activation_checkpointing: bool = False,
) -> str | None:
    """None when the run fits its device; otherwise a warning naming the strategy (and, if needed, the number
    of devices, activation checkpointing or a smaller micro-batch) that would fit."""
    est = memory_per_device(
        config, strategy, n_devices, precision, micro_batch, context, activation_checkpointing
    )
    if est.fits(device_memory):
        return None
    head = (
        f"WARNING: this run needs about {est.total / GiB:,.1f} GiB per device under strategy={strategy}"
        + (f" ({est.strategy})" if est.strategy != strategy else "")
        + " on "
        f"{n_devices} device(s), more than {FIT_FRACTION:.0%} of the {device_memory / GiB:,.0f} GiB it has."
    )

    def first_fit(devices: int, batch: int, checkpointing: bool) -> tuple[str, MemoryEstimate] | None:
        for placement, config_name in SUGGESTIONS:
            if placement == "ddp" and devices == 1:
                continue
            candidate = memory_per_device(
                config, placement, devices, precision, batch, context, activation_checkpointing=checkpointing
            )
            if candidate.fits(device_memory):
                return config_name, candidate
        return None

    found = first_fit(n_devices, micro_batch, activation_checkpointing)
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


# ---- the card -----------------------------------------------------------------------------------------


def human(n: float) -> str:
    for unit, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def model_card(
    config: GPTConfig,
    strategy: str = "single",
    n_devices: int = 1,
    precision: str = "32-true",
    micro_batch: int = 1,
    context: int | None = None,
    device_memory: float | None = None,
    device_name: str = "",
    short: bool = False,
    activation_checkpointing: bool = False,
) -> str:
    """The card as text: the short form (printed at training start) or the full one with every strategy."""
    c = config
    counts = parameter_counts(c)
    flops = flops_per_token(c, context)
    T = context or c.block_size
    gqa = f", {c.kv_heads} key/value heads" if c.kv_heads != c.n_head else ""
    lines = [
        f"Model: {c.n_layer} layers x {c.n_head} heads{gqa} x {c.n_embd} wide, MLP {mlp_hidden_width(c)} wide, "
        f"context {c.block_size}, vocabulary {c.vocab_size}; pos={c.pos}, activation={c.activation}, "
        f"norm={c.norm} ({c.norm_placement}), bias {'on' if c.bias else 'off'}, head "
        f"{'tied to' if c.tie_weights else 'separate from'} the token embedding",
        f"Parameters: total {counts['total']:,} ({human(counts['total'])}), embedding {counts['embedding']:,}, "
        f"non-embedding {counts['non_embedding']:,}",
        f"Training FLOPs per token at context {T}: {human(flops['training'])} (6N + 12 L h T: dense "
        f"{human(flops['dense'])}, attention {human(flops['attention'])})",
    ]
    est = memory_per_device(c, strategy, n_devices, precision, micro_batch, context, activation_checkpointing)
    checkpointing = ", activation checkpointing" if activation_checkpointing else ""
    lines.append(
        f"Memory per device ({est.strategy}, {n_devices} device(s), {precision}, micro-batch {micro_batch} x "
        f"{T}{checkpointing}): {_gib(est.total)} = weights {_gib(est.weights)} + gradients {_gib(est.gradients)} + AdamW "
        f"{_gib(est.optimizer)} + activations {_gib(est.activations)}"
        + (f" + buffers {_gib(est.buffers)}" if est.buffers else "")
        + (f"; on the host {_gib(est.host)}" if est.host else "")
        + (f"; device: {device_name}" if device_name else "")
    )
    warning = (
        advise(
            c, device_memory, strategy, n_devices, precision, micro_batch, context, activation_checkpointing
        )
        if device_memory
        else None
    )
    if short:
        return "\n".join(lines + ([warning] if warning else []))

    lines.append(
        f"Compute-optimal training tokens (about 20 per parameter, Hoffmann et al. 2022): "
        f"{human(20 * counts['total'])}, {20 * counts['total'] * flops['training']:.2e} FLOPs"
    )
    lines.append("")
    header = f"{'strategy':<16} {'weights':>10} {'grads':>10} {'AdamW':>10} {'activ.':>10} {'buffers':>10} {'total':>10}"
    for checkpointing in (False, True):
        lines.append(
            f"Memory per device over {n_devices} device(s), {precision}, micro-batch {micro_batch} x {T}"
            + (", activation checkpointing" if checkpointing else "")
            + " (GiB):"
        )
        lines.append(header)
        for placement in ("single", "ddp", "zero1", "zero2", "fsdp", "zero3", "zero3_offload"):
            if placement == "single" and n_devices > 1:
                continue
            e = memory_per_device(c, placement, n_devices, precision, micro_batch, context, checkpointing)
            fit = ""
            if device_memory:
                fit = "  fits" if e.fits(device_memory) else "  too big"
            lines.append(
                f"{placement:<16} {e.weights / GiB:>10,.2f} {e.gradients / GiB:>10,.2f} {e.optimizer / GiB:>10,.2f} "
                f"{e.activations / GiB:>10,.2f} {e.buffers / GiB:>10,.2f} {e.total / GiB:>10,.2f}{fit}"
            )
        lines.append("")
    if device_memory:
        lines.append(f"Device: {device_name or f'{device_memory / GiB:,.0f} GiB'}")
        lines.append(
            warning or f"strategy={strategy} fits: {_gib(est.total)} of {_gib(device_memory)} per device."
        )
    return "\n".join(lines)


def startup_card(
    config: GPTConfig,
    strategy: str = "auto",
    n_devices: int = 1,
    precision: str = "32-true",
    micro_batch: int = 1,
    context: int | None = None,
    on_cpu: bool = True,
    activation_checkpointing: bool = False,
) -> str:
    """The short card for the start of a training run, sized against the memory of the device it runs on."""
    memory, device = device_memory_bytes("cpu" if on_cpu else "cuda")
    if precision not in BYTES:  # a precision plugin's own name: count it as fp32, the safe side
        precision = "32-true"
    return model_card(
        config,
        strategy,
        n_devices,
        precision,
        micro_batch,
        context,
        memory,
        device,
        short=True,
        activation_checkpointing=activation_checkpointing,
    )


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if n >= 0.01 * GiB else f"{n / 2**20:,.1f} MiB"


__all__ = [
    "BYTES",
    "MemoryEstimate",
    "activation_bytes_per_token",
    "advise",
    "device_memory_bytes",
    "flops_per_token",
    "memory_per_device",
    "model_card",
    "parameter_counts",
    "resolve_strategy",
]
