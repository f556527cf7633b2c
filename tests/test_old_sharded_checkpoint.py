"""A distributed checkpoint (strategy=fsdp, one shard per rank) saved before the vocabulary padding resumes on
the same trajectory the old code gave, and loads for generation, its token table padded as it loads.

``tests/data/085de4e_fsdp_char/`` was written at commit 085de4e (before ``model.vocab_multiple``; the char
vocabulary of ``corpus.txt`` beside it, 89 rows, stored as 128 now); see tests/data/README.md for the command.
``losses.json`` holds that run's own losses after the checkpoint's step 4 (the old code, resumed from this
checkpoint, gave the same numbers to the last bit).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_train

from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.runs.checkpoints import dcp_tensor_sizes, load_checkpoint, model_config_dict, model_weights
from gptlab.runs.layout import checkpoint_kind, last_checkpoint
from gptlab.runs.trained import load_run

OLD_RUN = Path(__file__).parent / "data" / "085de4e_fsdp_char"
OLD = OLD_RUN / "best-step000004-val3.741.ckpt"
VOCAB, STORED = 89, 128
ARGS = [  # the command that wrote it, less its directories
    "model=tiny",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "data.batch_size=4",
    "trainer.max_steps=8",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=2",
    "tokenizer=char",
    "strategy=fsdp",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "callbacks.sample_generation.max_new_tokens=0",
    "trainer.log_every_n_steps=1",
    "callbacks.model_checkpoint.save_top_k=-1",
    "logger=csv",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
    # a text of the repository's own (its README at 085de4e), not the embedded corpus: Python's pydoc topics
    # differ between Python releases, and the resume refuses other training tokens
    f"data.path={OLD_RUN / 'corpus.txt'}",
]


def test_the_old_sharded_checkpoint_holds_the_vocabularys_rows():
    assert checkpoint_kind(OLD) == "dcp" and sorted(p.name for p in OLD.glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    sizes = dcp_tensor_sizes(OLD)
    assert sizes["state_dict.model.transformer.wte.weight"] == (VOCAB, 32)
    assert sizes["optimizer_0.state.model.transformer.wte.weight.exp_avg"] == (VOCAB, 32)


def test_an_old_sharded_checkpoint_loads_padded_and_generates_as_the_unpadded_model():
    trained = load_run(OLD)
    model = trained.model
    assert model.config.vocab_size == VOCAB and model.transformer.wte.weight.shape == (STORED, 32)
    assert not model.transformer.wte.weight[VOCAB:].any() and not model.lm_head.weight[VOCAB:].any()
    checkpoint = load_checkpoint(OLD)
    values = model_config_dict(checkpoint, OLD)
    assert "vocab_multiple" not in values  # written before the option existed
    unpadded = GPT(GPTConfig.from_dict({**values, "vocab_multiple": 1}))
    unpadded.load_state_dict(model_weights(checkpoint, OLD))
    unpadded.eval()
    assert unpadded.transformer.wte.weight.shape == (VOCAB, 32)
    prompt = torch.tensor([trained.tokenizer.encode("def ")])
    with torch.no_grad():
        torch.testing.assert_close(model(prompt)[0][..., :VOCAB], unpadded(prompt)[0], rtol=0, atol=1e-6)
    outputs = [
        m.generate(prompt, 16, temperature=1.0, generator=torch.Generator().manual_seed(0))
        for m in (unpadded, model)
    ]
    assert torch.equal(outputs[0], outputs[1]) and int(outputs[1].max()) < VOCAB


def optimizer_moments(checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The token table's optimizer moments in a distributed checkpoint, as torch's own converter reads them."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    converted = tmp_path / "converted.pt"
    dcp_to_torch_save(checkpoint, converted)
    state = torch.load(converted, weights_only=True)
    return state["optimizer_0"]["state"]["model.transformer.wte.weight"]


@pytest.mark.slow
def test_an_old_sharded_checkpoint_resumes_on_two_ranks_on_the_old_codes_trajectory(tmp_path):
    old = tmp_path / "old" / OLD.name
    old.parent.mkdir()
    shutil.copytree(OLD, old)
    shutil.copy(OLD_RUN / f"{OLD.name}.sha256", old.parent)
    run_dir = tmp_path / "resumed"
    proc = run_train(
        [*ARGS, f"paths.root_dir={tmp_path}", f"hydra.run.dir={run_dir}", f"resume={old}"],
        cwd=tmp_path,
        env={"OMP_NUM_THREADS": "1"},
    )
    out = proc.stdout + proc.stderr
    assert "Restored all states from the checkpoint" in out and "without verifying" not in out
    import csv

    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    train = {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}
    val = {int(r["step"]): float(r["val/loss"]) for r in rows if r.get("val/loss")}
    expected = json.loads((OLD_RUN / "losses.json").read_text())
    # the steps after the fourth, as the old code trained them from this checkpoint (weights, moments, data
    # position and random state all restored; the padding rows change no number)
    assert train == pytest.approx({int(s): v for s, v in expected["train/loss"].items()}, rel=1e-6, abs=0)
    assert val[8] == pytest.approx(expected["val/loss"]["8"], rel=1e-6, abs=0)

    # saved as today's: the padded rows, zero after four more steps, and so are their moments (no gradient
    # reached them); the vocabulary's rows trained on
    last = last_checkpoint(run_dir)
    weights = load_checkpoint(last)["state_dict"]
    for name in ("model.transformer.wte.weight", "model.lm_head.weight"):
        assert weights[name].shape == (STORED, 32) and not weights[name][VOCAB:].any(), name
    moments = optimizer_moments(last, tmp_path)
    assert moments["exp_avg"].shape == (STORED, 32)
    assert not moments["exp_avg"][VOCAB:].any() and not moments["exp_avg_sq"][VOCAB:].any()
    assert moments["exp_avg_sq"][:VOCAB].any()
    old_weights = load_checkpoint(old)["state_dict"]["model.transformer.wte.weight"]
    assert not torch.equal(weights["model.transformer.wte.weight"][:VOCAB], old_weights)


OLD_FILE = (
    Path(__file__).parent / "data" / "e9c3ad3_rope_rmsnorm_swiglu.ckpt"
)  # a single file, before the padding
OLD_FILE_ARGS = [
    "model=tiny",
    "model.n_embd=32",
    "model.n_head=2",
    "model.n_layer=1",
    "model.block_size=32",
    "tokenizer=char",
    "pos=rope",
    "norm=rmsnorm",
    "activation=swiglu",
]


def test_an_old_deepspeed_checkpoint_is_refused_before_training_with_the_multiple_it_was_saved_with(
    tmp_path, make_cfg
):
    """Lightning's DeepSpeed strategy runs only on CUDA, so the directory is laid out as DeepSpeed writes it
    (``latest`` naming the tag, Lightning's part as client state), from the single-file checkpoint saved before
    the padding. DeepSpeed would restore its flat optimizer partitions as saved: the resume is refused while it
    is planned, naming model.vocab_multiple=1, which it accepts, as it accepts the file under either multiple."""
    from gptlab.api import build_model_config, build_tokenizer
    from gptlab.errors import CheckpointError
    from gptlab.runs.resume import plan_resume

    checkpoint = torch.load(OLD_FILE, map_location="cpu", weights_only=True)
    folder = tmp_path / "last.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    torch.save(
        {"module": checkpoint["state_dict"], **client}, folder / "checkpoint" / "mp_rank_00_model_states.pt"
    )
    assert checkpoint_kind(folder) == "deepspeed"

    def model_config(*overrides: str):
        cfg = make_cfg(*OLD_FILE_ARGS, *overrides)
        return build_model_config(cfg, build_tokenizer(cfg))

    vocab = checkpoint["state_dict"]["model.transformer.wte.weight"].size(0)
    padded = model_config().padded_vocab_size
    assert padded > vocab
    with pytest.raises(CheckpointError) as refused:
        plan_resume(folder, model_config())
    assert str(refused.value) == (
        f"Checkpoint {folder} is a DeepSpeed checkpoint saved before model.vocab_multiple: its token table and "
        f"output layer hold the vocabulary's {vocab} rows, and DeepSpeed restores its optimizer's flat "
        f"partitions as they were saved, so they cannot be padded to {padded} rows as they load "
        "(model.vocab_multiple=64). Resume it with model.vocab_multiple=1 (the rows it was saved with); "
        "generation and evaluation read it as it is."
    )
    plan = plan_resume(folder, model_config("model.vocab_multiple=1"))
    assert plan is not None and plan.global_step == checkpoint["global_step"]
    for multiple in ("64", "1"):  # the file: padded as it loads, or as it was saved
        assert plan_resume(OLD_FILE, model_config(f"model.vocab_multiple={multiple}")) is not None
