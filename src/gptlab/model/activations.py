"""Feed-forward non-linearities, one small class each, registered by name (``activation=...``).

A gated activation receives the first projection at twice the hidden width, splits it into a gate and a
value, and returns ``f(gate) * value`` at the hidden width; it declares ``gated = True`` so that the MLP
builds the wider projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptlab.registry import Registry

REGISTRY: Registry[type[nn.Module]] = Registry("activation", "activation")
register = REGISTRY.register
get = REGISTRY.get
names = REGISTRY.names


def is_gated(name: str) -> bool:
    return bool(getattr(get(name), "gated", False))


@register("relu")
class ReLU(nn.Module):
    """max(0, x): the original transformer's FFN (Vaswani et al. 2017; Nair & Hinton 2010)."""

    gated = False

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


@register("gelu")
class GELU(nn.Module):
    """x * Phi(x), the exact Gaussian error linear unit (Hendrycks & Gimpel 2016)."""

    gated = False

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x)


@register("sigmoid")
class Sigmoid(nn.Module):
    """1 / (1 + e^-x): the classic squashing non-linearity, kept as a baseline (Rumelhart et al. 1986)."""

    gated = False

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(x)
