"""The callbacks every training run carries for surviving kills, and ``fit`` around them."""

from __future__ import annotations

from typing import Any

import lightning as L

from gptlab.tracking.loggers import WandbRunIdInCheckpoint
from gptlab.training.checkpointing.signals import StopOnSignal


def fault_tolerance_callbacks() -> list[L.Callback]:
    return [StopOnSignal(), WandbRunIdInCheckpoint()]


def fit(trainer: L.Trainer, module: L.LightningModule, datamodule: Any, ckpt_path: Any | None) -> bool:
    """``trainer.fit``, continuing from ``ckpt_path`` when given. Returns True when a stop signal ended
    training early (its checkpoint written), False when it ran to ``max_steps``."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    stoppers = [cb for cb in trainer.callbacks if isinstance(cb, StopOnSignal)]  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None)
    except SIGTERMException:
        return True
    finally:
        for cb in stoppers:
            cb.restore_handlers()
    return any(cb.stopped for cb in stoppers)
