"""A killed run loses nothing: it continues where it stopped, in its own directory, bit for bit."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, run_train

from gptlab.lit.checkpointing import AtomicCheckpointIO
from gptlab.tracking.wandb_files import find_runs, read_run

MAX_STEPS = 12
# A tiny run that checkpoints every 2 steps and validates every 4; the loss must not reach its floor, so
# that a wrong batch order or optimizer state after a resume would show in the weights.
ARGS = [
    *TINY,
    f"trainer.max_steps={MAX_STEPS}",
    "optim.warmup_steps=2",
    "callbacks.last_checkpoint.every_n_train_steps=2",
]


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors that differ: {different}"


def run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in (root / "outputs").glob("runs/*/*/.hydra"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """The same run, never interrupted: its final weights."""
    cwd = tmp_path_factory.mktemp("reference")
    run_train([*ARGS, "logger=none", f"paths.root_dir={cache_dir}"], cwd=cwd)
    (run,) = run_dirs(cwd)
    return weights(run / "checkpoints" / "last.ckpt")


def start_and_stop_at(args: list[str], cwd: Path, step: int, sig: int) -> subprocess.Popen:
    """Start `python train.py <args>` and send ``sig`` once the progress bar has shown ``step`` steps done."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []

    def watch() -> None:
        buf = ""
        sent = False
        for chunk in iter(lambda: proc.stdout.read(1), ""):
            buf += chunk
            seen.append(chunk)
            if not sent and re.search(rf"Training:[^\r\n]*\| {step}/{MAX_STEPS} ", buf[-400:]):
                proc.send_signal(sig)
                sent = True

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    proc.wait(timeout=300)
    thread.join(timeout=10)
    proc.output = "".join(seen)  # type: ignore[attr-defined]
    return proc


@pytest.mark.slow
def test_sigkill_three_times_then_resume_ends_bit_identical(tmp_path, cache_dir, reference):
    args = [*ARGS, "logger=none", f"paths.root_dir={cache_dir}", "resume=auto"]
    rng = random.Random()
    steps = sorted(rng.sample(range(2, MAX_STEPS), 3))
    for step in steps:
        proc = start_and_stop_at(args, tmp_path, step, signal.SIGKILL)
        assert proc.returncode == -signal.SIGKILL, proc.output[-3000:]
        (run,) = run_dirs(tmp_path)  # every restart continued the same run directory
        saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        # at most every_n_train_steps=2 steps lost
        assert step - 2 <= saved["global_step"] <= step + 1, (steps, saved["global_step"])
    proc = run_train(args, cwd=tmp_path)
    assert "Resuming from" in proc.stdout + proc.stderr
    (run,) = run_dirs(tmp_path)
    final = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == MAX_STEPS
    assert_bit_identical(final["state_dict"], reference), f"killed at steps {steps}"


def test_sigterm_saves_and_exits_cleanly_then_resumes_the_same_wandb_run(tmp_path, cache_dir, reference):
    args = [*ARGS, "logger=wandb", f"paths.root_dir={cache_dir}", "resume=auto"]
    step = random.Random().randrange(3, MAX_STEPS - 2)
    proc = start_and_stop_at(args, tmp_path, step, signal.SIGTERM)
    assert proc.returncode == 0, proc.output[-3000:]
    stopped = int(re.search(r"Stopped by a signal at step (\d+)", proc.output).group(1))
    assert step <= stopped <= step + 1
    (run,) = run_dirs(tmp_path)
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == stopped  # nothing lost, not even the steps since the periodic save

    proc = run_train(args, cwd=tmp_path)
    assert f"Resuming from {run / 'checkpoints' / 'last.ckpt'} (step {stopped})" in proc.stdout + proc.stderr
    assert run_dirs(tmp_path) == [run]  # continued in its own directory, no new one
    assert_bit_identical(weights(run / "checkpoints" / "last.ckpt"), reference)

    first, second = (read_run(p) for p in find_runs(run / "wandb"))
    assert first.run_id == second.run_id == saved["wandb_run_id"]
    # the continued W&B run logs the steps after the stop, not from step 0 again
    assert min(s for s, _ in second.metric("train/loss")) >= stopped - 1


