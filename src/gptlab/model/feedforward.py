"""The feed-forward layer of each block, one class per variant, registered by name (``mlp=dense|moe``).

- ``dense``: the position-wise MLP (expand, non-linearity, project back), every token through the same
  weights.
- ``moe``: a sparse Mixture-of-Experts layer (Shazeer et al. 2017, "Outrageously Large Neural Networks";
  Fedus et al. 2021, "Switch Transformers"; Jiang et al. 2024, "Mixtral of Experts"; Dai et al. 2024,
  "DeepSeekMoE"): a router sends each token to ``top_k`` of ``experts`` MLPs, and the layer's output is their
  outputs weighted by the router's probabilities. :class:`MoE` says how.

Both take the chosen ``activation=`` (a gated one doubles each expert's first projection, as in the dense
MLP). The model reads the layers' routing statistics after a forward pass (``GPT.routing_losses``): the
auxiliary losses a training step adds to the language-model loss, and the experts' load.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import Tensor, nn

from gptlab.errors import ConfigError
from gptlab.model import activations
from gptlab.registry import NoOptions, Registry


class LayerShape(Protocol):
    """What a feed-forward layer reads of the model's config (a :class:`gptlab.model.config.GPTConfig`,
    which imports this module to check its ``mlp`` node: named here by what it provides, not imported)."""

    n_embd: int
    bias: bool
    dropout: float
    mlp_ratio: float | None
    activation: Any  # the activation's Choice
    mlp: Any  # this layer's Choice: its name and typed options

    @property
    def gated(self) -> bool: ...


REGISTRY: Registry[type[Any]] = Registry("feed-forward layer", "mlp")
register = REGISTRY.register
get = REGISTRY.get
names = REGISTRY.names


def build(config: LayerShape) -> nn.Module:
    """The feed-forward layer ``config.mlp`` chooses, for one block of ``config``."""
    return get(config.mlp.name)(config)


def mlp_hidden_width(config: LayerShape) -> int:
    """The feed-forward hidden width: 4x n_embd, or for gated activations 2/3 of that rounded up to a
    multiple of 64, which keeps the parameter count of the 4x MLP (Shazeer 2020, "GLU Variants Improve
    Transformer"). ``mlp_ratio`` overrides either."""
    if config.mlp_ratio is not None:
        return int(round(config.mlp_ratio * config.n_embd))
    if config.gated:
        return 64 * math.ceil(2 * 4 * config.n_embd / 3 / 64)
    return 4 * config.n_embd


@register("dense")
class MLP(nn.Module):
    """The position-wise feed-forward network: expand, non-linearity, project back. ``hidden``: its width
    (default: :func:`mlp_hidden_width`); ``dropout``: whether the model's dropout follows it (an expert's
    output is dropped once, by its MoE layer)."""

    Options: ClassVar[type] = NoOptions

    def __init__(self, config: LayerShape, hidden: int | None = None, dropout: bool = True) -> None:
        super().__init__()
        hidden = hidden or mlp_hidden_width(config)
        self.c_fc = nn.Linear(config.n_embd, hidden * (2 if config.gated else 1), bias=config.bias)
        self.act = activations.build(config.activation)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout) if dropout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


@dataclass(frozen=True)
class MoEOptions:
    """The ``mlp.*`` keys of ``mlp=moe`` (conf/mlp/moe.yaml says why each default)."""

    experts: int = 8
    top_k: int = 2
    # Each expert's hidden width; None: the dense MLP's width / top_k (rounded up), so that a token's
    # active parameters and FLOPs are the dense model's (fine-grained experts, DeepSeekMoE).
    expert_hidden: int | None = None
    # Experts every token goes through besides its top_k (DeepSeekMoE's shared experts), each expert_hidden
    # wide.
    shared_experts: int = 0
    # The top_k weights divided by their sum (Mixtral), or the router's probabilities as they are (Switch).
    renormalize: bool = True
    # Switch's load-balancing loss, N sum_i f_i P_i, times this (Fedus et al. 2021: 0.01).
    balance_coef: float = 0.01
    # Where f_i, each expert's share of the assignments, is counted: in each micro-batch of each rank (Switch,
    # Megatron's default), or over the data-parallel batch, every rank's micro-batch and the optimizer step's
    # earlier ones (Qiu et al. 2025, "Demons in the Details"): the training step counts it (GPT.routing_losses).
    balance_scope: Literal["micro_batch", "global"] = "micro_batch"
    # ST-MoE's router z-loss, the mean of logsumexp(router logits)^2, times this (Zoph et al. 2022: 0.001).
    z_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        if self.experts < 1:
            raise ConfigError(f"mlp.experts={self.experts} must be at least 1 (e.g. mlp.experts=8).")
        if self.top_k < 1:
            raise ConfigError(
                f"mlp.top_k={self.top_k} must be at least 1: each token goes to its top_k experts (e.g. "
                "mlp.top_k=2)."
            )
        if self.top_k > self.experts:
            raise ConfigError(
                f"mlp.top_k={self.top_k} is more than mlp.experts={self.experts}: a token cannot go to more "
                f"experts than there are. Use mlp.top_k={self.experts} or less, or mlp.experts={self.top_k} "
                "or more."
            )
        if self.expert_hidden is not None and self.expert_hidden < 1:
            raise ConfigError(
                f"mlp.expert_hidden={self.expert_hidden} must be a positive width, or null for the dense "
                "width / top_k."
            )
        if self.shared_experts < 0:
            raise ConfigError(
                f"mlp.shared_experts={self.shared_experts} must be 0 or more (DeepSeekMoE: 1 or 2)."
            )
        for key in ("balance_coef", "z_loss_coef"):
            value = getattr(self, key)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"mlp.{key}={value} must be 0 or more (0: no such loss).")
        if self.balance_scope == "global" and self.balance_coef == 0:
            raise ConfigError(
                "mlp.balance_scope=global with mlp.balance_coef=0: there is no load-balancing loss whose expert "
                "shares could be counted over the global batch. Set mlp.balance_coef above 0 (Switch: 0.01), or "
                "leave mlp.balance_scope=micro_batch."
            )
        if self.top_k == 1 and self.renormalize and self.experts > 1:
            raise ConfigError(
                "mlp.top_k=1 with mlp.renormalize=true weights every token's one expert by 1: the router would "
                "get no gradient from the language-model loss, only from the auxiliary losses. Set "
                "mlp.renormalize=false (Switch Transformer's top-1 routing, weighted by the router's "
                "probability), or mlp.top_k=2."
            )


