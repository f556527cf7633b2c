"""Scaling laws from a sweep over model sizes: L(N) = E + A N^-alpha per condition, with profile-likelihood
intervals.

The form is Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", https://arxiv.org/abs/2001.08361,
eq. 1.1 with an irreducible term) and the N-part of Hoffmann et al. 2022 ("Training Compute-Optimal Large
Language Models", https://arxiv.org/abs/2203.15556, eq. 2, approach 3). N is the **non-embedding**
parameter count (Kaplan et al.'s choice: the embedding table's size says little about the loss at small N),
counted from each run's ``config_resolved.yaml`` (``gptlab.model.counting``), of the weights a token passes
through: all of a dense model's, and of a Mixture-of-Experts model (``mlp=moe``) its *active* ones, the
routers', the shared experts' and top_k experts' (Clark et al. 2022, "Unified Scaling Laws for Routed Language
Models", https://arxiv.org/abs/2202.01169, fit an MoE's loss against this dense-equivalent size, the expert
count apart). Every point is then on one measure, the one its training FLOPs per token (6 N) count, and an MoE
curve lies beside the dense one at equal work per token; its total (every expert) is kept in ``scaling.json``
(``n_total``), and wherever N is active the report, the plot and the script say so. The loss is the run's final
validation loss; every run was trained on the same number of tokens, so the fit describes L(N) at that data
budget, not a compute-optimal frontier.

Runs are read with the comparison's own reader (``gptlab.comparison.report.read_sweep``); unfinished runs
(killed, or still running) and diverged ones are left out. A *condition* is what the runs' overrides say
besides the size and the seed (``pos=rope``): one curve is fitted per condition.

The fit: for a fixed alpha the model is linear in (E, A), solved by least squares with E, A >= 0; alpha is
then the minimiser of the squared error (a grid, then a bounded scalar search). Intervals: the profile
likelihood with Student's t on the residual degrees of freedom (:func:`profile_intervals`). A bootstrap over
the runs is too narrow at the ladder's design: with 2 or 3 seeds per size, resampling them understates the
spread, and its 95% intervals covered a known truth in 69-83% of synthetic ladders; the profile intervals
cover it in about 95% (``tests/test_scaling.py``, docs/studies.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.errors import DataError
from gptlab.runs.jsonfile import all_figures_as_json, write_json

# Overrides that set the size of a model: not part of a condition.
SIZE_KEYS = ("model", "model.n_embd", "model.n_layer", "model.n_head", "model.mlp_ratio", "model.n_kv_head")
IGNORED_KEYS = ("seed",)
ALPHA_BOUNDS = (0.01, 3.0)  # the exponents the fit considers
PROFILE_GRID = 2001  # alphas on which the profile intervals are computed (steps of 0.0015)
INTERVAL_METHOD = "profile likelihood, Student's t on {df} residual degrees of freedom"


@dataclass(frozen=True)
class ScalingPoint:
    """One run: its non-embedding parameters a token passes through (``n``: a dense model's all, an MoE's
    active ones), final validation loss and condition; ``n_total``: its non-embedding parameters in all (every
    expert), None where not recorded (taken as ``n``)."""

    n: float
    loss: float
    condition: str = ""
    path: str = ""
    n_total: float | None = None

    @property
    def sparse(self) -> bool:
        """Whether its N is fewer than its parameters in all: an MoE run's active count."""
        return self.n_total is not None and self.n_total != self.n


# What N is, in the report's, the plot's and the script's words.
DENSE_N = "non-embedding parameters"
ACTIVE_N = "active non-embedding parameters"
ACTIVE_N_NOTE = (
    "the weights one token passes through: a Mixture-of-Experts run's routers', shared and top_k experts', "
    "not all its experts (their total is each point's n_total in scaling.json); a dense run's all"
)


def n_measure(points: Sequence[ScalingPoint]) -> str:
    """What the points' N is: ``non-embedding parameters``, or ``active non-embedding parameters`` where an
    MoE run's count of the weights a token passes through is among them."""
    return ACTIVE_N if any(p.sparse for p in points) else DENSE_N


@dataclass
class PowerLawFit:
    """L(N) = E + A N^-alpha, with (low, high) intervals of each parameter."""

    E: float
    A: float
    alpha: float
    rmse: float
    n_points: int
    n_sizes: int
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    interval_method: str = ""  # how the intervals were made; "" where there are none (3 runs: no residual)

    def predict(self, n: np.ndarray | float) -> np.ndarray:
        return self.E + self.A * np.power(np.asarray(n, dtype=float), -self.alpha)


