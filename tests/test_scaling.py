"""The scaling fit: known parameters recovered, intervals that cover the truth as often as they say, and a
sweep's runs read through the comparison's reader, one fit per condition."""

from __future__ import annotations

import json
import math
import runpy

import numpy as np
import pytest
import yaml
from conftest import ROOT, strict_json

from gptlab.comparison import scaling
from gptlab.comparison.scaling import (
    LADDER_SIZES,
    LADDER_TRUTH,
    fit_power_law,
    fit_with_intervals,
    interval_coverage,
    non_embedding_parameters,
    points_from_sweep,
    profile_intervals,
    write_scaling,
)
from gptlab.errors import DataError


def synthetic(E: float, A: float, alpha: float, sizes, seeds: int, noise: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = np.repeat(np.asarray(sizes, dtype=float), seeds)
    loss = E + A * n**-alpha + rng.normal(0, noise, size=n.size)
    return n, loss


def test_the_fit_recovers_exact_parameters_from_noiseless_points():
    n, loss = synthetic(1.7, 400.0, 0.34, np.geomspace(1e4, 1e7, 6), 1, 0.0)
    fit = fit_power_law(n, loss)
    assert fit.E == pytest.approx(1.7, rel=1e-3)
    assert fit.A == pytest.approx(400.0, rel=1e-2)
    assert fit.alpha == pytest.approx(0.34, rel=1e-3)


@pytest.mark.parametrize("seeds", [2, 3])
def test_the_95_percent_intervals_cover_the_truth_in_95_percent_of_ladders(seeds, capsys):
    # 1,000 synthetic ladders of the shipped design with a known truth, 2 or 3 seeds per size (the shipped
    # design is 2): each interval holds the truth in 95% of them, up to the binomial spread (sd 0.7 points at
    # 1,000 ladders; the band is 4 sd wide each side). A bootstrap over the runs covered 69-83% here.
    covered = interval_coverage(seeds, ladders=1000, seed=seeds)
    assert all(0.92 <= c <= 0.98 for c in covered.values()), covered
    # the same intervals as one ladder's fit reports
    n = np.repeat(LADDER_SIZES, seeds)
    losses = LADDER_TRUTH["E"] + LADDER_TRUTH["A"] * n ** -LADDER_TRUTH["alpha"]
    losses = losses + np.random.default_rng(seeds).normal(0, 0.02, size=(1000, n.size))
    fit, found = fit_with_intervals(n, losses[0]), profile_intervals(n, losses)
    for key in LADDER_TRUTH:
        assert fit.intervals[key] == pytest.approx(tuple(found[key][0]))
        assert fit.intervals[key][0] <= getattr(fit, key) <= fit.intervals[key][1]
    assert fit.interval_method.endswith(f"on {4 * seeds - 3} residual degrees of freedom")


def test_the_coverage_is_printed_by_the_script(capsys):
    main = runpy.run_path(str(ROOT / "scripts" / "fit_scaling.py"))["main"]
    assert main(["--coverage"]) == 0
    rows = {line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()}
    covered = interval_coverage(2, seed=2)
    assert rows["2"] == f"| 2 | {covered['E']:.1%} | {covered['A']:.1%} | {covered['alpha']:.1%} |"


def test_the_intervals_narrow_with_less_noise_and_are_absent_without_residuals():
    n = np.repeat(LADDER_SIZES, 2)
    clean = LADDER_TRUTH["E"] + LADDER_TRUTH["A"] * n ** -LADDER_TRUTH["alpha"]
    noise = np.random.default_rng(0).normal(0, 1, size=n.size)
    widths = []
    for scale in (0.02, 0.002):
        fit = fit_with_intervals(n, clean + scale * noise)
        widths.append(fit.intervals["alpha"][1] - fit.intervals["alpha"][0])
    assert widths[1] < widths[0] / 5 and widths[1] < 0.05
    # three runs at three sizes: the curve passes through them, nothing is left to measure the noise
    three = fit_with_intervals(LADDER_SIZES[:3], clean[::2][:3])
    assert three.intervals == {} and three.interval_method == ""


def test_fewer_than_three_sizes_cannot_be_fitted():
    with pytest.raises(DataError, match="at least 3 distinct sizes"):
        fit_power_law([1e4, 1e4, 1e5, 1e5], [3.0, 3.1, 2.5, 2.6])


def _fake_run(
    path,
    overrides: list[str],
    n_embd: int,
    pos: str,
    val_loss: float,
    finished: bool = True,
    mlp: dict | None = None,
):
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    model = {"n_layer": 2, "n_head": 4, "n_embd": n_embd, "block_size": 64, "vocab_size": None}
    config = {
        "model": model,
        "pos": {"name": pos},
        "activation": {"name": "gelu"},
        "norm": {"name": "layernorm"},
    }
    if mlp is not None:  # conf/mlp's node: {name: dense} or {name: moe, experts: ..., top_k: ...}
        config["mlp"] = mlp
    (path / "config_resolved.yaml").write_text(yaml.safe_dump(config))
    (path / "csv").mkdir()
    (path / "csv" / "metrics.csv").write_text(f"step,val/loss\n99,{val_loss + 0.5}\n199,{val_loss}\n")
    result = {
        "metrics": {"val/loss": val_loss},
        "global_step": 200 if finished else 120,
        "finished": finished,
    }
    (path / "result.json").write_text(json.dumps(result))


def test_a_sweep_gives_one_point_per_run_with_its_non_embedding_parameters_and_condition(tmp_path, capsys):
    job = 0
    for pos, E in (("learned", 1.5), ("rope", 1.4)):
        for n_embd in (32, 64, 128, 256):
            for seed in (0, 1):
                n = 12 * 2 * n_embd**2  # about the non-embedding parameters
                loss = E + 30 * n**-0.3 + 0.01 * seed
                overrides = [
                    "experiment=scaling_ladder",
                    f"model.n_embd={n_embd}",
                    f"pos={pos}",
                    f"seed={seed}",
                ]
                _fake_run(tmp_path / f"{job}", overrides, n_embd, pos, loss)
                job += 1
    points, skipped = points_from_sweep(tmp_path)
    assert len(points) == 16 and not skipped
    assert {p.condition for p in points} == {"pos=learned", "pos=rope"}
    # the count of model/counting.py, from the run's config: the token table (vocabulary unknown) left out
    assert non_embedding_parameters(tmp_path / "0") == min(
        p.n for p in points if p.condition == "pos=learned"
    )
    n32 = min(p.n for p in points)
    assert 12 * 2 * 32**2 < n32 < 12 * 2 * 32**2 * 1.2  # + biases and norms

    out = tmp_path / "fit"
    main = runpy.run_path(str(ROOT / "scripts" / "fit_scaling.py"))["main"]
    assert main([str(tmp_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| pos=learned | 8 | 4 |" in printed and "| pos=rope | 8 | 4 |" in printed
    saved = strict_json(out / "scaling.json")
    for condition in ("pos=learned", "pos=rope"):
        fit = saved["fits"][condition]
        assert 0.2 < fit["alpha"] < 0.4  # the generating exponent, 0.3, up to the seed offsets
        assert fit["intervals"]["alpha"][0] <= fit["alpha"] <= fit["intervals"]["alpha"][1]
    assert (out / "scaling.png").stat().st_size > 10_000 and (out / "scaling.md").is_file()


def test_scaling_json_is_strict_with_a_diverged_run_and_a_fit_without_intervals(tmp_path):
    """A sweep of three sizes and a fourth that diverged (val/loss inf, as result.json writes it): scaling.json
    parses strictly, the diverged run is among the skipped, and the fit of three runs, which has no interval,
    has each interval null and named with the reason, not left out or 0."""
    for job, n_embd in enumerate((32, 64, 128)):
        _fake_run(tmp_path / f"{job}", [f"model.n_embd={n_embd}"], n_embd, "learned", 2.0 - 0.1 * job)
    _fake_run(tmp_path / "3", ["model.n_embd=256"], 256, "learned", math.inf)
    result = json.loads((tmp_path / "3" / "result.json").read_text())
    result["metrics"]["val/loss"] = "inf"
    (tmp_path / "3" / "result.json").write_text(json.dumps({**result, "diverged": True}))
    fits, points, skipped, out = write_scaling(tmp_path, tmp_path / "fit")
    assert len(points) == 3 and [p.name for p, _ in skipped] == ["3"]
    saved = strict_json(out / "scaling.json")
    (fit,) = saved["fits"].values()
    assert fit["intervals"] == {"E": None, "A": None, "alpha": None}
    assert fit["intervals_missing"] == ["E", "A", "alpha"]
    assert fit["intervals_missing_reason"] == scaling.NO_INTERVALS
    assert saved["skipped"] == [[str(tmp_path / "3"), "diverged (final validation loss inf)"]]


def test_unfinished_and_diverged_runs_are_left_out(tmp_path, monkeypatch):
    from gptlab.comparison import report

    for job, n_embd in enumerate((32, 64, 128)):
        _fake_run(tmp_path / f"{job}", [f"model.n_embd={n_embd}"], n_embd, "learned", 2.0 - 0.1 * job)
    real_read_sweep = report.read_sweep

    def read_sweep_marking_one_unfinished(sweep_dir, source="auto"):
        runs, skipped = real_read_sweep(sweep_dir, source)
        for run in runs:
            if run.path.name == "2":
                run.status = "killed"
        return runs, skipped

    monkeypatch.setattr(report, "read_sweep", read_sweep_marking_one_unfinished)
    points, skipped = points_from_sweep(tmp_path)
    assert len(points) == 2 and [p.name for p, _ in skipped] == ["2"] and "unfinished" in skipped[0][1]
    # a run whose result.json says it diverged
    result = json.loads((tmp_path / "1" / "result.json").read_text())
    (tmp_path / "1" / "result.json").write_text(json.dumps({**result, "diverged": True}))
    points, skipped = points_from_sweep(tmp_path)
    assert len(points) == 1 and sorted(p.name for p, _ in skipped) == ["1", "2"]
    assert dict((p.name, why) for p, why in skipped)["1"] == "diverged (final validation loss 1.9)"


MOE = {"name": "moe", "experts": 8, "top_k": 2, "expert_hidden": None, "shared_experts": 0}


def _non_embedding_of_a_token(n_embd: int, mlp: dict) -> tuple[int, int]:
    """(non-embedding parameters in all, those one token passes through) of the model a _fake_run trained,
    counted from the model's own weights (on the meta device): the latter less the (experts - top_k) experts
    per layer that a token is not routed to."""
    import torch

    from gptlab.model.config import GPTConfig
    from gptlab.model.gpt import GPT

    config = {"n_layer": 2, "n_head": 4, "n_embd": n_embd, "block_size": 64, "vocab_size": 1}
    with torch.device("meta"):
        model = GPT(GPTConfig.from_dict({**config, "pos": {"name": "learned"}, "mlp": dict(mlp)}))
    counts = model.parameter_counts()
    unused = 0
    if mlp["name"] == "moe":
        unused = sum(
            (mlp["experts"] - mlp["top_k"]) * block.mlp.expert_parameters() for block in model.transformer.h
        )
    return counts["non_embedding"], counts["non_embedding"] - unused


def test_an_moe_ladder_is_fitted_on_its_active_parameters_and_says_so(tmp_path, capsys, monkeypatch):
    """Dense and MoE ladders side by side: every point's N is the non-embedding parameters a token passes
    through (the MoE's top_k experts, not all 8), its total kept in scaling.json, and the report, the plot's
    axis and the script name N as active; a dense-only fit keeps its words."""
    import gptlab.figures

    widths = {}
    for job, (mlp, E, n_embd) in enumerate(
        (mlp, E, n_embd) for mlp, E in (({"name": "dense"}, 1.5), (MOE, 1.4)) for n_embd in (32, 64, 128, 256)
    ):
        n = _non_embedding_of_a_token(n_embd, mlp)[1]
        overrides = [f"model.n_embd={n_embd}", f"mlp={mlp['name']}"]
        _fake_run(tmp_path / f"{job}", overrides, n_embd, "learned", E + 30 * n**-0.3, mlp=mlp)
        widths[str(tmp_path / f"{job}")] = (n_embd, mlp)
    points, skipped = points_from_sweep(tmp_path)
    assert not skipped and {p.condition for p in points} == {"mlp=dense", "mlp=moe"}
    for point in points:
        n_embd, mlp = widths[point.path]
        total, active = _non_embedding_of_a_token(n_embd, mlp)
        assert (point.n, point.n_total) == (active, total)
        assert point.sparse == (mlp is MOE)
        assert total > 2 * active if mlp is MOE else total == active

    xlabels = []
    save_figure = gptlab.figures.save_figure

    def recording_the_axis(fig, path):
        xlabels.append(fig.axes[0].get_xlabel())
        return save_figure(fig, path)

    monkeypatch.setattr(gptlab.figures, "save_figure", recording_the_axis)
    out = tmp_path / "fit"
    main = runpy.run_path(str(ROOT / "scripts" / "fit_scaling.py"))["main"]
    assert main([str(tmp_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"8 runs; N = active non-embedding parameters ({scaling.ACTIVE_N_NOTE})\n")
    moe = sorted((p for p in points if p.condition == "mlp=moe"), key=lambda p: p.n)
    dense = sorted((p for p in points if p.condition == "mlp=dense"), key=lambda p: p.n)
    assert (
        f"mlp=moe: N = {', '.join(f'{p.n:,.0f}' for p in moe)} active "
        f"(in all {', '.join(f'{p.n_total:,.0f}' for p in moe)})\n"
    ) in printed
    assert f"mlp=dense: N = {', '.join(f'{p.n:,.0f}' for p in dense)}\n" in printed
    saved = strict_json(out / "scaling.json")
    for condition in ("mlp=dense", "mlp=moe"):  # the generating exponent, 0.3, found on the active N
        assert saved["fits"][condition]["alpha"] == pytest.approx(0.3, abs=1e-3)
    assert saved["n"] == "active non-embedding parameters"
    assert sorted((p["n"], p["n_total"]) for p in saved["points"]) == sorted((p.n, p.n_total) for p in points)
    report = (out / "scaling.md").read_text()
    assert f"N = active non-embedding parameters ({scaling.ACTIVE_N_NOTE}); " in report
    assert xlabels == ["active non-embedding parameters N (MoE: a token's experts, not all)"]

    scaling.write_fits(dense, [], tmp_path / "dense_fit", "dense")
    assert "N = non-embedding parameters; " in (tmp_path / "dense_fit" / "scaling.md").read_text()
    assert strict_json(tmp_path / "dense_fit" / "scaling.json")["n"] == "non-embedding parameters"
    assert xlabels[-1] == "non-embedding parameters N"
