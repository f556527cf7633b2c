"""Runs grouped by condition, and the markdown table of the conditions.

A run's condition is what it set for every key that differs between the runs compared (its override, else
Hydra's choice for a group, else its resolved config value), the seed excepted and any key the reader names to
ignore: runs of one condition differ only by seed, and are its replicates. Rows are ordered by the metric,
mean final validation loss, best first. Each row says how far it lies from a reference condition and whether
that is beyond seed noise (:mod:`gptlab.comparison.stats`: Welch's test, Holm-adjusted over the table): the best
row, or a baseline given as ``pos=learned``. Only finished runs are ranked, unless asked otherwise; the
others are listed apart with their step. A condition with a diverged run (final validation loss non-finite,
or above the unigram entropy and far above where training starts: ``records.is_diverged``) keeps its row,
marked, after the others: it is neither tested nor a reference. An MFU above 100% is not a utilisation (the peak it was measured against was too low) and reads
``invalid (>100%)``, with a note under the table.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gptlab.comparison.records import OUTPUTS, RunRecord
from gptlab.comparison.stats import DEFAULT_ALPHA, Contrast, contrasts
from gptlab.errors import DataError
from gptlab.evaluation.long_context import format_perplexity, perplexity
from gptlab.runs.layout import Run
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
    parameters: float | None  # every weight of the model (an MoE's experts all counted)
    outputs: dict[str, dict[str, float | None]] = field(default_factory=dict)  # output -> header -> mean
    significance: str = ""  # against the reference row: "worse, p=0.003", "cannot tell (1 seed)", ...
    contrast: Contrast | None = None  # the difference to the reference, its interval and p-values
    mfu_invalid: bool = False  # a run's MFU above 1: measured against a peak too low to be a utilisation
    metric: str = (
        "val/loss"  # what val_loss_mean and val_loss_std hold: val/loss, or val/bpb across tokenizers
    )
    # the weights one token passes through (mlp=moe: the router's, shared and top_k experts'); a dense
    # model's parameters; None where a run's are unknown
    active_parameters: float | None = None

    @property
    def sparse(self) -> bool:
        """Whether its active parameters are not its parameters (or not known): an MoE condition."""
        return self.parameters is not None and self.active_parameters != self.parameters

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
        """The final values of the ranked metric, one per seed (:func:`per_seed`)."""
        return per_seed(self.runs, self.metric)

    @property
    def seeds(self) -> int:
        """How many seeds its runs used: the replicates its ± and its test count."""
        return len({_setting(r, SEED_KEY) for r in self.runs})

    @property
    def unfinished(self) -> int:
        return sum(not r.finished for r in self.runs)

    @property
    def diverged(self) -> int:
        """How many of its runs diverged (final val/loss non-finite or above where training starts)."""
        return sum(r.diverged for r in self.runs)

    @property
    def repeated_seeds(self) -> dict[str, int]:
        """Each seed that more than one of its runs used, and how many did (a command run twice): those runs
        are one replicate, counted once, at their mean (:func:`per_seed`)."""
        used = Counter(_setting(r, SEED_KEY) for r in self.runs)
        return {seed: n for seed, n in used.items() if n > 1}


def _human(n: float) -> str:
    from gptlab.model.counting import human  # the one number formatter (1.62M)

    return human(n)


@dataclass(frozen=True)
class MetricColumn:
    header: str
    value: Callable[[Row], float | None]
    fmt: Callable[[float], str]


# The run metrics that follow val/loss in the table, in this order.
INVALID_MFU = "invalid (>100%)"
MFU_NOTE = (
    f"MFU `{INVALID_MFU}`: a run measured more FLOP/s than the peak its MFU is taken against (a peak measured "
    "while other work shared the device), so the figure is not a utilisation and is not shown."
)
REPEATED_SEED_NOTE = (
    "`seed S xN`: N runs of the condition used the same seed S (the same run again, which on the same machine "
    "ends at about the same loss). They are one replicate, not N: the seeds column, the mean, the ± and the "
    "test count seed S once, at the mean of its N runs. For more replicates give each run its own seed "
    "(`seed=0,1,2`)."
)
ACTIVE_NOTE = (
    "`parameters`: every weight of the model, all of a Mixture of Experts' experts counted; `active`: the "
    "weights one token passes through (mlp=moe: the routers', the shared experts' and its top_k experts'; a "
    "dense model's are all of them). A token's training FLOPs (6 N) count the active ones: dense and MoE "
    "conditions of equal `active` do about equal work per token."
)
DIVERGED_NOTE = (
    "`diverged`: a run of the condition ended with a validation loss that is non-finite, or above the "
    "validation split's unigram entropy and more than a nat above a uniform guess over the vocabulary (worse than "
    "training started); the row is listed last, and neither tested nor used as the reference."
)


def _mfu_cell(value: float) -> str:
    return INVALID_MFU if value > 1 else f"{100 * value:.1f}%"


METRIC_COLUMNS = [
    MetricColumn("val/ppl", lambda r: r.val_ppl, format_perplexity),
    MetricColumn("tokens/s", lambda r: r.tokens_per_second, "{:,.0f}".format),
    MetricColumn("MFU", lambda r: 2.0 if r.mfu_invalid else r.mfu, _mfu_cell),
    MetricColumn("parameters", lambda r: r.parameters, _human),
]
# Beside ``parameters`` where a row's active parameters differ from them (an MoE condition): a table of dense
# conditions only has no such column.
ACTIVE_COLUMN = MetricColumn("active", lambda r: r.active_parameters, _human)


def metric_columns(rows: Sequence[Row]) -> list[MetricColumn]:
    """The metric columns of a table of ``rows``: :data:`METRIC_COLUMNS`, and ``active`` after ``parameters``
    where any row's active parameters are not its parameters (:attr:`Row.sparse`)."""
    if not any(row.sparse for row in rows):
        return list(METRIC_COLUMNS)
    at = [c.header for c in METRIC_COLUMNS].index("parameters") + 1
    return [*METRIC_COLUMNS[:at], ACTIVE_COLUMN, *METRIC_COLUMNS[at:]]


