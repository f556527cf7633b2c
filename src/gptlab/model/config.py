"""The model's configuration: plain, serialisable values, validated on construction.

Names, not classes, choose the variants (``pos="rope"``, ``activation="swiglu"``), so that a config can be
saved in a checkpoint, logged to W&B and rebuilt anywhere. This module imports no variant: each variant's
registry turns the name and its plain options into a typed ``Options`` dataclass where the variant is built
(``gptlab.model.gpt.check_config`` checks all of them at once, before any weight exists).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from gptlab.errors import ConfigError

# model.param: how weights and rates scale with width (model/parametrization.py).
PARAMETRIZATIONS = ("standard", "mup")


@dataclass
class GPTConfig:
    vocab_size: int = 50257
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
    # standard, or mup (model/parametrization.py): init, learning rates, logits and attention scaled with the
    # width relative to mup_base_width (Yang et al. 2022, "Tensor Programs V").
    param: str = "standard"
    mup_base_width: int = 128
    # Variant choices, each a name in its registry, with that variant's own options (plain values; the
    # variant's Options dataclass says which keys and types it takes).
    pos: str = "learned"
    pos_options: dict[str, Any] = field(default_factory=dict)
    activation: str = "gelu"
    activation_options: dict[str, Any] = field(default_factory=dict)
    norm: str = "layernorm"
    norm_placement: str = "pre"  # "pre" (GPT-2) or "post" (the original transformer)
    norm_eps: float = 1e-5
    norm_bias: bool | None = None  # None: the norms have a bias when ``bias`` is on (and the norm has one)

    def __post_init__(self) -> None:
        self.validate()

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
                raise ConfigError(f"model.{name}={value!r} must be a positive integer.")
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
        if self.norm_placement not in ("pre", "post"):
            raise ConfigError(
                f"norm.placement={self.norm_placement!r} is not one of 'pre', 'post'. Use norm.placement=pre "
                "(normalise before each sublayer, GPT-2) or norm.placement=post (after the residual add, "
                "the original transformer)."
            )
        if self.mlp_ratio is not None and self.mlp_ratio <= 0:
            raise ConfigError(f"model.mlp_ratio={self.mlp_ratio} must be positive (or null for the default).")
        self._validate_parametrization()
        for key in ("pos", "activation", "norm"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(f"{key}={getattr(self, key)!r} must be the name of a {key} choice.")
        for key in ("pos_options", "activation_options"):
            if not isinstance(getattr(self, key), dict):
                raise ConfigError(f"model {key}={getattr(self, key)!r} must be a mapping of option names.")

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPTConfig:
        """A config from ``to_dict``'s output, also as saved by earlier versions (checkpoints keep it). A
        variant may also be given as its config node, e.g. ``pos={"name": "rope", "base": 500.0}``."""
        values = dict(values)
        for key in ("pos", "activation"):
            node = values.get(key)
            if isinstance(node, dict):  # the YAML node shape: name plus the variant's options
                node = dict(node)
                values[key] = node.pop("name")
                values[f"{key}_options"] = {**values.get(f"{key}_options", {}), **node}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            import difflib

            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(
                f"Unknown model option(s): {', '.join(hints)}. Known options: {', '.join(sorted(known))}."
            )
        return cls(**values)
