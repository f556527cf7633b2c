"""The options of the studies run after training (the ``eval_length`` node and its ``passkey`` node), apart
from the studies themselves so that the config tree reads them without importing a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gptlab.errors import ConfigError
from gptlab.registry import build_options

DEFAULT_FACTORS = (1, 2, 4, 8)
ROPE_SCALINGS = ("linear", "ntk", "yarn")  # the context-scaling methods studied, where the scheme has them


@dataclass
class LengthEvalOptions:
    """The ``eval_length`` config node."""

    factors: Sequence[int] = DEFAULT_FACTORS
    max_tokens: int | None = None  # validation tokens to use (None: all of them)
    batch_tokens: int = 4096  # tokens per forward pass; the batch shrinks as the context grows
    rope_scalings: Sequence[str] = ROPE_SCALINGS

    def __post_init__(self) -> None:
        factors = list(self.factors)
        if not factors or any(not isinstance(f, int) or f < 1 for f in factors):
            raise ConfigError(
                f"eval_length.factors={factors!r} must be a non-empty list of positive integers "
                "(multiples of the training context, e.g. [1, 2, 4, 8])."
            )
        self.factors = sorted(set(factors))
        bad = [s for s in self.rope_scalings if s not in ROPE_SCALINGS]
        if bad:
            raise ConfigError(
                f"eval_length.rope_scalings has {bad}; allowed: {list(ROPE_SCALINGS)} (or [] for none)."
            )
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 2):
            raise ConfigError(f"eval_length.max_tokens={self.max_tokens!r} must be an integer >= 2 or null.")
        if not isinstance(self.batch_tokens, int) or self.batch_tokens < 1:
            raise ConfigError(f"eval_length.batch_tokens={self.batch_tokens!r} must be a positive integer.")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> LengthEvalOptions:
        values = dict(values or {})
        values.pop("enabled", None)
        values.pop("passkey", None)  # the passkey study's own node (gptlab.evaluation.passkey)
        return build_options(cls, values, "eval_length", "eval_length")


@dataclass
class PasskeyOptions:
    """The ``eval_length.passkey`` config node; lengths are ``eval_length.factors`` x the training context."""

    enabled: bool = True
    depths: int = 4  # equal bins of the filler; the key's depth is drawn uniformly inside each
    trials: int = 5  # prompts per (length, depth bin)
    seed: int = 0
    key_digits: int = 5
    batch_tokens: int = 16384  # tokens per forward pass

    def __post_init__(self) -> None:
        for name in ("depths", "trials", "key_digits", "batch_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"eval_length.passkey.{name}={value!r} must be a positive integer.")
        if not isinstance(self.seed, int):
            raise ConfigError(f"eval_length.passkey.seed={self.seed!r} must be an integer.")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> PasskeyOptions:
        values = dict(values or {})
        return build_options(cls, values, "eval_length.passkey", "eval_length.passkey")