def _setting(run: RunRecord, key: str) -> str:
    """What ``run`` set for ``key`` (see :meth:`gptlab.runs.layout.Run.setting`); ``default`` when it
    records nothing (a run read through the W&B API knows only its overrides)."""
    if key in run.overrides:
        return run.overrides[key]
    value = Run(run.path).setting(key) if run.path.is_dir() else None
    return "default" if value is None else value


def condition_keys(
    runs: list[RunRecord], sweep_dir: Path | None = None, ignore: Sequence[str] = ()
) -> list[str]:
    """The keys that define a condition: every override key (of any run) whose setting differs between the
    runs, and the keys the sweep's ``multirun.yaml`` sweeps (so a sweep with one finished value still names
    its key); the seed, keys that say where a run is written, and ``ignore`` left out."""
    candidates: list[str] = []
    for run in runs:
        candidates += [k for k in run.overrides if k not in candidates and not is_silent(k)]
    keys = [k for k in candidates if len({_setting(r, k) for r in runs}) > 1]
    if sweep_dir is not None:
        keys += [k for k in swept_keys_of(sweep_overrides_from_dir(sweep_dir)) if k not in keys]
    return [k for k in keys if k != SEED_KEY and k not in ignore]


def condition_of(run: RunRecord, keys: Sequence[str]) -> dict[str, str]:
    return {k: _setting(run, k) for k in keys}


def label_of(condition: dict[str, str]) -> str:
    return " ".join(f"{k}={_short(v)}" for k, v in condition.items()) or "all runs"


def condition_labels(
    run_dirs: Sequence[Path], ignore: Sequence[str] = ()
) -> tuple[list[str], dict[Path, str]]:
    """The condition keys of the runs in ``run_dirs`` (their overrides only; no metrics are read) and each
    run directory's condition label: for tables of evaluation outputs read straight from run directories."""
    runs = [RunRecord(path=Path(d), overrides=Run(Path(d)).choices()) for d in run_dirs]
    keys = condition_keys(runs, ignore=ignore)
    return keys, {r.path: label_of(condition_of(r, keys)) for r in runs}


# What the table ranks by, and in what unit.
UNITS = {"val/loss": "nats per token", "val/bpb": "bits per byte"}
TOKENIZER_KEY = "tokenizer"


