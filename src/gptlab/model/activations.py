"""Feed-forward non-linearities, one small class each, registered by name (``activation=...``).

A gated activation receives the first projection at twice the hidden width, splits it into a gate and a
value, and returns ``f(gate) * value`` at the hidden width; it declares ``gated = True`` so that the MLP
builds the wider projection. The split is [gate | value] along the last dimension: the first half of
``c_fc``'s output rows is the gate (Llama's ``gate_proj``), the second half the value (``up_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptlab.registry import NoOptions, Registry

REGISTRY: Registry[type[Activation]] = Registry("activation", "activation")
register = REGISTRY.register
get = REGISTRY.get
names = REGISTRY.names


def is_gated(name: str) -> bool:
    return get(name).gated


def build(choice: Any) -> Activation:
    """The chosen activation (a :class:`~gptlab.registry.Choice`), with its options."""
    return get(choice.name)(choice.options)


class Activation(nn.Module):
    """Base class: ``Options`` are the ``activation.*`` keys the activation takes (none by default);
    ``gated`` says whether it wants the doubled projection."""

    Options: ClassVar[type] = NoOptions
    gated: ClassVar[bool] = False

    def __init__(self, options: Any = None) -> None:
        super().__init__()
        self.options = options if options is not None else self.Options()


@register("relu")
class ReLU(Activation):
    """max(0, x): the original transformer's FFN (Vaswani et al. 2017; Nair & Hinton 2010)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


@register("gelu")
class GELU(Activation):
    """x * Phi(x), the exact Gaussian error linear unit (Hendrycks & Gimpel 2016, "Gaussian Error Linear
    Units (GELUs)")."""

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x)


@register("gelu_tanh")
class GELUTanh(Activation):
    """GELU through its tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Hendrycks &
    Gimpel 2016, section 2), the form GPT-2 was trained with (Hugging Face calls it ``gelu_new``)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")


@register("sigmoid")
class Sigmoid(Activation):
    """1 / (1 + e^-x): the classic squashing non-linearity, kept as a baseline (Rumelhart et al. 1986)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(x)


@register("silu")
class SiLU(Activation):
    """x * sigmoid(x), the sigmoid-weighted linear unit (Elfwing et al. 2018; "Swish" with beta = 1 in
    Ramachandran et al. 2017, "Searching for Activation Functions")."""

    def forward(self, x: Tensor) -> Tensor:
        return F.silu(x)


@register("relu2")
class SquaredReLU(Activation):
    """max(0, x)^2, squared ReLU (So et al. 2021, "Primer: Searching for Efficient Transformers for Language
    Modeling")."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x).square()


class GatedLinearUnit(Activation):
    """f(gate) * value over the two halves of the doubled projection (Dauphin et al. 2017 with f = sigmoid;
    Shazeer 2020, "GLU Variants Improve Transformer", for the other choices of f). Subclasses set ``gate``."""

    gated = True

    def gate(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        gate, value = x.chunk(2, dim=-1)  # (..., 2 * hidden) -> 2 x (..., hidden)
        return self.gate(gate) * value


@register("swiglu")
class SwiGLU(GatedLinearUnit):
    """Swish(gate) * value (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6), as in PaLM and Llama."""

    def gate(self, x: Tensor) -> Tensor:
        return F.silu(x)


@register("geglu")
class GeGLU(GatedLinearUnit):
    """GELU(gate) * value (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6), with the exact GELU, or
    with ``activation.approximate=tanh`` its tanh form (as Gemma's feed-forward)."""

    @dataclass(frozen=True)
    class Options:
        approximate: Literal["none", "tanh"] = "none"

    def gate(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate=self.options.approximate)


@register("reglu")
class ReGLU(GatedLinearUnit):
    """max(0, gate) * value (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6)."""

    def gate(self, x: Tensor) -> Tensor:
        return F.relu(x)
