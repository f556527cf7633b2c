"""A decoder-only GPT in plain PyTorch: no Lightning, no Hydra, no parallel strategy.

tokens -> ids -> token embeddings (+ position vectors) -> n_layer x [causal self-attention, feed-forward],
each with a residual and a norm -> final norm -> logits over the vocabulary through a head that reuses the
token embedding matrix. GPT-2's parameter names (``wte``, ``h``, ``ln_f``, ``lm_head``, ``c_attn``,
``c_proj``, ``c_fc``) are kept so that counts and weights can be checked against GPT-2.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptlab.model import attention, feedforward, norms, positional
from gptlab.model.attention import FROM_SCHEME, AttentionBias, CausalSelfAttention, KVCache
from gptlab.model.config import GPTConfig, hidden_init_std, output_multiplier
from gptlab.model.feedforward import MLP, MoE, RoutingLosses, mlp_hidden_width
from gptlab.model.head_loss import HeadLoss, soft_cap
from gptlab.model.mtp import MTPHeads

log = logging.getLogger(__name__)

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "KVCache",
    "document_positions",
    "fit_vocab_rows",
    "mlp_hidden_width",
    "prefill_chunk",
]


#: The most bytes of attention mask that one chunk of ``GPT.prefill`` builds for a kind of layer (local,
#: global): the dense fp32 (n_head, chunk, keys) mask of a bias, window or cap. 256 MiB holds 682 queries
#: over 8,192 keys with 12 heads; the chunk shrinks as the prompt grows, so the bound holds at any length.
PREFILL_MASK_BYTES = 256 * 2**20


def prefill_chunk(n_head: int, key_length: int, budget: int | None = None) -> int:
    """Queries per prefill chunk over at most ``key_length`` keys: the largest number whose fp32 mask
    (n_head, chunk, key_length) fits in ``budget`` bytes (None: ``PREFILL_MASK_BYTES``), at least one."""
    budget = PREFILL_MASK_BYTES if budget is None else budget
    return max(1, budget // (4 * n_head * key_length))


class Block(nn.Module):
    """One transformer layer. Pre-norm (GPT-2): x + f(norm(x)). Post-norm (the original transformer):
    norm(x + f(x)). Sandwich (Ding et al. 2021, "CogView"; Gemma 2): x + norm'(f(norm(x)))."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.pre_norm = config.norm_placement in ("pre", "sandwich")
        self.ln_1 = norms.build(config.norm, config.n_embd)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = norms.build(config.norm, config.n_embd)
        self.mlp = feedforward.build(config)  # mlp=dense|moe
        # The sandwich's norms on the sublayers' outputs; the identity otherwise.
        sandwich = config.norm_placement == "sandwich"
        self.ln_1_out = norms.build(config.norm, config.n_embd) if sandwich else nn.Identity()
        self.ln_2_out = norms.build(config.norm, config.n_embd) if sandwich else nn.Identity()

    def forward(
        self,
        x: Tensor,
        pos: positional.PositionalEncoding,
        positions: Tensor,
        cache: KVCache | None = None,
        bias: AttentionBias | None = FROM_SCHEME,
        first_values: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The layer's output, and its attention's values when it is the first layer of a model with a value
        residual (``attention.value_residual``: the later layers take them as ``first_values``)."""
        if self.pre_norm:
            y, values = self.attn(self.ln_1(x), pos, positions, cache, bias, first_values)
            x = x + self.ln_1_out(y)
            x = x + self.ln_2_out(self.mlp(self.ln_2(x)))
        else:
            y, values = self.attn(x, pos, positions, cache, bias, first_values)
            x = self.ln_1(x + y)
            x = self.ln_2(x + self.mlp(x))
        return x, values


class Trunk(nn.ModuleDict):
    """The layers between token ids and the output layer, typed by name (the keys of GPT-2's checkpoints:
    transformer.wte, transformer.h.0, ...)."""

    wte: nn.Embedding
    pos: positional.PositionalEncoding
    drop: nn.Dropout
    h: nn.ModuleList
    ln_f: nn.Module


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = Trunk(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                pos=positional.build(
                    config.pos, n_head=config.n_head, head_dim=config.head_dim, block_size=config.block_size
                ),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                # Post-norm blocks already end in a norm; a final norm is a pre-norm necessity.
                ln_f=norms.build(config.norm, config.n_embd)
                if config.norm_placement != "post"
                else nn.Identity(),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Both made with vocab_size rows (their constructors draw from the RNG as an unpadded model's do, so
        # every later draw is the same), then given padded_vocab_size rows: the first vocab_size the tokens',
        # the rest zero and never read (model.vocab_multiple).
        pad_vocab_rows_(self.transformer.wte, config.padded_vocab_size)
        pad_vocab_rows_(self.lm_head, config.padded_vocab_size)
        # Multi-token prediction's extra heads (mtp.depth > 0, model/mtp.py), used in training alone. Their
        # constructors' draws are discarded (reset_parameters draws every weight) and their parameters come
        # last, so that the model's own weights are those drawn without them.
        self.mtp: MTPHeads | None = None
        if config.mtp.depth > 0:
            with torch.random.fork_rng(devices=[]):
                self.mtp = MTPHeads(
                    config.mtp, config.n_embd, config.norm, lambda: Block(config, config.n_layer - 1)
                )
        if config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight  # the output layer reuses the embedding matrix
        self.output_mult = output_multiplier(config)
        # Gemma 2's final-logit softcap (loss.final_softcap; model/head_loss.py), applied wherever the model
        # produces logits; None: no cap.
        self.final_softcap: float | None = None
        self.reset_parameters()
        # A checkpoint saved with another number of rows (before the padding, or under another
        # model.vocab_multiple) is padded or cut to this model's rows as it loads.
        self.register_load_state_dict_pre_hook(_fit_vocab_rows_on_load)

    @property
    def vocab_rows(self) -> tuple[str, ...]:
        """The names of the parameters whose rows are the vocabulary's, padded to ``padded_vocab_size``."""
        return ("transformer.wte.weight", "lm_head.weight")

    def reset_parameters(self) -> None:
        # Embeddings (and a tied head) at init_std; the blocks' matrices at init_std, or init_std / sqrt(m)
        # under muP (model/config.py).
        std = self.config.init_std
        hidden_std = hidden_init_std(self.config)
        V = self.config.vocab_size
        for name, p in self.named_parameters():
            if name in self.vocab_rows:
                # The tokens' rows draw exactly what an unpadded table draws (the same RNG calls, the same
                # order); the padding rows are zero, and stay zero: they get no gradient.
                nn.init.normal_(p[:V], mean=0.0, std=std)
                nn.init.zeros_(p[V:])
                continue
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue
            block_std = hidden_std if name.startswith("transformer.h.") else std
            if name.endswith("attn.gate.weight"):
                nn.init.zeros_(p)  # every gate 0.5 at the start (AttentionGate); draws nothing from the RNG
            elif name.endswith("c_proj.weight"):
                # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer), two per block.
                nn.init.normal_(p, mean=0.0, std=block_std / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, mean=0.0, std=block_std)

    # ---- counting -------------------------------------------------------------------------------
    def parameter_counts(self) -> dict[str, int]:
        """total, embedding (token table and any learned position table), non-embedding and active (those a
        token goes through: all but the experts an MoE layer does not route it to) parameters; a tied head is
        counted once, with the embedding. The token table and an untied head count their
        ``vocab_size`` rows: the padding rows (``model.vocab_multiple``) are stored, never trained, and
        ``padding`` counts them apart."""
        seen: set[int] = set()
        total = 0
        padding = 0
        rows = self.config.padded_vocab_size - self.config.vocab_size
        for name, p in self.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
                if name in self.vocab_rows:
                    padding += rows * p.size(1)
        total -= padding
        embedding = self.config.vocab_size * self.transformer.wte.weight.size(1)
        embedding += sum(p.numel() for p in self.transformer.pos.parameters())
        # A token goes through top_k of each MoE layer's experts: the others' weights are not active for it.
        inactive = sum(
            (m.options.experts - m.options.top_k) * m.expert_parameters()
            for m in self.modules()
            if isinstance(m, MoE)
        )
        return {
            "total": total,
            "embedding": embedding,
            "non_embedding": total - embedding,
            "active": total - inactive,
            "padding": padding,
            # multi-token prediction's extra heads, in total and non_embedding: trained, never used in inference
            "mtp": sum(p.numel() for p in self.mtp.parameters()) if self.mtp is not None else 0,
        }

    def routing_losses(
        self, balance_counts: Callable[[Tensor], Tensor] | None = None
    ) -> RoutingLosses | None:
        """The routing of the MoE layers (``mlp=moe``) in the last forward pass: the auxiliary losses a
        training step adds to the language-model loss, and the experts' load; None for a dense model. Each
        layer's record is taken (cleared), so that a later call never returns a stale pass.
        ``balance_counts``: from the pass's (layers, experts) assignment counts to those the load-balancing
        loss counts each expert's share over (``mlp.balance_scope=global``: the training step sums them over
        the data-parallel batch, which the model knows nothing of); None: the pass's own."""
        if self.config.mlp.name != "moe":  # called at every training step: a dense model walks nothing
            return None
        layers = []
        for mlp in self.modules():  # the blocks', then multi-token prediction's extra blocks' (mtp.depth)
            if isinstance(mlp, MoE) and mlp.routing is not None:
                layers.append(mlp.routing)
                mlp.routing = None
        if not layers:
            return None
        return RoutingLosses.of(layers, self.config.mlp.options, balance_counts)

    # ---- forward --------------------------------------------------------------------------------
    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        cache: KVCache | None = None,
        head_loss: HeadLoss | None = None,
        doc_ids: Tensor | None = None,
        last_only: bool = False,
        mtp: bool = False,
    ) -> tuple[Tensor | None, Tensor | None]:
        """idx: (B, T) token ids; targets: (B, T) next-token ids (-1 is ignored).
        ``doc_ids``: (B, T) the document of each token of a packed window, nondecreasing along T
        (``data.document_mask=true``, gptlab.data.datamodule.document_ids): attention stays inside each
        document, and the positions that a scheme embeds or rotates by restart at 0 at each document's first
        token (the bias schemes read q - k, the same wherever a document starts). None: one sequence.
        Returns logits (B, T, vocab_size) and the mean cross-entropy (or None without targets). With
        ``head_loss`` and targets, the output layer and loss are computed together (model/head_loss.py) and
        the logits, never held whole, are None. ``last_only``: the logits of the last position alone,
        (B, 1, vocab_size), without targets (a prompt's chunks in ``prefill``). ``mtp``: with ``head_loss``
        and targets, the loss is the training objective of multi-token prediction (model/mtp.py), the
        next-token loss plus ``mtp.weight`` times the extra heads' losses, each computed by ``head_loss``
        after the next-token one; without it (evaluation, generation) the extra heads are not run."""
        B, T = idx.shape
        if last_only and targets is not None:
            raise ValueError("last_only=True gives the last position's logits alone: it takes no targets")
        if doc_ids is not None and cache is not None:
            raise ValueError(
                "doc_ids with a KV cache: document masking applies to packed training windows; decoding "
                "continues one document, so call it without doc_ids."
            )
        dropout = self.training and self.config.dropout > 0  # FlexAttention has no dropout
        use_flex = (
            cache is None
            and not dropout
            and attention.flex_attention_available(idx.device, self.config.head_dim)
        )
        if use_flex and targets is None and doc_ids is None and self.takes_flex_attention:
            padded = attention.flex_padded_length(T, self.transformer.pos.max_positions)
            if padded > T:
                # Compiled FlexAttention has static shapes: each new length would compile anew, and decoding
                # without a cache is a new length every token. Tokens appended at the end cannot change the
                # logits of the T before them (causality), so run at the bucket's length and keep T.
                logits, _ = self(F.pad(idx, (0, padded - T)))
                assert logits is not None
                return (logits[:, T - 1 : T] if last_only else logits[:, :T]), None
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + T, device=idx.device)  # (T,)
        # The positions each token is embedded and rotated at: its place in the window, or in its document.
        token_positions = positions if doc_ids is None else document_positions(doc_ids)  # (T,) or (B, T)
        pos = self.transformer.pos
        x = self.transformer.wte(idx)  # (B, T, n_embd)
        if self.config.embed_scale != 1.0:
            x = x * self.config.embed_scale
        x = self.transformer.drop(pos.embed(x, token_positions))
        # A positional bias, a window and a cap depend on positions only: built once here for each kind of
        # layer (global, or local with its window), shared by every layer of that kind. The keys of a layer
        # are the cached ones (a local layer's cache holds its last `window` positions only) and this step's.
        softcap = self.config.attention.logit_softcap
        biases: dict[int | None, AttentionBias | None] = {}
        first_values: Tensor | None = None
        run_mtp = mtp and self.mtp is not None and targets is not None and head_loss is not None
        trunk: Tensor | None = None  # the last layer's input, multi-token prediction's shared trunk
        for i, block in enumerate(self.transformer.h):
            window = self.config.attention.layer_window(i)
            if window not in biases:
                first_key = cache.first_key_position(window) if cache is not None else 0
                k_positions = torch.arange(first_key, start + T, device=idx.device)
                biases[window] = AttentionBias.build(
                    pos, positions, k_positions, use_flex, window, softcap, doc_ids
                )
            if run_mtp and i == self.config.n_layer - 1:
                trunk = x
            x, values = block(x, pos, token_positions, cache, biases[window], first_values)
            if i == 0:
                first_values = values  # the value residual's V_1 (None without one)
        final = x
        x = self.transformer.ln_f(x)
        if self.output_mult != 1.0:
            x = x * self.output_mult  # muP's readout multiplier 1/m on the logits, applied before the head
        if cache is not None:
            cache.length += T
        if targets is not None and head_loss is not None:
            if head_loss.final_softcap != self.final_softcap:
                raise ValueError(
                    f"the loss caps logits at {head_loss.final_softcap} but the model at {self.final_softcap}: "
                    "set GPT.final_softcap to the loss's final_softcap"
                )
            objective = head_loss(
                x, self.lm_head.weight, targets, self.lm_head.bias, vocab_size=self.config.vocab_size
            )
            if run_mtp:
                assert self.mtp is not None and trunk is not None
                last_bias = biases[self.config.attention.layer_window(self.config.n_layer - 1)]

                def layer(block: nn.Module, h: Tensor) -> Tensor:
                    return block(h, pos, token_positions, None, last_bias, first_values)[0]

                def embed(tokens: Tensor) -> Tensor:
                    e = self.transformer.wte(tokens)
                    return e * self.config.embed_scale if self.config.embed_scale != 1.0 else e

                def output_loss(h: Tensor, shifted: Tensor) -> Tensor:
                    h = self.transformer.ln_f(h)
                    h = h * self.output_mult if self.output_mult != 1.0 else h
                    return head_loss(
                        h, self.lm_head.weight, shifted, self.lm_head.bias, vocab_size=self.config.vocab_size
                    )

                extra = self.mtp.losses(
                    trunk, final, idx, targets, doc_ids, embed, layer, output_loss, head_loss.ignore_index
                )
                if extra:
                    objective = objective + self.mtp.options.weight * torch.stack(extra).sum()
            return None, objective
        if last_only:
            x = x[:, -1:]
        # The product with every stored row (aligned), then the vocabulary's columns alone: the padding rows'
        # logits take part in nothing (no softmax, no sampling) and their gradient is zero.
        logits = soft_cap(self.lm_head(x)[..., : self.config.vocab_size], self.final_softcap)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    @property
    def takes_flex_attention(self) -> bool:
        """Whether some layer attends through FlexAttention where it is available: a positional bias, a
        window or a logit cap (otherwise every layer takes SDPA's fused causal kernel)."""
        variants = self.config.attention
        return (
            self.transformer.pos.has_bias or variants.window is not None or variants.logit_softcap is not None
        )

    # ---- decoding -------------------------------------------------------------------------------
    def prefill(self, idx: Tensor, cache: KVCache, chunk: int | None = None) -> Tensor:
        """Feed the prompt ``idx`` (B, T) into ``cache`` ``chunk`` tokens at a time and return the logits
        (B, vocab_size) of its last position, the next token's: those of one call ``self(idx, cache=cache)``
        to fp32 rounding, and the cache it leaves.

        With a cache, attention takes SDPA: a positional bias, a window or a logit cap build a dense fp32
        mask, one block of ``QUERY_BLOCK`` queries at a time (``attention.DenseMask``), and every position's
        logits would be (B, T, vocab_size). In chunks of queries, each over the cached keys and its own, even
        a chunk's whole mask stays within ``PREFILL_MASK_BYTES`` (``prefill_chunk``, the default ``chunk``)
        and only the last position of each chunk reaches the output layer."""
        T = idx.size(1)
        if T == 0:
            raise ValueError("prefill needs a prompt of at least one token; idx has none")
        if chunk is None:
            chunk = prefill_chunk(self.config.n_head, cache.length + T)
        if chunk < 1:
            raise ValueError(f"prefill chunk={chunk} must be a positive number of tokens")
        for start in range(0, T, chunk):
            # through __call__, so that hooks on the model (FSDP2's gathering of its weights) run
            logits, _ = self(idx[:, start : start + chunk], cache=cache, last_only=True)
        assert logits is not None
        return logits[:, -1]

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
            if cache is None:
                logits, _ = self(step_input)
                assert logits is not None
                last = logits[:, -1]
            else:
                last = self.prefill(step_input, cache)  # the prompt in bounded chunks, then one token a step
            next_id = sample_next(last, temperature, top_k, top_p, generator)  # (B, 1)
            if eot_id is not None:
                next_id = torch.where(finished[:, None], torch.full_like(next_id, eot_id), next_id)
                finished |= next_id.squeeze(1) == eot_id
            out = torch.cat([out, next_id], dim=1)
            step_input = next_id
            if eot_id is not None and bool(finished.all()):
                break
        self.train(was_training)
        return out


