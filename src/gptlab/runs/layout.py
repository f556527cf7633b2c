"""The layout of a run directory, as ``python train.py`` writes it, and where to find things in it.

::

    <run dir>/                        outputs/runs/<date>/<time>, or <sweep dir>/<job> in a multirun
      .hydra/overrides.yaml           the command's overrides (Hydra); what makes a directory a run
      run.json                        which run this is: its id, and each part (start, resumes) with its step
      run.lock                        while a run is running: which process holds the directory (pid, host)
      config_resolved.yaml            the whole config, resolved
      result.json                     written when the run ends: its final metrics, last step, git commit
      checkpoints/last.ckpt           periodic and final; a file, or a directory for sharded strategies
      checkpoints/best-step*-val*.ckpt  best by val/loss (BEST_FILENAME; a hard link to last.ckpt at its step)
      checkpoints/best.json           each best checkpoint's score (val/loss), as the run measured it
      checkpoints/<name>.sha256       each checkpoint's SHA-256 digest, checked before it is read (runs.digests)
      hpc_ckpt_<n>.ckpt               SLURM's preemption checkpoints (digests in digests/)
      eval_length/length.json         the length study (scripts/eval_length.py, eval_length.enabled=true)
      csv/, wandb/, tensorboard/      the loggers' files
      .replaced/<time>/               an earlier run's files, moved aside by a run started with overwrite=true

A checkpoint is one of three kinds: a single ``torch.save`` file; a directory in PyTorch's distributed
checkpoint format (``.metadata``, one ``__<rank>_0.distcp`` per rank, and Lightning's ``meta.pt``), written by
``strategy=fsdp``; or a DeepSpeed checkpoint directory (``latest`` and ``<tag>/mp_rank_*_model_states.pt``).
This module is the one owner of these names: every reader and writer of a run directory builds its paths
here (:func:`last_checkpoint`, :func:`result_file`, ...), and the best checkpoint's loss is read from what the
run recorded (:func:`best_scores`), never parsed back out of its file name. Nothing here imports torch at
import time.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gptlab.runs.jsonfile import figures_as_json, figures_from_json, write_json

HYDRA_DIR = ".hydra"
OVERRIDES_FILE = f"{HYDRA_DIR}/overrides.yaml"
# Hydra's files of each later part of a run (a resume), kept apart from the first part's in .hydra/.
HYDRA_PARTS_DIR = f"{HYDRA_DIR}/parts"
CONFIG_FILE = "config_resolved.yaml"
RESULT_FILE = "result.json"
RUN_FILE = "run.json"  # which run this is: its id and parts (gptlab.runs.identity)
CLAIM_FILE = "run.lock"  # the running process's exclusive claim of the directory (gptlab.runs.identity)
REPLACED_DIR = ".replaced"  # an earlier run's files, moved aside by overwrite=true
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
BEST_PREFIX = "best-"
BEST_GLOB = f"{BEST_PREFIX}*.ckpt"
# The best checkpoint's name: Lightning's ModelCheckpoint ``filename`` format, the step and the monitored metric
# filled in (``best-step000080-val5.432``). callbacks.model_checkpoint.filename may change it as long as it
# starts with BEST_PREFIX (gptlab.training.checkpointing.BestCheckpoint checks): nothing reads the name back.
BEST_FILENAME = BEST_PREFIX + "step{step:06d}-val{val/loss:.3f}"
# Beside the best checkpoints: the monitored metric, its mode and each best checkpoint's score, written by
# BestCheckpoint after each save ({"monitor": "val/loss", "mode": "min", "scores": {"<name>.ckpt": 5.4321}}).
BEST_SCORES_FILE = "best.json"
HPC_GLOB = "hpc_ckpt_*.ckpt"  # Lightning's SLURM requeue checkpoints, in the run directory itself
DIGEST_SUFFIX = ".sha256"  # a checkpoint's SHA-256 digest: <name>.ckpt.sha256 (gptlab.runs.digests)
#: Where the digests of checkpoints named ``*ckpt_*`` (SLURM's ``hpc_ckpt_<n>.ckpt``) go, beside them: Lightning
#: reads the version of ``hpc_ckpt_<n>.ckpt`` from the digits of every file name in the folder holding
#: ``ckpt_``, and would read ``hpc_ckpt_1.ckpt.sha256`` as version 1256.
NESTED_DIGEST_DIR = "digests"
EVAL_LENGTH_DIR = "eval_length"
LENGTH_FILE = "length.json"
# Lightning's name for the non-tensor part of a sharded checkpoint directory (step, loops, hyperparameters).
SHARDED_META_FILE = "meta.pt"
DCP_METADATA_FILE = ".metadata"
# A sharded checkpoint directory is written beside its target, then swapped in (gptlab.parallel.checkpoint_io):
STAGING = ".{name}.tmp-dir"  # a directory being written
ASIDE = ".{name}.old"  # the previous directory, during the swap

# Folders that never hold run directories.
SKIP_DIRS = frozenset({"cache", "wandb", "checkpoints", "csv", "tensorboard", HYDRA_DIR, "__pycache__"})

FILE, DCP, DEEPSPEED = "file", "dcp", "deepspeed"


# ---- where things are, for a run directory ------------------------------------------------------------------
def checkpoint_dir(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / CHECKPOINT_DIR


def last_checkpoint(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints/last.ckpt``, whether or not it is there yet (:meth:`Run.last_checkpoint`
    returns it only when it holds a checkpoint)."""
    return checkpoint_dir(run_dir) / LAST_CHECKPOINT


