"""A decoder-only GPT in plain PyTorch: no Lightning, no Hydra, no parallel strategy.

tokens -> ids -> token embeddings (+ position vectors) -> n_layer x [causal self-attention, feed-forward],
each with a residual and a norm -> final norm -> logits over the vocabulary through a head that reuses the
token embedding matrix. GPT-2's parameter names (``wte``, ``h``, ``ln_f``, ``lm_head``, ``c_attn``,
``c_proj``, ``c_fc``) are kept so that counts and weights can be checked against GPT-2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptlab.model import activations, norms, positional
from gptlab.model.config import GPTConfig
from gptlab.model.head_loss import HeadLoss


def mlp_hidden_width(config: GPTConfig) -> int:
    """The feed-forward hidden width: 4x n_embd, or for gated activations 2/3 of that rounded up to a
    multiple of 64, which keeps the parameter count of the 4x MLP (Shazeer 2020, "GLU Variants Improve
    Transformer"). ``mlp_ratio`` overrides either."""
    if config.mlp_ratio is not None:
        return int(round(config.mlp_ratio * config.n_embd))
    if activations.is_gated(config.activation):
        return 64 * math.ceil(2 * 4 * config.n_embd / 3 / 64)
    return 4 * config.n_embd


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

    def forward(
        self, x: Tensor, pos: positional.PositionalEncoding, positions: Tensor, cache: KVCache | None
    ) -> Tensor:
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

        k_positions = torch.arange(int(positions[-1]) + 1 - Tk, int(positions[-1]) + 1, device=x.device)
        bias = pos.bias(positions, k_positions)  # (n_head, T, Tk) or None
        is_causal, mask = False, None
        if bias is not None:
            future = k_positions[None, :] > positions[:, None]  # (T, Tk)
            mask = bias.to(q.dtype).masked_fill(future, float("-inf"))
        elif Tk == T:
            is_causal = True  # the fused causal kernel
        elif T > 1:  # a chunk of queries after cached keys: an explicit causal mask
            mask = k_positions[None, :] <= positions[:, None]
        # softmax(q k^T / sqrt(head_dim) + bias) v
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            # Grouped-query attention (Ainslie et al. 2023): query head i reads K/V head i // (n_head /
            # n_kv_head), without materialising repeated keys and values.
            enable_gqa=self.n_kv_head != self.n_head,
        )  # (B, n_head, T, head_dim)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward network: expand, non-linearity, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = mlp_hidden_width(config)
        gated = activations.is_gated(config.activation)
        self.c_fc = nn.Linear(config.n_embd, hidden * (2 if gated else 1), bias=config.bias)
        self.act = activations.get(config.activation)()
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """One transformer layer. Pre-norm (GPT-2): x + f(norm(x)). Post-norm (the original transformer):
    norm(x + f(x))."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.pre_norm = config.norm_placement == "pre"
        self.ln_1 = norms.build(config)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = norms.build(config)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, pos: positional.PositionalEncoding, positions: Tensor, cache: KVCache | None = None
    ) -> Tensor:
        if self.pre_norm:
            x = x + self.attn(self.ln_1(x), pos, positions, cache)
            x = x + self.mlp(self.ln_2(x))
        else:
            x = self.ln_1(x + self.attn(x, pos, positions, cache))
            x = self.ln_2(x + self.mlp(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                pos=positional.get(config.pos)(config),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                # Post-norm blocks already end in a norm; a final norm is a pre-norm necessity.
                ln_f=norms.build(config) if config.norm_placement == "pre" else nn.Identity(),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight  # the output layer reuses the embedding matrix
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue
            if name.endswith("c_proj.weight"):
                # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer), two per block.
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, mean=0.0, std=std)

    # ---- counting -------------------------------------------------------------------------------
    def parameter_counts(self) -> dict[str, int]:
        """total, embedding (token table and any learned position table) and non-embedding parameters;
        a tied head is counted once, with the embedding."""
        seen: set[int] = set()
        total = 0
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        embedding = self.transformer.wte.weight.numel()
        embedding += sum(p.numel() for p in self.transformer.pos.parameters())
        return {"total": total, "embedding": embedding, "non_embedding": total - embedding}

    # ---- forward --------------------------------------------------------------------------------
    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        cache: KVCache | None = None,
        head_loss: HeadLoss | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """idx: (B, T) token ids; targets: (B, T) next-token ids (-1 is ignored).
        Returns logits (B, T, vocab_size) and the mean cross-entropy (or None without targets). With
        ``head_loss`` and targets, the output layer and loss are computed together (model/head_loss.py) and
        the logits, never held whole, are None."""
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + T, device=idx.device)  # (T,)
        pos = self.transformer.pos
        x = self.transformer.wte(idx)  # (B, T, n_embd)
        x = self.transformer.drop(pos.embed(x, positions))
        for block in self.transformer.h:
            x = block(x, pos, positions, cache)
        x = self.transformer.ln_f(x)
        if cache is not None:
            cache.length += T
        if targets is not None and head_loss is not None:
            return None, head_loss(x, self.lm_head.weight, targets, self.lm_head.bias)
        logits = self.lm_head(x)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    # ---- decoding -------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eot_id: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> Tensor:
        """Continue each row of ``idx`` (B, T) by up to ``max_new_tokens`` tokens.

        ``temperature=0`` is greedy decoding (argmax); otherwise sample from softmax(logits / temperature),
        restricted to the ``top_k`` most likely tokens and/or the smallest set whose probability reaches
        ``top_p`` (nucleus sampling, Holtzman et al. 2019). Stops early when every row has emitted ``eot_id``.
        A model with a bounded position table (pos=learned) keeps the last ``block_size`` tokens as context.
        """
        was_training = self.training
        self.eval()
        limit = self.transformer.pos.max_positions

        def context(tokens: Tensor) -> Tensor:
            return tokens if limit is None else tokens[:, -limit:]

        out = idx
        cache = KVCache.empty(self.config.n_layer) if use_cache else None
        step_input = context(idx)
        finished = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            if cache is None:
                step_input = context(out)
            elif limit is not None and cache.length + step_input.size(1) > limit:
                # The position table is full: slide the window and recompute from the cropped context.
                cache = KVCache.empty(self.config.n_layer)
                step_input = context(out)
            logits, _ = self(step_input, cache=cache)
            next_id = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)  # (B, 1)
            if eot_id is not None:
                next_id = torch.where(finished[:, None], torch.full_like(next_id, eot_id), next_id)
                finished |= next_id.squeeze(1) == eot_id
            out = torch.cat([out, next_id], dim=1)
            step_input = next_id
            if eot_id is not None and bool(finished.all()):
                break
        self.train(was_training)
        return out


def sample_next(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Pick the next token id from logits (B, vocab): greedy at temperature 0, else top-k / top-p sampling."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the most likely token always stays.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
