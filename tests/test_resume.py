"""A killed run loses nothing: it continues where it stopped, in its own directory, bit for bit."""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CONF, ROOT, TINY, run_train, signal_when_held, strict_json
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from gptlab.errors import CheckpointError, DiskFullError, NonFiniteLossError
from gptlab.model.config import GPTConfig
from gptlab.parallel.checkpoint_io import AtomicCheckpointIO
from gptlab.runs import Run, digests
from gptlab.runs.checkpoints import load_checkpoint, model_config_dict
from gptlab.runs.layout import last_checkpoint
from gptlab.runs.resume import checkpoint_to_resume, choose_run_dir, plan_resume
from gptlab.runs.trained import load_run
from gptlab.tasks.gpt import run
from gptlab.tracking.wandb_runs import find_runs, read_run

MAX_STEPS = 12
# A tiny run that checkpoints every 2 steps and validates every 4; the loss must not reach its floor, so
# that a wrong batch order or optimizer state after a resume would show in the weights.
ARGS = [
    *TINY,
    f"trainer.max_steps={MAX_STEPS}",
    "optim.warmup_steps=2",
    "callbacks.last_checkpoint.every_n_train_steps=2",
]


def with_overrides(args: list[str], *overrides: str) -> list[str]:
    """``args`` with each of ``overrides`` replacing the override of the same key (Hydra takes one each)."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [a for a in args if a.split("=", 1)[0] not in keys] + list(overrides)


def logged_steps(run_dir: Path, column: str = "train/loss") -> list[int]:
    """The steps of ``csv/metrics.csv``'s rows that hold ``column``, in file order."""
    return [int(r["step"]) for r in csv_rows(run_dir / "csv" / "metrics.csv") if r.get(column)]


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


def compose_cfg(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, cache_dir) -> tuple[Path, dict]:
    """The same run, never interrupted (in this process, logging to CSV): its run directory and the metrics
    the task returned. Shared: copy it before changing it."""
    out = tmp_path_factory.mktemp("reference")
    metrics = run(compose_cfg(*ARGS, "logger=csv", f"paths.root_dir={cache_dir}", f"paths.output_dir={out}"))
    return out, metrics


@pytest.fixture(scope="module")
def reference(reference_run):
    """The uninterrupted run's final weights."""
    return weights(last_checkpoint(reference_run[0]))


def start_and_stop_at(args: list[str], cwd: Path, step: int, sig: int) -> tuple[int, str]:
    """Run `python train.py <args>` (through tests/faults.py, which holds the run after ``step`` steps, on rank
    0, until a signal has been handled) and send ``sig`` once it is held there: the signal lands at that step
    however slowly this process reads the output. Returns (exit status, the whole output)."""
    ready = (f"held at step {step}",)
    return signal_when_held(
        [*args, "callbacks.progress_bar.every_n_steps=1"],
        cwd,
        f"hold_at_step:{step}",
        ready,
        sig,
        timeout=600,
    )


@pytest.mark.slow
def test_sigkill_three_times_then_resume_ends_bit_identical(tmp_path, cache_dir, reference):
    args = [*ARGS, "logger=csv", "trainer.log_every_n_steps=1", f"paths.root_dir={cache_dir}", "resume=auto"]
    rng = random.Random()
    # From step 5 on, a checkpoint is on disk whenever the kill lands: the save of step 4 waits for the
    # background write of step 2's (which a kill at step 3 may find in flight).
    steps = sorted(rng.sample(range(5, MAX_STEPS), 3))
    for step in steps:
        status, output = start_and_stop_at(args, tmp_path, step, signal.SIGKILL)
        assert status == -signal.SIGKILL, output[-3000:]
        (run_dir,) = run_dirs(tmp_path)  # every restart continued the same run directory
        saved = torch.load(last_checkpoint(run_dir), map_location="cpu", weights_only=True)
        # every_n_train_steps=2: at most 2 steps lost, and 2 more where the kill lands while the newest
        # checkpoint is still being written in the background (the save after it waits for it)
        assert step - 4 <= saved["global_step"] <= step, (steps, saved["global_step"])
    proc = run_train(args, cwd=tmp_path)
    assert "Resuming from" in proc.stdout + proc.stderr
    (run_dir,) = run_dirs(tmp_path)
    final = torch.load(last_checkpoint(run_dir), map_location="cpu", weights_only=True)
    assert final["global_step"] == MAX_STEPS
    assert_bit_identical(final["state_dict"], reference), f"killed at steps {steps}"
    # every step's row once: none lost with a killed part (rows are on disk with each checkpoint), none twice
    assert logged_steps(run_dir) == list(range(1, MAX_STEPS + 1)), f"killed at steps {steps}"


@pytest.mark.slow
def test_sigterm_through_the_cli_exits_0_then_resume_auto_continues_the_same_run(
    tmp_path, cache_dir, reference
):
    args = [*ARGS, "logger=wandb", f"paths.root_dir={cache_dir}", "resume=auto"]
    step = random.Random().randrange(3, MAX_STEPS - 2)
    status, output = start_and_stop_at(args, tmp_path, step, signal.SIGTERM)
    assert status == 0, output[-3000:]
    stopped = int(re.search(r"Stopped by SIGTERM at step (\d+)", output).group(1))
    assert stopped == step
    (run_dir,) = run_dirs(tmp_path)
    saved = torch.load(last_checkpoint(run_dir), map_location="cpu", weights_only=True)
    assert saved["global_step"] == stopped  # nothing lost, not even the steps since the periodic save

    proc = run_train(args, cwd=tmp_path)
    assert (
        f"Resuming from {run_dir / 'checkpoints' / 'last.ckpt'} (step {stopped})" in proc.stdout + proc.stderr
    )
    assert run_dirs(tmp_path) == [run_dir]  # continued in its own directory, no new one
    # its own checkpoints there, not a warning that the directory is not empty
    assert "exists and is not empty" not in proc.stdout + proc.stderr
    assert_bit_identical(weights(last_checkpoint(run_dir)), reference)

    first, second = (read_run(p) for p in find_runs(run_dir / "wandb"))
    assert first.run_id == second.run_id == saved["wandb_run_id"]
    # the continued W&B run logs the steps after the stop, not from step 0 again
    assert min(s for s, _ in second.metric("train/loss")) > stopped


