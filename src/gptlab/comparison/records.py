"""One run's choices and figures, read from its directory (or from the W&B API).

What each run chose comes from ``.hydra/overrides.yaml``; its metrics from ``csv/metrics.csv`` when there is
one, else from the W&B run file (``wandb/*/run-*.wandb``, read by :mod:`gptlab.tracking.wandb_files`); and
the figures of its evaluation outputs (``eval_length/length.json``, ...) from the readers declared in
:data:`OUTPUTS`: a new evaluation adds its columns to every comparison by adding one reader there.

Every record says which run it read (``run.json``'s id), whether that run finished (``result.json``), and
at which step it is; where a directory holds traces of more than one run (W&B files of two runs, a metrics
file whose steps start over), the record reads one of them and says so in ``notes``.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptlab.errors import DataError
from gptlab.runs.layout import Run
from gptlab.runs.naming import split_override
from gptlab.tracking.wandb_files import find_runs, read_run

SOURCES = ("auto", "csv", "wandb")
FINISHED, STOPPED, FAILED, RUNNING, KILLED = "finished", "stopped", "failed", "running", "killed"


@dataclass(frozen=True)
class OutputColumns:
    """Table columns read from a run's evaluation outputs: ``read(run)`` gives ``{header: value}``, a value
    of None where the run's output says it cannot be measured (shown as ``unavailable``), and no key where
    the run has no such output. ``order`` sorts the headers."""

    name: str
    read: Callable[[Run], dict[str, float | None]]
    fmt: str = "{:.2f}"
    unavailable: str = "n/a"
    order: Callable[[str], Any] = str


def _factor_of(header: str) -> float:
    """``"ppl@2x"`` -> 2.0."""
    return float(header.split("@", 1)[1].rstrip("x"))


def length_perplexities(run: Run) -> dict[str, float | None]:
    """``ppl@1x``, ``ppl@2x``, ... of the scheme as trained, from ``eval_length/length.json``; None where
    the scheme cannot run at that length."""
    result = run.length_result()
    if not result:
        return {}
    entries = (result.get("variants") or {}).get(result.get("pos"), {})
    out: dict[str, float | None] = {}
    for factor in result.get("factors", []):
        entry = entries.get(str(factor), {})
        ppl = entry.get("ppl")
        if ppl is None and entry.get("loss") is not None:
            ppl = math.exp(entry["loss"])
        out[f"ppl@{factor}x"] = _float(ppl)
    return out


def passkey_accuracy(run: Run) -> dict[str, float | None]:
    """``passkey@1x``, ... (retrieval accuracy over depths) from ``eval_length/passkey.json``."""
    from gptlab.evaluation import long_context

    return long_context.read_passkey(run.path)


# The evaluation outputs that become columns, in this order.
OUTPUTS: list[OutputColumns] = [
    OutputColumns("length", length_perplexities, order=_factor_of),
    OutputColumns("passkey", passkey_accuracy, order=_factor_of),
]


@dataclass
class RunRecord:
    """One run's choices and figures."""

    path: Path
    overrides: dict[str, str]
    val_loss: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) at each validation
    val_ppl: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    parameters: float | None = None
    outputs: dict[str, dict[str, float | None]] = field(
        default_factory=dict
    )  # output name -> header -> value
    source: str = ""
    commit: str | None = None
    run_id: str | None = None
    status: str = FINISHED  # finished, stopped, failed, running, killed (see RunRecord.describe_status)
    step: int | None = None  # optimizer steps done: result.json's, else the last logged step's
    max_steps: int | None = None
    notes: list[str] = field(default_factory=list)  # what the reader found and chose (more than one run, ...)

    @property
    def final_val_loss(self) -> float | None:
        return self.val_loss[-1][1] if self.val_loss else None

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def describe_status(self) -> str:
        """``finished``, or what stopped it and where: ``killed at step 40 of 320``, ``running (step
        40 of 320)``..."""
        where = f"step {self.step}" + (f" of {self.max_steps}" if self.max_steps else "")
        return {
            FINISHED: FINISHED,
            STOPPED: f"stopped by a signal at {where}",
            FAILED: f"failed at {where}",
            RUNNING: f"running ({where})",
            KILLED: f"killed at {where} (no result.json)",
        }.get(self.status, f"{self.status} at {where}")


