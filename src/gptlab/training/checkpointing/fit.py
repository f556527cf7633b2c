"""The callbacks every training run carries for surviving kills, and ``fit`` around them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from gptlab.tracking.loggers import WandbRunIdInCheckpoint
from gptlab.training.checkpointing.periodic import PeriodicLastCheckpoint
from gptlab.training.checkpointing.signals import StopOnSignal


@dataclass(frozen=True)
class SignalStop:
    """How a stop signal ended training early: which signal (``Ctrl-C``, ``SIGTERM``...), whether a second
    Ctrl-C quit at once (the step in progress unsaved), and the checkpoint a resumed run continues from."""

    signal: str
    quit_at_once: bool
    checkpoint: Path | None
    checkpoint_step: int | None


def fault_tolerance_callbacks() -> list[L.Callback]:
    return [StopOnSignal(), WandbRunIdInCheckpoint()]


def fit(
    trainer: L.Trainer, module: L.LightningModule, datamodule: Any, ckpt_path: Any | None
) -> SignalStop | None:
    """``trainer.fit``, continuing from ``ckpt_path`` when given. Returns how a stop signal ended training
    early (its checkpoint written, or, after a second Ctrl-C, the last one written before), None when it ran to
    ``max_steps``."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    stoppers = [cb for cb in trainer.callbacks if isinstance(cb, StopOnSignal)]  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None)
    except SIGTERMException:
        pass
    except SystemExit:
        # Lightning ends the process (status 1) after a KeyboardInterrupt; a second Ctrl-C is ours to report.
        if not any(cb.quit_at_once for cb in stoppers):
            raise
    finally:
        for cb in stoppers:
            cb.restore_handlers()
    stopper = next((cb for cb in stoppers if cb.stopped or cb.quit_at_once), None)
    if stopper is None:
        return None
    last = next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, PeriodicLastCheckpoint)), None)
    return SignalStop(
        signal=stopper.signal_name,
        quit_at_once=stopper.quit_at_once,
        checkpoint=last.saved_path if last is not None else None,
        checkpoint_step=last.saved_step if last is not None else None,
    )
