"""Planning a run before it starts: the memory it needs per device, whether that fits the device it will
train on, and the model card that prints both with the parameter and FLOP counts.

Pure arithmetic on a :class:`GPTConfig` and a `strategy=` choice (no weights, no processes), so it answers for a
175B model on a laptop, in milliseconds. What each device holds comes from the choice's own `placement`
(`gptlab.parallel.strategies`), the one description of each strategy that training also builds from.

**The estimate** (`memory_per_device`): memory per device, in bytes, for one optimizer step of AdamW:

- weights, gradients, optimizer state per parameter by precision (``BYTES``): fp32 4 + 4 + 8 (two moments);
  mixed precision with fp32 master weights 4 + 4 + 8 (Lightning's autocast, FSDP) or, under DeepSpeed,
  2 + 2 + 12 (16-bit weights and gradients, fp32 master copy and moments; Rajbhandari et al. 2020, "ZeRO",
  section 3.1); pure bf16 2 + 2 + 4.
- sharding over N devices (Rajbhandari et al. 2020), as each strategy's `Placement` says: DDP none (plus its gradient buckets, one more copy of
  the gradients); ZeRO-1 the optimizer state / N; ZeRO-2 also the gradients / N; ZeRO-3 and FSDP also the
  weights / N, plus the gathered weights and gradients of about two blocks at a time and of the root unit
  (the embeddings, final norm and output layer, which FSDP gathers whole for the forward and the backward
  pass, with its gradients whole until their reduce-scatter); offload moves the optimizer state (ZeRO-3: also
  the weights) to host memory.
- activations kept for the backward pass, per token and layer, in the activation dtype of p bytes
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.1,
  adapted to fused attention, which keeps no T x T scores): the two norm inputs 2h, the QKV input h, Q, K, V
  (h + 2 n_kv_head head_dim), the attention output h, the MLP input h, and the MLP's hidden tensors (2f, or
  4f gated: the doubled projection, f(gate) and the product), plus 1 byte per element of each dropout mask
  when dropout > 0; QK-norm's normalised queries and keys and their inputs, 2 (h + n_kv_head head_dim); the
  sandwich's two output-norm inputs, 2h; differential attention's halves of q and k, second attention output
  and head-norm input, 3h + n_kv_head head_dim; RMSNorm's normalised input, h per norm (torch's F.rms_norm
  keeps it where it is not one fused kernel). For GPT-2 in 16 bits this is 34 h bytes, the paper's figure
  without its 5 a T term. A masked or capped layer on the dense (CPU) route also keeps its T x T weights, as the bias
  schemes' do: not counted, since on CUDA FlexAttention keeps none.
  Outside the layers: the embedding output and final-norm input (2 p h). Activation checkpointing keeps only
  each block's input (p h) plus one block's activations during its recomputation. Data parallelism does not
  shard activations: each device holds its own micro-batch.
- the output layer and loss (``head``, :class:`HeadPlan`): what the run's ``loss.impl`` holds at its peak, the
  start of the backward pass, when every activation is still kept. ``plain`` holds the whole logits: the fp32
  log-probabilities cross-entropy keeps, their gradient from the loss and the gradient of the logits, 12 V
  bytes per token whatever the compute dtype (4.52 GiB measured on an H100 at 8,192 x 50,257 in bf16, 4.60
  counted), 8 V more with the z-loss and 4 V with the softcap. ``chunked`` and ``torch`` hold one (rows, V) fp32
  buffer per call, a fixed size, not per token, and the gradients they accumulate in the forward pass, (N, h)
  and (V, h) in fp32 (plus, with bf16 / fp16 products on CUDA, the chunk and the weight in that dtype and a
  (V, h) product). ``chunked``'s fused pass (CUDA, bf16 / fp16, triton installed: ``head_loss.
  fused_by_default``) holds no fp32 chunk: one (rows, V) chunk in the product dtype, the logits and then their
  gradient; its default chunk takes twice the rows of an fp32 one, in the same bytes. torch's also holds, at the end of its backward, two copies of each accumulated gradient, which at
  a width like GPT-2's outweighs its chunk. ``cce`` and ``liger`` hold no logits: a fixed allowance,
  ``KERNEL_HEAD_BYTES``. Which one a run takes is ``HeadLoss.resolve`` on its device and precision
  (``auto``: ``chunked``, on a CPU and on CUDA); the card says which it counted. The CPU heads,
  and the fused pass forced on a CPU in bf16, are checked against the CPU allocator's record of a forward and
  backward pass (``tests/test_model_card.py``): ``plain`` held 12.0 V bytes per token, as counted.

Estimates, not measurements: allocator slack, the CUDA context (about 0.5-1 GiB) and temporary buffers come
on top, so a run is called a fit only below 90% of the device memory.


**The fit** (`check_memory`). The estimate for the run as configured (model, `strategy=`, devices, precision,
micro-batch, context, activation checkpointing) is compared with what the device has: a CUDA GPU's memory, or
on a CPU the RAM available now, shared by the run's processes on this machine. A run estimated above
``FIT_FRACTION`` of it is refused with a :class:`OverMemoryError` that names the estimate, the device and the
changes that would fit, instead of being killed by the kernel's out-of-memory killer minutes later with no
word. ``allow_over_memory=true`` runs it anyway, for when the estimate is wrong.

**The card** (`model_card`): what a model is (parameters, FLOPs per token) and what training it takes (memory
per device under each `strategy=` choice, and whether the run fits its devices). Printed at the start of every
training run (`startup_card`, short form) and by `scripts/model_card.py` (full form).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from gptlab.errors import ConfigError
from gptlab.model.config import GPTConfig
from gptlab.model.counting import flops_per_token, gate_width, human, moe_options, parameter_counts
from gptlab.model.feedforward import expert_hidden_width
from gptlab.model.gpt import mlp_hidden_width
from gptlab.model.head_loss import (
    HeadLoss,
    chunk_logits_dtype,
    default_chunk_rows,
    fused_by_default,
    precision_dtype,
)
from gptlab.parallel.hardware import available_host_memory, host_memory_bytes
from gptlab.parallel.strategies import Placement, StrategyChoice, strategy_choice, strategy_choices

if TYPE_CHECKING:
    from gptlab.config import GPTRunConfig

log = logging.getLogger(__name__)

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


# What Cut Cross-Entropy and Liger-Kernel's fused linear cross-entropy hold beyond their inputs and the weight's
# gradient: neither keeps logits. Measured on an H100 at GPT-2 small's 8,192 x 768 x 50,257 in bf16, forward and
# backward: 0.06 GiB each (docs/performance.md, "Measured on an H100"); counted at twice that, a fixed size
# (their blocks are tiles of fixed size, not rows of the batch).
KERNEL_HEAD_BYTES = 128 * 2**20


@dataclass(frozen=True)
class HeadPlan:
    """The output layer and loss a run computes, as far as its memory goes: ``impl`` as the run resolves
    ``loss.impl`` (never ``auto``), ``chunk_rows`` for ``chunked`` and ``torch`` (None:
    ``default_chunk_rows`` for ``device_type``), whether the z-loss and the softcap are on (``plain`` holds
    two whole (N, V) tensors more for the one, one for the other), whether the chunked products run in
    bf16 / fp16 (on CUDA under a half precision), and whether ``chunked`` takes its fused pass there. The
    default, ``plain``, is what a plan that does not know its run's head counts: the whole logits."""

    impl: str = "plain"
    chunk_rows: int | None = None
    device_type: str = "cpu"
    z_loss: bool = False
    softcap: bool = False
    half_products: bool = False
    fused: bool = False  # chunked's elementwise pass compiled into one kernel (head_loss.fused_by_default)
    asked: str | None = None  # loss.impl as set, where it is not impl (auto): the card says both, once

    @classmethod
    def of(
        cls, loss: HeadLoss, device_type: str, precision: str | None, deterministic: bool | None = None
    ) -> HeadPlan:
        """The head ``loss`` resolves to on a ``device_type`` device under the Lightning ``precision``
        (``HeadLoss.resolve`` with ``precision_dtype``) in a run that asks for ``deterministic`` algorithms
        (None: whether torch has them on now); a CUDA kernel that cannot run there is refused
        (:class:`ConfigError`), as a run refuses it."""
        dtype = precision_dtype(precision)
        try:
            impl = loss.resolve(device_type, dtype=dtype, deterministic=deterministic)
        except RuntimeError as e:
            raise ConfigError(str(e)) from None
        half_products = device_type == "cuda" and dtype != torch.float32
        return cls(
            impl=impl,
            chunk_rows=loss.chunk_rows,
            device_type=device_type,
            z_loss=bool(loss.z_loss),
            softcap=loss.final_softcap is not None,
            half_products=half_products,
            fused=impl == "chunked" and half_products and fused_by_default(device_type, dtype),
            asked=loss.impl if loss.impl != impl else None,
        )

    def rows(self, config: GPTConfig) -> int:
        """Rows of B*T per chunk of ``chunked`` and ``torch``: by default as many as the device's chunk budget
        holds in the chunk's dtype (``head_loss.default_chunk_rows``), twice as many in the fused pass's bf16 /
        fp16 chunk as in an fp32 one."""
        if self.chunk_rows:
            return self.chunk_rows
        products = torch.bfloat16 if self.half_products else None  # bf16 and fp16: 2 bytes a logit alike
        logits = chunk_logits_dtype(products, self.impl == "chunked" and self.fused)
        return default_chunk_rows(config.vocab_size, self.device_type, logits)

    def bytes(self, config: GPTConfig, tokens: int) -> float:
        """Bytes the head holds at its peak for a micro-batch of ``tokens`` rows (see the module doc)."""
        V, h = config.vocab_size, config.n_embd
        if self.impl == "plain":
            # log-probabilities, their gradient from the loss, the logits' gradient: (N, V) fp32 each; the
            # z-loss's logsumexp keeps its input and its backward makes one more, the softcap keeps its tanh
            return tokens * 4 * V * (3 + 2 * self.z_loss + self.softcap)
        if self.impl in ("chunked", "torch"):
            rows = min(self.rows(config), tokens)
            # the fp32 gradients of the hidden states and of the weight, accumulated in the forward pass
            gradients = tokens * h * 4 + V * h * 4
            if self.fused:
                # one (rows, V) chunk in the product dtype, the logits then their gradient written over them
                # (row statistics in fp32: a few floats a row; the softcap needs no second buffer), the weight
                # in that dtype, and the weight's product per chunk before it is added in fp32, with an fp32
                # copy of it on a CPU (its elementwise cast; on CUDA cast in the kernel, counted anyway)
                return rows * V * 2 + gradients + V * h * (2 + 2 + 4)
            buffers = 2 if self.softcap else 1  # the softcap's gradient keeps tanh beside the chunk
            # the fp32 chunk (two with the softcap)
            held = buffers * rows * V * 4 + gradients
            if self.impl == "torch":
                # torch's holds the chunk's (rows, h) gradient beside it, and at the end of its backward two
                # copies of each gradient (measured with the CPU allocator's record: tests/test_model_card.py)
                held = max(held + rows * h * 4, 2 * gradients)
            if self.half_products:
                # the chunk's gradient and the weight in the product dtype, and the weight's product before
                # its fp32 copy is added (torch's in bf16: not measured, counted as chunked's)
                held += rows * V * 2 + V * h * 2 + V * h * (2 + 4)
            return held
        return KERNEL_HEAD_BYTES

    def describe(self, config: GPTConfig) -> str:
        """What the card counted, e.g. ``loss.impl=chunked, 160 rows per chunk``, or where ``loss.impl=auto``
        chose, what it took: ``loss.impl=auto: chunked, 160 rows per chunk``."""
        impl = f"loss.impl={self.asked}: {self.impl}" if self.asked else f"loss.impl={self.impl}"
        if self.impl in ("chunked", "torch"):
            fused = ", fused (one compiled kernel a chunk)" if self.fused else ""
            return f"{impl}, {self.rows(config):,} rows per chunk{fused}"
        if self.impl == "plain":
            return f"{impl}, the whole logits"
        return f"{impl}, no logits kept"


