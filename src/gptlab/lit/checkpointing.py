"""Checkpoints that survive kills: atomic writes, a periodic ``last.ckpt``, a clean stop on SIGTERM/SIGUSR1,
and a guard that never lets a non-finite training state replace a good checkpoint."""

from __future__ import annotations

import logging
import os
import random
import signal
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the run stops before the bad state is stepped or saved."""


def check_finite_loss(loss: torch.Tensor, step: int) -> None:
    """Raise NonFiniteLossError naming the optimizer step when ``loss`` is NaN or infinite."""
    if not bool(torch.isfinite(loss.detach()).all()):
        raise NonFiniteLossError(
            f"The training loss is {loss.item()} at step {step}: training stopped before this step's update, and "
            "checkpoints/last.ckpt still holds the last finite state. Lower optim.lr, raise optim.warmup_steps, "
            "or keep gradient clipping on (trainer.gradient_clip_val), then start again or resume."
        )


# ---- atomic writes ---------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (POSIX: the directory entry lives in the directory's inode)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file in the target's folder, fsyncs it, then renames it over the
    target with ``os.replace``: a process killed mid-write leaves the previous checkpoint intact (and at
    worst a stray ``.<name>.tmp-*`` file, which the next save of that name removes)."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r}).")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            stale.unlink(missing_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        fsync_dir(target.parent)


def checkpoint_plugins(strategy: Any) -> list[AtomicCheckpointIO]:
    """``[AtomicCheckpointIO()]`` for strategies that write one file through a CheckpointIO plugin, none
    for those that bring their own checkpoint writer (sharded directories, DeepSpeed)."""
    if isinstance(strategy, str):
        return [AtomicCheckpointIO()] if strategy in ("auto", "ddp", "ddp_spawn", "single_device") else []
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    return [AtomicCheckpointIO()] if isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)) else []


# ---- the periodic last checkpoint ------------------------------------------------------------------


def state_is_finite(module: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p.detach()).all()) for p in module.parameters())


class PeriodicLastCheckpoint(ModelCheckpoint):
    """``<dirpath>/last.ckpt``, rewritten every ``every_n_train_steps`` optimizer steps and when training
    ends, so a SIGKILL loses at most that many steps. It is always the same file (no ``last-v1.ckpt``), and
    a state holding a NaN or infinite parameter is never written over it."""

    def __init__(self, dirpath: str, every_n_train_steps: int = 50) -> None:
        if not isinstance(every_n_train_steps, int) or every_n_train_steps <= 0:
            from gptlab.errors import ConfigError

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

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, Any]) -> None:
        if not state_is_finite(trainer.lightning_module):
            log.warning(
                "Step %d: the model holds NaN or infinite parameters; last.ckpt keeps the last finite state.",
                trainer.global_step,
            )
            return
        super()._save_last_checkpoint(trainer, monitor_candidates)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def save_now(self, trainer: L.Trainer) -> None:
        """Write last.ckpt for the current step unless it already holds it."""
        if self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


# ---- stopping on a signal --------------------------------------------------------------------------


def under_slurm() -> bool:
    return SLURMEnvironment.detect()


class StopOnSignal(L.Callback):
    """SIGTERM (and SIGUSR1, outside SLURM, whose SIGUSR1 belongs to Lightning's requeue handler) ends the
    run cleanly: the step in progress finishes, last.ckpt is written, and training stops with exit status 0.

    The save happens at the end of a training batch, the point where periodic checkpoints are taken, so a
    resumed run continues exactly as one never stopped. A signal that arrives during validation is handled
    when Lightning interrupts the loop (its own SIGTERM exception), with a save at that point."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._saved_at: int | None = None

    def signals(self) -> list[int]:
        return [signal.SIGTERM] + (
            [] if under_slurm() or not hasattr(signal, "SIGUSR1") else [signal.SIGUSR1]
        )

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning installs its SIGTERM handler later (at fit start) and calls the one found here too.
        for signum in self.signals():
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning's own SIGTERM handler (installed at fit start) broadcasts to the other ranks from inside
        # the signal handler: a collective at an arbitrary point, which deadlocks when the signal lands inside
        # another collective. This callback decides at the step boundary instead, so its handler takes over;
        # handlers that were there before Lightning's are still called.
        for signum in self.signals():
            signal.signal(signum, self._handle)

    def restore_handlers(self) -> None:
        """Put back the handlers found at setup. Lightning restores the handlers it found at fit start
        (this callback's among them) in its own teardown, after this callback's: ``fit`` calls this again."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.restore_handlers()

    def _save(self, trainer: L.Trainer) -> None:
        if self._saved_at == trainer.global_step:
            return
        self._saved_at = trainer.global_step
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, PeriodicLastCheckpoint):
                cb.save_now(trainer)
                name = signal.Signals(self.received).name if self.received else "a signal"
                log.info(
                    "Received %s: saved %s at step %d; continue with resume=auto",
                    name,
                    cb.last_model_path,
                    trainer.global_step,
                )
                return
        log.warning("Received a stop signal, but no callbacks.last_checkpoint is configured: nothing saved.")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # Every rank takes the same decision (saving is collective), whichever rank got the signal.
        if trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            self._save(trainer)
            trainer.should_stop = True

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException) and self.received is not None:
            self._save(trainer)


# ---- RNG states --------------------------------------------------------------------------------------


def collect_rng_states() -> dict[str, Any]:
    """Every RNG state training draws from, as tensors and plain Python values (numpy's state object would
    make the checkpoint unreadable with ``torch.load(weights_only=True)``)."""
    version, mt_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(mt_state), gauss],
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    version, mt_state, gauss = states["python"]
    random.setstate((version, tuple(mt_state), gauss))
    n = states["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class RunIdentity(L.Callback):
    """Records the W&B run id in each checkpoint, so a resumed run continues the same W&B run."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        for lg in trainer.loggers:
            if type(lg).__name__ == "WandbLogger" and lg.version:
                checkpoint["wandb_run_id"] = str(lg.version)


def fault_tolerance_callbacks() -> list[L.Callback]:
    return [StopOnSignal(), RunIdentity()]


def fit(trainer: L.Trainer, module: L.LightningModule, datamodule: Any, ckpt_path: Any | None) -> bool:
    """``trainer.fit``, continuing from ``ckpt_path`` when given. Returns True when a stop signal ended
    training early (its checkpoint written), False when it ran to ``max_steps``."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    stoppers = [cb for cb in trainer.callbacks if isinstance(cb, StopOnSignal)]
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt_path) if ckpt_path else None)
    except SIGTERMException:
        return True
    finally:
        for cb in stoppers:
            cb.restore_handlers()
    return any(cb._saved_at is not None for cb in stoppers)
