"""The run's configuration as one typed tree, parsed once at start-up from Hydra's composed config.

Every node becomes the typed object its component takes, built and checked where that component declares it:
the model (a :class:`~gptlab.model.config.GPTConfig`, each variant a registry Choice), the corpus
(:class:`~gptlab.data.sources.DataSpec`) and its loader (:class:`~gptlab.data.sources.LoaderOptions`), the
tokenizer's options, the optimizer, the output layer and loss (:class:`~gptlab.model.head_loss.HeadLoss`), the
trainer's arguments, the parallel strategy (:class:`~gptlab.parallel.StrategyChoice`), what is applied to
every block (:class:`~gptlab.parallel.ParallelOptions`), and the length and passkey studies. An unknown key, a
value of the wrong type, or a combination that cannot run is a :class:`~gptlab.errors.ConfigError` here,
before any data is read, any logger is opened or any weight exists; a component then receives its own node and
nothing else.

    from gptlab.config import parse_gpt
    run = parse_gpt(cfg)          # cfg: Hydra's composed config
    run.model.pos.name, run.optim.options.lr, run.loader.batch_size
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, OmegaConf

from gptlab.errors import ConfigError
from gptlab.preflight import check_seed
from gptlab.registry import Choice

if TYPE_CHECKING:  # the nodes' types; their modules are imported where a node is parsed (a task that does
    # not train a GPT, word2vec, reads the top level without importing Lightning)
    from gptlab.data import tokenizers
    from gptlab.data.sources import DataSpec, LoaderOptions
    from gptlab.evaluation.downstream import DownstreamEvalOptions
    from gptlab.evaluation.options import LengthEvalOptions, PasskeyOptions
    from gptlab.model.config import GPTConfig
    from gptlab.model.head_loss import HeadLoss
    from gptlab.parallel import ParallelOptions, StrategyChoice


def plain(node: Any) -> Any:
    """A config node as plain Python values (interpolations resolved)."""
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    return node


@dataclass(frozen=True)
class RunSettings:
    """What every task reads at the top level: which task, the seed, and which run it continues."""

    task: str = "gpt"
    seed: int = 1337
    resume: str | None = None  # auto, a run directory or a checkpoint; None: a new run
    overwrite: bool = False
    optimized_metric: str | None = "val/loss"  # the metric the task returns to a sweeper
    plugins: tuple[str, ...] = ()  # the user's modules of variants, recorded with the checkpoints
    # start a run whose memory estimate exceeds what its device has (gptlab.planning)
    allow_over_memory: bool = False

    @classmethod
    def parse(cls, cfg: DictConfig) -> RunSettings:
        check_top_level(cfg)
        check_seed(cfg.get("seed"))
        resume = cfg.get("resume")
        return cls(
            task=str(cfg.get("task", cls.task)),  # a key absent: the default above
            seed=int(cfg.seed),
            resume=None if resume in (None, "", False) else str(resume),
            overwrite=bool(cfg.get("overwrite")),
            optimized_metric=cfg.get("optimized_metric"),
            plugins=tuple(str(m) for m in cfg.get("plugins") or ()),
            allow_over_memory=_flag(cfg, "allow_over_memory"),
        )


def top_level_keys() -> frozenset[str]:
    """The keys the root config (conf/train.yaml) has: its own and one per group of its defaults list. An
    experiment or debug file (``# @package _global_``) sets some of them; none adds another."""
    from gptlab.registry import CONFIG_DIR

    root = cast(dict[str, Any], OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "train.yaml")))
    groups = set()
    for entry in root.get("defaults", []):
        name = next(iter(entry)) if isinstance(entry, dict) else str(entry)
        groups.add(name.split()[-1].lstrip("/").split("/")[0])  # "optional x", "override /x"
    return frozenset(k for k in root if k != "defaults") | frozenset(groups - {"_self_"}) | {"hydra"}


def check_top_level(cfg: DictConfig) -> None:
    """Refuse a top-level key no part of gptlab reads (``+max_steps=100``): Hydra adds whatever a ``+``
    override names, so a misplaced key would otherwise be dropped without a word and the run would train
    with the default. The message names the nested key of that name (``trainer.max_steps``) where there is
    one."""
    known = top_level_keys()
    unknown = [str(k) for k in cfg if str(k) not in known]
    if not unknown:
        return
    key = unknown[0]
    value: Any = cfg._get_node(key)
    typed = key if isinstance(value, DictConfig) else f"{key}={value}"
    nested = sorted(path for path in dotted_keys(cfg, skip=set(unknown)) if path.rsplit(".", 1)[-1] == key)
    close = difflib.get_close_matches(key, sorted(known), n=1)
    suffix = typed[len(key) :]  # "=value", or nothing for a node
    if nested:
        hint = f" Did you mean {' or '.join(path + suffix for path in nested)}?"
    elif close:
        hint = f" Did you mean {close[0]}{suffix}?"
    else:
        hint = ""
    raise ConfigError(
        f"+{typed} adds a top-level key that no part of gptlab reads: the run would ignore it.{hint} Remove "
        f"it; the top level takes: {', '.join(sorted(known - {'hydra'}))}."
    )


