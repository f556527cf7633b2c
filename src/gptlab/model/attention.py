"""Causal self-attention and the routes it takes to the attention kernels.

- No positional bias, whole sequence: ``scaled_dot_product_attention(is_causal=True)``, the fused kernel.
- A positional bias (ALiBi, T5 relative, FIRE) is computed once per forward pass (``AttentionBias.build``)
  and shared by every layer:
  - on CUDA, FlexAttention (Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized
    Attention Kernels"): the bias is a ``score_mod`` and causality a block mask, so the kernel skips the
    future blocks and never holds a (T, T) score matrix. Its kernel is compiled once per batch size,
    sequence length, mask kind and grad mode, and shared by every layer and step (``compiled_flex_attention``,
    up to FLEX_RECOMPILE_LIMIT kernels a process; past it a warning says so);
  - elsewhere (FlexAttention has no CPU backward in torch 2.13), SDPA with the bias as an additive float
    mask, in blocks of ``QUERY_BLOCK`` queries that each read only the keys up to their last query: the
    upper triangle is never computed. Each block builds its own rows of the mask (``DenseMask``: the
    scheme's ``bias_rows``, causality, window, documents) and drops them after its call, so the whole
    (n_head, T, T) mask is never held: extra memory is (n_head, QUERY_BLOCK, Tk) at any length. What the
    rows share (a table per distance) is computed once per forward pass. On a CPU at T=1024, with the bias
    built once, the stack's training step was 1.2-1.5x faster than with one masked call per layer over the
    whole (T, T) square (``scripts/bench_attention.py`` times both). The masks reach SDPA 4-d
    (``fused_kernel_mask``), so that its CPU kernel takes its fused route wherever the mask needs no gradient.
- The attention variants (model/attention_variants.py) ride on the same two routes: a sliding window is a
  mask (the FlexAttention block mask, or a boolean / -inf mask through SDPA), prepared once per forward pass
  for the local layers and once for the global ones; a logit cap is part of the score_mod on CUDA and, since
  SDPA cannot cap, an explicit score computation elsewhere. QK-norm acts on q and k before any rotation.
  Differential attention calls the kernel twice, with each half of the queries and keys over the same values.
- Document masking (``data.document_mask=true``): the model gets each token's document id, and a query reads
  only the keys of its own document, on top of causality and any window: a per-window FlexAttention block
  mask on CUDA (``document_block_mask``), through SDPA elsewhere a block of (B, 1, rows, T) booleans, or
  with a bias (B, n_head, rows, T) floats, built one block of queries at a time: the (B, n_head, T, T) floats
  are never held, nor their gradient (``scripts/document_mask_memory.py`` measures the step's memory). The
  exception is a bias without a gradient (ALiBi) in a training step: SDPA's CPU kernel takes a 4-d mask's
  fused route and keeps the mask for the backward, in every layer; there one whole mask, shared by the
  layers, holds least. (Without documents the blocks' masks are (1, n_head, rows, T), what the fused route
  keeps of them is less than the explicit route kept before, and they stay per block: see
  ``fused_kernel_mask``.)
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptlab import torch_features
from gptlab.errors import ConfigError
from gptlab.model import positional
from gptlab.model.attention_variants import (
    AttentionGate,
    DifferentialAttention,
    QKNorm,
    SlidingWindow,
    ValueResidual,
    softcapped_attention,
)
from gptlab.model.config import attention_scale

if TYPE_CHECKING:
    from gptlab.model.config import GPTConfig
    from gptlab.model.positional import BiasRows, PositionalEncoding, ScoreMod

log = logging.getLogger(__name__)

QUERY_BLOCK = 256  # queries per masked SDPA call on the dense-bias route
#: The default of ``CausalSelfAttention.forward``'s ``bias``: compute the scheme's bias in this layer.
FROM_SCHEME: Any = object()


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, one (k, v) pair per layer, for incremental decoding.

    A local layer (a sliding window of W positions) keeps only the keys and values of the last W positions:
    no later query can read further back, so its cache is bounded by W however long the generation runs.
    A global layer keeps every position. The keys kept are always the most recent ones, in order, so a
    layer holding n of them holds positions ``length - n .. length - 1``; the keys were rotated (RoPE) at
    their absolute positions before they were cached, and the bias schemes read those positions back
    through :meth:`first_key_position`."""

    layers: list[tuple[Tensor, Tensor] | None] = field(default_factory=list)
    length: int = 0  # tokens already in the cache

    @classmethod
    def empty(cls, n_layer: int) -> KVCache:
        return cls(layers=[None] * n_layer)

    def first_key_position(self, window: int | None) -> int:
        """The absolute position of the first key that a layer with ``window`` (None: global) holds now,
        before the next step's tokens are added."""
        return 0 if window is None else max(0, self.length - window)

    def update(self, layer: int, k: Tensor, v: Tensor, window: int | None = None) -> tuple[Tensor, Tensor]:
        """The layer's keys and values for this step: the cached ones followed by the step's own ``k``,
        ``v`` (B, n_kv_head, T, head_dim). A local layer (``window`` W) then keeps the last W positions of
        them; the step itself still reads every key it returns (its first query may reach W - 1 back)."""
        past = self.layers[layer]
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        if window is not None and k.size(2) > window:
            # A view of this step's keys: the next step's concatenation copies it and frees the rest.
            self.layers[layer] = (k[:, :, -window:], v[:, :, -window:])
        else:
            self.layers[layer] = (k, v)
        return k, v


