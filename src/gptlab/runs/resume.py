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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import OmegaConf

from gptlab.errors import CheckpointError, ConfigError
from gptlab.runs.checkpoints import RESUME_INSTEAD, load_checkpoint, model_config_dict
from gptlab.runs.layout import (
    ASIDE,
    HYDRA_DIR,
    HYDRA_PARTS_DIR,
    LAST_CHECKPOINT_PATH,
    STAGING,
    Run,
    checkpoint_dir,
    checkpoint_kind,
    find_run_dirs,
    remove_path,
    run_of_path,
)

log = logging.getLogger(__name__)

RESUME_KEYS = ("resume=", "+resume=", "++resume=")

__all__ = [
    "CheckpointError",
    "ResumePlan",
    "RunEntry",
    "choose_run_dir",
    "enter_run",
    "confirm_resume",
    "plan_resume",
    "register_resolvers",
]


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
    """The overrides that say what is trained, one value per key (the last, as Hydra applies them; a sweep
    job's overrides.yaml holds only that one), sorted: ``resume=`` and ``overwrite=`` say how a run starts,
    and the progress display's keys (``callbacks.progress_bar.*``) how it is shown."""
    from gptlab.runs.naming import is_display_only, split_override

    settings = dict(split_override(item) for item in overrides)
    return sorted(
        f"{k}={v}" for k, v in settings.items() if k not in ("resume", "overwrite") and not is_display_only(k)
    )


@dataclass
class _Resumable:
    """A run under the search root with a checkpoint to continue from: what ``resume=auto`` compares."""

    path: Path
    mtime: float  # its checkpoint's
    settings: list[str]  # comparable(its first command's overrides)
    parts: list[list[str]]  # comparable(each later part's overrides)


def _resumable_runs(root: Path) -> list[_Resumable]:
    """Every run under ``root`` that holds a checkpoint to continue from, read once per ``resume=auto``."""
    found = []
    for path in find_run_dirs(root, max_depth=5):
        run = Run(path)
        # A checkpoint set aside by a kill mid-swap counts: train.run puts it back before it resumes. So does
        # a best checkpoint alone (a run stopped before its first last checkpoint): the run is found, and
        # checkpoint_to_resume refuses it naming that checkpoint, as resume=<run dir> does, rather than a new
        # run starting beside it unsaid.
        ckpt = run.resume_checkpoint() or next(iter(run.set_aside_checkpoints()), None) or _newest_best(run)
        saved = run.overrides()
        if ckpt is None or saved is None:
            continue
        parts = [comparable(p) for p in run.part_overrides()]
        found.append(_Resumable(path, ckpt.stat().st_mtime, comparable(saved), parts))
    return found


def find_run_to_continue(
    overrides: list[str], root: Path, runs: list[_Resumable] | None = None
) -> Path | None:
    """The newest run under ``root`` (or of ``runs``, read from it) started with the same overrides
    (``resume=`` aside) that holds a checkpoint to continue from, or None."""
    wanted = comparable(overrides)
    same = [r for r in (_resumable_runs(root) if runs is None else runs) if wanted in (r.settings, *r.parts)]
    return max(same, key=lambda r: r.mtime).path if same else None


# A new run directory that resume=auto chose -> what it says of the run that nearly matched (said once the
# run's logging is set up, by checkpoint_to_resume; the resolver runs while Hydra composes the config).
_NEAR_MISSES: dict[str, str] = {}
NEAR_MISS_KEYS = 2  # a run whose overrides differ in this many keys or fewer is named


def nearly_matching_run(overrides: list[str], root: Path, runs: list[_Resumable] | None = None) -> str | None:
    """What to say when ``resume=auto`` finds no run with the command's overrides: the newest run under
    ``root`` with a checkpoint whose overrides differ in the fewest keys (at most :data:`NEAR_MISS_KEYS`),
    the keys and their values there and now, and the ``resume=<run>`` that continues it; None when no run is
    that close. The classic case: the command of a finished run with a larger ``trainer.max_steps``, meant to
    train it longer, which ``resume=auto`` takes for another run."""
    from gptlab.runs.naming import split_override

    wanted = dict(map(split_override, comparable(overrides)))
    best: tuple[tuple[int, float], Path, dict[str, str], list[str]] | None = None
    for run in _resumable_runs(root) if runs is None else runs:
        have = dict(map(split_override, run.settings))
        differ = sorted(k for k in wanted.keys() | have.keys() if wanted.get(k) != have.get(k))
        if not differ or len(differ) > NEAR_MISS_KEYS:
            continue
        rank = (len(differ), -run.mtime)
        if best is None or rank < best[0]:
            best = (rank, run.path, have, differ)
    if best is None:
        return None
    _, path, have, differ = best
    changes = "; ".join(
        f"{k}={have.get(k, '(its default)')} there, {wanted.get(k, '(its default)')} now" for k in differ
    )
    return (
        f"resume=auto found no run started with these overrides, so this is a new run. The run {path} differs "
        f"only in {changes}. To continue that run with this command's settings instead (to train it longer, "
        f"say), stop this one (Ctrl-C) and give that run's directory: resume={path}"
    )


