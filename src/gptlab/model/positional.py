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

import math
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
    You Need", section 3.5). Defined for every position, so it also runs past ``block_size``.

    The paper multiplies the token embeddings by sqrt(n_embd) (section 3.4) before adding the table; here the
    token embeddings keep GPT-2's scale, so the table is multiplied by ``scale`` = 1/sqrt(n_embd) by default,
    which gives the paper's ratio of the two. Unscaled (``scale=1``), entries of size ~0.7 swamp embeddings
    of size 0.02 at initialisation."""

    options = {"base": 10000.0, "scale": None}

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
        scale = config.pos_options.get("scale")
        if scale is not None and (not isinstance(scale, (int, float)) or scale <= 0):
            raise ConfigError(
                f"pos.scale={scale!r} must be a positive number, or null for 1/sqrt(n_embd) (the paper's ratio)."
            )

    @property
    def multiplier(self) -> float:
        return self.scale if self.scale is not None else self.config.n_embd**-0.5

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        end = int(positions[-1]) + 1
        if end <= self.table.size(0):
            pe = self.table[positions]
        else:
            pe = sinusoidal_table(positions, self.config.n_embd, self.base).to(self.table.device)
        return x + (pe * self.multiplier).to(x.dtype)


@register("nope")
class NoPositionalEncoding(PositionalEncoding):
    """No positional information at all: causal attention alone orders the tokens (Kazemnejad et al. 2023,
    "The Impact of Positional Encoding on Length Generalization in Transformers")."""


# ---- rotary ---------------------------------------------------------------------------------------

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
    longer than the training one; the length evaluation sets the factor per context with ``set_scale``.
    """

    options = {
        "base": 10000.0,
        "rotary_fraction": 1.0,
        "scaling": "none",
        "scale_factor": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.rotary_dim = rotary_dim(config)
        self._cached: tuple[tuple, Tensor, float] | None = None  # (options, inverse frequencies, mscale)

    @classmethod
    def check_config(cls, config: GPTConfig) -> None:
        super().check_config(config)
        opts = {**cls.options, **config.pos_options}
        if config.head_dim % 2:
            raise ConfigError(
                f"pos=rope needs an even head dimension (it rotates pairs of dimensions), got n_embd/n_head = "
                f"{config.n_embd}/{config.n_head} = {config.head_dim}. Choose n_embd and n_head so that "
                f"n_embd/n_head is even (e.g. model.n_embd={config.n_head * (config.head_dim + 1)})."
            )
        fraction = opts["rotary_fraction"]
        if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ConfigError(f"pos.rotary_fraction={fraction!r} must be in (0, 1] (1 rotates whole heads).")
        if rotary_dim(config) < 2:
            raise ConfigError(
                f"pos.rotary_fraction={fraction} of head dimension {config.head_dim} leaves no pair to rotate: "
                f"raise pos.rotary_fraction to at least {2 / config.head_dim:.3g}."
            )
        base = opts["base"]
        if not isinstance(base, (int, float)) or base <= 1:
            raise ConfigError(f"pos.base={base!r} must be a number greater than 1 (the paper uses 10000).")
        if opts["scaling"] not in ROPE_SCALINGS:
            raise ConfigError(
                f"pos.scaling={opts['scaling']!r} is not one of {', '.join(ROPE_SCALINGS)}: use pos.scaling=linear "
                "(position interpolation), ntk (NTK-aware base) or yarn, or none."
            )
        factor = opts["scale_factor"]
        if not isinstance(factor, (int, float)) or factor < 1:
            raise ConfigError(
                f"pos.scale_factor={factor!r} must be a number >= 1: the evaluation context over the training "
                "context (1 leaves the rotations as trained)."
            )
        if not opts["beta_fast"] > opts["beta_slow"] > 0:
            raise ConfigError(
                f"pos.beta_fast={opts['beta_fast']} must exceed pos.beta_slow={opts['beta_slow']} > 0 "
                "(YaRN uses 32 and 1)."
            )

    def set_scale(self, factor: float) -> None:
        """Stretch the rotations for a context ``factor`` times the training one (1 restores them)."""
        if factor < 1:
            raise ValueError(f"scale factor {factor} must be >= 1")
        self.scale_factor = float(factor)

    def frequencies(self, device: torch.device) -> tuple[Tensor, float]:
        key = (self.scale_factor, self.scaling, self.base)
        if self._cached is None or self._cached[0] != key or self._cached[1].device != device:
            inv_freq, mscale = rope_inverse_frequencies(
                self.rotary_dim,
                self.base,
                self.scaling,
                self.scale_factor,
                self.config.block_size,
                self.beta_fast,
                self.beta_slow,
            )
            self._cached = (key, inv_freq.to(device), mscale)
        return self._cached[1], self._cached[2]

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq, mscale = self.frequencies(q.device)
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, rotary_dim/2)
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

    options = {**RotaryPositionalEncoding.options, "scale_base": 512.0, "gamma": 0.4}

    @classmethod
    def check_config(cls, config: GPTConfig) -> None:
        super().check_config(config)
        opts = {**cls.options, **config.pos_options}
        if not isinstance(opts["scale_base"], (int, float)) or opts["scale_base"] <= 0:
            raise ConfigError(
                f"pos.scale_base={opts['scale_base']!r} must be a positive number (the paper uses 512)."
            )
        if not isinstance(opts["gamma"], (int, float)) or opts["gamma"] <= 0:
            raise ConfigError(f"pos.gamma={opts['gamma']!r} must be a positive number (the paper uses 0.4).")

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        q, k = super().rotate(q, k, positions)
        r = self.rotary_dim
        zeta = (torch.arange(0, r, 2, dtype=torch.float64, device=q.device) / r + self.gamma) / (
            1 + self.gamma
        )
        power = positions.to(torch.float64)[:, None] / self.scale_base  # (T, 1)
        decay = zeta[None, :] ** power  # (T, r/2)
        decay = torch.cat([decay, decay], dim=-1)  # rotate_half pairs dimension i with i + r/2
        q = torch.cat([q[..., :r] * decay.to(q.dtype), q[..., r:]], dim=-1)
        k = torch.cat([k[..., :r] / decay.to(k.dtype), k[..., r:]], dim=-1)
        return q, k


