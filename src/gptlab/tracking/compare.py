"""Compare the runs of a sweep without a browser: validation-loss curves per choice with their spread over
seeds (a PNG), and a table sorted by final validation loss (markdown, also printed).

Runs are read from their directories: ``.hydra/overrides.yaml`` says what each run chose, the metrics come
from ``csv/metrics.csv`` when there is one, else from the W&B run file (``wandb/*/run-*.wandb``, read by
:mod:`gptlab.tracking.wandb_files`), and ``length_eval.json``, when present, adds perplexity at longer
contexts. Runs that differ only by ``seed`` form one row.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from gptlab.errors import DataError
from gptlab.eval import long_context
from gptlab.tracking.naming import is_silent, split_override, sweep_overrides_from_dir, swept_keys_of
from gptlab.tracking.wandb_files import find_runs, read_run

SEED_KEY = "seed"


@dataclass
class RunRecord:
    """One run's choices and metrics."""

    path: Path
    overrides: dict[str, str]
    val_loss: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) at each validation
    val_ppl: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    parameters: float | None = None
    length_ppl: dict[str, float | None] = field(default_factory=dict)  # "ppl@2x" -> perplexity (None: n/a)
    passkey: dict[str, float | None] = field(default_factory=dict)  # "passkey@2x" -> accuracy (None: n/a)
    source: str = ""

    @property
    def final_val_loss(self) -> float | None:
        return self.val_loss[-1][1] if self.val_loss else None


@dataclass
class Row:
    """One choice: the runs that differ only by seed, summarised."""

    choice: dict[str, str]
    runs: list[RunRecord]
    val_loss_mean: float
    val_loss_std: float | None
    val_ppl: float | None
    tokens_per_second: float | None
    mfu: float | None
    parameters: float | None
    length_ppl: dict[str, float | None]
    passkey: dict[str, float | None] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.choice.items()) or "all runs"


@dataclass
class Comparison:
    rows: list[Row]
    keys: list[str]
    table: str
    markdown_path: Path
    plot_path: Path
    skipped: list[tuple[Path, str]]