def choose_run_dir(task_overrides: Any, search_root: str, default: str) -> str:
    """The ``gptlab_run_dir`` resolver behind ``hydra.run.dir``: the directory of the run that ``resume=``
    continues, else ``default`` (a new run directory)."""
    if OmegaConf.is_config(task_overrides):
        task_overrides = OmegaConf.to_container(task_overrides)
    overrides = [str(x) for x in task_overrides or []]
    value = resume_value(overrides)
    if value is None:
        return unused(default)
    if value == "auto":
        runs = _resumable_runs(Path(search_root))  # read once, for the match and the near miss
        found = find_run_to_continue(overrides, Path(search_root), runs)
        if found is not None:
            return str(found)
        new = unused(default)
        near = nearly_matching_run(overrides, Path(search_root), runs)
        if near is not None:
            _NEAR_MISSES[str(Path(new).resolve())] = near
        return new
    run = run_of_path(Path(value).expanduser())
    return str(run.path) if run is not None else unused(default)


def unused(directory: str) -> str:
    """``directory``, or ``directory-1``, ``-2``... when a run started in the same second already took it
    (the default run directory is named by the second): the first that this process creates and claims
    itself (:func:`gptlab.runs.identity.take_new_run_dir`); once the job has its directory, that one. A rank
    that a launcher started (DDP's other ranks re-run the command line) takes ``directory`` as it is: rank 0
    made it for all of them."""
    from gptlab.runs.identity import launched_rank, take_new_run_dir

    if launched_rank():
        return directory
    own = this_jobs_output_dir()  # Hydra resolves hydra.run.dir again later (Lightning's DDP launch reads it)
    base = Path(directory).absolute()
    if own is not None and (
        own == base or (own.parent == base.parent and own.name.startswith(base.name + "-"))
    ):
        return str(own)
    return take_new_run_dir(directory)


def this_jobs_output_dir() -> Path | None:
    """The output directory Hydra has already given the running job, if any."""
    from hydra.core.hydra_config import HydraConfig

    try:
        own = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
    except Exception:  # the job's runtime node is not filled in yet
        return None
    return Path(own).absolute() if own else None


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("gptlab_run_dir"):
        OmegaConf.register_new_resolver("gptlab_run_dir", choose_run_dir)


# ---- entering the run directory: once per part of a run ----------------------------------------------------


@dataclass(frozen=True)
class RunEntry:
    """How this part of a run entered its directory, decided once (:func:`enter_run`)."""

    run_dir: Path
    continued: bool  # it continues the run already there: run.json gets a part, the claim that run's id
    checkpoint: Path | None  # what ``resume=`` selects to load; None for a new run


def restore_interrupted_saves(checkpoint_dir: Path) -> list[Path]:
    """Undo what a kill during a directory swap or a save left in ``checkpoint_dir``: a checkpoint set
    aside and not replaced is put back; unfinished staging directories are removed. Returns the
    checkpoints put back."""
    restored: list[Path] = []
    if not checkpoint_dir.is_dir():
        return restored
    aside_suffix = ASIDE.format(name="")[1:]  # ".old"
    for aside in checkpoint_dir.glob(ASIDE.format(name="*")):
        target = checkpoint_dir / aside.name[1 : -len(aside_suffix)]
        try:
            if target.exists():
                remove_path(aside)  # the swap finished; only the cleanup was lost
            else:
                os.rename(aside, target)
                restored.append(target)
                log.warning("A save was interrupted mid-swap: restored the previous %s", target)
        except FileNotFoundError:  # another rank got there first
            continue
    for staging in checkpoint_dir.glob(STAGING.format(name="*")):
        try:
            remove_path(staging)
        except FileNotFoundError:
            continue
    return restored