def expert_hidden_width(config: LayerShape, options: MoEOptions) -> int:
    """An expert's hidden width: ``mlp.expert_hidden``, else the dense width divided by ``top_k``, rounded
    up (a token's routed experts then hold the dense MLP's parameters)."""
    if options.expert_hidden is not None:
        return options.expert_hidden
    return -(-mlp_hidden_width(config) // options.top_k)


def balance_loss(counts: Tensor, probs: Tensor) -> Tensor:
    """Switch's load-balancing loss N sum_i f_i P_i (Fedus et al. 2021, eq. 4) of one layer: f_i the share of
    the assignments ``counts`` gives expert i (a count, no gradient), P_i ``probs``, its mean router
    probability over the tokens (the gradient's path to the router); both (E,)."""
    share = counts.float() / counts.sum().clamp_min(1)
    return probs.size(-1) * (share * probs).sum()


@dataclass
class Routing:
    """One MoE layer's routing in its last forward pass: the assignments each expert received and its mean
    router probability (the load-balancing loss's two factors), the router z-loss, unweighted (a scalar with a
    gradient to the router), and the experts' load (no gradient)."""

    counts: Tensor  # (E,) int64: the token-expert assignments each expert received, N top_k in all
    probs: Tensor  # (E,) P_i: each expert's mean router probability over the tokens, fp32
    z: Tensor  # mean over tokens of logsumexp(router logits)^2
    load_max: Tensor  # the busiest expert's share of the token-expert assignments (1/N when even)
    load_cv: Tensor  # the assignments' coefficient of variation over the experts (0 when even)

    @property
    def balance(self) -> Tensor:
        """N sum_i f_i P_i over this pass's assignments: 1 at a uniform router, up to N when one expert takes
        every token."""
        return balance_loss(self.counts, self.probs)


@register("moe")
class MoE(nn.Module):
    """A sparse Mixture-of-Experts feed-forward layer: token-choice top-k routing, dropless.

    The router, a linear map from the token to ``experts`` logits (no bias), gives probabilities p =
    softmax(logits) (in fp32). Each token goes to the ``top_k`` experts of highest probability, weighted by
    those probabilities, divided by their sum where ``renormalize`` (Mixtral) or as they are (Switch). Every
    token is processed (no capacity factor: no token is dropped, whatever the imbalance). Tokens are grouped
    by expert (one stable argsort of the assignments) and each expert runs one matrix product over its own
    tokens; an expert that received none runs over an empty batch, so that every parameter takes part in the
    graph (DDP needs no ``find_unused_parameters``) and gets a zero gradient.

    Shared experts (DeepSeekMoE, Dai et al. 2024) are one MLP of ``shared_experts * expert_hidden`` width
    that every token goes through, added to the routed output.

    After each forward pass ``routing`` holds the layer's :class:`Routing`: Switch's load-balancing loss
    N sum_i f_i P_i (f_i the share of the assignments expert i received, P_i its mean router probability over
    the tokens; Fedus et al. 2021, eq. 4, with f_i over the top_k assignments), and ST-MoE's router z-loss
    (Zoph et al. 2022, eq. 5)."""

    Options: ClassVar[type] = MoEOptions
    _experts_eager: ClassVar[bool] = False  # _run_experts wrapped by _keep_experts_eager

    def __init__(self, config: LayerShape) -> None:
        super().__init__()
        options: MoEOptions = config.mlp.options
        self.options = options
        self.n_embd = config.n_embd
        self.hidden = expert_hidden_width(config, options)
        self.router = nn.Linear(config.n_embd, options.experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, self.hidden, dropout=False) for _ in range(options.experts))
        self.shared = (
            MLP(config, options.shared_experts * self.hidden, dropout=False)
            if options.shared_experts
            else None
        )
        self.dropout = nn.Dropout(config.dropout)
        self.routing: Routing | None = None
        _keep_experts_eager()

    def expert_parameters(self) -> int:
        """The parameters of one routed expert."""
        return sum(p.numel() for p in self.experts[0].parameters())

    def forward(self, x: Tensor) -> Tensor:
        E, k = self.options.experts, self.options.top_k
        tokens = x.reshape(-1, self.n_embd)  # (N, h)
        N = tokens.size(0)
        logits = self.router(tokens).float()  # (N, E), fp32 for the softmax and the z-loss
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(k, dim=-1)  # (N, k) each
        if self.options.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # Group the N k assignments by expert: a stable sort keeps each expert's tokens in order.
        assigned = chosen.reshape(-1)  # (N k,): assignment a is token a // k's
        order = assigned.argsort(stable=True)
        counts = torch.bincount(assigned, minlength=E)  # (E,)
        token_of = order // k  # the token of each assignment, in expert order
        routed = self._run_experts(tokens.index_select(0, token_of), counts)  # (N k, h), in expert order
        routed = routed * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(routed.dtype)
        out = routed.new_zeros(N, self.n_embd).index_add(0, token_of, routed)
        if self.shared is not None:
            out = out + self.shared(tokens)
        self.routing = self._statistics(logits, probs, counts, N)
        return self.dropout(out.reshape(*x.shape[:-1], self.n_embd))

    def _run_experts(self, inputs: Tensor, counts: Tensor) -> Tensor:
        """Each expert over its own rows of ``inputs`` (grouped by expert, ``counts`` rows each), in eager mode
        under torch.compile (:func:`_keep_experts_eager`): the split sizes are the routing's data, so a compiled
        graph would be specialised to them and recompiled as they change (6 graphs in 4 steps of one layer),
        until torch's recompile limit silently left the block uncompiled. Left out of the graph, the block
        compiles once, around a break here; the experts' products are large matrix products that compiling
        would not speed up."""
        parts = inputs.split(counts.tolist())
        return torch.cat([expert(part) for expert, part in zip(self.experts, parts, strict=True)])

    def _statistics(self, logits: Tensor, probs: Tensor, counts: Tensor, N: int) -> Routing:
        k = self.options.top_k
        share = counts.float() / max(1, N * k)  # f_i, no gradient (a count)
        z = torch.logsumexp(logits, dim=-1).square().mean()
        load = counts.float()
        cv = load.std(unbiased=False) / load.mean().clamp_min(1e-9)
        return Routing(counts=counts, probs=probs.mean(dim=0), z=z, load_max=share.max(), load_cv=cv)


