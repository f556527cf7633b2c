"""A run resumed under changed settings continues correctly and says what changed, or is refused before it
reads a weight or trains a step, naming each change and the fix (gptlab.training.resume_changes)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import CONF, TINY, run_train
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from gptlab.data.corpus import num_windows
from gptlab.data.datamodule import ResumableDistributedSampler, TokenWindows, stateful_loader
from gptlab.errors import CheckpointError
from gptlab.runs.identity import release_run_dir
from gptlab.runs.layout import last_checkpoint
from gptlab.tasks.gpt import run
from gptlab.training.optimizers import lr_factor
from gptlab.training.resume_changes import lr_at

SEED = 1337  # conf/train.yaml's seed: the single-device loader's permutation of the training windows
TEXT = "".join(
    f"Paragraph {i}: the lamp over the desk was warm and the notes were long.\n\n" for i in range(400)
)
# Two steps of 4 windows, a checkpoint at each, every step logged; the character vocabulary keeps it small.
ARGS = [
    *TINY,
    "tokenizer=char",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "optim.warmup_steps=1",
    "callbacks.last_checkpoint.every_n_train_steps=1",
    "logger=csv",
]


def compose_cfg(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=[*ARGS, *overrides])


def train(*overrides: str) -> list[int]:
    """Run ``train.py`` with ``overrides`` in this process; returns the training windows it read, in order."""
    read: list[tuple[int, int]] = []
    original = TokenWindows.__getitem__

    def recording(self, i):
        read.append((len(self), i))
        return original(self, i)

    saved_env = dict(os.environ)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TokenWindows, "__getitem__", recording)
        try:
            run(compose_cfg(*overrides))
        finally:  # a DDP run's process group and environment end with it, as with its process
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            os.environ.clear()
            os.environ.update(saved_env)
    train_windows = max((n for n, _ in read), default=0)  # the validation split is a tenth of the text
    return [i for n, i in read if n == train_windows]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "notes.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, corpus) -> tuple[Path, list[int], list[str]]:
    """A finished 2-step run on ``corpus``, the windows it trained, and the overrides that made it. Shared:
    tests resume a copy."""
    out = tmp_path_factory.mktemp("base")
    data = [f"data.path={corpus}", f"paths.root_dir={tmp_path_factory.mktemp('root')}"]
    windows = train(*data, f"paths.output_dir={out}")
    return out, windows, data


def copy_run(base_run, tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of the base run, and the overrides that resume it."""
    out = tmp_path / "run"
    shutil.copytree(base_run[0], out)
    return out, [*base_run[2], f"paths.output_dir={out}", f"resume={out}"]


