"""Checkpoints that survive kills: what is saved, when, and how a stop signal ends training.

- **The non-finite guard**: a NaN or infinite loss on any rank stops every rank at the same step, before the
  update, and a non-finite state never replaces a good checkpoint. Each rank sees only its own loss (and,
  under FSDP, only its own shards of the weights), so every decision is taken together: the losses are
  gathered, and the finiteness of the state is reduced over the ranks. A rank that raised alone would leave
  the others waiting forever in the next collective.
- **RNG states**: every RNG state training draws from, saved in each checkpoint so a resumed run draws the
  same numbers as one never stopped (Lightning's checkpoints hold none).
- **The last and the best checkpoint** (their names: :mod:`gptlab.runs.layout`): the last rewritten every N
  optimizer steps, when training ends, and on a stop signal; the best by validation loss beside it, one file
  with the last where both hold the same step, its score recorded in the run's metadata. Files and sharded
  directories are written atomically by the strategies' checkpoint I/O (:mod:`gptlab.parallel.checkpoint_io`).
- **Stop signals**: the handler only sets a flag; at the next step boundary every rank learns whether any
  rank got a signal, and all of them save together and stop.

  - SIGTERM (a kill, a cluster's stop), SIGINT (Ctrl-C) and SIGUSR1 outside SLURM: save the last checkpoint
    at the current step, write the run's result as stopped, and end with status 0; the same command with
    ``resume=auto`` continues.
  - A second Ctrl-C while the first is being handled quits at once: Python's KeyboardInterrupt is raised
    wherever the process is. A checkpoint save it interrupts is abandoned (its temporary file removed; the
    previous last checkpoint is left whole), the steps since the last saved checkpoint are lost, and the
    run's result still says where the run stopped and which checkpoint ``resume=auto`` continues from.
  - SIGUSR1 under SLURM (its warning before preemption or the time limit, `#SBATCH --signal=USR1@<s>`): save
    ``<default_root_dir>/hpc_ckpt_<n>.ckpt``, requeue the job from rank 0 (`scontrol requeue`) and end with
    :class:`~gptlab.errors.RunRequeued` (a SystemExit of status 0, which ``gptlab.train()`` raises to its caller
    naming the checkpoint); the requeued job runs the same command in the same run directory, and Lightning
    resumes from that file.

  Saving from inside a signal handler (Lightning's own way) happens in the middle of a step and in each rank
  at its own moment, a collective at an arbitrary point that deadlocks when the signal lands inside another
  one.
- :func:`fit`: ``trainer.fit`` with the callbacks every run carries (:func:`fault_tolerance_callbacks`).
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from gptlab.errors import ConfigError, NonFiniteLossError, RunRequeued, signal_name
from gptlab.parallel import hardware
from gptlab.parallel.checkpoint_io import AtomicCheckpointIO, link_checkpoint
from gptlab.runs import digests
from gptlab.runs.layout import (
    BEST_FILENAME,
    BEST_PREFIX,
    LAST_CHECKPOINT,
    LAST_CHECKPOINT_PATH,
    BestScores,
    write_best_scores,
)
from gptlab.tracking.loggers import WandbRunIdInCheckpoint

log = logging.getLogger(__name__)


# ---- the non-finite guard ------------------------------------------------------------------------------


def gather_losses(loss: torch.Tensor, strategy: Any = None) -> list[float]:
    """Every rank's loss of this step, in rank order (one all-gather of one number per rank). Through
    torch.distributed's plain all-gather: the loss is detached, and Lightning's ``strategy.all_gather`` goes
    through the autograd-aware collective that torch 2.13 deprecates, a warning on every rank of every run."""
    import torch.distributed as dist

    local = loss.detach().float().reshape(1)
    if strategy is None or getattr(strategy, "world_size", 1) <= 1 or not dist.is_initialized():
        return local.tolist()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return torch.cat(gathered).tolist()


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
        f"step's update, and {LAST_CHECKPOINT_PATH} still holds the last finite state. Lower optim.lr, raise "
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


# ---- RNG states ----------------------------------------------------------------------------------------


def collect_rng_states() -> dict[str, Any]:
    """Every RNG state training draws from, as tensors and plain Python values (numpy's state object would
    make the checkpoint unreadable with ``torch.load(weights_only=True)``)."""
    version, mt_state, gauss = random.getstate()
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # the legacy (default) form
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
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


# ---- the last and the best checkpoint ---------------------------------------------------------------


class PeriodicLastCheckpoint(ModelCheckpoint):
    """The last checkpoint (:func:`gptlab.runs.layout.last_checkpoint`), rewritten every
    ``every_n_train_steps`` optimizer steps and when training ends, so a SIGKILL loses at most that many
    steps (and the steps of a write in flight). It is always the same file (or, for a sharded strategy,
    directory; no ``-v1`` version), and a state holding a NaN or infinite parameter on any rank is never
    written over it.

    With ``background`` (the default), the saves during training, this one's and a new best's
    (:class:`BestCheckpoint`), are written by a thread where the checkpoint is one file written by rank 0
    (:class:`gptlab.parallel.checkpoint_io.AtomicCheckpointIO`): the step waits only for the copy to host
    memory. A save at the end of training, on a stop signal or with a best checkpoint of the same step to
    link is written before the run goes on, as are sharded directories (every rank writes its shards
    together)."""

    # Lightning names it CHECKPOINT_NAME_LAST + FILE_EXTENSION: the name gptlab.runs.layout gives it.
    CHECKPOINT_NAME_LAST = Path(LAST_CHECKPOINT).stem
    FILE_EXTENSION = Path(LAST_CHECKPOINT).suffix

    def __init__(self, dirpath: str, every_n_train_steps: int = 50, background: bool = True) -> None:
        if not isinstance(every_n_train_steps, int) or every_n_train_steps <= 0:
            raise ConfigError(
                f"callbacks.last_checkpoint.every_n_train_steps={every_n_train_steps!r} must be a positive "
                "integer (e.g. 50): it bounds the steps a killed run loses."
            )
        if not isinstance(background, bool):
            raise ConfigError(
                f"callbacks.last_checkpoint.background={background!r} must be true (write the checkpoints "
                "saved during training in a thread, while training goes on) or false (write each before the "
                "next step)."
            )
        super().__init__(
            dirpath=dirpath,
            save_top_k=0,
            save_last=True,
            every_n_train_steps=every_n_train_steps,
            save_on_train_epoch_end=False,
            enable_version_counter=False,
        )
        self.background = background
        # The newest checkpoint written whole (or resumed from) and its step: what resume=auto continues from.
        self._saved: tuple[Path | None, int | None] = (None, None)
        # A save handed to the background writer: its path, step and write, the newest once that succeeds.
        self._queued: tuple[Path, int, Future[None]] | None = None
        # On a rank other than 0, where rank 0 writes the file in the background: what is on disk says.
        self._written_by_rank_0: Path | None = None
        self._requested_step: int | None = None

    @property
    def requested_step(self) -> int | None:
        """The step of the newest save asked for (written, or being written in the background): the same on
        every rank, for decisions every rank must take alike."""
        return self._requested_step

    def saved(self) -> tuple[Path | None, int | None]:
        """The newest checkpoint on disk whole and its step, after the background write in flight, if any, has
        ended (its error, if it failed, is left for the writer to raise)."""
        self._settle_write()
        if self._written_by_rank_0 is not None:
            # This rank cannot see rank 0's writer: the newest save is on disk when its digest says so (a
            # rank 0 killed while writing left the one before, or none).
            verdict = digests.check(self._written_by_rank_0) if self._written_by_rank_0.is_file() else None
            if verdict is not None and verdict.verified and verdict.step is not None:
                return self._written_by_rank_0, verdict.step
        return self._saved

    def _settle_write(self) -> None:
        """Wait for this process's background write, if one is queued; the newest saved once it succeeded."""
        if self._queued is not None:
            path, step, write = self._queued
            if write.exception() is None:
                self._saved = (path, step)
            self._queued = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.ckpt_path:
            self._saved = (Path(trainer.ckpt_path), trainer.global_step)
            self._requested_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        writer = background_writer(trainer)
        if writer is None or not self.background:
            super().on_train_batch_end(trainer, pl_module, *args)
            return
        writer.raise_if_failed()  # a full disk stops the run at the step after the write that found it
        with writer.in_background():
            super().on_train_batch_end(trainer, pl_module, *args)

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict[str, Any]) -> None:
        # Every rank takes the same decision: the save that follows is collective for sharded strategies.
        if not state_is_finite(trainer.lightning_module, trainer.strategy):
            log.warning(
                "Step %d: the model holds NaN or infinite parameters; %s keeps the last finite state.",
                trainer.global_step,
                LAST_CHECKPOINT,
            )
            return
        # The loggers' buffered rows first (the CSV logger writes every 100 steps): a run killed after this
        # save has every row up to the checkpoint's step on disk, and a resumed run drops the rows after it.
        for logger in trainer.loggers:
            logger.save()
        self._settle_write()
        super()._save_last_checkpoint(trainer, monitor_candidates)
        path, step = Path(self.last_model_path), trainer.global_step
        self._requested_step = step
        writer = background_writer(trainer)
        write = writer.pending_write if writer is not None else None
        if write is not None:
            self._queued = (path, step, write)
        elif writer is not None and written_by_rank_0_in_background(trainer, writer):
            self._written_by_rank_0 = path
        else:
            self._saved, self._written_by_rank_0 = (path, step), None
        # A best checkpoint saved at this step (the validation just before training ended) becomes a second
        # name of this file: one file on disk, not two copies of the same step.
        if trainer.is_global_zero:
            for best in best_checkpoints(trainer):
                if best.saved_step == trainer.global_step and best.saved_path:
                    if writer is not None:
                        writer.wait()  # both files on disk first (rare: a validation at a save's step)
                    if best.saved_path.is_file():
                        link_checkpoint(path, best.saved_path)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save_now(trainer)
        writer = background_writer(trainer)
        if writer is not None:
            writer.wait()  # the run's end reports its checkpoint: on disk by then

    def save_now(self, trainer: L.Trainer) -> None:
        """Write the last checkpoint for the current step unless it already holds it (or a write of it is in
        flight)."""
        if self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def written_by_rank_0_in_background(trainer: L.Trainer, writer: AtomicCheckpointIO) -> bool:
    """On a rank other than 0, whether the save just asked for is one file that rank 0 writes in the
    background (a sharded checkpoint is written by every rank before the save returns)."""
    sharded = bool(getattr(trainer.strategy, "_save_distributed_checkpoint", False))
    return writer.background_active and not trainer.is_global_zero and not sharded


