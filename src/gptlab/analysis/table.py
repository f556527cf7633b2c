"""Runs grouped by choice (the runs that differ only by seed), and the markdown table of the choices.

Rows are ordered by the metric, mean final validation loss, best first. Each row says whether it differs
from a reference choice beyond seed noise (:mod:`gptlab.analysis.stats`): the best row, or a baseline given
as ``pos=learned``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gptlab.analysis.records import OUTPUTS, RunRecord
from gptlab.analysis.stats import DEFAULT_ALPHA, verdict
from gptlab.errors import DataError
from gptlab.runs.naming import is_silent, split_override, sweep_overrides_from_dir, swept_keys_of

SEED_KEY = "seed"


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
    outputs: dict[str, dict[str, float | None]] = field(default_factory=dict)  # output -> header -> mean
    significance: str = ""  # against the reference row: "worse, p=0.003", "cannot tell (1 seed)", ...

    @property
    def length_ppl(self) -> dict[str, float | None]:
        return self.outputs.get("length", {})

    @property
    def passkey(self) -> dict[str, float | None]:
        return self.outputs.get("passkey", {})

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.choice.items()) or "all runs"

    @property
    def final_losses(self) -> list[float]:
        return [r.final_val_loss for r in self.runs if r.final_val_loss is not None]


def _human(n: float) -> str:
    from gptlab.model.counting import human  # the one number formatter (1.62M)

    return human(n)


@dataclass(frozen=True)
class MetricColumn:
    header: str
    value: Callable[[Row], float | None]
    fmt: Callable[[float], str]


# The run metrics that follow val/loss in the table, in this order.
METRIC_COLUMNS = [
    MetricColumn("val/ppl", lambda r: r.val_ppl, "{:.2f}".format),
    MetricColumn("tokens/s", lambda r: r.tokens_per_second, "{:,.0f}".format),
    MetricColumn("MFU", lambda r: r.mfu, lambda v: f"{100 * v:.1f}%"),
    MetricColumn("parameters", lambda r: r.parameters, _human),
]


def swept_keys(runs: list[RunRecord], sweep_dir: Path | None = None) -> list[str]:
    """The overrides the sweep varies, seed excluded: keys whose values differ between runs, and keys the
    sweep's ``multirun.yaml`` sweeps (so a choice with a single finished run still shows its key)."""
    keys: list[str] = []
    for run in runs:
        for key in run.overrides:
            if key not in keys and not is_silent(key) and len({r.overrides.get(key) for r in runs}) > 1:
                keys.append(key)
    if sweep_dir is not None:
        for key in swept_keys_of(sweep_overrides_from_dir(sweep_dir)):
            if key not in keys:
                keys.append(key)
    return [k for k in keys if k != SEED_KEY]


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize(
    runs: list[RunRecord], keys: list[str], baseline: str | None = None, alpha: float = DEFAULT_ALPHA
) -> list[Row]:
    """One row per choice (runs equal on ``keys``), sorted by mean final validation loss, each with its
    verdict against the best row or the ``baseline`` choice (``"pos=learned"``)."""
    groups: dict[tuple, list[RunRecord]] = {}
    for run in runs:
        groups.setdefault(tuple(run.overrides.get(k, "") for k in keys), []).append(run)
    rows = []
    for values, members in groups.items():
        losses = [r.final_val_loss for r in members if r.final_val_loss is not None]
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
                outputs={
                    name: {h: _mean([r.outputs.get(name, {}).get(h) for r in members]) for h in headers}
                    for name, headers in _output_headers(members).items()
                },
            )
        )
    rows.sort(key=lambda r: r.val_loss_mean)
    reference = reference_row(rows, baseline)
    for row in rows:
        row.significance = (
            "reference" if row is reference else verdict(row.final_losses, reference.final_losses, alpha)
        )
    return rows


def reference_row(rows: list[Row], baseline: str | None) -> Row:
    """The best row, or the row of the ``baseline`` choice (``"pos=learned"``, ``"pos=rope activation=gelu"``)."""
    if not baseline:
        return rows[0]
    wanted = dict(split_override(part) for part in baseline.split())
    matches = [r for r in rows if all(r.choice.get(k) == v for k, v in wanted.items())]
    if len(matches) != 1:
        choices = ", ".join(r.label for r in rows)
        raise DataError(
            f"--baseline {baseline!r} matches {len(matches)} of the choices ({choices}): give one of them, "
            "e.g. --baseline pos=learned."
        )
    return matches[0]


def _short(value: str) -> str:
    """A searched float to 4 significant digits (0.0018858046576709494 -> 0.001886)."""
    try:
        number = float(value)
    except ValueError:
        return value
    return f"{number:.4g}" if "." in value and len(value) > 8 else value


def _output_headers(runs: list[RunRecord]) -> dict[str, list[str]]:
    """{output name: its headers present in any of ``runs``, in the output's order}, in declared order."""
    found = {}
    for output in OUTPUTS:
        headers = {h for r in runs for h in r.outputs.get(output.name, {})}
        if headers:
            found[output.name] = sorted(headers, key=output.order)
    return found


def output_columns(rows: list[Row]) -> list[tuple[str, str, str, str]]:
    """(output name, header, format, unavailable text) of the output columns of the table."""
    headers = _output_headers([r for row in rows for r in row.runs])
    return [(o.name, h, o.fmt, o.unavailable) for o in OUTPUTS for h in headers.get(o.name, [])]


def _output_cell(value: float | None, fmt: str, unavailable: str) -> str:
    return unavailable if value is None else fmt.format(value)


def markdown_table(rows: list[Row], keys: list[str], reference: str = "best") -> str:
    """A markdown table, best first: the choice, seeds, final val/loss (mean ± std over seeds), the verdict
    against the reference, the metric columns and the evaluation-output columns."""
    extra = output_columns(rows)
    header = [
        "#",
        *(keys or ["runs"]),
        "seeds",
        "val/loss",
        f"vs {reference}",
        *(c.header for c in METRIC_COLUMNS),
        *(h for _, h, _, _ in extra),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, row in enumerate(rows, 1):
        loss = f"{row.val_loss_mean:.4f}" + (
            f" ± {row.val_loss_std:.4f}" if row.val_loss_std is not None else ""
        )
        metrics = [c.value(row) for c in METRIC_COLUMNS]
        cells = [
            str(i),
            *([_short(row.choice.get(k, "")) for k in keys] if keys else ["all"]),
            str(len(row.runs)),
            loss,
            row.significance,
            *("-" if v is None else c.fmt(v) for c, v in zip(METRIC_COLUMNS, metrics)),
            *(_output_cell(row.outputs.get(name, {}).get(h), fmt, na) for name, h, fmt, na in extra),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
