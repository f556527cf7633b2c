"""Attention variants, chosen by the ``attention`` config node: one small class per variant, each with its paper.

- :class:`QKNorm` (``attention.qk_norm=rmsnorm|layernorm``): a norm on each head's queries and keys, before
  any rotation;
- :class:`SlidingWindow` (``attention.window=W`` with ``attention.window_pattern``): local layers see the
  last W positions only, global layers see the whole past;
- :class:`LogitSoftcap` (``attention.logit_softcap=C``): the attention scores pass through C tanh(s / C);
- :class:`AttentionGate` (``attention.gate=elementwise|headwise``): the attention's output, per head, is
  multiplied by a sigmoid gate computed from the layer's input, before the output projection;
- :class:`ValueResidual` (``attention.value_residual=fixed|learnable``): every layer after the first mixes
  its values with the first layer's;
- :class:`DifferentialAttention` (``attention.differential=true``): each head attends twice, with the two
  halves of its queries and keys, and subtracts the second attention (times a learned lambda) from the first.

They combine freely (``attention=gemma2 attention.qk_norm=rmsnorm attention.gate=elementwise``) and with every
positional scheme: a window is a mask on top of whatever the scheme does (an added bias, a rotation, a
position vector), and the cap acts on q.k before a scheme's bias is added, so ALiBi's distance penalty is
never flattened by it. The gate acts after the attention kernel and the value residual before it, on the
values alone, so neither touches the scores, the masks or the positions. Differential attention runs the
fused causal kernel twice on half-width queries and keys; it is refused at config time beside what would
change those kernels' scores (a window, a cap, a bias scheme) or their scale (muP), see
:meth:`AttentionOptions.check_model`.

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
import torch.nn.functional as F
from torch import Tensor, nn

from gptlab.errors import ConfigError
from gptlab.model import norms
from gptlab.registry import Registry, build_options

QK_NORMS = ("none", "layernorm", "rmsnorm")
GATES = ("none", "elementwise", "headwise")
VALUE_RESIDUALS = ("none", "fixed", "learnable")


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
    # A sigmoid gate on each head's output: one per head dimension (elementwise, Qiu et al.'s best), one per
    # head (headwise), or none.
    gate: Literal["none", "elementwise", "headwise"] = "none"
    # The first layer's values mixed into every later layer's: 0.5 V_n + 0.5 V_1 (fixed), the two weights
    # learned per layer from 0.5 (learnable), or none.
    value_residual: Literal["none", "fixed", "learnable"] = "none"
    # Differential attention (Ye et al. 2024): softmax(Q1 K1^T s) - lambda softmax(Q2 K2^T s) over V, each head
    # split into two half-width query/key heads.
    differential: bool = False

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
        if self.gate != "none":
            parts.append(f"{self.gate} output gate")
        if self.value_residual != "none":
            parts.append(f"value residual {self.value_residual}")
        if self.differential:
            parts.append("differential")
        return ", ".join(parts) or "full"

    def check_depth(self, n_layer: int) -> None:
        """The checks that need the model's depth: a value residual needs a layer after the first."""
        if self.value_residual != "none" and n_layer < 2:
            raise ConfigError(
                f"attention.value_residual={self.value_residual} mixes the first layer's values into the later "
                f"layers', and model.n_layer={n_layer} has no later layer: use model.n_layer=2 or more, or "
                "attention.value_residual=none."
            )

    def check_model(
        self,
        head_dim: int,
        pos_name: str,
        rotary: bool,
        bias: bool,
        param: str,
        rotary_fraction: float = 1.0,
    ) -> None:
        """The checks that need the rest of the model: what differential attention cannot combine with.
        ``rotary``, ``bias``: whether the positional scheme ``pos_name`` rotates q and k (``rotary_fraction``
        of each head), or adds a bias."""
        if not self.differential:
            return
        if head_dim % 2:
            raise ConfigError(
                f"attention.differential=true splits each head's queries and keys into two halves, and the "
                f"head dimension (model.n_embd / model.n_head) is {head_dim}, odd: choose n_embd and n_head "
                "with an even quotient, or attention.differential=false."
            )
        if rotary and (rotary_fraction != 1 or head_dim % 4):
            raise ConfigError(
                f"attention.differential=true with pos={pos_name} splits each head by its rotation pairs, "
                f"half of the pairs to each half, so it needs whole heads rotated and a head dimension divisible "
                f"by 4; here pos.rotary_fraction={rotary_fraction:g} and head dimension {head_dim}. Use "
                "pos.rotary_fraction=1 and n_embd / n_head a multiple of 4, or attention.differential=false."
            )
        if bias:
            raise ConfigError(
                f"attention.differential=true cannot take pos={pos_name}: a bias scheme's attention goes through "
                "FlexAttention (CUDA) or the dense bias route, which differential attention does not take; it "
                "runs the fused causal kernel twice. Use pos=rope, pos=learned, pos=sinusoidal or pos=nope, or "
                "attention.differential=false."
            )
        if self.window is not None or self.logit_softcap is not None:
            what = "attention.window" if self.window is not None else "attention.logit_softcap"
            value = self.window if self.window is not None else self.logit_softcap
            raise ConfigError(
                f"attention.differential=true cannot take {what}={value}: a window or a cap goes through "
                "FlexAttention (CUDA) or the masked route, which differential attention does not take; it runs "
                f"the fused causal kernel twice. Set {what}=null, or attention.differential=false."
            )
        if param == "mup":
            raise ConfigError(
                "attention.differential=true cannot take model.param=mup: muP's attention scale is derived "
                "for full-width heads, and how it should scale half-width q.k with a subtracted second "
                "attention is not worked out. Use model.param=standard, or attention.differential=false."
            )


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