def best_scores_file(checkpoints: str | Path) -> Path:
    """``<checkpoints>/best.json``: the scores of the best checkpoints in the folder ``checkpoints``."""
    return Path(checkpoints) / BEST_SCORES_FILE


def result_file(run_dir: str | Path) -> Path:
    """``<run_dir>/result.json``."""
    return Path(run_dir) / RESULT_FILE


def run_file(run_dir: str | Path) -> Path:
    """``<run_dir>/run.json``."""
    return Path(run_dir) / RUN_FILE


def length_file(run_dir: str | Path) -> Path:
    """``<run_dir>/eval_length/length.json``."""
    return Path(run_dir) / EVAL_LENGTH_DIR / LENGTH_FILE


# A relative path for messages that tell the user where to look (``checkpoints/last.ckpt``).
LAST_CHECKPOINT_PATH = f"{CHECKPOINT_DIR}/{LAST_CHECKPOINT}"


def checkpoint_kind(path: Path) -> str | None:
    """``"file"``, ``"dcp"`` (a distributed checkpoint directory), ``"deepspeed"``, or None when ``path``
    is none of them (missing, or a directory that is not a complete checkpoint)."""
    path = Path(path)
    if path.is_file():
        return FILE
    if not path.is_dir():
        return None
    if (path / DCP_METADATA_FILE).is_file():
        return DCP
    if (path / "latest").is_file() or any(path.glob("*/*mp_rank_*_model_states.pt")):
        return DEEPSPEED
    return None


@dataclass(frozen=True)
class BestScores:
    """What ``checkpoints/best.json`` holds: the metric the best checkpoints are ranked by, whether lower is
    better, and each one's score by file name."""

    monitor: str
    mode: str  # "min" or "max"
    scores: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        # a NaN score (a validation that diverged) as "nan": strict JSON (gptlab.runs.jsonfile)
        return {"monitor": self.monitor, "mode": self.mode, "scores": figures_as_json(self.scores)}


def write_best_scores(checkpoints: str | Path, best: BestScores) -> Path:
    """Write ``<checkpoints>/best.json`` whole (a temporary file renamed over it)."""
    return write_json(best_scores_file(checkpoints), best.to_json(), sort_keys=True)


