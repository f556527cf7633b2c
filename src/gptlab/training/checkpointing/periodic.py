"""``checkpoints/last.ckpt``, rewritten every N optimizer steps, when training ends, and on a stop signal."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from gptlab.errors import ConfigError
from gptlab.training.checkpointing.guard import state_is_finite

log = logging.getLogger(__name__)


class PeriodicLastCheckpoint(ModelCheckpoint):
    """``<dirpath>/last.ckpt``, rewritten every ``every_n_train_steps`` optimizer steps and when training
    ends, so a SIGKILL loses at most that many steps. It is always the same file (or, for a sharded
    strategy, directory; no ``last-v1.ckpt``), and a state holding a NaN or infinite parameter on any rank
    is never written over it."""

    def __init__(self, dirpath: str, every_n_train_steps: int = 50) -> None:
        if not isinstance(every_n_train_steps, int) or every_n_train_steps <= 0:
            raise ConfigError(
                f"callbacks.last_checkpoint.every_n_train_steps={every_n_train_steps!r} must be a positive "
                "integer (e.g. 50): it bounds the steps a killed run loses."
            )
        super().__init__(
            dirpath=dirpath,
            save_top_k=0,
            save_last=True,
            every_n_train_steps=every_n_train_steps,
            save_on_train_epoch_end=False,
            enable_version_counter=False,
        )
        # The newest checkpoint written whole (or resumed from) and its step: what resume=auto continues from.
        self.saved_path: Path | None = None
        self.saved_step: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.ckpt_path:
            self.saved_path, self.saved_step = Path(trainer.ckpt_path), trainer.global_step

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, Any]) -> None:
        # Every rank takes the same decision: the save that follows is collective for sharded strategies.
        if not state_is_finite(trainer.lightning_module, trainer.strategy):
            log.warning(
                "Step %d: the model holds NaN or infinite parameters; last.ckpt keeps the last finite state.",
                trainer.global_step,
            )
            return
        # The loggers' buffered rows first (the CSV logger writes every 100 steps): a run killed after this
        # save has every row up to the checkpoint's step on disk, and a resumed run drops the rows after it.
        for logger in trainer.loggers:
            logger.save()
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self.saved_path, self.saved_step = Path(self.last_model_path), trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save_now(trainer)

    def save_now(self, trainer: L.Trainer) -> None:
        """Write last.ckpt for the current step unless it already holds it."""
        if self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
