"""Normalisation layers for Add & Norm, registered by name (``norm=...``).

Each class also states how many parameters it holds for a config (``parameter_count``), so that the model
card can count a model without building it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def build(config: GPTConfig) -> nn.Module:
    return get(config.norm)(config)


def has_bias(config: GPTConfig) -> bool:
    """``norm.bias`` when set, otherwise the model's ``bias`` switch."""
    return config.bias if config.norm_bias is None else config.norm_bias


@register("layernorm")
class LayerNorm(nn.LayerNorm):
    """(x - mean) / sqrt(var + eps) * gain (+ bias) over the feature dimension (Ba et al. 2016, "Layer
    Normalization"). The bias follows ``model.bias`` unless ``norm.bias`` says otherwise."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.n_embd, eps=config.norm_eps, bias=has_bias(config))

    @staticmethod
    def parameter_count(config: GPTConfig) -> int:
        return config.n_embd * (2 if has_bias(config) else 1)

    @classmethod
    def check_config(cls, config: GPTConfig) -> None:
        pass


@register("rmsnorm")
class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * gain: no centring and no bias (Zhang & Sennrich 2019, "Root Mean Square
    Layer Normalization"), as in T5, Gopher and Llama."""

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

    @classmethod
    def check_config(cls, config: GPTConfig) -> None:
        if config.norm_bias:
            raise ConfigError(
                "norm=rmsnorm has no bias (it neither centres nor shifts), but norm.bias=true was given. "
                "Drop norm.bias, or use norm=layernorm norm.bias=true for a norm with a bias."
            )
