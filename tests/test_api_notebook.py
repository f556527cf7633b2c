"""The Python API as a notebook uses it: several train() calls in one process, each leaving the process as it
found it and training as it would first in a fresh process; Ctrl-C (the kernel's interrupt: a real SIGINT to
this process) before and during training; train() from a thread; errors raised as exceptions; load_run and
compare over runs that did not finish."""

from __future__ import annotations

import csv
import json
import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import warnings
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, run_train, slurm_job
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

import gptlab
from gptlab.errors import CheckpointError, ConfigError, DataError
from gptlab.runs.identity import held_claim
from gptlab.tasks import gpt as gpt_task
from gptlab.training.callbacks import ValidateAtLastStep
from gptlab.training.checkpointing import StopOnSignal

SMALL = [*TINY, "tokenizer=char", "logger=csv"]
# Variables a library sets once for the rest of the process when it is first used (W&B's service address,
# torch's caches), not by a run for itself.
LIBRARY_ENVIRONMENT = {"WANDB_SERVICE", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK"}
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@pytest.fixture
def ctrl_c():
    """SIGINT handled as a notebook's kernel and a terminal's foreground process have it (KeyboardInterrupt), also
    where the suite runs in the background (SIGINT ignored); put back afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def flushing_denormals() -> bool:
    return (torch.tensor([1e-40]) * 1.0).item() == 0.0


def process_state() -> dict[str, object]:
    return {
        "handlers": {name: logging.getLogger(name).handlers[:] for name in ("", "hydra", "gptlab")},
        "warnings filters": list(warnings.filters),
        "environment": {k: v for k, v in os.environ.items() if k not in LIBRARY_ENVIRONMENT},
        "signal handlers": {s: signal.getsignal(s) for s in SIGNALS},
        "torch": (
            torch.get_num_threads(),
            torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled(),
            torch.get_float32_matmul_precision(),
            flushing_denormals(),
            torch.is_grad_enabled(),
        ),
        "cwd": os.getcwd(),
        "hydra": (GlobalHydra.instance().is_initialized(), HydraConfig.initialized()),
    }


def open_files_under(folder: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found


@pytest.fixture
def built_modules(monkeypatch) -> list[weakref.ref]:
    """A weak reference to the module (model, optimizer) of every language-model run trained from here on."""
    refs: list[weakref.ref] = []
    build = gpt_task.build

    def recording_build(*args, **kwargs):
        parts = build(*args, **kwargs)
        refs.append(weakref.ref(parts.module))
        return parts

    monkeypatch.setattr(gpt_task, "build", recording_build)
    return refs


def losses(run_dir: Path) -> dict[str, list[tuple[str, str]]]:
    """(step, value) of train/loss and val/loss in the run's metrics.csv, as written (every digit)."""
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {
        key: [(row["step"], row[key]) for row in rows if row.get(key)] for key in ("train/loss", "val/loss")
    }


def test_runs_in_one_process_leave_it_as_it_was_and_train_as_in_a_fresh_one(
    tmp_path, monkeypatch, built_modules, capfd
):
    """learned (logged to W&B offline), word2vec, then rope, one after the other: after each the process is as
    the caller had it (logging, warnings, environment, signal handlers, torch's settings, the caller's own
    random draws), no W&B run is open, no file of the runs is open and no model is held; rope, trained third,
    logs the losses of rope trained first in a fresh `python train.py` with as many threads, to the last digit
    (or one unit in it: fp32 sums in a process with another history may round otherwise)."""
    monkeypatch.chdir(tmp_path)
    common = [*SMALL, f"paths.root_dir={tmp_path}"]
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    generators = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    before = process_state()
    runs = {
        "learned": [*common, "pos=learned", "logger=wandb"],
        "word2vec": [
            "task=word2vec",
            "tokenizer=word",
            "logger=csv",
            f"paths.root_dir={tmp_path}",
            "word2vec.threads=1",
            "word2vec.max_steps=50",
            "word2vec.evaluate=false",
        ],
        "rope": [*common, "pos=rope"],
    }
    results = {}
    for name, overrides in runs.items():
        results[name] = gptlab.train(*overrides, run_dir=tmp_path / "runs" / name)
        assert results[name].finished, name
        assert process_state() == before, f"after {name}"
        import wandb

        assert wandb.run is None, f"{name} left its W&B run open"
        assert open_files_under(tmp_path) == [], f"{name} left files open"
        assert all(ref() is None for ref in built_modules), f"{name}'s model is still held"
    # the caller's next draws are those it would have made had no run happened in between
    draws = (random.random(), float(np.random.rand()), torch.rand(1).item())
    random.setstate(generators[0]), np.random.set_state(generators[1]), torch.set_rng_state(generators[2])
    assert draws == (random.random(), float(np.random.rand()), torch.rand(1).item())
    printed = capfd.readouterr().out
    for name, result in results.items():  # each run's log holds its own lines only, each printed once
        assert printed.count(f"Run directory: {result.run_dir}\n") == 1, name
        log = (result.run_dir / "train.log").read_text()
        others = [str(r.run_dir) for n, r in results.items() if n != name]
        assert str(result.run_dir) in log and not any(other in log for other in others), name

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    # with this process's torch threads: a product summed over 2 threads differs from 1's in the last digit
    threads = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    run_train([*runs["rope"], f"hydra.run.dir={fresh / 'rope'}"], cwd=fresh, env=threads)
    in_process, fresh_losses = losses(results["rope"].run_dir), losses(fresh / "rope")
    # to the last digit or one unit in it: the same steps and values, fp32 sums aside (a run that inherited
    # another's state, its seed, data order or settings, differs in the second or third digit)
    for key in ("train/loss", "val/loss"):
        assert [step for step, _ in in_process[key]] == [step for step, _ in fresh_losses[key]], key
        for (step, a), (_, b) in zip(in_process[key], fresh_losses[key]):
            assert float(a) == pytest.approx(float(b), rel=2.5e-7, abs=0), (key, step, a, b)
    assert losses(fresh / "rope")["val/loss"] and losses(fresh / "rope")["train/loss"]
    written = json.loads((fresh / "rope" / "result.json").read_text())["metrics"]
    assert results["rope"].metrics["val/loss"] == written["val/loss"]


def send_signal_after_step(monkeypatch, step: int, signum: int) -> None:
    """A real ``signum`` to this process after the optimizer step ``step``: SIGINT as a kernel's interrupt
    sends it, SIGUSR1 as SLURM sends it before it preempts a job."""
    original = ValidateAtLastStep.on_train_batch_end

    def on_train_batch_end(self, trainer, *rest):
        if trainer.global_step == step:
            os.kill(os.getpid(), signum)
        original(self, trainer, *rest)

    monkeypatch.setattr(ValidateAtLastStep, "on_train_batch_end", on_train_batch_end)


def send_ctrl_c_after_step(monkeypatch, step: int) -> None:
    send_signal_after_step(monkeypatch, step, signal.SIGINT)


def test_ctrl_c_in_training_returns_a_stopped_run_that_resumes_exactly(
    tmp_path, monkeypatch, ctrl_c, built_modules
):
    """Ctrl-C during training: train() returns (no exception), its result says stopped at the step it saved,
    the process is as it was; train() again with resume=auto ends where one run never stopped ends, and logs
    its losses to every digit."""
    common = [*SMALL, f"paths.root_dir={tmp_path}", "pos=rope"]
    before = process_state()
    with monkeypatch.context() as patched:
        send_ctrl_c_after_step(patched, 3)
        stopped = gptlab.train(*common, run_dir=tmp_path / "stopped")
    assert stopped.stopped and not stopped.finished and 3 <= stopped.step < 8
    assert stopped.raw["stop_signal"] == "Ctrl-C"
    assert (stopped.run_dir / "checkpoints" / "last.ckpt").is_file()
    assert process_state() == before
    assert held_claim(stopped.run_dir) is None and all(ref() is None for ref in built_modules)

    resumed = gptlab.train(*common, "resume=auto", run_dir=tmp_path / "stopped")
    whole = gptlab.train(*common, run_dir=tmp_path / "whole")
    assert resumed.finished and resumed.step == whole.step == 8
    assert resumed.metrics["val/loss"] == whole.metrics["val/loss"]
    # the same losses at every step the uninterrupted run logged; the stopped part also logged its last step
    for key, logged in losses(whole.run_dir).items():
        by_step = dict(losses(resumed.run_dir)[key])
        assert logged and all(by_step.get(step) == value for step, value in logged), key
        assert set(by_step) - dict(logged).keys() <= {str(stopped.step)}, key


def test_a_slurm_requeue_in_training_raises_run_requeued_naming_the_checkpoint(
    tmp_path, monkeypatch, built_modules
):
    """SIGUSR1 under SLURM (its warning before preemption or the time limit) in a job that trains through
    train(): the run saves its preemption checkpoint, requeues the job and stops. train() raises RunRequeued,
    which names the checkpoint, its step and the job, where a bare SystemExit(0) said nothing; a SystemExit
    of status 0 still, so that a script under sbatch ends as train.py does and no ``except Exception`` of the
    caller goes on to the next run while SLURM ends the job. The process is as it was."""
    env, calls = slurm_job(tmp_path)  # no SLURM controller here: scontrol is a stand-in
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "job_4242"
    before = process_state()
    with monkeypatch.context() as patched:
        send_signal_after_step(patched, 3, signal.SIGUSR1)
        with pytest.raises(gptlab.RunRequeued) as requeued:
            gptlab.train(*SMALL, f"paths.root_dir={tmp_path}", run_dir=run_dir)
    stop = requeued.value
    assert isinstance(stop, SystemExit) and stop.code == 0
    assert stop.requeued and stop.job_id == "4242" and calls.read_text().split() == ["requeue", "4242"]
    assert stop.run_dir == run_dir and stop.checkpoint.parent == run_dir and 3 <= stop.step < 8
    saved = torch.load(stop.checkpoint, map_location="cpu", weights_only=False)
    assert saved["global_step"] == stop.step
    said = str(stop)
    assert "SLURM job 4242" in said and str(stop.checkpoint) in said and f"step {stop.step}" in said
    again = pickle.loads(pickle.dumps(stop))  # as a process pool's worker returns it
    assert (str(again), again.checkpoint, again.code) == (said, stop.checkpoint, 0)
    assert process_state() == before
    assert held_claim(run_dir) is None and all(ref() is None for ref in built_modules)


def test_ctrl_c_before_training_raises_keyboard_interrupt_and_leaves_no_folder(tmp_path, monkeypatch, ctrl_c):
    """Ctrl-C while the corpus is tokenized: KeyboardInterrupt, as any interrupted cell raises; the run's new
    folder is gone (nothing was trained), its claim given up, the process as it was; the same call then
    trains."""
    from gptlab.data.tokenize_pool import TokenizeJob

    pieces = TokenizeJob.pieces

    def interrupted(self):
        os.kill(os.getpid(), signal.SIGINT)
        yield from pieces(self)

    common = [*SMALL, f"paths.root_dir={tmp_path}"]
    run_dir = tmp_path / "runs" / "interrupted"
    before = process_state()
    with monkeypatch.context() as patched:
        patched.setattr(TokenizeJob, "pieces", interrupted)
        with pytest.raises(KeyboardInterrupt):
            gptlab.train(*common, run_dir=run_dir)
    assert not (tmp_path / "runs").exists()
    assert held_claim(run_dir) is None and process_state() == before
    assert gptlab.train(*common, run_dir=run_dir).finished


def test_ctrl_c_as_lightning_starts_raises_keyboard_interrupt_not_system_exit(tmp_path, monkeypatch, ctrl_c):
    """Ctrl-C inside Lightning's fit before gptlab's handler is in place: Lightning ends the process
    (SystemExit) and leaves SIGINT ignored, which in a notebook would end the kernel's interrupts for good;
    train() raises KeyboardInterrupt and SIGINT interrupts again."""
    setup = StopOnSignal.setup

    def interrupted_setup(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        setup(self, *args, **kwargs)

    monkeypatch.setattr(StopOnSignal, "setup", interrupted_setup)
    with pytest.raises(KeyboardInterrupt):
        gptlab.train(*SMALL, f"paths.root_dir={tmp_path}", run_dir=tmp_path / "run")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert held_claim(tmp_path / "run") is None
    # the folder keeps what the run wrote before Lightning started (its config, its CSV's folder): said as such
    said = "the run ended without a result.json"
    with pytest.raises(DataError, match=f"run: {said}"):
        gptlab.TrainResult.read(tmp_path / "run")
    with pytest.raises(CheckpointError, match=f"no checkpoint yet .*: {said}"):
        gptlab.load_run(tmp_path / "run")


def compiled_entries(code) -> list:
    """The compiled code Dynamo holds for ``code``, one per cache entry."""
    return [entry.code for entry in torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)]


def test_a_compiled_run_leaves_no_compiled_code_of_its_own_and_keeps_the_callers(tmp_path, monkeypatch):
    """compile=true: the blocks' compiled code, shared by every model of the class in the process, goes when
    train() returns, so that the next run compiles as in a fresh process (kept, the entries of earlier runs of
    other widths reach torch's recompile limit, 8, and the fifth such run trains uncompiled: figures in
    docs/python-api.md). A function the caller compiled is kept, its compiled code the same objects."""
    from gptlab.model.gpt import Block
    from gptlab.parallel import transforms

    # Dynamo's own graph, run by the eager blocks: the compiles are counted without Inductor's minutes
    monkeypatch.setattr(transforms, "BLOCK_BACKEND", "eager")
    # the process as a notebook's first compiled run finds it: no block compiled yet (another test in this
    # worker may have compiled them; train() leaves code that held compiled entries before it as it was)
    from torch._C._dynamo import eval_frame

    eval_frame.reset_code(Block.forward.__code__)
    assert compiled_entries(Block.forward.__code__) == []
    mine = torch.compile(lambda x: torch.sin(x) + 1, backend="eager")
    mine(torch.ones(3))
    held = compiled_entries(mine.__wrapped__.__code__)
    assert len(held) == 1
    result = gptlab.train(*SMALL, "compile=true", f"paths.root_dir={tmp_path}", run_dir=tmp_path / "run")
    assert result.finished and result.raw["resolved"]["compile"] is True
    assert compiled_entries(Block.forward.__code__) == []
    assert compiled_entries(mine.__wrapped__.__code__) == held


def test_train_in_a_thread_runs_and_a_second_train_meanwhile_is_refused(tmp_path, monkeypatch):
    """From a thread (signal handlers cannot be set there) the run trains, without catching signals; while it
    trains, train() from another thread is refused by name, and nothing of that run is touched."""
    held, go = threading.Event(), threading.Event()
    original = ValidateAtLastStep.on_train_batch_end

    def hold_at_step_2(self, trainer, *rest):
        if trainer.global_step == 2 and threading.current_thread() is not threading.main_thread():
            held.set()
            go.wait(timeout=600)
        original(self, trainer, *rest)

    monkeypatch.setattr(ValidateAtLastStep, "on_train_batch_end", hold_at_step_2)
    common = [*SMALL, f"paths.root_dir={tmp_path}"]
    handlers = {s: signal.getsignal(s) for s in SIGNALS}
    outcome: dict[str, object] = {}

    def work() -> None:
        try:
            outcome["result"] = gptlab.train(*common, run_dir=tmp_path / "in-thread")
        except BaseException as e:  # reported by the test below
            outcome["error"] = e
        finally:
            held.set()

    thread = threading.Thread(target=work, name="trainer-thread")
    thread.start()
    assert held.wait(timeout=600)
    try:
        assert "error" not in outcome, outcome.get("error")
        with pytest.raises(ConfigError, match="already training in this process .*'trainer-thread'"):
            gptlab.train(*common, run_dir=tmp_path / "second")
        assert not (tmp_path / "second").exists()
    finally:
        go.set()
        thread.join(timeout=600)
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert isinstance(result, gptlab.TrainResult) and result.finished and result.step == 8
    assert {s: signal.getsignal(s) for s in SIGNALS} == handlers


def test_a_crash_in_training_raises_its_own_error_and_load_run_says_the_run_failed(tmp_path, monkeypatch):
    """A bug inside training propagates as the exception it is (not SystemExit, not ConfigError), once
    result.json records it; the claim is given up. load_run of that run says it failed before its first
    checkpoint; compare() beside a finished run says it skipped it and why."""
    original = ValidateAtLastStep.on_train_batch_end

    def crash(self, trainer, *rest):
        if trainer.global_step == 3:
            raise ZeroDivisionError("a bug at step 3")
        original(self, trainer, *rest)

    common = [*SMALL, f"paths.root_dir={tmp_path}"]
    with monkeypatch.context() as patched:
        patched.setattr(ValidateAtLastStep, "on_train_batch_end", crash)
        with pytest.raises(ZeroDivisionError, match="a bug at step 3"):
            gptlab.train(*common, run_dir=tmp_path / "runs" / "crashed")
    crashed = tmp_path / "runs" / "crashed"
    assert held_claim(crashed) is None
    result = gptlab.TrainResult.read(crashed)
    assert "ZeroDivisionError" in (result.failed or "") and result.step == 3 and not result.finished
    with pytest.raises(
        CheckpointError, match=r"no checkpoint yet .*: the run failed at step 3 \(ZeroDivision"
    ):
        gptlab.load_run(crashed)


@pytest.mark.slow
def test_load_run_and_compare_while_another_process_trains(tmp_path, caplog):
    """A run that another process is training (held at step 6, validated at step 4, a checkpoint written every
    2 steps): load_run loads its checkpoint and says the run is still training and by which process; compare()
    beside a finished run ranks the finished one alone and says the other is running. Once a SIGTERM has
    stopped it, both say so."""
    finished = gptlab.train(*SMALL, f"paths.root_dir={tmp_path}", run_dir=tmp_path / "runs" / "finished")
    running_dir = tmp_path / "runs" / "running"
    args = [
        *SMALL,
        f"paths.root_dir={tmp_path}",
        f"hydra.run.dir={running_dir}",
        "callbacks.last_checkpoint.every_n_train_steps=2",
        "callbacks.last_checkpoint.background=false",
    ]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "faults.py"), *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "GPTLAB_TEST_FAULT": "hold_at_step:6"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if line.startswith("held at step 6"):
                break
        else:
            raise AssertionError("".join(output))
        with caplog.at_level(logging.WARNING, logger="gptlab"):
            run = gptlab.load_run(running_dir)
        assert run.result is None and run.metrics == {}
        assert run.state is not None and f"still training (process {proc.pid} " in run.state
        assert run.state in caplog.text and run.generate("The", max_new_tokens=3).startswith("The")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gptlab"):
            rows = gptlab.compare(tmp_path / "runs")
        assert [len(row.runs) for row in rows] == [1]
        assert rows[0].val_loss_mean == pytest.approx(finished.metrics["val/loss"], rel=1e-6)
        assert [r.path for r in rows.unfinished] == [running_dir]
        assert f"{running_dir}: running (step " in caplog.text and "of 8): not ranked" in caplog.text
        proc.send_signal(signal.SIGTERM)
        output.extend(proc.stdout)
        assert proc.wait(timeout=600) == 0, "".join(output)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stopped = gptlab.load_run(running_dir)
    assert stopped.state == "the run was stopped by SIGTERM at step 6: resume=auto continues it"
    rows = gptlab.compare(tmp_path / "runs")
    assert [r.describe_status() for r in rows.unfinished] == ["stopped by a signal at step 6 of 8"]
