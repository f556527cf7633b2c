"""Experiment loggers: W&B (online when logged in, offline files otherwise), CSV and TensorBoard."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from gptlab.tracking.plain_loggers import SAMPLES_FILE, drop_rows, wandb_init_args
from gptlab.tracking.wandb_check import wandb_logged_in as wandb_logged_in  # its home has no Lightning
from gptlab.tracking.wandb_check import wandb_mode as wandb_mode

log = logging.getLogger(__name__)


def wandb_logger(save_dir: str, log_model: bool = False, **kwargs: Any) -> WandbLogger:
    """A Lightning WandbLogger whose files live in the run directory, its project, name, group, tags and mode
    as :func:`gptlab.tracking.plain_loggers.wandb_init_args` derives them (the same for a plain loop's W&B
    logger). Offline runs are written under ``<save_dir>/wandb/offline-run-*`` and can be uploaded later
    with ``wandb sync <that folder>``."""
    resolved, init = wandb_init_args(save_dir, **kwargs)
    return OwnRunWandbLogger(
        save_dir=init.pop("dir"),
        project=init.pop("project"),
        name=init.pop("name"),
        id=init.pop("id"),
        offline=resolved == "offline",
        log_model=log_model and resolved == "online",
        **init,
    )


class OwnRunWandbLogger(WandbLogger):
    """Lightning's WandbLogger, except that a W&B run already open in this process (a notebook's, or one an
    earlier in-process run left open) is not reused: Lightning's logger would write this run's curves into
    that run, and wandb.init (without ``reinit="create_new"``) would hand that run back. This one opens a run
    of its own beside it. Lightning passes ``anonymous=None`` to wandb.init when it is not set, which wandb
    0.31 answers with a warning on every run ("The anonymous setting has no effect"): left out unless set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        import wandb

        if self._experiment is None and wandb.run is not None:
            run = wandb.init(**{**self._wandb_init, "reinit": "create_new"})
            run.define_metric("trainer/global_step")
            run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
            self._experiment = run
        return super().experiment


class ContinuedCSVWriter(ExperimentWriter):
    """Lightning's CSV writer, continuing an existing ``metrics.csv`` (its columns read from the header)
    instead of deleting it. A module-level class, so that ``ddp_spawn`` can pickle the logger."""

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if path.is_file():
            header = path.read_text().partition("\n")[0].strip()
            self.metrics_keys = sorted(k for k in header.split(",") if k)

    def drop_rows_after(self, resumed_at: int) -> int:
        """Remove the rows that a stopped or killed part logged after the checkpoint a resumed run continues
        from (``resumed_at``, its global step): the resumed run trains those steps again and logs them anew.
        Both files count steps as ``trainer.global_step`` does (the row of optimizer step n says n), so the
        rows kept are those up to ``resumed_at``. Returns the number of metric rows dropped; a file with nothing
        to drop is left untouched."""
        # Lightning writes metrics.csv with csv's own line ends (\r\n); samples.tsv has \n.
        dropped = drop_rows(Path(self.metrics_file_path), ",", "\r\n", lambda step: step <= resumed_at)
        drop_rows(Path(self.log_dir) / SAMPLES_FILE, "\t", "\n", lambda step: step <= resumed_at)
        return dropped


class ContinuedCSVLogger(CSVLogger):
    """Lightning's CSVLogger deletes an existing ``metrics.csv`` when it starts; a resumed run continues the
    file instead, so it holds the whole curve, each step once: the rows the earlier part logged after the
    checkpoint (``resumed_at``) are dropped before the resumed run logs those steps again."""

    resumed_at: int | None = None  # set by csv_logger for a resumed run

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            writer = ContinuedCSVWriter(log_dir=self.log_dir)
            if self.resumed_at is not None:
                dropped = writer.drop_rows_after(self.resumed_at)
                if dropped:
                    log.info(
                        "%s: %d rows logged after step %d (the checkpoint this run resumes from) dropped; "
                        "they are logged again as the steps are trained again",
                        writer.metrics_file_path,
                        dropped,
                        self.resumed_at,
                    )
            self._experiment = writer
        return self._experiment


def csv_logger(
    save_dir: str, name: str = "csv", version: str | int | None = "", resumed_at: int | None = None
) -> CSVLogger:
    """Metrics as ``<save_dir>/<name>/metrics.csv``: needs nothing, read by scripts/compare.py."""
    logger = ContinuedCSVLogger(save_dir=save_dir, name=name, version=version)
    logger.resumed_at = resumed_at
    return logger


def tensorboard_logger(
    save_dir: str, name: str = "tensorboard", version: str | int | None = "", purge_step: int | None = None
) -> Logger:
    """TensorBoard event files in ``<save_dir>/<name>/`` (``tensorboard --logdir <save_dir>``). A resumed run
    passes ``purge_step`` (the step after its checkpoint's): TensorBoard hides the events an earlier part
    logged from that step on, which this run logs again."""
    extra: dict[str, Any] = {"purge_step": purge_step} if purge_step is not None else {}
    return TensorBoardLogger(save_dir=save_dir, name=name, version=version, default_hp_metric=False, **extra)


def log_text_samples(trainer: L.Trainer, columns: list[str], rows: list[list[Any]], new: int = 1) -> None:
    """Log generated samples with every logger that can hold text: W&B the whole table, the others its last
    ``new`` rows (those added since the last call)."""
    added = rows[-new:]
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_text(key="samples", columns=columns, data=rows, step=trainer.global_step)
        elif isinstance(logger, CSVLogger):
            path = Path(logger.log_dir) / SAMPLES_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                if path.stat().st_size == 0:
                    f.write("\t".join(columns) + "\n")
                for row in added:
                    f.write("\t".join(str(v).replace("\t", " ").replace("\n", "\\n") for v in row) + "\n")
        elif isinstance(logger, TensorBoardLogger):
            header = " | ".join(columns)
            body = "\n".join(
                "| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |"
                for row in added
            )
            table = f"| {header} |\n|{'---|' * len(columns)}\n{body}"
            logger.experiment.add_text("samples", table, global_step=trainer.global_step)


class WandbRunIdInCheckpoint(L.Callback):
    """Records the W&B run id in each checkpoint, so a resumed run continues the same W&B run."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        for lg in trainer.loggers:
            if isinstance(lg, WandbLogger) and lg.version:
                checkpoint["wandb_run_id"] = str(lg.version)


# ---- what the GPT task asks of its loggers (the rest: gptlab.tracking.plain_loggers) ------------------
def update_wandb_summary(loggers: list[Logger], values: dict[str, float]) -> None:
    """Add ``values`` to the W&B run's summary (the figures its table and comparisons show)."""
    for lg in loggers:
        if isinstance(lg, WandbLogger):
            lg.experiment.summary.update(values)


def logger_lines(loggers: list[Logger]) -> list[str]:
    """Where each logger wrote, one line each, for the run's closing report."""
    lines = []
    for lg in loggers:
        if isinstance(lg, WandbLogger):
            folder = Path(lg.experiment.dir).parent
            if lg.experiment.settings._offline:
                lines.append(f"  W&B offline run: {folder}  (upload: wandb sync {folder})")
            else:
                lines.append(f"  W&B run: {lg.experiment.url}")
        elif isinstance(lg, CSVLogger):
            lines.append(f"  metrics: {Path(lg.log_dir) / 'metrics.csv'}")
        elif isinstance(lg, TensorBoardLogger):
            folder = Path(lg.log_dir)  # without the trailing / of an empty version
            lines.append(f"  TensorBoard: {folder}  (view: tensorboard --logdir {folder})")
    return lines