def rotary_dim(config: GPTConfig) -> int:
    """The rotated part of each head: rotary_fraction of head_dim, rounded down to an even number."""
    fraction = config.pos_options.get("rotary_fraction", 1.0)
    return int(config.head_dim * fraction) // 2 * 2


# ---- attention biases -----------------------------------------------------------------------------


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

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.register_buffer("slopes", alibi_slopes(config.n_head), persistent=False)  # (n_head,)

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        distance = (q_positions[:, None] - k_positions[None, :]).to(self.slopes.dtype)  # (Tq, Tk)
        return -self.slopes[:, None, None] * distance  # (n_head, Tq, Tk)


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

    options = {"num_buckets": 32, "max_distance": 128}

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.relative_attention_bias = nn.Embedding(self.num_buckets, config.n_head)

    @classmethod
    def check_config(cls, config: GPTConfig) -> None:
        super().check_config(config)
        opts = {**cls.options, **config.pos_options}
        buckets, distance = opts["num_buckets"], opts["max_distance"]
        if not isinstance(buckets, int) or buckets < 4:
            raise ConfigError(f"pos.num_buckets={buckets!r} must be an integer >= 4 (T5 uses 32).")
        if not isinstance(distance, int) or distance <= buckets // 2:
            raise ConfigError(
                f"pos.max_distance={distance!r} must be an integer larger than pos.num_buckets/2 = {buckets // 2} "
                "(T5 uses 128 with 32 buckets)."
            )

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        buckets = t5_relative_buckets(
            k_positions[None, :] - q_positions[:, None], self.num_buckets, self.max_distance
        )  # (Tq, Tk)
        return self.relative_attention_bias(buckets).permute(2, 0, 1)  # (n_head, Tq, Tk)


@register("fire")
class FIREPositionalEncoding(PositionalEncoding):
    """Functional Interpolation for Relative positions: a small MLP maps the normalised distance
    psi(i - j) / psi(max(L, i)), psi(x) = log(c x + 1), to a bias per head; c and the threshold L are learned
    (Li et al. 2023, "Functional Interpolation for Relative Positions Improves Long Context Transformers").
    The normalisation by the query's own position keeps inputs in [0, 1] at any length."""

    options = {"hidden": 32, "init_threshold": None}

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.mlp = nn.Sequential(nn.Linear(1, self.hidden), nn.ReLU(), nn.Linear(self.hidden, config.n_head))
        self.log_c = nn.Parameter(torch.zeros(()))  # c = exp(log_c) > 0, starts at 1
        threshold = float(self.init_threshold or config.block_size)
        self.log_threshold = nn.Parameter(torch.tensor(math.log(threshold)))

    @classmethod
    def check_config(cls, config: GPTConfig) -> None:
        super().check_config(config)
        hidden = config.pos_options.get("hidden", 32)
        if not isinstance(hidden, int) or hidden <= 0:
            raise ConfigError(f"pos.hidden={hidden!r} must be a positive integer (the paper uses 32).")
        threshold = config.pos_options.get("init_threshold")
        if threshold is not None and (not isinstance(threshold, (int, float)) or threshold < 1):
            raise ConfigError(
                f"pos.init_threshold={threshold!r} must be a number >= 1, or null for model.block_size."
            )

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        dtype = self.log_c.dtype
        c = self.log_c.exp()
        distance = (q_positions[:, None] - k_positions[None, :]).clamp_min(0).to(dtype)  # (Tq, Tk)
        scale = torch.maximum(q_positions.to(dtype), self.log_threshold.exp())  # (Tq,)
        normalised = torch.log1p(c * distance) / torch.log1p(c * scale)[:, None]  # (Tq, Tk) in [0, 1]
        return self.mlp(normalised[..., None]).permute(2, 0, 1)  # (n_head, Tq, Tk)
