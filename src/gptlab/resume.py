"""Continuing a run: which directory it continues in, which checkpoint it loads, and the checks that refuse
an unreadable checkpoint or one from a different model before any training starts.

``resume=auto`` looks for the newest run under ``outputs/`` (single runs and multirun jobs) whose
``.hydra/overrides.yaml`` equals the current command's overrides (``resume=`` itself aside) and that holds a
checkpoint; Hydra's run directory then *is* that run's directory (the ``gptlab_run_dir`` resolver in
``conf/hydra/default.yaml``), so the continued run writes its logs, checkpoints and W&B files beside the
first part's. Without such a run, ``resume=auto`` starts a new run: the same command serves for the first
start and for every restart after a preemption. ``resume=<run dir or .ckpt file>`` continues that run.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from gptlab.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

RESUME_KEYS = ("resume=", "+resume=", "++resume=")
# Folders under outputs/ that never hold run directories.
_SKIP_DIRS = {"cache", "wandb", "checkpoints", "csv", ".hydra", "__pycache__"}


# ---- which run ---------------------------------------------------------------------------------------


def resume_value(overrides: list[str]) -> str | None:
    """The value of ``resume=`` among Hydra task overrides, or None."""
    value = None
    for item in overrides:
        for prefix in RESUME_KEYS:
            if item.startswith(prefix):
                value = item[len(prefix) :].strip().strip("'\"")
    return None if value in (None, "", "null", "None", "none", "false", "False") else value


def comparable(overrides: list[str]) -> list[str]:
    return sorted(item for item in overrides if not item.startswith(RESUME_KEYS))


def resume_checkpoint_in(run_dir: Path) -> Path | None:
    """The checkpoint a run continues from: the newest of ``checkpoints/last.ckpt`` (periodic and on
    SIGTERM/SIGUSR1) and Lightning's SLURM ``hpc_ckpt_*.ckpt`` in the run directory."""
    candidates = [run_dir / "checkpoints" / "last.ckpt", *run_dir.glob("hpc_ckpt_*.ckpt")]
    found = [p for p in candidates if p.exists()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def run_dirs_under(root: Path, max_depth: int = 5) -> list[Path]:
    """Directories under ``root`` that Hydra ran a job in (they hold ``.hydra/overrides.yaml``)."""
    runs = []
    root = Path(root)
    if not root.is_dir():
        return runs
    base_depth = len(root.parts)
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        if (here / ".hydra" / "overrides.yaml").is_file():
            runs.append(here)
        if len(here.parts) - base_depth >= max_depth:
            dirnames[:] = []
        else:
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
    return runs


def read_overrides(run_dir: Path) -> list[str] | None:
    try:
        data = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return [str(x) for x in data] if isinstance(data, list) else [] if data is None else None


def find_run_to_continue(overrides: list[str], root: Path) -> Path | None:
    """The newest run under ``root`` started with the same overrides (``resume=`` aside) that holds a
    checkpoint to continue from, or None."""
    wanted = comparable(overrides)
    best: tuple[float, Path] | None = None
    for run_dir in run_dirs_under(root):
        ckpt = resume_checkpoint_in(run_dir)
        if ckpt is None or read_overrides(run_dir) is None:
            continue
        if comparable(read_overrides(run_dir)) != wanted:
            continue
        mtime = ckpt.stat().st_mtime
        if best is None or mtime > best[0]:
            best = (mtime, run_dir)
    return best[1] if best else None


def run_dir_of_checkpoint(path: Path) -> Path | None:
    """The Hydra run directory a checkpoint or run directory belongs to, if it is one."""
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / ".hydra").is_dir():
            return candidate
    return None


def choose_run_dir(task_overrides: Any, search_root: str, default: str) -> str:
    """The ``gptlab_run_dir`` resolver behind ``hydra.run.dir``: the directory of the run that ``resume=``
    continues, else ``default`` (a new run directory)."""
    if OmegaConf.is_config(task_overrides):
        task_overrides = OmegaConf.to_container(task_overrides)
    overrides = [str(x) for x in task_overrides or []]
    value = resume_value(overrides)
    if value is None:
        return default
    if value == "auto":
        found = find_run_to_continue(overrides, Path(search_root))
        return str(found) if found is not None else default
    found = run_dir_of_checkpoint(Path(value).expanduser())
    return str(found) if found is not None else default


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("gptlab_run_dir"):
        OmegaConf.register_new_resolver("gptlab_run_dir", choose_run_dir)


# ---- which checkpoint, and is it usable ----------------------------------------------------------------


@dataclass
class ResumePlan:
    ckpt_path: Path
    global_step: int
    wandb_run_id: str | None


