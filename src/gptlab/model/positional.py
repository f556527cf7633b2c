"""Positional encodings: how the model learns where each token stands.

Schemes act in three different places, so every scheme implements the same three hooks, each a no-op by
default, and the model always calls all three:

- ``embed(x, positions)``: add a position vector to the token embeddings (learned, sinusoidal);
- ``rotate(q, k, positions)``: transform queries and keys inside attention (rotary schemes);
- ``bias(q_positions, k_positions)``: an additive attention bias per head (ALiBi, T5 relative buckets).

A scheme that returns no bias keeps the fused causal path of ``scaled_dot_product_attention``. A new scheme
is one class here (registered by name) plus one YAML under ``conf/pos/``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from gptlab.errors import ConfigError
from gptlab.registry import Registry

if TYPE_CHECKING:
    from gptlab.model.config import GPTConfig

REGISTRY: Registry[type[PositionalEncoding]] = Registry("positional encoding", "pos")
register = REGISTRY.register
get = REGISTRY.get
names = REGISTRY.names


class PositionalEncoding(nn.Module):
    """Base class: every hook is the identity, so a scheme overrides only the places it acts."""

    #: The largest number of positions the scheme can represent, or None when any position works.
    max_positions: int | None = None
    #: Options this scheme accepts under ``pos.*`` (besides ``name``), with their defaults.
    options: dict[str, object] = {}

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        for key, default in self.options.items():
            setattr(self, key, config.pos_options.get(key, default))

    @classmethod
    def check_config(cls, config: GPTConfig) -> None:
        unknown = sorted(set(config.pos_options) - set(cls.options))
        if unknown:
            allowed = ", ".join(f"pos.{k}" for k in cls.options) or "none"
            raise ConfigError(
                f"pos={config.pos} does not take option(s) {', '.join('pos.' + k for k in unknown)}. "
                f"Its options: {allowed}."
            )

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (B, T, n_embd) token embeddings; positions: (T,) absolute positions."""
        return x

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """q: (B, n_head, T, head_dim), k: (B, n_kv_head, T, head_dim), both at ``positions``."""
        return q, k

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """An additive attention bias of shape (n_head, Tq, Tk), or None for no bias."""
        return None

    def check_positions(self, end: int) -> None:
        """Raise a clear error when positions up to ``end`` (exclusive) are out of the scheme's range."""
        if self.max_positions is not None and end > self.max_positions:
            raise ValueError(
                f"pos={self.config.pos} has a table of {self.max_positions} positions, but a sequence needs "
                f"{end}. Keep sequences within model.block_size={self.max_positions}, raise model.block_size "
                f"before training, or train with a scheme that extrapolates (pos=sinusoidal, pos=nope)."
            )


@register("learned")
class LearnedPositionalEncoding(PositionalEncoding):
    """A trained table of ``block_size`` position vectors added to the token embeddings (GPT-2;
    Radford et al. 2019, "Language Models are Unsupervised Multitask Learners")."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.max_positions = config.block_size
        self.wpe = nn.Embedding(config.block_size, config.n_embd)

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        self.check_positions(int(positions[-1]) + 1)
        return x + self.wpe(positions)


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
    You Need", section 3.5). Defined for every position, so it also runs past ``block_size``."""

    options = {"base": 10000.0}

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        positions = torch.arange(config.block_size)
        # Not persistent: the table is a function of the config, not a learned state.
        self.register_buffer("table", sinusoidal_table(positions, config.n_embd, self.base), persistent=False)

    @classmethod
    def check_config(cls, config: GPTConfig) -> None:
        super().check_config(config)
        base = config.pos_options.get("base", 10000.0)
        if not isinstance(base, (int, float)) or base <= 1:
            raise ConfigError(f"pos.base={base!r} must be a number greater than 1 (the paper uses 10000).")

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        end = int(positions[-1]) + 1
        if end <= self.table.size(0):
            pe = self.table[positions]
        else:
            pe = sinusoidal_table(positions, self.config.n_embd, self.base).to(self.table.device)
        return x + pe.to(x.dtype)


@register("nope")
class NoPositionalEncoding(PositionalEncoding):
    """No positional information at all: causal attention alone orders the tokens (Kazemnejad et al. 2023,
    "The Impact of Positional Encoding on Length Generalization in Transformers")."""
