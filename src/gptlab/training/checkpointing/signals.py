"""One way to stop on a signal: the handler only sets a flag; at the next step boundary every rank learns
whether any rank got a signal, and all of them save together and stop.

- SIGTERM (a kill, a cluster's stop), SIGINT (Ctrl-C) and SIGUSR1 outside SLURM: save ``last.ckpt`` at the
  current step, write ``result.json`` as stopped, and end with status 0; the same command with
  ``resume=auto`` continues.
- A second Ctrl-C while the first is being handled quits at once: Python's KeyboardInterrupt is raised
  wherever the process is. A checkpoint save it interrupts is abandoned (its temporary file removed; the
  previous ``last.ckpt`` is left whole), the steps since the last saved checkpoint are lost, and
  ``result.json`` still says where the run stopped and which checkpoint ``resume=auto`` continues from.
- SIGUSR1 under SLURM (its warning before preemption or the time limit, `#SBATCH --signal=USR1@<s>`): save
  ``<default_root_dir>/hpc_ckpt_<n>.ckpt``, requeue the job from rank 0 (`scontrol requeue`) and exit; the
  requeued job runs the same command in the same run directory, and Lightning resumes from that file.

Saving from inside a signal handler (Lightning's own way) happens in the middle of a step and in each rank at
its own moment, a collective at an arbitrary point that deadlocks when the signal lands inside another one.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import lightning as L

from gptlab.parallel import hardware
from gptlab.training.checkpointing.periodic import PeriodicLastCheckpoint

log = logging.getLogger(__name__)


def signal_name(signum: int | None) -> str:
    """How a stop signal is named to the user: ``Ctrl-C`` for SIGINT, the signal's name otherwise."""
    if signum is None:
        return "a signal"
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


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
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            log.info(
                "SLURM signal: saved %s at step %d; requeueing job %s",
                path,
                trainer.global_step,
                hardware.slurm_job_id(),
            )
            hardware.requeue_job()
        # Stop here, as SLURM is about to: no end-of-run validation or checkpoint that the requeued job would
        # find beside its own.
        raise SystemExit(0)