def dotted_keys(node: Any, prefix: str = "", skip: set[str] | None = None, depth: int = 3) -> list[str]:
    """The dotted paths of ``node``'s keys, ``depth`` levels down (interpolations left unresolved)."""
    if not isinstance(node, DictConfig) or depth == 0:
        return []
    paths: list[str] = []
    for k in node.keys():
        if skip and str(k) in skip:
            continue
        path = f"{prefix}{k!s}"
        paths.append(path)
        child = node._get_node(k)
        if isinstance(child, DictConfig):
            paths += dotted_keys(child, path + ".", depth=depth - 1)
    return paths


def _flag(cfg: DictConfig, key: str) -> bool:
    """A top-level true/false key; anything else is refused rather than read as truthy."""
    value = cfg.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false (e.g. {key}=true).")
    return value


@dataclass(frozen=True)
class GPTRunConfig:
    """The whole typed tree of a language-model run (``task=gpt``)."""

    run: RunSettings
    model: GPTConfig  # vocab_size is the tokenizer's when ``vocab_from_tokenizer``
    vocab_from_tokenizer: bool
    init_from: str | None
    tokenizer: dict[str, Any]  # the node: name and options (checked); a fitted vocabulary comes with the data
    data: DataSpec
    loader: LoaderOptions
    optim: Choice  # the optimizer and its typed options (training/optimizers.py), schedule included
    loss: HeadLoss
    trainer: dict[str, Any]  # Lightning Trainer arguments, checked; precision chosen for the hardware
    strategy: StrategyChoice
    strategy_node: dict[str, Any]
    # resolved for the device the run trains on: whether the blocks are compiled, and why (compile_choice)
    parallel: ParallelOptions
    length_study: LengthEvalOptions | None  # None: no length study after training
    passkey: PasskeyOptions | None
    downstream_eval: DownstreamEvalOptions | None = None  # None: no harness tasks during training

    @property
    def block_size(self) -> int:
        """The training context: ``data.block_size`` or the model's."""
        return self.loader.block_size or self.model.block_size

    def with_vocabulary(self, tokenizer: tokenizers.Tokenizer) -> GPTConfig:
        """The model config for ``tokenizer`` (:func:`with_vocabulary`)."""
        return with_vocabulary(self.model, self.vocab_from_tokenizer, tokenizer)


def with_vocabulary(model: GPTConfig, from_tokenizer: bool, tokenizer: tokenizers.Tokenizer) -> GPTConfig:
    """``model`` (as :func:`parse_model` returns it) for ``tokenizer``: its size when ``model.vocab_size`` is
    null (``from_tokenizer``), else checked against it."""
    if from_tokenizer:
        return dataclasses.replace(model, vocab_size=tokenizer.vocab_size)
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(
            f"tokenizer={tokenizer.name} has {tokenizer.vocab_size} ids but model.vocab_size="
            f"{model.vocab_size}: the embedding table has no row for the larger ids. Set "
            f"model.vocab_size={tokenizer.vocab_size} or larger, or null to take the tokenizer's size."
        )
    return model


def parse_model(cfg: DictConfig) -> tuple[GPTConfig, bool, str | None]:
    """The ``model``, ``pos``, ``activation``, ``norm``, ``attention`` and ``mlp`` nodes as one checked GPTConfig; whether its
    vocabulary is the tokenizer's (``model.vocab_size: null``, checked with a stand-in size until the
    tokenizer exists); and ``model.init_from``."""
    from gptlab.model.config import GPTConfig

    values = dict(plain(cfg.model))
    init_from = values.pop("init_from", None)
    from_tokenizer = values.get("vocab_size") is None
    if from_tokenizer:
        values["vocab_size"] = 1
    attention = plain(cfg.attention) if "attention" in cfg else None
    mlp = plain(cfg.mlp) if "mlp" in cfg else None
    config = GPTConfig.from_nodes(
        values, plain(cfg.pos), plain(cfg.activation), plain(cfg.norm), attention, mlp
    )
    if init_from and config.mlp.name != "dense":
        raise ConfigError(
            f"model.init_from={init_from} loads a Hugging Face GPT-2, Llama, Qwen3 or Gemma 2, whose feed-forward "
            f"layers are dense MLPs, but mlp={config.mlp.name} builds other weights. Use mlp=dense with "
            "model.init_from, or train the MoE from scratch (model.init_from=null)."
        )
    if cfg.get("mtp") is not None:  # multi-token prediction's extra heads (model/mtp.py), held by the model
        from gptlab.model.mtp import MTPOptions

        config = dataclasses.replace(config, mtp=MTPOptions.from_node(plain(cfg.mtp)))
    return config, from_tokenizer, init_from