def pad_vocab_rows_(layer: nn.Embedding | nn.Linear, rows: int) -> None:
    """Give ``layer``'s weight ``rows`` rows in place, its own first and zeros after."""
    weight = layer.weight
    if weight.size(0) == rows:
        return
    with torch.no_grad():
        padded = torch.cat([weight, weight.new_zeros(rows - weight.size(0), weight.size(1))])
    layer.weight = nn.Parameter(padded, requires_grad=weight.requires_grad)
    if isinstance(layer, nn.Embedding):
        layer.num_embeddings = rows
    else:
        layer.out_features = rows


def _fit_vocab_rows_on_load(
    module: nn.Module,
    state_dict: dict[str, Tensor],
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """A state dict whose token table (and head) has another number of rows than this model stores, padded
    with zero rows or cut to them in place (``fit_vocab_rows``): a checkpoint saved before the padding, or
    under another ``model.vocab_multiple``, loads as it was trained."""
    assert isinstance(module, GPT)
    for name in module.vocab_rows:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = fit_vocab_rows(state_dict[key], module.config, key)


_TOLD: set[tuple[int, int]] = set()


def fit_vocab_rows(tensor: Tensor, config: GPTConfig, name: str = "the token table") -> Tensor:
    """``tensor`` (rows, ...) with ``config.padded_vocab_size`` rows: zero rows appended, or the rows past
    the vocabulary cut (they are padding: zero, never read). A tensor with fewer rows than the vocabulary, or
    anything but zeros in the rows cut, is returned as it is (loading then reports the size mismatch)."""
    if tensor.dim() == 0:
        return tensor
    rows, V, padded = tensor.size(0), config.vocab_size, config.padded_vocab_size
    if rows == padded or rows < V:
        return tensor
    if rows > padded:
        extra = tensor[padded:]
        if tensor.device.type != "meta" and bool(extra.count_nonzero()):
            return tensor  # trained rows beyond this vocabulary: not padding, left to the size check
        fitted = tensor[:padded]
    else:
        fitted = torch.cat([tensor, tensor.new_zeros((padded - rows, *tensor.shape[1:]))])
    if (rows, padded) not in _TOLD:
        _TOLD.add((rows, padded))
        log.info(
            "%s: %d rows saved for a vocabulary of %d; stored with %d (model.vocab_multiple=%d), the extra "
            "rows zero and never read.",
            name,
            rows,
            V,
            padded,
            config.vocab_multiple,
        )
    return fitted


def document_positions(doc_ids: Tensor) -> Tensor:
    """(B, T): each token's position within its document, 0 at the document's first token, from the
    documents (B, T) of a window (nondecreasing along T; the window's first token starts a document)."""
    T = doc_ids.size(1)
    index = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # its document's start
    return index - first


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