def checkpoint_to_resume(resume: Any, run_dir: Path) -> Path | None:
    """The checkpoint that ``resume`` (null, ``auto``, a run directory or a checkpoint file) selects."""
    if resume in (None, False, "", "null", "none", "None"):
        return None
    if resume == "auto":
        ckpt = resume_checkpoint_in(run_dir)
        if ckpt is None:
            log.info("resume=auto: no earlier run with these overrides has a checkpoint; starting a new run.")
        return ckpt
    path = Path(str(resume)).expanduser()
    if path.is_dir() and not (path / ".metadata").exists():  # a run directory, not a sharded checkpoint
        ckpt = resume_checkpoint_in(path)
        if ckpt is None:
            raise CheckpointError(
                f"resume={resume}: the directory holds no checkpoints/last.ckpt to continue from. Give a "
                "checkpoint file (resume=<run>/checkpoints/<name>.ckpt), another run directory, or resume=auto."
            )
        return ckpt
    if not path.exists():
        raise CheckpointError(
            f"resume={resume}: no such file or directory. Give a checkpoint file, a run directory "
            "(outputs/runs/<date>/<time>), or resume=auto to continue the newest run with these overrides."
        )
    return path


def load_checkpoint_file(path: Path) -> dict[str, Any]:
    """Load a checkpoint on the CPU (memory-mapped, tensors only), with an error that names the file."""
    import torch

    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        size = path.stat().st_size if path.exists() else 0
        raise CheckpointError(
            f"Checkpoint {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
            f"{size:,} bytes): it is truncated, corrupt, or not a PyTorch checkpoint. Resume from another "
            f"checkpoint (resume=<path>), or delete it and start again."
        ) from e


def architecture_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [
        f"{key}: {saved.get(key)!r} in the checkpoint, {current.get(key)!r} now"
        for key in keys
        if saved.get(key) != current.get(key)
    ]


def inspect_checkpoint(path: Path, model_config: Any) -> ResumePlan:
    """Check that ``path`` is a readable gptlab checkpoint of the same model as ``model_config`` (a
    GPTConfig); returns what the resumed run needs from it."""
    if path.is_dir():  # a sharded (distributed checkpoint) directory: its strategy reads and checks it
        return ResumePlan(path, -1, None)
    checkpoint = load_checkpoint_file(path)
    hparams = checkpoint.get("hyper_parameters") or {}
    if "state_dict" not in checkpoint or "model" not in hparams:
        raise CheckpointError(
            f"Checkpoint {path} is not a gptlab training checkpoint (it has no "
            f"{'state_dict' if 'state_dict' not in checkpoint else 'hyper_parameters.model'}; keys: "
            f"{sorted(checkpoint)[:8]}). Resume from a checkpoint that train.py wrote."
        )
    from gptlab.model.config import GPTConfig

    try:
        saved = GPTConfig.from_dict(dict(hparams["model"])).to_dict()
    except ConfigError as e:
        raise CheckpointError(f"Checkpoint {path} holds a model config this version cannot build: {e}") from e
    diffs = architecture_differences(saved, model_config.to_dict())
    if diffs:
        fixes = " ".join(
            f"model.{k}={saved[k]}" if k in ("n_layer", "n_head", "n_embd", "block_size", "n_kv_head") else ""
            for k in sorted(k for k in saved if saved[k] != model_config.to_dict().get(k))
        ).split()
        raise CheckpointError(
            f"Checkpoint {path} is from a different model: {'; '.join(diffs)}. Resume with the settings it was "
            f"trained with{' (' + ' '.join(fixes) + ')' if fixes else ''}, or start a new run without resume=."
        )
    wandb_run_id = checkpoint.get("wandb_run_id")
    return ResumePlan(
        path, int(checkpoint.get("global_step", 0)), str(wandb_run_id) if wandb_run_id else None
    )


def plan_resume(resume: Any, run_dir: Path, model_config: Any) -> ResumePlan | None:
    """Everything a resumed run needs, checked before any training: None for a new run."""
    ckpt = checkpoint_to_resume(resume, run_dir)
    if ckpt is None:
        return None
    plan = inspect_checkpoint(ckpt, model_config)
    log.info("Resuming from %s (step %d)", plan.ckpt_path, plan.global_step)
    return plan


def check_writable(run_dir: Path) -> None:
    """Create the run directory and write a probe file in it: an unwritable place fails now, not at the
    first checkpoint."""
    import tempfile

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"The output directory {run_dir} cannot be written ({e.strerror or e}). Choose a writable folder "
            "with hydra.run.dir=<dir> (hydra.sweep.dir=<dir> for -m), run from a folder you can write to "
            "(runs go under ./outputs), or fix the folder's permissions."
        ) from e


def unwritable_reason(path: Path) -> str | None:
    """Why a directory could not be created and written at ``path``, judged from its nearest existing
    ancestor; None when it can."""
    path = Path(path).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable (permission denied)"
    return None


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra-core < 1.1
    _HydraCallback = object


class CheckRunDirectory(_HydraCallback):
    """A Hydra callback: refuses an output directory that cannot be written before Hydra creates it, with
    the fix, instead of a traceback from ``mkdir``."""

    def _check(self, path: Any, key: str) -> None:
        import sys

        reason = unwritable_reason(Path(str(path)))
        if reason:
            print(
                f"\ngptlab: error: the output directory {key}={path} cannot be created: {reason}. Choose a "
                f"writable folder with {key}=<dir>, run from a folder you can write to (runs go under "
                "./outputs), or fix the permissions.",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(2)

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._check(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._check(config.hydra.sweep.dir, "hydra.sweep.dir")
