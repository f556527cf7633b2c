"""Which run a resume continues, and stops of runs made of more than one process or part: resume=auto among
the runs under outputs/, a SIGTERM under DDP, a stop before the length study, a stop in a sweep. Apart from
tests/test_resume.py (whose tests share an uninterrupted reference run) so that the two files run side by
side on two workers."""

from __future__ import annotations

import json
import logging
import re
import shlex
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY, run_train
from test_resume import (
    ARGS,
    MAX_STEPS,
    assert_bit_identical,
    compose_cfg,
    csv_rows,
    run_dirs,
    start_and_stop_at,
    weights,
    with_overrides,
)

from gptlab.runs import Run
from gptlab.runs.layout import last_checkpoint
from gptlab.runs.resume import checkpoint_to_resume, choose_run_dir, restore_interrupted_saves
from gptlab.tasks.gpt import run
from gptlab.tracking.wandb_runs import find_runs, read_run


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def runs_under_outputs(tmp_path_factory, cache_dir):
    """Runs as `python train.py` leaves them under ./outputs: a single run, then a two-job sweep whose job 0
    has the same overrides, then a third run with them again that is killed before its first checkpoint."""
    root = tmp_path_factory.mktemp("auto")
    base = [*TINY, "tokenizer=char", "logger=none", "trainer.max_steps=2", f"paths.root_dir={cache_dir}"]
    run_train([*base, "pos=sinusoidal", "seed=1"], cwd=root)
    run_train(["-m", *base, "pos=sinusoidal", "seed=1,2"], cwd=root)
    killed = run_train(
        [*base, "pos=sinusoidal", "seed=1"],
        cwd=root,
        check=False,
        script=ROOT / "tests" / "faults.py",
        env={"GPTLAB_TEST_FAULT": "kill_at_step:1:seed=1"},
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    single, unsaved = run_dirs(root)
    (sweep,) = (root / "outputs" / "multirun").glob("*/*")
    return root / "outputs", base, single, sweep, unsaved


def test_resume_auto_picks_the_newest_run_with_the_same_overrides(runs_under_outputs):
    outputs, base, single, sweep, unsaved = runs_under_outputs
    default = str(outputs / "runs" / "new")
    overrides = [*base, "pos=sinusoidal", "seed=1"]
    assert Run(unsaved).resume_checkpoint() is None and Run(unsaved).choices()["seed"] == "1"
    # the sweep's job 0 is newer than the single run; the killed run has nothing to continue from
    assert choose_run_dir([*overrides, "resume=auto"], str(outputs), default) == str(sweep / "0")
    # no run with these overrides: a new run; no resume: always a new run
    assert choose_run_dir([*base, "seed=3", "resume=auto"], str(outputs), default) == default
    assert choose_run_dir(overrides, str(outputs), default) == default
    # an explicit checkpoint or run directory continues in its own run directory
    ckpt = last_checkpoint(single)
    assert choose_run_dir([f"resume={ckpt}"], str(outputs), default) == str(single)
    assert choose_run_dir([f"resume={single}"], str(outputs), default) == str(single)


def test_resume_auto_with_a_longer_max_steps_starts_a_new_run_and_names_the_run_it_nearly_matched(
    runs_under_outputs, caplog
):
    # The command of the runs above with a larger trainer.max_steps, meant to train them longer: resume=auto
    # matches overrides exactly, so it starts a new run, and says which run differs in that key alone and how
    # to continue it.
    outputs, base, single, sweep, unsaved = runs_under_outputs
    default = outputs / "runs" / "longer"
    longer = [*base, "pos=sinusoidal", "seed=1", "trainer.max_steps=5", "resume=auto"]
    assert choose_run_dir(longer, str(outputs), str(default)) == str(default)
    with caplog.at_level(logging.INFO, logger="gptlab.runs.resume"):
        assert checkpoint_to_resume("auto", default) is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == (
        f"resume=auto found no run started with these overrides, so this is a new run. The run {sweep / '0'} "
        "differs only in trainer.max_steps=2 there, 5 now. To continue that run with this command's settings "
        f"instead (to train it longer, say), stop this one (Ctrl-C) and give that run's directory: "
        f"resume={sweep / '0'}"
    )
    # runs that differ in more than two keys are not named: the plain note that a new run starts
    caplog.clear()
    other = outputs / "runs" / "other"
    far = [*base, "pos=rope", "seed=7", "model.n_layer=3", "resume=auto"]
    assert choose_run_dir(far, str(outputs), str(other)) == str(other)
    with caplog.at_level(logging.INFO, logger="gptlab.runs.resume"):
        assert checkpoint_to_resume("auto", other) is None
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no earlier run with these overrides" in r.getMessage() for r in caplog.records)


def test_resume_auto_finds_a_run_whose_sharded_checkpoint_a_kill_left_set_aside(tmp_path, cache_dir):
    # A kill between the two renames of a sharded save (strategy=fsdp, on one process here) leaves
    # checkpoints/.last.ckpt.old and no last.ckpt: the run is still the one to continue, and restoring puts
    # its checkpoint back.
    args = [
        *TINY,
        "tokenizer=char",
        "logger=none",
        "trainer.max_steps=4",
        "strategy=fsdp",
        "trainer.accelerator=cpu",
    ]
    args += ["callbacks.last_checkpoint.every_n_train_steps=1", f"paths.root_dir={cache_dir}"]
    killed = run_train(
        args,
        cwd=tmp_path,
        check=False,
        script=ROOT / "tests" / "faults.py",
        env={"GPTLAB_TEST_FAULT": "kill_mid_swap:2"},
        start_new_session=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    aside = run_dir / "checkpoints" / ".last.ckpt.old"
    assert (aside / ".metadata").is_file() and not (last_checkpoint(run_dir)).exists()
    outputs, default = tmp_path / "outputs", str(tmp_path / "outputs" / "runs" / "new")
    assert choose_run_dir([*args, "resume=auto"], str(outputs), default) == str(run_dir)
    assert restore_interrupted_saves(run_dir / "checkpoints") == [last_checkpoint(run_dir)]
    restored = last_checkpoint(run_dir)
    assert (restored / ".metadata").is_file() and Run(run_dir).resume_checkpoint() == restored


@pytest.mark.slow
def test_sigterm_under_ddp_stops_every_rank_and_saves(tmp_path, cache_dir):
    # Two CPU processes (DDP over gloo): the signal reaches rank 0, every rank stops at the same step.
    args = [
        *ARGS,
        "logger=none",
        f"paths.root_dir={cache_dir}",
        "trainer.devices=2",
        "trainer.accelerator=cpu",
    ]
    status, output = start_and_stop_at(args, tmp_path, 4, signal.SIGTERM)
    assert status == 0, output[-3000:]
    stopped = int(re.search(r"Stopped by SIGTERM at step (\d+)", output).group(1))
    assert stopped == 4
    # one line for the run, not one per process
    assert output.count("Received SIGTERM: saved") == 1 and output.count("Stopped by SIGTERM") == 1
    (run_dir,) = run_dirs(tmp_path)
    saved = torch.load(last_checkpoint(run_dir), map_location="cpu", weights_only=True)
    assert saved["global_step"] == stopped < MAX_STEPS
    # Resumed, the run ends bit-identical to the same two-process run never interrupted: the distributed
    # sampler's position is restored with the loader state.
    run_train([*args, "resume=auto"], cwd=tmp_path)
    ref_dir = tmp_path / "uninterrupted"
    ref_dir.mkdir()
    run_train(args, cwd=ref_dir)
    (ref_run,) = run_dirs(ref_dir)
    assert_bit_identical(weights(last_checkpoint(run_dir)), weights(last_checkpoint(ref_run)))


def test_a_finished_run_resumed_closes_as_it_did_and_says_what_to_do_next(tmp_path, cache_dir, capsys):
    run_dir = tmp_path / "runs" / "first"  # the runs beside it: those in tmp_path/runs
    common = [
        *TINY,
        "trainer.max_steps=2",
        "logger=csv",
        f"paths.root_dir={cache_dir}",
        f"paths.output_dir={run_dir}",
    ]
    capsys.readouterr()
    run(compose_cfg(*common))
    first = capsys.readouterr().out
    run(compose_cfg(*common, f"resume={run_dir}"))
    again = capsys.readouterr().out
    assert "The run already finished at step 2; nothing to do" in again

    def final_line(out: str) -> str:
        return next(line for line in out.splitlines() if line.startswith("Final validation loss"))

    # the same line, with the sentence on which validation tokens were scored (result.json keeps it)
    assert final_line(again) == final_line(first)
    assert re.search(r"It scored [\d,]+ of the [\d,]+ validation tokens", final_line(first)), first
    suggested = [f"Sample from it: python scripts/generate.py {run_dir}", f"resume={run_dir} and a larger"]
    for out in (first, again):
        assert all(s in out for s in suggested), out
    # the commands suggested run as they are printed (from the checkout, where train.py is)
    line = next(line for line in first.splitlines() if line.startswith("Sample from it:"))
    sample, compare = (part.split(": ")[-1] for part in line.split("; "))
    for command, extra in ((sample, ["max_new_tokens=4"]), (compare, [])):
        argv = [sys.executable, *shlex.split(command)[1:], *extra]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "runs" / "comparison.md").is_file()  # the runs beside it, this one among them


def test_a_run_ends_with_a_validation_at_its_last_step(tmp_path, cache_dir, capsys):
    # `python train.py trainer.max_steps=3` with validation every 4 steps: without the end-of-run validation,
    # no validation at all
    out = tmp_path / "run"
    overrides = [
        *TINY,
        "tokenizer=char",
        "trainer.max_steps=3",
        "logger=[csv,wandb]",
        f"paths.root_dir={cache_dir}",
    ]
    proc = run_train([*overrides, f"hydra.run.dir={out}"], cwd=tmp_path)
    result = json.loads((out / "result.json").read_text())
    val = result["metrics"]["val/loss"]
    assert result["global_step"] == 3 and result["finished"]
    assert f"Final validation loss {val:.4f} nats" in proc.stdout and "Trained 3 steps" in proc.stdout

    rows = [r for r in csv_rows(out / "csv" / "metrics.csv") if r.get("val/loss")]
    assert [int(r["step"]) for r in rows] == [3]  # the validation after the third optimizer step
    assert float(rows[-1]["val/loss"]) == pytest.approx(val, rel=1e-6)
    (wandb_file,) = find_runs(out / "wandb")
    wandb_run = read_run(wandb_file)
    assert wandb_run.metric("val/loss") == [(3, pytest.approx(val, rel=1e-6))]
    assert wandb_run.summary["val/loss"] == pytest.approx(val, rel=1e-6)
    best = torch.load(next((out / "checkpoints").glob("best-*.ckpt")), map_location="cpu", weights_only=True)
    assert best["global_step"] == 3  # the best checkpoint is the validated last state

    overrides[overrides.index("logger=[csv,wandb]")] = "logger=csv"
    # the task's return value carries the same number as the log (in-process, as a sweeper calls it)
    metrics = run(compose_cfg(*overrides, f"paths.output_dir={tmp_path / 'three'}"))
    rows = [r for r in csv_rows(tmp_path / "three" / "csv" / "metrics.csv") if r.get("val/loss")]
    assert [int(r["step"]) for r in rows] == [3] and float(rows[0]["val/loss"]) == pytest.approx(
        metrics["val/loss"]
    )
    # a last step that is a validation step validates once; with validation off there is none
    metrics = run(compose_cfg(*overrides, "trainer.max_steps=4", f"paths.output_dir={tmp_path / 'four'}"))
    steps = [int(r["step"]) for r in csv_rows(tmp_path / "four" / "csv" / "metrics.csv") if r.get("val/loss")]
    assert steps == [4]
    off = run(compose_cfg(*overrides, "trainer.limit_val_batches=0", f"paths.output_dir={tmp_path / 'off'}"))
    assert "val/loss" not in off and "No validation (it is off" in capsys.readouterr().out


@pytest.mark.slow
def test_a_stop_signal_skips_the_length_study_until_the_resumed_run_finishes(tmp_path, cache_dir):
    from gptlab.runs.layout import Run

    args = [
        *ARGS,
        "logger=csv",
        f"paths.root_dir={cache_dir}",
        "resume=auto",
        "pos=rope",
        "eval_length.enabled=true",
        "eval_length.factors=[1,2]",
        "eval_length.max_tokens=257",
        "eval_length.rope_scalings=[]",
        "eval_length.passkey.enabled=false",
    ]
    status, output = start_and_stop_at(args, tmp_path, 5, signal.SIGTERM)
    assert status == 0, output[-3000:]
    stopped = int(re.search(r"Stopped by SIGTERM at step (\d+)", output).group(1))
    assert stopped == 5
    assert (
        "Stopped by a signal: the length study (eval_length) is skipped; it runs when the resumed run finishes."
        in output
    )
    (run_dir,) = run_dirs(tmp_path)
    assert not (run_dir / "eval_length").exists()  # no study of the half-trained model
    result = Run(run_dir).result()
    assert result["stopped_by_signal"] is True and result["finished"] is False
    assert result["global_step"] == stopped and "length/" not in " ".join(result["metrics"])

    proc = run_train(args, cwd=tmp_path)
    assert "the length study (eval_length) is skipped" not in proc.stdout + proc.stderr
    assert (run_dir / "eval_length" / "length.json").is_file()
    result = Run(run_dir).result()
    assert result["stopped_by_signal"] is False and result["finished"] is True
    assert "length/loss@2x" in result["metrics"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, signal_name, status", [("ctrl_c", "Ctrl-C", 130), ("sigterm", "SIGTERM", 143)]
)
def test_a_stop_signal_in_a_sweep_stops_the_sweep_and_its_command_continues_it(
    tmp_path, cache_dir, fault, signal_name, status
):
    sweep = tmp_path / "sweep"
    args = with_overrides(
        [*ARGS, "logger=none", f"paths.root_dir={cache_dir}"],
        "trainer.max_steps=6",
        "callbacks.last_checkpoint.every_n_train_steps=50",
    )
    proc = run_train(
        ["-m", *args, "seed=0,1", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
        check=False,
        script=ROOT / "tests" / "faults.py",
        env={"GPTLAB_TEST_FAULT": f"{fault}:3"},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == status, output[-3000:]
    assert f"{signal_name} stopped the sweep in job #0 (" in output
    assert f"Sweep: 1 run in {sweep} (1 stopped)" in output
    # job 0 stopped at the step after the signal, with its checkpoint and result; job 1 never started
    result = Run(sweep / "0").result()
    assert result["stopped_by_signal"] is True and result["global_step"] == 4
    saved = torch.load(last_checkpoint(sweep / "0"), map_location="cpu", weights_only=True)
    assert saved["global_step"] == 4
    assert not (sweep / "1").exists()
    if fault == "ctrl_c":
        return
    # the printed command (here without the fault) finishes job 0 from its checkpoint and runs job 1
    command = output.split("others start): ", 1)[1].splitlines()[0]
    argv = shlex.split(command)
    assert argv[-1] == "resume=auto" and f"hydra.sweep.dir={sweep}" in argv
    run_train(argv[2:], cwd=tmp_path)
    for job in ("0", "1"):
        result = Run(sweep / job).result()
        assert result["finished"] is True and result["global_step"] == 6, (job, result)
    assert [p["status"] for p in Run(sweep / "0").result()["parts"]] == ["stopped", "finished"]