# ---- reading runs ---------------------------------------------------------------------------------------
def find_run_dirs(root: str | Path) -> list[Path]:
    """Every run directory below ``root`` (one holding ``.hydra/overrides.yaml``), in job order."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(
            f"{root} is not a directory: pass a sweep directory such as outputs/multirun/<date>/<time> "
            "(or a single run directory)."
        )
    found = sorted({p.parent.parent for p in root.glob("**/.hydra/overrides.yaml")})

    def order(path: Path) -> tuple:
        rel = path.relative_to(root).parts
        return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in rel)

    return sorted(found, key=order)


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


def _series_from_wandb(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    # A resumed run may have written more than one file: later files continue the curve.
    for file in sorted(find_runs(run_dir), key=lambda p: p.stat().st_mtime):
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


def read_length_eval(path: Path) -> dict[str, float | None]:
    """``length_eval.json`` -> {"ppl@1x": 8.2, "ppl@2x": 9.1, "ppl@4x": None, ...}; None where the scheme
    cannot run at that length."""
    data = json.loads(path.read_text())
    out: dict[str, float | None] = {}
    for entry in data.get("results", []):
        factor = entry.get("factor")
        name = f"ppl@{int(factor) if float(factor).is_integer() else factor}x"
        ppl = entry.get("ppl")
        if ppl is None and entry.get("loss") is not None:
            ppl = math.exp(entry["loss"])
        out[name] = _float(ppl)
    return out


SOURCES = ("auto", "csv", "wandb")


def read_run_dir(run_dir: str | Path, source: str = "auto") -> RunRecord:
    """Read one run directory; raises DataError when it holds no metrics.

    ``source``: ``csv`` (``csv/metrics.csv``), ``wandb`` (the W&B run file), or ``auto`` (CSV when present)."""
    if source not in SOURCES:
        raise DataError(f"source={source!r} is not one of {SOURCES}")
    run_dir = Path(run_dir)
    overrides = OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")
    pairs = dict(split_override(str(o)) for o in overrides)
    csv_files = sorted(run_dir.glob("csv/**/metrics.csv")) if source in ("auto", "csv") else []
    wandb_files = find_runs(run_dir) if source in ("auto", "wandb") else []
    if csv_files:
        series, source = _series_from_csv(csv_files[0]), "csv"
    elif wandb_files:
        series, source = _series_from_wandb(run_dir), "wandb"
    else:
        wanted = {"auto": "neither csv/metrics.csv nor a W&B run file", "csv": "no csv/metrics.csv"}
        raise DataError(f"{run_dir} holds no metrics ({wanted.get(source, 'no W&B run file')})")
    record = RunRecord(path=run_dir, overrides=pairs, source=source)
    record.val_loss = sorted(series.get("val/loss", []))
    ppl = sorted(series.get("val/ppl", []))
    record.val_ppl = ppl[-1][1] if ppl else None
    record.tokens_per_second = _median([v for _, v in series.get("train/tokens_per_second", [])])
    record.mfu = _median([v for _, v in series.get("train/mfu", [])])
    params = series.get("parameters/total")
    record.parameters = params[-1][1] if params else None
    if (run_dir / "length_eval.json").is_file():
        record.length_ppl = read_length_eval(run_dir / "length_eval.json")
    else:  # the length study of eval_length.enabled=true / scripts/eval_length.py
        record.length_ppl = long_context.read_length_study(run_dir)
    record.passkey = long_context.read_passkey(run_dir)
    if not record.val_loss:
        raise DataError(f"{run_dir} logged no val/loss (did it fail before its first validation?)")
    return record


# ---- grouping -------------------------------------------------------------------------------------------
def swept_keys(runs: list[RunRecord], sweep_dir: Path | None = None) -> list[str]:
    """The overrides the sweep varies, seed excluded: keys whose values differ between runs, and keys the
    sweep's ``multirun.yaml`` sweeps (so a choice with a single finished run still shows its key)."""
    keys: list[str] = []
    for run in runs:
        for key in run.overrides:
            if key not in keys and not is_silent(key):
                if len({r.overrides.get(key) for r in runs}) > 1:
                    keys.append(key)
    if sweep_dir is not None:
        for key in swept_keys_of(sweep_overrides_from_dir(sweep_dir)):
            if key not in keys:
                keys.append(key)
    return [k for k in keys if k != SEED_KEY]


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize(runs: list[RunRecord], keys: list[str]) -> list[Row]:
    """One row per choice (runs equal on ``keys``), sorted by mean final validation loss."""
    groups: dict[tuple, list[RunRecord]] = {}
    for run in runs:
        groups.setdefault(tuple(run.overrides.get(k, "") for k in keys), []).append(run)
    rows = []
    for values, members in groups.items():
        losses = [r.final_val_loss for r in members]
        length_keys = sorted(
            {k for r in members for k in r.length_ppl}, key=lambda s: float(s[4:-1])
        )  # "ppl@2x" -> 2.0
        rows.append(
            Row(
                choice=dict(zip(keys, values)),
                runs=members,
                val_loss_mean=statistics.fmean(losses),
                val_loss_std=statistics.stdev(losses) if len(losses) > 1 else None,
                val_ppl=_mean([r.val_ppl for r in members]),
                tokens_per_second=_mean([r.tokens_per_second for r in members]),
                mfu=_mean([r.mfu for r in members]),
                parameters=_mean([r.parameters for r in members]),
                length_ppl={k: _mean([r.length_ppl.get(k) for r in members]) for k in length_keys},
                passkey={
                    k: _mean([r.passkey.get(k) for r in members])
                    for k in sorted({k for r in members for k in r.passkey}, key=long_context.factor_of)
                },
            )
        )
    return sorted(rows, key=lambda r: r.val_loss_mean)


# ---- output ---------------------------------------------------------------------------------------------
def _human(n: float | None) -> str:
    from gptlab.model.counting import human

    return "-" if n is None else human(n)


def _short(value: str) -> str:
    """A searched float to 4 significant digits (0.0018858046576709494 -> 0.001886)."""
    number = _float(value)
    return f"{number:.4g}" if number is not None and "." in value and len(value) > 8 else value