@dataclass(frozen=True)
class TrainingPlan:
    """How a model is to be trained, as far as its memory goes: the `strategy=` choice (a name, a strategy
    config node or a `StrategyChoice`), ``n_devices`` data-parallel devices, the Lightning ``precision``,
    ``micro_batch`` sequences of ``context`` tokens per device (None: the model's block size), whether
    activations are recomputed in the backward pass, and the output layer and loss the run computes
    (``head``; by default ``plain``, the whole logits)."""

    strategy: str | dict[str, Any] | StrategyChoice | None = "auto"
    n_devices: int = 1
    precision: str = "32-true"
    micro_batch: int = 1
    context: int | None = None
    activation_checkpointing: bool = False
    head: HeadPlan = HeadPlan()


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
    buffers: float  # DDP's gradient buckets; FSDP/ZeRO-3's gathered blocks and root unit (gathered_root)
    host: float  # state offloaded to host (CPU) memory, per device
    head: float = 0.0  # what the output layer and loss hold at the backward pass's start (HeadPlan)
    # of buffers: the root unit's whole weights and unsharded gradients (FSDP/ZeRO-3; see memory_per_device)
    gathered_root: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.head + self.buffers

    def describe(self) -> str:
        host = f", plus {self.host / GiB:,.1f} GiB of host memory" if self.host else ""
        return f"about {self.total / GiB:,.1f} GiB per device{host}"

    def fits(self, device_memory: float) -> bool:
        return self.total <= FIT_FRACTION * device_memory