@register("gate")
class AttentionGate(nn.Module):
    """Gated attention: Y' = Y * sigmoid(X W_theta), each head's attention output Y (after SDPA, before the
    output projection) multiplied by a gate computed from the layer's input X, the normed hidden state of
    the token (Qiu et al. 2025, "Gated Attention for Large Language Models: Non-linearity, Sparsity, and
    Attention-Sink-Free", arXiv 2505.06708; the gate of Qwen3-Next). ``elementwise``: one gate per head
    dimension, W_theta (n_embd, n_head * head_dim), the paper's best ("G1", head-specific and elementwise);
    ``headwise``: one scalar gate per head, W_theta (n_embd, n_head). The gate puts a non-linearity between
    the value and output projections (a low-rank linear map without it) and, being query-dependent and often
    near 0, lets a head output nothing without parking its attention on the first token (no attention sink).

    W_theta has no bias (the paper's formula) and starts at zero: every gate is sigmoid(0) = 0.5 at step 0,
    the same for every seed and width, so the model starts as the ungated one (the same weights at the same
    seed) with each attention output halved; its gradient X^T (dL/dY' * Y * 0.25) is not zero, so it learns
    from the first step. It is a hidden matrix like c_attn (fan-in n_embd): muP's Adam rate ``lr / m`` and
    Muon apply to it. Each position's gate reads that position's input only, so the KV cache needs nothing
    from it."""

    def __init__(self, kind: str, n_embd: int, n_head: int, head_dim: int) -> None:
        super().__init__()
        self.kind = kind
        self.n_head = n_head
        # W_theta as a (gates, n_embd) matrix, made zero without drawing from the generator: at one seed every
        # other weight of a gated model is the ungated model's.
        self.weight = nn.Parameter(torch.zeros(self.width(kind, n_head, head_dim), n_embd))

    @staticmethod
    def width(kind: str, n_head: int, head_dim: int) -> int:
        """The gate projection's outputs: a gate per head dimension, or per head; 0 without a gate."""
        return {"none": 0, "elementwise": n_head * head_dim, "headwise": n_head}[kind]

    def forward(self, y: Tensor, x: Tensor) -> Tensor:
        """y: (B, T, n_head, head_dim) the heads' outputs; x: (B, T, n_embd) the layer's input."""
        B, T, _ = x.shape
        gate = torch.sigmoid(F.linear(x, self.weight)).view(B, T, self.n_head, -1)  # (B, T, n_head, d or 1)
        return y * gate


@register("value_residual")
class ValueResidual(nn.Module):
    """Value residual learning (ResFormer): each layer n > 1 attends over V_n' = lambda1 V_n + lambda2 V_1,
    its own values mixed with the first layer's, which carries each token's own information to the deep
    layers past the attention's smoothing (Zhou et al. 2024, "Value Residual Learning For Alleviating
    Attention Concentration In Transformers", arXiv 2410.17897). ``fixed``: lambda1 = lambda2 = 0.5, the
    paper's; ``learnable``: the two lambdas a parameter of each layer, from 0.5 (as in the modded-nanogpt
    speedrun), without weight decay and at the plain learning rate (scalars: muP leaves them alone).

    The mix is per position, so a layer caches its mixed values: a decoding step needs the first layer's
    values of its own new tokens only, never the cached ones."""

    INIT: ClassVar[tuple[float, float]] = (0.5, 0.5)

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lambdas: nn.Parameter | None = None
        if kind == "learnable":
            self.lambdas = nn.Parameter(torch.tensor(self.INIT))

    @staticmethod
    def parameter_count(kind: str, n_layer: int) -> int:
        """The learned lambdas of every layer after the first."""
        return 2 * (n_layer - 1) if kind == "learnable" else 0

    def forward(self, v: Tensor, first: Tensor) -> Tensor:
        """v, first: (B, n_kv_head, T, head_dim), this layer's values and the first layer's."""
        if self.lambdas is None:
            return self.INIT[0] * v + self.INIT[1] * first
        lambdas = self.lambdas.to(v.dtype)
        return lambdas[0] * v + lambdas[1] * first