def background_writer(trainer: L.Trainer) -> AtomicCheckpointIO | None:
    """The checkpoint writer of ``trainer``'s strategy where it writes single files in the background."""
    writer = getattr(trainer.strategy, "checkpoint_io", None)
    return writer if isinstance(writer, AtomicCheckpointIO) else None


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (``callbacks.model_checkpoint``: the best by val/loss), except that:

    - a best saved at the step the last checkpoint holds is a hard link to it, not a second copy of the same
      step: a 5-step run keeps one file, where it kept two of 192 MB each with model=small. A later save of
      the last checkpoint writes a new file and renames it into place, so the best keeps its bytes (and its
      digest). Where hard links fail (or a checkpoint is a sharded directory) the best is written in full;
    - after each save, the score of every best checkpoint kept is written beside them
      (:func:`gptlab.runs.layout.write_best_scores`): readers rank the best checkpoints by it, so the file
      name's format (``filename``, by default :data:`gptlab.runs.layout.BEST_FILENAME`) is free to change;
      it must start with ``best-``, the prefix by which a run's best checkpoints are found."""

    def __init__(self, dirpath: str | None = None, filename: str | None = None, **kwargs: Any) -> None:
        filename = BEST_FILENAME if filename is None else str(filename)
        if not filename.startswith(BEST_PREFIX):
            raise ConfigError(
                f"callbacks.model_checkpoint.filename={filename!r} must start with {BEST_PREFIX!r}: a run's best "
                f"checkpoints are found by that prefix. Use e.g. callbacks.model_checkpoint.filename="
                f"'{BEST_PREFIX}{{step}}', or null for gptlab's default ({BEST_FILENAME!r})."
            )
        super().__init__(dirpath=dirpath, filename=filename, **kwargs)
        # The newest best written by this process and its step: the last checkpoint, saved at that step, links
        # to it.
        self.saved_path: Path | None = None
        self.saved_step: int | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A best saved during training is written in the background where the last checkpoint's are
        # (callbacks.last_checkpoint.background); the one after training's last step, in the foreground.
        writer = background_writer(trainer)
        last = last_checkpoint_callback(trainer)
        during_training = (
            trainer.state.fn == TrainerFn.FITTING and 0 <= trainer.global_step < trainer.max_steps
        )
        if writer is None or last is None or not last.background or not during_training:
            super().on_validation_end(trainer, pl_module)
            return
        with writer.in_background():
            super().on_validation_end(trainer, pl_module)

    def _update_best_and_save(
        self, current: torch.Tensor, trainer: L.Trainer, monitor_candidates: dict[str, torch.Tensor]
    ) -> None:
        super()._update_best_and_save(current, trainer, monitor_candidates)
        if trainer.is_global_zero and self.dirpath:
            scores = {
                Path(path).name: float(score)
                for path, score in self.best_k_models.items()
                if score is not None
            }
            record = BestScores(str(self.monitor), self.mode, scores)
            dirpath = self.dirpath
            # once the new best is on disk: the scores never name a file that a kill could leave unwritten
            after_write(trainer, lambda: write_best_scores(dirpath, record))

    def _remove_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        # The best it displaces goes once the new one is on disk (a full disk keeps it, and its score).
        after_write(trainer, lambda: super(BestCheckpoint, self)._remove_checkpoint(trainer, filepath))

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        last = last_checkpoint_callback(trainer)
        linked = False
        if last is not None and last.requested_step == trainer.global_step:
            # Every rank takes the same branch (the save this step asked for, the same on every rank): the full
            # save below is collective for some strategies. Rank 0 links to the file once it is whole.
            made = False
            if trainer.is_global_zero:
                saved_path, saved_step = last.saved()
                if saved_path is not None and saved_step == trainer.global_step:
                    made = link_checkpoint(saved_path, Path(filepath))
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