def read_best_scores(checkpoints: str | Path) -> BestScores | None:
    """``<checkpoints>/best.json``, or None when the run wrote none (one from before gptlab recorded it)."""
    data = _read_json(best_scores_file(checkpoints))
    if data is None or not isinstance(data.get("scores"), dict):
        return None
    scores = {}
    for name, score in data["scores"].items():
        try:
            scores[str(name)] = float(score)
        except (TypeError, ValueError):
            continue
    return BestScores(str(data.get("monitor") or ""), "max" if data.get("mode") == "max" else "min", scores)


def score_in_checkpoint(path: Path) -> float | None:
    """The score that a best checkpoint file holds for itself, in Lightning's ModelCheckpoint state (its
    ``best_k_models``): for runs written before ``best.json``. None when it holds none (a sharded directory,
    or a best that is a second name of the last checkpoint, saved before that best was known)."""
    if checkpoint_kind(path) != FILE:
        return None
    import torch  # only here: listing a run's files costs no torch

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # unreadable here: the loader names the problem when the checkpoint is read
        return None
    states = checkpoint.get("callbacks") if isinstance(checkpoint, dict) else None
    for key, state in (states or {}).items():
        if "ModelCheckpoint" not in str(key) and "BestCheckpoint" not in str(key):
            continue
        for saved, score in ((state or {}).get("best_k_models") or {}).items():
            if Path(str(saved)).name == path.name and score is not None:
                return float(score)
    return None


def _job_order(root: Path, path: Path) -> tuple:
    """Path parts that start with a job number in numeric order (``10-rope-seed0`` after ``9-nope-seed2``)."""

    def key(part: str) -> tuple:
        number = re.match(r"\d+", part)
        return (0, int(number.group()), part) if number else (1, 0, part)

    return tuple(key(p) for p in path.relative_to(root).parts)


