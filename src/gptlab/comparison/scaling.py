"""Scaling laws from a sweep over model sizes: L(N) = E + A N^-alpha per condition, with bootstrap intervals.

The form is Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", https://arxiv.org/abs/2001.08361,
eq. 1.1 with an irreducible term) and the N-part of Hoffmann et al. 2022 ("Training Compute-Optimal Large
Language Models", https://arxiv.org/abs/2203.15556, eq. 2, approach 3). N is the **non-embedding**
parameter count (Kaplan et al.'s choice: the embedding table's size says little about the loss at small N),
counted from each run's ``config_resolved.yaml`` (``gptlab.model.counting``). The loss is the run's final
validation loss; every run was trained on the same number of tokens, so the fit describes L(N) at that data
budget, not a compute-optimal frontier.

Runs are read with the comparison's own reader (``gptlab.comparison.report.read_sweep``); unfinished runs
(killed, or still running) are left out. A *condition* is what the runs' overrides say besides the size and
the seed (``pos=rope``): one curve is fitted per condition.

The fit: for a fixed alpha the model is linear in (E, A), solved by least squares with E, A >= 0; alpha is
then the minimiser of the squared error (a grid, then a bounded scalar search). Intervals: percentile
bootstrap over runs; when every size has at least two runs the resampling is stratified by size (the sizes
are the design, the seeds the noise), otherwise runs are resampled freely and resamples with fewer than
three distinct sizes are dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.errors import DataError

# Overrides that set the size of a model: not part of a condition.
SIZE_KEYS = ("model", "model.n_embd", "model.n_layer", "model.n_head", "model.mlp_ratio", "model.n_kv_head")
IGNORED_KEYS = ("seed",)


@dataclass(frozen=True)
class ScalingPoint:
    """One run: its non-embedding parameters, final validation loss and condition."""

    n: float
    loss: float
    condition: str = ""
    path: str = ""


@dataclass
class PowerLawFit:
    """L(N) = E + A N^-alpha, with (low, high) bootstrap percentile intervals."""

    E: float
    A: float
    alpha: float
    rmse: float
    n_points: int
    n_sizes: int
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    bootstrap: str = ""  # "stratified by size", "runs", or "" (none)
    resamples: int = 0  # bootstrap fits that succeeded

    def predict(self, n: np.ndarray | float) -> np.ndarray:
        return self.E + self.A * np.power(np.asarray(n, dtype=float), -self.alpha)


# ---- fitting ----------------------------------------------------------------------------------------------
def _solve_linear(x: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """min over E, A >= 0 of ||E + A x - loss||^2 for each row of ``x`` (G, n): (E, A, squared error), each
    (G,). The unconstrained least squares, or where it breaks a bound, the best fit on that bound."""
    x = np.atleast_2d(x)
    mx, ml = x.mean(axis=1), loss.mean()
    var = ((x - mx[:, None]) ** 2).sum(axis=1)
    A = np.where(var > 0, ((x - mx[:, None]) * (loss - ml)).sum(axis=1) / np.where(var > 0, var, 1), 0.0)
    E = ml - A * mx
    # A < 0: the best constant; E < 0: the best line through the origin.
    A_origin = (x * loss).sum(axis=1) / np.maximum((x * x).sum(axis=1), 1e-300)
    on_E_bound = (E < 0) & (A >= 0)
    E = np.where(on_E_bound, 0.0, E)
    A = np.where(on_E_bound, np.maximum(A_origin, 0.0), A)
    on_A_bound = A < 0
    A = np.where(on_A_bound, 0.0, A)
    E = np.where(on_A_bound, max(ml, 0.0), E)
    sse = ((E[:, None] + A[:, None] * x - loss) ** 2).sum(axis=1)
    return E, A, sse


def fit_power_law(
    n: Sequence[float], loss: Sequence[float], alpha_bounds: tuple[float, float] = (0.01, 3.0)
) -> PowerLawFit:
    """The least-squares L(N) = E + A N^-alpha (Kaplan et al. 2020, https://arxiv.org/abs/2001.08361;
    Hoffmann et al. 2022, https://arxiv.org/abs/2203.15556) with E, A >= 0 and alpha in ``alpha_bounds``. N is divided by
    its geometric mean inside the fit, for conditioning; A is reported for N itself."""
    from scipy.optimize import minimize_scalar

    n_arr, loss_arr = np.asarray(n, dtype=float), np.asarray(loss, dtype=float)
    if len(n_arr) != len(loss_arr) or len(n_arr) < 3:
        raise DataError(f"A power law needs at least 3 points; got {len(n_arr)}.")
    if len(np.unique(n_arr)) < 3:
        raise DataError(
            f"A power law E + A N^-alpha has three parameters: it needs at least 3 distinct sizes, got "
            f"{sorted(set(n_arr.tolist()))}. Add sizes to the ladder."
        )
    scale = float(np.exp(np.mean(np.log(n_arr))))
    log_u = np.log(n_arr / scale)

    def error(alpha: float) -> float:
        return float(_solve_linear(np.exp(-alpha * log_u), loss_arr)[2][0])

    grid = np.linspace(alpha_bounds[0], alpha_bounds[1], 300)
    errors = _solve_linear(np.exp(-grid[:, None] * log_u[None, :]), loss_arr)[2]
    i = int(np.argmin(errors))
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    alpha = float(grid[i])
    if hi > lo:
        result = minimize_scalar(error, bounds=(lo, hi), method="bounded", options={"xatol": 1e-7})
        if result.fun <= errors[i]:
            alpha = float(result.x)
    E, A_scaled, sse = (float(v[0]) for v in _solve_linear(np.exp(-alpha * log_u), loss_arr))
    return PowerLawFit(
        E=E,
        A=A_scaled * scale**alpha,  # A_scaled (N/scale)^-alpha = (A_scaled scale^alpha) N^-alpha
        alpha=alpha,
        rmse=math.sqrt(sse / len(n_arr)),
        n_points=len(n_arr),
        n_sizes=len(np.unique(n_arr)),
    )


def bootstrap_fit(
    n: Sequence[float],
    loss: Sequence[float],
    resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> PowerLawFit:
    """``fit_power_law`` on the points, with percentile intervals for E, A and alpha from ``resamples``
    bootstrap resamples of the runs (stratified by size when every size has at least two runs)."""
    fit = fit_power_law(n, loss)
    n_arr, loss_arr = np.asarray(n, dtype=float), np.asarray(loss, dtype=float)
    sizes, inverse, counts = np.unique(n_arr, return_inverse=True, return_counts=True)
    stratified = bool(np.all(counts >= 2))
    rng = np.random.default_rng(seed)
    draws: list[tuple[float, float, float]] = []
    groups = [np.flatnonzero(inverse == k) for k in range(len(sizes))]
    for _ in range(resamples):
        if stratified:
            idx = np.concatenate([rng.choice(g, size=len(g), replace=True) for g in groups])
        else:
            idx = rng.integers(0, len(n_arr), size=len(n_arr))
            if len(np.unique(n_arr[idx])) < 3:
                continue
        try:
            f = fit_power_law(n_arr[idx], loss_arr[idx])
        except DataError:
            continue
        draws.append((f.E, f.A, f.alpha))
    fit.bootstrap = "stratified by size" if stratified else "runs"
    fit.resamples = len(draws)
    if draws:
        arr = np.asarray(draws)
        tail = (1 - confidence) / 2 * 100
        for j, name in enumerate(("E", "A", "alpha")):
            low, high = np.percentile(arr[:, j], [tail, 100 - tail])
            fit.intervals[name] = (float(low), float(high))
    return fit


# ---- reading a sweep --------------------------------------------------------------------------------------
def non_embedding_parameters(run_dir: Path) -> float:
    """The non-embedding parameter count of the model a run trained, from its ``config_resolved.yaml``
    (the vocabulary does not enter it). Reads the model, pos, activation and norm nodes as the trainer does
    (``gptlab.config.parse_model``), without importing the training stack."""
    from gptlab.model.config import GPTConfig
    from gptlab.model.counting import parameter_counts
    from gptlab.runs.layout import Run

    cfg = Run(Path(run_dir)).config()
    if not cfg or "model" not in cfg:
        raise DataError(f"{run_dir} has no config_resolved.yaml: its model size is unknown.")
    values = {k: v for k, v in cfg["model"].items() if k != "init_from"}
    if values.get("vocab_size") is None:
        values["vocab_size"] = 1  # the token table is embedding: its size does not change the count
    values["pos"], values["activation"] = dict(cfg["pos"]), dict(cfg["activation"])
    norm = dict(cfg["norm"])
    values["norm"] = norm.pop("name")
    values.update({f"norm_{key}": value for key, value in norm.items()})
    if cfg.get("attention"):  # QK-norm's gains are parameters too; runs from before the node have none
        values["attention"] = dict(cfg["attention"])
    return float(parameter_counts(GPTConfig.from_dict(values))["non_embedding"])


def points_from_sweep(
    sweep_dir: str | Path, size_keys: Sequence[str] = SIZE_KEYS
) -> tuple[list[ScalingPoint], list[tuple[Path, str]]]:
    """(one point per finished run, the runs left out with the reason), read through ``read_sweep``; a
    point's condition is the comparison's (:mod:`gptlab.comparison.table`), the size keys left out."""
    from gptlab.comparison.report import read_sweep
    from gptlab.comparison.table import condition_keys, condition_of, label_of

    runs, skipped = read_sweep(sweep_dir)
    skipped = list(skipped)
    finished = []
    for run in runs:
        if not run.finished:
            skipped.append((Path(run.path), f"unfinished ({run.describe_status()})"))
        elif run.final_val_loss is None:
            skipped.append((Path(run.path), "no validation loss"))
        else:
            finished.append(run)
    keys = condition_keys(finished, Path(sweep_dir), ignore=[*size_keys, *IGNORED_KEYS])
    points = []
    for run in finished:
        try:
            n = non_embedding_parameters(Path(run.path))
        except DataError as e:
            skipped.append((Path(run.path), str(e)))
            continue
        assert run.final_val_loss is not None
        points.append(
            ScalingPoint(n, float(run.final_val_loss), label_of(condition_of(run, keys)), str(run.path))
        )
    return points, skipped


def fit_conditions(
    points: Sequence[ScalingPoint], resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> dict[str, PowerLawFit]:
    """One bootstrapped fit per condition (conditions with fewer than 3 sizes are left out)."""
    fits = {}
    for condition in sorted({p.condition for p in points}):
        mine = [p for p in points if p.condition == condition]
        if len({p.n for p in mine}) < 3:
            continue
        fits[condition] = bootstrap_fit(
            [p.n for p in mine], [p.loss for p in mine], resamples, confidence, seed
        )
    return fits


# ---- writing ----------------------------------------------------------------------------------------------
def _interval(fit: PowerLawFit, key: str, fmt: str) -> str:
    if key not in fit.intervals:
        return "n/a"
    low, high = fit.intervals[key]
    return f"[{fmt.format(low)}, {fmt.format(high)}]"


def markdown_table(fits: dict[str, PowerLawFit], confidence: float = 0.95) -> str:
    """One row per condition. ``E = 0 (bound)``: the best fit wants no irreducible term (the points show no
    flattening yet), so alpha describes a near-logarithmic decline and E is not identified."""
    pct = f"{confidence:.0%}"
    lines = [
        f"| condition | runs | sizes | alpha | {pct} interval | E | {pct} interval | A | rmse |",
        "|---|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for condition, f in fits.items():
        lines.append(
            f"| {condition} | {f.n_points} | {f.n_sizes} | {f.alpha:.3f} | {_interval(f, 'alpha', '{:.3f}')} | "
            f"{f.E:.3f}{' (bound)' if f.E == 0 else ''} | {_interval(f, 'E', '{:.3f}')} | {f.A:.3g} | "
            f"{f.rmse:.4f} |"
        )
    return "\n".join(lines)


def plot_fits(points: Sequence[ScalingPoint], fits: dict[str, PowerLawFit], path: Path) -> Path:
    """Final validation loss against non-embedding parameters (log x), one colour per condition, with the
    fitted curve."""
    from gptlab.figures import pyplot, save_figure

    fig, ax = pyplot().subplots(figsize=(7.5, 4.5), dpi=120)
    for condition in sorted({p.condition for p in points}):
        mine = [p for p in points if p.condition == condition]
        fit = fits.get(condition)
        label = condition + (f" (alpha={fit.alpha:.2f})" if fit else "")
        dots = ax.scatter([p.n for p in mine], [p.loss for p in mine], s=18, label=label)
        if fit:
            grid = np.geomspace(min(p.n for p in mine) / 1.3, max(p.n for p in mine) * 1.3, 100)
            ax.plot(grid, fit.predict(grid), color=dots.get_facecolor()[0], linewidth=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("non-embedding parameters N")
    ax.set_ylabel("final validation loss (nats)")
    ax.set_title("L(N) = E + A N^-alpha per condition")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def write_scaling(
    sweep_dir: str | Path,
    out_dir: str | Path | None = None,
    resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[dict[str, PowerLawFit], list[ScalingPoint], list[tuple[Path, str]], Path]:
    """Read, fit and write ``scaling.md``, ``scaling.json`` and ``scaling.png`` into ``out_dir`` (default:
    the sweep directory). Returns (fits, points, skipped runs, out_dir)."""
    points, skipped = points_from_sweep(sweep_dir)
    if not points:
        raise DataError(f"No finished run below {sweep_dir} to fit.")
    fits = fit_conditions(points, resamples, confidence, seed)
    out = Path(out_dir) if out_dir else Path(sweep_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_fits(points, fits, out / "scaling.png")
    table = markdown_table(fits, confidence)
    (out / "scaling.md").write_text(
        f"# Scaling fits: {sweep_dir}\n\nL(N) = E + A N^-alpha, N = non-embedding parameters; "
        f"{confidence:.0%} percentile bootstrap intervals over runs ({resamples} resamples).\n\n{table}\n\n"
        "![scaling](scaling.png)\n"
    )
    payload: dict[str, Any] = {
        "fits": {c: asdict(f) for c, f in fits.items()},
        "points": [asdict(p) for p in points],
        "skipped": [[str(p), why] for p, why in skipped],
        "confidence": confidence,
        "resamples": resamples,
    }
    (out / "scaling.json").write_text(json.dumps(payload, indent=2))
    return fits, points, skipped, out
