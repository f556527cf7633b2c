"""A run read back: its layout, and every checkpoint kind (a single file, a distributed checkpoint directory)
through the one loader, by the library and by the scripts; checkpoints that could run code are refused."""

from __future__ import annotations

import io
import os
import pickle
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONF, ROOT, TINY, run_train
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from gptlab.errors import CheckpointError
from gptlab.runs import Run, digests, find_run_dirs, run_of_path
from gptlab.runs.checkpoints import load_checkpoint
from gptlab.runs.layout import checkpoint_kind, last_checkpoint
from gptlab.runs.trained import load_run


def compose_cfg(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny character-level RoPE run, trained in this process (single-file checkpoints); and the same run
    trained by `python train.py strategy=fsdp` on one CPU process, whose checkpoints are distributed
    checkpoint directories (shards through torch.distributed.checkpoint, Lightning's meta.pt beside them)."""
    from gptlab.tasks.gpt import run

    root = tmp_path_factory.mktemp("runs")
    run_dir = root / "run"
    args = [*TINY, "tokenizer=char", "pos=rope", "logger=none", f"paths.root_dir={root}"]
    run(compose_cfg(*args, f"paths.output_dir={run_dir}"))
    run_train([*args, "strategy=fsdp", "trainer.accelerator=cpu", f"hydra.run.dir={root / 'fsdp'}"], cwd=root)
    return root, run_dir, last_checkpoint(run_dir), last_checkpoint(root / "fsdp")


def test_the_layout_of_a_run(trained):
    root, run_dir, last, sharded = trained
    run = Run(run_dir)
    assert find_run_dirs(root) == [root / "fsdp", run_dir]
    assert run.last_checkpoint() == last and run.resume_checkpoint() == last
    (best,) = run.best_checkpoints()
    assert best.name.startswith("best-step000008-val") and run.checkpoint("best") == best
    assert run.config()["pos"]["name"] == "rope"
    assert run.result()["global_step"] == 8 and run.result()["finished"]
    assert run_of_path(last) == run and run_of_path(run_dir) == run
    assert run_of_path(sharded) == Run(root / "fsdp") and Run(root / "fsdp").last_checkpoint() == sharded
    assert checkpoint_kind(last) == "file" and checkpoint_kind(sharded) == "dcp"
    assert checkpoint_kind(run_dir) is None


def test_result_json_records_what_the_settings_left_to_the_hardware_took(trained):
    """compile=auto, loss.impl=auto and trainer.precision=null as each run took them on this CPU: the config
    files keep what was asked, result.json what was done; the run's header says why."""
    root, run_dir, _, _ = trained
    taken = {"compile": False, "loss.impl": "chunked", "trainer.precision": "32-true"}
    for directory in (run_dir, root / "fsdp"):
        assert Run(directory).result()["resolved"] == taken
        assert Run(directory).config()["compile"] == "auto"
    assert "Compile: off (auto: CPU, where it measured no gain)" in (root / "fsdp" / "train.log").read_text()


def test_a_distributed_checkpoint_loads_the_same_model_as_the_file(trained, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, _, last, sharded = trained
    from_file, from_dcp = load_run(last), load_run(sharded)
    assert from_dcp.run_dir == root / "fsdp" and from_dcp.checkpoint == sharded
    a, b = from_file.model.state_dict(), from_dcp.model.state_dict()
    # exactly the tensors torch's own reader finds in the shards
    dcp_to_torch_save(sharded, tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=True)["state_dict"]
    assert b.keys() == {k.removeprefix("model.") for k in converted}
    assert all(torch.equal(b[k.removeprefix("model.")], v) for k, v in converted.items())
    # and the same model as the run trained without sharding (the same steps, up to float rounding)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    # without the weights, only Lightning's part is read: what resuming checks
    meta = load_checkpoint(sharded, weights=False)
    assert "state_dict" not in meta and meta["global_step"] == 8 and meta["hyper_parameters"]["model"]


def test_resume_checks_a_distributed_checkpoint_before_training(trained, make_cfg):
    root, _, _, sharded = trained
    run_dir = root / "fsdp"
    from gptlab.api import build_model_config, build_tokenizer
    from gptlab.runs.resume import checkpoint_to_resume, plan_resume

    cfg = make_cfg(*TINY, "tokenizer=char", "pos=rope")
    plan = plan_resume(
        checkpoint_to_resume(str(sharded), run_dir), build_model_config(cfg, build_tokenizer(cfg))
    )
    assert plan.global_step == 8 and plan.ckpt_path == sharded
    other = make_cfg(*TINY, "tokenizer=char", "pos=rope", "model.n_layer=2")
    with pytest.raises(CheckpointError, match="n_layer: 1 in the checkpoint, 2 now"):
        plan_resume(
            checkpoint_to_resume(str(sharded), run_dir), build_model_config(other, build_tokenizer(other))
        )


def script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )


def main_of(name: str):
    """scripts/<name>'s main(), to call in this process: a second interpreter would only add start-up time
    (the scripts run as commands in test_cli, test_eval_length and below)."""
    return runpy.run_path(str(ROOT / "scripts" / name))["main"]


def test_the_scripts_read_a_distributed_checkpoint(trained, tmp_path, capsys):
    _, run_dir, last, sharded = trained
    generate = main_of("generate.py")
    greedy = []
    for path in (last, sharded):
        generate([f"ckpt={path}", "prompt=The", "max_new_tokens=8"])
        greedy.append(capsys.readouterr().out)
    assert greedy[0] == greedy[1] and greedy[1].startswith("The")

    eval_length, out = main_of("eval_length.py"), tmp_path / "len"
    assert eval_length([str(sharded), "--factors", "1", "2", "--no-wandb", "--out", str(out)]) == 0
    assert (out / "length.json").is_file() and "| rope |" in capsys.readouterr().out

    proc = script("plot_positions.py", str(sharded), "--out", str(tmp_path / "pictures"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "pictures" / "rope_similarity.png").is_file()


class RunsCode:
    """Unpickling this runs a shell command: what a checkpoint from elsewhere could hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused(trained, tmp_path):
    _, run_dir, last, sharded = trained
    marker = tmp_path / "code-ran"
    checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    bad_file = run_dir / "checkpoints" / "evil.ckpt"
    torch.save({**checkpoint, "extra": RunsCode(marker)}, bad_file)
    with pytest.raises(CheckpointError, match=r"evil.ckpt cannot be read .*loading them could run code"):
        load_run(bad_file)
    proc = script("generate.py", f"ckpt={bad_file}", "prompt=The")
    assert proc.returncode != 0 and "loading them could run code" in proc.stderr
    bad_file.unlink()

    # a distributed checkpoint's index is a plain pickle: the loader admits only the format's own classes
    bad_dir = tmp_path / "evil_dcp"
    shutil.copytree(sharded, bad_dir)
    (bad_dir / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(CheckpointError, match=r"refers to posix.system.*refused"):
        load_checkpoint(bad_dir)
    assert not marker.exists()


class LooksUp:
    """Unpickles as ``getattr(pathlib.Path, "home")``: an attribute lookup that is not an enum member's."""

    def __reduce__(self):
        return (getattr, (Path, "home"))


def test_a_distributed_checkpoint_whose_index_names_enums_by_name_loads(trained, tmp_path):
    """Python 3.11.0-3.11.3 (Debian 12's 3.11.2) pickle an enum member as getattr(its class, its name): a DCP
    index written there holds builtins.getattr for its memory formats. It loads; any other lookup is refused."""
    import enum

    _, _, _, sharded = trained
    copy = tmp_path / "by_name"
    shutil.copytree(sharded, copy)
    metadata = pickle.loads((sharded / ".metadata").read_bytes())

    class EnumsByName(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, enum.Enum):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    buffer = io.BytesIO()
    EnumsByName(buffer).dump(metadata)  # the default protocol, as torch's writer uses
    assert b"getattr" in buffer.getvalue()
    (copy / ".metadata").write_bytes(buffer.getvalue())
    digests.write_digest(copy, digests.compute(copy), digests.read_digest(sharded).step)  # re-sealed
    want, got = load_checkpoint(sharded)["state_dict"], load_checkpoint(copy)["state_dict"]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    (copy / ".metadata").write_bytes(pickle.dumps(LooksUp()))
    digests.write_digest(copy, digests.compute(copy), None)
    with pytest.raises(CheckpointError, match=r"looks up 'home' on <class 'pathlib.Path'>.*refused"):
        load_checkpoint(copy)


def test_a_directory_that_is_not_a_checkpoint_is_named(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointError, match="half is a directory but not a checkpoint"):
        load_checkpoint(tmp_path / "half")
    with pytest.raises(CheckpointError, match="holds no checkpoint .*outputs/runs"):
        load_run(tmp_path)


@pytest.mark.slow
def test_a_checkpoint_sharded_by_fsdp_on_two_processes_gives_the_runs_validation_loss(tmp_path):
    """strategy=fsdp on two CPU processes writes last.ckpt as a directory with one shard per rank; the length
    script reads it in one process, and its loss at 1x on the windows validation used (2 ranks x 2 batches x
    4 windows of 32 + 1 characters, the first 513) is the run's own final val/loss."""
    from conftest import run_train

    run_dir = tmp_path / "fsdp"
    run_train(
        [
            *TINY,
            "tokenizer=char",
            "strategy=fsdp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.max_steps=4",
            "logger=csv",
            "callbacks.sample_generation.max_new_tokens=0",
            f"paths.root_dir={tmp_path}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    last = last_checkpoint(run_dir)
    assert checkpoint_kind(last) == "dcp" and len(list(last.glob("*.distcp"))) == 2
    val = Run(run_dir).result()["metrics"]["val/loss"]
    proc = script("eval_length.py", str(last), "--factors", "1", "--max-tokens", "513", "--no-wandb")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = Run(run_dir).length_result()
    assert result["checkpoint"] == str(last)
    assert result["variants"]["learned"]["1"]["windows"] == 16
    assert result["variants"]["learned"]["1"]["loss"] == pytest.approx(val, abs=1e-4)


def test_a_deepspeed_directory_needs_the_extra_for_its_weights(trained, tmp_path):
    """Lightning's DeepSpeed strategy runs only on CUDA, so its checkpoint directory is laid out here by hand
    as DeepSpeed writes it (``latest`` naming the tag, ``<tag>/mp_rank_00_model_states.pt`` holding
    Lightning's part as client state). Without the deepspeed package the step and config still read (what
    resuming checks), and the weights are refused naming the extra to install."""
    try:
        import deepspeed  # noqa: F401

        pytest.skip("deepspeed is installed: its consolidation needs real ZeRO shards")
    except ImportError:
        pass
    _, _, last, _ = trained
    checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    folder = tmp_path / "last.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    torch.save(
        {"module": checkpoint["state_dict"], **client}, folder / "checkpoint" / "mp_rank_00_model_states.pt"
    )
    assert checkpoint_kind(folder) == "deepspeed"
    meta = load_checkpoint(folder, weights=False)
    assert meta["global_step"] == checkpoint["global_step"] and "model" in meta["hyper_parameters"]
    with pytest.raises(
        CheckpointError,
        match=r"DeepSpeed checkpoint; reading it needs the deepspeed package: pip install -e '.\[deepspeed\]'",
    ):
        load_checkpoint(folder)


DEEPSPEED_WRITER = """
import os, sys, torch
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4])
import deepspeed
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT

source, out, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
checkpoint = torch.load(source, map_location="cpu", weights_only=True)


class Module(torch.nn.Module):  # the LightningModule's shape: the GPT under .model
    def __init__(self):
        super().__init__()
        self.model = GPT(GPTConfig.from_dict(dict(checkpoint["hyper_parameters"]["model"])))


module = Module()
module.load_state_dict(checkpoint["state_dict"])
deepspeed.init_distributed(dist_backend="gloo")
config = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": stage},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}
engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
# as Lightning's DeepSpeedStrategy saves: its own part of the checkpoint as DeepSpeed's client state
client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
engine.save_checkpoint(out, client_state=client, tag="checkpoint")
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_zero_checkpoint_loads_the_same_model(trained, tmp_path, stage):
    """A ZeRO checkpoint directory written by DeepSpeed itself on one CPU process (gloo; Lightning's DeepSpeed
    strategy needs CUDA), with Lightning's part as client state: the loader consolidates the shards with
    DeepSpeed's zero_to_fp32 after reading every file with tensors and DeepSpeed's plain state classes only."""
    pytest.importorskip("deepspeed")
    import socket

    _, _, last, _ = trained
    folder = tmp_path / "last.ckpt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    proc = subprocess.run(
        [sys.executable, "-c", DEEPSPEED_WRITER, str(last), str(folder), str(stage), port],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert checkpoint_kind(folder) == "deepspeed"
    assert load_checkpoint(folder, weights=False)["global_step"] == 8
    a, b = load_run(last).model.state_dict(), load_run(folder).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    greedy = [script("generate.py", f"ckpt={p}", "prompt=The", "max_new_tokens=8") for p in (last, folder)]
    assert greedy[1].returncode == 0, greedy[1].stderr[-2000:]
    assert greedy[0].stdout == greedy[1].stdout
