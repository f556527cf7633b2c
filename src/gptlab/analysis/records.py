"""One run's choices and figures, read from its directory (or from the W&B API).

What each run chose comes from ``.hydra/overrides.yaml``; its metrics from ``csv/metrics.csv`` when there is
one, else from the W&B run file (``wandb/*/run-*.wandb``, read by :mod:`gptlab.tracking.wandb_files`); and
the figures of its evaluation outputs (``eval_length/length.json``, ...) from the readers declared in
:data:`OUTPUTS`: a new evaluation adds its columns to every comparison by adding one reader there.
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
    from gptlab.eval import long_context

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

    @property
    def final_val_loss(self) -> float | None:
        return self.val_loss[-1][1] if self.val_loss else None


def _float(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _series_from_csv(path: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            for key, value in row.items():
                number = _float(value)
                if key not in ("step", "epoch") and number is not None:
                    series.setdefault(key, []).append((step, number))
    return series


def _series_from_wandb(files: list[Path]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    # A resumed run may have written more than one file: later files continue the curve.
    for file in sorted(files, key=lambda p: p.stat().st_mtime):
        run = read_run(file)
        for row in run.history:
            step = int(row.get("trainer/global_step", row.get("_step", 0)))
            for key, value in row.items():
                number = _float(value)
                if not key.startswith("_") and key != "trainer/global_step" and number is not None:
                    series.setdefault(key, []).append((step, number))
        if "parameters/total" in run.summary and "parameters/total" not in series:
            series["parameters/total"] = [(0, float(run.summary["parameters/total"]))]
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


def read_run_dir(run_dir: str | Path, source: str = "auto") -> RunRecord:
    """Read one run directory; raises DataError when it holds no metrics.

    ``source``: ``csv`` (``csv/metrics.csv``), ``wandb`` (the W&B run file), or ``auto`` (CSV when present)."""
    if source not in SOURCES:
        raise DataError(f"source={source!r} is not one of {SOURCES}: use --source csv, wandb or auto.")
    run = Run(Path(run_dir))
    csv_files = sorted(run.path.glob("csv/**/metrics.csv")) if source in ("auto", "csv") else []
    wandb_files = find_runs(run.path) if source in ("auto", "wandb") else []
    if csv_files:
        series, source = _series_from_csv(csv_files[0]), "csv"
    elif wandb_files:
        series, source = _series_from_wandb(wandb_files), "wandb"
    else:
        wanted = {"auto": "neither csv/metrics.csv nor a W&B run file", "csv": "no csv/metrics.csv"}
        raise DataError(f"{run.path} holds no metrics ({wanted.get(source, 'no W&B run file')})")
    record = _fill(RunRecord(path=run.path, overrides=run.choices(), source=source), series)
    for output in OUTPUTS:
        record.outputs[output.name] = output.read(run)
    record.commit = (run.result() or {}).get("git_commit")
    if not record.val_loss:
        raise DataError(f"{run.path} logged no val/loss (did it fail before its first validation?)")
    return record


HISTORY_KEYS = ("val/loss", "val/ppl", "train/tokens_per_second", "train/mfu")


def record_from_api_run(run: Any) -> RunRecord:
    """A run of the W&B public API (``wandb.Api().runs(...)``) as a RunRecord: its overrides from the
    ``sweep`` config section that gptlab logs, its metrics from the run's history."""
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
    return record