# ---- fitting ----------------------------------------------------------------------------------------------
def _linear_fits(x: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """min over E, A >= 0 of ||E + A x - loss||^2 for every pair of a row of ``x`` (M, P: one alpha each) and a
    row of ``loss`` (G, P: one ladder each): (E, A, squared error), each (G, M). The unconstrained least
    squares, or where it breaks a bound, the best fit on that bound. From the sums alone (no (G, M, P) array),
    so that many ladders are fitted at once."""
    x, loss = np.atleast_2d(x), np.atleast_2d(loss)
    p = x.shape[1]
    mx, ml = x.mean(axis=1), loss.mean(axis=1, keepdims=True)  # (M,), (G, 1)
    sxx = ((x - mx[:, None]) ** 2).sum(axis=1)  # (M,)
    xx = (x * x).sum(axis=1)
    xy = loss @ x.T  # (G, M)
    sxy = xy - p * ml * mx
    syy = ((loss - ml) ** 2).sum(axis=1, keepdims=True)  # (G, 1)
    yy = (loss * loss).sum(axis=1, keepdims=True)
    A = np.where(sxx > 0, sxy / np.where(sxx > 0, sxx, 1), 0.0)
    E = ml - A * mx
    sse = np.maximum(syy - A * sxy, 0.0)
    # E < 0 (A >= 0): the best line through the origin.
    on_E_bound = (E < 0) & (A >= 0)
    A_origin = np.maximum(xy / np.maximum(xx, 1e-300), 0.0)
    E = np.where(on_E_bound, 0.0, E)
    A = np.where(on_E_bound, A_origin, A)
    sse = np.where(on_E_bound, np.maximum(yy - 2 * A_origin * xy + A_origin**2 * xx, 0.0), sse)
    # A < 0: the best constant (not below 0).
    on_A_bound = A < 0
    constant = np.maximum(ml, 0.0)
    A = np.where(on_A_bound, 0.0, A)
    E = np.where(on_A_bound, constant, E)
    sse = np.where(on_A_bound, syy + p * (ml - constant) ** 2, sse)
    return E, A, sse


def fit_power_law(
    n: Sequence[float], loss: Sequence[float], alpha_bounds: tuple[float, float] = ALPHA_BOUNDS
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
        return float(_linear_fits(np.exp(-alpha * log_u)[None, :], loss_arr)[2][0, 0])

    grid = np.linspace(alpha_bounds[0], alpha_bounds[1], 300)
    errors = _linear_fits(np.exp(-grid[:, None] * log_u[None, :]), loss_arr)[2][0]
    i = int(np.argmin(errors))
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    alpha = float(grid[i])
    if hi > lo:
        result = minimize_scalar(error, bounds=(lo, hi), method="bounded", options={"xatol": 1e-7})
        if result.fun <= errors[i]:
            alpha = float(result.x)
    E, A_scaled, sse = (float(v[0, 0]) for v in _linear_fits(np.exp(-alpha * log_u)[None, :], loss_arr))
    return PowerLawFit(
        E=E,
        A=A_scaled * scale**alpha,  # A_scaled (N/scale)^-alpha = (A_scaled scale^alpha) N^-alpha
        alpha=alpha,
        rmse=math.sqrt(sse / len(n_arr)),
        n_points=len(n_arr),
        n_sizes=len(np.unique(n_arr)),
    )


def profile_intervals(
    n: Sequence[float] | np.ndarray,
    losses: np.ndarray,
    confidence: float = 0.95,
    alpha_bounds: tuple[float, float] = ALPHA_BOUNDS,
    grid: int = PROFILE_GRID,
) -> dict[str, np.ndarray]:
    """Profile-likelihood intervals of E, A and alpha for each row of ``losses`` (G ladders, P runs each, at
    the sizes ``n``): each parameter's values whose best fit, the other two free (E, A >= 0, alpha in
    ``alpha_bounds``), has a squared error within ``SSE (1 + t^2 / (P - 3))`` of the best, t the two-sided
    ``confidence`` quantile of Student's t on the P - 3 residual degrees of freedom (Bates & Watts 1988,
    "Nonlinear Regression Analysis and Its Applications", chapter 6: the profile t). ``{"E": (G, 2),
    "A": (G, 2), "alpha": (G, 2)}`` of (low, high); NaN rows where P <= 3 (no residual to estimate the noise
    from).

    For a fixed alpha the model is linear in (E, A), so the squared error at a fixed E (or A), the other
    minimised, is a parabola (or, where that minimum would break its bound, the fit on the bound, another
    parabola); the interval of E is the union over an alpha grid of where those parabolas lie below the
    threshold, and the same for A. Everything is sums over the P runs: many ladders are done at once."""
    from scipy import stats

    n_arr = np.asarray(n, dtype=float)
    y = np.atleast_2d(np.asarray(losses, dtype=float))  # (G, P)
    g, p = y.shape
    out = {key: np.full((g, 2), np.nan) for key in ("E", "A", "alpha")}
    if p <= 3:
        return out
    scale = float(np.exp(np.mean(np.log(n_arr))))
    alphas = np.linspace(alpha_bounds[0], alpha_bounds[1], grid)
    x = np.exp(-alphas[:, None] * np.log(n_arr / scale)[None, :])  # (M, P)
    _, _, sse = _linear_fits(x, y)  # (G, M): the best fit at each alpha
    best = sse.min(axis=1, keepdims=True)
    t = float(stats.t.ppf(0.5 + confidence / 2, p - 3))
    threshold = best * (1 + t * t / (p - 3))  # (G, 1)

    # alpha: where the profile lies below the threshold, its ends interpolated between grid points
    inside = sse <= threshold
    first, last = inside.argmax(axis=1), grid - 1 - inside[:, ::-1].argmax(axis=1)
    rows = np.arange(g)

    def crossing(i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """alpha where the profile crosses the threshold between grid points i (outside) and j (inside)."""
        si, sj = sse[rows, i], sse[rows, j]
        frac = np.clip((threshold[:, 0] - si) / np.where(sj != si, sj - si, 1.0), 0.0, 1.0)
        return alphas[i] + frac * (alphas[j] - alphas[i])

    out["alpha"][:, 0] = np.where(first > 0, crossing(np.maximum(first - 1, 0), first), alphas[0])
    out["alpha"][:, 1] = np.where(last < grid - 1, crossing(np.minimum(last + 1, grid - 1), last), alphas[-1])

    mx, xx, sx = x.mean(axis=1), (x * x).sum(axis=1), x.sum(axis=1)  # (M,)
    sxx = np.maximum(xx - p * mx * mx, 1e-300)
    ml = y.mean(axis=1, keepdims=True)  # (G, 1)
    syy = ((y - ml) ** 2).sum(axis=1, keepdims=True)
    xy = y @ x.T  # (G, M)
    sxy = xy - p * ml * mx
    A_free, sse_free = sxy / sxx, syy - sxy**2 / sxx  # the unconstrained fit at each alpha
    E_free = ml - A_free * mx

    def below(centre: np.ndarray, floor: np.ndarray, curvature: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where floor + curvature (v - centre)^2 <= threshold: (low, high), NaN where nowhere."""
        room = (threshold - floor) / curvature
        half = np.sqrt(np.where(room >= 0, room, np.nan))
        return centre - half, centre + half

    def hull(pieces: list[tuple[np.ndarray, np.ndarray]], floor: float = 0.0) -> np.ndarray:
        """(low, high) over every piece and alpha with a non-empty part at or above ``floor``."""
        lows = np.concatenate([np.broadcast_to(lo, (g, grid)) for lo, _ in pieces], axis=1)
        highs = np.concatenate([np.broadcast_to(hi, (g, grid)) for _, hi in pieces], axis=1)
        lows = np.maximum(lows, floor)
        ok = highs >= lows  # False where NaN
        low = np.where(ok, lows, np.inf).min(axis=1)
        high = np.where(ok, highs, -np.inf).max(axis=1)
        return np.where(np.isfinite(low)[:, None], np.stack([low, high], axis=1), np.nan)

    # E fixed, A >= 0 free: A(E) = (xy - E sx) / xx while E <= xy / sx (a parabola in E of curvature
    # p sxx / xx about the free fit), else A = 0 and the error is syy + p (E - mean)^2.
    E_turn = xy / sx
    lo, hi = below(E_free, sse_free, p * sxx / xx)
    flat_lo, flat_hi = below(ml, syy, np.array(float(p)))
    out["E"] = hull([(lo, np.minimum(hi, E_turn)), (np.maximum(flat_lo, E_turn), flat_hi)])

    # A fixed, E >= 0 free: E(A) = mean - A mx while A <= mean / mx (a parabola in A of curvature sxx about
    # the free fit), else E = 0 and the error is a parabola about the fit through the origin.
    A_turn = ml / mx
    lo, hi = below(A_free, sse_free, sxx)
    A_origin = xy / xx
    origin_lo, origin_hi = below(A_origin, (y * y).sum(axis=1, keepdims=True) - xy * A_origin, xx)
    to_n = scale**alphas  # A for (N / scale)^-alpha -> A for N^-alpha
    out["A"] = hull(
        [(lo * to_n, np.minimum(hi, A_turn) * to_n), (np.maximum(origin_lo, A_turn) * to_n, origin_hi * to_n)]
    )
    return out


def fit_with_intervals(n: Sequence[float], loss: Sequence[float], confidence: float = 0.95) -> PowerLawFit:
    """``fit_power_law`` on the points, with profile-likelihood intervals for E, A and alpha
    (:func:`profile_intervals`); none where there are no more runs than parameters (3)."""
    fit = fit_power_law(n, loss)
    found = profile_intervals(n, np.asarray(loss, dtype=float)[None, :], confidence)
    for name, bounds in found.items():
        if np.all(np.isfinite(bounds[0])):
            fit.intervals[name] = (float(bounds[0, 0]), float(bounds[0, 1]))
    if fit.intervals:
        fit.interval_method = INTERVAL_METHOD.format(df=fit.n_points - 3)
    return fit


# ---- how often the intervals hold the truth ---------------------------------------------------------------
# The shipped ladder (experiment=scaling_ladder: non-embedding parameters at widths 32-256, 2 blocks) and a
# truth like its RoPE fit (docs/studies.md), with seed-to-seed noise of 0.02 nats.
LADDER_SIZES = (25_472.0, 100_096.0, 396_800.0, 1_580_032.0)
LADDER_TRUTH = {"E": 1.7, "A": 165.0, "alpha": 0.533}


def interval_coverage(
    seeds: int,
    ladders: int = 1000,
    sizes: Sequence[float] = LADDER_SIZES,
    truth: dict[str, float] | None = None,
    noise: float = 0.02,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, float]:
    """The share of ``ladders`` synthetic ladders (``seeds`` runs per size, Gaussian noise of sd ``noise``
    about a known ``truth``) whose ``confidence`` intervals (:func:`profile_intervals`) hold the true E, A
    and alpha."""
    truth = truth or LADDER_TRUTH
    n = np.repeat(np.asarray(sizes, dtype=float), seeds)
    clean = truth["E"] + truth["A"] * n ** -truth["alpha"]
    losses = clean + np.random.default_rng(seed).normal(0, noise, size=(ladders, n.size))
    found = profile_intervals(n, losses, confidence)
    return {
        key: float(np.mean((found[key][:, 0] <= value) & (value <= found[key][:, 1])))
        for key, value in truth.items()
    }


# ---- reading a sweep --------------------------------------------------------------------------------------
def non_embedding_counts(run_dir: Path) -> tuple[float, float]:
    """(non-embedding parameters in all, those a token passes through) of the model a run trained, from its
    ``config_resolved.yaml`` (the vocabulary does not enter them): equal for a dense model; under ``mlp=moe``
    the second counts a token's top_k experts, not all of them. Read as the trainer reads the config
    (:func:`gptlab.comparison.records.config_parameter_counts`), without importing the training stack. Multi-token prediction's extra heads (the
    ``mtp`` node) are left out: the fitted loss, val/loss, is the next-token model's, which does not use them
    (the run's training FLOPs, model/flops_per_token, do count them)."""
    from gptlab.comparison.records import config_parameter_counts
    from gptlab.runs.layout import Run

    cfg = Run(Path(run_dir)).config()
    if not cfg or "model" not in cfg:
        raise DataError(f"{run_dir} has no config_resolved.yaml: its model size is unknown.")
    counts = config_parameter_counts(cfg)
    return float(counts["non_embedding"]), float(counts["active"] - counts["embedding"])


def non_embedding_parameters(run_dir: Path) -> float:
    """The non-embedding parameter count of the model a run trained, every expert of an MoE counted
    (:func:`non_embedding_counts`)."""
    return non_embedding_counts(run_dir)[0]


def points_from_sweep(
    sweep_dir: str | Path, size_keys: Sequence[str] = SIZE_KEYS
) -> tuple[list[ScalingPoint], list[tuple[Path, str]]]:
    """(one point per finished run, the runs left out with the reason), read through ``read_sweep``; a
    point's N is its non-embedding parameters a token passes through (an MoE run's active ones), its
    condition the comparison's (:mod:`gptlab.comparison.table`), the size keys left out."""
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
        elif run.diverged:
            skipped.append((Path(run.path), f"diverged (final validation loss {run.final_val_loss:.4g})"))
        else:
            finished.append(run)
    keys = condition_keys(finished, Path(sweep_dir), ignore=[*size_keys, *IGNORED_KEYS])
    points = []
    for run in finished:
        try:
            total, active = non_embedding_counts(Path(run.path))
        except DataError as e:
            skipped.append((Path(run.path), str(e)))
            continue
        assert run.final_val_loss is not None
        condition = label_of(condition_of(run, keys))
        points.append(ScalingPoint(active, float(run.final_val_loss), condition, str(run.path), total))
    return points, skipped


def fit_conditions(points: Sequence[ScalingPoint], confidence: float = 0.95) -> dict[str, PowerLawFit]:
    """One fit with intervals per condition (conditions with fewer than 3 sizes are left out)."""
    fits = {}
    for condition in sorted({p.condition for p in points}):
        mine = [p for p in points if p.condition == condition]
        if len({p.n for p in mine}) < 3:
            continue
        fits[condition] = fit_with_intervals([p.n for p in mine], [p.loss for p in mine], confidence)
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
    """Final validation loss against N (log x), one colour per condition, with the fitted curve; the x axis
    says which N (:func:`n_measure`: active where an MoE run is among the points)."""
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
    measure = n_measure(points)
    ax.set_xlabel(f"{measure} N" + (" (MoE: a token's experts, not all)" if measure == ACTIVE_N else ""))
    ax.set_ylabel("final validation loss (nats)")
    ax.set_title("L(N) = E + A N^-alpha per condition")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def write_scaling(
    sweep_dir: str | Path,
    out_dir: str | Path | None = None,
    confidence: float = 0.95,
) -> tuple[dict[str, PowerLawFit], list[ScalingPoint], list[tuple[Path, str]], Path]:
    """Read, fit and write ``scaling.md``, ``scaling.json`` and ``scaling.png`` into ``out_dir`` (default:
    the sweep directory). Returns (fits, points, skipped runs, out_dir)."""
    points, skipped = points_from_sweep(sweep_dir)
    if not points:
        raise DataError(f"No finished run below {sweep_dir} to fit.")
    out = Path(out_dir) if out_dir else Path(sweep_dir)
    fits = write_fits(points, skipped, out, str(sweep_dir), confidence)
    return fits, points, skipped, out


def write_fits(
    points: Sequence[ScalingPoint],
    skipped: Sequence[tuple[Path, str]],
    out: Path,
    title: str,
    confidence: float = 0.95,
) -> dict[str, PowerLawFit]:
    """Fit ``points`` per condition and write ``scaling.md``, ``scaling.json`` (the points with them, so that
    the fits can be made again from it alone) and ``scaling.png`` into ``out``."""
    fits = fit_conditions(points, confidence)
    out.mkdir(parents=True, exist_ok=True)
    plot_fits(points, fits, out / "scaling.png")
    table = markdown_table(fits, confidence)
    measure = n_measure(points)
    what = f"{measure} ({ACTIVE_N_NOTE})" if measure == ACTIVE_N else measure
    (out / "scaling.md").write_text(
        f"# Scaling fits: {title}\n\nL(N) = E + A N^-alpha, N = {what}; "
        f"{confidence:.0%} profile-likelihood intervals (Student's t on the residual degrees of freedom: "
        f"the runs less 3).\n\n{table}\n\n"
        "![scaling](scaling.png)\n"
    )
    payload: dict[str, Any] = {
        "n": measure,
        "fits": {c: fit_as_json(f) for c, f in fits.items()},
        "points": [asdict(p) for p in points],
        "skipped": [[str(p), why] for p, why in skipped],
        "confidence": confidence,
    }
    # strict JSON (gptlab.runs.jsonfile), written whole: a figure that is not finite as "inf"/"nan"
    write_json(out / "scaling.json", all_figures_as_json(payload))
    return fits


# Why a fit has no intervals: the profile's threshold needs a residual degree of freedom.
NO_INTERVALS = "no more runs than the fit's 3 parameters (E, A, alpha): no residual to size an interval on"
NO_INTERVAL = "the profile likelihood is below its threshold nowhere inside the bounds"


def fit_as_json(fit: PowerLawFit) -> dict[str, Any]:
    """A fit as ``scaling.json`` writes it: each of E, A and alpha has an interval, ``null`` where none was
    found, named in ``intervals_missing`` with the reason in ``intervals_missing_reason``."""
    out = asdict(fit)
    out["intervals"] = {name: fit.intervals.get(name) for name in ("E", "A", "alpha")}
    missing = [name for name, bounds in out["intervals"].items() if bounds is None]
    if missing:
        out["intervals_missing"] = missing
        out["intervals_missing_reason"] = NO_INTERVALS if fit.n_points <= 3 else NO_INTERVAL
    return out