def check_context(model: GPTConfig, loader: LoaderOptions) -> int:
    """The training context (``data.block_size``, else the model's), refused past a learned position table."""
    from gptlab.model import positional

    block_size = loader.block_size or model.block_size
    if not positional.get(model.pos.name).extrapolates and block_size > model.block_size:
        raise ConfigError(
            f"data.block_size={block_size} is longer than the learned position table of "
            f"pos={model.pos.name} (model.block_size={model.block_size}). Set model.block_size={block_size}, "
            "shorten data.block_size, or use a scheme without a table (pos=sinusoidal, pos=nope)."
        )
    return block_size


def check_window(model: GPTConfig, block_size: int) -> None:
    """A sliding window no shorter than the training context, refused: every local layer would see its whole
    past, as under full attention, so the run would train ``attention=default`` under another name (as a
    pattern without a local layer, refused with the attention options)."""
    window = model.attention.window
    if window is None or window < block_size:
        return
    example = max(1, block_size // 2)
    raise ConfigError(
        f"attention.window={window} is not shorter than the training context of {block_size} positions, so "
        f"every local layer would see its whole past, as with full attention: the window would change "
        f"nothing. Use attention.window below {block_size} (e.g. attention.window={example}), a longer "
        "context (model.block_size), or attention.window=null for full attention in every layer."
    )


def check_mtp(model: GPTConfig, context: int, init_from: str | None) -> None:
    """Multi-token prediction's extra heads where the run cannot honour them: a training context too short
    for their targets, or initial weights from a Hugging Face checkpoint, which holds no extra heads."""
    if model.mtp.depth == 0:
        return
    model.mtp.check_context(context, "data.block_size")
    if init_from:
        raise ConfigError(
            f"mtp.depth={model.mtp.depth} with model.init_from={init_from}: the checkpoint holds the next-token "
            "model alone, not the extra heads, so they cannot be initialised from it. Train from scratch with "
            "mtp.depth, or fine-tune from the checkpoint with mtp.depth=0."
        )


def check_document_mask(model: GPTConfig, loader: LoaderOptions, trainer: dict[str, Any]) -> None:
    """A document mask with differential attention, refused before the data where the run trains on CUDA: there
    the mask goes through FlexAttention, which differential attention's two half-width kernels do not take (on
    a CPU both take the dense route, and train)."""
    import torch

    from gptlab.model.attention import flex_attention_available
    from gptlab.preflight import training_device_type

    on_cuda = training_device_type(trainer) == "cuda"
    if not (model.attention.differential and loader.document_mask and on_cuda):
        return
    if flex_attention_available(torch.device("cuda"), model.head_dim):
        raise ConfigError(
            "attention.differential=true cannot take data.document_mask=true on CUDA, where the document mask "
            "goes through FlexAttention: set data.document_mask=false, or attention.differential=false."
        )


def parse_tokenizer(node: Any) -> dict[str, Any]:
    from gptlab.data import tokenizers

    values = dict(plain(node))
    tokenizers.options_of(values["name"], values)  # an unknown name or option is refused here
    return values


def parse_loss(node: Any, trainer: dict[str, Any]) -> HeadLoss:
    """The ``loss`` node, refused where its kernel cannot run (a CUDA kernel without CUDA or its package, Cut
    Cross-Entropy in a full-precision run, or in a run with ``trainer.deterministic=true``: its gradients are
    not deterministic). Under ``trainer.deterministic=warn`` (torch warns of its own nondeterministic
    operations and runs them) such a kernel runs, with a warning."""
    import logging

    from gptlab.model.head_loss import (
        NONDETERMINISTIC,
        NONDETERMINISTIC_NOTES,
        HeadLoss,
        precision_dtype,
        refusal,
    )
    from gptlab.preflight import training_device_type

    loss = HeadLoss.from_node(plain(node))
    dtype = precision_dtype(trainer.get("precision"))
    deterministic = trainer.get("deterministic")
    message = refusal(
        loss.impl, training_device_type(trainer), dtype=dtype, deterministic=deterministic is True
    )
    if message is not None:
        raise ConfigError(message)
    if deterministic == "warn" and loss.impl in NONDETERMINISTIC:
        logging.getLogger("gptlab").warning(
            "loss.impl=%s %s; trainer.deterministic=warn lets it run. loss.impl=auto takes a deterministic "
            "one.",
            loss.impl,
            NONDETERMINISTIC_NOTES[loss.impl],
        )
    return loss


def parse_trainer(node: Any) -> dict[str, Any]:
    """The ``trainer`` node: Lightning's arguments, checked before Lightning sees them."""
    from gptlab.parallel import choose_precision
    from gptlab.preflight import (
        check_accelerator,
        check_precision,
        check_trainer_options,
        check_trainer_values,
        full_precision,
    )

    trainer = cast(dict[str, Any], plain(node))
    check_trainer_options(trainer)
    check_trainer_values(trainer)
    check_accelerator(trainer)  # and devices, num_nodes
    check_precision(trainer)
    # a short form (bf16) by its full name (bf16-mixed), as Lightning reads it, without its warning
    trainer["precision"] = choose_precision(
        full_precision(trainer.get("precision")), trainer.get("accelerator")
    )
    return trainer


def parse_studies(cfg: DictConfig) -> tuple[LengthEvalOptions | None, PasskeyOptions | None]:
    """The ``eval_length`` node and its ``passkey`` node, each parsed once here (None: that study is off)."""
    from gptlab.evaluation.options import LengthEvalOptions, PasskeyOptions

    node = dict(plain(cfg.get("eval_length")) or {})
    enabled = node.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(
            f"eval_length.enabled={enabled!r} must be true or false (e.g. eval_length.enabled=true)."
        )
    study = LengthEvalOptions.from_dict(node)  # checked also when off: a typo fails now, not at the end
    passkey = PasskeyOptions.from_dict(node.get("passkey"))
    if not enabled:
        return None, None
    return study, passkey if passkey.enabled else None


def parse_downstream_node(
    cfg: DictConfig, strategy: StrategyChoice, trainer: dict[str, Any]
) -> DownstreamEvalOptions | None:
    """The ``eval_harness`` node (harness tasks during training), refused where rank 0 cannot run the model
    alone (sharded weights)."""
    from gptlab.evaluation.downstream import parse_downstream
    from gptlab.parallel.hardware import world_size

    options = parse_downstream(plain(cfg.get("eval_harness")))
    n = world_size(trainer)
    if options is not None and n > 1 and strategy.placement(n).shards_weights:
        raise ConfigError(
            f"eval_harness.enabled=true runs the harness on rank 0 alone during training, but strategy="
            f"{strategy.label} shards the weights over the {n} processes. Train with strategy=ddp, or with "
            "eval_harness.enabled=false and run scripts/evaluate.py on the run directory afterwards."
        )
    return options


def parse_gpt(cfg: DictConfig) -> GPTRunConfig:
    """The typed tree of a ``task=gpt`` run, every node checked (see the module's docstring)."""
    from gptlab.data.sources import parse_data
    from gptlab.parallel import ParallelOptions, check_rank_zero_evaluation, strategy_choice
    from gptlab.preflight import training_device_type
    from gptlab.training.optimizers import parse_optim

    run = RunSettings.parse(cfg)
    trainer = parse_trainer(cfg.trainer)
    loss = parse_loss(cfg.get("loss"), trainer)
    strategy_node = cast(dict[str, Any], plain(cfg.get("strategy")) or {"name": "auto"})
    strategy = strategy_choice(strategy_node)
    optim = parse_optim(cast(dict[str, Any], plain(cfg.optim)), trainer["max_steps"], strategy.label)
    model, from_tokenizer, init_from = parse_model(cfg)
    data, loader = parse_data(cfg.data)
    context = check_context(model, loader)
    check_window(model, context)
    check_mtp(model, context, init_from)
    check_document_mask(model, loader, trainer)
    study, passkey = parse_studies(cfg)
    if study is not None:
        check_rank_zero_evaluation(strategy, trainer, "eval_length.enabled=true")
    downstream = parse_downstream_node(cfg, strategy, trainer)
    # compile=auto made concrete here, as trainer.precision=null is: for the device Lightning will pick
    parallel = ParallelOptions.from_config(
        {k: cfg[k] for k in ("compile", "activation_checkpointing") if cfg.get(k) is not None}
    ).resolved(training_device_type(trainer))
    return GPTRunConfig(
        run=run,
        model=model,
        vocab_from_tokenizer=from_tokenizer,
        init_from=str(Path(init_from)) if init_from else None,
        tokenizer=parse_tokenizer(cfg.tokenizer),
        data=data,
        loader=loader,
        optim=optim,
        loss=loss,
        trainer=trainer,
        strategy=strategy,
        strategy_node=strategy_node,
        parallel=parallel,
        length_study=study,
        passkey=passkey,
        downstream_eval=downstream,
    )
