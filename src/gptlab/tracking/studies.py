"""Study results logged to W&B: the length study's table and figures (with the passkey table), and the
lm-evaluation-harness table.

The studies themselves (gptlab.evaluation) know nothing of W&B: they hand over plain data (summary metrics,
table rows, figure paths) and this module makes the W&B objects. W&B and Lightning are imported inside the
functions, so importing a study imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StudyTable:
    """A table of a study's results, logged as a ``wandb.Table``: its column names and one list per row."""

    columns: list[str]
    rows: list[list[Any]]

    def to_wandb(self) -> Any:
        import wandb

        return wandb.Table(columns=list(self.columns), data=self.rows)


@dataclass(frozen=True)
class LengthStudy:
    """What a length study logs: its summary metrics, its table (logged as ``length/table``), its output
    files (the ``.png`` ones are logged as images ``length/<stem>``) and the passkey study's table
    (``passkey/table``; None when there was no passkey study)."""

    summary: dict[str, Any]
    table: StudyTable
    paths: Sequence[Path]
    passkey_table: StudyTable | None = None


def log_length_study_to_run(study: LengthStudy, run: Any) -> None:
    """Log the summary metrics, a table and the plots to an open W&B run."""
    import wandb

    run.summary.update(study.summary)
    extra = {"passkey/table": study.passkey_table.to_wandb()} if study.passkey_table is not None else {}
    run.log(
        {
            "length/table": study.table.to_wandb(),
            **{f"length/{p.stem}": wandb.Image(str(p)) for p in study.paths if p.suffix == ".png"},
            **extra,
        }
    )


def log_length_study(study: LengthStudy, loggers: Sequence[Any]) -> None:
    """Log the study to the W&B run of each W&B logger among a training run's Lightning loggers (none: nothing
    is logged)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger):
            log_length_study_to_run(study, logger.experiment)


def log_length_study_as_new_run(study: LengthStudy, run_dir: Path, config: dict[str, Any]) -> Path | None:
    """When the training run in ``run_dir`` logged to W&B, log the study as a new W&B run in the same project
    and group (the training run's id when it had no group), job type ``eval_length``, its config
    ``source_run_id`` and ``config``. Returns its folder (None: the run logged no W&B run, or W&B is
    disabled)."""
    from gptlab.tracking.wandb_check import wandb_mode
    from gptlab.tracking.wandb_runs import find_runs, read_run

    files = find_runs(run_dir / "wandb")
    if not files:
        return None
    import wandb

    source = read_run(files[-1])
    mode = wandb_mode("auto")
    if mode == "disabled":
        return None
    run = wandb.init(
        project=source.project or "gptlab",
        group=source.group or source.run_id,
        name=f"{source.name or source.run_id}-length",
        job_type="eval_length",
        dir=str(run_dir),
        mode=mode,
        config={"source_run_id": source.run_id, **config},
        reinit="create_new",  # a run of its own; another open run is left as it is
    )
    try:
        log_length_study_to_run(study, run)
        folder = Path(run.dir).parent
    finally:
        run.finish()
    return folder


def log_harness_results(metrics: dict[str, Any], table: StudyTable, run_dir: Path) -> Path | None:
    """Log the harness metrics (to the summary) and their table (``harness/table``) to the run's own W&B run
    (resumed by id, in the run's mode), or to a new run in ``run_dir`` when the run logged none. Returns the
    W&B run folder (None when W&B is disabled)."""
    import wandb

    from gptlab.tracking.wandb_check import wandb_mode
    from gptlab.tracking.wandb_runs import find_runs, read_run

    mode = wandb_mode("auto")
    if mode == "disabled":
        return None
    trained = [r for r in (read_run(p) for p in find_runs(run_dir / "wandb")) if r.job_type in ("train", "")]
    source = trained[-1] if trained else None
    init: dict[str, Any] = {"dir": str(run_dir), "mode": mode, "reinit": "create_new"}
    if source is not None:
        init.update(project=source.project or "gptlab", id=source.run_id, resume="allow")
    else:
        init.update(project="gptlab", name=f"{run_dir.name}-harness", job_type="eval_harness")
    wandb_run = wandb.init(**init)
    try:
        wandb_run.summary.update(metrics)
        wandb_run.log({"harness/table": table.to_wandb()})
        folder = Path(wandb_run.dir).parent
    finally:
        wandb_run.finish()
    return folder


def log_scores_and_figure(
    loggers: Sequence[Any], scores: dict[str, float], figures: dict[str, Path], step: int
) -> None:
    """Into the W&B run among ``loggers`` (Lightning's or a plain loop's), if any: ``scores`` into its summary
    (what its table shows) and each figure as an image under its key."""
    from gptlab.tracking.plain_loggers import is_wandb_logger

    for logger in loggers:
        if is_wandb_logger(logger):
            logger.experiment.summary.update(scores)
            if figures:
                import wandb

                logger.experiment.log({k: wandb.Image(str(p)) for k, p in figures.items()}, step=step)