def signal_after_first_checkpoint(ckpt: Path, signum: int) -> None:
    """Send ``signum`` to this process from a thread once ``ckpt`` exists (training is under way)."""

    def wait_and_send() -> None:
        # as long as a loaded machine needs to get there; never a signal before the checkpoint: the
        # test's assertions then say the run was not stopped
        deadline = time.monotonic() + 600
        while not ckpt.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if ckpt.exists():
            os.kill(os.getpid(), signum)

    threading.Thread(target=wait_and_send, daemon=True).start()


def test_sigterm_saves_the_current_step_and_resume_continues_bit_identical(tmp_path, cache_dir, reference):
    out = tmp_path / "run"
    ckpt = last_checkpoint(out)
    overrides = [
        *ARGS,
        "logger=[csv,wandb]",
        "trainer.log_every_n_steps=1",
        f"paths.root_dir={cache_dir}",
        f"paths.output_dir={out}",
    ]
    handler_before = signal.getsignal(signal.SIGTERM)
    signal_after_first_checkpoint(ckpt, signal.SIGTERM)
    run(compose_cfg(*overrides))
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    stopped = saved["global_step"]
    assert 2 <= stopped < MAX_STEPS  # stopped early, with the step it stopped at saved
    assert signal.getsignal(signal.SIGTERM) == handler_before  # the handlers are gone after the run

    run(compose_cfg(*overrides, "resume=auto"))
    assert_bit_identical(weights(ckpt), reference)
    assert logged_steps(out) == list(range(1, MAX_STEPS + 1))  # each step once
    first, second = (read_run(p) for p in find_runs(out / "wandb"))
    assert first.run_id == second.run_id == saved["wandb_run_id"]
    assert min(s for s, _ in second.metric("train/loss")) == stopped + 1


def test_sigusr1_saves_the_current_step_and_stops_cleanly(tmp_path, cache_dir):
    out = tmp_path / "run"
    ckpt = last_checkpoint(out)
    signal_after_first_checkpoint(ckpt, signal.SIGUSR1)
    metrics = run(compose_cfg(*ARGS, "logger=none", f"paths.root_dir={cache_dir}", f"paths.output_dir={out}"))
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert 2 <= saved["global_step"] < MAX_STEPS  # stopped early, and the step it stopped at is saved
    assert metrics["wall_seconds"] > 0
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the handler is gone after the run


@pytest.mark.slow
def test_resume_from_an_explicit_checkpoint_continues_in_its_run_directory(tmp_path, cache_dir, reference):
    args = [*ARGS, "logger=none", f"paths.root_dir={cache_dir}"]
    status, output = start_and_stop_at(args, tmp_path, 7, signal.SIGKILL)
    assert status == -signal.SIGKILL, output[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    kept = run_dir / "checkpoints" / "kept.ckpt"
    os.replace(last_checkpoint(run_dir), kept)
    step = torch.load(kept, map_location="cpu", weights_only=True)["global_step"]
    assert 0 < step < MAX_STEPS

    proc = run_train([*args, f"resume={kept}"], cwd=tmp_path)
    assert f"Resuming from {kept} (step {step})" in proc.stdout + proc.stderr
    assert run_dirs(tmp_path) == [run_dir]  # continued in the checkpoint's run directory
    assert_bit_identical(weights(last_checkpoint(run_dir)), reference)


# A real process writing a 192 MB checkpoint that stops once a quarter of its bytes are in the file, says so,
# and waits there to be killed: the kill lands mid-write however slowly the test reads the line.
WRITER = """
import sys, threading, torch
from gptlab.parallel.checkpoint_io import AtomicCheckpointIO

class StopsMidWrite:
    def __init__(self, file):
        self.file, self.written = file, 0

    def write(self, data):
        view = memoryview(data).cast("B")
        for start in range(0, len(view), 2**20):  # the tensor's bytes come as one call: written by the MiB
            self.written += self.file.write(view[start : start + 2**20])
            if self.written >= 48 * 2**20:
                self.file.flush()
                print("writing", flush=True)
                threading.Event().wait()
        return len(view)

    def flush(self):
        self.file.flush()

save = torch.save
torch.save = lambda obj, f, *args, **kwargs: save(obj, StopsMidWrite(f), *args, **kwargs)
AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(48 * 2**20)}}, sys.argv[1])
"""


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_checkpoint(tmp_path):
    ckpt = last_checkpoint(tmp_path)
    good = {"state_dict": {"w": torch.arange(10.0)}, "global_step": 4}
    AtomicCheckpointIO().save_checkpoint(good, ckpt)

    # A real process writing a 192 MB checkpoint over it, killed while the bytes are going to disk.
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(ckpt)], stdout=subprocess.PIPE, text=True)
    watchdog = threading.Timer(600, child.kill)  # a child that never gets there ends the read below
    watchdog.start()
    try:
        # its start (importing torch, Lightning) took over 40 s on a loaded machine: no deadline but the watchdog's
        assert child.stdout.readline() == "writing\n", "the child ended before it was killed mid-write"
    finally:
        child.kill()
        watchdog.cancel()
    assert child.wait(timeout=120) == -signal.SIGKILL
    (tmp_file,) = ckpt.parent.glob(".last.ckpt.tmp-*")
    assert 48 * 2**20 <= tmp_file.stat().st_size < 192 * 2**20  # killed mid-write

    loaded = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert loaded["global_step"] == 4 and torch.equal(loaded["state_dict"]["w"], good["state_dict"]["w"])
    # the next save of the same checkpoint clears the half-written file
    AtomicCheckpointIO().save_checkpoint({**good, "global_step": 6}, ckpt)
    assert not list(ckpt.parent.glob(".last.ckpt.tmp-*"))
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 6


