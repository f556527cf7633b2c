"""A checkpoint written by an earlier version of gptlab resumes, or is refused with the overrides that match it.

``tests/data/e9c3ad3_rope_rmsnorm_swiglu.ckpt`` was written by ``train.py`` at commit e9c3ad3, before the
variants' options were typed per family (its ``hyper_parameters["model"]`` holds ``pos`` + ``pos_options``,
``norm_eps``, ``norm_bias``), by:

    python train.py model=tiny model.n_embd=32 model.n_head=2 model.n_layer=1 model.block_size=32 \
        tokenizer=char pos=rope norm=rmsnorm activation=swiglu trainer.max_steps=4 \
        trainer.val_check_interval=2 logger=csv data.batch_size=4 hydra.run.dir=<dir>
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from conftest import run_train

from gptlab.model.config import GPTConfig
from gptlab.runs import digests
from gptlab.runs.checkpoints import load_checkpoint, model_config_dict
from gptlab.runs.layout import last_checkpoint

OLD = Path(__file__).parent / "data" / "e9c3ad3_rope_rmsnorm_swiglu.ckpt"
ARGS = [
    "model=tiny",
    "model.n_embd=32",
    "model.n_head=2",
    "model.n_layer=1",
    "model.block_size=32",
    "tokenizer=char",
    "pos=rope",
    "norm=rmsnorm",
    "activation=swiglu",
    "trainer.val_check_interval=2",
    "logger=csv",
    "data.batch_size=4",
]


def test_the_old_model_config_reads_as_todays_choices():
    config = GPTConfig.from_dict(model_config_dict(load_checkpoint(OLD, weights=False), OLD))
    assert config.pos.name == "rope" and config.pos.options.base == 10000.0
    assert config.norm.name == "rmsnorm" and config.norm.options.eps == 1e-5
    assert config.activation.name == "swiglu" and config.n_embd == 32


def test_an_old_checkpoint_resumes_and_a_mismatch_is_refused_with_its_overrides(tmp_path):
    ckpt = tmp_path / "old.ckpt"
    shutil.copy(OLD, ckpt)
    refused = run_train(
        [*ARGS, "pos.base=500", f"resume={ckpt}", f"hydra.run.dir={tmp_path / 'a'}"], tmp_path, check=False
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "pos.base: 10000.0 in the checkpoint, 500.0 now" in refused.stderr
    assert "(pos.base=10000.0)" in refused.stderr and "Traceback" not in refused.stderr

    run = tmp_path / "b"
    done = run_train([*ARGS, "trainer.max_steps=6", f"resume={ckpt}", f"hydra.run.dir={run}"], tmp_path)
    assert "Resuming from" in done.stdout + done.stderr
    assert (done.stdout + done.stderr).count("loaded without verifying its bytes") == 1
    result = json.loads((run / "result.json").read_text())
    assert result["finished"] and result["global_step"] == 6
    new = torch.load(last_checkpoint(run), map_location="cpu", weights_only=False)
    assert new["hyper_parameters"]["model"]["pos"] == GPTConfig(pos="rope").pos.node()  # saved as today's
    assert digests.check(last_checkpoint(run)).verified  # written with its digest


def test_a_checkpoint_without_a_digest_loads_with_one_line_saying_it_was_not_verified(caplog):
    assert not digests.digest_path(OLD).exists()  # written before gptlab wrote digests
    with caplog.at_level(logging.INFO):
        checkpoint = load_checkpoint(OLD)
    assert checkpoint["global_step"] == 4 and checkpoint["state_dict"]
    assert [r.getMessage() for r in caplog.records if "digest" in r.getMessage()] == [
        f"Checkpoint {OLD} has no digest ({OLD.name}.sha256): loaded without verifying its bytes (written by "
        "a gptlab that wrote no digests, or by a save stopped before its digest)."
    ]