def _float(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# Logged once when training starts (training/metrics.py), at the step it starts from: 0 for a new run, the
# checkpoint's step for a resumed one.
START_MARKER = "model/flops_per_token"


def _one_run_of(rows: list[tuple[int, dict[str, float]]], where: Path, notes: list[str]) -> list:
    """The rows of the last run in a metrics file that holds several: each start of training logs
    :data:`START_MARKER` at the step it starts from, so a start at step 0 after the first begins a second
    run (written into the same directory by an older gptlab), while a resumed run starts later."""
    starts = [i for i, (step, values) in enumerate(rows) if START_MARKER in values and step == 0]
    if len(starts) > 1:
        notes.append(
            f"{where} holds {len(starts)} runs (training started at step 0 {len(starts)} times); read the last"
        )
        return rows[starts[-1] :]
    return rows


def _series(rows: list[tuple[int, dict[str, float]]]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for step, values in rows:
        for key, value in values.items():
            series.setdefault(key, []).append((step, value))
    return series


def _series_from_csv(path: Path, notes: list[str]) -> dict[str, list[tuple[int, float]]]:
    rows = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            values = {k: v for k, v in ((k, _float(x)) for k, x in row.items()) if v is not None}
            rows.append((step, {k: v for k, v in values.items() if k not in ("step", "epoch")}))
    return _series(_one_run_of(rows, path, notes))


def _series_from_wandb(
    files: list[Path], notes: list[str], wanted_id: str | None = None
) -> dict[str, list[tuple[int, float]]]:
    """The series of one W&B run: the one ``wanted_id`` names, else the newest. A resumed run continues its
    W&B run, so several files of one id are one curve, in the order they were written."""
    runs = sorted((read_run(f) for f in files), key=lambda r: r.path.stat().st_mtime)
    ids = list(dict.fromkeys(r.run_id for r in runs))
    chosen = wanted_id if wanted_id in ids else ids[-1]
    if len(ids) > 1:
        notes.append(f"{len(ids)} W&B runs ({', '.join(ids)}) in one run directory; read {chosen}")
    rows: list[tuple[int, dict[str, float]]] = []
    summary: dict[str, Any] = {}
    for run in (r for r in runs if r.run_id == chosen):
        for row in run.history:
            step = int(row.get("trainer/global_step", row.get("_step", 0)))
            values = {
                k: _float(v) for k, v in row.items() if not k.startswith("_") and k != "trainer/global_step"
            }
            rows.append((step, {k: v for k, v in values.items() if v is not None}))
        summary.update(run.summary)
    series = _series(rows)
    if "parameters/total" in summary and "parameters/total" not in series:
        series["parameters/total"] = [(0, float(summary["parameters/total"]))]
    return series


def _fill(record: RunRecord, series: dict[str, list[tuple[int, float]]]) -> RunRecord:
    # One value per step: a validation logged twice at one step (a resumed run) keeps the later one.
    record.val_loss = sorted(dict(series.get("val/loss", [])).items())
    ppl = sorted(dict(series.get("val/ppl", [])).items())
    record.val_ppl = ppl[-1][1] if ppl else None
    record.tokens_per_second = _median([v for _, v in series.get("train/tokens_per_second", [])])
    record.mfu = _median([v for _, v in series.get("train/mfu", [])])
    params = series.get("parameters/total")
    record.parameters = params[-1][1] if params else None
    return record


def _status(run: Run, record: RunRecord, series: dict[str, list[tuple[int, float]]]) -> None:
    """Whether the run finished, and its step: from ``result.json`` when it wrote one (also for a run
    stopped by a signal or failed), else from its process (``run.json``: still alive?) and its last
    logged step."""
    from gptlab.runs.layout import read_run_info

    info = read_run_info(run.path)
    result = run.result() or {}
    record.run_id = info.run_id if info else None
    record.commit = result.get("git_commit")
    max_steps = run.setting("trainer.max_steps")
    record.max_steps = int(max_steps) if max_steps and max_steps.isdigit() else None
    if result and info and result.get("run_id") not in (None, info.run_id):
        record.notes.append(
            f"result.json is of run {result.get('run_id')}, run.json of {info.run_id}: the result is not read"
        )
        result = {}
    if result:
        record.step = int(result.get("global_step") or 0)
        if result.get("finished"):
            record.status = FINISHED
        elif result.get("failed"):
            record.status = FAILED
        else:
            record.status = STOPPED
        return
    logged = [s for values in series.values() for s, _ in values]
    record.step = max(logged) + 1 if logged else 0  # Lightning logs after step n as step n - 1
    record.status = RUNNING if info is not None and info.alive() else KILLED


def read_run_dir(run_dir: str | Path, source: str = "auto") -> RunRecord:
    """Read one run directory; raises DataError when it holds no metrics.

    ``source``: ``csv`` (``csv/metrics.csv``), ``wandb`` (the W&B run file), or ``auto`` (CSV when present).
    The record says whether the run finished (``status``, ``step``) and what the reader had to choose."""
    if source not in SOURCES:
        raise DataError(f"source={source!r} is not one of {SOURCES}: use --source csv, wandb or auto.")
    run = Run(Path(run_dir))
    csv_files = sorted(run.path.glob("csv/**/metrics.csv")) if source in ("auto", "csv") else []
    wandb_files = find_runs(run.path) if source in ("auto", "wandb") else []
    notes: list[str] = []
    if csv_files:
        series, source = _series_from_csv(csv_files[0], notes), "csv"
    elif wandb_files:
        wanted = (run.result() or {}).get("wandb_run_id")
        series, source = _series_from_wandb(wandb_files, notes, wanted), "wandb"
    else:
        wanted = {"auto": "neither csv/metrics.csv nor a W&B run file", "csv": "no csv/metrics.csv"}
        raise DataError(f"{run.path} holds no metrics ({wanted.get(source, 'no W&B run file')})")
    record = _fill(RunRecord(path=run.path, overrides=run.choices(), source=source, notes=notes), series)
    for output in OUTPUTS:
        record.outputs[output.name] = output.read(run)
    _status(run, record, series)
    if not record.val_loss:
        raise DataError(
            f"{run.path} logged no val/loss ({record.describe_status()}: did it stop before its first "
            "validation?)"
        )
    return record


HISTORY_KEYS = ("val/loss", "val/ppl", "train/tokens_per_second", "train/mfu")


def record_from_api_run(run: Any) -> RunRecord:
    """A run of the W&B public API (one of ``gptlab.tracking.wandb_api.group_runs``) as a RunRecord: its
    overrides from the ``sweep`` config section that gptlab logs, its metrics from the run's history."""
    overrides = (run.config.get("sweep") or {}).get("overrides") or []
    series: dict[str, list[tuple[int, float]]] = {}
    for key in HISTORY_KEYS:
        for row in run.scan_history(keys=["trainer/global_step", key]):
            value = _float(row.get(key))
            if value is not None:
                series.setdefault(key, []).append((int(row["trainer/global_step"]), value))
    record = RunRecord(
        path=Path(str(run.path if isinstance(run.path, str) else "/".join(run.path))),
        overrides=dict(split_override(str(o)) for o in overrides),
        source="wandb-api",
    )
    _fill(record, series)
    record.parameters = _float(run.summary.get("parameters/total"))
    # W&B's own state of the run: finished, running, crashed (killed or lost), failed (exit code != 0)
    state = str(getattr(run, "state", FINISHED))
    record.status = {"finished": FINISHED, "running": RUNNING, "crashed": KILLED, "failed": FAILED}.get(
        state, state
    )
    logged = [step for values in series.values() for step, _ in values]
    record.step = max(logged) + 1 if logged else None
    max_steps = (run.config.get("trainer") or {}).get("max_steps")
    record.max_steps = int(max_steps) if isinstance(max_steps, int) else None
    return record
