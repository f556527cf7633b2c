"""Absolute schemes: a vector per position added to the token embeddings, or nothing at all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gptlab.errors import ConfigError
from gptlab.model.positional.base import PositionalEncoding, register


@register("learned")
class LearnedPositionalEncoding(PositionalEncoding):
    """A trained table of ``block_size`` position vectors added to the token embeddings (GPT-2;
    Radford et al. 2019, "Language Models are Unsupervised Multitask Learners")."""

    extrapolates = False

    def __init__(self, options: Any = None, *, n_head: int, head_dim: int, block_size: int) -> None:
        super().__init__(options, n_head=n_head, head_dim=head_dim, block_size=block_size)
        self.wpe = nn.Embedding(block_size, self.n_embd)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        self.check_positions(self.end_of(positions))
        return x + self.wpe(positions)

    def position_vectors(self, n: int) -> Tensor:
        return self.wpe.weight[: min(n, self.block_size)]


def sinusoidal_table(positions: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(pos / base^(2i/d)); shape (T, dim)."""
    i = torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)
    inv_freq = base ** (-i / dim)  # (ceil(dim/2),)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, ceil(dim/2))
    table = torch.empty(positions.numel(), dim, dtype=torch.float64, device=positions.device)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : dim // 2])
    return table.to(torch.get_default_dtype())


@register("sinusoidal")
class SinusoidalPositionalEncoding(PositionalEncoding):
    """The fixed sine/cosine table added to the token embeddings (Vaswani et al. 2017, "Attention Is All
    You Need", section 3.5). Defined for every position, so it also runs past ``block_size``.

    The paper multiplies the token embeddings by sqrt(n_embd) (section 3.4) before adding the table; here the
    token embeddings keep GPT-2's scale, so the table is multiplied by ``scale`` = 1/sqrt(n_embd) by default,
    which gives the paper's ratio of the two. Unscaled (``scale=1``), entries of size ~0.7 swamp embeddings
    of size 0.02 at initialisation."""

    @dataclass(frozen=True)
    class Options:
        base: float = 10000.0
        scale: float | None = None  # None: 1/sqrt(n_embd)

        def __post_init__(self) -> None:
            if self.base <= 1:
                raise ConfigError(f"pos.base={self.base!r} must be greater than 1 (the paper uses 10000).")
            if self.scale is not None and self.scale <= 0:
                raise ConfigError(
                    f"pos.scale={self.scale!r} must be positive, or null for 1/sqrt(n_embd) (the paper's ratio)."
                )

    table: Tensor  # (block_size, n_embd) buffer

    def __init__(self, options: Any = None, *, n_head: int, head_dim: int, block_size: int) -> None:
        super().__init__(options, n_head=n_head, head_dim=head_dim, block_size=block_size)
        positions = torch.arange(block_size)
        # Not persistent: the table is a function of the config, not a learned state.
        table = sinusoidal_table(positions, self.n_embd, self.options.base)
        self.register_buffer("table", table, persistent=False)

    @property
    def multiplier(self) -> float:
        scale = self.options.scale
        return scale if scale is not None else self.n_embd**-0.5

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        if self.end_of(positions) <= self.table.size(0):
            pe = self.table[positions]  # (T, n_embd) or, per document, (B, T, n_embd)
        else:
            pe = sinusoidal_table(positions.flatten(), self.n_embd, self.options.base).to(self.table.device)
            pe = pe.view(*positions.shape, self.n_embd)
        return x + (pe * self.multiplier).to(x.dtype)

    def position_vectors(self, n: int) -> Tensor:
        return sinusoidal_table(torch.arange(n), self.n_embd, self.options.base) * self.multiplier


@register("nope")
class NoPositionalEncoding(PositionalEncoding):
    """No positional information at all: causal attention alone orders the tokens (Kazemnejad et al. 2023,
    "The Impact of Positional Encoding on Length Generalization in Transformers")."""
