"""The parts of a run from a composed config, for notebooks and scripts. Each reads its nodes through the
typed config tree (:mod:`gptlab.config`), so a part built here is the part ``python train.py`` trains.

    from hydra import compose, initialize_config_dir
    import gptlab
    with initialize_config_dir(str(gptlab.CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["model=tiny", "pos=sinusoidal"])
    model = gptlab.build_model(cfg)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig

from gptlab.config import check_context, parse_model, parse_tokenizer, plain
from gptlab.data import corpus, tokenizers
from gptlab.data.datamodule import GPTDataModule
from gptlab.data.sources import parse_data
from gptlab.errors import ConfigError
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT


def data_spec(data: Any) -> corpus.DataSpec:
    """The corpus spec from the ``data`` node (the whole config is accepted too)."""
    if isinstance(data, DictConfig) and "data" in data and "model" in data:
        data = data.data
    return parse_data(data)[0]


def build_tokenizer(node: Any, data: Any = None) -> tokenizers.Tokenizer:
    """The tokenizer of the ``tokenizer`` node (or of the whole config). One with a fixed vocabulary is
    built at once; one that learns its vocabulary (``fitted``) is a product of preparing the corpus of the
    ``data`` node, taken from the token cache. A training run takes it from its datamodule instead."""
    if isinstance(node, DictConfig) and "tokenizer" in node:
        node, data = node.tokenizer, node.get("data") if data is None else data
    values = parse_tokenizer(node)
    cls = tokenizers.TOKENIZERS.get(values["name"])
    if not cls.fitted:
        return cls.create(tokenizers.options_of(values["name"], values))
    if data is None:
        raise ConfigError(
            f"tokenizer={values['name']} learns its vocabulary from a corpus: pass the data node."
        )
    return corpus.prepare(data_spec(data), values).tokenizer


def build_model_config(cfg: DictConfig, tokenizer: tokenizers.Tokenizer | None = None) -> GPTConfig:
    """The GPTConfig of a composed config; ``model.vocab_size: null`` takes the tokenizer's size (built here
    when not given)."""
    config, from_tokenizer, _ = parse_model(cfg)
    if from_tokenizer:
        tokenizer = tokenizer or build_tokenizer(cfg)
        return dataclasses.replace(config, vocab_size=tokenizer.vocab_size)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(
            f"tokenizer={tokenizer.name} has {tokenizer.vocab_size} ids but model.vocab_size="
            f"{config.vocab_size}: the embedding table has no row for the larger ids. Set "
            f"model.vocab_size={tokenizer.vocab_size} or larger, or null to take the tokenizer's size."
        )
    return config


def build_model(cfg: DictConfig, tokenizer: tokenizers.Tokenizer | None = None) -> GPT:
    """The model of a composed config, with ``model.init_from``'s weights when set, capping its logits where
    ``loss.final_softcap`` says so."""
    model = GPT(build_model_config(cfg, tokenizer))
    model.final_softcap = (plain(cfg.get("loss")) or {}).get("final_softcap")
    source = plain(cfg.model).get("init_from")
    if source:
        from gptlab.model.hf import load_pretrained

        load_pretrained(model, source)
    return model


def build_datamodule(cfg: DictConfig) -> GPTDataModule:
    spec, loader = parse_data(cfg.data)
    model, _, _ = parse_model(cfg)
    return GPTDataModule(
        spec=spec,
        tokenizer=parse_tokenizer(cfg.tokenizer),
        block_size=check_context(model, loader),
        batch_size=loader.batch_size,
        stride=loader.stride,
        val_stride=loader.val_stride,
        num_workers=loader.num_workers,
        document_mask=loader.document_mask,
        seed=cfg.seed,
    )
