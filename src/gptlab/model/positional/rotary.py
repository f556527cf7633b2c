"""Rotary schemes: rotate query/key dimension pairs by position-proportional angles, so that attention
scores depend on the distance between tokens."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from gptlab.errors import ConfigError
from gptlab.model.positional.base import PositionalEncoding, register

ROPE_SCALINGS = ("none", "linear", "ntk", "yarn")


def rope_inverse_frequencies(
    rotary_dim: int,
    base: float,
    scaling: str = "none",
    factor: float = 1.0,
    original_context: int = 2048,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> tuple[Tensor, float]:
    """theta_i = base^(-2i/d) for i < d/2, adjusted for a context ``factor`` times the training one.

    Returns the (rotary_dim/2,) inverse frequencies and a factor for cos/sin (YaRN's attention temperature,
    1 otherwise). ``linear``: positions / factor, i.e. theta_i / factor (Chen et al. 2023, "Extending Context
    Window of Large Language Models via Positional Interpolation"). ``ntk``: base * factor^(d/(d-2)), which
    keeps the highest frequency and interpolates the lowest (bloc97 2023, "NTK-Aware Scaled RoPE").
    ``yarn``: interpolate only dimensions whose wavelength is long against the training context, keep the
    short ones, ramp in between, and scale the logits by (0.1 ln(factor) + 1)^2 (Peng et al. 2023, "YaRN:
    Efficient Context Window Extension of Large Language Models", eq. 17-22).
    """
    d = rotary_dim
    exponent = torch.arange(0, d, 2, dtype=torch.float64) / d  # (d/2,)
    if scaling == "none" or factor <= 1.0:
        return base**-exponent, 1.0
    if scaling == "linear":
        return base**-exponent / factor, 1.0
    if scaling == "ntk":
        return (base * factor ** (d / (d - 2))) ** -exponent, 1.0
    if scaling == "yarn":
        theta = base**-exponent
        rotations = original_context * theta / (2 * math.pi)  # r = L / wavelength: turns over the context
        keep = ((rotations - beta_slow) / (beta_fast - beta_slow)).clamp(0.0, 1.0)  # gamma: 1 keeps theta
        return theta * keep + theta / factor * (1 - keep), 0.1 * math.log(factor) + 1.0
    raise ValueError(f"unknown RoPE scaling {scaling!r}")


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs (x[i], x[i + d/2]) by the angles whose cos/sin are given; x: (..., T, d)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


@register("rope")
class RotaryPositionalEncoding(PositionalEncoding):
    """Rotary position embedding: rotate each pair of query/key dimensions by an angle proportional to the
    position, so that q_i . k_j depends on i - j only (Su et al. 2021, "RoFormer: Enhanced Transformer with
    Rotary Position Embedding"). ``rotary_fraction`` < 1 rotates only the first part of each head (GPT-NeoX).

    ``scaling`` (none, linear, ntk, yarn) with ``scale_factor`` > 1 stretches the rotations for contexts
    longer than the training one; the length evaluation sets both per context with ``scaled(...)``.
    """

    @dataclass(frozen=True)
    class Options:
        base: float = 10000.0
        rotary_fraction: float = 1.0
        scaling: Literal["none", "linear", "ntk", "yarn"] = "none"
        scale_factor: float = 1.0
        beta_fast: float = 32.0
        beta_slow: float = 1.0

        def __post_init__(self) -> None:
            if not 0 < self.rotary_fraction <= 1:
                raise ConfigError(
                    f"pos.rotary_fraction={self.rotary_fraction!r} must be in (0, 1] (1 rotates whole heads)."
                )
            if self.base <= 1:
                raise ConfigError(f"pos.base={self.base!r} must be greater than 1 (the paper uses 10000).")
            if self.scale_factor < 1:
                raise ConfigError(
                    f"pos.scale_factor={self.scale_factor!r} must be a number >= 1: the evaluation context "
                    "over the training context (1 leaves the rotations as trained)."
                )
            if not self.beta_fast > self.beta_slow > 0:
                raise ConfigError(
                    f"pos.beta_fast={self.beta_fast} must exceed pos.beta_slow={self.beta_slow} > 0 "
                    "(YaRN uses 32 and 1)."
                )

    is_rotary = True
    context_scalings = tuple(s for s in ROPE_SCALINGS if s != "none")

    def __init__(self, options: Any = None, *, n_head: int, head_dim: int, block_size: int) -> None:
        super().__init__(options, n_head=n_head, head_dim=head_dim, block_size=block_size)
        self.rotary_dim = rotary_dim(head_dim, self.options.rotary_fraction)
        self._cached: tuple[object, Tensor, float] | None = None  # (options, inverse frequencies, mscale)

    @classmethod
    def check_shape(cls, options: Any, *, n_head: int, head_dim: int, block_size: int) -> None:
        if head_dim % 2:
            raise ConfigError(
                f"pos={cls.choice_name} needs an even head dimension (it rotates pairs of dimensions), got "
                f"n_embd/n_head = {n_head * head_dim}/{n_head} = {head_dim}. Choose n_embd and "
                f"n_head so that n_embd/n_head is even (e.g. model.n_embd={n_head * (head_dim + 1)})."
            )
        if rotary_dim(head_dim, options.rotary_fraction) < 2:
            raise ConfigError(
                f"pos.rotary_fraction={options.rotary_fraction} of head dimension {head_dim} leaves no "
                f"pair to rotate: raise pos.rotary_fraction to at least {2 / head_dim:.3g}."
            )

    @contextmanager
    def scaled(self, factor: float, method: str) -> Iterator[RotaryPositionalEncoding]:
        with super().scaled(factor, method):
            trained = self.options
            self.options = dataclasses.replace(trained, scaling=method, scale_factor=float(factor))
            try:
                yield self
            finally:
                self.options = trained

    def frequencies(self, device: torch.device) -> tuple[Tensor, float]:
        o = self.options
        if self._cached is None or self._cached[0] != o or self._cached[1].device != device:
            inv_freq, mscale = rope_inverse_frequencies(
                self.rotary_dim,
                o.base,
                o.scaling,
                o.scale_factor,
                self.block_size,
                o.beta_fast,
                o.beta_slow,
            )
            self._cached = (o, inv_freq.to(device), mscale)
        return self._cached[1], self._cached[2]

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq, mscale = self.frequencies(q.device)
        # (T, rotary_dim/2), or with per-document positions (B, T, rotary_dim/2)
        angles = positions.to(torch.float64)[..., None] * inv_freq
        if angles.dim() == 3:
            angles = angles[:, None]  # (B, 1, T, rotary_dim/2): the same angles for every head
        cos = (angles.cos() * mscale).to(q.dtype)
        sin = (angles.sin() * mscale).to(q.dtype)
        r = self.rotary_dim
        q = torch.cat([rotate_half(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([rotate_half(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        return q, k


@register("xpos")
class XPosPositionalEncoding(RotaryPositionalEncoding):
    """RoPE with an exponential decay: pair i of a query at position n is scaled by zeta_i^(n/scale_base) and of
    a key at m by zeta_i^(-m/scale_base), zeta_i = (2i/d + gamma) / (1 + gamma), so the score still depends on
    n - m only and fades with distance, fastest for the fast-rotating pairs (Sun et al. 2022, "A
    Length-Extrapolatable Transformer"). Positions are not re-centred, so keep n / scale_base moderate
    (at 8 x 512 positions the key scale reaches about 2e4, fine in fp32)."""

    @dataclass(frozen=True)
    class Options(RotaryPositionalEncoding.Options):
        scale_base: float = 512.0
        gamma: float = 0.4

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.scale_base <= 0:
                raise ConfigError(
                    f"pos.scale_base={self.scale_base!r} must be positive (the paper uses 512)."
                )
            if self.gamma <= 0:
                raise ConfigError(f"pos.gamma={self.gamma!r} must be positive (the paper uses 0.4).")

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        q, k = super().rotate(q, k, positions)
        r, gamma = self.rotary_dim, self.options.gamma
        zeta = (torch.arange(0, r, 2, dtype=torch.float64, device=q.device) / r + gamma) / (1 + gamma)
        power = positions.to(torch.float64)[..., None] / self.options.scale_base  # (T, 1) or (B, T, 1)
        decay = zeta**power  # (T, r/2) or (B, T, r/2)
        if decay.dim() == 3:
            decay = decay[:, None]  # per-document positions: one decay for every head
        decay = torch.cat([decay, decay], dim=-1)  # rotate_half pairs dimension i with i + r/2
        q = torch.cat([q[..., :r] * decay.to(q.dtype), q[..., r:]], dim=-1)
        k = torch.cat([k[..., :r] / decay.to(k.dtype), k[..., r:]], dim=-1)
        return q, k


def rotary_dim(head_dim: int, fraction: float) -> int:
    """The rotated part of each head: ``fraction`` of head_dim, rounded down to an even number."""
    return int(head_dim * fraction) // 2 * 2
