"""One run per run directory.

A run directory holds exactly one run: the first start and every resumed part of it. ``run.json`` says which
run it is (an id drawn when the run starts), when each part started and from which step, and on which host and
process it runs, so that a reader can tell a finished run from a killed one and from one still running.

A fresh start into a directory that already holds a run is refused before anything is written (before Hydra
rewrites ``.hydra/``, before any logger opens a file), with the two ways on: ``resume=auto`` to continue it, or
another ``hydra.run.dir``. ``overwrite=true`` starts anew there and moves the old run's files aside, whole,
into ``<run dir>/.replaced/<time>/``: nothing is merged, nothing is lost. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from gptlab.errors import ConfigError
from gptlab.runs.layout import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    EVAL_LENGTH_DIR,
    HPC_GLOB,
    HYDRA_DIR,
    REPLACED_DIR,
    RESULT_FILE,
    RUN_FILE,
    Run,
    RunInfo,
    find_run_dirs,
    read_run_info,
    run_of_path,
)

# What a run that started training leaves in its directory (config_resolved.yaml is written before the first
# step); run.json and Hydra's .hydra/ are written earlier, also by a command then refused at config time.
_RUN_OUTPUTS = (RESULT_FILE, CONFIG_FILE, CHECKPOINT_DIR, EVAL_LENGTH_DIR, "csv", "wandb", "tensorboard")
# Environment variables that mark a process started by a launcher for rank > 0 (Lightning, torchrun, srun).
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")


class RunDirectoryInUse(ConfigError):
    """A fresh run was asked to start in a directory that already holds another run."""


def launched_rank() -> bool:
    """True in a process that a launcher started for a rank other than 0: rank 0 checks and claims the run
    directory for all of them."""
    return any(os.environ.get(name, "0") not in ("", "0") for name in _RANK_VARIABLES)


def previous_run_files(run_dir: Path) -> list[Path]:
    """The files and folders in ``run_dir`` that show an earlier run started training there (``run.json``,
    Hydra's ``.hydra/`` and log alone do not: a command refused at config time leaves them)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for name in _RUN_OUTPUTS:
        path = run_dir / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(path)
    return found + sorted(run_dir.glob(HPC_GLOB))


def resume_asked(resume: Any) -> bool:
    return resume not in (None, False, "", "null", "none", "None", "false", "False")


def continues_a_run(resume: Any, run_dir: Path) -> bool:
    """True when ``resume`` continues the run in ``run_dir``: ``auto`` with a checkpoint there to continue
    from (one a kill set aside mid-swap counts: it is put back before loading), or a path inside it; or,
    without ``resume``, a requeued SLURM job finding its preemption checkpoint."""
    run_dir = Path(run_dir)
    if not resume_asked(resume):
        # A SLURM job requeued after preemption runs the same command again, in the same directory, and
        # Lightning continues from the preemption checkpoint it left there.
        return bool(os.environ.get("SLURM_JOB_ID")) and bool(Run(run_dir).preemption_checkpoints())
    if resume == "auto":
        run = Run(run_dir)
        return run.resume_checkpoint() is not None or bool(run.set_aside_checkpoints())
    resumed = run_of_path(Path(str(resume)).expanduser())
    return resumed is not None and resumed.path.resolve() == run_dir.resolve()


def move_aside(run_dir: Path, paths: list[Path]) -> Path:
    """Move ``paths`` (inside ``run_dir``) into ``<run_dir>/.replaced/<time>/``, keeping their names."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    target = run_dir / REPLACED_DIR / stamp
    n = 1
    while target.exists():
        n += 1
        target = run_dir / REPLACED_DIR / f"{stamp}_{n}"
    target.mkdir(parents=True)
    for path in paths:
        os.replace(path, target / path.name)
    return target


def refusal(run_dir: Path, found: list[Path], key: str = "hydra.run.dir") -> str:
    names = ", ".join(p.name for p in found[:6]) + (", ..." if len(found) > 6 else "")
    return (
        f"{run_dir} already holds a run ({names}); a new run there would mix its metrics, checkpoints and W&B "
        f"files with that run's. Continue that run with resume=auto (the same overrides) or "
        f"resume={run_dir}; start a new run elsewhere with {key}=<another dir> (or leave {key} unset); or "
        "add overwrite=true to start anew there, with the old run's files moved to "
        f"{run_dir / REPLACED_DIR}/<time>/."
    )


def claim_run_dir(
    run_dir: Path, resume: Any, overwrite: bool, include_hydra: bool = False, log: Any = None
) -> Path | None:
    """Make sure a starting run is the only run in ``run_dir``: nothing to do for a run that continues
    (``resume`` with a checkpoint there) or where no run started training; otherwise a
    :class:`RunDirectoryInUse`, or, with ``overwrite`` (or ``resume=auto`` finding nothing to continue), the
    old files moved aside (with ``include_hydra``, before Hydra writes, its ``.hydra/`` and log too).
    Returns the folder they were moved to, if any."""
    run_dir = Path(run_dir)
    if launched_rank() or continues_a_run(resume, run_dir):
        return None
    found = previous_run_files(run_dir)
    if not found:
        return None
    if not overwrite and resume != "auto":
        raise RunDirectoryInUse(refusal(run_dir, found))
    found += [p for p in (run_dir / RUN_FILE,) if p.exists()]
    if include_hydra:  # before Hydra's job starts: the old run's .hydra/ and log go with it
        found += [p for p in (run_dir / HYDRA_DIR, *run_dir.glob("*.log")) if p.exists()]
    aside = move_aside(run_dir, found)
    if log is not None:
        why = "overwrite=true" if overwrite else "resume=auto found no checkpoint to continue from"
        log.warning("%s: the earlier run's files in %s are moved to %s", why, run_dir, aside)
    return aside


def claim_sweep_dir(sweep_dir: Path, resume: Any, overwrite: bool) -> Path | None:
    """The same for a multirun's ``hydra.sweep.dir``: refused when it holds runs, unless ``resume`` (each
    job continues its own directory) or ``overwrite`` (the old jobs and ``multirun.yaml`` moved aside)."""
    sweep_dir = Path(sweep_dir)
    if launched_rank() or resume_asked(resume):
        return None
    jobs = find_run_dirs(sweep_dir)
    if not jobs:
        return None
    if not overwrite:
        raise RunDirectoryInUse(
            f"{sweep_dir} already holds {len(jobs)} run(s) of an earlier sweep ({', '.join(p.name for p in jobs[:4])}"
            f"{', ...' if len(jobs) > 4 else ''}); new jobs there would mix with them. Continue that sweep with "
            "resume=auto (the same command: each job continues its own directory); start a new sweep with "
            "hydra.sweep.dir=<another dir> (or leave it unset); or add overwrite=true to move the old jobs to "
            f"{sweep_dir / REPLACED_DIR}/<time>/."
        )
    top = {sweep_dir / job.relative_to(sweep_dir).parts[0] for job in jobs} | {sweep_dir / "multirun.yaml"}
    return move_aside(sweep_dir, sorted(p for p in top if p.exists()))


# ---- run.json ------------------------------------------------------------------------------------------------


def record_start(run_dir: Path, continued: bool, overrides: list[str], task: str) -> RunInfo:
    """Write ``run.json`` for a new run, or add a part to it for a run that ``continued``."""
    run_dir = Path(run_dir)
    info = read_run_info(run_dir) if continued else None
    part = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "started_unix": time.time(),
        "resumed": bool(continued),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "overrides": list(overrides),
    }
    info = RunInfo(info.run_id if info else uuid.uuid4().hex[:12], [*(info.parts if info else []), part])
    data = {"run_id": info.run_id, "task": task, "parts": info.parts}
    tmp = run_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, run_dir / RUN_FILE)
    return info
