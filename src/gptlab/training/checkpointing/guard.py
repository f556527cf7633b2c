"""The non-finite guard: a NaN or infinite loss on any rank stops every rank at the same step, before the
update, and a non-finite state never replaces a good checkpoint.

Each rank sees only its own loss (and, under FSDP, only its own shards of the weights), so every decision
here is taken together: the losses are gathered, and the finiteness of the state is reduced over the ranks.
A rank that raised alone would leave the others waiting forever in the next collective.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gptlab.errors import NonFiniteLossError


def gather_losses(loss: torch.Tensor, strategy: Any = None) -> list[float]:
    """Every rank's loss of this step, in rank order (one all-gather of one number per rank)."""
    local = loss.detach().float().reshape(1)
    if strategy is None or getattr(strategy, "world_size", 1) <= 1:
        return local.tolist()
    return strategy.all_gather(local).reshape(-1).tolist()


def check_finite_loss(loss: torch.Tensor, step: int, strategy: Any = None) -> None:
    """Raise NonFiniteLossError, on every rank at once, when the loss of ``step`` is NaN or infinite on any
    rank; the message names the step and the ranks."""
    losses = gather_losses(loss, strategy)
    bad = [(rank, value) for rank, value in enumerate(losses) if not math.isfinite(value)]
    if not bad:
        return
    where = ""
    if len(losses) > 1:
        ranks = ", ".join(str(rank) for rank, _ in bad)
        where = f" on rank{'s' if len(bad) > 1 else ''} {ranks} of {len(losses)}"
    raise NonFiniteLossError(
        f"The training loss is {bad[0][1]} at step {step}{where}: training stopped on every rank before this "
        "step's update, and checkpoints/last.ckpt still holds the last finite state. Lower optim.lr, raise "
        "optim.warmup_steps, or keep gradient clipping on (trainer.gradient_clip_val), then start again or "
        "resume."
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor's local shard under FSDP2; the tensor itself otherwise)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def state_is_finite(module: torch.nn.Module, strategy: Any = None) -> bool:
    """Whether every parameter on every rank is finite: each rank checks what it holds, then all agree."""
    local = all(bool(torch.isfinite(_local(p.detach())).all()) for p in module.parameters())
    if strategy is None or getattr(strategy, "world_size", 1) <= 1:
        return local
    return bool(strategy.reduce_boolean_decision(local, all=True))
