"""What a fault on one rank does to a distributed run (CPU processes, gloo): a NaN loss on one rank stops
every rank at the same step; a kill during a sharded save leaves the previous checkpoint whole; and the
gradient norm DeepSpeed ZeRO keeps out of ``p.grad``. A rank lost altogether: tests/test_lost_ranks.py.
Faults are injected by tests/faults.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, run_train
from test_strategies import CPU2, QUIET, _free_port, column, metrics_csv

from gptlab.runs import digests
from gptlab.runs.layout import last_checkpoint

# ---- faults on one rank ----------------------------------------------------------------------------------
FAULTS = ROOT / "tests" / "faults.py"


def _checkpoint_step(path: Path) -> int:
    """The optimizer step a last.ckpt holds (a file, or a sharded directory with its meta.pt)."""
    meta = path / "meta.pt" if path.is_dir() else path
    return torch.load(meta, map_location="cpu", weights_only=False)["global_step"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_nan_loss_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, strategy):
    common = [
        *TINY,
        *QUIET,
        f"strategy={strategy}",
        *CPU2,
        "callbacks.last_checkpoint.every_n_train_steps=2",
        "trainer.val_check_interval=6",
        "logger=csv",
        f"paths.root_dir={tmp_path}",
    ]
    run_dir = tmp_path / "run"
    # Rank 1's third training forward pass (step 3) returns NaN; rank 0's loss stays finite.
    proc = run_train(
        [*common, "trainer.max_steps=6", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        script=FAULTS,
        env={"GPTLAB_TEST_FAULT": "nan_loss:1:3"},
        check=False,
        timeout=300,  # a rank left waiting in a collective would hang until this
    )
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    # Both ranks stop at step 3 with the same message, naming the rank that saw the NaN.
    message = "gptlab: training failed: The training loss is nan at step 3 on rank 1 of 2: training stopped"
    assert err.count(message) == 2, err[-3000:]
    assert "Lower optim.lr" in err
    # The last checkpoint is the finite state of step 2, and a run resumes from it.
    last = last_checkpoint(run_dir)
    assert _checkpoint_step(last) == 2
    resumed = tmp_path / "resumed"
    proc = run_train(
        [*common, "trainer.max_steps=4", f"resume={last}", f"hydra.run.dir={resumed}"], cwd=tmp_path
    )
    assert "Restored all states from the checkpoint" in proc.stdout + proc.stderr
    assert "Trained 4 steps" in proc.stdout
    assert _checkpoint_step(last_checkpoint(resumed)) == 4


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill_in_save", "kill_mid_swap"])
def test_a_kill_during_a_sharded_save_keeps_the_previous_checkpoint_whole(tmp_path, fault):
    common = [
        *TINY,
        *QUIET,
        "strategy=fsdp",
        *CPU2,
        "callbacks.last_checkpoint.every_n_train_steps=2",
        "trainer.val_check_interval=6",
        "logger=csv",
        f"paths.root_dir={tmp_path}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    checkpoints = tmp_path / "run" / "checkpoints"
    last, staging, aside = (checkpoints / n for n in ("last.ckpt", ".last.ckpt.tmp-dir", ".last.ckpt.old"))
    # kill_in_save: both ranks die once their shards of the second last.ckpt (step 4) are on disk.
    # kill_mid_swap: the run dies after step 4's directory is complete, between the two renames.
    proc = run_train(
        [*common, "trainer.max_steps=6"],
        cwd=tmp_path,
        script=FAULTS,
        env={"GPTLAB_TEST_FAULT": f"{fault}:2"},
        check=False,
        timeout=300,
        start_new_session=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    shards = ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in staging.glob("*.distcp")) == shards  # the killed save wrote beside
    previous = last if fault == "kill_in_save" else aside
    assert not (fault == "kill_mid_swap" and last.exists())
    # The previous checkpoint is step 2's, whole, and untouched since.
    assert _checkpoint_step(previous) == 2
    assert sorted(p.name for p in previous.iterdir()) == [".metadata", *shards, "meta.pt"]
    newest_in_previous = max(p.stat().st_mtime_ns for p in previous.iterdir())
    assert newest_in_previous <= min(p.stat().st_mtime_ns for p in staging.iterdir())

    # The same command resumes from step 2 (put back in place first, after a kill mid-swap): steps 3 to 6
    # are trained, and the leftovers are cleared.
    proc = run_train([*common, "trainer.max_steps=6", f"resume={last}"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "Restored all states from the checkpoint" in out
    assert ("restored the previous" in out) == (fault == "kill_mid_swap")
    assert "Trained 6 steps" in proc.stdout
    assert _checkpoint_step(last) == 6
    assert not staging.exists() and not aside.exists()
    # The interrupted save had removed the old digest before its swap (so it could not describe other
    # bytes); the new last.ckpt has its own.
    assert digests.check(last).verified and digests.check(last).step == 6


DEEPSPEED_GRAD_NORM = """
import os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.parallel.checkpoint_io import AtomicDeepSpeedStrategy