def _keep_experts_eager() -> None:
    """Wrap :meth:`MoE._run_experts` in ``torch.compiler.disable``, once, when the first MoE layer is made
    rather than when this module is imported: the wrapper imports Dynamo, about 0.8 s of every process that
    reads a model's config (a refused `python train.py model.n_head=3` took 2.8 s with it, 2.1 without), while
    only a model with experts needs it, before any forward pass."""
    if not MoE._experts_eager:
        MoE._run_experts = torch.compiler.disable(MoE._run_experts)  # type: ignore[method-assign]
        MoE._experts_eager = True


@dataclass
class RoutingLosses:
    """The routing of every MoE layer of a forward pass, together: the auxiliary losses (means over the
    layers, so that each reads the same at any depth: the balance 1 at a uniform router) and ``objective``,
    what a training step adds to the language-model loss (each loss times its coefficient)."""

    balance: Tensor
    z: Tensor
    objective: Tensor
    load_max: Tensor  # the largest share of any expert in any layer
    load_cv: Tensor  # the mean over the layers
    counts: Tensor  # (layers, E) int64: this pass's assignments per expert, each layer's row

    @classmethod
    def of(
        cls,
        layers: list[Routing],
        options: MoEOptions,
        balance_counts: Callable[[Tensor], Tensor] | None = None,
    ) -> RoutingLosses:
        """``balance_counts``: from this pass's (layers, E) assignment counts to those f_i is counted over
        (under ``mlp.balance_scope=global``, the training step's: summed over the data-parallel ranks and the
        step's micro-batches); None: this pass's own."""
        counts = torch.stack([r.counts for r in layers])  # (layers, E)
        over = counts if balance_counts is None else balance_counts(counts)
        balance = torch.stack([balance_loss(c, r.probs) for c, r in zip(over, layers, strict=True)]).mean()
        z = torch.stack([r.z for r in layers]).mean()
        return cls(
            balance=balance,
            z=z,
            objective=options.balance_coef * balance + options.z_loss_coef * z,
            load_max=torch.stack([r.load_max for r in layers]).max(),
            load_cv=torch.stack([r.load_cv for r in layers]).mean(),
            counts=counts,
        )