def ranking_metric(runs: list[RunRecord]) -> str:
    """``val/bpb`` when the runs differ in tokenizer (nats per token are then on different scales: a
    character scores one character, a GPT-2 token about four), else ``val/loss``. Runs of different tokenizers
    of which one logged no bits per byte (trained before gptlab measured it) are refused: no ranking of
    theirs would be on one scale."""
    if len({_setting(r, TOKENIZER_KEY) for r in runs}) < 2:
        return "val/loss"
    missing = [r for r in runs if r.final_val_loss is not None and r.final("val/bpb") is None]
    if missing:
        raise DataError(
            f"The runs differ in tokenizer, so they are ranked by bits per byte (val/bpb), but {len(missing)} of "
            f"them logged none (e.g. {missing[0].path}; a run of an older gptlab): validate them again with "
            "this gptlab (resume=auto on a finished run validates its checkpoint), or compare the runs of one "
            "tokenizer at a time."
        )
    return "val/bpb"


def ranking_line(metric: str) -> str:
    """What the table ranks by, in words, for the line above it."""
    why = (
        ": the runs differ in tokenizer, so nats per token are on different scales"
        if metric == "val/bpb"
        else ""
    )
    return f"Ranked by final {metric} ({UNITS[metric]}){why}."


def _stdev(values: list[float]) -> float | None:
    """The standard deviation over seeds; None for one seed or a non-finite value (statistics.stdev fails
    on inf)."""
    if len(values) < 2 or not all(math.isfinite(v) for v in values):
        return None
    return statistics.stdev(values)


def table_notes(rows: list[Row]) -> list[str]:
    """The notes under the table for its marks: diverged rows, invalid MFU, seeds used more than once, and
    what ``parameters`` and ``active`` are where the table has both."""
    return [
        note
        for note, shown in (
            (ACTIVE_NOTE, any(r.sparse for r in rows)),
            (DIVERGED_NOTE, any(r.diverged for r in rows)),
            (MFU_NOTE, any(r.mfu_invalid for r in rows)),
            (REPEATED_SEED_NOTE, any(r.repeated_seeds for r in rows)),
        )
        if shown
    ]


def seed_of(run: RunRecord) -> str:
    """The seed ``run`` trained with (``default`` where it records none)."""
    return _setting(run, SEED_KEY)


def per_seed(runs: Sequence[RunRecord], metric: str) -> list[float]:
    """The final ``metric`` of each seed the runs used, in the order first seen: the runs of one seed (the same
    command run twice into a folder) are one replicate, taken at their mean, since counting each as a seed
    would shrink the ± and the p-value with no new evidence about the noise between seeds."""
    by_seed: dict[str, list[float]] = {}
    for run in runs:
        if (value := run.final(metric)) is not None:
            by_seed.setdefault(seed_of(run), []).append(value)
    return [sum(values) / len(values) for values in by_seed.values()]  # inf for a run that ended at inf


def _active_parameters(runs: Sequence[RunRecord]) -> float | None:
    """The mean active parameters of the runs whose ``parameters`` are counted (the same runs as that mean,
    so that a dense condition's two are equal); None where one of them has no active count (an MoE run whose
    count is unknown): never a mean of the others passed off as the condition's."""
    counted = [r for r in runs if r.parameters is not None]
    if any(r.active_parameters is None for r in counted):
        return None
    return _mean([r.active_parameters for r in counted])


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def geometric_mean(values: Sequence[float | None]) -> float | None:
    """exp of the mean log of the values present: the mean of perplexities that is the perplexity of the mean
    loss (a perplexity is exp of a loss); inf where one is inf, NaN where one is NaN."""
    present = [v for v in values if v is not None]
    return perplexity(statistics.fmean(math.log(v) for v in present)) if present else None


def perplexity_over_seeds(runs: Sequence[RunRecord]) -> float | None:
    """A condition's ``val/ppl``: exp of the mean final ``val/loss`` over its seeds (:func:`per_seed`), the
    geometric mean of the seeds' perplexities, so that it is the perplexity of the ``val/loss`` beside it. The
    arithmetic mean of the perplexities is not: exp of a mean is below the mean of the exps (Jensen), by more
    the more the seeds differ. Where a run recorded a perplexity but no loss, the geometric mean of the
    perplexities recorded."""
    if runs and all(r.final_val_loss is not None for r in runs):
        return perplexity(statistics.fmean(per_seed(runs, "val/loss")))
    return geometric_mean([r.val_ppl for r in runs])


