"""Bias schemes: no position vectors; an additive bias on the attention score of query i on key j, one per
head. The bias depends on the positions only, so the model computes it once per forward pass."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gptlab.errors import ConfigError
from gptlab.model.positional.base import BiasRows, PositionalEncoding, ScoreMod, register


def alibi_slopes(n_head: int) -> Tensor:
    """ALiBi's head slopes: for n a power of two, the geometric sequence starting at 2^(-8/n) with that
    ratio (8 heads: 1/2, 1/4, ..., 1/256). Otherwise the slopes of the closest smaller power of two m,
    followed by every other slope of 2m until there are n (Press et al. 2021, section 3 and their code)."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    m = 2 ** math.floor(math.log2(n_head))
    slopes = power_of_two(m)
    if m < n_head:
        slopes += power_of_two(2 * m)[0::2][: n_head - m]
    return torch.tensor(slopes)


@register("alibi")
class ALiBiPositionalEncoding(PositionalEncoding):
    """Attention with Linear Biases: no position vectors; each head subtracts slope * (i - j) from the score
    of query i on key j (Press et al. 2021, "Train Short, Test Long: Attention with Linear Biases Enables
    Input Length Extrapolation")."""

    slopes: Tensor  # (n_head,) buffer

    def __init__(self, options: Any = None, *, n_head: int, head_dim: int, block_size: int) -> None:
        super().__init__(options, n_head=n_head, head_dim=head_dim, block_size=block_size)
        self.register_buffer("slopes", alibi_slopes(n_head), persistent=False)  # (n_head,)

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        distance = (q_positions[:, None] - k_positions[None, :]).to(self.slopes.dtype)  # (Tq, Tk)
        return -self.slopes[:, None, None] * distance  # (n_head, Tq, Tk)

    def score_mod(self, q_positions: Tensor, k_positions: Tensor) -> ScoreMod:
        # Closed form, no (n_head, Tq, Tk) tensor: the bias is -slope * (i - j), never +.
        slopes, offset = self.slopes, int(q_positions[0]) - int(k_positions[0])

        def alibi(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score - slopes[h] * (q_idx + offset - kv_idx)

        return alibi


def distance_table_rows(per_distance: Tensor, q_positions: Tensor, k_positions: Tensor) -> BiasRows:
    """The rows of a bias that depends on the distance q - k alone, read from its (n_head, >= Tk) table per
    distance 0, 1, ...; keys in the future read distance 0's entry (the mask hides them)."""

    def rows(start: int, end: int, keys: int) -> Tensor:
        distance = (q_positions[start:end, None] - k_positions[None, :keys]).clamp_min(0)  # (rows, keys)
        return per_distance[:, distance]  # (n_head, rows, keys)

    return rows


def t5_relative_buckets(relative_position: Tensor, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """Causal T5 buckets of distance n = max(i - j, 0): n itself below num_buckets/2, then logarithmically
    wider buckets up to max_distance, past which every distance shares the last bucket (Raffel et al. 2020,
    "Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer", section 2.1)."""
    n = (-relative_position).clamp_min(0)  # relative_position = j - i; distance into the past
    exact = num_buckets // 2
    log_ratio = torch.log(n.float().clamp_min(1) / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (num_buckets - exact)).long()
    far = far.clamp_max(num_buckets - 1)
    return torch.where(n < exact, n, far)


@register("relative")
class T5RelativePositionalEncoding(PositionalEncoding):
    """A learned scalar per head and distance bucket, added to the attention scores; one table shared by all
    layers, causal buckets (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified
    Text-to-Text Transformer"; buckets after Shaw et al. 2018)."""

    @dataclass(frozen=True)
    class Options:
        num_buckets: int = 32
        max_distance: int = 128  # distances from here on share the last bucket

        def __post_init__(self) -> None:
            if self.num_buckets < 4:
                raise ConfigError(
                    f"pos.num_buckets={self.num_buckets!r} must be an integer >= 4 (T5 uses 32)."
                )
            if self.max_distance <= self.num_buckets // 2:
                raise ConfigError(
                    f"pos.max_distance={self.max_distance!r} must be an integer larger than pos.num_buckets/2 "
                    f"= {self.num_buckets // 2} (T5 uses 128 with 32 buckets)."
                )

    def __init__(self, options: Any = None, *, n_head: int, head_dim: int, block_size: int) -> None:
        super().__init__(options, n_head=n_head, head_dim=head_dim, block_size=block_size)
        self.relative_attention_bias = nn.Embedding(self.options.num_buckets, n_head)

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        return self.bias_rows(q_positions, k_positions)(0, len(q_positions), len(k_positions))

    def bias_rows(self, q_positions: Tensor, k_positions: Tensor) -> BiasRows:
        o = self.options
        # The bias is a function of the distance alone: look it up once per distance 0..Tk-1, then spread it
        # over each block's (rows, keys) pairs (keys in the future get distance 0; they are masked anyway).
        d = torch.arange(len(k_positions), device=k_positions.device)  # (Tk,)
        buckets = t5_relative_buckets(-d, o.num_buckets, o.max_distance)
        per_distance = self.relative_attention_bias(buckets).T  # (n_head, Tk)
        return distance_table_rows(per_distance, q_positions, k_positions)


@register("fire")
class FIREPositionalEncoding(PositionalEncoding):
    """Functional Interpolation for Relative positions: a small MLP maps the normalised distance
    psi(i - j) / psi(max(L, i)), psi(x) = log(c x + 1), to a bias per head; c and the threshold L are learned
    (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context Transformers").
    The normalisation by the query's own position keeps inputs in [0, 1] at any length."""

    @dataclass(frozen=True)
    class Options:
        hidden: int = 32  # width of the MLP
        init_threshold: float | None = None  # the learned threshold L starts here; None: model.block_size

        def __post_init__(self) -> None:
            if self.hidden <= 0:
                raise ConfigError(
                    f"pos.hidden={self.hidden!r} must be a positive integer (the paper uses 32)."
                )
            if self.init_threshold is not None and self.init_threshold < 1:
                raise ConfigError(
                    f"pos.init_threshold={self.init_threshold!r} must be >= 1, or null for model.block_size."
                )

    def __init__(self, options: Any = None, *, n_head: int, head_dim: int, block_size: int) -> None:
        super().__init__(options, n_head=n_head, head_dim=head_dim, block_size=block_size)
        hidden = self.options.hidden
        self.mlp = nn.Sequential(nn.Linear(1, hidden), nn.ReLU(), nn.Linear(hidden, n_head))
        self.log_c = nn.Parameter(torch.zeros(()))  # c = exp(log_c) > 0, starts at 1
        threshold = float(self.options.init_threshold or block_size)
        self.log_threshold = nn.Parameter(torch.tensor(math.log(threshold)))

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        return self.bias_rows(q_positions, k_positions)(0, len(q_positions), len(k_positions))

    def bias_rows(self, q_positions: Tensor, k_positions: Tensor) -> BiasRows:
        dtype = self.log_c.dtype
        c, threshold = self.log_c.exp(), self.log_threshold.exp()
        # Rows of queries within the threshold are normalised by psi(L), so their bias is a function of the
        # distance alone: the MLP runs once on the Tk distances, not on each block's pairs. Built on the first
        # such block and shared by the rest, and by every layer.
        table: list[Tensor] = []
        within = int((q_positions <= threshold).sum())  # the first rows (positions increase): one sync a pass

        def per_distance() -> Tensor:  # (n_head, Tk)
            if not table:
                d = torch.arange(len(k_positions), device=k_positions.device, dtype=dtype)  # (Tk,) distances
                normalised = torch.log1p(c * d) / torch.log1p(c * threshold)  # (Tk,) in [0, 1]
                table.append(self.mlp(normalised[:, None]).T)
            return table[0]

        def rows(start: int, end: int, keys: int) -> Tensor:
            q, k = q_positions[start:end], k_positions[:keys]
            if end <= within:
                return distance_table_rows(per_distance(), q, k)(0, len(q), len(k))
            distance = (q[:, None] - k[None, :]).clamp_min(0)  # (rows, keys)
            scale = torch.maximum(q.to(dtype), threshold)  # (rows,)
            normalised = torch.log1p(c * distance.to(dtype)) / torch.log1p(c * scale)[:, None]  # in [0, 1]
            return self.mlp(normalised[..., None]).permute(2, 0, 1)  # (n_head, rows, keys)

        return rows
