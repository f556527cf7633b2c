"""Normalisation layers for Add & Norm, registered by name (``norm=...``).

A norm is built from the width it normalises and its own options, the ``Options`` dataclass of its class
(``norm.eps``, and for LayerNorm ``norm.bias``): ``RMSNorm(dim, options)``. A norm with a new option declares
it in its ``Options`` and reads it from there; nothing else changes. ``norm.placement`` (pre, post or sandwich) is the
block's, not the norm's. Each class also states how many parameters it holds (``parameter_count``), so that
the model card can count a model without building it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptlab.errors import ConfigError
from gptlab.registry import Registry

REGISTRY: Registry[type[Norm]] = Registry("norm", "norm")
register = REGISTRY.register
get = REGISTRY.get
names = REGISTRY.names


@dataclass(frozen=True)
class NormOptions:
    """What every norm takes: the epsilon added to the variance (or mean square)."""

    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.eps <= 0:
            raise ConfigError(f"norm.eps={self.eps!r} must be positive (1e-5 is usual).")


class Norm(nn.Module):
    """Base class of the norms: built from the normalised width and the norm's own options."""

    Options: ClassVar[type] = NormOptions

    def __init__(self, dim: int, options: Any = None) -> None:
        super().__init__()
        self.dim = dim
        self.options = options if options is not None else self.Options()

    @classmethod
    def parameter_count(cls, dim: int, options: Any) -> int:
        """Parameters of one norm of width ``dim``, for the model card; by default counted on the meta
        device (no memory)."""
        with torch.device("meta"):
            return sum(p.numel() for p in cls(dim, options).parameters())


@register("layernorm")
class LayerNorm(Norm):
    """(x - mean) / sqrt(var + eps) * gain (+ bias) over the feature dimension (Ba et al. 2016, "Layer
    Normalization"). ``norm.bias`` null follows ``model.bias``."""

    @dataclass(frozen=True)
    class Options(NormOptions):
        bias: bool | None = None  # None: follow model.bias (the model config resolves it)

    def __init__(self, dim: int, options: Any = None) -> None:
        super().__init__(dim, options)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if self.options.bias is not False else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.options.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @classmethod
    def parameter_count(cls, dim: int, options: Any) -> int:
        return dim * (1 if options.bias is False else 2)


@register("rmsnorm")
class RMSNorm(Norm):
    """x / sqrt(mean(x^2) + eps) * gain: no centring and no bias (Zhang & Sennrich 2019, "Root Mean Square
    Layer Normalization"), as in T5, Gopher and Llama."""

    def __init__(self, dim: int, options: Any = None) -> None:
        super().__init__(dim, options)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (self.dim,), self.weight, self.options.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    @classmethod
    def parameter_count(cls, dim: int, options: Any) -> int:
        return dim


def build(choice: Any, dim: int) -> Norm:
    """The chosen norm (a :class:`~gptlab.registry.Choice`) at width ``dim``."""
    return get(choice.name)(dim, choice.options)