def flex_attention_available(device: torch.device, head_dim: int = 64) -> bool:
    """Whether the bias schemes take FlexAttention here: it trains on CUDA only (no CPU backward in torch
    2.13), its Triton tiles want heads of at least 16 dimensions, and the installed torch must have it
    (``gptlab.torch_features``); otherwise the dense SDPA route, which gives the same result."""
    if device.type != "cuda" or head_dim < 16:
        return False
    return torch_features.has("flex_attention")


#: The most FlexAttention kernels one process compiles. Each kernel is specialised (static shapes) to one
#: (batch size, sequence length, mask kind, grad mode): the score_mods and masks differ between layers and
#: forward passes only in the tensors they read, which are inputs of the kernel, so every layer of a kind and
#: every step share it (``scripts/flex_recompiles.py`` counts them). A training run of local and global layers
#: with the default length study needs about 16 (training and validation: 2 kinds x 2 grad modes, document
#: masks double them; the study: 4 lengths x 2 kinds, its smaller last batch at each length padded to the
#: others' size by ``gptlab.evaluation.length.loss_by_position``; the passkey study none, its passes read a KV
#: cache and take the dense route); torch's own limit of 8 per function would send the longest lengths, where
#: it matters most, to uncompiled FlexAttention. A larger torch limit
#: (``torch._dynamo.config.recompile_limit``) is kept.
FLEX_RECOMPILE_LIMIT = 64
#: torch.compile's backend for FlexAttention: Inductor generates the fused kernel. ``eager`` (Dynamo's graph,
#: run by the uncompiled FlexAttention) compiles exactly as often, quickly: scripts/flex_recompiles.py counts
#: compiles with it on a CPU.
FLEX_BACKEND = "inductor"
_uncompiled_shapes: set[tuple[Any, ...]] = set()


@functools.cache
def _compiled_flex_attention(backend: str) -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    # Eager FlexAttention is a slow reference; compiled, it is a fused Triton kernel. Compiled for static
    # shapes: each new sequence length compiles anew, so the model runs whole sequences at a multiple of
    # FLEX_LENGTH_BUCKET (GPT.forward, ``flex_padded_length``).
    return torch.compile(flex_attention, dynamic=False, backend=backend)


def reset_compiled_flex_attention() -> None:
    """Forget every compiled FlexAttention kernel (torch's whole compile cache) and the shapes warned about:
    the next calls compile anew, as in a fresh process (scripts/flex_recompiles.py counts from here)."""
    torch._dynamo.reset()
    _compiled_flex_attention.cache_clear()
    _uncompiled_shapes.clear()


