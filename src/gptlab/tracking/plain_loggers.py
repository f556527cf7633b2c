"""Experiment loggers for a training loop that is not Lightning's (``task=word2vec``), written without
Lightning, and what every task asks of its loggers (building them from the ``logger`` node, the W&B run id,
closing the W&B run).

Importing Lightning costs a few seconds a process, longer than word2vec's training on a corpus of a few
hundred thousand words. The ``logger`` config node names the Lightning-backed factories of
:mod:`gptlab.tracking.loggers` (the GPT task's Trainer takes those); a plain loop asks
:func:`instantiate_loggers` with ``lightning=False`` and gets the same logger from the same node, built here:

- :class:`CSVMetricsLogger`: ``<save_dir>/csv/metrics.csv`` in the format Lightning's CSVLogger writes (a
  ``step`` column, the columns sorted by name, the header rewritten when a column appears, csv's ``\\r\\n``
  line ends), continued across a resume; what scripts/compare.py and :mod:`gptlab.comparison.records` read;
- :class:`WandbRunLogger`: ``wandb.init`` with the project, group, name, tags and run id the Lightning
  logger would pass (:func:`wandb_init_args`, shared with it), offline unless the user is logged in, its
  curves against ``trainer/global_step``, and always a run of its own;
- :class:`TensorBoardRunLogger`: torch's ``SummaryWriter`` in ``<save_dir>/tensorboard/``.

They all have the small interface a plain loop uses: ``log_metrics(metrics, step)``,
``log_hyperparams(params)``, ``save()``, ``finalize(status)``, ``save_dir`` and ``version``. A plain loop
logs at the number of steps done (the row of step n is written after n steps), so a resumed run from the
checkpoint of step n keeps the rows up to n and logs n + 1 on.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import secrets
import string
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gptlab.tracking.wandb_check import check_wandb_online, wandb_mode

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.csv"
SAMPLES_FILE = "samples.tsv"  # SampleGeneration's text, beside metrics.csv
HPARAMS_FILE = "hparams.yaml"
#: The factories of the ``logger`` config nodes (conf/logger/*.yaml), Lightning's loggers behind them.
LIGHTNING_FACTORIES = "gptlab.tracking.loggers"
FACTORY_NAMES = ("csv_logger", "wandb_logger", "tensorboard_logger")


# ---- CSV -------------------------------------------------------------------------------------------------
def drop_rows(path: Path, delimiter: str, line_end: str, keep: Callable[[int], bool]) -> int:
    """Rewrite ``path`` (a table with a ``step`` column, one row a line: metric values and samples with their
    tabs and newlines escaped) without the rows whose step ``keep`` rejects, atomically (a temporary file
    renamed over it); the rows kept are kept byte for byte. Rows without a readable step are kept. Returns
    the number of rows dropped; a file with nothing to drop is left untouched."""
    if not path.is_file():
        return 0
    header, *rows = path.read_bytes().decode().split(line_end)
    names = header.split(delimiter)
    if "step" not in names:
        return 0
    column = names.index("step")

    def kept(row: str) -> bool:
        try:
            return bool(keep(int(float(row.split(delimiter)[column]))))
        except (IndexError, ValueError):
            return True  # the empty string after the last line end among them

    remaining = [row for row in rows if kept(row)]
    if len(remaining) == len(rows):
        return 0
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(line_end.join([header, *remaining]).encode())
    os.replace(tmp, path)
    return len(rows) - len(remaining)


class CSVMetricsLogger:
    """Metrics as ``<save_dir>/<name>/metrics.csv``, written as Lightning's CSVLogger writes them (see the
    module doc). Rows are kept in memory and appended every :attr:`flush_rows` rows, at each ``save()`` (a
    checkpoint) and at ``finalize``. An existing file is continued, its columns read from its header; with
    ``resumed_at`` (the step of the checkpoint a resumed run continues from) the rows a stopped or killed part
    logged after that step are dropped first: the resumed run logs those steps again."""

    flush_rows = 100

    def __init__(
        self,
        save_dir: str | Path,
        name: str = "csv",
        version: str | int | None = "",
        resumed_at: int | None = None,
    ) -> None:
        self.save_dir = str(save_dir)
        self.name = name
        self.version = "" if version is None else str(version)
        self.log_dir = str(Path(save_dir) / name / self.version)
        self.metrics_file_path = str(Path(self.log_dir) / METRICS_FILE)
        self.resumed_at = resumed_at
        self._rows: list[dict[str, Any]] = []
        self._keys: list[str] | None = None  # read from the file on the first write

    def _open(self) -> list[str]:
        if self._keys is None:
            path = Path(self.metrics_file_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            if self.resumed_at is not None:
                at = self.resumed_at
                dropped = drop_rows(path, ",", "\r\n", lambda step: step <= at)
                if dropped:
                    log.info(
                        "%s: %d rows logged after step %d (the checkpoint this run resumes from) dropped; "
                        "they are logged again as the steps are trained again",
                        path,
                        dropped,
                        at,
                    )
            header = path.read_text().partition("\n")[0].strip() if path.is_file() else ""
            self._keys = sorted(k for k in header.split(",") if k)
        return self._keys

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """``hparams.yaml`` beside the metrics, as Lightning's CSVLogger writes it."""
        from omegaconf import OmegaConf

        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(dict(params)), Path(self.log_dir) / HPARAMS_FILE)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        # a tensor as its number, anything else as it is (an int stays an int), as Lightning's writer does
        row: dict[str, Any] = {k: v.item() if hasattr(v, "item") else v for k, v in metrics.items()}
        row["step"] = len(self._rows) if step is None else int(step)
        self._rows.append(row)
        if len(self._rows) >= self.flush_rows:
            self.save()

    def save(self) -> None:
        """Append the rows logged since the last save; a new column rewrites the file under the new header."""
        if not self._rows:
            return
        keys = self._open()
        path = Path(self.metrics_file_path)
        new = {k for row in self._rows for k in row} - set(keys)
        exists = path.is_file()
        if new:
            keys[:] = sorted([*keys, *new])
            if exists:
                with path.open(newline="") as f:
                    earlier = list(csv.DictReader(f))
                with path.open("w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=keys)
                    writer.writeheader()
                    writer.writerows(earlier)
        with path.open("a" if exists else "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            if not exists:
                writer.writeheader()
            writer.writerows(self._rows)
        self._rows = []

    def finalize(self, status: str) -> None:
        self.save()


# ---- W&B -------------------------------------------------------------------------------------------------
def wandb_init_args(
    save_dir: str,
    project: str = "gptlab",
    entity: str | None = None,
    name: str | None = None,
    group: str | None = None,
    job_type: str | None = None,  # None: derived (train, sweep or search), as conf/logger/wandb.yaml's null
    tags: Sequence[str] | None = (),
    id: str | None = None,
    mode: str | None = "auto",
    **kwargs: Any,
) -> tuple[str, dict[str, Any]]:
    """(the mode W&B runs in, the arguments of ``wandb.init``) for a run whose files live in ``save_dir``
    (``<save_dir>/wandb/offline-run-*`` offline, uploaded later with ``wandb sync <that folder>``). Online
    without a key (or with one the server rejects) is refused here, before the run starts.

    ``name``, ``group`` and ``job_type`` left null are derived from the Hydra overrides (see
    :mod:`gptlab.runs.naming`): a sweep is one group, each run is named by what it varies, and every
    chosen override (``pos=rope``, ``seed=1``) is a tag, added to ``tags``."""
    from gptlab.runs.naming import labels_from_hydra

    resolved = wandb_mode(mode)
    check_wandb_online(mode)  # no key, a rejected one, no server: refused now, not after a 90 s hang
    labels = labels_from_hydra()
    tags = list(dict.fromkeys([*(tags or []), *labels.tags]))
    # In the run's config, so the W&B UI can group runs that differ only by seed (sweep.group_key).
    kwargs.setdefault("config", {"sweep": labels.as_config()})
    # A run of its own even where the process has another open (wandb.init would otherwise hand that one back).
    kwargs.setdefault("reinit", "create_new")
    kwargs.setdefault("resume", "allow")
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    os.environ["WANDB_MODE"] = resolved  # respected by wandb.init in this process and its children
    os.environ.setdefault("WANDB_SILENT", "true")
    if resolved == "online":
        log.info("W&B: logging online to project %s", project)
    init = {
        "name": name or labels.name,
        "project": project,
        "dir": save_dir,
        "id": id,
        "entity": entity,
        "group": group or labels.group,
        "job_type": job_type or labels.job_type,
        "tags": list(tags) if tags else None,
        "mode": resolved,
        **kwargs,
    }
    return resolved, init


class WandbRunLogger:
    """A W&B run opened by ``wandb.init`` when first used, always a run of its own (``reinit="create_new"``:
    a run the process already has open, a notebook's or an earlier in-process run's, is left as it is and
    gets none of this run's records). Metrics are logged with ``trainer/global_step`` as their step metric, as
    Lightning's WandbLogger logs them, so both kinds of run read alike (:mod:`gptlab.tracking.wandb_runs`).

    :meth:`open_in_background` opens the run in a thread instead: importing wandb, starting its service
    process and ``wandb.init`` take one to two seconds, longer than word2vec's training on a small corpus, and
    they then overlap the training. The config and metrics logged meanwhile are held and sent in order once
    the run is open; whatever needs the run itself (``experiment``, ``finalize``) waits for it, and an error
    of ``wandb.init`` is raised there."""

    def __init__(self, init: Mapping[str, Any]) -> None:
        self._wandb_init = dict(init)
        self._experiment: Any = None
        self.save_dir = str(self._wandb_init.get("dir"))
        self.name = self._wandb_init.get("project")
        self._opening: threading.Thread | None = None
        self._open_error: BaseException | None = None
        self._held: list[tuple[str, dict[str, Any]]] = []  # ("config" | "log", values) while opening

    def _open(self) -> None:
        import wandb

        run = wandb.init(**{**self._wandb_init, "reinit": "create_new"})
        run.define_metric("trainer/global_step")
        run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
        self._experiment = run

    def open_in_background(self) -> None:
        """Start opening the run in a thread (see the class doc). Its id is chosen here when the run is new
        (8 characters of [a-z0-9], as wandb's own), so :attr:`version` is known at once."""
        if self._experiment is not None or self._opening is not None:
            return
        if not self._wandb_init.get("id"):
            alphabet = string.ascii_lowercase + string.digits
            self._wandb_init["id"] = "".join(secrets.choice(alphabet) for _ in range(8))

        def open_run() -> None:
            try:
                self._open()
            except BaseException as e:  # raised in the caller's thread by _wait
                self._open_error = e

        self._opening = threading.Thread(target=open_run, name="gptlab-wandb-init", daemon=True)
        self._opening.start()

    def _still_opening(self) -> bool:
        return self._opening is not None and self._opening.is_alive()

    def _wait(self) -> None:
        """Wait for a run being opened in the background, then send what was held, in order."""
        if self._opening is None:
            return
        self._opening.join()
        self._opening = None
        if self._open_error is not None:
            error, self._open_error, self._held = self._open_error, None, []
            raise error
        held, self._held = self._held, []
        for kind, values in held:
            if kind == "config":
                self._experiment.config.update(values, allow_val_change=True)
            else:
                self._experiment.log(values)

    @property
    def experiment(self) -> Any:
        self._wait()
        if self._experiment is None:
            self._open()
        return self._experiment

    @property
    def version(self) -> str | None:
        """The W&B run id: the open run's, else the one it was asked to continue (or was given)."""
        run_id = self._experiment.id if self._experiment is not None else self._wandb_init.get("id")
        return str(run_id) if run_id else None

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        values = _json_safe(dict(params))
        if self._still_opening():
            self._held.append(("config", values))
        else:
            self.experiment.config.update(values, allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        values = dict(metrics)
        if step is not None:
            values["trainer/global_step"] = step
        if self._still_opening():
            self._held.append(("log", values))
        else:
            self.experiment.log(values)

    def save(self) -> None:
        pass  # W&B writes its records as they come

    def finalize(self, status: str) -> None:
        """Wait for a run being opened and send what it holds; the run itself is closed by finish_loggers,
        with the run's exit status."""
        self._wait()


def _json_safe(params: dict[str, Any]) -> dict[str, Any]:
    def safe(value: Any) -> bool:
        try:
            json.dumps(value)
            return True
        except (TypeError, ValueError, OverflowError):
            return False

    return {k: v if safe(v) else str(v) for k, v in params.items()}


# ---- TensorBoard -----------------------------------------------------------------------------------------
class TensorBoardRunLogger:
    """TensorBoard event files in ``<save_dir>/<name>/``, through torch's ``SummaryWriter`` (opened when first
    used). A resumed run passes ``purge_step``: TensorBoard hides the events an earlier part logged from that
    step on, which this run logs again. The config is in ``config_resolved.yaml``; it is not logged here."""

    def __init__(
        self,
        save_dir: str | Path,
        name: str = "tensorboard",
        version: str | int | None = "",
        purge_step: int | None = None,
    ) -> None:
        self.save_dir = str(save_dir)
        self.name = name
        self.version = "" if version is None else str(version)
        self.log_dir = str(Path(save_dir) / name / self.version)
        self.purge_step = purge_step
        self._experiment: Any = None

    @property
    def experiment(self) -> Any:
        if self._experiment is None:
            from torch.utils.tensorboard import SummaryWriter

            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            self._experiment = SummaryWriter(log_dir=self.log_dir, purge_step=self.purge_step)
        return self._experiment

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.experiment.add_scalar(key, float(value), global_step=step)

    def save(self) -> None:
        if self._experiment is not None:
            self._experiment.flush()

    def finalize(self, status: str) -> None:
        if self._experiment is not None:
            self._experiment.close()
            self._experiment = None


PLAIN_LOGGERS = (CSVMetricsLogger, WandbRunLogger, TensorBoardRunLogger)


# ---- the factories a plain loop gets in place of conf/logger's ---------------------------------------------
def csv_logger(
    save_dir: str, name: str = "csv", version: str | int | None = "", resumed_at: int | None = None
) -> CSVMetricsLogger:
    """Metrics as ``<save_dir>/<name>/metrics.csv``: needs nothing, read by scripts/compare.py."""
    return CSVMetricsLogger(save_dir, name, version, resumed_at)


def wandb_logger(save_dir: str, log_model: bool = False, **kwargs: Any) -> WandbRunLogger:
    """The W&B run of :func:`wandb_init_args` (``log_model`` is the Lightning logger's: checkpoints as
    artifacts; a plain loop has none to log)."""
    _, init = wandb_init_args(save_dir, **kwargs)
    return WandbRunLogger(init)


def tensorboard_logger(
    save_dir: str, name: str = "tensorboard", version: str | int | None = "", purge_step: int | None = None
) -> TensorBoardRunLogger:
    return TensorBoardRunLogger(save_dir, name, version, purge_step)


# ---- what a task asks of its loggers ---------------------------------------------------------------------
def instantiate_loggers(
    nodes: Any, wandb_run_id: str | None = None, resumed_at: int | None = None, lightning: bool = True
) -> list[Any]:
    """The loggers of the ``logger`` node (each a ``_target_`` node); with ``wandb_run_id`` the W&B logger
    continues that run (a resumed run's curves go on in the same W&B run); with ``resumed_at`` (the step of
    the checkpoint a resumed run continues from) the CSV logger drops the rows logged after it, and TensorBoard
    hides the events logged after it.

    ``lightning=False`` (a plain loop): gptlab's own logger nodes are built by this module's factories of the
    same name, so that no Lightning is imported; a node naming any other ``_target_`` is built as it is."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from gptlab.errors import ConfigError

    loggers: list[Any] = []
    for _, node in nodes.items():
        if node is None or "_target_" not in node:
            continue
        module, _, factory = str(node["_target_"]).rpartition(".")
        own = module == LIGHTNING_FACTORIES and factory in FACTORY_NAMES
        extra: dict[str, Any] = {}
        if own and not lightning:
            extra["_target_"] = f"{__name__}.{factory}"
        if own and wandb_run_id and factory == "wandb_logger":
            extra.update(id=wandb_run_id, resume="allow")
        elif own and resumed_at is not None and factory == "csv_logger":
            extra["resumed_at"] = resumed_at
        elif own and resumed_at is not None and factory == "tensorboard_logger":
            # rows are logged at the optimizer steps done: the first step the resumed run logs again
            extra["purge_step"] = resumed_at + 1
        try:
            loggers.append(instantiate(node, **extra))
        except InstantiationException as e:
            if isinstance(e.__cause__, ConfigError):  # a refusal (W&B online without a key) as itself
                raise e.__cause__ from None
            raise
    return loggers


def is_wandb_logger(logger: Any) -> bool:
    """A W&B logger of either kind; Lightning's class is looked for only where Lightning is imported already
    (a process without it holds none of its loggers)."""
    if isinstance(logger, WandbRunLogger):
        return True
    module = sys.modules.get("lightning.pytorch.loggers.wandb")
    return module is not None and isinstance(logger, module.WandbLogger)


def wandb_run_id(loggers: list[Any]) -> str | None:
    """The W&B run id of the W&B logger among ``loggers``; None when there is none."""
    for lg in loggers:
        if is_wandb_logger(lg) and lg.version:
            return str(lg.version)
    return None


def finish_loggers(loggers: list[Any], failed: bool) -> None:
    """Close this job's W&B run, so that the next job of a multirun starts its own, and write what a plain
    logger still holds (a failed run's rows too). The logger's own run is closed, not ``wandb.run``: in a
    process that opened another run before (a notebook, a test session) the global run may be that other one,
    and this run's last records would stay unwritten."""
    for lg in loggers:
        if isinstance(lg, PLAIN_LOGGERS):
            lg.finalize("failed" if failed else "success")
        run = getattr(lg, "_experiment", None) if is_wandb_logger(lg) else None
        if run is not None:
            run.finish(exit_code=1 if failed else 0)
