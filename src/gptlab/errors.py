"""Every exception gptlab raises on purpose. Each message names the bad value, what is allowed, and the fix.

``ConfigError`` and its kinds end `python train.py` with exit status 2 and the message alone (no traceback);
``NonFiniteLossError``, ``DiskFullError`` and ``RankLostError`` end it with status 1, as a run that started and
then failed. ``SweepStopped`` ends a sweep that a stop signal interrupted with 128 + the signal's number, as a shell
reports a process a signal ended. ``RunRequeued`` ends it with status 0, as SLURM expects of a job it requeued.
``EvaluationStopped`` never leaves the task that raised it: it ends an evaluation after training, and the task
records the stop.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value that cannot work, found before any expensive work starts."""


class DataError(ValueError):
    """A corpus or data file that cannot be used as given."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read, that is not gptlab's, or that belongs to a different model."""


class WandbFileError(ValueError):
    """A W&B run file (``run-*.wandb``) that cannot be read: not one, truncated, or corrupt."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite on some rank; every rank stops at the same step, before the
    bad state is stepped or saved."""


class DiskFullError(RuntimeError):
    """A checkpoint could not be written for want of space; the message names the place, the space needed
    and free, and the last good checkpoint (a failed save never replaces it)."""


class RankLostError(RuntimeError):
    """A process of a distributed run ended (killed, crashed) or its launching process is gone; the message
    names the rank and how it ended, the last intact checkpoint and the command that continues the run."""


def signal_name(signum: int | None) -> str:
    """How a stop signal is named to the user: ``Ctrl-C`` for SIGINT, the signal's name otherwise."""
    if signum is None:
        return "a signal"
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class SweepStopped(Exception):
    """A job of a sweep (``python train.py -m``) that a stop signal ended early, its checkpoint and
    ``result.json`` written. The sweep stops with it rather than starting its next job: the signal (Ctrl-C, a
    ``kill``, a scheduler's SIGTERM) was meant for the whole command, and a job started after it would run
    until a harder kill ended it unsaved. ``gptlab.cli`` says how the sweep continues."""

    def __init__(self, signum: int, run_dir: Path) -> None:
        self.signum, self.run_dir = signum, run_dir
        super().__init__(f"{signal_name(signum)} stopped the sweep in {run_dir}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class EvaluationStopped(BaseException):
    """A stop signal (SIGTERM, Ctrl-C) that ended the evaluation after training (word2vec's benchmarks), raised
    from the signal handler. A ``BaseException``, as ``KeyboardInterrupt`` is: no ``except Exception`` on the way
    (a benchmark's own) takes it for a failed score."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal_name(signum)} stopped the evaluation")


class PreparationStopped(KeyboardInterrupt):
    """A stop signal (a scheduler's SIGTERM) that ended a token cache's preparation, raised from the signal
    handler. A ``KeyboardInterrupt``, as Ctrl-C's is: it takes the same way out (the work folder removed on
    the way, one line, exit status 128 + the signal's number)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"{signal_name(signum)} stopped the preparation of a token cache")


class RunRequeued(SystemExit):
    """A run that SLURM's warning signal (SIGUSR1 before preemption or the time limit) stopped: its preemption
    checkpoint ``checkpoint`` saved at step ``step`` in ``run_dir``, and the job ``job_id`` requeued
    (``requeued``: whether ``scontrol requeue`` said it was). The requeued job runs the same command again and,
    in the same run directory, continues from that checkpoint.

    A ``SystemExit`` whose ``code`` is 0: the job is about to end, so nothing in the process should go on to
    other work (no ``except Exception`` takes it), and a script under ``sbatch`` that calls
    ``gptlab.train()`` ends with the status ``python train.py`` ends with. ``gptlab.train()`` raises it;
    ``python train.py`` exits with status 0."""

    def __init__(
        self, run_dir: Path, checkpoint: Path, step: int, job_id: str | None, requeued: bool = True
    ) -> None:
        self.run_dir, self.checkpoint, self.step = run_dir, checkpoint, step
        self.job_id, self.requeued = job_id, requeued
        then = (
            f"the requeued job runs the same command again and continues from it in {run_dir}."
            if requeued
            else f"`scontrol requeue {job_id}` failed, so the job was not requeued: submit the same command "
            f"again (same run directory, {run_dir}) to continue from it."
        )
        super().__init__(
            f"SLURM job {job_id}: SIGUSR1 (its warning before preemption or the time limit) stopped the run at "
            f"step {step}; its checkpoint is {checkpoint}, and {then}"
        )
        # the process ends with status 0, as train.py does (Python reads .code, not the message)
        self.code = 0

    def __reduce__(
        self,
    ) -> tuple[Any, ...]:  # pickled whole (a process pool's worker returns it to its parent)
        return (type(self), (self.run_dir, self.checkpoint, self.step, self.job_id, self.requeued))


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DiskFullError",
    "EvaluationStopped",
    "NonFiniteLossError",
    "PreparationStopped",
    "RankLostError",
    "RunRequeued",
    "SweepStopped",
    "WandbFileError",
    "signal_name",
]