def test_a_background_save_writes_the_state_of_its_step_while_the_tensors_change(tmp_path):
    ckpt = last_checkpoint(tmp_path)
    embedding = torch.randn(1000, 64)
    weights_at_save = embedding.clone()
    state = {
        "state_dict": {"wte": embedding, "lm_head": embedding, "ln": torch.ones(64)},  # tied, as gptlab's
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(1000, 64), "step": torch.tensor(3.0)}}}],
        "global_step": 3,
    }
    writer = AtomicCheckpointIO()
    with writer.in_background():
        writer.save_checkpoint(state, ckpt)
    write = writer.pending_write
    assert write is not None
    embedding.add_(1.0)  # the next optimizer steps, while the thread writes
    state["optimizer_states"][0]["state"][0]["exp_avg"].fill_(7.0)
    writer.wait()
    assert write.done() and digests.check(ckpt).verified
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert torch.equal(saved["state_dict"]["wte"], weights_at_save)  # the step's state, not the later one
    assert saved["state_dict"]["lm_head"].untyped_storage().data_ptr() == (
        saved["state_dict"]["wte"].untyped_storage().data_ptr()
    )  # still one tensor on disk, as a foreground save writes it
    assert not saved["optimizer_states"][0]["state"][0]["exp_avg"].any()
    foreground = tmp_path / "foreground.ckpt"
    AtomicCheckpointIO().save_checkpoint({**state, "state_dict": {"wte": weights_at_save}}, foreground)
    assert abs(ckpt.stat().st_size - foreground.stat().st_size) < 200_000  # the shared storage written once

    # The next save reuses the host copy's buffers: nothing allocated per save once training runs.
    buffers = {id(b) for b in writer._snapshot._buffers.values()}
    with writer.in_background():
        writer.save_checkpoint({**state, "global_step": 4}, ckpt)
    assert {id(b) for b in writer._snapshot._buffers.values()} == buffers
    writer.teardown()  # waits for the write
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 4
    assert torch.equal(torch.load(ckpt, weights_only=True)["state_dict"]["wte"], embedding)


def test_what_follows_a_background_write_waits_for_it_and_is_dropped_if_it_fails(tmp_path):
    """The removal of the best checkpoint a new one displaces, and the scores naming it, run after the new one
    is on disk, and not at all where its write failed: then the old best and its score stay as they were."""
    writer = AtomicCheckpointIO()
    state = {"state_dict": {"w": torch.ones(2**20)}, "global_step": 4}
    new_best = tmp_path / "best-step4.ckpt"
    seen: list[bool] = []
    with writer.in_background():
        writer.save_checkpoint(state, new_best)
    writer.after_write(lambda: seen.append(new_best.is_file() and digests.check(new_best).verified))
    writer.wait()
    assert seen == [True]

    blocked = tmp_path / "a-file"  # a folder that is a file: the write fails for real (root or not)
    blocked.write_text("")
    with writer.in_background():
        writer.save_checkpoint(state, blocked / "best-step8.ckpt")
    writer.after_write(lambda: new_best.unlink())
    with pytest.raises(OSError):
        writer.wait()
    assert new_best.is_file()  # not removed: the write it waited for failed
    writer.wait()  # the error was raised once
    writer.after_write(lambda: seen.append(True))  # nothing in flight: at once
    assert seen == [True, True]
    writer.teardown()


def test_without_room_for_the_host_copy_checkpoints_are_written_in_the_foreground(
    tmp_path, monkeypatch, caplog
):
    # The host's free memory is the one thing faked: exhausting this machine's RAM for real is not a test.
    import gptlab.parallel.hardware as hardware

    monkeypatch.setattr(hardware, "available_host_memory", lambda: 1e6)  # 1 MB, for a 4 MB checkpoint
    ckpt = last_checkpoint(tmp_path)
    writer = AtomicCheckpointIO()
    for step in (2, 4):
        with caplog.at_level("WARNING", logger="gptlab.parallel.checkpoint_io"):
            with writer.in_background():
                writer.save_checkpoint({"state_dict": {"w": torch.zeros(2**20)}, "global_step": step}, ckpt)
        assert writer.pending_write is None  # written before the save returned
        assert torch.load(ckpt, weights_only=True)["global_step"] == step and digests.check(ckpt).verified
    assert caplog.text.count("written in the foreground from now on") == 1
    assert "needs 4 MB more, and 1 MB are available" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning succeeds where CUDA is: tests/test_gpu.py")