def summarize(
    runs: list[RunRecord],
    keys: list[str],
    baseline: str | None = None,
    alpha: float = DEFAULT_ALPHA,
    include_unfinished: bool = False,
    metric: str = "val/loss",
) -> list[Row]:
    """One row per condition (runs equal on ``keys``), sorted by the mean final ``metric`` (``val/loss``, or
    ``val/bpb`` across tokenizers: :func:`ranking_metric`; ``val_loss_mean`` and ``final_losses`` then hold
    it), each with its difference to the best row or the ``baseline`` condition (``"pos=learned"``),
    Holm-adjusted over the table. Unfinished runs are left out unless ``include_unfinished``."""
    groups: dict[tuple, list[RunRecord]] = {}
    for run in runs:
        if run.finished or include_unfinished:
            groups.setdefault(tuple(condition_of(run, keys).values()), []).append(run)
    if not groups:
        raise DataError(
            f"None of the {len(runs)} runs finished, so none is ranked: wait for them, resume them "
            "(resume=auto), or pass --include-unfinished to rank them at the step they reached."
        )
    rows = []
    for values, members in groups.items():
        losses = per_seed(members, metric)
        rows.append(
            Row(
                metric=metric,
                choice=dict(zip(keys, values)),
                runs=members,
                val_loss_mean=sum(losses) / len(losses),  # inf for a run that ended at inf
                val_loss_std=_stdev(losses),
                val_ppl=perplexity_over_seeds(members),
                tokens_per_second=_mean([r.tokens_per_second for r in members]),
                mfu=_mean([r.mfu for r in members]),
                # a window above 100% (logged apart) says the run's peak is too low: its other windows'
                # MFU, taken against the same peak, is no utilisation either
                mfu_invalid=any(
                    (r.mfu is not None and r.mfu > 1) or r.mfu_above_peak is not None for r in members
                ),
                parameters=_mean([r.parameters for r in members]),
                active_parameters=_active_parameters(members),
                outputs={
                    name: {
                        h: _average(name, h)([r.outputs.get(name, {}).get(h) for r in members])
                        for h in headers
                    }
                    for name, headers in _output_headers(members).items()
                },
            )
        )
    # diverged conditions last; a NaN mean sorts with them, not at random
    rows.sort(
        key=lambda r: (r.diverged > 0, r.val_loss_mean if r.val_loss_mean == r.val_loss_mean else math.inf)
    )
    for row in rows:
        if row.diverged:
            row.significance = f"diverged ({row.diverged} of {len(row.runs)} runs): not tested"
    tested = [r for r in rows if not r.diverged]
    if tested:
        reference = tested.index(reference_row(tested, baseline, diverged=[r for r in rows if r.diverged]))
        for row, contrast in zip(tested, contrasts([r.final_losses for r in tested], reference, alpha)):
            row.contrast, row.significance = contrast, contrast.verdict
    return rows


def reference_row(rows: list[Row], baseline: str | None, diverged: Sequence[Row] = ()) -> Row:
    """The best row, or the row of the ``baseline`` condition (``"pos=learned"``, ``"pos=rope activation=gelu"``);
    a baseline among the ``diverged`` rows is refused."""
    if not baseline:
        return rows[0]
    wanted = dict(split_override(part) for part in baseline.split())
    matches = [r for r in rows if all(r.choice.get(k) == v for k, v in wanted.items())]
    gone = [r for r in diverged if all(r.choice.get(k) == v for k, v in wanted.items())]
    if not matches and len(gone) == 1:
        raise DataError(
            f"--baseline {baseline!r} names a condition that diverged ({gone[0].diverged} of its "
            f"{len(gone[0].runs)} runs): nothing can be tested against it; name another, e.g. --baseline "
            f"'{rows[0].label}'."
        )
    matches += gone
    if len(matches) != 1:
        choices = ", ".join(r.label for r in rows)
        raise DataError(
            f"--baseline {baseline!r} matches {len(matches)} of the conditions ({choices}): name exactly one, "
            f"e.g. --baseline '{rows[-1].label}'."
        )
    return matches[0]


def _signed(value: float) -> str:
    return f"{value:+.4f}"


def contrast_cell(contrast: Contrast | None) -> str:
    """``+0.0412 [0.0120, 0.0704]``: the difference to the reference and its 95% interval."""
    if contrast is None or contrast.difference is None or contrast.verdict == "reference":
        return "-"
    if contrast.low is None or contrast.high is None:
        return _signed(contrast.difference)
    return f"{_signed(contrast.difference)} [{_signed(contrast.low)}, {_signed(contrast.high)}]"


