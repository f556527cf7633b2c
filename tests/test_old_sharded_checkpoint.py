"""A distributed checkpoint (strategy=fsdp, one shard per rank) saved before the vocabulary padding resumes on
the same trajectory the old code gave, and loads for generation, its token table padded as it loads.

``tests/data/085de4e_fsdp_char/`` was written at commit 085de4e (before ``model.vocab_multiple``; the char
vocabulary of the default corpus, 104 rows, stored as 128 now); see tests/data/README.md for the command.
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
OLD = OLD_RUN / "best-step000004-val3.813.ckpt"
VOCAB, STORED = 104, 128
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
