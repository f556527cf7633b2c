"""The LightningModule: the training step, validation loss and perplexity, the optimizer and its schedule.

It receives only its own parts (the model's config, the optimizer's config), never the global config.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import Tensor

from gptlab.data import tokenizers
from gptlab.errors import ConfigError
from gptlab.lit.checkpointing import check_finite_loss, collect_rng_states, restore_rng_states
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT

OPTIM_DEFAULTS: dict[str, Any] = {
    "lr": 3e-4,
    "weight_decay": 0.1,
    "betas": (0.9, 0.95),
    "eps": 1e-8,
    "warmup_steps": 100,
    "min_lr_ratio": 0.1,  # the cosine schedule ends at min_lr_ratio * lr
}


def check_optim(optim: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(optim) - set(OPTIM_DEFAULTS))
    if unknown:
        raise ConfigError(f"Unknown optim option(s) {unknown}. Known: {sorted(OPTIM_DEFAULTS)}.")
    merged = {**OPTIM_DEFAULTS, **optim}
    for key in ("lr", "weight_decay", "eps", "warmup_steps", "min_lr_ratio"):
        value = merged[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(
                f"optim.{key}={value!r} must be a number (e.g. optim.{key}={OPTIM_DEFAULTS[key]})."
            )
    if not merged["lr"] > 0:
        raise ConfigError(f"optim.lr={merged['lr']} must be positive (e.g. optim.lr=3e-4).")
    if merged["warmup_steps"] < 0:
        raise ConfigError(f"optim.warmup_steps={merged['warmup_steps']} must be >= 0.")
    if not 0 <= merged["min_lr_ratio"] <= 1:
        raise ConfigError(f"optim.min_lr_ratio={merged['min_lr_ratio']} must be in [0, 1].")
    merged["betas"] = tuple(merged["betas"])
    return merged


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup from lr/warmup_steps to lr, then cosine decay to min_lr_ratio * lr at max_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if max_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class GPTLitModule(L.LightningModule):
    def __init__(self, model: dict[str, Any], optim: dict[str, Any] | None = None) -> None:
        super().__init__()
        # Plain dicts only, so a checkpoint rebuilds the module without this project's config system.
        self.save_hyperparameters(logger=False)
        self.model_config = GPTConfig.from_dict(dict(model))
        self.optim = check_optim(dict(optim or {}))
        self.model = GPT(self.model_config)
        self.tokenizer: tokenizers.Tokenizer | None = None  # set by the trainer task; saved in checkpoints
        self.parallel: Any = None  # gptlab.parallel.ParallelOptions, set by the trainer task
        self._val_loss_sum = torch.zeros(())
        self._val_count = torch.zeros(())

    def forward(self, idx: Tensor, targets: Tensor | None = None):
        return self.model(idx, targets)

    def configure_model(self) -> None:
        # Sharding, activation checkpointing and compilation are applied from outside the model, per block.
        from gptlab.parallel import ParallelOptions, parallelize

        parallelize(
            self.model, self.parallel or ParallelOptions(), self.trainer.strategy, self.trainer.precision
        )

    # ---- training -------------------------------------------------------------------------------
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        _, loss = self.model(x, y)
        check_finite_loss(loss, step=self.global_step + 1, strategy=self.trainer.strategy)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        self.log("lr", self.optimizers().param_groups[0]["lr"], on_step=True, on_epoch=False)
        return loss

    # ---- validation -----------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self._val_count = torch.zeros((), device=self.device, dtype=torch.float64)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        _, loss = self.model(x, y)
        n = y.numel()
        self._val_loss_sum += loss.detach().double() * n
        self._val_count += n
        return loss

    def on_validation_epoch_end(self) -> None:
        # Mean over every validation token on every rank, so the figure does not depend on the batching.
        total = self.trainer.strategy.reduce(self._val_loss_sum, reduce_op="sum")
        count = self.trainer.strategy.reduce(self._val_count, reduce_op="sum")
        val_loss = (total / count.clamp_min(1)).float()
        self.log("val/loss", val_loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(val_loss), sync_dist=False)

    # ---- optimizer ------------------------------------------------------------------------------
    def configure_optimizers(self):
        # Weight decay on matrices (linear weights, embeddings); none on biases and norm gains.
        decay, no_decay = [], []
        for _, p in self.model.named_parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        o = self.optim
        groups = [
            {"params": decay, "weight_decay": o["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=o["lr"], betas=o["betas"], eps=o["eps"])
        max_steps = self.trainer.max_steps
        if max_steps is None or max_steps <= 0:
            raise ConfigError(
                f"trainer.max_steps={max_steps}: training is counted in optimizer steps; set trainer.max_steps "
                "to a positive number (the learning-rate schedule ends there)."
            )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, o["warmup_steps"], max_steps, o["min_lr_ratio"])
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- checkpoints ----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.tokenizer is not None:
            checkpoint["tokenizer"] = self.tokenizer.spec()
        checkpoint["rng_states"] = collect_rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "tokenizer" in checkpoint:
            self.tokenizer = tokenizers.from_spec(checkpoint["tokenizer"])
        if "rng_states" in checkpoint:
            restore_rng_states(checkpoint["rng_states"])