def test_where_pinning_fails_the_host_copy_is_pageable_equal_and_said_once(tmp_path, caplog):
    """Pinned buffers asked for on a machine without CUDA (torch has no pinned allocator here): the copy falls
    back to pageable buffers, with the same bytes and the tie kept, and says so once, not at each save; the
    default asks for pinning only for CUDA tensors, so a CPU run never sees the warning."""
    from gptlab.parallel.checkpoint_io import HostSnapshot

    embedding = torch.randn(300, 16)
    state = {"state_dict": {"wte": embedding, "lm_head": embedding, "ln": torch.ones(16)}, "global_step": 2}
    snapshot = HostSnapshot(pin=True)
    with caplog.at_level("WARNING", logger="gptlab.parallel.checkpoint_io"):
        for step in (2, 3):
            at_save = embedding.clone()
            copy = snapshot.take({**state, "global_step": step})
            embedding.add_(1.0)  # the next step: the copy keeps the save's values
            assert torch.equal(copy["state_dict"]["wte"], at_save) and copy["global_step"] == step
            assert copy["state_dict"]["wte"].untyped_storage().data_ptr() == (
                copy["state_dict"]["lm_head"].untyped_storage().data_ptr()
            )
            assert snapshot.pinned_bytes() == 0 and not copy["state_dict"]["ln"].is_pinned()
    assert caplog.text.count("Checkpoint copies go to pageable host memory from now on: pinning") == 1
    assert "Background saves still work" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="gptlab.parallel.checkpoint_io"):
        default = HostSnapshot()
        assert torch.equal(default.take(state)["state_dict"]["wte"], embedding)
    assert caplog.text == "" and default.pinned_bytes() == 0


