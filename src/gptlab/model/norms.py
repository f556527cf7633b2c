"""Normalisation layers for Add & Norm, registered by name (``norm=...``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from gptlab.registry import Registry

if TYPE_CHECKING:
    from gptlab.model.config import GPTConfig

REGISTRY: Registry[type[nn.Module]] = Registry("norm", "norm")
register = REGISTRY.register
get = REGISTRY.get
names = REGISTRY.names


def build(config: GPTConfig) -> nn.Module:
    return get(config.norm)(config)


@register("layernorm")
class LayerNorm(nn.LayerNorm):
    """Layer normalisation over the feature dimension, with a gain and (optionally) a bias
    (Ba et al. 2016, "Layer Normalization")."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.n_embd, eps=config.norm_eps, bias=config.bias)
