"""One owner per default. An option's default is written twice: in conf/ (what `python train.py` and
`gptlab.compose()` read) and in the dataclass that parses the node (what a Python user building ``Options()``
gets: the API's builders, tests, scripts). This walks every YAML of every registered family, every other node
train.yaml parses into a dataclass, and the callbacks' and loggers' constructors, and checks that

- every key a YAML sets is an option of the node's dataclass, and the run's parse refuses a key that is not;
- every value a YAML sets equals the dataclass default, or the difference is listed in ``DELIBERATE`` with why;
- every option a YAML leaves out is listed in ``OMITTED`` with why the dataclass may own it alone.

A listing that no longer matches anything fails too, so the lists stay the truth. Nothing is built beyond
config objects: no model, no data, no training.

Not walked, and why: ``trainer`` (Lightning's Trainer arguments: their defaults are Lightning's, and
gptlab.preflight refuses an unknown key); ``paths`` (interpolations of the environment); ``hydra``; and
``experiment``, ``debug``, ``hparams_search`` (overrides of the nodes above, different from their defaults
by design).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from conftest import CONF
from omegaconf import OmegaConf

from gptlab.config import RunSettings, parse_model
from gptlab.data import tokenizers
from gptlab.data.sources import DataSpec, LoaderOptions, parse_data
from gptlab.errors import ConfigError
from gptlab.evaluation.downstream import DownstreamEvalOptions, parse_downstream
from gptlab.evaluation.options import LengthEvalOptions, PasskeyOptions
from gptlab.model import activations, feedforward, norms, positional
from gptlab.model.attention_variants import AttentionOptions
from gptlab.model.config import _MODEL_KEYS, GPTConfig
from gptlab.model.head_loss import LOSS_KEYS, HeadLoss
from gptlab.parallel import ParallelOptions, strategy_choice
from gptlab.registry import Registry, build_options
from gptlab.training import optimizers
from gptlab.word2vec.config import Word2VecOptions

# (node label, glob over labels; key) -> why the YAML and the dataclass default differ on purpose.
DELIBERATE: dict[tuple[str, str], str] = {
    # A size preset is a size: GPTConfig()'s sizes are model=small's (4 x 256, context 256), one preset among
    # them; `python train.py` starts from model=tiny, sized for two CPU cores.
    **{
        ("model=*", key): "a preset's own size (GPTConfig() is model=small's)"
        for key in ("n_layer", "n_head", "n_embd", "block_size")
    },
    # null takes the tokenizer's vocabulary once it exists (gptlab.config.with_vocabulary); a GPTConfig built
    # in Python has no tokenizer, so it needs a number: GPT-2's.
    ("model=[lmst]*", "vocab_size"): "null: the tokenizer's size, which a Python GPTConfig does not know",
    # The attention presets exist to set what attention=default leaves off.
    ("attention=differential", "differential"): "the preset's point",
    ("attention=gated", "gate"): "the preset's point",
    ("attention=qk_norm", "qk_norm"): "the preset's point",
    ("attention=value_residual", "value_residual"): "the preset's point",
    ("attention=sliding_window", "window"): "the preset's point: half of model=tiny's context",
    ("attention=gemma2", "window"): "Gemma 2's local layers, at half of model=tiny's context",
    ("attention=gemma2", "window_pattern"): "Gemma 2 alternates local and global layers",
    ("attention=gemma2", "logit_softcap"): "Gemma 2's cap of 50",
    # One DeepSpeedOptions for five choices; its defaults are deepspeed_stage_2's.
    ("strategy=deepspeed_stage_[13]*", "stage"): "the choice's ZeRO stage",
    ("strategy=deepspeed_stage_*_offload", "offload_optimizer"): "the choice's offload",
    ("strategy=deepspeed_stage_3_offload", "offload_parameters"): "the choice's offload",
}

# (node label glob, option) -> why the YAML may leave the option to the dataclass alone.
OMITTED: dict[tuple[str, str], str] = {
    # Set by model.init_from for Gemma 2 (sqrt(hidden_size), gptlab.model.hf) and compared there; typed by
    # hand it is +model.embed_scale, as hf.py's own message writes it. No preset of conf/model scales.
    ("model=*", "embed_scale"): "Gemma's, set from the Hugging Face config it loads",
}


@dataclasses.dataclass
class Node:
    """A config node as the YAML (composed: a preset's defaults list merged) gives it, the run's parse of it,
    and what a Python user gets without it."""

    label: str  # as a user types it: pos=rope, data, callbacks.sample_generation
    values: dict[str, Any]  # the YAML's keys and values (the choice's ``name`` taken out)
    parse: Callable[[dict[str, Any]], Any]  # the run's parse of the node: typed, unknown keys refused
    default: Any  # the dataclass built with no arguments
    options: tuple[str, ...]  # the keys the node takes: the dataclass's fields a config may set
    # keys whose YAML value is an interpolation, ``${...}``: a link to another node's value (the run's seed,
    # its directory, the model's context), not a second default
    linked: frozenset[str] = frozenset()
    # whether the parse itself refuses a key its dataclass does not take (False: Hydra does, see where set)
    refuses_unknown: bool = True

    def parsed(self) -> Any:
        return self.parse(self.values)


def group_node(group: str, choice: str) -> dict[str, Any]:
    """conf/<group>/<choice>.yaml as Hydra composes it for ``<group>=<choice>``: the siblings its defaults list
    names first, then its own keys (the one form of defaults list these groups use)."""
    raw = yaml.safe_load((CONF / group / f"{choice}.yaml").read_text()) or {}
    merged = OmegaConf.create()
    own = OmegaConf.create({k: v for k, v in raw.items() if k != "defaults"})
    for entry in raw.get("defaults", ["_self_"]):
        assert isinstance(entry, str), f"{group}={choice}: a defaults entry {entry!r} this walk does not read"
        merged = OmegaConf.merge(merged, own if entry == "_self_" else group_node(group, entry))
    if "_self_" not in raw.get("defaults", ["_self_"]):
        merged = OmegaConf.merge(merged, own)
    return OmegaConf.to_container(merged)


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def init_fields(options_type: type) -> tuple[str, ...]:
    """The options a config may set: the dataclass's fields its constructor takes."""
    return tuple(f.name for f in dataclasses.fields(options_type) if f.init)


# The registered families: one YAML per choice, its options the registered class's Options.
FAMILIES: dict[str, Registry[Any]] = {
    "pos": positional.REGISTRY,
    "activation": activations.REGISTRY,
    "norm": norms.REGISTRY,
    "mlp": feedforward.REGISTRY,
    "optim": optimizers.REGISTRY,
    "tokenizer": tokenizers.TOKENIZERS,
}


def family_nodes() -> list[Node]:
    nodes = []
    for group, registry in FAMILIES.items():
        for choice in choices(group):
            values = group_node(group, choice)
            name = values.pop("name")
            if group == "norm":  # the block's placement rides in the norm node; checked on its own below
                values.pop("placement")
            options_type = registry.options_type(name)
            nodes.append(
                Node(
                    f"{group}={choice}",
                    values,
                    lambda v, r=registry, n=name: r.build_options(n, v),
                    options_type(),
                    init_fields(options_type),
                )
            )
    for choice in choices("strategy"):
        values = group_node("strategy", choice)
        chosen = strategy_choice(dict(values))
        for key in ("name", "choice"):
            values.pop(key, None)
        nodes.append(
            Node(
                f"strategy={choice}",
                values,
                lambda v, c=choice: strategy_choice({**group_node("strategy", c), **v}).options,
                type(chosen).Options(),
                init_fields(type(chosen).Options),
            )
        )
    return nodes


def preset_nodes() -> list[Node]:
    nodes = []
    for choice in choices("attention"):
        nodes.append(
            Node(
                f"attention={choice}",
                group_node("attention", choice),
                AttentionOptions.from_node,
                AttentionOptions(),
                init_fields(AttentionOptions),
            )
        )
    for choice in choices("model"):
        values = group_node("model", choice)
        # model.init_from is parse_model's (the weights to start from), not GPTConfig's: null in every preset
        assert values.pop("init_from") is None, f"model={choice}: a preset that loads weights"
        nodes.append(Node(f"model={choice}", values, parse_model_node, GPTConfig(), tuple(_MODEL_KEYS)))
    return nodes


def parse_model_node(values: dict[str, Any]) -> GPTConfig:
    """The model node through the run's parse (parse_model), its vocabulary left null where the YAML's is."""
    cfg = OmegaConf.create(
        {"model": values, "pos": "learned", "activation": "gelu", "norm": {"name": "layernorm"}}
    )
    config, from_tokenizer, _ = parse_model(cfg)
    if from_tokenizer:  # compared as the YAML wrote it; the stand-in size parse_model checks with is not one
        config.vocab_size = None  # type: ignore[assignment]
    return config


def train_yaml_nodes(make_cfg) -> list[Node]:
    """The nodes of train.yaml's own and of its single-choice groups, parsed into dataclasses."""
    cfg = make_cfg()
    plain = OmegaConf.to_container(cfg, resolve=True)
    raw = OmegaConf.to_container(cfg, resolve=False)
    data = plain["data"]
    data_links = frozenset(k for k, v in raw["data"].items() if is_interpolation(v))
    spec_keys, loader_keys = init_fields(DataSpec), init_fields(LoaderOptions)
    eval_length = dict(plain["eval_length"])
    passkey = eval_length.pop("passkey")
    eval_length.pop("enabled")  # whether the study runs: the run's switch, parse_studies'
    harness = dict(plain["eval_harness"])
    harness.pop("enabled")  # likewise parse_downstream's
    top = {k: plain[k] for k in init_fields(RunSettings)}
    parallel = {k: plain[k] for k in init_fields(ParallelOptions)}
    return [
        Node("loss", plain["loss"], HeadLoss.from_node, HeadLoss(), LOSS_KEYS),
        Node(
            "data (the corpus)",
            {k: v for k, v in data.items() if k in spec_keys},
            lambda v: parse_data(v)[0],
            DataSpec(),
            spec_keys,
            data_links,
        ),
        Node(
            "data (the loader)",
            {k: v for k, v in data.items() if k in loader_keys},
            lambda v: parse_data(v)[1],
            LoaderOptions(),
            loader_keys,
            data_links,
        ),
        Node(
            "word2vec",
            plain["word2vec"],
            Word2VecOptions.from_dict,
            Word2VecOptions(),
            init_fields(Word2VecOptions),
        ),
        Node(
            "eval_length",
            eval_length,
            LengthEvalOptions.from_dict,
            LengthEvalOptions(),
            init_fields(LengthEvalOptions),
        ),
        Node(
            "eval_length.passkey",
            passkey,
            PasskeyOptions.from_dict,
            PasskeyOptions(),
            init_fields(PasskeyOptions),
        ),
        Node(
            "eval_harness",
            harness,
            parse_harness,
            DownstreamEvalOptions(),
            init_fields(DownstreamEvalOptions),
        ),
        Node(
            "the top level (RunSettings)",
            top,
            lambda v: RunSettings.parse(OmegaConf.create(v)),
            RunSettings(),
            init_fields(RunSettings),
            # the top level also holds every group's node: a mistyped key there is refused by Hydra's struct
            # mode when typed (`sed=1`: "Key 'sed' is not in struct"); `+key=` adds one on purpose
            refuses_unknown=False,
        ),
        Node(
            "the top level (ParallelOptions)",
            parallel,
            ParallelOptions.from_config,
            ParallelOptions(),
            init_fields(ParallelOptions),
        ),
    ]


def is_interpolation(value: Any) -> bool:
    """``${...}``: a link to another node's value (the run's seed, its directory), not a second default."""
    return isinstance(value, str) and "${" in value


def differences(node: Node) -> dict[str, tuple[Any, Any]]:
    """key -> (the YAML's value as parsed, the default), for every key the YAML sets to another value."""
    parsed = node.parsed()
    found = {}
    for key in node.values:
        if key in node.linked:
            continue
        ours, theirs = as_list(getattr(parsed, key)), as_list(getattr(node.default, key))
        if ours != theirs:
            found[key] = (ours, theirs)
    return found


def as_list(value: Any) -> Any:
    """A sequence as a list: YAML writes a list where a dataclass default is a tuple."""
    return list(value) if isinstance(value, tuple) else value


def parse_harness(values: dict[str, Any]) -> DownstreamEvalOptions:
    """The eval_harness node as the run parses it while off (keys and values checked; the task names only
    when on, which imports the harness)."""
    assert parse_downstream({**values, "enabled": False}) is None
    return build_options(DownstreamEvalOptions, values, "eval_harness", "eval_harness")


def check_nodes(nodes: list[Node]) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """Check each node; return the (pattern, key) listings of DELIBERATE and OMITTED it used."""
    drifts, unlisted_omissions = [], []
    used_deliberate, used_omitted = set(), set()
    for node in nodes:
        unknown = sorted(set(node.values) - set(node.options))
        assert not unknown, f"{node.label}: the YAML sets {unknown}, which its dataclass does not take"
        # the run refuses a key its dataclass does not take, with the key named
        if node.refuses_unknown:
            with pytest.raises(ConfigError, match="not_an_option"):
                node.parse({**node.values, "not_an_option": 1})
        for key, (ours, theirs) in differences(node).items():
            hits = {(p, k) for p, k in DELIBERATE if k == key and fnmatch.fnmatchcase(node.label, p)}
            if hits:
                used_deliberate |= hits
            else:
                drifts.append(f"{node.label}: {key} is {ours!r} in conf/ but {theirs!r} in the dataclass")
        for key in sorted(set(node.options) - set(node.values)):
            hits = {(p, k) for p, k in OMITTED if k == key and fnmatch.fnmatchcase(node.label, p)}
            if hits:
                used_omitted |= hits
            else:
                unlisted_omissions.append(f"{node.label}: {key}")
    assert not drifts, "defaults that differ between conf/ and the dataclass:\n" + "\n".join(drifts)
    assert not unlisted_omissions, (
        "options conf/ leaves out (list them in conf/ so that `<node>.<key>=...` needs no +, or in OMITTED "
        "with why the dataclass alone owns them):\n" + "\n".join(unlisted_omissions)
    )
    return used_deliberate, used_omitted


def test_every_registered_choice_has_its_yaml():
    """A registered variant without a YAML cannot be chosen from the command line; a YAML without a
    registered variant is refused when chosen."""
    for group, registry in FAMILIES.items():
        named = {group_node(group, choice)["name"] for choice in choices(group)}
        assert named == set(registry.names()), group
    from gptlab.parallel.strategies import STRATEGIES

    assert {group_node("strategy", c)["name"] for c in choices("strategy")} == set(STRATEGIES.names())


def test_the_walks_reading_of_a_preset_is_hydras(make_cfg):
    """group_node merges a preset's defaults list as Hydra does (the walk reads files, not composes them)."""
    for group, choice in (("attention", "gemma2"), ("optim", "muon"), ("pos", "rope")):
        assert group_node(group, choice) == OmegaConf.to_container(make_cfg(f"{group}={choice}")[group])


def test_every_yaml_default_is_its_dataclass_default_or_listed_with_why(make_cfg):
    nodes = family_nodes() + preset_nodes() + train_yaml_nodes(make_cfg)
    assert len(nodes) > 60  # every family, preset and node walked (a lost group would shrink this)
    used_deliberate, used_omitted = check_nodes(nodes)
    assert used_deliberate == set(DELIBERATE), (
        f"DELIBERATE lists what is no longer so: {set(DELIBERATE) - used_deliberate}"
    )
    assert used_omitted == set(OMITTED), f"OMITTED lists what is no longer so: {set(OMITTED) - used_omitted}"


def test_the_norm_nodes_placement_is_the_models_default():
    """norm.placement is parsed into GPTConfig.norm_placement (the block's, not the norm's)."""
    for choice in choices("norm"):
        assert group_node("norm", choice)["placement"] == GPTConfig().norm_placement, choice


def test_a_drift_is_found_and_named():
    """The check itself: a default changed in one place only fails, naming the node, key and both values."""
    node = Node(
        "pos=rope",
        {**group_node("pos", "rope"), "base": 500.0},
        lambda v: positional.REGISTRY.build_options("rope", {k: x for k, x in v.items() if k != "name"}),
        positional.get("rope").Options(),
        init_fields(positional.get("rope").Options),
    )
    node.values.pop("name")
    with pytest.raises(
        AssertionError, match=r"pos=rope: base is 500.0 in conf/ but 10000.0 in the dataclass"
    ):
        check_nodes([node])


# ---- constructors named by _target_ (callbacks, loggers): their keyword defaults are the Python owner ----

#: A target that passes its keywords on to another function of gptlab's, whose defaults then count.
FORWARDED = {"gptlab.tracking.loggers.wandb_logger": "gptlab.tracking.plain_loggers.wandb_init_args"}


def resolve(target: str) -> Any:
    module, _, attr = target.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def keyword_defaults(target: str) -> tuple[dict[str, Any], set[str], bool]:
    """(parameter -> default, the parameters with none, whether other keywords pass on to a class not
    gptlab's, such as Lightning's ModelCheckpoint, whose defaults are not ours to pin)."""
    parameters = dict(inspect.signature(resolve(target)).parameters)
    if target in FORWARDED:
        parameters |= inspect.signature(resolve(FORWARDED[target])).parameters
    passes_on = any(p.kind is p.VAR_KEYWORD for p in parameters.values()) and target not in FORWARDED
    named = {n: p for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    defaults = {n: p.default for n, p in named.items() if p.default is not p.empty}
    return defaults, set(named) - set(defaults), passes_on


def test_callbacks_and_loggers_yaml_values_are_their_constructors_defaults(make_cfg):
    """Each `_target_` node of callbacks and of logger=all sets only keys its constructor takes, to the
    constructor's default where it has one (interpolations such as ${seed} link to the run's value)."""
    cfg = OmegaConf.to_container(make_cfg("logger=all"), resolve=False)
    drifts = []
    walked = 0
    for group in ("callbacks", "logger"):
        for name, node in cfg[group].items():
            node = dict(node)
            target = node.pop("_target_")
            defaults, required, passes_on = keyword_defaults(target)
            walked += 1
            for key, value in node.items():
                if key not in defaults and key not in required:
                    assert passes_on, f"{group}.{name}.{key}: {target} takes no such keyword"
                    continue  # the wrapped class's keyword, with its library's default
                if is_interpolation(value) or key in required:
                    continue
                default = list(defaults[key]) if isinstance(defaults[key], tuple) else defaults[key]
                if value != default:
                    drifts.append(f"{group}.{name}.{key}: {value!r} in conf/ but {default!r} in {target}")
    assert walked >= 10
    assert not drifts, "defaults that differ between conf/ and the constructor:\n" + "\n".join(drifts)
