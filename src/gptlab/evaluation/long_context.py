"""One long-context report for a run or a sweep: perplexity at 1x-8x the training context (the length study's
``eval_length/length.json``) and passkey retrieval accuracy at the same lengths (``eval_length/passkey.json``),
read from run directories, averaged over seeds and drawn side by side; and the passkey heatmap of one run."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.evaluation import passkey
from gptlab.runs.jsonfile import figures_from_json
from gptlab.runs.layout import EVAL_LENGTH_DIR, Run

PASSKEY_FILE = Path(EVAL_LENGTH_DIR) / passkey.RESULT_FILE


def factor_of(key: str) -> float:
    """The multiple of the training context a column or series key names: ``"ppl@2x"``, ``"passkey@2x"``
    -> 2.0 (what the comparison table sorts its columns by, and the figures' x axis)."""
    return float(key.split("@", 1)[1].rstrip("x"))


def perplexity(loss: float) -> float:
    """exp(``loss``): inf where it overflows a float (a loss above about 709 nats, a badly diverged model's),
    NaN for a NaN loss."""
    try:
        return math.exp(loss)
    except OverflowError:  # math.exp raises where numpy's would give inf
        return math.inf


#: How many significant digits a printed perplexity carries (a comparison's cells, a run's closing line), at most
#: :data:`PERPLEXITY_DECIMALS` of them after the point: 8.81, 118.53, 1234.6, 13314; a perplexity's whole part
#: is never rounded.
PERPLEXITY_DIGITS = 5
PERPLEXITY_DECIMALS = 2


def format_perplexity(ppl: float) -> str:
    """``ppl`` as every perplexity is printed: :data:`PERPLEXITY_DIGITS` significant digits, at most
    :data:`PERPLEXITY_DECIMALS` decimals, none once the whole part has that many digits (13314, not
    13314.34); a diverged model's, from a million up, in three digits and a power of ten (1.23e+37); ``inf``
    and ``nan`` as such."""
    if not math.isfinite(ppl):
        return str(ppl)
    if abs(ppl) >= 1e6:
        return f"{ppl:.3g}"
    for decimals in range(PERPLEXITY_DECIMALS, 0, -1):
        text = f"{ppl:.{decimals}f}"
        if len(text.split(".")[0].lstrip("-")) + decimals <= PERPLEXITY_DIGITS:
            return text
    return f"{ppl:.0f}"


def read_length_study(run_dir: str | Path) -> dict[str, float | None]:
    """{"ppl@1x": 8.2, "ppl@2x": None, ...}: the validation perplexity of the scheme as trained at each
    length of the run's study (``eval_length/length.json``); None where the scheme cannot run at that length
    (past a learned table) or the loss is not finite. Empty without a study."""
    result = Run(Path(run_dir)).length_result()
    if not result:
        return {}
    entries = (result.get("variants") or {}).get(result.get("pos"), {})
    out: dict[str, float | None] = {}
    for factor in result.get("factors", []):
        entry = entries.get(str(factor), {})
        ppl, loss = entry.get("ppl"), entry.get("loss")
        if ppl is None and isinstance(loss, int | float):  # a study that wrote the loss alone
            ppl = perplexity(loss)
        out[f"ppl@{factor}x"] = float(ppl) if isinstance(ppl, int | float) and math.isfinite(ppl) else None
    return out


def read_passkey_file(path: Path) -> dict[str, Any]:
    """A ``passkey.json``, its non-finite figures (a diverged model's key log-probability, written ``"nan"``:
    :mod:`gptlab.runs.jsonfile`) as floats."""
    data: dict[str, Any] = figures_from_json(json.loads(path.read_text()))
    return data


def read_passkey(run_dir: str | Path) -> dict[str, float | None]:
    """{"passkey@1x": None, "passkey@2x": 0.4, ...}: accuracy over the depth bins at each length; None where
    no prompt could run (too short for the prompt, or past a bounded position table)."""
    path = Path(run_dir) / PASSKEY_FILE
    if not path.is_file():
        return {}
    data = read_passkey_file(path)
    return {
        f"passkey@{factor}x": data.get("metrics", {}).get(f"passkey/acc@{factor}x")
        for factor in data["factors"]
    }


def read_key_logprob(run_dir: str | Path) -> dict[str, float | None]:
    """{"key_logprob@2x": -3.1, ...}: the true key's mean log-probability per token at each length."""
    path = Path(run_dir) / PASSKEY_FILE
    if not path.is_file():
        return {}
    data = read_passkey_file(path)
    return {
        f"key_logprob@{f}x": data.get("metrics", {}).get(f"passkey/key_logprob@{f}x") for f in data["factors"]
    }


def mean_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def read_loss_by_position(run_dir: str | Path) -> list[float] | None:
    """The loss at each position of the longest context the scheme as trained ran at."""
    data = Run(Path(run_dir)).length_result()
    if not data:
        return None
    runs = [e for e in data.get("variants", {}).get(data.get("pos"), {}).values() if "loss_by_position" in e]
    return max(runs, key=lambda e: e["context"])["loss_by_position"] if runs else None


def plot_rows(rows: Sequence[Any], path: Path) -> Path:
    """The long-context figure of a comparison: for each row (a choice, its runs over seeds), perplexity,
    passkey accuracy and the true key's log-probability against the evaluation length, and the loss by
    position at the longest context; means over seeds."""
    series, curves = {}, {}
    for row in rows:
        dirs = [r.path for r in row.runs]
        logprob_keys = {k for d in dirs for k in read_key_logprob(d)}
        series[row.label] = {
            **row.length_ppl,
            **row.passkey,
            **{k: mean_or_none([read_key_logprob(d).get(k) for d in dirs]) for k in logprob_keys},
        }
        by_position = [c for c in (read_loss_by_position(d) for d in dirs) if c is not None]
        shortest = min((len(c) for c in by_position), default=0)
        if shortest:
            curves[row.label] = [statistics.fmean(c[i] for c in by_position) for i in range(shortest)]
    return plot_long_context(series, path, curves)


def plot_long_context(
    series: dict[str, dict[str, float | None]], path: Path, curves: dict[str, list[float]] | None = None
) -> Path:
    """Panels against the evaluation length (multiples of the training context): perplexity, passkey accuracy
    and, when given, the true key's log-probability per token; then, when given, the loss by position. One
    line per label. ``series``: label -> {"ppl@2x": ..., "passkey@2x": ..., "key_logprob@2x": ...};
    ``curves``: label -> loss at each position."""
    from gptlab.figures import binned, pyplot, save_figure

    plt = pyplot()
    panels = [
        ("ppl@", "Perplexity against context", "validation perplexity"),
        ("passkey@", "Passkey retrieval", "accuracy (over depths)"),
    ]
    if any(k.startswith("key_logprob@") for values in series.values() for k in values):
        panels.append(("key_logprob@", "Log-probability of the true key", "nats per key token"))
    n = len(panels) + bool(curves)
    fig, axes = plt.subplots(1, n, figsize=(4.8 * n, 4.2))
    factors = sorted({factor_of(k) for values in series.values() for k in values})
    # one colour per label in every panel, also where a label has no points (a learned table past its context)
    colors = {label: f"C{i % 10}" for i, label in enumerate(dict.fromkeys([*series, *(curves or {})]))}
    for label, values in series.items():
        for ax, (prefix, _, _) in zip(axes, panels):
            points = sorted(
                (factor_of(k), v) for k, v in values.items() if k.startswith(prefix) and v is not None
            )
            if points:
                ax.plot(*zip(*points), marker="o", label=label, color=colors[label])
    for ax, (prefix, title, ylabel) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(factors, [f"{f:g}x" for f in factors])
        ax.axvline(1, color="grey", linestyle=":")
        ax.set_xlabel("evaluation context (x training context)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if prefix == "passkey@":
            ax.set_ylim(-0.05, 1.05)
        if prefix == "key_logprob@":
            ax.axhline(-math.log(10), color="grey", linestyle="--", label="uniform over 10 digits")
            ax.legend(fontsize=7)
    if curves:
        ax = axes[-1]
        for label, losses in curves.items():
            x, y = binned(np.asarray(losses), bins=48)
            ax.plot(x, y, label=f"{label} ({len(losses)})", color=colors[label])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token position (longest context each ran at)")
        ax.set_ylabel("validation loss (nats)")
        ax.set_title("Loss by position")
    axes[0].legend(fontsize=7, ncol=2)
    return save_figure(fig, path, dpi=90)


# ---- a sweep's passkey table ----------------------------------------------------------------------


def collect_passkey(
    sweep_dirs: Sequence[str | Path], conditions: dict[Path, str] | None = None
) -> list[dict[str, Any]]:
    """Every run's passkey result below ``sweep_dirs``, with its run directory (``job_dir``) and, where
    ``conditions`` names it, its condition: the table's rows are then conditions, not scheme names."""
    found = []
    for d in sweep_dirs:
        for p in sorted(Path(d).glob(f"**/{PASSKEY_FILE.as_posix()}")):
            job_dir = p.parents[len(PASSKEY_FILE.parts) - 1]
            if any(part.startswith(".") for part in job_dir.relative_to(d).parts):
                continue  # a run moved aside (.replaced/)
            result = {**read_passkey_file(p), "job_dir": str(job_dir)}
            if conditions and job_dir in conditions:
                result["condition"] = conditions[job_dir]
            found.append(result)
    return found


def row_name(result: dict[str, Any], variant: str) -> str:
    """The table row of one variant of a run's length or passkey result: its condition, with the context
    scaling for a scaled variant (``pos=rope activation=gelu +ntk``); the variant's own name (``rope+ntk``)
    when the result carries no condition."""
    condition = result.get("condition")
    if not condition:
        return variant
    return condition if variant == result["pos"] else f"{condition} {variant[len(result['pos']) :]}"


def _variants(result: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, float]]]:
    """(name, cells, metrics as ``acc@2x``...) for the scheme as trained and each context scaling; a scaled
    variant takes the as-trained values at lengths it skips (1x)."""

    def strip(metrics: dict[str, float], prefix: str) -> dict[str, float]:
        return {
            k[len(prefix) :]: v
            for k, v in metrics.items()
            if k.startswith(prefix) and "/" not in k[len(prefix) :]
        }

    base = (result["pos"], result["cells"], strip(result["metrics"], "passkey/"))
    out = [base]
    for name, variant in result.get("scaled", {}).items():
        metrics = {**base[2], **strip(variant["metrics"], f"passkey/{name}/")}
        out.append((name, {**base[1], **variant["cells"]}, metrics))
    return out