def test_sigusr1_saves_and_exits_cleanly(tmp_path, cache_dir):
    args = [*ARGS, "logger=none", f"paths.root_dir={cache_dir}"]
    proc = start_and_stop_at(args, tmp_path, 3, signal.SIGUSR1)
    assert proc.returncode == 0, proc.output[-3000:]
    stopped = int(re.search(r"Stopped by a signal at step (\d+)", proc.output).group(1))
    (run,) = run_dirs(tmp_path)
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == stopped < MAX_STEPS


def test_resume_from_an_explicit_checkpoint_continues_in_its_run_directory(tmp_path, cache_dir, reference):
    args = [*ARGS, "logger=none", f"paths.root_dir={cache_dir}"]
    proc = start_and_stop_at(args, tmp_path, 7, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    (run,) = run_dirs(tmp_path)
    kept = run / "checkpoints" / "kept.ckpt"
    os.replace(run / "checkpoints" / "last.ckpt", kept)
    step = torch.load(kept, map_location="cpu", weights_only=True)["global_step"]
    assert 0 < step < MAX_STEPS

    proc = run_train([*args, f"resume={kept}"], cwd=tmp_path)
    assert f"Resuming from {kept} (step {step})" in proc.stdout + proc.stderr
    assert run_dirs(tmp_path) == [run]  # continued in the checkpoint's run directory
    assert_bit_identical(weights(run / "checkpoints" / "last.ckpt"), reference)


def _write_big_checkpoint(path: str, started: str) -> None:
    Path(started).touch()
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(96 * 2**20)}}, path)


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    good = {"state_dict": {"w": torch.arange(10.0)}, "global_step": 4}
    AtomicCheckpointIO().save_checkpoint(good, ckpt)

    # A real process writing a 384 MB checkpoint over it, killed while the bytes are going to disk.
    started = tmp_path / "started"
    child = mp.get_context("fork").Process(target=_write_big_checkpoint, args=(str(ckpt), str(started)))
    child.start()
    deadline = time.monotonic() + 60
    tmp_files: list[Path] = []
    while time.monotonic() < deadline:
        tmp_files = [p for p in ckpt.parent.glob(".last.ckpt.tmp-*") if p.stat().st_size > 0]
        if tmp_files:
            break
        time.sleep(0.001)
    assert tmp_files, "the child never started writing"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL
    assert tmp_files[0].exists() and tmp_files[0].stat().st_size < 384 * 2**20  # killed mid-write

    loaded = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert loaded["global_step"] == 4 and torch.equal(loaded["state_dict"]["w"], good["state_dict"]["w"])
    # the next save of the same checkpoint clears the half-written file
    AtomicCheckpointIO().save_checkpoint({**good, "global_step": 6}, ckpt)
    assert not list(ckpt.parent.glob(".last.ckpt.tmp-*"))
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 6


def test_non_finite_loss_stops_with_the_step_and_keeps_the_last_finite_checkpoint(tmp_path, cache_dir):
    # A learning rate of 1e30 blows the weights up after one update: the second loss is NaN.
    proc = run_train(
        [
            *ARGS,
            "logger=none",
            f"paths.root_dir={cache_dir}",
            "optim.lr=1e30",
            "optim.warmup_steps=0",
            "callbacks.last_checkpoint.every_n_train_steps=1",
        ],
        cwd=tmp_path,
        check=False,
    )
    err = proc.stderr
    assert proc.returncode == 1
    assert re.search(r"gptlab: training failed: The training loss is (nan|inf) at step 2\b", err), err[-2000:]
    assert "Lower optim.lr" in err and "Traceback" not in err
    (run,) = run_dirs(tmp_path)
    saved = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == 1
    assert all(torch.isfinite(t).all() for t in saved["state_dict"].values())
