"""`python train.py -m ...` from the grid to the answer: one run directory and one W&B run per job, named,
grouped and tagged from the overrides, then a comparison; and an Optuna search."""

import itertools
import math
import runpy
import statistics

import pytest
from conftest import ROOT, TINY, run_train
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from gptlab.comparison.report import compare
from gptlab.runs.layout import Run, last_checkpoint
from gptlab.tracking.wandb_runs import find_runs, read_run

# A tiny character-level model: a job trains in seconds.
FAST = [*TINY, "tokenizer=char", "trainer.log_every_n_steps=2"]
# The jobs of the session's sweep (tests/conftest.py: SWEEP, logger=all), in Hydra's order: the product of the
# swept values, the last key varying fastest.
JOBS = {
    str(num): {"pos": pos, "activation": activation, "seed": seed}
    for num, (pos, activation, seed) in enumerate(
        itertools.product(["learned", "rope"], ["gelu", "swiglu"], [0, 1])
    )
}


@pytest.fixture(scope="module")
def sweep(tiny_sweep):
    return tiny_sweep


def test_multirun_leaves_one_run_directory_and_one_wandb_run_per_job(sweep):
    root, sweep_dir, _ = sweep
    jobs = sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
    )
    assert [p.name for p in jobs] == list(JOBS)
    runs = {}
    for job in jobs:
        files = find_runs(job / "wandb")
        assert len(files) == 1, f"job {job.name}: {files}"
        runs[job.name] = read_run(files[0])
        assert (last_checkpoint(job)).is_file()
    assert len({r.run_id for r in runs.values()}) == len(JOBS)  # one run per job, not one reused run

    for job, choice in JOBS.items():
        run = runs[job]
        pos, activation, seed = choice["pos"], choice["activation"], choice["seed"]
        # one group per sweep (its directory, relative to where the sweep was started), a job type, a name
        # from what the sweep varies, and a tag per override
        assert run.group == "multirun/tiny_pos"
        assert run.job_type == "sweep"
        assert run.name == f"pos={pos} activation={activation} seed={seed}"
        assert {f"pos={pos}", f"activation={activation}", f"seed={seed}", "tokenizer=char"} <= set(run.tags)
        assert not any(t.startswith(("paths.", "hydra.", "logger")) for t in run.tags)
        # the resolved config, so the W&B UI groups by pos.name and averages over seed
        assert run.config["pos"]["name"] == pos and run.config["seed"] == seed
        assert run.config["sweep"]["group_key"] == f"pos={pos} activation={activation}"
        assert run.config["sweep"]["job_num"] == int(job)
        assert run.exit_code == 0

        val = run.metric("val/loss")
        assert [s for s, _ in val] == [4, 7]  # validation after step 4, and at the last step, 7
        assert math.isclose(run.metric("val/ppl")[-1][1], math.exp(val[-1][1]), rel_tol=1e-4)
        grad_norms = [v for _, v in run.metric("train/grad_norm")]
        assert grad_norms and all(v > 0 and math.isfinite(v) for v in grad_norms)
        mfu = [v for _, v in run.metric("train/mfu")]
        assert mfu and all(0 < v < 1 for v in mfu)
        assert run.metric("lr") and run.metric("train/tokens_per_second") and run.metric("train/loss")
        assert run.summary["parameters/total"] == run.metric("parameters/total")[0][1] > 0
        assert run.summary["samples/_type"] == "table-file"


def test_a_sweep_ends_with_where_its_runs_are_and_the_command_that_compares_them(sweep):
    _, sweep_dir, proc = sweep
    closing = f"Sweep: {len(JOBS)} runs in {sweep_dir} ({len(JOBS)} finished)\n"
    closing += f"Compare them: python scripts/compare.py {sweep_dir}"
    assert proc.stdout.rstrip().endswith(closing), proc.stdout[-2000:]