def passkey_sweep_table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per scheme (and context scaling), one column per length: accuracy over depth bins
    and trials, mean ± std over seeds, with the mean key log-probability per token; why a length could not
    run otherwise."""
    rows: dict[str, list[tuple[dict[str, Any], dict[str, float], bool]]] = defaultdict(list)
    for r in results:
        if "error" in r:
            rows[row_name(r, r["pos"])].append(({}, {}, True))
            continue
        for name, cells, metrics in _variants(r):
            rows[row_name(r, name)].append((cells, metrics, False))
    if not rows:
        return ""
    factors = sorted({f for r in results for f in r["factors"]})
    contexts = sorted({r["train_context"] for r in results})
    trials = sorted({r["trials"] * len(r["depth_bins"]) for r in results})
    head = "| condition | seeds | " + " | ".join(
        f"{f}x ({f * contexts[0]})" if len(contexts) == 1 else f"{f}x" for f in factors
    )
    lines = [head + " |", "|---|---:" + "|---:" * len(factors) + "|"]
    for name in sorted(rows):
        runs = rows[name]
        row_cells: list[str] = []
        for f in factors:
            accs = [m[f"acc@{f}x"] for _, m, _ in runs if f"acc@{f}x" in m]
            lps = [m.get(f"key_logprob@{f}x") for _, m, _ in runs if f"acc@{f}x" in m]
            if accs:
                std = f" ± {statistics.stdev(accs):.0%}" if len(accs) > 1 else ""
                row_cells.append(f"{statistics.fmean(accs):.0%}{std} ({mean_or_none(lps):.2f})")
            elif any(failed for _, _, failed in runs):
                row_cells.append("not run")
            else:
                errors = {c.get("error", "") for c_, _, _ in runs for c in c_.get(str(f), {}).values()}
                row_cells.append("cannot run" if any("table of" in e for e in errors) else "too short")
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(row_cells) + " |")
    return "\n".join(lines) + (
        f"\n\nCells: accuracy over {'/'.join(map(str, trials))} prompts per run (depth bins x trials), mean ± std "
        "over seeds, and in brackets the mean log-probability per token of the true key; `+ntk` etc.: the "
        "RoPE runs with that context scaling set to the factor (at 1x, the runs as trained)."
    )