@register("differential")
class DifferentialAttention(nn.Module):
    """Differential attention: each head's output is (softmax(Q1 K1^T s) - lambda softmax(Q2 K2^T s)) V, the
    head's queries and keys split into two halves (Q1, Q2; K1, K2) of head_dim / 2 each, V of the whole head,
    s = 1 / sqrt(head_dim / 2). The second map cancels the attention that both give to irrelevant context,
    as a differential amplifier cancels common-mode noise (Ye et al. 2024, "Differential Transformer", arXiv
    2410.05258, ICLR 2025).

    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, one scalar per layer from four learned vectors of
    head_dim / 2 (drawn from N(0, 0.1^2), the paper's), with lambda_init = 0.8 - 0.6 exp(-0.3 (l - 1)) for
    layer l (1-based): 0.2 in the first layer, towards 0.8 in deep ones. Each head's output is then normalised
    (RMSNorm over head_dim, one gain per dimension shared by the heads: the paper's headwise GroupNorm) and
    multiplied by (1 - lambda_init), which brings its scale back to plain attention's at the start.

    The two maps are two calls of the attention kernel on the same V (CausalSelfAttention), each the fused
    causal one: no (T, T) score matrix is written out. Q1, K1 are the first half of each head's dimensions
    (after any QK-norm over the whole head), Q2, K2 the second. Under a rotary scheme (``pairs``) each half
    takes whole rotation pairs instead, after the rotation: RoPE turns dimension j with j + head_dim/2, so the
    pairs of even j go to the first half and those of odd j to the second, and each half's q.k depends on the
    distance alone. The first half then rotates at exactly the frequencies of a RoPE of head_dim/2 (the
    paper rotates each half at half width), the second at each of those times base^(-2/head_dim). The KV cache
    holds whole keys and values, so decoding needs nothing else. The lambda vectors and the norm's gain are vectors: no weight decay and the
    plain learning rate.
    """

    EPS: ClassVar[float] = 1e-5  # the head norm's (the paper's RMSNorm)
    LAMBDA_STD: ClassVar[float] = 0.1

    def __init__(self, layer: int, head_dim: int, pairs: bool = False) -> None:
        super().__init__()
        self.lambda_init = self.initial_lambda(layer)
        self.pairs = pairs
        half = head_dim // 2
        # Drawn from a generator of their own, seeded from the run's seed and the layer: the global stream is
        # left as the plain model's, so at one seed every other weight is the plain model's.
        generator = torch.Generator().manual_seed((torch.initial_seed() + 7919 * (layer + 1)) % 2**63)
        vectors = torch.randn(4, half, generator=generator, device="cpu") * self.LAMBDA_STD
        self.lambda_q1 = nn.Parameter(vectors[0].clone())
        self.lambda_k1 = nn.Parameter(vectors[1].clone())
        self.lambda_q2 = nn.Parameter(vectors[2].clone())
        self.lambda_k2 = nn.Parameter(vectors[3].clone())
        self.norm = norms.get("rmsnorm")(head_dim, norms.get("rmsnorm").Options(eps=self.EPS))

    @staticmethod
    def initial_lambda(layer: int) -> float:
        """lambda_init of layer ``layer`` (0-based): 0.8 - 0.6 exp(-0.3 (l - 1)) with l = layer + 1."""
        return 0.8 - 0.6 * math.exp(-0.3 * layer)

    @staticmethod
    def parameter_count(head_dim: int) -> int:
        """A layer's: the four lambda vectors of head_dim / 2 and the head norm's gain of head_dim."""
        return 4 * (head_dim // 2) + head_dim

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The two halves of each head, x: (B, heads, T, head_dim) -> two (B, heads, T, head_dim / 2): the
        first and the last head_dim / 2 dimensions, or with ``pairs`` the rotation pairs (j, j + head_dim/2)
        of even j and of odd j."""
        if not self.pairs:
            first, second = x.chunk(2, dim=-1)
            return first, second
        # (.., head_dim) as (.., 2, head_dim/4, 2): [h, i, p] is dimension h head_dim/2 + 2i + p, pair j = 2i + p.
        paired = x.unflatten(-1, (2, x.size(-1) // 4, 2))
        return paired[..., 0].flatten(-2), paired[..., 1].flatten(-2)

    def lambda_(self) -> Tensor:
        """The layer's lambda, a scalar, computed in float32."""
        first = torch.exp(torch.dot(self.lambda_q1.float(), self.lambda_k1.float()))
        second = torch.exp(torch.dot(self.lambda_q2.float(), self.lambda_k2.float()))
        return first - second + self.lambda_init

    def forward(self, y1: Tensor, y2: Tensor) -> Tensor:
        """y1, y2: (B, n_head, T, head_dim), the two attentions over V; their normalised difference."""
        y = y1 - self.lambda_().to(y1.dtype) * y2
        return self.norm(y) * (1 - self.lambda_init)


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
    "GATES",
    "QK_NORMS",
    "REGISTRY",
    "VALUE_RESIDUALS",
    "AttentionGate",
    "AttentionOptions",
    "DifferentialAttention",
    "LogitSoftcap",
    "QKNorm",
    "SlidingWindow",
    "ValueResidual",
    "softcapped_attention",
]