def enter_run(
    run_dir: Path,
    resume: Any,
    overwrite: bool,
    *,
    include_hydra: bool = False,
    log: Any = None,
    pick_checkpoint: bool = True,
) -> RunEntry:
    """The one entry of a run into its directory, for a new run and a resumed one alike: whether it
    continues the run there (:func:`gptlab.runs.identity.continues_a_run`) is decided here, once, and the
    directory claimed accordingly: held by this process (a live holder refused by name), and, for a run that
    does not continue the one there, made its own (:func:`gptlab.runs.identity.claim_run_dir`: refused, or
    the old files moved aside). Once this process holds the directory, a
    sharded checkpoint that a kill left set aside mid-swap is put back (:func:`restore_interrupted_saves`). With ``pick_checkpoint`` (the task's entry; Hydra's
    callback enters before the job without it) the checkpoint to continue from is then chosen (:func:`checkpoint_to_resume`: an unusable ``resume=`` is refused
    here, before any data is read). Holding and claiming twice in one process (Hydra's callback, then the
    task) is harmless: the second finds the directory held and already this run's."""
    from gptlab.runs.identity import claim_run_dir, continues_a_run, hold_run_dir, launched_rank

    run_dir = Path(run_dir)
    continued = continues_a_run(resume, run_dir)
    hold_run_dir(run_dir, continued)
    restore_interrupted_saves(checkpoint_dir(run_dir))
    if not continued and not launched_rank():
        claim_run_dir(run_dir, resume, overwrite, include_hydra=include_hydra, log=log)
    checkpoint = checkpoint_to_resume(resume, run_dir) if pick_checkpoint else None
    return RunEntry(run_dir, continued, checkpoint)


# ---- which checkpoint, and is it usable ----------------------------------------------------------------


@dataclass
class ResumePlan:
    ckpt_path: Path
    global_step: int
    wandb_run_id: str | None
    # what this part changes from the checkpoint's settings (``{"data.batch_size": [4, 8]}``: the checkpoint's
    # value, then this command's), recorded in its part of result.json
    changes: dict[str, list[Any]] = field(default_factory=dict)
    # what confirm_resume needs once the data is prepared: the checkpoint without its weights and optimizer
    # state, its model config, the warnings that tell the changes, and whether the vocabulary was compared
    checkpoint: dict[str, Any] = field(default_factory=dict, repr=False)
    saved_model: dict[str, Any] = field(default_factory=dict, repr=False)
    warnings: list[str] = field(default_factory=list, repr=False)
    vocab_checked: bool = True


# Compares a loaded checkpoint (without its weights) and its path with the command's settings, before the
# data is prepared: raises a CheckpointError for a change a resume cannot make, returns those it makes
# (gptlab.training.resume_changes.ResumeChanges: ``applied`` and the ``warnings`` that tell them).
ConditionsCheck = Callable[[dict[str, Any], Path], Any]
# Compares the checkpoint with the prepared training data: raises a CheckpointError naming both if they differ.
DataCheck = Callable[[dict[str, Any], Path], None]


def _newest_best(run: Run) -> Path | None:
    """The newest best checkpoint of ``run`` (the one holding the most training), or None."""
    return max(run.best_checkpoints(), key=lambda p: p.stat().st_mtime, default=None)


def _best_hint(best: Path) -> str:
    """How a refusal of a run without a last checkpoint names its best checkpoint and the resume= that takes it. Not
    taken unasked: it was saved at a validation, perhaps well before the run stopped, and a run continued from
    it trains those steps again."""
    return (
        f" It holds {best.name} (a best checkpoint, saved at a validation): resume={best} continues from it."
    )