def _short(value: str) -> str:
    """A searched float to 4 significant digits (0.0018858046576709494 -> 0.001886)."""
    try:
        number = float(value)
    except ValueError:
        return value
    return f"{number:.4g}" if "." in value and len(value) > 8 else value


def _average(output: str, header: str) -> Callable[[list[float | None]], float | None]:
    """How the seeds' figures of an evaluation output's column are averaged: a perplexity by its geometric
    mean, anything else by its mean (:data:`OUTPUTS`, ``geometric``)."""
    geometric = any(o.geometric(header) for o in OUTPUTS if o.name == output)
    return geometric_mean if geometric else _mean


def _output_headers(runs: list[RunRecord]) -> dict[str, list[str]]:
    """{output name: its headers present in any of ``runs``, in the output's order}, in declared order."""
    found = {}
    for output in OUTPUTS:
        headers = {h for r in runs for h in r.outputs.get(output.name, {})}
        if headers:
            found[output.name] = sorted(headers, key=output.order)
    return found


def output_columns(rows: list[Row]) -> list[tuple[str, str, Callable[[float], str], str]]:
    """(output name, header, formatter, unavailable text) of the output columns of the table. A column of
    perplexities (those averaged geometrically over seeds: ppl@Nx, the harness's word and byte perplexities)
    is printed as val/ppl is."""
    headers = _output_headers([r for row in rows for r in row.runs])
    return [
        (o.name, h, format_perplexity if o.geometric(h) else o.fmt.format, o.unavailable)
        for o in OUTPUTS
        for h in headers.get(o.name, [])
    ]


def _output_cell(value: float | None, fmt: Callable[[float], str], unavailable: str) -> str:
    return unavailable if value is None else fmt(value)


def markdown_table(rows: list[Row], keys: list[str], reference: str = "best") -> str:
    """A markdown table, best first: the condition, seeds, final val/loss (mean ± std over seeds), the
    difference to the reference with its 95% interval, the verdict (Holm-adjusted p), the metric columns
    (``active`` among them where an MoE condition's active parameters differ from its total:
    :func:`metric_columns`) and the evaluation-output columns. A row holding unfinished runs (``--include-unfinished``) says how
    many in its seeds cell."""
    extra = output_columns(rows)
    columns = metric_columns(rows)
    header = [
        "#",
        *(keys or ["runs"]),
        "seeds",
        rows[0].metric if rows else "val/loss",
        f"Δ vs {reference} (95% CI)",
        f"vs {reference} (Holm)",
        *(c.header for c in columns),
        *(h for _, h, _, _ in extra),
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, row in enumerate(rows, 1):
        loss = f"{row.val_loss_mean:.4f}" + (
            f" ± {row.val_loss_std:.4f}" if row.val_loss_std is not None else ""
        )
        metrics = [c.value(row) for c in columns]
        marks = [f"{row.unfinished} unfinished"] * bool(row.unfinished)
        marks += [f"{row.diverged} diverged"] * bool(row.diverged)
        marks += [f"seed {seed} x{n}" for seed, n in row.repeated_seeds.items()]
        seeds = str(row.seeds) + (f" ({', '.join(marks)})" if marks else "")
        cells = [
            str(i),
            *([_short(row.choice.get(k, "")) for k in keys] if keys else ["all"]),
            seeds,
            loss,
            contrast_cell(row.contrast),
            row.significance,
            *("-" if v is None else c.fmt(v) for c, v in zip(columns, metrics)),
            *(_output_cell(row.outputs.get(name, {}).get(h), fmt, na) for name, h, fmt, na in extra),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def unfinished_table(runs: list[RunRecord], keys: list[str], root: Path | None = None) -> str:
    """The runs that did not finish, one line each: where, its condition and seed, how far it got and why
    it stopped, and its last validation loss (not comparable with finished runs')."""
    lines = [
        "| run | " + " | ".join(keys or ["condition"]) + " | seed | status | last val/loss |",
        "|---|" + "---|" * (len(keys or [0]) + 3),
    ]
    for run in runs:
        where = run.path.relative_to(root) if root is not None and run.path.is_relative_to(root) else run.path
        condition = condition_of(run, keys)
        last = f"{run.final_val_loss:.4f}" if run.final_val_loss is not None else "-"
        cells = [str(where), *([_short(v) for v in condition.values()] or ["all"])]
        cells += [_setting(run, SEED_KEY), run.describe_status(), last]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
