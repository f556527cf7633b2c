"""``checkpoints/last.ckpt``, rewritten every N optimizer steps, when training ends, and on a stop signal;
the best checkpoint by validation loss beside it, one file with last.ckpt where both hold the same step."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from gptlab.errors import ConfigError
from gptlab.parallel.checkpoint_io import link_checkpoint
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
        # A best checkpoint saved at this step (the validation just before training ended) becomes a second
        # name of this file: one file on disk, not two copies of the same step.
        if trainer.is_global_zero:
            for best in best_checkpoints(trainer):
                if best.saved_step == trainer.global_step and best.saved_path and best.saved_path.is_file():
                    link_checkpoint(self.saved_path, best.saved_path)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save_now(trainer)

    def save_now(self, trainer: L.Trainer) -> None:
        """Write last.ckpt for the current step unless it already holds it."""
        if self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (``callbacks.model_checkpoint``: the best by val/loss), except that a best
    saved at the step ``last.ckpt`` holds is a hard link to last.ckpt, not a second copy of the same step:
    a 5-step run keeps one file, where it kept two of 192 MB each with model=small. A later save of
    last.ckpt writes a new file and renames it into place, so the best keeps its bytes (and its digest).
    Where hard links fail (or a checkpoint is a sharded directory) the best is written in full, as before."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The newest best written by this process and its step: last.ckpt, saved at that step, links to it.
        self.saved_path: Path | None = None
        self.saved_step: int | None = None

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        last = next(
            (cb for cb in trainer.checkpoint_callbacks if isinstance(cb, PeriodicLastCheckpoint)),
            None,
        )
        linked = False
        if last is not None and last.saved_step == trainer.global_step and last.saved_path is not None:
            # Every rank takes the same branch: the full save below is collective for some strategies.
            made = link_checkpoint(last.saved_path, Path(filepath)) if trainer.is_global_zero else False
            linked = bool(trainer.strategy.broadcast(made, src=0))
        if not linked:
            super()._save_checkpoint(trainer, filepath)
        else:  # Lightning's bookkeeping of a save
            self._last_global_step_saved = trainer.global_step
            self._last_checkpoint_saved = filepath
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.after_save_checkpoint(proxy(self))
        self.saved_path, self.saved_step = Path(filepath), trainer.global_step


def best_checkpoints(trainer: L.Trainer) -> list[BestCheckpoint]:
    return [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, BestCheckpoint)]