def checkpoint_to_resume(resume: Any, run_dir: Path) -> Path | None:
    """The checkpoint that ``resume`` (null, ``auto``, a run directory or a checkpoint) selects."""
    if resume in (None, False, "", "null", "none", "None"):
        return None
    if resume == "auto":
        ckpt = Run(run_dir).resume_checkpoint()
        best = _newest_best(Run(run_dir)) if ckpt is None else None
        if best is not None:
            raise CheckpointError(
                f"resume=auto: the run {run_dir}, started with these overrides, holds no "
                f"{LAST_CHECKPOINT_PATH} to continue from.{_best_hint(best)} Or start a new run beside it "
                "with resume=null."
            )
        if ckpt is None:
            near = _NEAR_MISSES.get(str(run_dir.resolve()))
            if near is not None:
                log.warning("%s", near)
            else:
                log.info(
                    "resume=auto: no earlier run with these overrides has a checkpoint; starting a new run."
                )
        return ckpt
    path = Path(str(resume)).expanduser()
    if path.is_dir() and checkpoint_kind(path) is None:  # a run directory, not a sharded checkpoint
        run = Run(path)
        ckpt = run.resume_checkpoint()
        if ckpt is None:
            # a run stopped before its first last checkpoint may hold a best checkpoint of a validation: name it
            best = _newest_best(run)
            hint = _best_hint(best) if best is not None else ""
            raise CheckpointError(
                f"resume={resume}: the directory holds no {LAST_CHECKPOINT_PATH} to continue from.{hint} Give a "
                "checkpoint (resume=<run>/checkpoints/<name>.ckpt), another run directory, or resume=auto."
            )
        return ckpt
    if not path.exists():
        raise CheckpointError(
            f"resume={resume}: no such file or directory. Give a checkpoint file, a run directory "
            "(outputs/runs/<date>/<time>), or resume=auto to continue the newest run with these overrides."
        )
    return path


