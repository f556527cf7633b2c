"""Attention variants, chosen by the ``attention`` config node: one small class per variant, each with its paper.

- :class:`QKNorm` (``attention.qk_norm=rmsnorm|layernorm``): a norm on each head's queries and keys, before
  any rotation;
- :class:`SlidingWindow` (``attention.window=W`` with ``attention.window_pattern``): local layers see the
  last W positions only, global layers see the whole past;
- :class:`LogitSoftcap` (``attention.logit_softcap=C``): the attention scores pass through C tanh(s / C).

The three combine freely (``attention=gemma2 attention.qk_norm=rmsnorm``) and with every positional scheme:
a window is a mask on top of whatever the scheme does (an added bias, a rotation, a position vector), and the
cap acts on q.k before a scheme's bias is added, so ALiBi's distance penalty is never flattened by it.

``AttentionOptions`` is the node's typed form, checked whole when the model config is made; the model config
records it (``GPTConfig.attention``), and a checkpoint saved before the node existed reads as the default
(full attention, no QK-norm, no cap).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from gptlab.errors import ConfigError
from gptlab.model import norms
from gptlab.registry import Registry, build_options

QK_NORMS = ("none", "layernorm", "rmsnorm")


@dataclass(frozen=True)
class AttentionOptions:
    """The ``attention`` node. The defaults are plain causal attention over the whole past."""

    qk_norm: Literal["none", "layernorm", "rmsnorm"] = "none"
    qk_norm_eps: float = 1e-6
    window: int | None = None  # positions a local layer sees, its own included; None: every layer global
    # Local (L) and global (G) layers, repeated over the depth: L every layer local (Mistral), LG alternating
    # (Gemma 2), LLLLLG five local then one global (Gemma 3).
    window_pattern: str = "L"
    logit_softcap: float | None = None  # C in C tanh(s / C); None: no cap

    def __post_init__(self) -> None:
        if not self.qk_norm_eps > 0:
            raise ConfigError(f"attention.qk_norm_eps={self.qk_norm_eps!r} must be positive (1e-6 is usual).")
        if self.window is not None and self.window < 1:
            raise ConfigError(
                f"attention.window={self.window!r} must be a positive number of positions (e.g. "
                "attention.window=64), or null for full attention in every layer."
            )
        pattern = self.window_pattern
        if not pattern or set(pattern) - {"L", "G"}:
            raise ConfigError(
                f"attention.window_pattern={pattern!r} must be a string of L (local) and G (global) layers, "
                "repeated over the depth: L (every layer local), LG (alternating, Gemma 2), LLLLLG (a global "
                "layer every sixth)."
            )
        if self.window is None and pattern != "L":
            raise ConfigError(
                f"attention.window_pattern={pattern} places local layers, but attention.window is null: set the "
                "local layers' window too, e.g. attention.window=64 (or choose attention=sliding_window)."
            )
        if self.window is not None and "L" not in pattern:
            raise ConfigError(
                f"attention.window_pattern={pattern} has no local layer, so attention.window={self.window} "
                "would apply nowhere: put an L in the pattern, or set attention.window=null."
            )
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ConfigError(
                f"attention.logit_softcap={self.logit_softcap!r} must be positive (Gemma 2 uses 50.0), or null "
                "for no cap."
            )

    @classmethod
    def from_node(cls, node: Any) -> AttentionOptions:
        """The options of an ``attention`` node (plain values; None: the defaults), every key and type checked."""
        if isinstance(node, AttentionOptions):
            return node
        if node is None:
            return cls()
        if not isinstance(node, dict):
            raise ConfigError(
                f"attention={node!r} must be a config node (e.g. attention=qk_norm, or attention.window=64)."
            )
        return build_options(cls, node, "attention", "attention")

    def node(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def is_default(self) -> bool:
        return self == AttentionOptions()

    def layer_window(self, layer: int) -> int | None:
        """The window of layer ``layer`` (0-based): ``window`` where the pattern says L, None where G."""
        return SlidingWindow(self.window, self.window_pattern).layer_window(layer)

    def describe(self) -> str:
        """A short phrase for the model card, e.g. ``qk-norm rmsnorm, window 64 on layers LG, logit cap 50``."""
        parts = []
        if self.qk_norm != "none":
            parts.append(f"qk-norm {self.qk_norm}")
        if self.window is not None:
            parts.append(f"window {self.window} on layers {self.window_pattern}")
        if self.logit_softcap is not None:
            parts.append(f"logit cap {self.logit_softcap:g}")
        return ", ".join(parts) or "full"


# One class per variant, found by the name of the key that turns it on (``attention.<name>``).
REGISTRY: Registry[type[Any]] = Registry("attention variant", "attention")
register = REGISTRY.register


@register("qk_norm")
class QKNorm(nn.Module):
    """A norm over each head's query (or key) vector, with one gain per head dimension shared by the heads,
    applied before RoPE: the scores then grow with the alignment of q and k, not their length, which keeps
    the softmax from saturating at high learning rates (Henry et al. 2020, "Query-Key Normalization for
    Transformers"; Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters", LayerNorm;
    OLMo team 2024, "2 OLMo 2 Furious", and Qwen team 2025, "Qwen3 Technical Report", RMSNorm).

    Under muP the scores are then scaled by 1/head_dim (model/config.py): unit-RMS q and k of an
    aligned pair give q.k of order head_dim, so the scaled score stays of order one at every width."""

    def __init__(self, kind: str, head_dim: int, eps: float) -> None:
        super().__init__()
        norm_class = norms.get(kind)
        options = norm_class.Options(eps=eps)
        if hasattr(options, "bias"):  # LayerNorm: a gain and a bias per dimension, as ViT-22B
            options = dataclasses.replace(options, bias=True)
        self.norm = norm_class(head_dim, options)

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, heads, T, head_dim), normalised over head_dim."""
        return self.norm(x)

    @staticmethod
    def parameter_count(kind: str, head_dim: int) -> int:
        """Parameters of the query and the key norm together."""
        if kind == "none":
            return 0
        return 2 * head_dim * (2 if kind == "layernorm" else 1)


