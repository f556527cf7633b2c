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
    assert model.config.pos.name == "sinusoidal" and model.config.vocab_size == tok.vocab_size
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


def test_any_family_gets_typed_options_from_the_registry():
    """The mechanism the variant families share: a registered class's Options dataclass, built and checked
    from a config node by `Registry.build_options`."""
    from dataclasses import dataclass
    from typing import Literal

    from gptlab.errors import ConfigError
    from gptlab.registry import NoOptions, Registry

    family = Registry("widget", "widget")

    @family.register("plain")
    class Plain:
        """Takes no options."""

    @family.register("tuned")
    class Tuned:
        @dataclass(frozen=True)
        class Options:
            size: int = 3
            rate: float = 0.5
            mode: Literal["fast", "exact"] = "fast"
            limit: int | None = None

    assert family.build_options("plain", {"name": "plain"}) == NoOptions()
    assert family.build_options("tuned", {"name": "tuned", "rate": 1, "limit": 7}) == Tuned.Options(
        3, 1.0, "fast", 7
    )
    assert family.names() == ["plain", "tuned"] and "tuned" in family
    with pytest.raises(
        ConfigError, match=r"widget=plain does not take option\(s\) widget.size. Its options: none"
    ):
        family.build_options("plain", {"size": 2})
    with pytest.raises(ConfigError, match=r"widget.mode='slow' must be one of 'fast', 'exact' \(got str\)"):
        family.build_options("tuned", {"mode": "slow"})
    with pytest.raises(ConfigError, match=r"widget.limit='7' must be an integer or null \(got str\)"):
        family.build_options("tuned", {"limit": "7"})
    with pytest.raises(ConfigError, match=r"widget.size=True must be an integer \(got bool\)"):
        family.build_options("tuned", {"size": True})
    with pytest.raises(ConfigError, match=r"Did you mean widget.rate\?"):
        family.build_options("tuned", {"rates": 1.0})
    with pytest.raises(ConfigError, match=r"Unknown widget 'tune'.*Did you mean widget=tuned\?"):
        family.build_options("tune", {})
