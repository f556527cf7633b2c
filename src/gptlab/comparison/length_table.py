"""The length evaluations of a sweep (one ``<job>/eval_length/length.json`` per run) in one table and one
figure: the mean and standard deviation over seeds of the validation loss for each condition (and each
context scaling of its scheme) at each multiple of the training context. A condition is what the runs set for
the keys that differ between them, the seed excepted (:mod:`gptlab.comparison.table`): two runs of one scheme
with different activations are two rows, not two seeds of one. Rows are ordered by the metric: the mean loss
at the training context, then the name."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.errors import DataError
from gptlab.evaluation.long_context import row_name
from gptlab.runs.jsonfile import all_figures_as_json, read_figure, write_json
from gptlab.runs.layout import EVAL_LENGTH_DIR, LENGTH_FILE, Run, find_run_dirs


def collect(
    sweep_dirs: str | Path | Sequence[str | Path], ignore: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Every run's length result below the sweep directories, with its seed, run directory and condition
    (``ignore``: keys left out of the condition)."""
    from gptlab.comparison.table import condition_labels

    if isinstance(sweep_dirs, (str, Path)):
        sweep_dirs = [sweep_dirs]
    runs = [Run(path) for d in sweep_dirs for path in find_run_dirs(d)]
    found = [(run, result) for run in runs if (result := run.length_result()) is not None]
    if not found:
        raise DataError(
            f"{', '.join(map(str, sweep_dirs))} hold(s) no <run>/{EVAL_LENGTH_DIR}/{LENGTH_FILE}: train the sweep "
            "with eval_length.enabled=true (experiment=pos_sweep does) or run scripts/eval_length.py on each run."
        )
    _, labels = condition_labels([run.path for run, _ in found], ignore)
    return [label(result, run, labels[run.path]) for run, result in found]


def label(result: dict[str, Any], run: Run, condition: str) -> dict[str, Any]:
    """``result`` with the seed, run directory and condition that its table row is keyed on."""
    return {**result, "seed": run.config().get("seed"), "job_dir": str(run.path), "condition": condition}


# What a length table shows: an entry's key, and its unit.
METRICS = {"loss": "validation loss (nats)", "bpb": "validation bits per byte"}
# The cell of a study that measured the loss but not the metric shown (bits per byte, before gptlab had them).
NOT_RECORDED = "not recorded"
# The cell of a factor no run of the row was evaluated at (runs with different eval_length.factors).
NOT_MEASURED = "no run of this row was evaluated at this length"


def metric_for(results: list[dict[str, Any]]) -> str:
    """``bpb`` when the runs of ``results`` differ in tokenizer (nats per token are then on different
    scales), else ``loss``."""
    tokenizers = {Run(Path(r["job_dir"])).setting("tokenizer") for r in results if r.get("job_dir")}
    return "bpb" if len(tokenizers) > 1 else "loss"


def aggregate(results: list[dict[str, Any]], metric: str = "loss") -> dict[str, Any]:
    """{variant: {factor: {"mean", "std", "n", "errors"}}} of each entry's ``metric`` (``loss``, or ``bpb``
    across tokenizers), plus the shared factors and training context."""
    losses: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    errors: dict[str, dict[int, str]] = defaultdict(dict)
    curves: dict[str, list[np.ndarray]] = defaultdict(list)
    factors: set[int] = set()
    scaled: set[str] = set()  # rows of a context scaling (rope+ntk), beside the scheme as trained
    contexts = {r["train_context"] for r in results}
    for r in results:
        factors.update(r["factors"])
        base = r["variants"][r["pos"]]
        for variant, entries in r["variants"].items():
            name = row_name(r, variant)
            if variant != r["pos"]:
                scaled.add(name)
            merged = {**base, **entries}  # a scaled variant is the model as trained at 1x
            for factor, entry in merged.items():
                # a diverged run's figures are "nan" or "inf" (gptlab.runs.jsonfile), older files' bare NaN
                if (figure := read_figure(entry.get(metric))) is not None:
                    losses[name][int(factor)].append(figure)
                elif "error" in entry:
                    errors[name][int(factor)] = entry["error"]
                elif "loss" in entry:  # a study from before bits per byte were measured
                    errors[name][int(factor)] = NOT_RECORDED
            longest = max((e for e in merged.values() if "loss_by_position" in e), key=lambda e: e["context"])
            position_losses = [read_figure(v) for v in longest["loss_by_position"]]
            curves[name].append(np.asarray([math.nan if v is None else v for v in position_losses]))
    table: dict[str, dict[int, dict[str, Any]]] = {}
    first = min(factors)

    def by_metric(name: str) -> tuple[float, str]:
        values = losses[name].get(first, [])
        return (float(np.mean(values)) if values else math.inf, name)

    for name in sorted(set(losses) | set(errors), key=by_metric):
        table[name] = {}
        for f in sorted(factors):
            values = losses[name].get(f, [])
            table[name][f] = {  # no run measured it: mean and std missing (None), the reason in error
                "mean": float(np.mean(values)) if values else None,
                "std": (float(np.std(values, ddof=1)) if len(values) > 1 else 0.0) if values else None,
                "n": len(values),
                "error": errors[name].get(f) or (None if values else NOT_MEASURED),
            }
    lengths = {name: min(len(c) for c in cs) for name, cs in curves.items()}
    by_position = {name: np.mean([c[: lengths[name]] for c in cs], axis=0) for name, cs in curves.items()}
    return {
        "table": table,
        "factors": sorted(factors),
        "train_context": sorted(contexts),
        "by_position": by_position,
        "runs": len(results),
        "scaled": sorted(scaled),
        "metric": metric,
    }