#: FlexAttention's tiles on CUDA for training and evaluation in bf16 or fp16 at head_dim 64 and 128 (block
#: masks of 128 x 128, its default). torch 2.11's own tiles for an H100 at head_dim 64 in bf16, 128 queries x
#: 128 keys in 3 stages, asked 245,760 bytes of shared memory with gptlab's score_mods, over the H100's 232,448:
#: the kernel did not compile ("No valid triton configs ... out of resource"), at GPT-2 small's shape with
#: pos=alibi. These are torch's tiles for an A100 (164 KiB of shared memory), which an H100's larger shared
#: memory holds with room for a score_mod's loads: forward 128 x 64 in 3 stages, backward 64 x 64 in 2.
FLEX_HALF_TILES = {
    64: {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4},
    128: {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 8},
}
FLEX_HALF_BACKWARD_TILES = {
    "bwd_BLOCK_M1": 64,
    "bwd_BLOCK_N1": 64,
    "bwd_BLOCK_M2": 64,
    "bwd_BLOCK_N2": 64,
    "bwd_num_stages": 2,
    "bwd_num_warps": 4,
}


def flex_kernel_options(q: Tensor, k: Tensor) -> Any:  # torch's FlexKernelOptions (a TypedDict) or None
    """The tiles FlexAttention takes for these queries and keys (``FLEX_HALF_TILES``), or None for torch's own:
    on the CPU, in fp32, at other head sizes, and when decoding (fewer queries than keys, torch's decoding
    kernel)."""
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16) or q.size(2) != k.size(2):
        return None
    tiles = FLEX_HALF_TILES.get(q.size(-1))
    return None if tiles is None else {**tiles, **FLEX_HALF_BACKWARD_TILES}


def compiled_flex_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: ScoreMod | None,
    block_mask: Any,
    enable_gqa: bool,
    scale: float | None,
) -> Tensor:
    """FlexAttention through its compiled kernel, at most FLEX_RECOMPILE_LIMIT kernels per process. Past the
    limit torch would run it uncompiled with a line in its own log; here a warning, once per new shape, names
    the cause and the fix, and the result is the same."""
    from torch.nn.attention.flex_attention import flex_attention

    # the same call on each route: inside a compiled block, through its own compiled kernel, or uncompiled
    arguments: dict[str, Any] = dict(
        score_mod=score_mod,
        block_mask=block_mask,
        enable_gqa=enable_gqa,
        scale=scale,
        kernel_options=flex_kernel_options(q, k),
    )
    if torch.compiler.is_compiling():  # inside a compiled block (compile=true): compiled with it
        return flex_attention(q, k, v, **arguments)
    config = torch._dynamo.config
    saved = config.recompile_limit, config.fail_on_recompile_limit_hit
    # Set for this call only (not torch.compile's own recompile_limit, which torch 2.11 lacks): a raised
    # error instead of torch's silent fall-back, and a limit for this function alone.
    config.recompile_limit = max(FLEX_RECOMPILE_LIMIT, saved[0])
    config.fail_on_recompile_limit_hit = True
    try:
        return _compiled_flex_attention(FLEX_BACKEND)(q, k, v, **arguments)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        shape = (
            tuple(q.shape),
            tuple(k.shape),
            q.dtype,
            torch.is_grad_enabled(),
            block_mask.mask_mod.__name__,
        )
        if shape not in _uncompiled_shapes:
            _uncompiled_shapes.add(shape)
            log.warning(
                "FlexAttention has compiled %d kernels in this process, its limit (one per batch size, "
                "sequence length, mask kind and grad mode); queries %s with mask %s run UNCOMPILED, which "
                "holds the whole score matrix and is many times slower. Run fewer distinct lengths and batch "
                "sizes in one process (e.g. fewer eval_length.factors), or raise "
                "gptlab.model.attention.FLEX_RECOMPILE_LIMIT.",
                config.recompile_limit,
                tuple(q.shape),
                shape[-1],
            )
        return flex_attention(q, k, v, **arguments)
    finally:
        config.recompile_limit, config.fail_on_recompile_limit_hit = saved


#: FlexAttention's block size (its default): a sequence run through it is padded to a multiple of this many
#: positions, which costs no extra kernel block and compiles once per multiple instead of once per length.
FLEX_LENGTH_BUCKET = 128