@dataclass(frozen=True)
class RunInfo:
    """What ``run.json`` holds: the run's id and its parts (the first start, then one per resume)."""

    run_id: str
    parts: list[dict[str, Any]]

    @property
    def host(self) -> str | None:
        return self.parts[-1].get("host") if self.parts else None

    @property
    def pid(self) -> int | None:
        return self.parts[-1].get("pid") if self.parts else None

    def alive(self) -> bool | None:
        """Whether the process of the latest part is still running: None when it ran on another host."""
        if self.pid is None or self.host != socket.gethostname():
            return None
        try:
            os.kill(int(self.pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def read_run_info(run_dir: Path) -> RunInfo | None:
    """``<run_dir>/run.json`` (written by :mod:`gptlab.runs.identity`), or None for a run without one."""
    try:
        data = json.loads((Path(run_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "run_id" not in data:
        return None
    return RunInfo(str(data["run_id"]), list(data.get("parts") or []))


@dataclass(frozen=True)
class Run:
    """One run directory."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    # ---- files ----------------------------------------------------------------------------------
    @property
    def overrides_file(self) -> Path:
        return self.path / OVERRIDES_FILE

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def result_file(self) -> Path:
        return result_file(self.path)

    @property
    def checkpoint_dir(self) -> Path:
        return checkpoint_dir(self.path)

    @property
    def eval_length_dir(self) -> Path:
        return self.path / EVAL_LENGTH_DIR

    @staticmethod
    def is_run_dir(path: Path) -> bool:
        path = Path(path)
        return (path / OVERRIDES_FILE).is_file() or (path / CONFIG_FILE).is_file()

    # ---- what it was -----------------------------------------------------------------------------
    def overrides(self) -> list[str] | None:
        """The command-line overrides the run was started with; None when the file is missing or unreadable."""
        try:
            data = yaml.safe_load(self.overrides_file.read_text())
        except (OSError, yaml.YAMLError):
            return None
        if data is None:
            return []
        return [str(x) for x in data] if isinstance(data, list) else None

    def part_overrides(self) -> list[list[str]]:
        """The overrides of each later part of the run (a ``resume=`` that continued it, also one then
        refused), oldest first: Hydra's files of those parts go to ``.hydra/parts/<time>/``, so that
        ``.hydra/`` keeps the command the run was started with."""
        found = []
        for path in sorted((self.path / HYDRA_PARTS_DIR).glob("*/overrides.yaml")):
            try:
                data = yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(data, list):
                found.append([str(x) for x in data])
        return found

    def choices(self) -> dict[str, str]:
        """The overrides as ``{key: value}`` (``+trainer.x=1`` -> ``trainer.x``)."""
        from gptlab.runs.naming import split_override

        return dict(split_override(o) for o in self.overrides() or [])

    def setting(self, key: str) -> str | None:
        """What the run chose for ``key``: its override, else Hydra's choice for a config group
        (``pos`` -> ``learned``), else the value in its resolved config (``model.n_layer`` -> ``2``); None
        when the run records none of them."""
        choices = self.choices()
        if key in choices:
            return choices[key]
        try:
            hydra = yaml.safe_load((self.path / HYDRA_DIR / "hydra.yaml").read_text())
            group_choices = hydra["hydra"]["runtime"]["choices"]
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            group_choices = {}
        if isinstance(group_choices, dict) and group_choices.get(key) is not None:
            return str(group_choices[key])
        node: Any = self.config()
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return None if isinstance(node, (dict, list)) else str(node)

    def config(self) -> dict[str, Any]:
        """The resolved config (``config_resolved.yaml``); {} when the run has none."""
        if not self.config_file.is_file():
            return {}
        data = yaml.safe_load(self.config_file.read_text())
        return data if isinstance(data, dict) else {}

    def result(self) -> dict[str, Any] | None:
        """What the run reported when it ended (``result.json``), or None (still running, or killed)."""
        return _read_json(self.result_file)

    def info(self) -> RunInfo | None:
        """Which run this is (``run.json``: its id and parts); None for a run written before gptlab
        recorded it."""
        return read_run_info(self.path)

    def write_result(self, result: dict[str, Any]) -> Path:
        """Write ``result.json`` whole or not at all (a temporary file renamed over it; a full disk leaves no
        half-written file beside the old result), as strict JSON: its figures already converted
        (:func:`gptlab.runs.jsonfile.figures_as_json`), a NaN anywhere else raises ``ValueError``."""
        return write_json(self.result_file, result, sort_keys=True)

    def length_result(self) -> dict[str, Any] | None:
        """The length study's output (``eval_length/length.json``), or None; a diverged model's figures
        (written ``"inf"``, ``"nan"``: :mod:`gptlab.runs.jsonfile`) as floats, a missing one as None."""
        return figures_from_json(_read_json(length_file(self.path)))

    # ---- checkpoints -----------------------------------------------------------------------------
    def last_checkpoint(self) -> Path | None:
        """``checkpoints/last.ckpt`` when it holds a checkpoint, else None."""
        path = last_checkpoint(self.path)
        return path if checkpoint_kind(path) else None

    def best_checkpoints(self) -> list[Path]:
        """``best-*.ckpt`` of this run, best first: by the score the run recorded for each (``best.json``;
        for runs written before it, the score in the checkpoint's own state), newest first among equals and
        after those with a score; checkpoints older than the run's start (``run.json``) are another run's and
        left out, with a warning."""
        found = [p for p in self.checkpoint_dir.glob(BEST_GLOB) if checkpoint_kind(p)]
        started = self._started()
        if started is not None:
            foreign = [p for p in found if p.stat().st_mtime < started - 1.0]
            if foreign:
                logging.getLogger(__name__).warning(
                    "%s: %s predate(s) this run (started %s) and belong(s) to another run: not read",
                    self.path,
                    ", ".join(p.name for p in foreign),
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
                )
                found = [p for p in found if p not in foreign]
        return sorted(found, key=lambda p: (self._rank_of_best(p), -p.stat().st_mtime))

    def best_score(self, path: Path) -> float | None:
        """The score (``val/loss``) the run recorded for its best checkpoint ``path``; None when unknown."""
        recorded = read_best_scores(self.checkpoint_dir)
        if recorded is not None and Path(path).name in recorded.scores:
            return recorded.scores[Path(path).name]
        return score_in_checkpoint(Path(path))

    def _rank_of_best(self, path: Path) -> float:
        score = self.best_score(path)
        if score is None or score != score:  # unknown or NaN: after every known score
            return float("inf")
        recorded = read_best_scores(self.checkpoint_dir)
        return -score if recorded is not None and recorded.mode == "max" else score

    def _started(self) -> float | None:
        """When the run's first part started (``run.json``), seconds since the epoch; None when unknown."""
        info = self.info()
        started = info.parts[0].get("started_unix") if info and info.parts else None
        return float(started) if isinstance(started, (int, float)) else None

    def preemption_checkpoints(self) -> list[Path]:
        """SLURM's ``hpc_ckpt_<n>.ckpt``, newest first."""
        found = [p for p in self.path.glob(HPC_GLOB) if checkpoint_kind(p)]
        return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)

    def resume_checkpoint(self) -> Path | None:
        """The checkpoint a resumed run continues from: the newest of ``last.ckpt`` and the preemption
        checkpoints."""
        candidates = [p for p in (self.last_checkpoint(), *self.preemption_checkpoints()) if p is not None]
        return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None

    def set_aside_checkpoints(self) -> list[Path]:
        """Sharded checkpoints that a kill between the two renames of a save left set aside
        (``checkpoints/.<name>.old``); a resumed run puts them back before it loads."""
        return sorted(self.checkpoint_dir.glob(".*.old"))

    def checkpoint(self, which: str = "last") -> Path | None:
        """``which="last"``: last.ckpt, else the best; ``"best"``: the best, else last.ckpt; then any
        other checkpoint in ``checkpoints/``. None when the run holds none."""
        if which not in ("last", "best"):
            raise ValueError(f"which={which!r}: use 'last' or 'best'")
        last, best = [self.last_checkpoint()], self.best_checkpoints()
        ordered = [*best, *last] if which == "best" else [*last, *best]
        others = sorted(p for p in self.checkpoint_dir.glob("*.ckpt") if checkpoint_kind(p))
        return next((p for p in [*ordered, *others] if p is not None), None)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def git_commit(where: Path | None = None) -> str:
    """The commit of the git checkout ``where`` (default: the one gptlab is imported from), with ``+dirty``
    when tracked files have uncommitted changes; ``unknown`` outside a checkout."""
    where = where or Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def find_run_dirs(root: str | Path, max_depth: int = 6) -> list[Path]:
    """The run directories at or below ``root`` (those holding ``.hydra/overrides.yaml`` or
    ``config_resolved.yaml``), in job order (``<sweep>/2`` before ``<sweep>/10``). Empty when ``root`` is
    not a directory."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    base = len(root.parts)
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        if Run.is_run_dir(here):
            found.append(here)
        if len(here.parts) - base >= max_depth:
            dirnames[:] = []
        else:
            # dot folders (.hydra, .replaced) never hold runs of this sweep
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
    return sorted(found, key=lambda p: _job_order(root, p))


def run_of_path(path: str | Path) -> Run | None:
    """The run a run directory or a checkpoint (file or sharded directory) belongs to, if any."""
    path = Path(path)
    for candidate in (path, path.parent, path.parent.parent):
        if Run.is_run_dir(candidate) or (candidate / HYDRA_DIR).is_dir():
            return Run(candidate)
    return None


def remove_path(path: Path) -> None:
    """Remove a file, a link or a directory tree, whichever ``path`` is; nothing where there is nothing."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
