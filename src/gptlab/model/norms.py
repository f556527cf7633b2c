"""Normalisation layers for Add & Norm, registered by name (``norm=...``).

A norm's options (``norm.eps``, ``norm.bias``) are its ``Options`` dataclass, built from the model config's
``norm_eps``/``norm_bias``; ``norm.placement`` (pre or post) is the block's, not the norm's. Each class also
states how many parameters it holds for a config (``parameter_count``), so that the model card can count a
model without building it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptlab.errors import ConfigError
from gptlab.registry import Registry

if TYPE_CHECKING:
    from gptlab.model.config import GPTConfig

REGISTRY: Registry[type[nn.Module]] = Registry("norm", "norm")
register = REGISTRY.register
get = REGISTRY.get
names = REGISTRY.names


@dataclass(frozen=True)
class NormOptions:
    eps: float = 1e-5
    bias: bool | None = None  # None: follow model.bias

    def __post_init__(self) -> None:
        if self.eps <= 0:
            raise ConfigError(f"norm.eps={self.eps!r} must be positive (1e-5 is usual).")


def check(config: GPTConfig) -> Any:
    """The typed options of ``config``'s norm; raises a ConfigError for an unknown norm or option."""
    return REGISTRY.build_options(config.norm, {"eps": config.norm_eps, "bias": config.norm_bias})


def build(config: GPTConfig) -> nn.Module:
    check(config)
    return get(config.norm)(config)


def has_bias(config: GPTConfig) -> bool:
    """``norm.bias`` when set, otherwise the model's ``bias`` switch."""
    return config.bias if config.norm_bias is None else config.norm_bias


@register("layernorm")
class LayerNorm(nn.LayerNorm):
    """(x - mean) / sqrt(var + eps) * gain (+ bias) over the feature dimension (Ba et al. 2016, "Layer
    Normalization"). The bias follows ``model.bias`` unless ``norm.bias`` says otherwise."""

    Options = NormOptions

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.n_embd, eps=config.norm_eps, bias=has_bias(config))

    @staticmethod
    def parameter_count(config: GPTConfig) -> int:
        return config.n_embd * (2 if has_bias(config) else 1)


@register("rmsnorm")
class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * gain: no centring and no bias (Zhang & Sennrich 2019, "Root Mean Square
    Layer Normalization"), as in T5, Gopher and Llama."""

    @dataclass(frozen=True)
    class Options(NormOptions):
        def __post_init__(self) -> None:
            super().__post_init__()
            if self.bias:
                raise ConfigError(
                    "norm=rmsnorm has no bias (it neither centres nor shifts), but norm.bias=true was given. "
                    "Drop norm.bias, or use norm=layernorm norm.bias=true for a norm with a bias."
                )

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.eps = config.norm_eps
        self.weight = nn.Parameter(torch.ones(config.n_embd))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    @staticmethod
    def parameter_count(config: GPTConfig) -> int:
        return config.n_embd