def test_a_sweep_goes_on_past_failed_jobs_and_ends_naming_each_once_with_its_message(tmp_path):
    # job 0 is refused (bad input), job 1 diverges at its second step, job 2 crashes (an error that is not
    # gptlab's: a bug, injected by tests/faults.py), job 3 trains: one `python train.py -m` as a user runs it
    sweep_dir = tmp_path / "sweep"
    args = [
        "-m",
        *FAST,
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "logger=csv",
        f"paths.root_dir={tmp_path}",
        f"hydra.sweep.dir={sweep_dir}",
        "optim.lr=-1,1e30,1e-3,2e-3",
    ]
    fault = {"GPTLAB_TEST_FAULT": "raise_at_step:1:optim.lr=0.001"}  # as Hydra writes the job's override
    proc = run_train(args, tmp_path, env=fault, check=False, script=ROOT / "tests" / "faults.py")
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 1, err[-3000:]  # 1: a job failed in training (2 where every one was refused)

    # the job after the failed ones ran to the end; the diverged and the crashed ones keep their failure
    assert Run(sweep_dir / "3").result()["finished"]
    assert "failed" in Run(sweep_dir / "1").result() and "failed" in Run(sweep_dir / "2").result()
    assert not (sweep_dir / "0").exists()  # a refused job leaves no run directory
    assert f"Sweep: 3 runs in {sweep_dir} (2 failed, 1 finished)\nCompare them: " in out
    # each failed job: one line when it happened, then its message once, in the sweep's closing lines; not
    # Hydra's line with the job's whole command line, nor a traceback
    assert "Error executing job" not in err and "Traceback" not in err + out, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("gptlab: job #")]
    assert said == [
        "gptlab: job #0 (lr=-1) was refused; the sweep's closing lines say why",
        "gptlab: job #1 (lr=1e+30) failed; the sweep's closing lines say why",
        "gptlab: job #2 (lr=0.001) crashed; the sweep's closing lines say why",
    ]
    closing = err[err.index("gptlab: error: 3 jobs of the sweep did not run to the end:") :]
    lines = closing.splitlines()
    assert lines[1] == "  job #0 (lr=-1) was refused: optim.lr=-1.0 must be positive (e.g. optim.lr=0.004)."
    assert lines[2].startswith("  job #1 (lr=1e+30) failed: The training loss is nan at step 2: ")
    log = sweep_dir / "2" / "faults.log"  # the job's log file (Hydra's, named after the script)
    assert lines[3] == (
        f"  job #2 (lr=0.001) crashed: RuntimeError: a fault injected at step 1 (its traceback is in {log})"
    )
    assert len(lines) == 4 and err.count("must be positive") == 1
    # the crash's traceback is kept, in the file the line names, down to the line that raised
    traceback = log.read_text()
    assert "job #2 crashed:\nTraceback (most recent call last):" in traceback
    assert 'raise RuntimeError(f"a fault injected at step {fault_step}")' in traceback
    assert traceback.rstrip().endswith("RuntimeError: a fault injected at step 1")


def test_every_logger_of_logger_all_holds_the_run(sweep):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, sweep_dir, _ = sweep
    job = sweep_dir / "0"
    events = EventAccumulator(str(job / "tensorboard")).Reload()
    tb_val = [e.value for e in events.Scalars("val/loss")]
    wandb_val = [v for _, v in read_run(find_runs(job / "wandb")[0]).metric("val/loss")]
    assert tb_val == pytest.approx(wandb_val, rel=1e-6)
    assert "train/mfu" in events.Tags()["scalars"] and "samples/text_summary" in events.Tags()["tensors"]
    header = (job / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"val/loss", "train/grad_norm", "train/mfu", "parameters/total"} <= set(header)