def activation_bytes_per_token(
    config: GPTConfig, bytes_per_value: int, activation_checkpointing: bool = False
) -> float:
    """Bytes of activations kept for the backward pass per token of a micro-batch, the output layer and loss
    aside (``HeadPlan.bytes``; see the module doc)."""
    h, p, L = config.n_embd, bytes_per_value, config.n_layer
    moe = moe_options(config)
    # the widths a token's hidden activations take: the MLP's, or its top_k experts' and the shared MLP's
    f = (
        mlp_hidden_width(config)
        if moe is None
        else expert_hidden_width(config, moe) * (moe.top_k + moe.shared_experts)
    )
    kv = config.kv_heads * config.head_dim
    hidden = 4 * f if config.gated else 2 * f
    per_layer = p * (2 * h + h + (h + 2 * kv) + h + h + hidden)
    if moe is not None:
        # each of a token's top_k assignments: its gathered input, its expert's output and the weighted output;
        # and the router's fp32 logits and probabilities
        per_layer += p * 3 * moe.top_k * h + 2 * 4 * moe.experts
    if config.dropout > 0:
        per_layer += 2 * h  # a 1-byte mask after attention and after the MLP
    if config.attention.qk_norm != "none":
        per_layer += p * 2 * (h + kv)  # q and k before and after their norms (no longer views of one QKV)
    if config.attention.gate != "none":
        per_layer += p * (h + gate_width(config))  # the heads' outputs before the gate, and the gates
    if config.attention.value_residual != "none":
        per_layer += p * kv  # the mixed values (no longer a view of the QKV projection)
    if config.attention.differential:
        # the halves of q and k as the two kernels take them (h + kv), the second attention's output (h) and the
        # two outputs' difference, the head norm's input (h)
        per_layer += p * (3 * h + kv)
    if config.norm_placement == "sandwich":
        per_layer += p * 2 * h  # the inputs of the norms on the sublayers' outputs
    outside = 2 * p * h  # the embedding output and the final norm's input
    if config.norm.name == "rmsnorm":
        # torch's F.rms_norm, where it is not one fused kernel (a CPU), keeps the normalised input beside the
        # input: one (N, h) more per norm
        per_layer += p * h * (4 if config.norm_placement == "sandwich" else 2)
        outside += p * h
    # multi-token prediction: each extra head's layer and its final norm's input; the sequential modules also
    # keep the two normed inputs and their concatenation. Under activation checkpointing a head's layer is
    # checkpointed as the trunk's are (parallel.transforms.model_blocks): it keeps its input alone, which a
    # parallel head shares with the trunk's last layer (counted among the L inputs) and a sequential module
    # makes with its projection, and is recomputed in its backward like any layer (the one layer's
    # activations counted below).
    sequential = config.mtp.style == "sequential"
    extra = 4 * p * h if sequential else 0
    if activation_checkpointing:
        mtp = config.mtp.depth * (p * h + extra + (p * h if sequential else 0))
        return L * p * h + per_layer + outside + mtp
    mtp = config.mtp.depth * (per_layer + p * h + extra)
    return L * per_layer + outside + mtp


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
    counts = parameter_counts(config)
    n = counts["total"] + counts["padding"]  # the padding rows are stored, with gradients and optimizer state
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
    buffers = gathered_root = 0.0
    if placement.gradient_buckets and n_devices > 1:
        buffers = n * size["gradients"]
    if placement.shards_weights and shards > 1:
        # Gathered in 16 bits under bf16-mixed (FSDP's mixed-precision policy; DeepSpeed's 16-bit weights), else
        # in the weights' own dtype.
        gathered = 2 if precision == "bf16-mixed" else size["weights"]
        per_layer = counts["per_layer"]
        # Two blocks gathered at a time (the current one and the prefetched next), weights and gradients.
        blocks = 2 * per_layer * 2 * gathered
        # The root unit: what no block holds (the embeddings, the final norm, an untied output layer, the
        # sequential heads' projections, the padding rows); at GPT-2's width and vocabulary, five blocks' worth.
        # Its weights are gathered whole for the whole forward pass (the output layer and loss among it) and
        # again for the whole backward pass, and its gradients are whole until its reduce-scatter at the
        # backward pass's end: two copies of the root unit (scripts/fsdp_memory.py measures the peak on two CPU
        # processes; tests/test_model_card.py).
        root = n - (config.n_layer + config.mtp.depth) * per_layer
        gathered_root = 2 * root * gathered
        buffers = blocks + gathered_root
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
        gathered_root=gathered_root,
        host=host,
        # the output layer and loss once for the next token and once for each head of multi-token prediction,
        # each call's kept until the backward pass
        head=plan.head.bytes(config, micro_batch * T) * (1 + config.mtp.depth),
    )