def flex_padded_length(length: int, max_positions: int | None = None) -> int:
    """``length`` rounded up to a multiple of FLEX_LENGTH_BUCKET, but not past a scheme's position table
    (``max_positions``; a table of a length that is not a multiple compiles once more, at that length)."""
    padded = -(-length // FLEX_LENGTH_BUCKET) * FLEX_LENGTH_BUCKET
    return max(length, min(padded, max_positions)) if max_positions is not None else padded


@functools.lru_cache(maxsize=16)
def causal_block_mask(q_len: int, kv_len: int, device: str, window: int | None = None) -> Any:
    """Query i (the last ``q_len`` of ``kv_len`` positions) sees keys up to its own position, and with a
    ``window`` only the last ``window`` of them (its own included)."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = kv_len - q_len

    def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx + offset

    reach = window or 0

    def causal_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        behind = q_idx + offset - kv_idx
        return (behind >= 0) & (behind < reach)

    mask_mod = causal if window is None else causal_window  # causal_window reads a window that is set
    return create_block_mask(mask_mod, None, None, q_len, kv_len, device=device)


def document_block_mask(doc_ids: Tensor, window: int | None = None) -> Any:
    """A FlexAttention block mask per window of ``doc_ids`` (B, T): query i sees key j when j <= i, both
    are in the same document, and with a ``window`` i - j < window. Built for every batch (the documents
    differ), once per forward pass; blocks that hold no pair of one document are skipped by the kernel."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = doc_ids.shape
    reach = window or T

    def same_document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        behind = q_idx - kv_idx
        return (behind >= 0) & (behind < reach) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return create_block_mask(same_document_causal, B, None, T, T, device=str(doc_ids.device))


def capped_score_mod(score_mod: ScoreMod | None, cap: float) -> ScoreMod:
    """``score_mod`` (a positional bias, or none) after the logit cap cap * tanh(score / cap)."""

    def capped(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        score = cap * torch.tanh(score / cap)
        return score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)

    return capped


@dataclass
class DenseMask:
    """The dense route's attention mask, built one block of query rows at a time and never whole: a block's
    rows are its slice of the positional bias (``PositionalEncoding.bias_rows``), -inf (or False, without a
    bias) where causality, the window or the documents forbid a pair. A block of ``QUERY_BLOCK`` queries over
    Tk keys is (n_head, 256, Tk) floats; the whole mask would be (n_head, Tq, Tk), 3.2 GB for 12 heads over
    8,192 positions, and (B, n_head, Tq, Tk) with documents. Each layer builds its blocks anew and drops them
    after its SDPA call; what the blocks share (a table per distance) is computed once per forward pass, by
    ``bias_rows``."""

    q_positions: Tensor  # (Tq,) the queries' positions in the window (or the whole sequence)
    k_positions: Tensor  # (Tk,) the keys', the queries the last Tq of them
    bias: BiasRows | None = None
    window: int | None = None
    doc_ids: Tensor | None = None  # (B, T) each token's document in a whole window (Tq == Tk == T)

    def rows(self, start: int, end: int, keys: int) -> Tensor:
        """The mask of queries ``start..end-1`` over the first ``keys`` keys: additive (n_head, rows, keys)
        with a bias, boolean (1, rows, keys) without (True: attend); with document ids (B, n_head or 1,
        rows, keys)."""
        allowed = SlidingWindow.allowed(
            self.q_positions[start:end], self.k_positions[:keys], self.window
        )  # (rows, keys)
        if self.doc_ids is not None:
            ids = self.doc_ids
            in_document = ids[:, start:end, None] == ids[:, None, :keys]  # (B, rows, keys)
            allowed = (allowed & in_document)[:, None]  # (B, 1, rows, keys)
        else:
            allowed = allowed[None]  # (1, rows, keys)
        if self.bias is None:
            return allowed
        bias = self.bias(start, end, keys)  # (n_head, rows, keys)
        if self.doc_ids is not None:
            return torch.where(allowed, bias, float("-inf"))  # (B, n_head, rows, keys)
        return bias.masked_fill(~allowed, float("-inf"))

    def whole(self) -> Tensor:
        """Every row at once: the (n_head or 1, Tq, Tk) mask, (B, n_head or 1, Tq, Tk) with documents; the
        reference the blocks are checked against, and on the route only for the one exception that
        ``AttentionBias.build`` names."""
        return self.rows(0, len(self.q_positions), len(self.k_positions))


@dataclass
class AttentionBias:
    """What every layer of one kind (local, global) adds to plain causal attention in one forward pass: a
    positional bias, a window, a logit cap and document masking. Either the dense route's mask for SDPA,
    built a block of queries at a time (``DenseMask``; additive, the future and the positions outside the
    window or the document at -inf; or boolean, True where a query may look, when there is no bias), or a
    FlexAttention block mask with a score_mod (the cap, then the bias), per window with documents. One
    exception holds a whole mask: a bias without a gradient (ALiBi) with documents in a training step (see
    ``build``)."""

    mask: DenseMask | Tensor | None = None
    score_mod: ScoreMod | None = None
    block_mask: Any = None
    softcap: float | None = None  # the dense route's logit cap (FlexAttention's is in score_mod)

    @classmethod
    def build(
        cls,
        pos: PositionalEncoding,
        positions: Tensor,
        k_positions: Tensor,
        use_flex: bool,
        window: int | None = None,
        softcap: float | None = None,
        doc_ids: Tensor | None = None,
    ) -> AttentionBias | None:
        """None when there is no bias, window, cap or document mask (attention then takes the fused causal
        route). ``doc_ids`` (B, T): each token's document in a whole window (no cache), or None. The bias
        reads the window's positions: the relative schemes depend on q - k only, the same within a
        document wherever it starts."""
        if use_flex:
            score_mod = pos.score_mod(positions, k_positions)
            if score_mod is None and window is None and softcap is None and doc_ids is None:
                return None
            if softcap is not None:
                score_mod = capped_score_mod(score_mod, softcap)
            if doc_ids is not None:
                return cls(score_mod=score_mod, block_mask=document_block_mask(doc_ids, window))
            shape = (len(positions), len(k_positions), str(positions.device))
            mask = causal_block_mask(*shape) if window is None else causal_block_mask(*shape, window)
            return cls(score_mod=score_mod, block_mask=mask)
        bias = pos.bias_rows(positions, k_positions)
        if bias is None and window is None and softcap is None and doc_ids is None:
            return None
        dense = DenseMask(positions, k_positions, bias, window, doc_ids)
        bias_has_grad = any(p.requires_grad for p in pos.parameters())
        if doc_ids is not None and bias is not None and softcap is None:
            if torch.is_grad_enabled() and not bias_has_grad:
                # A bias without a gradient (ALiBi) with documents in a training step: SDPA's fused CPU kernel
                # takes a (B, n_head, ..) mask and keeps it for its backward, so blocks built in each layer
                # would be held once per layer; one whole mask is held once, by every layer.
                return cls(mask=dense.whole(), softcap=softcap)  # (B, n_head, Tq, Tk)
        return cls(mask=dense, softcap=softcap)


def fused_kernel_mask(mask: Tensor) -> Tensor:
    """``mask`` as SDPA's (B or 1, n_head or 1, rows, keys), the shape that lets its CPU kernel take the fused
    (flash) route: given fewer dimensions it takes the explicit route, which keeps the (B, n_head, rows, keys)
    attention weights for the backward. The fused route is taken wherever the mask needs no gradient (a
    boolean mask, ALiBi, any bias under ``no_grad``), also with GQA and after cached keys; it keeps the mask
    itself instead, not expanded over the batch, and its results equal the explicit route's to float rounding.
    A mask that needs a gradient (the learned biases of ``relative`` and ``fire`` in a training step) takes
    the explicit route either way, in torch 2.11 and 2.13: the fused kernel gives no gradient for a mask (a call
    with attention dropout takes it too). Measured on a CPU, one thread (docs/performance.md, "The dense route's
    fused kernel"): one SDPA call at T=1024, B=4, 4 heads of 64, forward and backward, 2.4-2.5x faster with a
    mask that needs no gradient, unchanged with one that does; a training step of the bench's 2-layer stack
    with ALiBi at T=1024, 1.24x faster and its peak memory 391 -> 237 MiB (954 -> 478 MiB at 2,048). The fused
    route keeps each layer's blocks' masks, (n_head, T, ~T/2 + 128) floats a layer: still less than the
    explicit route's weights and scores even at B=1 (a 2-layer step at T=2,048: 302 -> 216 MiB). One whole
    mask shared by the layers keeps less as layers are added, but little shows in the peak (12 layers at
    T=1024: 1,010 against 1,060 MiB), so the blocks stay and no pass holds the whole mask."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def dense_bias_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: DenseMask | Tensor,
    dropout_p: float,
    gqa: bool,
    scale: float | None = None,
    softcap: float | None = None,
) -> Tensor:
    """softmax(q k^T / sqrt(d) + mask) v in blocks of queries, each over the keys up to its last query only.
    q: (B, n_head, T, d); k, v: (B, n_kv_head, Tk, d) with the T queries the last T of the Tk positions;
    mask: a ``DenseMask``, whose rows each block builds for itself, or a whole (n_head or 1, T, Tk) or
    (B, n_head or 1, T, Tk) mask that each block slices; additive or boolean (True: attend). ``scale``: the
    factor on q k^T instead of 1 / sqrt(d) (muP's). ``softcap``: the scores are capped first, computed
    explicitly (SDPA cannot)."""
    T, Tk = q.size(2), k.size(2)

    def attend(q: Tensor, k: Tensor, v: Tensor, start: int, end: int) -> Tensor:
        keys = k.size(2)
        rows = mask.rows(start, end, keys) if isinstance(mask, DenseMask) else mask[..., start:end, :keys]
        if rows.is_floating_point():
            rows = rows.to(q.dtype)
        if softcap is not None:
            return softcapped_attention(q, k, v, rows, softcap, dropout_p, gqa, scale)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=fused_kernel_mask(rows), dropout_p=dropout_p, enable_gqa=gqa, scale=scale
        )

    if T <= QUERY_BLOCK:
        return attend(q, k, v, 0, T)
    blocks = []
    for start in range(0, T, QUERY_BLOCK):
        end = min(T, start + QUERY_BLOCK)
        keys = Tk - T + end  # keys past the block's last query are all in the future
        blocks.append(attend(q[:, :, start:end], k[:, :, :keys], v[:, :, :keys], start, end))
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
        # None: 1/sqrt(head_dim); under muP sqrt(base_head_dim)/head_dim (model/config.py).
        self.scale = attention_scale(config)
        variants = config.attention
        self.window = variants.layer_window(layer)  # None: a global layer
        self.softcap = variants.logit_softcap
        self.q_norm: QKNorm | None = None
        self.k_norm: QKNorm | None = None
        if variants.qk_norm != "none":  # Qwen3's names, so that its weights map one to one
            self.q_norm = QKNorm(variants.qk_norm, self.head_dim, variants.qk_norm_eps)
            self.k_norm = QKNorm(variants.qk_norm, self.head_dim, variants.qk_norm_eps)
        # Gated attention: a sigmoid gate on each head's output, from the layer's input.
        self.gate: AttentionGate | None = None
        if variants.gate != "none":
            self.gate = AttentionGate(variants.gate, config.n_embd, self.n_head, self.head_dim)
        # Value residual: the first layer hands its values on; every later layer mixes them into its own.
        self.hands_on_values = variants.value_residual != "none" and layer == 0
        self.value_residual: ValueResidual | None = None
        if variants.value_residual != "none" and layer > 0:
            self.value_residual = ValueResidual(variants.value_residual)
        # Differential attention: two attention maps of half-width queries and keys, subtracted.
        self.differential: DifferentialAttention | None = None
        if variants.differential:
            rotary = positional.get(config.pos.name).is_rotary  # each half takes whole rotation pairs
            self.differential = DifferentialAttention(layer, self.head_dim, pairs=rotary)

    def forward(
        self,
        x: Tensor,
        pos: PositionalEncoding,
        positions: Tensor,
        cache: KVCache | None,
        bias: AttentionBias | None = FROM_SCHEME,
        first_values: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, n_embd) at ``positions``; ``bias``: the forward pass's positional bias, window and cap
        for this layer's kind, built once by the model (None: none of them), or by default built here.
        ``first_values``: the first layer's values of these T tokens (B, n_kv_head, T, head_dim), which a
        later layer mixes into its own under ``attention.value_residual``.

        Returns the layer's output (B, T, n_embd), and its values when it is the first layer of a model with
        a value residual (None otherwise)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim],
            dim=-1,
        )
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, n_head, T, head_dim)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, head_dim)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, head_dim)
        handed_on = v if self.hands_on_values else None
        if self.value_residual is not None:
            if first_values is None:
                raise ValueError(
                    f"layer {self.layer} mixes the first layer's values (attention.value_residual) but was "
                    "given none: pass the first layer's values as first_values"
                )
            # Mixed before caching: the mix is per position, so the cache holds what a whole pass computes.
            v = self.value_residual(v, first_values)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # before the rotation, as OLMo 2 and Qwen3
        q, k = pos.rotate(q, k, positions)
        if cache is not None:
            k, v = cache.update(self.layer, k, v, self.window)  # (B, n_kv_head, Tk, head_dim)
        Tk = k.size(2)
        dropout_p = self.dropout if self.training else 0.0
        # Grouped-query attention (Ainslie et al. 2023): query head i reads K/V head i // (n_head /
        # n_kv_head), without materialising repeated keys and values.
        gqa = self.n_kv_head != self.n_head
        if bias is FROM_SCHEME:
            end = int(positions[-1]) + 1
            k_positions = torch.arange(end - Tk, end, device=x.device)
            bias = AttentionBias.build(pos, positions, k_positions, False, self.window, self.softcap)

        if self.differential is None:
            y = self.attend(q, k, v, bias, positions, dropout_p, gqa)
        else:  # the same kernel twice over the same values, with each half of the queries and keys
            if bias is not None and bias.block_mask is not None:
                # Only a document mask gets here (config time refuses a bias scheme, a window and a cap).
                raise ConfigError(
                    "attention.differential=true cannot take data.document_mask=true on CUDA, where the "
                    "document mask goes through FlexAttention: set data.document_mask=false, or "
                    "attention.differential=false."
                )
            (q1, q2), (k1, k2) = self.differential.split(q), self.differential.split(k)
            y1 = self.attend(q1, k1, v, bias, positions, dropout_p, gqa)
            y2 = self.attend(q2, k2, v, bias, positions, dropout_p, gqa)
            y = self.differential(y1, y2)
        y = y.transpose(1, 2)  # (B, T, n_head, head_dim)
        if self.gate is not None:
            y = self.gate(y, x)  # after SDPA, before the output projection
        y = y.contiguous().view(B, T, C)  # (B, T, n_embd)
        return self.resid_dropout(self.c_proj(y)), handed_on

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: AttentionBias | None,
        positions: Tensor,
        dropout_p: float,
        gqa: bool,
    ) -> Tensor:
        """softmax(q k^T * scale + bias) v through the route that fits, scale = 1/sqrt(q's head_dim) unless
        muP sets it. q: (B, n_head, T, d); k: (B, n_kv_head, Tk, d); v: (B, n_kv_head, Tk, d_v), with the T
        queries the last T of the Tk positions. Returns (B, n_head, T, d_v)."""
        T, Tk = q.size(2), k.size(2)
        scale = self.scale
        if bias is not None and bias.block_mask is not None:
            return compiled_flex_attention(q, k, v, bias.score_mod, bias.block_mask, gqa, scale)
        elif bias is not None and bias.mask is not None:
            return dense_bias_attention(q, k, v, bias.mask, dropout_p, gqa, scale, bias.softcap)
        elif Tk == T:
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa, scale=scale
            )
        else:  # a chunk of queries after cached keys: an explicit causal mask
            k_positions = torch.arange(Tk, device=q.device) + (int(positions[-1]) + 1 - Tk)
            mask = fused_kernel_mask(k_positions[None, :] <= positions[:, None])
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa, scale=scale
            )