def _flat(config: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """A model config's values by the override that sets each: ``n_layer`` -> ``model.n_layer``, a variant's
    node ``pos={"name": "rope", "base": 500.0}`` -> ``pos=rope``, ``pos.base``, the placement ->
    ``norm.placement``. Where ``other`` chooses another variant of a family, that family's options are left out
    (they belong to the variant, and the name already differs)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            same_variant = isinstance(other.get(key), dict) and other[key].get("name") == value.get("name")
            for option, v in value.items():
                if option == "name" or same_variant:
                    flat[key if option == "name" else f"{key}.{option}"] = v
        else:
            flat["norm.placement" if key == "norm_placement" else f"model.{key}"] = value
    return flat


def architecture_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each value that differs, by its override: ``model.n_embd: 32 in the checkpoint, 64 now``."""
    flat_saved, flat_current = _flat(saved, current), _flat(current, saved)
    return [
        f"{key}: {flat_saved.get(key)!r} in the checkpoint, {flat_current.get(key)!r} now"
        for key in sorted(set(flat_saved) | set(flat_current))
        if flat_saved.get(key) != flat_current.get(key)
    ]


def inspect_checkpoint(
    path: Path,
    model_config: Any,
    check: ConditionsCheck | None = None,
    ranks_check_shards: bool = False,
    vocab_known: bool = True,
) -> ResumePlan:
    """Check that ``path`` (a file or a sharded directory) is a readable gptlab checkpoint of the same model
    as ``model_config`` (a GPTConfig; its ``vocab_size`` is compared only when ``vocab_known``: a vocabulary
    fitted to the corpus is known once the data is prepared, and :func:`confirm_resume` compares it then);
    returns what the resumed run needs from it. Checkpoints written by earlier versions of gptlab hold the
    same keys and pass; one from elsewhere is refused here, by name, as is one whose bytes differ from the
    digest written with it (naming the intact checkpoints to resume from). ``check`` compares the rest of the
    command's settings (the processes, the batch, the loss, the optimizer, ...): all of it is known before
    the data is prepared, so a wrong command is refused before any text is tokenized. ``ranks_check_shards``:
    the ranks that load a sharded checkpoint hash its files, each its share (only the sizes are compared
    here)."""
    checkpoint = load_checkpoint(
        path, weights=False, use_instead=RESUME_INSTEAD, hash_shards=not ranks_check_shards
    )
    if checkpoint_kind(path) == "file" and "state_dict" not in checkpoint:
        raise CheckpointError(
            f"Checkpoint {path} is not a gptlab training checkpoint (it has no state_dict; keys: "
            f"{sorted(checkpoint)[:8]}). Resume from a checkpoint that train.py wrote."
        )
    from gptlab.model.config import GPTConfig

    raw = model_config_dict(checkpoint, path)
    try:
        saved = GPTConfig.from_dict(raw).to_dict()
    except CheckpointError:
        raise
    except ConfigError as e:
        raise CheckpointError(f"Checkpoint {path} holds a model config this version cannot build: {e}") from e
    refusal: CheckpointError | None = None
    outcome: Any = None
    try:
        outcome = check(checkpoint, Path(path)) if check is not None else None
    except CheckpointError as e:
        refusal = e
    current = model_config.to_dict()
    if not vocab_known:
        current["vocab_size"] = saved.get("vocab_size")
    if "vocab_multiple" not in raw:
        _saved_before_vocab_padding(path, saved, current)
    # a fitted vocabulary follows the corpus and the tokenizer: a refusal of either names the cause
    _refuse_other_model(path, saved, current, keep_vocab=refusal is None)
    if refusal is not None:
        raise refusal
    wandb_run_id = checkpoint.get("wandb_run_id")
    light = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    return ResumePlan(
        Path(path),
        int(checkpoint.get("global_step", 0)),
        str(wandb_run_id) if wandb_run_id else None,
        dict(getattr(outcome, "applied", {}) or {}),
        checkpoint=light,
        saved_model=saved,
        warnings=list(getattr(outcome, "warnings", []) or []),
        vocab_checked=vocab_known,
    )


def _saved_before_vocab_padding(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """A checkpoint saved before ``model.vocab_multiple`` holds the token table (and head) with the vocabulary's
    rows: it resumes under any multiple (a file or a distributed checkpoint is padded as it loads; under
    ``model.vocab_multiple=1`` it is what the model stores), so the multiple is not compared. A DeepSpeed
    directory is the exception: DeepSpeed restores its optimizer's flat partitions of every parameter as they
    were saved, so rows cannot be added as it loads; it is refused before training with the multiple that
    matches it."""
    saved["vocab_multiple"] = current.get("vocab_multiple")
    vocab, multiple = int(saved.get("vocab_size") or 0), int(current.get("vocab_multiple") or 1)
    padded = -(-vocab // multiple) * multiple
    if checkpoint_kind(path) == "deepspeed" and padded != vocab:
        raise CheckpointError(
            f"Checkpoint {path} is a DeepSpeed checkpoint saved before model.vocab_multiple: its token table "
            f"and output layer hold the vocabulary's {vocab} rows, and DeepSpeed restores its optimizer's flat "
            f"partitions as they were saved, so they cannot be padded to {padded} rows as they load "
            f"(model.vocab_multiple={multiple}). Resume it with model.vocab_multiple=1 (the rows it was saved "
            "with); generation and evaluation read it as it is."
        )


def _refuse_other_model(path: Path, saved: dict[str, Any], current: dict[str, Any], keep_vocab: bool) -> None:
    """Refuse a checkpoint of another model than ``current``, naming each key that differs and the fix."""
    diffs = architecture_differences(saved, current)
    if not keep_vocab:
        diffs = [d for d in diffs if not d.startswith("model.vocab_size:")]
    if not diffs:
        return
    flat_saved, flat_current = _flat(saved, current), _flat(current, saved)
    fixes = [
        f"{k}={'null' if flat_saved[k] is None else flat_saved[k]}"
        for k in sorted(k for k in flat_saved if flat_saved[k] != flat_current.get(k))
        if k != "model.vocab_size"
    ]
    raise CheckpointError(
        f"Checkpoint {path} is from a different model: {'; '.join(diffs)}. Resume with the settings it was "
        f"trained with{' (' + ' '.join(fixes) + ')' if fixes else ''}, or start a new run without resume=."
    )


def plan_resume(
    ckpt: Path | None,
    model_config: Any,
    check: ConditionsCheck | None = None,
    ranks_check_shards: bool = False,
    vocab_known: bool = True,
) -> ResumePlan | None:
    """What a resumed run needs from its checkpoint (:attr:`RunEntry.checkpoint`), checked before the data is
    prepared (:func:`inspect_checkpoint`): None for a new run. ``ranks_check_shards``: the run's ranks will
    hash a sharded checkpoint's files between them when they load it. The plan is confirmed, once the data
    is prepared, by :func:`confirm_resume`."""
    if ckpt is None:
        return None
    return inspect_checkpoint(ckpt, model_config, check, ranks_check_shards, vocab_known)


def confirm_resume(
    plan: ResumePlan | None, model_config: Any, data_check: DataCheck | None = None
) -> ResumePlan | None:
    """The checks of a resume that need the prepared data: the training tokens (``data_check``), then a
    vocabulary fitted to them (``model_config``: the model as built for the prepared tokenizer). Then the
    changes the resume makes are told (their warnings), and where it continues from."""
    if plan is None:
        return None
    if data_check is not None:
        data_check(plan.checkpoint, plan.ckpt_path)  # the cause, before its consequence (the vocabulary)
    if not plan.vocab_checked:
        _refuse_other_model(plan.ckpt_path, plan.saved_model, model_config.to_dict(), keep_vocab=True)
    for line in plan.warnings:
        log.warning("%s", line)
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


def _refuse(message: str) -> None:
    import sys

    print(f"\ngptlab: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class CheckRunDirectory(HydraCallback):
    """A Hydra callback, before Hydra creates or writes the output directory: refuses one that cannot be
    written (with the fix, instead of a traceback from ``mkdir``), and one that already holds another run
    (:mod:`gptlab.runs.identity`), before Hydra rewrites that run's ``.hydra/``."""

    def _check(self, path: Any, key: str) -> None:
        reason = unwritable_reason(Path(str(path)))
        if reason:
            _refuse(
                f"the output directory {key}={path} cannot be created: {reason}. Choose a writable folder "
                f"with {key}=<dir>, run from a folder you can write to (runs go under ./outputs), or fix "
                "the permissions."
            )

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        from gptlab.runs.identity import RunDirectoryInUse, release_run_dir

        self._check(config.hydra.run.dir, "hydra.run.dir")
        run_dir = Path(str(config.hydra.run.dir))
        # A run's first command stays in its .hydra/ (on_job_start); a resume's files go beside it.
        first = run_dir / HYDRA_DIR
        self._first_part = {
            name: (first / name).read_bytes()
            for name in ("config.yaml", "hydra.yaml", "overrides.yaml")
            if (first / name).is_file()
        }
        try:
            # this process's claim first: of two runs started into one directory, one goes on, one stops here
            enter_run(
                run_dir,
                config.get("resume"),
                bool(config.get("overwrite")),
                include_hydra=True,
                log=log,
                pick_checkpoint=False,
            )
        except RunDirectoryInUse as e:
            release_run_dir(run_dir)  # refused: this process's own claim, if it took one, goes too
            _refuse(str(e))

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        """Hydra has just written this job's ``.hydra/`` files. A later part of a run (a resume) puts them in
        ``.hydra/parts/<time>/`` and gives the first part's back: ``.hydra/`` keeps the command that started
        the run, which ``resume=auto`` and the comparison read, also when this part is then refused."""
        stash: dict[str, bytes] = getattr(self, "_first_part", None) or {}
        self._first_part = {}
        if not stash:
            return
        hydra_dir = Path(str(config.hydra.runtime.output_dir)) / HYDRA_DIR
        if not hydra_dir.is_dir() or all(
            (hydra_dir / name).is_file() and (hydra_dir / name).read_bytes() == data
            for name, data in stash.items()
        ):
            return
        part = hydra_dir.parent / HYDRA_PARTS_DIR / time.strftime("%Y-%m-%d_%H-%M-%S")
        suffix = 0
        while True:
            candidate = part.with_name(f"{part.name}-{suffix}") if suffix else part
            try:
                candidate.mkdir(parents=True)
                break
            except FileExistsError:
                suffix += 1
        for name, data in stash.items():
            written = hydra_dir / name
            if written.is_file():
                os.replace(written, candidate / name)
            written.write_bytes(data)

    def on_job_end(self, config: Any, job_return: Any = None, **kwargs: Any) -> None:
        """The job's claim on its directory ends with the job (the next job of a sweep, or a later command,
        may start there), also when the task failed before it could release it."""
        from gptlab.runs.identity import release_run_dir

        release_run_dir(Path(str(config.hydra.runtime.output_dir)))

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from gptlab.runs.identity import RunDirectoryInUse, claim_sweep_dir

        self._check(config.hydra.sweep.dir, "hydra.sweep.dir")
        try:
            aside = claim_sweep_dir(
                Path(str(config.hydra.sweep.dir)), config.get("resume"), bool(config.get("overwrite"))
            )
        except RunDirectoryInUse as e:
            _refuse(str(e).replace("hydra.run.dir", "hydra.sweep.dir"))
        else:
            if aside is not None:
                log.warning("overwrite=true: the earlier sweep's jobs are moved to %s", aside)