@register("window")
class SlidingWindow:
    """Local attention: a query at position i sees the keys at i - W < j <= i, W positions with its own, in
    the layers the pattern marks L; G layers see the whole past (Beltagy et al. 2020, "Longformer"; Jiang et
    al. 2023, "Mistral 7B", every layer local; Gemma Team 2024, "Gemma 2", local and global layers
    alternating). Stacked local layers still pass information further back, W positions per layer.

    The window is a mask on top of the causal one: a boolean mask (or -inf in a positional bias) through
    SDPA on a CPU, a FlexAttention block mask on CUDA, and the same mask over a KV cache when decoding."""

    pattern_letters: ClassVar[str] = "LG"

    def __init__(self, window: int | None, pattern: str = "L") -> None:
        self.window = window
        self.pattern = pattern

    def layer_window(self, layer: int) -> int | None:
        if self.window is None:
            return None
        return self.window if self.pattern[layer % len(self.pattern)] == "L" else None

    @staticmethod
    def allowed(q_positions: Tensor, k_positions: Tensor, window: int | None) -> Tensor:
        """(Tq, Tk) True where query i may read key j: j <= i, and i - j < window when there is one."""
        behind = q_positions[:, None] - k_positions[None, :]
        allowed = behind >= 0
        if window is not None:
            allowed &= behind < window
        return allowed


@register("logit_softcap")
class LogitSoftcap:
    """Attention-logit soft-capping: each score s = q.k * scale becomes C tanh(s / C), smooth and bounded
    by C, before the positional bias and the mask (Gemma Team 2024, "Gemma 2: Improving Open Language Models
    at a Practical Size", C = 50; after Bello et al. 2016). SDPA has no hook for it, so a capped layer computes
    its scores explicitly on a CPU; on CUDA the cap is part of FlexAttention's score_mod."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __call__(self, scores: Tensor) -> Tensor:
        return self.cap * torch.tanh(scores / self.cap)


def softcapped_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    cap: float,
    dropout_p: float,
    gqa: bool,
    scale: float | None,
) -> Tensor:
    """softmax(cap tanh(q k^T scale / cap) + mask) v, the scores written out. q: (B, H, Tq, d); k, v:
    (B, H_kv, Tk, d); mask: (1 or H, Tq, Tk), boolean (True: attend) or additive with -inf."""
    if gqa:  # each key/value head serves H / H_kv query heads
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    factor = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    scores = LogitSoftcap(cap)(torch.matmul(q, k.transpose(-2, -1)).float() * factor)  # (B, H, Tq, Tk)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    weights = torch.softmax(scores, dim=-1).to(q.dtype)
    if dropout_p > 0:
        weights = torch.nn.functional.dropout(weights, dropout_p)
    return torch.matmul(weights, v)  # (B, H, Tq, d)


__all__ = [
    "QK_NORMS",
    "REGISTRY",
    "AttentionOptions",
    "LogitSoftcap",
    "QKNorm",
    "SlidingWindow",
    "softcapped_attention",
]
