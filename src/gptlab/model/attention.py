"""Causal self-attention and the routes it takes to the attention kernels.

- No positional bias, whole sequence: ``scaled_dot_product_attention(is_causal=True)``, the fused kernel.
- A positional bias (ALiBi, T5 relative, FIRE) is computed once per forward pass (``AttentionBias.build``)
  and shared by every layer:
  - on CUDA, FlexAttention (Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized
    Attention Kernels"): the bias is a ``score_mod`` and causality a block mask, so the kernel skips the
    future blocks and never holds a (T, T) score matrix;
  - elsewhere (FlexAttention has no CPU backward in torch 2.13), SDPA with the bias as an additive float
    mask, in blocks of ``QUERY_BLOCK`` queries that each read only the keys up to their last query: the
    upper triangle is never computed. On a CPU at T=1024, with the bias built once, the stack's training step
    was 1.2-1.5x faster than with one masked call per layer over the whole (T, T) square
    (``scripts/bench_attention.py`` times both).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptlab import torch_features
from gptlab.model.parametrization import attention_scale

if TYPE_CHECKING:
    from gptlab.model.config import GPTConfig
    from gptlab.model.positional import PositionalEncoding, ScoreMod

QUERY_BLOCK = 256  # queries per masked SDPA call on the dense-bias route
#: The default of ``CausalSelfAttention.forward``'s ``bias``: compute the scheme's bias in this layer.
FROM_SCHEME: Any = object()


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, one (k, v) pair per layer, for incremental decoding."""

    layers: list[tuple[Tensor, Tensor] | None] = field(default_factory=list)
    length: int = 0  # tokens already in the cache

    @classmethod
    def empty(cls, n_layer: int) -> KVCache:
        return cls(layers=[None] * n_layer)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        past = self.layers[layer]
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        self.layers[layer] = (k, v)
        return k, v


def flex_attention_available(device: torch.device, head_dim: int = 64) -> bool:
    """Whether the bias schemes take FlexAttention here: it trains on CUDA only (no CPU backward in torch
    2.13), its Triton tiles want heads of at least 16 dimensions, and the installed torch must have it
    (``gptlab.torch_features``); otherwise the dense SDPA route, which gives the same result."""
    if device.type != "cuda" or head_dim < 16:
        return False
    return torch_features.has("flex_attention")


@functools.cache
def _compiled_flex_attention() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    # Eager FlexAttention is a slow reference; compiled, it is a fused Triton kernel.
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=16)
def causal_block_mask(q_len: int, kv_len: int, device: str) -> Any:
    """Query i (the last ``q_len`` of ``kv_len`` positions) sees keys up to its own position."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = kv_len - q_len

    def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx + offset

    return create_block_mask(causal, None, None, q_len, kv_len, device=device)


@dataclass
class AttentionBias:
    """A positional bias for every layer of one forward pass: either a dense (n_head, Tq, Tk) additive mask
    with the future at -inf (SDPA), or a FlexAttention score_mod with a causal block mask."""

    mask: Tensor | None = None
    score_mod: ScoreMod | None = None
    block_mask: Any = None

    @classmethod
    def build(
        cls, pos: PositionalEncoding, positions: Tensor, k_positions: Tensor, use_flex: bool
    ) -> AttentionBias | None:
        """None when the scheme adds no bias (attention then takes the fused causal route)."""
        if use_flex:
            score_mod = pos.score_mod(positions, k_positions)
            if score_mod is None:
                return None
            mask = causal_block_mask(len(positions), len(k_positions), str(positions.device))
            return cls(score_mod=score_mod, block_mask=mask)
        bias = pos.bias(positions, k_positions)  # (n_head, Tq, Tk)
        if bias is None:
            return None
        future = k_positions[None, :] > positions[:, None]  # (Tq, Tk)
        return cls(mask=bias.masked_fill(future, float("-inf")))


def dense_bias_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout_p: float, gqa: bool, scale: float | None = None
) -> Tensor:
    """softmax(q k^T / sqrt(d) + mask) v in blocks of queries, each over the keys up to its last query only.
    q: (B, n_head, T, d); k, v: (B, n_kv_head, Tk, d) with the T queries the last T of the Tk positions.
    ``scale``: the factor on q k^T instead of 1 / sqrt(d) (muP's)."""
    T, Tk = q.size(2), k.size(2)
    mask = mask.to(q.dtype)
    if T <= QUERY_BLOCK:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa, scale=scale
        )
    blocks = []
    for start in range(0, T, QUERY_BLOCK):
        end = min(T, start + QUERY_BLOCK)
        keys = Tk - T + end  # keys past the block's last query are all in the future
        blocks.append(
            F.scaled_dot_product_attention(
                q[:, :, start:end],
                k[:, :, :keys],
                v[:, :, :keys],
                attn_mask=mask[:, start:end, :keys],
                dropout_p=dropout_p,
                enable_gqa=gqa,
                scale=scale,
            )
        )
    return torch.cat(blocks, dim=2)  # (B, n_head, T, d)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = config.head_dim
        # Q, K and V projections in one matrix, laid out [q | k | v] as in GPT-2.
        qkv_width = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, qkv_width, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        # None: 1/sqrt(head_dim); under muP sqrt(base_head_dim)/head_dim (model/parametrization.py).
        self.scale = attention_scale(config)

    def forward(
        self,
        x: Tensor,
        pos: PositionalEncoding,
        positions: Tensor,
        cache: KVCache | None,
        bias: AttentionBias | None = FROM_SCHEME,
    ) -> Tensor:
        """x: (B, T, n_embd) at ``positions``; ``bias``: the forward pass's positional bias, built once by
        the model for every layer (None: no bias), or by default the scheme's, built here."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim],
            dim=-1,
        )
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, n_head, T, head_dim)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, head_dim)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, head_dim)
        q, k = pos.rotate(q, k, positions)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, n_kv_head, Tk, head_dim)
        Tk = k.size(2)
        dropout_p = self.dropout if self.training else 0.0
        # Grouped-query attention (Ainslie et al. 2023): query head i reads K/V head i // (n_head /
        # n_kv_head), without materialising repeated keys and values.
        gqa = self.n_kv_head != self.n_head
        if bias is FROM_SCHEME:
            end = int(positions[-1]) + 1
            bias = AttentionBias.build(pos, positions, torch.arange(end - Tk, end, device=x.device), False)

        # softmax(q k^T * scale + bias) v, scale = 1/sqrt(head_dim) unless muP sets it
        scale = self.scale
        if bias is not None and bias.score_mod is not None:
            y = _compiled_flex_attention()(
                q, k, v, score_mod=bias.score_mod, block_mask=bias.block_mask, enable_gqa=gqa, scale=scale
            )
        elif bias is not None and bias.mask is not None:
            y = dense_bias_attention(q, k, v, bias.mask, dropout_p, gqa, scale)
        elif Tk == T:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa, scale=scale
            )
        else:  # a chunk of queries after cached keys: an explicit causal mask
            k_positions = torch.arange(Tk, device=x.device) + (int(positions[-1]) + 1 - Tk)
            mask = k_positions[None, :] <= positions[:, None]
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa, scale=scale
            )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, n_embd)
        return self.resid_dropout(self.c_proj(y))
