"""What the machine has, how many processes a trainer config starts on it, and the cluster that started them.

SLURM sends SIGUSR1 before it preempts a job or its time runs out (`#SBATCH --signal=USR1@<seconds>`).
Lightning's own handler saves from inside the signal handler, in the middle of a step and in each rank at
its own moment; here the signal is one of those `gptlab.training.checkpointing.StopOnSignal` handles:
every rank saves together at the next step boundary, then rank 0 requeues the job (`requeue_job`), and the
environment plugin (`slurm_plugins`) leaves SIGUSR1 to this project.
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Any

import torch

log = logging.getLogger("gptlab")


def choose_precision(requested: Any, accelerator: str | None = "auto") -> Any:
    """fp32 on CPU (bf16 matrix products run far slower than fp32 on CPUs); bf16 mixed precision on GPUs
    that have it, fp16 mixed on older ones."""
    if requested not in (None, "auto"):
        return requested
    if accelerator != "cpu" and torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


def uses_gpus(trainer_cfg: dict[str, Any]) -> bool:
    accelerator = trainer_cfg.get("accelerator", "auto")
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, as under a job scheduler or `taskset`)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without affinity masks
        return os.cpu_count() or 1


def devices_per_node(trainer_cfg: dict[str, Any]) -> int:
    """How many processes Lightning starts on each node for `trainer.devices` (an int, a list of ids, a
    comma-separated string, -1 or "auto")."""
    devices = trainer_cfg.get("devices", "auto")
    gpus = uses_gpus(trainer_cfg)
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return torch.cuda.device_count() if gpus else 1
        if "," in text:
            return len([d for d in text.split(",") if d.strip()])
        devices = int(text)
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if devices == -1:
        return torch.cuda.device_count() if gpus else (os.cpu_count() or 1)
    return int(devices)


def world_size(trainer_cfg: dict[str, Any]) -> int:
    return devices_per_node(trainer_cfg) * int(trainer_cfg.get("num_nodes", 1) or 1)


def warn_if_cpu_oversubscribed(trainer_cfg: dict[str, Any]) -> str | None:
    """Warn (and return the warning) when CPU training starts more processes on this node than it has
    cores: each process then gets a fraction of a core and the run is slower than with fewer processes.
    Allowed, since a DDP or FSDP run on CPUs is also how multi-device code is tried out."""
    if uses_gpus(trainer_cfg):
        return None
    try:
        processes = devices_per_node(trainer_cfg)
    except (TypeError, ValueError):  # a malformed value: Lightning names it
        return None
    cores = cpu_cores()
    if processes <= cores:
        return None
    message = (
        f"trainer.devices={trainer_cfg.get('devices')} starts {processes} training processes on the CPU, but "
        f"this machine gives this run {cores} core(s): each process gets a fraction of a core, and the run "
        f"is slower than with trainer.devices={cores}. Use trainer.devices={cores} or fewer (or a GPU machine)."
    )
    log.warning(message)
    return message


def launched_externally() -> bool:
    """True when SLURM (srun), torchrun or MPI started this process as one rank of many: Lightning then
    starts no processes of its own."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    return (
        TorchElasticEnvironment.detect()
        or SLURMEnvironment.detect()
        or LSFEnvironment.detect()
        or MPIEnvironment.detect()
    )


# SLURM: the job to requeue, and the environment plugin that leaves SIGUSR1 to this project.


def under_slurm() -> bool:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def slurm_job_id() -> str | None:
    """The id `scontrol requeue` takes: <array job>_<task> for an array task (a Hydra sweep), else the job."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_job() -> bool:
    """`scontrol requeue <job>`: SLURM starts the same command again, in the same run directory. Returns
    whether scontrol succeeded."""
    job = slurm_job_id()
    try:
        result = subprocess.call(["scontrol", "requeue", str(job)])
    except OSError as e:  # no scontrol on PATH
        log.warning("scontrol requeue %s could not run: %s", job, e)
        return False
    if result != 0:
        log.warning("scontrol requeue %s failed with exit code %d", job, result)
    return result == 0


def slurm_plugins() -> list[Any]:
    """``[SLURMEnvironment(auto_requeue=False)]`` under SLURM (Lightning then installs no SIGUSR1 handler
    of its own), else nothing."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def host_memory_bytes() -> float:
    """The host's physical RAM in bytes (16 GiB where the system does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX hosts
        return 16.0 * 2**30


def available_host_memory() -> float:
    """Bytes of RAM this machine can give now (``MemAvailable``: free memory plus the page cache it can drop);
    the physical RAM where the kernel does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024  # the kernel reports KiB
    except OSError:  # pragma: no cover - not Linux
        pass
    return host_memory_bytes()