def last_checkpoint_callback(trainer: L.Trainer) -> PeriodicLastCheckpoint | None:
    return next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, PeriodicLastCheckpoint)), None)


def after_write(trainer: L.Trainer, operation: Any) -> None:
    """``operation`` once the checkpoint being written in the background is on disk, or now (rank 0 runs
    these file operations; the writer of another rank has nothing in flight)."""
    writer = background_writer(trainer)
    if writer is None:
        operation()
    else:
        writer.after_write(operation)


# ---- stop signals -------------------------------------------------------------------------------------


class StopOnSignal(L.Callback):
    """Stops training cleanly on SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (see the module doc for what each does).

    A SIGTERM that arrives during validation is handled when Lightning interrupts the loop (its own SIGTERM
    exception), with a save at that point; a Ctrl-C during validation lets it finish and stops after the next
    step."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.quit_at_once = False  # a second Ctrl-C arrived: KeyboardInterrupt was raised
        self._previous: dict[int, Any] = {}
        self._saved_at: int | None = None
        self._is_global_zero = True

    @staticmethod
    def signals() -> list[signal.Signals]:
        return [signal.SIGTERM, signal.SIGINT] + ([signal.SIGUSR1] if hasattr(signal, "SIGUSR1") else [])

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            if self.received is not None:  # a second Ctrl-C (or Ctrl-C after another stop signal)
                self.quit_at_once = True
                raise KeyboardInterrupt
            self.received = signum
            if self._is_global_zero:
                # os.write, not print or logging: a handler may run in the middle of a write to the same stream.
                os.write(
                    2,
                    b"\nCtrl-C: stopping at the end of this step, with a checkpoint saved for it "
                    b"(Ctrl-C again quits at once, without saving)\n",
                )
            return  # Python's own handler (KeyboardInterrupt) is not called: the stop is this one's
        self.received = signum
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    def _install(self) -> None:
        # Handlers can be set in the main thread only: a run trained in another thread (gptlab.train() from
        # a thread of a notebook or a server) catches no signal, and a signal reaches the main thread as usual.
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals():
            signal.signal(signum, self._handle)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._is_global_zero = trainer.is_global_zero
        for signum in self.signals():
            self._previous[signum] = signal.getsignal(signum)
        self._install()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning installs its own SIGTERM handler at fit start (it broadcasts from inside the handler);
        # this one takes over again. Handlers that were there before Lightning's are still called.
        self._install()

    def restore_handlers(self) -> None:
        """Put back the handlers found at setup. Lightning restores the handlers it found at fit start
        (this callback's among them) in its own teardown, after this callback's: ``fit`` calls this again."""
        if threading.current_thread() is not threading.main_thread():
            return  # none was installed (_install)
        for signum, previous in self._previous.items():
            current = signal.getsignal(signum)
            # Lightning ignores SIGINT after it caught a KeyboardInterrupt (a second Ctrl-C): put it back too.
            ours = current == self._handle or (signum == signal.SIGINT and current == signal.SIG_IGN)
            if ours:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.restore_handlers()

    @property
    def stopped(self) -> bool:
        return self._saved_at is not None

    @property
    def signal_name(self) -> str:
        """``Ctrl-C``, ``SIGTERM``, ``SIGUSR1``: the stop signal received, as the user knows it."""
        return signal_name(self.received)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # Ranks may get the signal a step apart: every rank learns whether any rank got one (saving is
        # collective), then which kind, so all of them take the same branch.
        if not trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            return
        requeue = hardware.under_slurm() and trainer.strategy.reduce_boolean_decision(
            self.received == getattr(signal, "SIGUSR1", None), all=False
        )
        if requeue:
            self._save_and_requeue(trainer)
        self._save_last(trainer)
        trainer.should_stop = True

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException) and self.received is not None:
            self._save_last(trainer)

    def _name(self) -> str:
        return signal_name(self.received)

    def _save_last(self, trainer: L.Trainer) -> None:
        if self._saved_at == trainer.global_step:
            return
        self._saved_at = trainer.global_step
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, PeriodicLastCheckpoint):
                cb.save_now(trainer)
                if trainer.is_global_zero:  # one line for the run, not one per rank
                    log.info(
                        "Received %s: saved %s at step %d; continue with resume=auto",
                        self._name(),
                        cb.last_model_path,
                        trainer.global_step,
                    )
                return
        if trainer.is_global_zero:
            log.warning(
                "Received a stop signal, but no callbacks.last_checkpoint is configured: nothing saved."
            )

    def _save_and_requeue(self, trainer: L.Trainer) -> None:
        path = Path(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
        trainer.save_checkpoint(path)
        requeued = True
        if trainer.is_global_zero:
            log.info(
                "SLURM signal: saved %s at step %d; requeueing job %s",
                path,
                trainer.global_step,
                hardware.slurm_job_id(),
            )
            requeued = hardware.requeue_job()
        # Stop here, as SLURM is about to: no end-of-run validation or checkpoint that the requeued job would
        # find beside its own. A SystemExit of status 0 (python train.py exits with it; gptlab.train() raises
        # it, naming the checkpoint).
        raise RunRequeued(path.parent, path, trainer.global_step, hardware.slurm_job_id(), requeued)


# ---- fit ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignalStop:
    """How a stop signal ended training early: which signal (``Ctrl-C``, ``SIGTERM``...), whether a second
    Ctrl-C quit at once (the step in progress unsaved), and the checkpoint a resumed run continues from."""

    signal: str
    signum: int
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
    last = last_checkpoint_callback(trainer)
    saved = last.saved() if last is not None else (None, None)
    return SignalStop(
        signal=stopper.signal_name,
        # a rank a peer's signal stopped received none itself: the stop of a kill
        signum=int(stopper.received if stopper.received is not None else signal.SIGTERM),
        quit_at_once=stopper.quit_at_once,
        checkpoint=saved[0],
        checkpoint_step=saved[1],
    )
