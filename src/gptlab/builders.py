"""Build the parts of a run from a composed config. Each builder reads only its own part of the config.

From a notebook::

    from hydra import compose, initialize_config_dir
    import gptlab
    with initialize_config_dir(str(gptlab.CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["model=tiny", "pos=sinusoidal"])
    model = gptlab.build_model(cfg)
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from gptlab.data import corpus, tokenizers
from gptlab.data.datamodule import GPTDataModule
from gptlab.errors import ConfigError
from gptlab.model import positional
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.registry import check_keys

# Keys of the data node that describe the corpus (the rest are loader settings).
_SPEC_KEYS = {
    "builtin",
    "path",
    "name",
    "config_name",
    "split",
    "revision",
    "text_field",
    "val_fraction",
    "split_seed",
    "num_proc",
    "cache_dir",
    "max_tokens",
    "streaming",
    "val_tokens",
}
_LOADER_KEYS = {"batch_size", "block_size", "stride", "val_stride", "num_workers"}


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def data_spec(data: Any) -> corpus.DataSpec:
    """The corpus spec from the ``data`` node (the whole config is accepted too)."""
    if isinstance(data, DictConfig) and "data" in data and "model" in data:
        data = data.data
    data = _plain(data)
    check_keys(data, sorted(_SPEC_KEYS | _LOADER_KEYS), "data", "data")
    return corpus.DataSpec(**{k: v for k, v in data.items() if k in _SPEC_KEYS})


def build_tokenizer(node: Any, data: Any = None) -> tokenizers.Tokenizer:
    """The tokenizer of the ``tokenizer`` node (or of the whole config). One with a fixed vocabulary is
    built at once; one that learns its vocabulary (``fitted``) is a product of preparing the corpus of the
    ``data`` node, taken from the token cache. A training run takes it from its datamodule instead."""
    if isinstance(node, DictConfig) and "tokenizer" in node:
        node, data = node.tokenizer, node.get("data") if data is None else data
    values = _plain(node)
    cls = tokenizers.TOKENIZERS.get(values["name"])
    options = tokenizers.options_of(values["name"], values)
    if not cls.fitted:
        return cls.create(options)
    if data is None:
        raise ConfigError(
            f"tokenizer={values['name']} learns its vocabulary from a corpus: pass the data node."
        )
    return corpus.prepare(data_spec(data), values).tokenizer


def model_config_from_nodes(
    model: Any, pos: Any, activation: Any, norm: Any, tokenizer: tokenizers.Tokenizer | None = None
) -> GPTConfig:
    """The GPTConfig of the ``model``, ``pos``, ``activation`` and ``norm`` config nodes; ``tokenizer`` sizes
    the vocabulary when ``model.vocab_size`` is null. Every variant name and option is checked here."""
    values = dict(_plain(model))
    values.pop("init_from", None)  # weights to start from, not part of the architecture
    if values.get("vocab_size") is None:
        if tokenizer is None:
            raise ConfigError("model.vocab_size=null takes the tokenizer's size, but no tokenizer was given.")
        values["vocab_size"] = tokenizer.vocab_size
    elif tokenizer is not None and tokenizer.vocab_size > values["vocab_size"]:
        raise ConfigError(
            f"tokenizer={tokenizer.name} has {tokenizer.vocab_size} ids but model.vocab_size="
            f"{values['vocab_size']}: the embedding table has no row for the larger ids. Set "
            f"model.vocab_size={tokenizer.vocab_size} or larger, or null to take the tokenizer's size."
        )
    return GPTConfig.from_nodes(values, _plain(pos), _plain(activation), _plain(norm))


def build_model_config(cfg: DictConfig, tokenizer: tokenizers.Tokenizer | None = None) -> GPTConfig:
    """``model_config_from_nodes`` for a whole composed config (it builds the tokenizer when the vocabulary
    size comes from it)."""
    if cfg.model.get("vocab_size") is None and tokenizer is None:
        tokenizer = build_tokenizer(cfg)
    return model_config_from_nodes(cfg.model, cfg.pos, cfg.activation, cfg.norm, tokenizer)


def build_model(cfg: DictConfig, tokenizer: tokenizers.Tokenizer | None = None) -> GPT:
    return load_initial_weights(cfg, GPT(build_model_config(cfg, tokenizer)))


def load_initial_weights(cfg: DictConfig, model: GPT) -> GPT:
    """Load ``model.init_from`` (a Hugging Face GPT-2 or Llama directory) into ``model``, when set."""
    source = cfg.model.get("init_from")
    if source:
        from gptlab.model.hf import load_pretrained

        load_pretrained(model, source)
    return model


def build_datamodule(cfg: DictConfig) -> GPTDataModule:
    data = _plain(cfg.data)
    model_cfg = _plain(cfg.model)
    block_size = data.get("block_size") or model_cfg["block_size"]
    if not positional.get(cfg.pos.name).extrapolates and block_size > model_cfg["block_size"]:
        raise ConfigError(
            f"data.block_size={block_size} is longer than the learned position table of "
            f"pos={cfg.pos.name} (model.block_size={model_cfg['block_size']}). Set model.block_size={block_size}, shorten "
            "data.block_size, or use a scheme without a table (pos=sinusoidal, pos=nope)."
        )
    return GPTDataModule(
        spec=data_spec(cfg.data),
        tokenizer=_plain(cfg.tokenizer),
        block_size=block_size,
        batch_size=data.get("batch_size", 8),
        stride=data.get("stride"),
        val_stride=data.get("val_stride"),
        num_workers=data.get("num_workers", 0),
        seed=cfg.seed,
    )
