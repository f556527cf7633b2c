"""Parallel strategies: every choice builds or is refused clearly; DDP, FSDP, two nodes and multiruns train
on CPU processes (gloo); the SLURM launcher's job script and its preemption path."""

from __future__ import annotations

import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONF, ROOT, TINY, run_train, signal_when_held, slurm_job
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import gptlab.tasks.gpt
from gptlab.errors import ConfigError
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.parallel import (
    STRATEGIES,
    ParallelOptions,
    build_strategy,
    parallelize,
    strategy_choice,
    warn_if_cpu_oversubscribed,
)
from gptlab.parallel.hardware import cpu_cores
from gptlab.runs import digests
from gptlab.runs.layout import last_checkpoint
from gptlab.tracking.wandb_runs import find_runs, read_run

STRATEGY_CHOICES = sorted(p.stem for p in (CONF / "strategy").glob("*.yaml"))
CPU2 = ["trainer.accelerator=cpu", "trainer.devices=2"]
QUIET = ["callbacks.sample_generation.max_new_tokens=0", "trainer.log_every_n_steps=1"]


def metrics_csv(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


# ---- config time ---------------------------------------------------------------------------------------
def test_the_strategy_folder_and_the_registry_agree():
    names = set()
    for choice in STRATEGY_CHOICES:
        names.add(OmegaConf.load(CONF / "strategy" / f"{choice}.yaml").name)
    assert names == set(STRATEGIES.names())
    for required in ("auto", "ddp", "ddp_spawn", "fsdp", "deepspeed_stage_1", "deepspeed_stage_2"):
        assert required in STRATEGY_CHOICES
    assert {"deepspeed_stage_3", "deepspeed_stage_2_offload", "deepspeed_stage_3_offload"} <= set(
        STRATEGY_CHOICES
    )


@pytest.mark.parametrize("choice", STRATEGY_CHOICES)
def test_every_strategy_composes_and_builds_or_is_refused_on_cpu(make_cfg, choice):
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    cfg = make_cfg(f"strategy={choice}", "trainer.accelerator=cpu", "trainer.devices=2")
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    strategy_cfg = OmegaConf.to_container(cfg.strategy, resolve=True)
    if choice.startswith("deepspeed"):
        with pytest.raises(ConfigError) as err:
            build_strategy(strategy_cfg, trainer_cfg)
        message = str(err.value)
        assert f"strategy={choice} needs CUDA GPUs" in message
        assert "strategy=fsdp" in message and "strategy=ddp" in message
        return
    strategy = build_strategy(strategy_cfg, trainer_cfg)
    if choice == "auto":
        assert strategy == "auto"
    elif choice in ("ddp", "ddp_spawn"):
        assert isinstance(strategy, DDPStrategy)
        assert strategy._start_method == ("spawn" if choice == "ddp_spawn" else "popen")
    elif choice == "fsdp":
        assert isinstance(strategy, ModelParallelStrategy)
        assert strategy.reshard_after_forward and not strategy.hybrid and not strategy.cpu_offload
    # The checkpoint writer follows the choice: one atomic file from rank 0, or a directory per checkpoint.
    choice = strategy_choice(strategy_cfg)
    assert bool(choice.plugins()) != choice.writes_directory()


def test_bad_strategy_options_name_the_fix():
    cpu = {"accelerator": "cpu", "devices": 2, "num_nodes": 1}
    with pytest.raises(
        ConfigError,
        match=r"strategy=fsdp does not take option\(s\) strategy.sharding. Its options: strategy.reshard_after",
    ):
        build_strategy({"name": "fsdp", "sharding": "full"}, cpu)
    with pytest.raises(ConfigError, match="strategy.hybrid=true .* trainer.num_nodes=1"):
        build_strategy({"name": "fsdp", "hybrid": True}, cpu)
    with pytest.raises(ConfigError, match="cpu_offload=true .* no GPU.*Set strategy.cpu_offload=false"):
        build_strategy({"name": "fsdp", "cpu_offload": True}, cpu)
    with pytest.raises(ConfigError, match="Unknown strategy 'fsdp2'.*Did you mean strategy=fsdp"):
        strategy_choice({"name": "fsdp2"})
    with pytest.raises(ConfigError, match="offload_parameters=true needs ZeRO stage 3"):
        build_strategy({"name": "deepspeed", "stage": 2, "offload_parameters": True}, cpu)
    with pytest.raises(ConfigError, match=r"strategy.find_unused_parameters='no' must be true or false"):
        build_strategy({"name": "ddp", "find_unused_parameters": "no"}, cpu)
    with pytest.raises(ConfigError, match=r"strategy.stage='2' must be an integer"):
        build_strategy({"name": "deepspeed", "stage": "2"}, cpu)
    with pytest.raises(ConfigError, match="compile='yes' must be true or false or 'auto'"):
        ParallelOptions.from_config({"compile": "yes"})


@pytest.mark.parametrize(
    "setting,device,on,said",
    [
        ("auto", "cuda", True, "on (auto: CUDA)"),
        ("auto", "cpu", False, "off (auto: CPU, where it measured no gain)"),
        ("auto", "mps", False, "off (auto: mps, not measured there)"),
        (True, "cpu", True, "on (compile=true)"),
        (False, "cuda", False, "off (compile=false)"),
    ],
)
def test_compile_auto_compiles_the_blocks_of_a_cuda_run_only(setting, device, on, said):
    options = ParallelOptions.from_config({"compile": setting}).resolved(device)
    choice = options.compile_choice
    assert (choice.on, choice.describe()) == (on, said)
    assert options.compiled is on and options.compile == setting  # the setting kept as given


def test_compile_auto_resolves_with_the_config_for_the_device_the_run_trains_on(make_cfg):
    """The default, compile=auto, is off for a run on this machine's CPU, whose config then holds a plain
    false (what parallelize applies); parallelize refuses an unresolved auto rather than guess its device.
    Built in Python, the options default to auto as train.yaml does."""
    from gptlab.config import parse_gpt

    assert make_cfg().compile == "auto"
    settings = parse_gpt(make_cfg("trainer.accelerator=cpu"))
    assert settings.parallel.compiled is False
    assert settings.parallel.compile_choice.describe() == "off (auto: CPU, where it measured no gain)"
    assert parse_gpt(make_cfg("trainer.accelerator=cpu", "compile=true")).parallel.compiled is True
    assert ParallelOptions() == ParallelOptions.from_config({}) and ParallelOptions().compile == "auto"
    with pytest.raises(ConfigError, match="compile='maybe' must be true or false or 'auto'"):
        parse_gpt(make_cfg("trainer.accelerator=cpu", "compile=maybe"))  # when the config is read
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    for unresolved in (ParallelOptions(), ParallelOptions(compile="auto")):
        with pytest.raises(ValueError, match="compile=auto must be resolved"):
            parallelize(model, unresolved)


def test_the_process_group_timeout_is_a_strategy_option(make_cfg):
    from datetime import timedelta

    cpu = {"accelerator": "cpu", "devices": 2, "num_nodes": 1}
    for choice in ("ddp", "ddp_spawn", "fsdp"):
        cfg = make_cfg(f"strategy={choice}", "trainer.accelerator=cpu", "trainer.devices=2")
        built = build_strategy(OmegaConf.to_container(cfg.strategy, resolve=True), cpu)
        assert built._timeout == timedelta(seconds=600)  # not Lightning's 30 minutes
        cfg = make_cfg(f"strategy={choice}", "strategy.timeout_s=45")
        built = build_strategy(OmegaConf.to_container(cfg.strategy, resolve=True), cpu)
        assert built._timeout == timedelta(seconds=45)
    for choice in ("ddp", "fsdp", "deepspeed"):  # refused before the hardware is looked at
        with pytest.raises(
            ConfigError, match=r"strategy.timeout_s=0.0: the seconds a rank waits .* positive"
        ):
            build_strategy({"name": choice, "timeout_s": 0}, cpu)
    with pytest.raises(ConfigError, match=r"strategy.timeout_s='ten' must be a number"):
        build_strategy({"name": "ddp", "timeout_s": "ten"}, cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal on a machine without CUDA")
def test_deepspeed_on_cpu_is_refused_before_any_work(tmp_path):
    proc = run_train(
        [
            *TINY,
            "strategy=deepspeed_stage_2",
            f"paths.root_dir={tmp_path}",
            f"hydra.run.dir={tmp_path / 'r'}",
        ],
        cwd=tmp_path,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 2
    assert "gptlab: error: strategy=deepspeed_stage_2 needs CUDA GPUs" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs" / "cache").exists()  # no corpus was tokenized
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_a_multirun_with_ddp_is_refused_and_points_to_ddp_spawn_and_slurm(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(
        [
            "-m",
            *TINY,
            "strategy=ddp",
            *CPU2,
            "seed=1,2",
            f"paths.root_dir={tmp_path}",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
        check=False,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "every rank would run a sweep of its own" in out
    assert "strategy=ddp_spawn" in out and "hydra/launcher=slurm" in out
    assert not list(sweep.glob("*/checkpoints"))
    assert "Initializing distributed" not in out  # no second process was started


def test_the_multirun_guard_refuses_only_what_would_start_a_second_sweep(monkeypatch):
    from gptlab.parallel import check_launch

    for name in ("SLURM_NTASKS", "SLURM_JOB_NAME", "LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    two = {"accelerator": "cpu", "devices": 2, "num_nodes": 1}
    for name in ("auto", "ddp", "fsdp"):
        with pytest.raises(ConfigError, match="strategy=ddp_spawn"):
            check_launch(strategy_choice({"name": name}), two, multirun=True)
        check_launch(strategy_choice({"name": name}), two, multirun=False)
        check_launch(strategy_choice({"name": name}), {**two, "devices": 1}, multirun=True)
    with pytest.raises(ConfigError):  # two nodes of one device each are two processes too
        check_launch(strategy_choice({"name": "ddp"}), {**two, "devices": 1, "num_nodes": 2}, multirun=True)
    check_launch(strategy_choice({"name": "ddp_spawn"}), two, multirun=True)
    # Under SLURM (hydra/launcher=slurm) srun has started every rank: each runs its own job only.
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "gptlab")
    check_launch(strategy_choice({"name": "ddp"}), two, multirun=True)


@pytest.mark.parametrize("attention", [{}, {"gate": "elementwise", "value_residual": "learnable"}])
def test_activation_checkpointing_keeps_the_loss_the_gradients_and_the_parameter_names(attention):
    """Also with the first layer's values handed from block to block (attention.value_residual): each
    checkpointed block recomputes its forward from its own inputs, the first layer's values among them."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, attention=attention)
    plain, wrapped = GPT(config), GPT(config)
    wrapped.load_state_dict(plain.state_dict())
    parallelize(wrapped, ParallelOptions(activation_checkpointing=True).resolved("cpu"))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    x = torch.randint(0, 64, (3, 16))
    y = torch.randint(0, 64, (3, 16))
    loss_plain = plain(x, y)[1]
    loss_wrapped = wrapped(x, y)[1]
    loss_plain.backward()
    loss_wrapped.backward()
    assert torch.equal(loss_plain, loss_wrapped)
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6, msg=name)


def test_more_cpu_processes_than_cores_warns_with_the_core_count(caplog):
    cores = cpu_cores()
    with caplog.at_level("WARNING", logger="gptlab"):
        message = warn_if_cpu_oversubscribed({"accelerator": "cpu", "devices": 4 * cores})
    assert f"trainer.devices={4 * cores} starts {4 * cores} training processes on the CPU" in caplog.text
    assert f"this machine gives this run {cores} core(s)" in message
    assert f"Use trainer.devices={cores} or fewer" in message
    caplog.clear()
    with caplog.at_level("WARNING", logger="gptlab"):
        assert warn_if_cpu_oversubscribed({"accelerator": "cpu", "devices": cores}) is None
    assert not caplog.text


def test_eval_length_with_sharded_weights_on_several_ranks_is_refused_at_start(make_cfg, tmp_path):
    # The length study runs a forward pass on rank 0 alone; with FSDP each rank holds only its shards.
    cfg = make_cfg(
        *TINY,
        "strategy=fsdp",
        *CPU2,
        "eval_length.enabled=true",
        "logger=csv",
        f"paths.output_dir={tmp_path}",
    )
    with pytest.raises(ConfigError) as err:
        gptlab.tasks.gpt.run(cfg)
    message = str(err.value)
    assert "eval_length.enabled=true evaluates the trained model on rank 0 alone" in message
    assert "strategy=fsdp shards the weights over the 2 processes" in message
    assert "eval_length.enabled=false" in message and "scripts/eval_length.py" in message
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "csv").exists()
    # Replicated weights (DDP) or one process: every rank holds the whole model, so it runs.
    from gptlab.parallel import check_rank_zero_evaluation

    check_rank_zero_evaluation(strategy_choice("ddp"), {"accelerator": "cpu", "devices": 2}, "eval_length")
    check_rank_zero_evaluation(strategy_choice("fsdp"), {"accelerator": "cpu", "devices": 1}, "eval_length")


# ---- SLURM -----------------------------------------------------------------------------------------------
def test_slurm_launcher_asks_for_one_task_per_device_and_lightnings_requeue_signal(tmp_path, monkeypatch):
    import submitit
    from hydra.utils import instantiate

    # submitit's SLURM executor insists on finding `srun`; no SLURM here, so an empty stand-in is on PATH.
    (tmp_path / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["hydra/launcher=slurm", "strategy=ddp", "trainer.devices=8", "trainer.num_nodes=4"],
            return_hydra_config=True,
        )
    launcher = instantiate(cfg.hydra.launcher)
    params = launcher.params
    assert params["tasks_per_node"] == 8 and params["nodes"] == 4 and params["gpus_per_node"] == 8
    # The sbatch script submitit would submit, from the parameters as the launcher passes them.
    executor = submitit.AutoExecutor(cluster="slurm", folder=tmp_path / "jobs")
    executor.update_parameters(
        tasks_per_node=params["tasks_per_node"],
        nodes=params["nodes"],
        gpus_per_node=params["gpus_per_node"],
        slurm_additional_parameters=dict(params["additional_parameters"]),
        slurm_signal_delay_s=params["signal_delay_s"],
    )
    script = executor._executor._make_submission_file_text("python -m submitit.core._submit", "0")
    assert "#SBATCH --ntasks-per-node=8" in script
    assert "#SBATCH --nodes=4" in script
    assert "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --signal=USR1@120" in script and "USR2" not in script


@pytest.mark.slow
def test_a_preempted_slurm_job_saves_requeues_and_resumes_in_the_same_run_directory(tmp_path):
    # No SLURM controller here: the job's environment variables are set by hand and `scontrol` is a script
    # that records its arguments.
    env, calls = slurm_job(tmp_path)
    env["PYTHONUNBUFFERED"] = "1"
    run_dir = tmp_path / "job_4242"
    max_steps = 8
    args = [
        *TINY,
        *QUIET,
        f"trainer.max_steps={max_steps}",
        f"trainer.val_check_interval={max_steps}",
        "logger=csv",
        f"paths.root_dir={tmp_path}",
        f"hydra.run.dir={run_dir}",
    ]
    # held after step 3 until the signal has been handled: what SLURM sends before it preempts or times out
    # the job lands mid-run however slowly this process reads the line
    status, out = signal_when_held(
        args, tmp_path, "hold_at_step:3", ("held at step 3",), signal.SIGUSR1, env=env
    )
    assert status == 0, out[-3000:]
    assert calls.read_text().split() == ["requeue", "4242"]
    saved_step = torch.load(run_dir / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=False)[
        "global_step"
    ]
    assert saved_step == 3

    # The requeued job runs the same command again and finds the checkpoint in its run directory.
    proc = run_train(args, cwd=tmp_path, env=env)
    out = proc.stdout + proc.stderr
    assert "Restored all states from the checkpoint" in out and "hpc_ckpt_1.ckpt" in out
    last = torch.load(last_checkpoint(run_dir), map_location="cpu", weights_only=False)
    assert last["global_step"] == max_steps
    assert f"Trained {max_steps} steps" in proc.stdout


def test_fsdp_in_bf16_mixed_precision_logs_the_loss_its_training_step_computed(tmp_path):
    """Under mixed precision FSDP casts the root module's inputs, rebuilding every list and dataclass among
    them: the training step's recording head loss reaches the model as a copy. The step reads the terms the
    copy recorded (train/loss, the z-loss apart). On a GPU, trainer.precision=null is bf16-mixed."""
    run_train(
        [
            *TINY,
            *QUIET,
            "strategy=fsdp",
            "trainer.accelerator=cpu",
            "trainer.devices=1",
            "trainer.precision=bf16-mixed",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "loss.z_loss=1e-4",
            "logger=csv",
            f"paths.root_dir={tmp_path}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
    )
    rows = metrics_csv(tmp_path / "run")
    loss, z_loss = column(rows, "train/loss"), column(rows, "train/z_loss")
    assert sorted(loss) == [1, 2] and sorted(z_loss) == [1, 2]
    assert all(9 < value < 12 for value in loss.values())  # ln(50257) = 10.8 at initialisation
    # 1e-4 x log^2 Z, log Z near ln(50257) at initialisation
    assert all(0.5e-4 * 10.8**2 < value < 2e-4 * 10.8**2 for value in z_loss.values()), z_loss


# ---- several processes -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ddp_processes_give_the_loss_curve_of_one_process_with_the_same_global_batch_and_print_once(
    tmp_path,
):
    # Same samples per step: under a distributed strategy Lightning draws one permutation of the training
    # windows (seeded by `seed`, the same in every rank) and rank r takes every other index of it, so the two
    # half batches together are the batch a world of one process takes. (A plain single-device run shuffles
    # with another permutation.) Mean losses over equal halves average to the full batch's mean; no dropout.
    # The validation loss at steps 2 and 4 is the mean over every validation token of every rank.
    common = [
        *TINY,
        "trainer.log_every_n_steps=1",
        "callbacks.sample_generation.max_new_tokens=2",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "logger=wandb",
        f"paths.root_dir={tmp_path}",
    ]
    one_process = ["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=1", "data.batch_size=8"]
    run_train([*common, *one_process, f"hydra.run.dir={tmp_path / 'one'}"], cwd=tmp_path)
    ddp_cwd = tmp_path / "ddp"
    ddp_cwd.mkdir()
    # DDP re-runs the command for rank 1. Pinned to one core (as `taskset -c 0` does; DDP's second process
    # inherits it), two processes are more than the cores: the core-count warning is due, once.
    proc = run_train(
        [*common, "data.batch_size=4", "strategy=ddp", *CPU2],
        cwd=ddp_cwd,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
    )
    out = proc.stdout + proc.stderr
    assert "Starting with 2 processes" in out  # rank 0's: every rank joined
    # Each message once, not once per process
    once = [
        "Initializing distributed: GLOBAL_RANK",  # rank 0's; "Starting with 2 processes" says the others joined
        "trainer.devices=2 starts 2 training processes on the CPU, but this machine gives this run 1 core(s)",
        "Windows of 33 tokens:",
        "Data ready after",
        "Final validation loss",
        *(
            f"step {n} {decoding}: 'In this case, the' -> "
            for n in (2, 4)
            for decoding in ("greedy", "sampled (temperature 1, top-k 40)")
        ),
    ]
    assert {line: out.count(line) for line in once} == dict.fromkeys(once, 1), out[-4000:]
    assert out.count("Token cache hit") + out.count("Preparing embedded corpus") == 1
    assert "sync_dist" not in out  # the validation metrics are the same on every rank, and Lightning knows it
    # the non-finite guard's all-gather of each step's loss draws no deprecation warning from any rank
    assert "all_gather is deprecated" not in out, out[-4000:]

    # One run directory and one W&B run for the two processes.
    run_dirs = [p for p in (ddp_cwd / "outputs" / "runs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    ddp_runs = find_runs(run_dirs[0] / "wandb")
    assert len(ddp_runs) == 1

    one = read_run(find_runs(tmp_path / "one" / "wandb")[0]).metric("val/loss")
    two = read_run(ddp_runs[0]).metric("val/loss")
    assert [s for s, _ in one] == [s for s, _ in two] and len(one) == 2
    for (step, a), (_, b) in zip(one, two):
        assert abs(a - b) < 1e-5, (step, a, b)
    assert one[-1][1] < one[0][1]  # it trained

    w_one = torch.load(last_checkpoint(tmp_path / "one"), map_location="cpu", weights_only=False)
    w_two = torch.load(last_checkpoint(run_dirs[0]), map_location="cpu", weights_only=False)
    for name, value in w_one["state_dict"].items():
        torch.testing.assert_close(value, w_two["state_dict"][name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_fsdp_on_two_processes_trains_checkpoints_shards_and_resumes(tmp_path):
    # Under optim=muon, which takes AdamW for the embeddings and norms: torch.optim.Muon on FSDP2's sharded
    # DTensor parameters (the Newton-Schulz products redistribute the shards, so each rank orthogonalises the
    # whole matrix), and both optimizers' states go through the sharded checkpoint and come back.
    common = [
        *TINY,
        *QUIET,
        "strategy=fsdp",
        *CPU2,
        "optim=muon",
        "optim.warmup_steps=1",
        "trainer.val_check_interval=3",
        "callbacks.model_checkpoint.save_top_k=-1",
        "logger=csv",
        f"paths.root_dir={tmp_path}",
    ]
    full = tmp_path / "full"
    run_train([*common, "trainer.max_steps=6", f"hydra.run.dir={full}"], cwd=tmp_path)
    middle = next((full / "checkpoints").glob("best-step000003-*.ckpt"))
    # A distributed checkpoint: a directory with one shard file per rank.
    assert middle.is_dir() and sorted(p.name for p in middle.glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    full_loss = column(metrics_csv(full), "train/loss")
    assert full_loss[6] < full_loss[1] - 0.3  # it trained
    # The two ranks hashed the directory's files between them; rank 0 wrote the one digest file: one line per
    # file, every rank's shard included, which sha256sum checks as written.
    manifest = digests.read_digest(middle)
    listed = {f.name for f in manifest.files}
    assert listed == {f"{middle.name}/{p.name}" for p in middle.iterdir()} and len(listed) == 4
    if shutil.which("sha256sum"):
        checked = subprocess.run(
            ["sha256sum", "-c", "--strict", digests.digest_path(middle).name],
            cwd=middle.parent,
            capture_output=True,
            text=True,
        )
        assert checked.returncode == 0 and checked.stdout.count(": OK") == 4, checked.stdout

    resumed = tmp_path / "resumed"
    proc = run_train(
        [*common, "trainer.max_steps=6", f"resume={middle}", f"hydra.run.dir={resumed}"], cwd=tmp_path
    )
    assert "Restored all states from the checkpoint" in proc.stdout + proc.stderr
    assert "without verifying" not in proc.stdout + proc.stderr  # each rank checked the shards first
    resumed_loss = column(metrics_csv(resumed), "train/loss")
    assert sorted(resumed_loss) == [4, 5, 6]  # the steps after the third
    # The sharded weights and both optimizers' states came back (Muon's momentum, AdamW's moments): the loss
    # goes on as in the run never stopped.
    for step in (4, 5, 6):
        assert resumed_loss[step] == pytest.approx(full_loss[step], abs=1e-4), (step, resumed_loss, full_loss)
    assert (last_checkpoint(resumed)).is_dir()

    # A shard that rank 1 checks when the two ranks load the checkpoint, changed in place (same size): both
    # ranks refuse it, each with the message one process gives, before any step.
    rank1_share = digests.shares([(f.name, f.size) for f in manifest.files], 2)[1]
    damaged = next(name for name in rank1_share if name.endswith(".distcp"))
    shard = middle / damaged.split("/", 1)[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    refused = run_train(
        [*common, "trainer.max_steps=6", f"resume={middle}", f"hydra.run.dir={tmp_path / 'refused'}"],
        cwd=tmp_path,
        check=False,
        timeout=300,  # a rank left waiting for the other's verdict would hang until this
    )
    err = refused.stderr
    message = (
        f"gptlab: error: Checkpoint {middle} is damaged: its bytes differ from those written at step 3 "
        f"(recorded in {digests.digest_path(middle).name}): {damaged} has the size written "
        f"({len(data):,} bytes) but SHA-256 "
    )
    assert refused.returncode == 2, err[-4000:]
    assert err.count(message) == 2, err[-4000:]  # rank 0 and rank 1, the same words
    assert not (tmp_path / "refused" / "checkpoints").exists() or not any(
        (tmp_path / "refused" / "checkpoints").iterdir()
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_together_under_torchrun(tmp_path):
    port = _free_port()
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc_per_node=1",
            f"--node_rank={node}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(ROOT / "train.py"),
            *TINY,
            *QUIET,
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
            "strategy=ddp",
            "trainer.accelerator=cpu",
            "trainer.devices=1",
            "trainer.num_nodes=2",
            "logger=csv",
            f"paths.root_dir={tmp_path}",
            f"hydra.run.dir={tmp_path / f'node{node}'}",
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=tmp_path,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "Starting with 2 processes" in outs[0]  # rank 0's, once node 1's rank 1 joined
    # Rank 0 (node 0) logs and saves; every step counted the tokens of both nodes.
    rows = metrics_csv(tmp_path / "node0")
    tokens = column(rows, "train/tokens")
    assert tokens[4] == 4 * 2 * 4 * 32  # steps x nodes x batch x block_size
    assert not (tmp_path / "node1" / "checkpoints").exists()
    assert torch.load(last_checkpoint(tmp_path / "node0"), weights_only=False)["global_step"] == 4


@pytest.mark.slow
def test_a_multirun_with_ddp_spawn_writes_one_run_directory_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(
        [
            "-m",
            *TINY,
            *QUIET,
            "strategy=ddp_spawn",
            *CPU2,
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            "logger=csv",
            "seed=1,2",
            f"paths.root_dir={tmp_path}",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=tmp_path,
    )
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1"], proc.stdout[-2000:]
    for job, seed in (("0", 1), ("1", 2)):
        assert OmegaConf.load(sweep / job / "config_resolved.yaml").seed == seed
        assert (last_checkpoint(sweep / job)).is_file()
        assert (sweep / job / "csv" / "metrics.csv").is_file()
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs" / "multirun").exists()


def test_precision_defaults_to_fp32_on_cpu_and_keeps_an_explicit_choice():
    from gptlab.parallel import choose_precision

    assert choose_precision(None, "cpu") == "32-true"
    assert choose_precision("auto", "cpu") == "32-true"
    assert choose_precision("bf16-mixed", "cpu") == "bf16-mixed"
    if torch.cuda.is_available():
        assert choose_precision(None, "auto") in ("bf16-mixed", "16-mixed")
    else:
        assert choose_precision(None, "auto") == "32-true"
