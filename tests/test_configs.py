"""Every YAML under conf/ composes, and the parts build from a composed config."""

from pathlib import Path

import pytest
import torch
from conftest import CONF
from hydra.utils import instantiate

import gptlab

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in ("hydra",))


def choices():
    for group in GROUPS:
        for yaml in sorted((CONF / group).glob("*.yaml")):
            yield group, yaml.stem


@pytest.mark.parametrize("group,choice", list(choices()))
def test_every_yaml_composes(make_cfg, group, choice):
    cfg = make_cfg(f"{group}={choice}")
    assert cfg.seed is not None
    for name in ("callbacks", "logger"):
        for _key, node in (cfg.get(name) or {}).items():
            if node and "_target_" in node:
                target = node["_target_"]
                module, _, attr = target.rpartition(".")
                assert hasattr(__import__(module, fromlist=[attr]), attr), f"{group}={choice}: {target}"


def test_model_presets_build_on_the_meta_device(make_cfg):
    for preset in sorted(p.stem for p in (CONF / "model").glob("*.yaml")):
        cfg = make_cfg(f"model={preset}")
        with torch.device("meta"):
            model = gptlab.build_model(cfg)
        assert model.parameter_counts()["total"] > 0
    with torch.device("meta"):
        gpt2 = gptlab.build_model(make_cfg("model=gpt2"))
    assert gpt2.parameter_counts()["total"] == 124_439_808


def test_the_parts_build_from_python(make_cfg):
    cfg = make_cfg("model=tiny", "pos=sinusoidal", "activation=relu")
    tok = gptlab.build_tokenizer(cfg)
    model = gptlab.build_model(cfg, tok)
    assert model.config.pos == "sinusoidal" and model.config.vocab_size == tok.vocab_size
    dm = gptlab.build_datamodule(cfg)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (cfg.data.batch_size, cfg.model.block_size)
    assert torch.equal(x[:, 1:], y[:, :-1])
    _, loss = model(x, y)
    assert (
        abs(loss.item() - torch.log(torch.tensor(50257.0)).item()) < 1.0
    )  # an untrained model is near uniform


def test_word_tokenizer_sizes_the_model(make_cfg):
    cfg = make_cfg("tokenizer=word")
    tok = gptlab.build_tokenizer(cfg)
    assert 1000 < tok.vocab_size < 50257
    assert gptlab.build_model_config(cfg).vocab_size == tok.vocab_size


def test_logger_factories_instantiate(make_cfg, tmp_path):
    cfg = make_cfg("logger=csv", f"paths.output_dir={tmp_path}")
    logger = instantiate(cfg.logger.csv)
    assert Path(logger.log_dir).parent == tmp_path / "csv" or Path(logger.log_dir) == tmp_path / "csv"