def test_compare_script_gives_one_row_per_choice_with_both_seeds(sweep, tmp_path, capsys):
    root, sweep_dir, _ = sweep
    # scripts/compare.py's main(), in this process: a second interpreter would only add start-up time
    script = runpy.run_path(str(ROOT / "scripts" / "compare.py"))
    out = tmp_path / "comparison"
    assert script["main"]([str(sweep_dir), "--source", "wandb", "--out", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert lines[0].startswith(
        "| # | pos | activation | seeds | val/loss | Δ vs best (95% CI) | vs best (Holm) | val/ppl | tokens/s "
        "| MFU | parameters |"
    )
    conditions = {(c["pos"], c["activation"]) for c in JOBS.values()}
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1 : 1 + len(conditions)]]
    assert sorted((r[1], r[2]) for r in rows) == sorted(conditions) and [r[3] for r in rows] == ["2"] * 4

    # the figures are the mean and spread of the runs' own final validation losses, best first
    final = {}
    for job, choice in JOBS.items():
        loss = read_run(find_runs(sweep_dir / job)[0]).metric("val/loss")[-1][1]
        final.setdefault((choice["pos"], choice["activation"]), []).append(loss)
    by_mean = sorted(final, key=lambda c: statistics.fmean(final[c]))
    assert [(r[1], r[2]) for r in rows] == by_mean
    for row in rows:
        mean, std = (float(x) for x in row[4].split(" ± "))
        assert mean == pytest.approx(statistics.fmean(final[(row[1], row[2])]), abs=1e-4)
        assert std == pytest.approx(statistics.stdev(final[(row[1], row[2])]), abs=1e-4)

    png = out / "val_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "| learned | gelu |" in (out / "comparison.md").read_text()
    # CSV files and W&B files tell the same story
    from_csv = compare(sweep_dir, tmp_path / "from_csv", source="csv")
    assert [r.val_loss_mean for r in from_csv.rows] == pytest.approx(
        [statistics.fmean(final[c]) for c in by_mean], rel=1e-6
    )


def test_optuna_search_finishes_and_reports_its_best_parameters(tmp_path):
    import optuna

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    sweep_dir = tmp_path / "search"
    proc = run_train(
        [
            "-m",
            "hparams_search=optuna",
            *FAST,
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "trainer.limit_val_batches=1",
            "logger=csv",
            "hydra.sweeper.n_trials=3",
            "hydra.sweeper.sampler.n_startup_trials=2",
            f"hydra.sweeper.storage={storage}",
            f"paths.root_dir={tmp_path}",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
    )
    assert "Best parameters" in proc.stdout + proc.stderr
    result = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    best = result.best_params
    assert set(best) == {"optim.lr", "optim.warmup_steps"}
    assert 3e-4 <= best["optim.lr"] <= 2e-2 and 0 <= best["optim.warmup_steps"] <= 80
    # the study persisted in its SQLite file (needs SQLAlchemy < 2 with optuna 2.x): three finished trials,
    # each the final validation loss of one job
    study = optuna.load_study(study_name="lr_warmup", storage=storage)
    values = sorted(t.value for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE)
    assert len(values) == 3
    table = compare(sweep_dir)
    assert sorted(r.val_loss_mean for r in table.rows) == pytest.approx(values, rel=1e-5)
    assert result.best_value == pytest.approx(values[0], rel=1e-6)


@pytest.mark.parametrize(
    "choice,expected",
    [("logger=[wandb,csv]", {"wandb", "csv"}), ("logger=all", {"wandb", "csv", "tensorboard"})],
)
def test_several_loggers_at_once(make_cfg, choice, expected):
    cfg = make_cfg(choice)
    assert set(cfg.logger) == expected


@pytest.mark.parametrize(
    "experiment,key", [("activation_sweep", "activation"), ("depth_sweep", "model.n_layer")]
)
def test_experiment_presets_sweep_their_choice_over_seeds(experiment, key):
    from hydra import compose, initialize_config_dir

    GlobalHydra.instance().clear()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert set(params) == {key, "seed"} and params.seed == "0,1,2"
