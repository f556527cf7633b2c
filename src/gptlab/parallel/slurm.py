"""SLURM: the job to requeue, and the environment plugin that leaves SIGUSR1 to this project.

SLURM sends SIGUSR1 before it preempts a job or its time runs out (`#SBATCH --signal=USR1@<seconds>`).
Lightning's own handler saves from inside the signal handler, in the middle of a step and in each rank at
its own moment; here the signal is one of those `gptlab.training.checkpointing.StopOnSignal` handles:
every rank saves together at the next step boundary, then rank 0 requeues the job.
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Any

log = logging.getLogger("gptlab")


def under_slurm() -> bool:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def slurm_job_id() -> str | None:
    """The id `scontrol requeue` takes: <array job>_<task> for an array task (a Hydra sweep), else the job."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_job() -> None:
    """`scontrol requeue <job>`: SLURM starts the same command again, in the same run directory."""
    job = slurm_job_id()
    result = subprocess.call(["scontrol", "requeue", str(job)])
    if result != 0:
        log.warning("scontrol requeue %s failed with exit code %d", job, result)


def slurm_plugins() -> list[Any]:
    """``[SLURMEnvironment(auto_requeue=False)]`` under SLURM (Lightning then installs no SIGUSR1 handler
    of its own), else nothing."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []
