"""What a model is, counted from its config alone: parameters and training FLOPs per token.

Pure arithmetic on a :class:`GPTConfig` (no weights), so it answers for a 175B model on a laptop. The formulas,
with h = n_embd, V = vocab_size, L = n_layer, T = context, f = MLP hidden width:

Parameters. Per layer: attention h (n_head + 2 n_kv_head) head_dim for Q, K, V plus h^2 for the output
projection, plus h n_head head_dim (h n_head headwise) for an output gate's projection (``attention.gate``),
plus 3 head_dim for differential attention (four lambda vectors of head_dim / 2, a head norm's gain);
MLP h f (x2 for gated activations) plus f h; two norms; biases where ``bias`` is on. A Mixture-of-Experts layer
(``mlp=moe``) holds E experts of width f_e, each an MLP as above, a router's h E (no bias), and a shared MLP of
width s f_e (``mlp.shared_experts``); its *active* parameters, those a token goes through, are the router's,
the shared MLP's and top_k experts': ``active`` is the total less (E - top_k) experts a layer. Plus the token embedding
V h, the positional scheme's own parameters, a final norm (pre-norm), V h again for an untied head, and
2 (L - 1) learned value-residual lambdas. "Embedding" counts the token table and any learned position table
(a tied head is counted there once).

The padding (``model.vocab_multiple``): the token table and the output layer are stored with
``padded_vocab_size`` rows, V rounded up to a multiple of 64 by default, so that a GPU's products over them run
in aligned kernels. The extra rows are zero, never read and never trained: every count here is of the model's V
rows (GPT-2 small stays 124,439,808), and ``padding`` gives the stored extra weights apart ((P - V) h, twice
with an untied head).

Training FLOPs per token (Chowdhery et al. 2022, "PaLM", appendix B; the count behind nanoGPT's MFU):

    6 N + 12 L h T,    N = the weights of every matrix product: the layers' matrices (an output gate's
                       projection among them) and the head's V h,

i.e. 2 FLOPs per multiply-add, a backward pass twice the forward, and 2 matrix products of T x head_dim per
head and token for the attention scores and their weighted sum (counted over the full context, as is usual;
a causal kernel skips about half of that term). A local layer (``attention.window``) counts min(T, window)
keys instead of T: the keys its queries can reach. Differential attention (``attention.differential``) has
two score products at half width (together one at full width) and two weighted sums over V: 3 products of
T x head_dim, 18 L h T. Kaplan et al. 2020 keep only 6 N (non-embedding). Under ``mlp=moe`` N counts the active
weights (6 N_active, as Fedus et al. 2021 and DeepSeekMoE count an MoE's compute): each layer's router product
h E (every token is scored against every expert), top_k experts' matrices and the shared MLP's; the grouping of
tokens by expert and the weighted sum of the experts' outputs are no matrix products (O(top_k h) a token).

The head's term is V h, not the padded P h: these are the model's FLOPs (what MFU divides, as PaLM defines it:
the work the model needs, whatever the implementation spends beyond it, like recomputation), not the
products a kernel ran. The plain and chunked paths multiply by all P rows on a GPU, while torch's, Liger's and
Cut Cross-Entropy's kernels take the first V rows only; counting V keeps one figure for every ``loss.impl``, so
that a faster implementation shows as a higher MFU and never as more FLOPs. The difference is (P - V) / V of
the head's share: 0.09% of it at GPT-2's vocabulary.

Multi-token prediction (``mtp.depth`` = D > 0, model/mtp.py): D extra heads that training alone runs and
inference never uses. Parameters: each head one more layer of the model's last layer's shape (``per_layer``),
and in the sequential style two norms and a 2 h x h projection; ``total`` and ``non_embedding`` include them
(they are trained), and ``mtp`` gives them apart: the model that generates has ``total - mtp``. Training FLOPs
per token: each head's layer (its matrices and its attention over the last layer's keys), the shared output
layer's V h once more for each head, and the sequential projection's 2 h^2, the part ``mtp`` of ``training``
(so that MFU counts the work a step does); a forward pass in evaluation is a third of ``training - mtp``. The
scaling fit's N leaves the heads out (comparison/scaling.py): the loss it fits is the next-token model's.
"""

from __future__ import annotations

import torch

from gptlab.model import norms, positional
from gptlab.model.attention_variants import AttentionGate, DifferentialAttention, QKNorm, ValueResidual
from gptlab.model.config import GPTConfig
from gptlab.model.feedforward import MoEOptions, expert_hidden_width, mlp_hidden_width

# ---- parameters -------------------------------------------------------------------------------------


def positional_parameters(config: GPTConfig) -> int:
    """The positional scheme's own parameters (a learned table, relative-position buckets...), counted from
    the scheme built on the meta device: no memory, whatever its size."""
    with torch.device("meta"):
        scheme = positional.build(
            config.pos, n_head=config.n_head, head_dim=config.head_dim, block_size=config.block_size
        )
    return sum(p.numel() for p in scheme.parameters())


def parameter_counts(config: GPTConfig) -> dict[str, int]:
    """total, embedding, non_embedding, and per_layer parameters, from the config alone; ``padding``: the
    zero rows stored beyond the vocabulary (``model.vocab_multiple``), in none of the others."""
    h, V, bias = config.n_embd, config.vocab_size, int(config.bias)
    qkv_width = (config.n_head + 2 * config.kv_heads) * config.head_dim
    attention = h * qkv_width + qkv_width * bias + h * h + h * bias
    attention += QKNorm.parameter_count(config.attention.qk_norm, config.head_dim)
    attention += h * gate_width(config)
    if config.attention.differential:
        attention += DifferentialAttention.parameter_count(config.head_dim)
    mlp, inactive = mlp_parameters(config)
    norm = norms.get(config.norm.name).parameter_count(h, config.norm.options)
    per_layer = attention + mlp + (4 if config.norm_placement == "sandwich" else 2) * norm
    embedding = V * h + positional_parameters(config)
    final_norm = norm if config.norm_placement != "post" else 0
    head = 0 if config.tie_weights else V * h
    # The value residual's learned lambdas: every layer's but the first's, outside per_layer.
    lambdas = ValueResidual.parameter_count(config.attention.value_residual, config.n_layer)
    mtp = config.mtp.depth * (per_layer + (2 * norm + 2 * h * h if config.mtp.style == "sequential" else 0))
    total = embedding + config.n_layer * per_layer + lambdas + final_norm + head + mtp
    padding = (config.padded_vocab_size - V) * h * (1 if config.tie_weights else 2)
    return {
        "total": total,
        "embedding": embedding,
        "non_embedding": total - embedding,
        # the MoE layers' experts a token is not routed to, in the blocks and in any extra head's block
        "active": total - (config.n_layer + config.mtp.depth) * inactive,
        "per_layer": per_layer,
        "padding": padding,
        "mtp": mtp,  # multi-token prediction's extra heads: trained, never used in inference
    }


def moe_options(config: GPTConfig) -> MoEOptions | None:
    """The Mixture-of-Experts options of ``config`` (``mlp=moe``), None for a dense feed-forward layer."""
    options = config.mlp.options
    return options if isinstance(options, MoEOptions) else None


def mlp_parameters(config: GPTConfig) -> tuple[int, int]:
    """A layer's feed-forward parameters, and how many of them a token does not go through (the experts it
    is not routed to; 0 for a dense MLP)."""
    h, bias = config.n_embd, int(config.bias)

    def one_mlp(f: int) -> int:
        f_in = f * (2 if config.gated else 1)
        return h * f_in + f_in * bias + f * h + h * bias

    moe = moe_options(config)
    if moe is None:
        return one_mlp(mlp_hidden_width(config)), 0
    f_e = expert_hidden_width(config, moe)
    shared = one_mlp(moe.shared_experts * f_e) if moe.shared_experts else 0
    return h * moe.experts + moe.experts * one_mlp(f_e) + shared, (moe.experts - moe.top_k) * one_mlp(f_e)


def mlp_matmul_parameters(config: GPTConfig) -> int:
    """A layer's feed-forward weights that enter a matrix product per token: the MLP's two matrices, or under
    ``mlp=moe`` the router's, top_k experts' and the shared MLP's."""
    h = config.n_embd

    def matrices(f: int) -> int:
        return h * f * (2 if config.gated else 1) + f * h

    moe = moe_options(config)
    if moe is None:
        return matrices(mlp_hidden_width(config))
    f_e = expert_hidden_width(config, moe)
    return h * moe.experts + moe.top_k * matrices(f_e) + matrices(moe.shared_experts * f_e)


def gate_width(config: GPTConfig) -> int:
    """The outputs of a layer's attention-gate projection (``attention.gate``): n_head * head_dim gates
    (elementwise), n_head (headwise), or 0."""
    return AttentionGate.width(config.attention.gate, config.n_head, config.head_dim)


# ---- compute ----------------------------------------------------------------------------------------


def matmul_parameters(config: GPTConfig) -> int:
    """The weights that enter a matrix product per token: every layer's matrices and the output head, its V
    rows (the input embedding is a lookup; biases and norm gains cost no multiply-adds worth counting; the
    padding rows are no work of the model's: module docstring)."""
    h = config.n_embd
    qkv_width = (config.n_head + 2 * config.kv_heads) * config.head_dim
    per_layer = h * qkv_width + h * gate_width(config) + h * h + mlp_matmul_parameters(config)
    return config.n_layer * per_layer + config.vocab_size * h


def mtp_head_matmul_parameters(config: GPTConfig) -> int:
    """The weights of one multi-token prediction head that enter a matrix product per token: a layer's
    (the mean layer's of ``matmul_parameters``), the shared output layer's V rows, and the sequential
    style's 2 h x h projection."""
    h, V = config.n_embd, config.vocab_size
    layer = (matmul_parameters(config) - V * h) // config.n_layer
    return layer + V * h + (2 * h * h if config.mtp.style == "sequential" else 0)


def flops_per_token(config: GPTConfig, context: int | None = None) -> dict[str, float]:
    """Training (forward + backward) FLOPs per token, 6 N + 12 L h T (PaLM, appendix B), and its parts;
    N = ``matmul_parameters``."""
    T = context or config.block_size
    dense = 6 * matmul_parameters(config)
    keys = sum(min(T, config.attention.layer_window(i) or T) for i in range(config.n_layer))
    # Per key, head and head dimension: 2 FLOPs a multiply-add x 3 (forward and backward) x the matrix
    # products (2: the scores and the weighted sum; differential: two half-width scores and two sums, 3).
    products = 3 if config.attention.differential else 2
    per_key = 6 * products * config.n_head * config.head_dim
    attention = per_key * keys
    # multi-token prediction: each extra head a layer like the last (its keys), the output layer once more
    last_keys = min(T, config.attention.layer_window(config.n_layer - 1) or T)
    mtp = config.mtp.depth * (6 * mtp_head_matmul_parameters(config) + per_key * last_keys)
    return {
        "training": float(dense + attention + mtp),
        "dense": float(dense),
        "attention": float(attention),
        "mtp": float(mtp),
    }


# ---- printing ---------------------------------------------------------------------------------------


def human(n: float) -> str:
    """A count with an SI suffix: 1.23B, 45.00M, 6.00k; up to 999.99Y (GPT-3's training, 3.14e23 FLOPs, is
    314.00Z), beyond that in powers of ten."""
    if abs(n) >= 1e27:
        return f"{n:.2e}"
    for unit, scale in (
        ("Y", 1e24),
        ("Z", 1e21),
        ("E", 1e18),
        ("P", 1e15),
        ("T", 1e12),
        ("B", 1e9),
        ("M", 1e6),
        ("k", 1e3),
    ):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


__all__ = [
    "flops_per_token",
    "gate_width",
    "human",
    "matmul_parameters",
    "mlp_matmul_parameters",
    "mlp_parameters",
    "moe_options",
    "mtp_head_matmul_parameters",
    "parameter_counts",
    "positional_parameters",
]