def cpu_peak_bytes(work: Callable[[], object]) -> int:
    """The most bytes torch's CPU allocator held at once while ``work()`` ran, above what it held before: the
    profiler's record of every allocation and free, replayed in order. What the estimates above are measured
    against on a CPU (scripts/fsdp_memory.py, the tests of the output layer's memory)."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        work()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak


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
    ram = host_memory_bytes()
    return ram, f"CPU, {ram / GiB:.0f} GiB of RAM"


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


# Whether the run as configured fits the device it will train on.


class OverMemoryError(ConfigError):
    """A run whose estimated memory exceeds what its device has, refused before it starts."""


@dataclass(frozen=True)
class DeviceMemory:
    """What one training process may use: ``bytes`` of ``kind`` ("cuda" or "cpu"), described for a message."""

    kind: str
    bytes: float
    description: str


def training_plan(settings: GPTRunConfig) -> tuple[TrainingPlan, int]:
    """The run's plan as the planner takes it, with the output layer and loss its ``loss`` node resolves to
    on its device, and its processes on this machine."""
    from gptlab.parallel.hardware import devices_per_node
    from gptlab.preflight import training_device_type

    trainer = settings.trainer
    try:
        local = max(1, devices_per_node(trainer))
    except (TypeError, ValueError):  # a malformed trainer.devices: Lightning names it
        local = 1
    nodes = trainer.get("num_nodes") or 1
    precision = str(trainer.get("precision"))
    precision = precision if precision in BYTES else "32-true"  # a plugin's own name: fp32, the safe side
    plan = TrainingPlan(
        strategy=settings.strategy,
        n_devices=local * (int(nodes) if isinstance(nodes, int) else 1),
        precision=precision,
        micro_batch=settings.loader.batch_size,
        context=settings.block_size,
        activation_checkpointing=settings.parallel.activation_checkpointing,
        head=HeadPlan.of(
            settings.loss,
            training_device_type(trainer),
            precision,
            deterministic=bool(trainer.get("deterministic")),  # true or warn: auto passes cce by in either
        ),
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
            _gib(needed, 1),
            100 * FIT_FRACTION,
            _gib(device.bytes, 1),
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
        f"weights {_gib(estimate.weights, 1)}, gradients {_gib(estimate.gradients, 1)}, AdamW "
        f"{_gib(estimate.optimizer, 1)}, activations {_gib(estimate.activations, 1)}, output layer and loss "
        f"{_gib(estimate.head, 1)} ({plan.head.describe(model)})"
    )
    if estimate.buffers:
        parts += f", buffers {_gib(estimate.buffers, 1)}"
    if estimate.host:
        parts += f"; offloaded to the host {_gib(estimate.host, 1)}"
    checkpointing = ", activation checkpointing" if plan.activation_checkpointing else ""
    head = (
        f"This run needs about {_gib(estimate.total + (estimate.host if device.kind == 'cpu' else 0), 1)} per "
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
            + "; or ".join(f"{overrides} ({_gib(e.total, 1)} per device)" for overrides, e in options)
            + "."
        )
    else:
        fix = (
            "Nothing fits on this device, whatever the micro-batch, strategy or activation checkpointing: use "
            "more or larger devices, or a smaller model or context (the memory under every strategy: python "
            "scripts/model_card.py with the same overrides)."
        )
    return f"{head} {fix} If the estimate is wrong for this run, allow_over_memory=true starts it anyway."


# The model card.


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
    lines.append(_memory_line(c, est, plan, T, device_name))
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
        f"Model: {c.n_layer} layer{'s' * (c.n_layer != 1)} x {c.n_head} head{'s' * (c.n_head != 1)}{gqa} x "
        f"{c.n_embd} wide, {_mlp_words(c)}, "
        f"context {c.block_size}, vocabulary {c.vocab_size}; pos={c.pos.name}, activation={c.activation.name}, "
        f"norm={c.norm.name} ({c.norm_placement}), bias {'on' if c.bias else 'off'}, head "
        f"{'tied to' if c.tie_weights else 'separate from'} the token embedding"
        + ("" if c.attention.is_default else f"; attention: {c.attention.describe()}"),
        f"Parameters: total {counts['total']:,} ({human(counts['total'])}), embedding {counts['embedding']:,}, "
        f"non-embedding {counts['non_embedding']:,}"
        + (
            f", active per token {counts['active']:,} ({human(counts['active'])}: the MoE layers' top_k "
            "experts)"
            if counts["active"] != counts["total"]
            else ""
        )
        + (
            f"; of these, {counts['mtp']:,} in the {c.mtp.depth} extra head(s) of multi-token prediction "
            f"(mtp.style={c.mtp.style}), trained and never used in inference"
            if counts.get("mtp")
            else ""
        )
        + (
            f"; and {counts['padding']:,} of padding, zero and never trained (the vocabulary stored as "
            f"{c.padded_vocab_size} rows: model.vocab_multiple={c.vocab_multiple})"
            if counts.get("padding")
            else ""
        ),
        f"Training FLOPs per token at context {T}: {human(flops['training'])} (6N + 12 L h T: dense "
        f"{human(flops['dense'])}, attention {human(flops['attention'])}"
        + (f", multi-token prediction's heads {human(flops['mtp'])}" if flops.get("mtp") else "")
        + ")",
    ]


def _mlp_words(c: GPTConfig) -> str:
    """The feed-forward layer in words: the MLP's width, or the Mixture of Experts' shape."""
    moe = moe_options(c)
    if moe is None:
        return f"MLP {mlp_hidden_width(c)} wide"
    shared = f" + {moe.shared_experts} shared" if moe.shared_experts else ""
    return (
        f"MoE {moe.experts} experts x {expert_hidden_width(c, moe)} wide{shared}, top-{moe.top_k} "
        f"({'renormalised' if moe.renormalize else 'router'} weights)"
    )


def _memory_line(c: GPTConfig, est: MemoryEstimate, plan: TrainingPlan, T: int, device_name: str) -> str:
    """The one-line memory breakdown per device of the chosen strategy."""
    checkpointing = ", activation checkpointing" if plan.activation_checkpointing else ""
    return (
        f"Memory per device ({est.strategy}, {plan.n_devices} device(s), {plan.precision}, micro-batch "
        f"{plan.micro_batch} x "
        f"{T}{checkpointing}): {_gib(est.total)} = weights {_gib(est.weights)} + gradients {_gib(est.gradients)} + AdamW "
        f"{_gib(est.optimizer)} + activations {_gib(est.activations)} + output layer and loss {_gib(est.head)} "
        f"({plan.head.describe(c)})"
        + (f" + buffers {_gib(est.buffers)}" if est.buffers else "")
        + (f"; on the host {_gib(est.host)}" if est.host else "")
        + (f"; device: {device_name}" if device_name else "")
    )


def _strategy_table(c: GPTConfig, plan: TrainingPlan, T: int, device_memory: float | None) -> list[str]:
    """The memory table of every distinct strategy (title, header, one row each, a blank line)."""
    lines = [
        f"Memory per device over {plan.n_devices} device(s), {plan.precision}, micro-batch {plan.micro_batch} x {T}"
        + (", activation checkpointing" if plan.activation_checkpointing else "")
        + f"; head: {plan.head.describe(c)} (GiB):",
        f"{'strategy':<26} {'weights':>10} {'grads':>10} {'AdamW':>10} {'activ.':>10} {'head':>10} {'buffers':>10} "
        f"{'total':>10}",
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
        f"{e.activations / GiB:>10,.2f} {e.head / GiB:>10,.2f} {e.buffers / GiB:>10,.2f} {e.total / GiB:>10,.2f}{fit}"
    )


def startup_card(
    config: GPTConfig, plan: TrainingPlan, on_cpu: bool = True, loss: HeadLoss | None = None
) -> str:
    """The short card for the start of a training run, sized against the memory of the device it runs on."""
    memory, device = device_memory_bytes("cpu" if on_cpu else "cuda")
    if plan.precision not in BYTES:  # a precision plugin's own name: count it as fp32, the safe side
        plan = replace(plan, precision="32-true")
    return model_card(config, plan, memory, device, short=True, loss=loss)


def _gib(n: float, decimals: int = 2) -> str:
    """``n`` bytes in GiB with ``decimals`` decimals (the card 2, a refusal 1), or in MiB with one fewer below
    ten units of the last decimal, so that every figure keeps two significant digits (AdamW's 12.4 MiB, not
    "0.01 GiB")."""
    if n >= 10 ** (1 - decimals) * GiB:
        return f"{n / GiB:,.{decimals}f} GiB"
    return f"{n / 2**20:,.{decimals - 1}f} MiB"