def markdown_table(rows: list[Row], keys: list[str]) -> str:
    """A markdown table, best first: the choice, seeds, final val/loss (mean ± std over seeds), val/ppl,
    tokens/s, MFU, parameters, ``ppl@Nx`` columns where a length evaluation exists and ``passkey@Nx``
    (retrieval accuracy) where a passkey study exists."""
    length_cols = sorted({k for r in rows for k in r.length_ppl}, key=lambda s: float(s[4:-1]))
    passkey_cols = sorted({k for r in rows for k in r.passkey}, key=long_context.factor_of)
    choice_cols = keys or ["runs"]
    header = [
        "#",
        *choice_cols,
        "seeds",
        "val/loss",
        "val/ppl",
        "tokens/s",
        "MFU",
        "parameters",
        *length_cols,
        *passkey_cols,
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, row in enumerate(rows, 1):
        loss = f"{row.val_loss_mean:.4f}" + (
            f" ± {row.val_loss_std:.4f}" if row.val_loss_std is not None else ""
        )
        cells = [
            str(i),
            *([_short(row.choice.get(k, "")) for k in keys] if keys else ["all"]),
            str(len(row.runs)),
            loss,
            f"{row.val_ppl:.2f}" if row.val_ppl is not None else "-",
            f"{row.tokens_per_second:,.0f}" if row.tokens_per_second is not None else "-",
            f"{100 * row.mfu:.1f}%" if row.mfu is not None else "-",
            _human(row.parameters),
            *[
                f"{row.length_ppl[c]:.2f}" if row.length_ppl.get(c) is not None else "n/a"
                for c in length_cols
            ],
            *[f"{row.passkey[c]:.0%}" if row.passkey.get(c) is not None else "n/a" for c in passkey_cols],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_val_loss(rows: list[Row], path: Path, title: str = "") -> Path:
    """Validation loss against step, one line per choice: the mean over seeds at the steps every seed
    logged, and a band of ± one standard deviation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for row in rows:
        curves = [dict(r.val_loss) for r in row.runs]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        if not steps:
            continue
        means = [statistics.fmean(c[s] for c in curves) for s in steps]
        n = len(row.runs)
        label = f"{row.label} (n={n})"
        (line,) = ax.plot(steps, means, marker="o", markersize=3, label=label)
        if n > 1:
            stds = [statistics.stdev(c[s] for c in curves) for s in steps]
            ax.fill_between(
                steps,
                [m - s for m, s in zip(means, stds)],
                [m + s for m, s in zip(means, stds)],
                color=line.get_color(),
                alpha=0.2,
                linewidth=0,
            )
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title(title or "Validation loss: mean ± std over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_comparison(
    runs: list[RunRecord],
    out: Path,
    title: str,
    sweep_dir: Path | None = None,
    skipped: list[tuple[Path, str]] | None = None,
) -> Comparison:
    """Group ``runs`` by choice and write ``comparison.md`` and ``val_loss.png`` into ``out``."""
    skipped = skipped or []
    keys = swept_keys(runs, sweep_dir)
    rows = summarize(runs, keys)
    table = markdown_table(rows, keys)
    out.mkdir(parents=True, exist_ok=True)
    plot_path = plot_val_loss(rows, out / "val_loss.png", title=f"Validation loss, {title}")
    markdown_path = out / "comparison.md"
    notes = "".join(f"\n- skipped {p}: {m}" for p, m in skipped)
    long_context_plot = ""
    if any(row.length_ppl or row.passkey for row in rows):
        path = long_context.plot_rows(rows, out / "long_context.png")
        long_context_plot = f"\n\n![perplexity, loss by position and passkey retrieval]({path.name})"
    markdown_path.write_text(
        f"# {title}\n\n{len(runs)} runs, sorted by final validation loss (mean ± std over seeds)."
        f"\n\n{table}\n\n![validation loss]({plot_path.name}){long_context_plot}\n{notes}\n"
    )
    return Comparison(rows, keys, table, markdown_path, plot_path, skipped)


def compare(sweep_dir: str | Path, out_dir: str | Path | None = None, source: str = "auto") -> Comparison:
    """Read every run below ``sweep_dir``; write ``comparison.md`` and ``val_loss.png`` to ``out_dir``
    (default: the sweep directory). ``source``: where metrics are read from (see :func:`read_run_dir`)."""
    if source not in SOURCES:
        raise DataError(f"source={source!r} is not one of {SOURCES}: use --source csv, wandb or auto.")
    sweep_dir = Path(sweep_dir)
    run_dirs = find_run_dirs(sweep_dir)
    if not run_dirs:
        raise DataError(
            f"No run directories below {sweep_dir} (none holds .hydra/overrides.yaml): pass the directory a "
            "multirun printed, e.g. outputs/multirun/<date>/<time>."
        )
    runs, skipped = [], []
    for run_dir in run_dirs:
        try:
            runs.append(read_run_dir(run_dir, source))
        except DataError as e:
            skipped.append((run_dir, str(e)))
    if not runs:
        raise DataError(f"No run below {sweep_dir} has metrics: " + "; ".join(m for _, m in skipped))
    return write_comparison(runs, Path(out_dir) if out_dir else sweep_dir, str(sweep_dir), sweep_dir, skipped)


# ---- online runs ----------------------------------------------------------------------------------------
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
    record.val_loss = sorted(series.get("val/loss", []))
    record.val_ppl = sorted(series["val/ppl"])[-1][1] if series.get("val/ppl") else None
    record.tokens_per_second = _median([v for _, v in series.get("train/tokens_per_second", [])])
    record.mfu = _median([v for _, v in series.get("train/mfu", [])])
    record.parameters = _float(run.summary.get("parameters/total"))
    return record


def compare_online(project: str, group: str, out_dir: str | Path) -> Comparison:
    """Compare the runs of one W&B group (``project`` as ``entity/project``) through the W&B API; needs the
    network and a login."""
    import wandb

    api_runs = wandb.Api().runs(project, filters={"group": group})
    runs = [r for r in map(record_from_api_run, api_runs) if r.val_loss]
    if not runs:
        raise DataError(f"No run of W&B group {group!r} in {project} logged val/loss.")
    return write_comparison(runs, Path(out_dir), f"{project} {group}")
