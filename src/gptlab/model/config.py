"""The model's configuration: its sizes and switches, one :class:`~gptlab.registry.Choice` per variant
family (positional scheme, activation, norm, feed-forward layer: ``mlp=dense|moe``, model/feedforward.py),
each with that variant's typed options, and the attention
variants (QK-norm, sliding windows, logit cap, output gate, value residual, differential attention:
``attention``, model/attention_variants.py).

Made once, and checked whole when it is made: every size, every variant name and option (the variant's own
``Options`` dataclass, built by its registry), and the checks that need both (a rotary scheme's even head
dimension). A variant is given by its name, its config node (``pos={"name": "rope", "base": 500.0}``) or a
Choice. ``to_dict`` writes plain values (saved in checkpoints, logged to W&B); ``from_dict`` reads them back,
also as saved by earlier versions (``pos`` + ``pos_options``, ``norm_eps``, ``norm_bias``, no ``attention``, no ``mlp``).

How weights are initialised and scaled with width follows from the config too (``param``: the standard
parametrisation, or muP; the functions at the end of this module).
muP, the maximal update parametrisation (Yang et al. 2022, "Tensor Programs V: Tuning Large Neural Networks
via Zero-Shot Hyperparameter Transfer", https://arxiv.org/abs/2203.03466, table 3 for Adam), makes each
layer's activations and their updates keep their scale as the width grows, so that hyperparameters tuned on
a narrow model carry over to a wide one. With width multiplier m = n_embd / mup_base_width:

- hidden matrices (the blocks' attention and MLP weights): initial std ``init_std / sqrt(m)`` (variance
  proportional to 1 / fan_in) and Adam learning rate ``lr / m``;
- input weights (token and position embeddings), biases and norm gains: unchanged init and learning rate;
- the output logits are multiplied by ``1 / m`` (the readout multiplier; with a tied head the shared matrix
  keeps the embedding's init and rate, as in the ``mup`` package's shared readout);
- attention scores are scaled by ``1 / head_dim`` instead of ``1 / sqrt(head_dim)``: written
  ``sqrt(base_head_dim) / head_dim`` so that at the base width the model is the standard one.

At m = 1 every rule is the identity: a muP model at its base width is the standard model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

from gptlab.errors import ConfigError
from gptlab.model import activations, attention_variants, feedforward, norms, positional
from gptlab.model import mtp as multi_token
from gptlab.registry import Choice, check_keys

PARAMETRIZATIONS = ("standard", "mup")
NORM_PLACEMENTS = ("pre", "post", "sandwich")


#: The default of ``vocab_multiple``: the token table's rows padded to a multiple of 64 (GPT-2's 50,257 to
#: 50,304 = 64 x 786, as nanoGPT does), so that the output layer's products run in aligned kernels on a GPU.
VOCAB_MULTIPLE = 64


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    # The token table and the output layer are stored with vocab_size rounded up to a multiple of this
    # (``padded_vocab_size``); the extra rows are zero and take part in nothing (model/gpt.py). 1: no padding.
    vocab_multiple: int = VOCAB_MULTIPLE
    block_size: int = 256  # the training context, in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    n_kv_head: int | None = None  # None: as many key/value heads as query heads
    dropout: float = 0.0
    bias: bool = True  # biases in the linear layers (and the norms, where the norm has one)
    tie_weights: bool = True  # the output head reuses the token embedding matrix
    mlp_ratio: float | None = None  # None: 4 for plain activations, the gated default for gated ones
    init_std: float = 0.02
    # standard, or mup (the functions at the end of this module): init, learning rates, logits and attention
    # scaled with the width relative to mup_base_width (Yang et al. 2022, "Tensor Programs V").
    param: str = "standard"
    mup_base_width: int = 128
    # The variants: each a Choice of its registry (given as a name or a config node, made a Choice here).
    pos: Choice = field(default_factory=lambda: Choice("learned"))
    activation: Choice = field(default_factory=lambda: Choice("gelu"))
    norm: Choice = field(default_factory=lambda: Choice("layernorm"))
    # "pre" (GPT-2), "post" (the original transformer) or "sandwich" (pre, and a norm on each sublayer's
    # output before the residual add: Gemma 2): the block's, not the norm's
    norm_placement: str = "pre"
    embed_scale: float = 1.0  # the token embeddings are multiplied by it (Gemma: sqrt(n_embd))
    # QK-norm, sliding windows, the attention-logit cap, the output gate, the value residual and differential
    # attention (given as the ``attention`` config node).
    attention: attention_variants.AttentionOptions = field(
        default_factory=attention_variants.AttentionOptions
    )
    # The feed-forward layer: dense (the MLP) or moe (a Mixture of Experts, model/feedforward.py).
    mlp: Choice = field(default_factory=lambda: Choice("dense"))
    # Multi-token prediction's extra heads (the ``mtp`` config node, model/mtp.py): part of the model that
    # trains them, so that its checkpoints hold them; depth 0 (the default) has none.
    mtp: multi_token.MTPOptions = field(default_factory=multi_token.MTPOptions)

    def __post_init__(self) -> None:
        self.attention = attention_variants.AttentionOptions.from_node(self.attention)
        self.mtp = multi_token.MTPOptions.from_node(self.mtp)
        self.pos = positional.REGISTRY.choose(self.pos)
        self.activation = activations.REGISTRY.choose(self.activation)
        self.mlp = feedforward.REGISTRY.choose(self.mlp)
        norm = norms.REGISTRY.choose(self.norm)
        if getattr(norm.options, "bias", False) is None:  # a norm bias that follows the model's
            norm = Choice(norm.name, dataclasses.replace(norm.options, bias=self.bias))
        self.norm = norm
        self.validate()

    @property
    def padded_vocab_size(self) -> int:
        """The rows the token table and the output layer are stored with: ``vocab_size`` rounded up to a
        multiple of ``vocab_multiple``. Only the first ``vocab_size`` are ever read."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def validate(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                example = next(f.default for f in fields(self) if f.name == name)
                raise ConfigError(
                    f"model.{name}={value!r} must be a positive integer (e.g. model.{name}={example})."
                )
        multiple = self.vocab_multiple
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple <= 0:
            raise ConfigError(
                f"model.vocab_multiple={multiple!r} must be a positive integer: the token table and output "
                f"layer are stored with model.vocab_size rounded up to a multiple of it (e.g. "
                f"model.vocab_multiple={VOCAB_MULTIPLE}; 1 for no padding)."
            )
        if self.n_embd % self.n_head != 0:
            divisors = [h for h in range(1, min(self.n_embd, 64) + 1) if self.n_embd % h == 0]
            raise ConfigError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}: each head needs "
                f"n_embd / n_head dimensions. Choose n_head from {divisors[-8:]} or change n_embd "
                f"(for example model.n_embd={self.n_head * max(1, round(self.n_embd / self.n_head))})."
            )
        if self.n_kv_head is not None and (self.n_kv_head <= 0 or self.n_head % self.n_kv_head != 0):
            raise ConfigError(
                f"model.n_head={self.n_head} is not divisible by model.n_kv_head={self.n_kv_head}: each key/value "
                f"head serves a whole group of query heads. Use a divisor of {self.n_head} "
                f"(1 for multi-query attention, {self.n_head} or null for multi-head attention)."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1).")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ConfigError(
                f"norm.placement={self.norm_placement!r} is not one of 'pre', 'post', 'sandwich'. Use "
                "norm.placement=pre (normalise before each sublayer, GPT-2), norm.placement=post (after the "
                "residual add, the original transformer) or norm.placement=sandwich (before each sublayer and "
                "on its output, Gemma 2)."
            )
        if not self.embed_scale > 0:
            raise ConfigError(
                f"model.embed_scale={self.embed_scale!r} must be positive (1 leaves the embeddings)."
            )
        if self.mlp_ratio is not None and self.mlp_ratio <= 0:
            raise ConfigError(f"model.mlp_ratio={self.mlp_ratio} must be positive (or null for the default).")
        self._validate_parametrization()
        self._validate_mlp()
        self.attention.check_depth(self.n_layer)
        self.mtp.check_model(self.block_size, self.param)
        scheme = positional.get(self.pos.name)
        self.attention.check_model(
            self.head_dim,
            self.pos.name,
            rotary=scheme.is_rotary,
            bias=scheme.bias is not positional.PositionalEncoding.bias,
            param=self.param,
            rotary_fraction=getattr(self.pos.options, "rotary_fraction", 1.0),
        )
        positional.get(self.pos.name).check_shape(
            self.pos.options, n_head=self.n_head, head_dim=self.head_dim, block_size=self.block_size
        )

    def _validate_parametrization(self) -> None:
        if self.param not in PARAMETRIZATIONS:
            raise ConfigError(
                f"model.param={self.param!r} is not one of {', '.join(PARAMETRIZATIONS)}: use model.param=standard "
                "or model.param=mup (with model.mup_base_width, the width the hyperparameters were tuned at)."
            )
        base = self.mup_base_width
        if isinstance(base, bool) or not isinstance(base, int) or base <= 0:
            raise ConfigError(
                f"model.mup_base_width={base!r} must be a positive integer: the n_embd the hyperparameters "
                "were tuned at (e.g. model.mup_base_width=128)."
            )
        if self.param == "mup" and base % self.n_head != 0:
            near = max(self.n_head, self.n_head * round(base / self.n_head))
            raise ConfigError(
                f"model.mup_base_width={base} is not divisible by model.n_head={self.n_head}: muP's attention "
                f"scale uses the base model's head width, mup_base_width / n_head. Use a multiple of "
                f"{self.n_head}, e.g. model.mup_base_width={near}."
            )

    def _validate_mlp(self) -> None:
        """The combinations a Mixture of Experts cannot honour here."""
        if self.mlp.name != "moe":
            return
        if self.param == "mup":
            raise ConfigError(
                "mlp=moe cannot take model.param=mup: muP's rules for the router and the experts' widths are "
                "not derived here, so learning rates tuned at the base width would not transfer. Use "
                "model.param=standard with mlp=moe, or mlp=dense with model.param=mup."
            )

    @property
    def gated(self) -> bool:
        """Whether the activation gates (and so wants the doubled first projection)."""
        return activations.get(self.activation.name).gated

    @classmethod
    def from_nodes(
        cls,
        model: dict[str, Any],
        pos: Any,
        activation: Any,
        norm: Any,
        attention: Any = None,
        mlp: Any = None,
    ) -> GPTConfig:
        """The config of the ``model``, ``pos``, ``activation``, ``norm``, ``attention`` and ``mlp`` config
        nodes (plain values): ``norm.placement`` is taken out of the norm's node, the rest of each node is its
        variant's options."""
        norm = dict(norm) if not isinstance(norm, (str, Choice)) else norm
        placement = norm.pop("placement", "pre") if isinstance(norm, dict) else "pre"
        check_keys(model, _MODEL_KEYS, "model", "model")
        return cls(
            **model,
            pos=pos,
            activation=activation,
            norm=norm,
            norm_placement=placement,
            attention=attention_variants.AttentionOptions.from_node(attention),
            mlp=mlp if mlp is not None else Choice("dense"),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain values: the sizes and switches, and each variant as its config node."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("pos", "activation", "norm", "mlp"):
            values[key] = getattr(self, key).node()
        values["attention"] = self.attention.node()
        values["mtp"] = self.mtp.node()
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """A config from ``to_dict``'s output, also as saved by earlier versions (checkpoints keep it)."""
        values = dict(values)
        for key in ("pos", "activation"):  # earlier: the name, and its options beside it
            if isinstance(values.get(key), str):
                values[key] = {"name": values[key], **(values.pop(f"{key}_options", None) or {})}
            else:
                values.pop(f"{key}_options", None)
        if isinstance(values.get("norm"), str):  # earlier: norm_eps and norm_bias beside the name
            norm: dict[str, Any] = {"name": values["norm"], "eps": values.pop("norm_eps", 1e-5)}
            bias = values.pop("norm_bias", None)
            if bias is not None or values["norm"] != "rmsnorm":
                norm["bias"] = bias
            values["norm"] = norm
        if isinstance(values.get("norm"), dict) and "placement" in values["norm"]:
            values["norm"] = dict(values["norm"])
            values["norm_placement"] = values["norm"].pop("placement")
        check_keys(values, [f.name for f in fields(cls)], "model", "model")
        return cls(**values)


_MODEL_KEYS = [
    f.name
    for f in fields(GPTConfig)
    if f.name not in ("pos", "activation", "norm", "norm_placement", "attention", "mlp", "mtp")
]

# The parametrisation: how weights are initialised and scaled with width.


def is_mup(config: GPTConfig) -> bool:
    return config.param == "mup"


def width_multiplier(config: GPTConfig) -> float:
    """m = n_embd / mup_base_width under muP, 1 in the standard parametrisation."""
    return config.n_embd / config.mup_base_width if is_mup(config) else 1.0


def hidden_init_std(config: GPTConfig) -> float:
    """The initial std of a hidden matrix: ``init_std`` standard, ``init_std / sqrt(m)`` under muP."""
    return config.init_std / math.sqrt(width_multiplier(config))


def hidden_lr_scale(config: GPTConfig) -> float:
    """The factor on Adam's learning rate for hidden matrices: 1 standard, ``1 / m`` under muP."""
    return 1.0 / width_multiplier(config)


def output_multiplier(config: GPTConfig) -> float:
    """The factor on the logits: 1 standard, ``1 / m`` under muP."""
    return 1.0 / width_multiplier(config)


def attention_scale(config: GPTConfig) -> float | None:
    """The factor on q.k: None (SDPA's 1/sqrt(head_dim)) standard; ``sqrt(base_head_dim) / head_dim`` under
    muP, which is 1/sqrt(head_dim) at the base width and falls as 1/head_dim with width."""
    if not is_mup(config):
        return None
    base_head_dim = config.mup_base_width / config.n_head
    return math.sqrt(base_head_dim) / config.head_dim