def permutation(n: int) -> list[int]:
    """The order in which a single-device run takes its ``n`` training windows in its first epoch."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(SEED)).tolist()


def test_a_larger_batch_continues_the_windows_where_they_stopped_and_is_recorded(base_run, tmp_path, caplog):
    out, resume = copy_run(base_run, tmp_path)
    caplog.set_level("WARNING")
    windows = train(*resume, "data.batch_size=8", "trainer.max_steps=4")
    first = base_run[1]
    assert len(first) == 2 * 4 and len(windows) == 2 * 8
    tokens = torch.load(last_checkpoint(out), weights_only=True)["training_conditions"]["data"]["tokens"]
    n = num_windows(tokens, 33, 32)  # model.block_size + 1 tokens, every 32
    # no window twice, none skipped: the two parts read the single-device permutation's first 24, in order
    assert first + windows == permutation(n)[:24]
    assert (
        "data.batch_size: 4 in the checkpoint, 8 now: the shuffled windows continue where step 2 left them, and "
        "each step from step 3 trains 8 windows (data.batch_size 8 x 1 process(es) x "
        "trainer.accumulate_grad_batches 1) where it trained 4" in caplog.text
    )
    parts = json.loads((out / "result.json").read_text())["parts"]
    assert [p["to_step"] for p in parts] == [2, 4]
    assert parts[1]["changed"] == {
        "data.batch_size": [4, 8],
        "global_batch": [4, 8],
        "trainer.max_steps": [2, 4],
    }
    assert "changed" not in parts[0]


@pytest.mark.parametrize("processes", [[], ["trainer.devices=1", "strategy=ddp", "trainer.accelerator=cpu"]])
def test_a_larger_batch_trains_the_epoch_to_the_end_of_its_order(processes, tmp_path):
    """Lightning counts an epoch's batches on from the checkpoint's: in the old, smaller ones, it would end the
    epoch before its order of the windows, its last windows untrained. One process, or one DDP process (its
    own distributed sampler), in this process."""
    text = tmp_path / "short.txt"
    text.write_text(TEXT[: len(TEXT) // 10])  # about 80 windows: an epoch is some 10 steps of 8
    common = [f"data.path={text}", f"paths.root_dir={tmp_path}", "trainer.limit_val_batches=0", *processes]
    out = tmp_path / "run"
    first = train(*common, f"paths.output_dir={out}")
    release_run_dir(out)
    tokens = torch.load(last_checkpoint(out), weights_only=True)["training_conditions"]["data"]["tokens"]
    n = num_windows(tokens, 33, 32)
    rest = (n - 8) // 8  # whole steps of 8 left in the epoch after the first 8 windows
    second = train(
        *common,
        f"paths.output_dir={out}",
        f"resume={out}",
        "data.batch_size=8",
        f"trainer.max_steps={2 + rest + 1}",
    )
    # the epoch's order to its last whole step, each window once, then one step of the next epoch
    assert first + second[: 8 * rest] == permutation(n)[: 8 + 8 * rest]
    assert len(second) == 8 * (rest + 1)


def test_a_new_learning_rate_and_more_steps_apply_from_the_resumed_step(base_run, tmp_path, caplog):
    out, resume = copy_run(base_run, tmp_path)
    caplog.set_level("WARNING")
    train(*resume, "optim.lr=0.001", "trainer.max_steps=4")
    # the rate of step s is lr x factor(s - 1) of the new schedule: 1e-3, over 4 steps
    rows = [r for r in csv_rows(out / "csv" / "metrics.csv") if r.get("lr")]
    logged = {int(r["step"]): float(r["lr"]) for r in rows}
    for step in (3, 4):
        assert logged[step] == pytest.approx(1e-3 * lr_factor(step - 1, 1, 4, 0.1, "cosine"), rel=1e-6)
    assert logged[1] == pytest.approx(4e-3 * lr_factor(0, 1, 2, 0.1, "cosine"), rel=1e-6)  # the first part's
    saved = torch.load(last_checkpoint(out), weights_only=True)
    assert saved["lr_schedulers"][0]["base_lrs"] == pytest.approx([1e-3, 1e-3])
    assert saved["hyper_parameters"]["optim"]["lr"] == 1e-3
    before, after = 4e-3 * lr_factor(2, 1, 2, 0.1, "cosine"), 1e-3 * lr_factor(2, 1, 4, 0.1, "cosine")
    assert (
        "trainer.max_steps: 2 in the checkpoint, 4 now; optim.lr: 0.004 in the checkpoint, 0.001 now"
        in caplog.text
    )
    assert (
        f"the learning rate of step 3, the first this part trains, is {after:.4g} ({before:.4g} by the"
        in caplog.text
    )
    assert "The run is extended from 2 to 4 steps" in caplog.text
    part = json.loads((out / "result.json").read_text())["parts"][-1]
    assert part["changed"] == {"optim.lr": [0.004, 0.001], "trainer.max_steps": [2, 4]}


def csv_rows(path: Path) -> list[dict[str, str]]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_extending_a_run_moves_a_wsd_decay_and_stretches_a_cosine():
    wsd = {"name": "adamw", "schedule": "wsd", "warmup_steps": 10, "decay_fraction": 0.2, "lr": 1e-3}
    # resumed in the stable phase (step 50 of 100, decay from 80): the longer run's rate, unchanged
    assert lr_at(wsd, 100, 50) == lr_at(wsd, 200, 50) == pytest.approx(1e-3)
    # resumed at the end of the decay: back to the peak, where the longer run is still stable
    assert lr_at(wsd, 100, 100) == pytest.approx(1e-4) and lr_at(wsd, 200, 100) == pytest.approx(1e-3)
    cosine = {"name": "adamw", "warmup_steps": 10, "lr": 1e-3}
    assert lr_at(cosine, 200, 100) > lr_at(cosine, 100, 100) == pytest.approx(1e-4)


REFUSED = {
    "accumulation": (
        ["trainer.accumulate_grad_batches=2"],
        "trainer.accumulate_grad_batches: 1 in the checkpoint, 2 now",
        "Resume with trainer.accumulate_grad_batches=1",
    ),
    "devices": (
        ["trainer.devices=2", "strategy=ddp", "trainer.accelerator=cpu"],
        "the processes: 1 process(es) with no distributed strategy in the checkpoint, 2 process(es) with a "
        "distributed strategy now",
        "Resume with no distributed strategy (trainer.devices=1 strategy=auto)",
    ),
    "loss": (
        ["loss.z_loss=0.0001", "loss.final_softcap=30"],
        "loss.z_loss: 0.0 in the checkpoint, 0.0001 now: the loss trained would change; loss.final_softcap: "
        "null in the checkpoint, 30 now",
        "Resume with loss.z_loss=0.0; loss.final_softcap=null",
    ),
    "optimizer": (["optim=muon"], "optim: adamw in the checkpoint, muon now", "Resume with optim=adamw"),
    "stride": (["data.stride=16"], "data.stride: 32 in the checkpoint, 16 now", "Resume with data.stride=32"),
    "seed": (["seed=7"], "seed: 1337 in the checkpoint, 7 now", "Resume with seed=1337"),
    "workers": (["data.num_workers=1"], "data.num_workers: 0 in the checkpoint, 1 now", "data.num_workers=0"),
    "tokenizer": (
        ["tokenizer=word"],
        "tokenizer: char in the checkpoint, word now: the training tokens would be others",
        "Resume with tokenizer=char",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_change_a_resume_cannot_make_is_refused_before_anything_is_trained(
    case, base_run, tmp_path, caplog
):
    out, resume = copy_run(base_run, tmp_path)
    overrides, what, fix = REFUSED[case]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    caplog.set_level("INFO")
    cache = tmp_path / "cache"  # where a corpus prepared for this command would be tokenized
    with pytest.raises(CheckpointError) as refused:
        train(*resume, *overrides, "trainer.max_steps=4", f"data.cache_dir={cache}")
    # refused before the corpus was prepared: no cache made or opened, no windows cut
    assert not cache.exists()
    assert (
        "Preparing" not in caplog.text
        and "Token cache" not in caplog.text
        and "Windows of" not in caplog.text
    )
    message = str(refused.value)
    assert (
        f"Checkpoint {last_checkpoint(out)} (step 2) cannot be continued as this command asks: {what}"
        in message
    )
    assert fix in message and "the same command without resume=" in message
    release_run_dir(out)  # this process's claim, which the end of a `python train.py` job gives up
    # nothing written but run.json's record of the attempt: no checkpoint, metric or result of the run changed
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    assert after.keys() == before.keys()
    assert [p.name for p, data in before.items() if after[p] != data] == ["run.json"]


def test_a_stream_resumed_on_another_number_of_processes_is_refused(tmp_path):
    """Each process reads its own share of a stream, at its own place: the places of one DDP process cannot be
    shared among two. Refused before any process starts or any text is read."""
    lines = tmp_path / "stream.jsonl"
    lines.write_text(
        "".join(json.dumps({"text": TEXT[i : i + 600]}) + "\n" for i in range(0, len(TEXT), 600))
    )
    common = [
        f"data.path={lines}",
        "data.streaming=true",
        "tokenizer=gpt2",
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path / 'run'}",
        "trainer.accelerator=cpu",
        "strategy=ddp",
    ]
    train(*common, "trainer.devices=1")
    with pytest.raises(CheckpointError) as refused:
        train(*common, "trainer.devices=2", f"resume={tmp_path / 'run'}", "trainer.max_steps=4")
    release_run_dir(tmp_path / "run")
    assert (
        "the processes: 1 in the checkpoint, 2 now (trainer.devices x trainer.num_nodes): a stream is read in one "
        "share per process, each at its own place in it. Resume with 1 process(es) again (e.g. trainer.devices=1)"
        in str(refused.value)
    )


def test_an_edited_corpus_is_refused_naming_the_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text(TEXT)
    common = [f"data.path={text}", f"paths.root_dir={tmp_path}", f"paths.output_dir={tmp_path / 'run'}"]
    train(*common)
    # edited in place, with a character the first text had: the fitted vocabulary changes as well
    text.write_text(TEXT.replace("lamp", "Lamp") + "Zebra.\n")
    with pytest.raises(CheckpointError) as refused:
        train(*common, f"resume={tmp_path / 'run'}", "trainer.max_steps=4")
    message = str(refused.value)
    assert (
        f"the training data differ: local files '{text}' with tokenizer=char (" in message
        and "training tokens) in the checkpoint" in message
    )
    assert "Resume with the training text and tokenizer as they were" in message
    assert "different model" not in message  # the cause is named, not its consequence (the vocabulary)
    # the same text again continues
    text.write_text(TEXT)
    train(*common, f"resume={tmp_path / 'run'}", "trainer.max_steps=3")
    assert torch.load(last_checkpoint(tmp_path / "run"), weights_only=True)["global_step"] == 3


def sampler_position(run_dir: Path) -> int:
    """Where in the epoch's permutation of the windows the ranks of a run had reached together, as its last
    checkpoint's loader state holds it (a distributed sampler's ``start + num_replicas x yielded``)."""

    def find(node):
        if isinstance(node, dict):
            if {"start", "num_replicas", "yielded"} <= node.keys():
                return node
            node = list(node.values())
        if isinstance(node, list):
            return next((found for v in node if (found := find(v)) is not None), None)
        return None

    loops = torch.load(last_checkpoint(run_dir), weights_only=True)["loops"]
    state = find(loops)
    assert state is not None, "no distributed sampler's position in the checkpoint"
    return int(state["start"]) + int(state["num_replicas"]) * int(state["yielded"])


@pytest.mark.slow
def test_a_ddp_run_goes_on_on_two_processes_or_on_one_as_if_never_stopped_and_without_ddp_is_refused(
    tmp_path,
):
    # min_lr_ratio=1: the rate is flat after the warmup, so a run of 2 steps extended to 4 and a run of 4
    # steps follow the same schedule, and their weights can be compared. The last checkpoint is written when
    # training ends, as with the defaults (every 50 steps): Lightning then counts its epoch as ended.
    common = [
        *(a for a in ARGS if not a.startswith("callbacks.last_checkpoint.")),
        "logger=none",
        "trainer.accelerator=cpu",
        "optim.min_lr_ratio=1.0",
        f"paths.root_dir={tmp_path}",
    ]
    ddp = ["trainer.devices=2", "strategy=ddp"]
    run_dir = tmp_path / "ddp"
    run_train([*common, *ddp, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    ckpt = last_checkpoint(run_dir)
    saved = ckpt.read_bytes()
    on_one = tmp_path / "on-one"
    shutil.copytree(run_dir, on_one)
    # One process without a distributed strategy orders the windows otherwise: refused, before any data
    cache = tmp_path / "new-cache"
    proc = run_train(
        [*common, "trainer.max_steps=4", f"resume={run_dir}", f"data.cache_dir={cache}"],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        "gptlab: error: Checkpoint " in proc.stderr
        and "the processes: 2 process(es) with a distributed strategy in the checkpoint, 1 process(es) with no "
        "distributed strategy now"
        in proc.stderr
        and "Resume with a distributed strategy again, on any number of processes (e.g. strategy=ddp "
        "trainer.devices=2; trainer.devices=1 strategy=ddp continues it on one process)"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr and "Training:" not in proc.stdout
    assert not cache.exists() and "Token cache" not in proc.stdout + proc.stderr
    assert ckpt.read_bytes() == saved
    # Trained longer from its final checkpoint (whose epoch Lightning counts as ended) on the same two
    # processes: each rank continues its share of the same shuffled windows, and the weights end as those of
    # the 4-step run never stopped, bit for bit.
    run_train([*common, *ddp, "trainer.max_steps=4", f"resume={run_dir}"], cwd=tmp_path)
    reference = tmp_path / "reference"
    run_train([*common, *ddp, "trainer.max_steps=4", f"hydra.run.dir={reference}"], cwd=tmp_path)
    resumed, uninterrupted = (
        torch.load(last_checkpoint(d), weights_only=True)["state_dict"] for d in (run_dir, reference)
    )
    assert [k for k in resumed if not torch.equal(resumed[k], uninterrupted[k])] == []
    # The same checkpoint on one DDP process with twice the batch (the same 8 windows a step): the one process
    # takes the rest of the permutation from where the two left it, so steps 3 and 4 train the windows the
    # two processes train in the run never stopped; the weights and the validation loss agree to rounding
    # (one mean of 8 windows' gradients against the average of two means of 4).
    proc = run_train(
        [
            *common,
            "trainer.devices=1",
            "strategy=ddp",
            "data.batch_size=8",
            "trainer.max_steps=4",
            f"resume={on_one}",
        ],
        cwd=tmp_path,
    )
    assert (
        "the processes: 2 in the checkpoint, 1 now (trainer.devices x trainer.num_nodes): the shuffled windows "
        "continue where the 2 left them at step 2, the one process taking the rest of the epoch's order (none "
        "twice, none skipped), and each step from step 3 trains 8 windows (data.batch_size 8 x 1 process(es) x "
        "trainer.accumulate_grad_batches 1), the global batch it trained before." in proc.stdout + proc.stderr
    )
    assert sampler_position(on_one) == sampler_position(reference) == 4 * 8
    one = torch.load(last_checkpoint(on_one), weights_only=True)["state_dict"]
    worst = max((one[k] - uninterrupted[k]).abs().max().item() for k in one)
    assert worst < 1e-5, worst  # 3e-7 here; a step on other windows moves weights by about optim.lr, 4e-3
    results = [json.loads((d / "result.json").read_text()) for d in (on_one, reference)]
    assert results[0]["metrics"]["val/loss"] == pytest.approx(results[1]["metrics"]["val/loss"], abs=1e-5)
    assert results[0]["parts"][-1]["changed"] == {
        "data.batch_size": [4, 8],
        "processes": [2, 1],
        "trainer.max_steps": [2, 4],
    }


def test_a_distributed_sampler_continues_the_permutation_it_saved_whatever_epoch_lightning_counts():
    """The order Lightning follows on resume: ``set_epoch`` with its own count (one more after a final
    checkpoint), then the loader state, then the first window."""
    windows = list(range(100))

    def sampler() -> ResumableDistributedSampler:
        return ResumableDistributedSampler(
            windows, num_replicas=2, rank=1, shuffle=True, seed=5, drop_last=True
        )

    def epoch(n: int) -> list[int]:
        never_stopped = sampler()
        never_stopped.set_epoch(n)
        return list(never_stopped)

    first = sampler()
    first.set_epoch(0)
    it = iter(first)
    seen = [next(it) for _ in range(10)]
    resumed = sampler()
    resumed.set_epoch(1)  # Lightning counts the epoch of the final checkpoint as ended
    resumed.load_state_dict(first.state_dict())
    assert seen + list(resumed) == epoch(0)  # the rest of the saved permutation: none twice, none skipped
    resumed.set_epoch(2)  # Lightning's next epoch: the permutation the run never stopped draws next
    assert list(resumed) == epoch(1)
    assert resumed.state_dict()["epoch"] == 1


def test_a_distributed_sampler_position_is_carried_to_another_number_of_processes():
    """Two ranks save their loaders' positions after 3 batches of 4; three ranks, then one, go on from the
    position they reached together: the windows the ranks read, step by step, are the epoch's permutation in
    order, none twice, none skipped, and the next epoch is the new number of ranks' own."""
    n, seed = 101, 5
    windows = list(range(n))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()

    def loaders(replicas: int, batch: int) -> list:
        return [
            stateful_loader(
                windows,
                batch_size=batch,
                drop_last=True,
                sampler=ResumableDistributedSampler(
                    windows, num_replicas=replicas, rank=r, shuffle=True, seed=seed, drop_last=True
                ),
            )
            for r in range(replicas)
        ]

    def steps(ranks: list, count: int | None) -> list[list[int]]:
        """``count`` steps (None: to the epoch's end) of every rank, each step's windows ranked by position."""
        its = [iter(loader) for loader in ranks]
        trained = []
        while count is None or len(trained) < count:
            try:
                batch = [w for it in its for w in next(it).tolist()]
            except StopIteration:
                break
            trained.append(sorted(batch, key=order.index))
        return trained

    two = loaders(2, 4)
    first = steps(two, 3)
    three = loaders(3, 4)
    for loader in three:
        loader.load_state_dict(two[0].state_dict())  # rank 0's position, as a checkpoint holds it
    second = steps(three, 2)
    one = loaders(1, 12)
    one[0].load_state_dict(three[0].state_dict())
    third = steps(one, None)
    assert [w for step in first + second + third for w in step] == order[: 24 + 24 + 12 * ((n - 48) // 12)]
    assert [len(step) for step in first + second + third] == [8] * 3 + [12] * 2 + [12] * ((n - 48) // 12)
    # the next epoch, as one process draws it (torch's sampler, seed + 1)
    one[0].sampler.set_epoch(1)
    reference = torch.utils.data.DistributedSampler(
        windows, num_replicas=1, rank=0, seed=seed, drop_last=True
    )
    reference.set_epoch(1)
    assert [w for b in one[0] for w in b.tolist()] == list(reference)[: 12 * (n // 12)]


# Every key that shapes the model, each refused by name with the checkpoint's value as the fix (model.n_embd
# in docs/bad-input.md; the model's options in GPTConfig, the variants' in their own nodes).
ARCHITECTURE = {
    "model.n_layer=2": ("model.n_layer: 1 in the checkpoint, 2 now", "model.n_layer=1"),
    "model.n_head=4": ("model.n_head: 2 in the checkpoint, 4 now", "model.n_head=2"),
    "model.n_embd=64": ("model.n_embd: 32 in the checkpoint, 64 now", "model.n_embd=32"),
    "model.block_size=64": ("model.block_size: 32 in the checkpoint, 64 now", "model.block_size=32"),
    "model.n_kv_head=1": ("model.n_kv_head: None in the checkpoint, 1 now", "model.n_kv_head=null"),
    "model.bias=false": ("model.bias: True in the checkpoint, False now", "model.bias=True"),
    "model.tie_weights=false": (
        "model.tie_weights: True in the checkpoint, False now",
        "model.tie_weights=True",
    ),
    "model.mlp_ratio=2": ("model.mlp_ratio: None in the checkpoint, 2", "model.mlp_ratio=null"),
    "model.param=mup": ("model.param: 'standard' in the checkpoint, 'mup' now", "model.param=standard"),
    "pos=rope": ("pos: 'learned' in the checkpoint, 'rope' now", "pos=learned"),
    "activation=swiglu": ("activation: 'gelu' in the checkpoint, 'swiglu' now", "activation=gelu"),
    "norm=rmsnorm": ("norm: 'layernorm' in the checkpoint, 'rmsnorm' now", "norm=layernorm"),
    "norm.placement=post": ("norm.placement: 'pre' in the checkpoint, 'post' now", "norm.placement=pre"),
    "attention.qk_norm=rmsnorm": (
        "attention.qk_norm: 'none' in the checkpoint, 'rmsnorm' now",
        "attention.qk_norm=none",
    ),
    "attention.window=16": ("attention.window: None in the checkpoint, 16 now", "attention.window=null"),
    "attention.logit_softcap=50": (
        "attention.logit_softcap: None in the checkpoint, 50",
        "attention.logit_softcap=null",
    ),
}


@pytest.mark.parametrize("override", sorted(ARCHITECTURE))
def test_every_key_that_shapes_the_model_is_refused_by_name(override, base_run, tmp_path):
    out, resume = copy_run(base_run, tmp_path)
    what, fix = ARCHITECTURE[override]
    cache = tmp_path / "cache"
    with pytest.raises(CheckpointError) as refused:
        train(*resume, override, "trainer.max_steps=4", f"data.cache_dir={cache}")
    release_run_dir(out)
    assert (
        not cache.exists()
    )  # refused before the corpus was prepared (a fitted vocabulary is compared after)
    message = str(refused.value)
    assert f"Checkpoint {last_checkpoint(out)} is from a different model: " in message
    assert what in message and fix in message, message
