"""Applied to the built model inside each rank, from outside the model code: activation checkpointing,
`torch.compile` and FSDP2 sharding of every transformer block, multi-token prediction's extra heads' blocks
among them (`model_blocks`)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from gptlab.registry import build_options

if TYPE_CHECKING:
    from gptlab.model.gpt import GPT

#: torch.compile's backend for each block (``compile=true``). Tests count the blocks' compiles with a backend
#: of their own, as scripts/flex_recompiles.py counts FlexAttention's.
BLOCK_BACKEND: Any = "inductor"


#: What ``compile=auto`` takes on each kind of device the run trains on. CUDA: on. GPT-2 small at 32 x 1024 in
#: bf16 took 98.0 ms a step compiled against 106.4 eager on an H200 (8% faster) and 101.8 against 113.3 on an
#: H100, for about 8 s of compilation at the first step (scripts/gpu_check.py; docs/performance.md, "Measured on
#: an H200"). CPU: off. The default model's steady step showed no reliable gain (median of paired steps 0.97x:
#: the output layer, not compiled, is most of a CPU step), for 20-45 s of compilation per process on an idle
#: machine (docs/performance.md, "Speed per step"). Any other device (mps, ...): not measured, off.
COMPILE_AUTO: dict[str, bool] = {"cuda": True, "cpu": False}
#: Why ``compile=auto`` chose as it did, per device type (the run's header says it).
COMPILE_AUTO_WHY = {"cuda": "CUDA", "cpu": "CPU, where it measured no gain"}


@dataclass(frozen=True)
class CompileChoice:
    """Whether the blocks are compiled in a run, and why: ``setting`` is ``compile`` as given (true, false or
    ``auto``), ``device_type`` the kind of device the run trains on ("cuda", "cpu", ...; None where it is not
    known, which only an explicit true or false decides)."""

    setting: bool | str
    device_type: str | None

    def __post_init__(self) -> None:
        if self.setting == "auto" and self.device_type is None:  # it would be a guess
            raise ValueError(
                "compile=auto must be resolved for the run's device first: ParallelOptions.resolved"
            )

    @property
    def on(self) -> bool:
        if self.setting == "auto":
            return COMPILE_AUTO.get(str(self.device_type), False)
        return bool(self.setting)

    def describe(self) -> str:
        """``on (auto: CUDA)``, ``off (auto: CPU, where it measured no gain)``, ``on (compile=true)``."""
        state = "on" if self.on else "off"
        if self.setting != "auto":
            return f"{state} (compile={str(self.setting).lower()})"
        why = COMPILE_AUTO_WHY.get(str(self.device_type), f"{self.device_type}, not measured there")
        return f"{state} (auto: {why})"


@dataclass
class ParallelOptions:
    """Options applied to the built model in `configure_model`: per-block `torch.compile` and activation
    checkpointing (recompute each block's activations in the backward pass instead of storing them; Chen et
    al. 2016, "Training Deep Nets with Sublinear Memory Cost", https://arxiv.org/abs/1604.06174).
    ``compile``: true, false, or ``auto`` (the default, as in train.yaml: on where the run trains on CUDA,
    ``COMPILE_AUTO``). Whether the blocks are compiled is one decision, :attr:`compile_choice`, made from the
    setting and the device the run trains on (:meth:`resolved`, when a run's config is read, or by the module
    for its device when built in Python): the run's header says it, result.json records it and `parallelize`
    applies it (:attr:`compiled`)."""

    compile: bool | Literal["auto"] = "auto"
    activation_checkpointing: bool = False
    # The kind of device the run trains on ("cuda", "cpu", ...), which compile=auto depends on; set by
    # resolved(), never an option (init=False: no config key sets it).
    device_type: str | None = field(default=None, init=False)

    @classmethod
    def from_config(cls, values: dict[str, Any] | None) -> ParallelOptions:
        values = dict(values or {})
        return build_options(cls, values, "The run (train.yaml's top level)", "")

    def resolved(self, device_type: str) -> ParallelOptions:
        """These options for a run that trains on a ``device_type`` device."""
        options = copy.copy(self)
        options.device_type = device_type
        return options

    @property
    def compile_choice(self) -> CompileChoice:
        """Whether the blocks are compiled, and why (a ValueError for ``auto`` not yet :meth:`resolved`)."""
        return CompileChoice(self.compile, self.device_type)

    @property
    def compiled(self) -> bool:
        """Whether the blocks are compiled: :attr:`compile_choice`, the one place it is decided."""
        return self.compile_choice.on


def model_blocks(model: GPT) -> list[nn.Module]:
    """Every transformer block of ``model``: the trunk's (``model.transformer.h``), then those of multi-token
    prediction's extra heads (``model.mtp.blocks``, mtp.depth > 0). Each is a `Block` of the model's last
    layer's kind, as large as a trunk block and run once per training step like one, so each is checkpointed,
    compiled and sharded as one: left out, a head's block kept its activations under activation
    checkpointing, ran eagerly under compile and was gathered with the root unit under FSDP."""
    blocks: list[nn.Module] = list(model.transformer.h)
    if model.mtp is not None:
        blocks += list(model.mtp.blocks)
    return blocks


def parallelize(model: GPT, options: ParallelOptions, strategy: Any = None, precision: Any = None) -> None:
    """Apply, in place and in this order, activation checkpointing, `torch.compile` and FSDP2 sharding to
    every transformer block of ``model`` (`model_blocks`: the trunk's and the extra heads'), then shard the
    rest of the model. Parameter names stay those of the plain model, so checkpoints load into an unwrapped
    GPT."""
    if getattr(model, "_gptlab_parallelized", False):  # configure_model runs again for validate/test
        return
    compiled = options.compiled  # compile=auto not resolved for the run's device is refused here
    blocks = model_blocks(model)
    if options.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in blocks:
            checkpoint(block, use_reentrant=False)
    if compiled:
        for block in blocks:
            block.compile(backend=BLOCK_BACKEND)
    if strategy is not None and not isinstance(strategy, str):
        from gptlab.parallel.checkpoint_io import FullyShardedStrategy

        if isinstance(strategy, FullyShardedStrategy):
            shard(model, strategy, precision)
    model._gptlab_parallelized = True  # type: ignore[assignment]  # nn.Module.__setattr__ is typed for tensors and modules only


@contextmanager
def uncompiled_blocks(model: GPT) -> Iterator[None]:
    """Run the blocks compiled by `parallelize` (``compile=true``) through their plain forward inside the
    block, and compiled again after it, also when it raises. For the evaluations outside the training step
    (the length and passkey studies after training, sample generation, the downstream tasks): they run many
    shapes of their own (other lengths, a KV cache, one-token decoding steps), each a new compile of every
    block, and torch's recompile limit (8 per function) is reached within the passkey study's first length,
    after which torch runs the blocks uncompiled anyway. FlexAttention keeps its own compiled kernel
    (`gptlab.model.attention.compiled_flex_attention`, compiled apart from the blocks), which the long lengths
    need; ``torch.compiler.set_stance("force_eager")`` would turn that eager too."""
    # nn.Module.compile keeps torch.compile(module._call_impl) in _compiled_call_impl, which __call__ runs
    # instead of _call_impl while it is set (torch 2.11 to 2.13); unset, the call is the plain module's.
    compiled = [
        (block, block._compiled_call_impl)
        for block in model_blocks(model)
        if block._compiled_call_impl is not None
    ]
    for block, _ in compiled:
        block._compiled_call_impl = None
    try:
        yield
    finally:
        for block, call in compiled:
            block._compiled_call_impl = call


def shard(model: GPT, strategy: Any, precision: Any = None) -> None:
    """FSDP2 over the data-parallel ranks of ``strategy`` (a `FullyShardedStrategy`): each block (`model_blocks`,
    the extra heads' too) is one unit; the root unit holds the embedding, the final norm and the (tied) head,
    and the sequential heads' norms and projections."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = strategy.device_mesh["data_parallel"]
    if strategy.hybrid:
        # Replicate across nodes, shard within a node: (num_nodes, devices per node).
        mesh = init_device_mesh(
            strategy.root_device.type,
            (strategy.num_nodes, strategy.num_processes),
            mesh_dim_names=("replicate", "shard"),
        )
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy() if strategy.cpu_offload else OffloadPolicy(),
    }
    if str(precision).startswith("bf16"):
        # Gather and compute in bf16, reduce gradients in fp32 (the master weights stay fp32).
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model_blocks(model):
        fully_shard(block, reshard_after_forward=strategy.reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=strategy.reshard_after_forward, **kwargs)