def format_table(summary: dict[str, Any]) -> str:
    """One row per condition as trained; then, when any scheme was also evaluated with a context scaling
    (RoPE's linear, NTK, YaRN), a second table of those rows."""
    (context, *others) = summary["train_context"]
    factors = summary["factors"]
    head = " | ".join(f"{f}x ({f * context})" if not others else f"{f}x" for f in factors)
    scaled = set(summary.get("scaled", ()))
    tables = []
    for first, names in (
        ("condition", [n for n in summary["table"] if n not in scaled]),
        ("condition, context scaling", [n for n in summary["table"] if n in scaled]),
    ):
        if not names:
            continue
        lines = [f"| {first} | seeds | {head} |", "|---|---:" + "|---:" * len(factors) + "|"]
        for name in names:
            row = summary["table"][name]
            seeds = max(c["n"] for c in row.values())
            cells = []
            for f in factors:
                cell = row[f]
                if cell["n"]:
                    cells.append(f"{cell['mean']:.3f} ± {cell['std']:.3f}")
                else:
                    error = cell["error"]
                    cells.append(
                        error
                        if error == NOT_RECORDED
                        else ""
                        if error in (None, NOT_MEASURED)
                        else "cannot run"
                    )
            lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def plot_summary(summary: dict[str, Any], path: str | Path) -> Path:
    from gptlab.figures import binned, pyplot, save_figure

    plt = pyplot()

    context = summary["train_context"][0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    tab20 = plt.get_cmap("tab20")  # 20 colours: dark ones first, then their light pairs
    palette = [tab20(i) for i in [*range(0, 20, 2), *range(1, 20, 2)]]
    for k, (name, row) in enumerate(summary["table"].items()):
        points = [(f * context, c["mean"], c["std"]) for f, c in row.items() if c["n"]]
        if not points:
            continue
        x, y, e = zip(*points)
        style = dict(linestyle="--" if "+" in name else "-", color=palette[k % len(palette)])
        left.errorbar(x, y, yerr=e, marker="o", capsize=3, label=name, **style)
        bx, by = binned(summary["by_position"][name], bins=48)
        right.plot(bx, by, label=name, **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.axvline(context, color="grey", linestyle=":")
    left.set_ylabel(METRICS[summary.get("metric", "loss")])
    right.set_ylabel("validation loss (nats)")  # the loss at each position is in nats per token
    left.set_xlabel("evaluation context (tokens); dotted: training context")
    what = "Bits per byte" if summary.get("metric") == "bpb" else "Loss"
    left.set_title(f"{what} against context, mean ± std over seeds ({summary['runs']} runs)")
    right.set_xlabel("token position (longest context each scheme ran at)")
    right.set_title("Loss by token position, mean over seeds")
    left.legend(fontsize=7, ncol=2)
    # the axes' range from the finite figures: a diverged run's inf or NaN is drawn off the chart, not at 0
    means = [c["mean"] for row in summary["table"].values() for c in row.values() if c["n"]]
    if finite := [m for m in means if math.isfinite(m)]:
        ylo = min(finite)
        left.set_ylim(bottom=ylo - 0.1, top=min(left.get_ylim()[1], ylo + 3))
    positions = [c[np.isfinite(c)] for c in summary["by_position"].values()]
    if finite_positions := [c for c in positions if c.size]:
        position_lo = min(float(np.min(c)) for c in finite_positions)
        right.set_ylim(bottom=position_lo - 0.3, top=min(right.get_ylim()[1], position_lo + 3))
    return save_figure(fig, path, dpi=80)


def summarize(
    sweep_dirs: str | Path | Sequence[str | Path] = (),
    plot: str | Path | None = None,
    out_dir: str | Path | None = None,
    results: list[dict[str, Any]] | None = None,
    ignore: Sequence[str] = (),
    metric: str = "loss",
) -> str:
    """The markdown table of the length results of one or more sweeps (or of ``results`` already collected
    and labelled, as the comparison passes them) in ``metric`` (``loss`` in nats, or ``bpb``); also writes
    ``plot`` (PNG) and ``length_summary.json`` in ``out_dir`` (default: the first sweep directory). ``auto``:
    ``bpb`` when the runs differ in tokenizer (:func:`metric_for`)."""
    if isinstance(sweep_dirs, (str, Path)):
        sweep_dirs = [sweep_dirs]
    results = results if results is not None else collect(sweep_dirs, ignore)
    summary = aggregate(results, metric_for(results) if metric == "auto" else metric)
    out = {k: v for k, v in summary.items() if k != "by_position"}
    out["table"] = {n: {str(f): c for f, c in row.items()} for n, row in summary["table"].items()}
    folder = Path(out_dir or sweep_dirs[0])
    folder.mkdir(parents=True, exist_ok=True)
    # strict JSON (gptlab.runs.jsonfile): a diverged run's mean as "inf" or "nan"; a cell no run measured
    # has mean and std null, the reason in its error
    write_json(folder / "length_summary.json", all_figures_as_json(out))
    if plot is not None:
        plot_summary(summary, plot)
    return format_table(summary)