torch.manual_seed(0)
config = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64)
model, reference = GPT(config), GPT(config)
reference.load_state_dict(model.state_dict())
x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
deepspeed.init_distributed(dist_backend="gloo")
ds_config = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 2},
    "gradient_clipping": 0.1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
engine.backward(engine(x, y)[1])
assert all(p.grad is None for p in engine.module.parameters())  # what the per-parameter norm would see
engine.step()
strategy = AtomicDeepSpeedStrategy(stage=2)
strategy.model = engine
reference(x, y)[1].backward()
print(strategy.gradient_norm_after_step(), float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])))
"""


@pytest.mark.slow
def test_the_deepspeed_strategy_reports_the_zero2_gradient_norm_before_clipping(tmp_path):
    # Raw DeepSpeed runs ZeRO-2 on CPU (gloo), though Lightning's DeepSpeedStrategy does not.
    pytest.importorskip("deepspeed")
    script = tmp_path / "grad_norm.py"
    script.write_text(DEEPSPEED_GRAD_NORM)
    proc = subprocess.run(
        [sys.executable, str(script), str(_free_port())],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from_strategy, unclipped = map(float, proc.stdout.strip().splitlines()[-1].split())
    assert unclipped > 0.1  # so clipping at 0.1 would change it
    assert from_strategy == pytest.approx(unclipped, rel=1e-5)


# ---- on a GPU (skipped without CUDA) ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("choice", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_deepspeed_on_a_gpu_logs_the_gradient_norm_and_resumes_from_its_directory(tmp_path, choice):
    pytest.importorskip("deepspeed")
    common = [
        *TINY,
        *QUIET,
        f"strategy={choice}",
        "trainer.accelerator=gpu",
        "trainer.devices=1",
        "callbacks.last_checkpoint.every_n_train_steps=2",
        "logger=csv",
        f"paths.root_dir={tmp_path}",
    ]
    first = tmp_path / "first"
    run_train([*common, "trainer.max_steps=4", f"hydra.run.dir={first}"], cwd=tmp_path)
    # ZeRO-2/3 keep gradients out of p.grad: the norm comes from the DeepSpeed engine, every step.
    norms = column(metrics_csv(first), "train/grad_norm")
    assert sorted(norms) == [0, 1, 2, 3] and all(0 < v < float("inf") for v in norms.values())
    last = last_checkpoint(first)
    assert last.is_dir() and not (first / "checkpoints" / ".last.ckpt.tmp-dir").exists()
    proc = run_train(
        [*common, "trainer.max_steps=6", f"resume={last}", f"hydra.run.dir={tmp_path / 'second'}"],
        cwd=tmp_path,
    )
    assert "Restored all states from the checkpoint" in proc.stdout + proc.stderr
    assert "Trained 6 steps" in proc.stdout
