"""Applied to the built model inside each rank, from outside the model code: activation checkpointing,
`torch.compile` and FSDP2 sharding of every transformer block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gptlab.registry import build_options

if TYPE_CHECKING:
    from gptlab.model.gpt import GPT


@dataclass
class ParallelOptions:
    """Options applied to the built model in `configure_model`: per-block `torch.compile` and activation
    checkpointing (recompute each block's activations in the backward pass instead of storing them; Chen et
    al. 2016, "Training Deep Nets with Sublinear Memory Cost", https://arxiv.org/abs/1604.06174)."""

    compile: bool = False
    activation_checkpointing: bool = False

    @classmethod
    def from_config(cls, values: dict[str, Any] | None) -> ParallelOptions:
        values = dict(values or {})
        return build_options(cls, values, "The run (train.yaml's top level)", "")


def parallelize(model: GPT, options: ParallelOptions, strategy: Any = None, precision: Any = None) -> None:
    """Apply, in place and in this order, activation checkpointing, `torch.compile` and FSDP2 sharding to
    every transformer block of ``model`` (``model.transformer.h``), then shard the rest of the model.
    Parameter names stay those of the plain model, so checkpoints load into an unwrapped GPT."""
    if getattr(model, "_gptlab_parallelized", False):  # configure_model runs again for validate/test
        return
    blocks = list(model.transformer.h)
    if options.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in blocks:
            checkpoint(block, use_reentrant=False)
    if options.compile:
        for block in blocks:
            block.compile()
    if strategy is not None and not isinstance(strategy, str):
        from gptlab.parallel.checkpoint_io import FullyShardedStrategy

        if isinstance(strategy, FullyShardedStrategy):
            shard(model, strategy, precision)
    model._gptlab_parallelized = True  # type: ignore[assignment]  # nn.Module.__setattr__ is typed for tensors and modules only


def shard(model: GPT, strategy: Any, precision: Any = None) -> None:
    """FSDP2 over the data-parallel ranks of ``strategy`` (a `FullyShardedStrategy`): each block is one
    unit; the root unit holds the embedding, the final norm and the (tied) head."""
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
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=strategy.reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=strategy.reshard_after_forward, **kwargs)