def test_a_host_copy_whose_pinned_buffers_would_not_fit_takes_pageable_ones(monkeypatch, caplog):
    """torch's pinned allocator rounds each block up to a power of two: the guard counts a 3 MiB storage's pinned
    buffer as 4 MiB. Where that is more than half the memory available and 3 MiB is not, the copy takes a
    pageable buffer (said once) rather than being refused or pinning past the guard."""
    import gptlab.parallel.hardware as hardware
    from gptlab.parallel.checkpoint_io import HostSnapshot

    # The host's free memory is the one thing faked, as in the test above.
    monkeypatch.setattr(hardware, "available_host_memory", lambda: 7e6)  # half: 3.5 MB
    weights = torch.randn(3 * 2**20 // 4)  # 3.1 MB; a pinned buffer of it: 4.2 MB
    snapshot = HostSnapshot(pin=True)
    with caplog.at_level("WARNING", logger="gptlab.parallel.checkpoint_io"):
        for step in (1, 2):
            copy = snapshot.take({"state_dict": {"w": weights}, "global_step": step})
            assert torch.equal(copy["state_dict"]["w"], weights) and snapshot.pinned_bytes() == 0
    assert caplog.text.count("new host buffers are pageable: pinned ones would take 4 MB") == 1
    assert "pinning" not in caplog.text  # never tried: not a failure to pin
    with pytest.raises(MemoryError, match="needs 4 MB more, and 7 MB are available"):
        snapshot.take({"w": weights, "v": torch.zeros(2**20)})  # 4.2 MB more even as pageable: refused


def test_non_finite_loss_stops_with_the_step_and_keeps_the_last_finite_checkpoint(tmp_path, cache_dir):
    # A learning rate of 1e30 blows the weights up in one update: the second loss is NaN.
    out = tmp_path / "run"
    cfg = compose_cfg(
        *ARGS,
        "logger=none",
        f"paths.root_dir={cache_dir}",
        f"paths.output_dir={out}",
        "optim.lr=1e30",
        "optim.warmup_steps=0",
        "callbacks.last_checkpoint.every_n_train_steps=1",
    )
    with pytest.raises(
        NonFiniteLossError, match=r"The training loss is (nan|inf) at step 2\b.*Lower optim.lr"
    ):
        run(cfg)
    saved = torch.load(last_checkpoint(out), map_location="cpu", weights_only=True)
    assert saved["global_step"] == 1
    assert all(torch.isfinite(t).all() for t in saved["state_dict"].values())
    # its result (the failure, the figures logged before it) is strict JSON
    result = strict_json(out / "result.json")
    assert "NonFiniteLossError" in result["failed"] and math.isfinite(result["metrics"]["train/loss"])


def disk_bytes(folder: Path) -> int:
    """The bytes ``folder``'s files take on disk, a file with several names counted once (as ``du`` does)."""
    inodes = {(p.stat().st_dev, p.stat().st_ino): p.stat().st_blocks * 512 for p in folder.iterdir()}
    return sum(inodes.values())


def test_a_best_checkpoint_at_the_step_of_last_is_one_file_on_disk(tmp_path, cache_dir):
    # A 5-step run validates after steps 4 and 5: its best is step 5, the step last.ckpt holds at the end.
    out = tmp_path / "five"
    common = [
        *TINY,
        "logger=csv",
        "callbacks.sample_generation.max_new_tokens=0",
        f"paths.root_dir={cache_dir}",
    ]
    run(compose_cfg(*common, "trainer.max_steps=5", f"paths.output_dir={out}"))
    last = last_checkpoint(out)
    (best,) = (out / "checkpoints").glob("best-*.ckpt")
    assert best.name.startswith("best-step000005-")
    assert disk_bytes(out / "checkpoints") < 1.05 * last.stat().st_size  # one checkpoint's bytes, not two
    assert best.samefile(last)
    for path in (best, last):  # each name's digest holds, as sha256sum -c in that folder would check
        verdict = digests.check(path)
        assert verdict.verified and verdict.step == 5, (path, verdict.problems)
    assert load_run(out, which="best").checkpoint == best

    # last.ckpt rewritten after every step: a best linked to it at its step keeps its own bytes and step.
    out = tmp_path / "six"
    run(
        compose_cfg(
            *common,
            "trainer.max_steps=6",
            "callbacks.last_checkpoint.every_n_train_steps=1",
            "callbacks.model_checkpoint.save_top_k=-1",  # keep the best of step 4 beside the one of step 6
            f"paths.output_dir={out}",
        )
    )
    checkpoints = out / "checkpoints"
    last = checkpoints / "last.ckpt"
    four, six = (next(checkpoints.glob(f"best-step00000{n}-*.ckpt")) for n in (4, 6))
    assert six.samefile(last) and not four.samefile(last)
    assert load_checkpoint(four)["global_step"] == 4 and load_checkpoint(last)["global_step"] == 6
    assert digests.check(four).verified and digests.check(four).step == 4
    assert disk_bytes(checkpoints) < 2.1 * last.stat().st_size  # three names, two files
    assert not list(checkpoints.glob(".*tmp*"))


def test_resuming_a_finished_run_does_nothing_and_rewrites_nothing(
    tmp_path, cache_dir, reference_run, capsys
):
    finished, first = reference_run
    # a copy of the finished run: resumed here, it must not change
    shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
    common = [*ARGS, "logger=csv", f"paths.root_dir={cache_dir}", f"paths.output_dir={tmp_path}"]
    ckpt, result = last_checkpoint(tmp_path), tmp_path / "result.json"
    saved, metrics_csv, recorded = (
        ckpt.read_bytes(),
        (tmp_path / "csv" / "metrics.csv").read_text(),
        result.read_bytes(),
    )
    capsys.readouterr()
    again = run(compose_cfg(*common, f"resume={tmp_path}"))
    out = capsys.readouterr().out
    assert f"The run already finished at step {MAX_STEPS}; nothing to do" in out
    assert f"Final validation loss {first['val/loss']:.4f}" in out and "Trained" not in out
    # nothing trained, saved, logged or recorded again: its wall time and metrics stay the first run's
    assert result.read_bytes() == recorded
    assert ckpt.read_bytes() == saved
    assert (tmp_path / "csv" / "metrics.csv").read_text() == metrics_csv
    assert again["val/loss"] == first["val/loss"] and again["wall_seconds"] == first["wall_seconds"]

    # A run killed after its last checkpoint and before its result.json: resuming validates and records it.
    result.unlink()
    again = run(compose_cfg(*common, f"resume={tmp_path}"))
    assert f"Nothing left to train at step {MAX_STEPS}: validated the checkpoint" in capsys.readouterr().out
    assert again["val/loss"] == pytest.approx(first["val/loss"], abs=1e-6)
    assert Run(tmp_path).result()["finished"] is True and ckpt.read_bytes() == saved


def csv_rows(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_checkpoint_holding_python_objects_is_refused_by_name(tmp_path, cache_dir, reference_run):
    """Checkpoints of earlier versions hold the same tensors and plain values and resume (the tests above use
    the format unchanged); one holding other Python objects, such as numpy's RNG state object, is refused
    before training, with the file named."""
    import numpy as np

    common = [*ARGS, f"trainer.max_steps={MAX_STEPS + 2}", "logger=none", f"paths.root_dir={cache_dir}"]
    checkpoint = torch.load(last_checkpoint(reference_run[0]), map_location="cpu", weights_only=True)
    old = tmp_path / "old.ckpt"
    torch.save({**checkpoint, "numpy_rng": np.random.get_state()}, old)
    with pytest.raises(CheckpointError, match=rf"Checkpoint {old} cannot be read .*beyond tensors"):
        run(compose_cfg(*common, f"paths.output_dir={tmp_path / 'new'}", f"resume={old}"))


def copy_of_run(reference_run, tmp_path: Path) -> tuple[Path, Path, Path]:
    """A copy of the finished reference run: its directory, its last.ckpt and its best checkpoint."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run[0], run_dir)
    checkpoints = run_dir / "checkpoints"
    (best,) = checkpoints.glob("best-*.ckpt")
    return run_dir, checkpoints / "last.ckpt", best


def test_a_checkpoint_changed_after_it_was_written_is_refused_naming_the_intact_one_to_resume_from(
    tmp_path, cache_dir, reference_run
):
    run_dir, last, best = copy_of_run(reference_run, tmp_path)
    assert digests.check(last).verified and digests.check(best).verified  # each save wrote its digest
    # 64 bytes in the middle of last.ckpt (inside the weights) changed, as a bad disk or a stray write would:
    # the file still loads, and resumed without a word before digests.
    middle = last.stat().st_size // 2
    with open(last, "r+b") as f:
        f.seek(middle)
        original = f.read(64)
        f.seek(middle)
        f.write(bytes(b ^ 0xFF for b in original))
    damaged = last.read_bytes()
    common = [
        *ARGS,
        f"trainer.max_steps={MAX_STEPS + 2}",
        "logger=none",
        f"paths.root_dir={cache_dir}",
        f"paths.output_dir={run_dir}",
    ]
    with pytest.raises(CheckpointError) as refused:
        run(compose_cfg(*common, "resume=auto"))
    message = str(refused.value)
    best_step = digests.read_digest(best).step
    assert f"Checkpoint {last} is damaged: its bytes differ from those written at step {MAX_STEPS}" in message
    assert f"last.ckpt has the size written ({len(damaged):,} bytes) but SHA-256" in message
    assert (
        f"Intact checkpoints beside it (each just verified against its digest): {best} (step {best_step})."
        in message
    )
    assert message.endswith(f"the same command with resume=<its path>, e.g. resume={best}.")
    assert last.read_bytes() == damaged  # refused before anything trained or saved

    # The command the message gives continues from the intact checkpoint, and the new last.ckpt has its digest.
    run(compose_cfg(*common, f"resume={best}"))
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == MAX_STEPS + 2
    assert digests.check(last).verified and digests.check(last).step == MAX_STEPS + 2


def test_a_truncated_last_checkpoint_is_refused_naming_the_intact_ones(tmp_path, reference_run):
    run_dir, last, best = copy_of_run(reference_run, tmp_path)
    written = last.stat().st_size
    os.truncate(last, written // 3)
    model = GPTConfig.from_dict(model_config_dict(load_checkpoint(best, weights=False)))
    intact = f"Intact checkpoints beside it (each just verified against its digest): {best} (step "
    with pytest.raises(CheckpointError) as refused:
        plan_resume(checkpoint_to_resume("auto", run_dir), model)
    message = str(refused.value)
    assert f"last.ckpt is {written // 3:,} bytes instead of the {written:,} written (truncated)" in message
    assert intact in message and message.endswith(f"resume={best}.")
    # The scripts that read a trained run (eval_length, generate, evaluate) refuse it the same way.
    with pytest.raises(
        CheckpointError, match=rf"{re.escape(intact)}.*in its place, e.g. {re.escape(str(best))}\.$"
    ):
        load_run(run_dir)

    # A run of a gptlab that wrote no digests: torch cannot read the file, and the message still names the
    # intact checkpoint beside it.
    digests.digest_path(last).unlink()
    with pytest.raises(CheckpointError) as refused:
        plan_resume(checkpoint_to_resume("auto", run_dir), model)
    message = str(refused.value)
    assert f"Checkpoint {last} cannot be read" in message and "it is truncated" in message
    assert intact in message and message.endswith(f"resume={best}.")


def test_a_sharded_checkpoint_is_verified_file_by_file(tmp_path):
    """A distributed checkpoint directory (real shards, written by torch.distributed.checkpoint in this
    process) gets one digest line per file; a changed or missing shard is refused by name."""
    import torch.distributed.checkpoint as dcp
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from gptlab.parallel.checkpoint_io import save_directory_atomically

    target = last_checkpoint(tmp_path)
    state = {"state_dict": {"model.w": torch.arange(4096.0)}}
    save_directory_atomically(
        SingleDeviceStrategy(), target, lambda staging: dcp.save(state, checkpoint_id=staging), step=6
    )
    manifest = digests.read_digest(target)
    files = sorted(p.relative_to(target.parent).as_posix() for p in target.iterdir())
    assert manifest.step == 6 and [f.name for f in manifest.files] == files
    assert "last.ckpt/__0_0.distcp" in files
    if shutil.which("sha256sum"):  # the digest file is sha256sum's own format
        checked = subprocess.run(
            ["sha256sum", "-c", "--strict", "last.ckpt.sha256"],
            cwd=target.parent,
            capture_output=True,
            text=True,
        )
        assert checked.returncode == 0 and checked.stdout.count(": OK") == len(files), checked.stdout
    assert torch.equal(load_checkpoint(target)["state_dict"]["model.w"], state["state_dict"]["model.w"])

    shard = target / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"last.ckpt/__0_0.distcp has the size written .* but SHA-256"):
        load_checkpoint(target)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"last.ckpt/__0_0.distcp is missing"):
        load_checkpoint(target, weights=False)

    # A checkpoint removed (a best checkpoint past save_top_k) takes its digest with it.
    AtomicCheckpointIO().remove_checkpoint(target)
    assert not target.exists() and not digests.digest_path(target).exists()


@pytest.mark.slow
def test_ctrl_c_saves_the_current_step_and_resume_ends_as_if_never_stopped(
    tmp_path, cache_dir, reference_run
):
    # Periodic checkpoints every 50 steps: the step Ctrl-C stops at is saved by the stop itself.
    args = with_overrides(
        [*ARGS, "logger=csv", f"paths.root_dir={cache_dir}", "resume=auto"],
        "callbacks.last_checkpoint.every_n_train_steps=50",
        "trainer.log_every_n_steps=1",
    )
    status, output = start_and_stop_at(args, tmp_path, 5, signal.SIGINT)
    assert status == 0, output[-3000:]
    assert "Ctrl-C: stopping at the end of this step, with a checkpoint saved for it" in output
    stopped = int(re.search(r"Stopped by Ctrl-C at step (\d+): \S+ holds it; resume with", output).group(1))
    assert stopped == 5
    assert "resume with the same command and resume=auto" in output
    (run_dir,) = run_dirs(tmp_path)
    saved = torch.load(last_checkpoint(run_dir), map_location="cpu", weights_only=True)
    assert saved["global_step"] == stopped  # nothing lost
    result = Run(run_dir).result()
    assert result["stopped_by_signal"] is True and result["finished"] is False
    assert result["global_step"] == stopped and result["stop_signal"] == "Ctrl-C"
    assert result["stopped_during"] == "training" and "eval_length_missing" not in result
    assert "train/loss" in result["metrics"] and "failed" not in result

    proc = run_train(args, cwd=tmp_path)
    assert (
        f"Trained {MAX_STEPS} steps; this part, resumed at step {stopped}, trained {MAX_STEPS - stopped} in"
        in (proc.stdout)
    )
    assert run_dirs(tmp_path) == [run_dir]
    assert_bit_identical(
        weights(last_checkpoint(run_dir)),
        weights(last_checkpoint(reference_run[0])),
    )
    assert logged_steps(run_dir) == list(range(1, MAX_STEPS + 1))  # each step once
    result = Run(run_dir).result()
    assert result["finished"] is True and result["stopped_by_signal"] is False
    assert result["metrics"]["val/loss"] == pytest.approx(reference_run[1]["val/loss"], abs=1e-6)
    # the run's wall time is the sum of its two parts', each part recorded
    parts = result["parts"]
    assert [(p["from_step"], p["to_step"], p["status"]) for p in parts] == [
        (0, stopped, "stopped"),
        (stopped, MAX_STEPS, "finished"),
    ]
    assert result["metrics"]["wall_seconds"] == pytest.approx(sum(p["wall_seconds"] for p in parts))


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_save_quits_and_leaves_the_previous_checkpoint(
    tmp_path, cache_dir, reference
):
    # The first Ctrl-C after step 5 asks for a save at step 6; the second lands inside that save, after the
    # bytes are written and before the rename. Periodic checkpoints every 4 steps: last.ckpt holds step 4.
    args = with_overrides(
        [*ARGS, "logger=[csv,tensorboard]", f"paths.root_dir={cache_dir}", "resume=auto"],
        "callbacks.last_checkpoint.every_n_train_steps=4",
        "trainer.log_every_n_steps=1",
    )
    proc = run_train(
        args,
        cwd=tmp_path,
        check=False,
        script=ROOT / "tests" / "faults.py",
        env={"GPTLAB_TEST_FAULT": "ctrl_c_twice:5"},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert re.search(
        r"Quit by a second Ctrl-C at step 6, without saving it: \S+last.ckpt holds step 4; resume with the same "
        r"command and resume=auto \(it continues from step 4\)",
        output,
    ), output[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    checkpoints = run_dir / "checkpoints"
    assert torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 4
    assert not list(checkpoints.glob(".*tmp*"))  # the interrupted save left nothing behind
    result = Run(run_dir).result()
    assert (
        result["stopped_by_signal"] is True and result["checkpoint_step"] == 4 and result["global_step"] == 6
    )
    assert max(logged_steps(run_dir)) >= 5  # rows past the checkpoint's step were written...

    run_train(args, cwd=tmp_path)
    assert logged_steps(run_dir) == list(
        range(1, MAX_STEPS + 1)
    )  # ...and dropped, not repeated, by the resumed run
    # TensorBoard reads the two parts' event files as one curve, each step once
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, MAX_STEPS + 1))
    assert_bit_identical(weights(checkpoints / "last.ckpt"), reference)


def disk_for_one_checkpoint_and_a_half(tmp_path, run_dir):
    """A real filesystem (a tmpfs at ``tmp_path/run``) with room for one of ``run_dir``'s checkpoints and a half;
    the test is skipped where none can be mounted."""
    size = last_checkpoint(run_dir).stat().st_size
    out = tmp_path / "run"
    out.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size * 3 // 2 // 4096 * 4096}", "tmpfs", str(out)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here (needs root outside an unprivileged container): {mounted.stderr}"
        )
    return out


@pytest.mark.parametrize("background", [True, False])
def test_a_full_disk_names_the_space_and_keeps_the_last_checkpoint_and_the_metrics(
    tmp_path, cache_dir, reference_run, background
):
    """A real full filesystem: the run directory on a tmpfs with room for one checkpoint and a half. The
    first save fits; the second, written beside the first before it replaces it, does not."""
    out = disk_for_one_checkpoint_and_a_half(tmp_path, reference_run[0])
    try:
        cfg = compose_cfg(
            *with_overrides(ARGS, "trainer.val_check_interval=100"),  # no best-*.ckpt before the second save
            "logger=csv",
            f"paths.root_dir={cache_dir}",
            f"paths.output_dir={out}",
            f"callbacks.last_checkpoint.background={str(background).lower()}",
        )
        with pytest.raises(DiskFullError) as raised:
            run(cfg)
        message = str(raised.value)
        checkpoints = out / "checkpoints"
        match = re.fullmatch(
            rf"no space left on {checkpoints}: the checkpoint last.ckpt needs about (\d+) MB, (\d+) MB free\. "
            rf"Free space there, or start the run on another disk \(hydra.run.dir=<dir>\); the last good "
            rf"checkpoint {checkpoints / 'last.ckpt'} is intact: once there is space, resume=auto continues "
            r"from it\.",
            message,
        )
        assert match, message
        needed, free = int(match.group(1)), int(match.group(2))
        size = last_checkpoint(reference_run[0]).stat().st_size
        assert abs(needed * 1e6 - size) < 0.1 * size and free < needed  # about the checkpoint's real size
        # the old checkpoint is whole, no partial file is left, and result.json keeps what was logged
        saved = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)
        names = sorted(p.name for p in checkpoints.iterdir())
        assert saved["global_step"] == 2 and names == ["last.ckpt", "last.ckpt.sha256"]
        assert digests.check(checkpoints / "last.ckpt").verified  # "intact", as the message says
        result = Run(out).result()
        # The step 4 save failed: in the foreground at once; in the background found at the end of step 5,
        # or by the save of step 6, which waits for it.
        assert result["failed"].startswith("DiskFullError: no space left on")
        assert result["global_step"] in ((5, 6) if background else (4,))
        assert result["finished"] is False
        assert {"train/loss", "lr", "wall_seconds"} <= set(result["metrics"])
    finally:
        subprocess.run(["umount", str(out)], check=False)


def test_a_run_directory_without_last_ckpt_is_refused_naming_its_best_checkpoint(tmp_path, reference_run):
    # a run stopped before its first last.ckpt (or one whose last.ckpt was deleted) with a best checkpoint
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run[0], run_dir)
    for path in (run_dir / "checkpoints").glob("last.ckpt*"):
        path.unlink()
    (best,) = (run_dir / "checkpoints").glob("best-*.ckpt")
    with pytest.raises(CheckpointError) as refused:
        checkpoint_to_resume(str(run_dir), tmp_path / "new")
    assert str(refused.value) == (
        f"resume={run_dir}: the directory holds no checkpoints/last.ckpt to continue from. It holds {best.name} (a "
        f"best checkpoint, saved at a validation): resume={best} continues from it. Give a checkpoint "
        "(resume=<run>/checkpoints/<name>.ckpt), another run directory, or resume=auto."
    )
    assert checkpoint_to_resume(str(best), tmp_path / "new") == best  # the command it names is taken


def test_resume_auto_refuses_a_matching_run_without_last_ckpt_naming_its_best_checkpoint(
    tmp_path, reference_run
):
    """resume=auto finds the run started with the same overrides even when it holds only a best checkpoint (a
    disk filled before its first last.ckpt), and refuses as resume=<run dir> does, naming that checkpoint,
    rather than starting a new run beside it as if there were nothing to continue."""
    outputs = tmp_path / "outputs"
    run_dir = outputs / "runs" / "2026-11-27" / "01-00-00"
    shutil.copytree(reference_run[0], run_dir)
    for path in (run_dir / "checkpoints").glob("last.ckpt*"):
        path.unlink()
    (best,) = (run_dir / "checkpoints").glob("best-*.ckpt")
    overrides = Run(run_dir).overrides()
    if overrides is None:  # composed in this process: the overrides Hydra's command line would have saved
        (run_dir / ".hydra").mkdir(exist_ok=True)
        (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(ARGS)))
        overrides = list(ARGS)
    kept = sorted(p.name for p in run_dir.rglob("*") if p.is_file())
    default = str(outputs / "runs" / "new")
    chosen = choose_run_dir([*overrides, "resume=auto"], str(outputs), default)
    assert chosen == str(run_dir)
    with pytest.raises(CheckpointError) as refused:
        checkpoint_to_resume("auto", Path(chosen))
    assert str(refused.value) == (
        f"resume=auto: the run {run_dir}, started with these overrides, holds no checkpoints/last.ckpt to continue "
        f"from. It holds {best.name} (a best checkpoint, saved at a validation): resume={best} continues from it. "
        "Or start a new run beside it with resume=null."
    )
    assert kept == sorted(p.name for p in run_dir.rglob("*") if p.is_file())  # the run is as it was
    assert not (outputs / "runs" / "new").exists()


def test_a_full_disk_before_the_first_last_checkpoint_names_the_best_checkpoint_to_resume_from(
    tmp_path, cache_dir, reference_run
):
    """A real full filesystem (room for one checkpoint and a half) where last.ckpt is not due yet: the first
    validation's best checkpoint fits, the second's does not. The message names the first, which holds the
    run, rather than saying no checkpoint was written."""
    out = disk_for_one_checkpoint_and_a_half(tmp_path, reference_run[0])
    try:
        cfg = compose_cfg(
            *with_overrides(
                ARGS,
                "trainer.val_check_interval=2",
                "callbacks.last_checkpoint.every_n_train_steps=100",  # no last.ckpt before the end
                "callbacks.model_checkpoint.save_top_k=2",  # step 4's best is saved whatever its loss
            ),
            "logger=csv",
            f"paths.root_dir={cache_dir}",
            f"paths.output_dir={out}",
        )
        with pytest.raises(DiskFullError) as raised:
            run(cfg)
        checkpoints = out / "checkpoints"
        (kept,) = checkpoints.glob("best-step000002-*.ckpt")
        message = str(raised.value)
        assert re.fullmatch(
            rf"no space left on {checkpoints}: the checkpoint best-step000004-val[\d.]+\.ckpt needs about \d+ MB, "
            rf"\d+ MB free\. Free space there, or start the run on another disk \(hydra.run.dir=<dir>\); no "
            rf"last.ckpt was written yet, and the best checkpoint {kept} is intact: once there is space, "
            rf"resume={kept} continues from it\.",
            message,
        ), message
        assert not last_checkpoint(out).exists()
        assert digests.check(kept).verified  # "intact", as the message says
        assert torch.load(kept, map_location="cpu", weights_only=True)["global_step"] == 2
    finally:
        subprocess.run(["umount", str(out)], check=False)


def test_a_resumed_runs_result_sums_the_wall_time_and_rates_over_its_parts():
    from gptlab.tasks.skeleton import earlier_parts, merged_metrics

    # a result.json written before parts were recorded: 5,000 tokens in 100 s of wall time, 50 s of training
    earlier = {
        "global_step": 160,
        "metrics": {
            "wall_seconds": 100.0,
            "tokens_per_second_wall": 50.0,
            "tokens_per_second_training": 100.0,
            "train/loss": 5.0,
            "train/grad_norm": 0.5,
        },
    }
    # this part: 5,000 more tokens in 50 s of wall time, 25 s of training; it logged no gradient norm
    part = {
        "from_step": 160,
        "to_step": 320,
        "wall_seconds": 50.0,
        "tokens_per_second_wall": 100.0,
        "tokens_per_second_training": 200.0,
    }
    latest = {"wall_seconds": 50.0, "tokens_per_second_wall": 100.0, "tokens_per_second_training": 200.0}
    merged = merged_metrics(earlier, {**latest, "train/loss": 4.0}, part)
    assert merged["wall_seconds"] == 150.0
    assert merged["tokens_per_second_wall"] == pytest.approx(10_000 / 150)
    assert merged["tokens_per_second_training"] == pytest.approx(10_000 / 75)
    assert merged["train/loss"] == 4.0 and merged["train/grad_norm"] == 0.5  # the latest value of each
    assert earlier_parts(earlier) == [
        {
            "to_step": 160,
            "wall_seconds": 100.0,
            "tokens_per_second_wall": 50.0,
            "tokens_per_second_training": 100.0,
        }
    ]
