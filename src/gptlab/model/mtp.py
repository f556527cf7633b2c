"""Multi-token prediction: at each position the model also predicts the tokens after the next one, as an
extra training objective (the ``mtp`` config node). Inference, generation and evaluation use the next-token
head alone: the extra heads are parameters that only training uses.

Two styles, each one small module per extra token, feeding the model's own final norm and output layer (the
shared unembedding) through ``loss.impl``'s output path:

- ``parallel``: Gloeckle et al. 2024, "Better & Faster Large Language Models via Multi-token Prediction"
  (arXiv:2404.19737). n independent heads on a shared trunk, each head one transformer layer. Here the
  trunk is the model's first ``n_layer - 1`` layers and its last layer is the next-token head; extra head k
  is another layer on the same trunk output, predicting the token k after the next one.
- ``sequential``: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv:2412.19437), its MTP modules.
  Module k takes depth k-1's hidden state (depth 0: the main model's last layer, before the final norm),
  normalises it and the embedding of the token k positions ahead (the shared token table), concatenates the
  two, projects them back to n_embd (a 2 n_embd x n_embd matrix) and passes the result through one
  transformer layer; its output predicts the token k after the next one.

The objective is ``L_next + mtp.weight * sum_k L_k``: Gloeckle et al. weigh every head's loss 1 (weight 1,
the default); DeepSeek-V3 uses ``lambda / D * sum_k L_k`` with lambda 0.3 for most of training and 0.1 at
the end, D = 1 (``mtp.weight`` is lambda / D). ``L_k``'s targets are the next-token targets shifted by k;
those beyond the window and those in another document (``data.document_mask=true``) are ignored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gptlab.errors import ConfigError
from gptlab.model import norms
from gptlab.registry import Choice, build_options

__all__ = ["STYLES", "MTPHeads", "MTPOptions", "shifted_targets"]

STYLES = ("parallel", "sequential")


@dataclass(frozen=True)
class MTPOptions:
    """The ``mtp`` node. ``depth``: tokens predicted beyond the next one at each position (0: off; Gloeckle
    et al.'s n is depth + 1, DeepSeek-V3's D is depth); ``style``: parallel heads or sequential modules;
    ``weight``: the factor on the sum of the extra losses."""

    depth: int = 0
    style: Literal["parallel", "sequential"] = "parallel"
    weight: float = 1.0

    def __post_init__(self) -> None:
        depth = self.depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ConfigError(
                f"mtp.depth={depth!r} must be a whole number >= 0: the tokens each position predicts beyond "
                "the next one (e.g. mtp.depth=1; 0 trains next-token prediction alone)."
            )
        weight = self.weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ConfigError(f"mtp.weight={weight!r} must be a finite number (e.g. mtp.weight=1.0).")
        if weight < 0:
            raise ConfigError(
                f"mtp.weight={weight} is negative: it would train the extra heads to predict the future "
                "tokens badly. Use a positive weight (Gloeckle et al.: 1; DeepSeek-V3: 0.3, then 0.1)."
            )
        if weight == 0 and depth > 0:
            raise ConfigError(
                f"mtp.weight=0 with mtp.depth={depth}: the extra heads would cost compute and train nothing. "
                "Use a positive mtp.weight, or mtp.depth=0 for next-token prediction alone."
            )

    @classmethod
    def from_node(cls, node: Any) -> MTPOptions:
        """The options of an ``mtp`` node (plain values; None: off), every key and type checked."""
        if isinstance(node, MTPOptions):
            return node
        if node is None:
            return cls()
        if not isinstance(node, dict):
            raise ConfigError(f"mtp={node!r} must be a config node (e.g. mtp.depth=1).")
        return build_options(cls, node, "mtp", "mtp")

    def node(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check_context(self, context: int, source: str) -> None:
        """Refused where no position of a ``context``-token window has a target ``depth`` tokens after the
        next one: every extra loss would be over no token."""
        if self.depth >= context:
            raise ConfigError(
                f"mtp.depth={self.depth} predicts the token {self.depth} after the next one, but a window of "
                f"{source}={context} tokens has no such target at any position. Use mtp.depth below "
                f"{context} (e.g. mtp.depth=1), or a longer context."
            )

    def check_model(self, block_size: int, param: str) -> None:
        """The model settings (``model.block_size``, ``model.param``) the extra heads cannot honour, refused
        with the fix."""
        if self.depth == 0:
            return
        self.check_context(block_size, "model.block_size")
        if param == "mup":
            raise ConfigError(
                f"mtp.depth={self.depth} with model.param=mup: the extra heads' initialisation and learning "
                "rates are not scaled with the width, so the hyperparameters would not transfer. Use "
                "model.param=standard, or mtp.depth=0."
            )


def shifted_targets(targets: Tensor, k: int, doc_ids: Tensor | None, ignore_index: int = -1) -> Tensor:
    """The targets (B, T) of the head that predicts the token ``k`` after the next one: position i takes
    ``targets[:, i + k]``. Ignored (``ignore_index``): the last ``k`` positions (their target is beyond the
    window), ignored next-token targets, and with ``doc_ids`` (B, T) a target in another document than
    position i's. The next-token target at j belongs to ``doc_ids[:, j]`` (an end-of-text token ends the
    document before it, data.datamodule.document_ids), so position i's is kept where ``doc_ids[:, i + k]``
    equals ``doc_ids[:, i]``."""
    B, T = targets.shape
    out = torch.full_like(targets, ignore_index)
    if k >= T:
        return out
    ahead = targets[:, k:]
    if doc_ids is not None:
        ahead = torch.where(
            doc_ids[:, k:] == doc_ids[:, : T - k], ahead, torch.full_like(ahead, ignore_index)
        )
    out[:, : T - k] = ahead
    return out


class MTPHeads(nn.Module):
    """The extra heads of :class:`MTPOptions` ``depth`` > 0: ``blocks[k-1]`` (a transformer layer made by
    ``make_block``, the model's last layer's kind) predicts the token k after the next one; the sequential
    style adds, per module, ``norm``s (the model's norm, width ``n_embd``) of the previous hidden state and of
    the token embedding, and the projection of their concatenation."""

    def __init__(
        self, options: MTPOptions, n_embd: int, norm: Choice, make_block: Callable[[], nn.Module]
    ) -> None:
        super().__init__()
        self.options = options
        self.blocks = nn.ModuleList([make_block() for _ in range(options.depth)])
        if options.style == "sequential":
            h = n_embd
            self.norm_hidden = nn.ModuleList([norms.build(norm, h) for _ in range(options.depth)])
            self.norm_embed = nn.ModuleList([norms.build(norm, h) for _ in range(options.depth)])
            self.proj = nn.ModuleList([nn.Linear(2 * h, h, bias=False) for _ in range(options.depth)])

    def losses(
        self,
        trunk: Tensor,
        final: Tensor,
        idx: Tensor,
        targets: Tensor,
        doc_ids: Tensor | None,
        embed: Callable[[Tensor], Tensor],
        layer: Callable[[nn.Module, Tensor], Tensor],
        output_loss: Callable[[Tensor, Tensor], Tensor],
        ignore_index: int = -1,
    ) -> list[Tensor]:
        """The extra losses L_1..L_depth, in order, each through ``output_loss(hidden, targets)`` (the
        model's final norm, output layer and ``loss.impl``). ``trunk``: the input of the model's last layer
        (the parallel heads' input); ``final``: its output (the sequential modules' depth 0); ``embed``:
        token ids -> scaled embeddings; ``layer(block, x)``: ``block`` run at the model's positions, masks
        and biases. A head whose targets are all ignored (a window whose documents all end within k tokens)
        adds zero and is not passed to ``output_loss``; the ignored targets of head k are a subset of head
        k+1's, so the heads that reach ``output_loss`` are the first ones, in order."""
        out: list[Tensor] = []
        previous = final
        if self.options.style == "sequential":
            # the token i + k of position i: the inputs, then the last target, then padding (ignored targets)
            ahead = torch.cat([idx, targets[:, -1:].clamp_min(0)], dim=1)
        for k, block in enumerate(self.blocks, start=1):
            shifted = shifted_targets(targets, k, doc_ids, ignore_index)
            if self.options.style == "parallel":
                hidden = layer(block, trunk)
            else:
                T = idx.size(1)
                tokens = ahead[:, k : k + T]
                tokens = torch.cat([tokens, tokens.new_zeros(tokens.size(0), T - tokens.size(1))], dim=1)
                mixed = torch.cat(
                    [self.norm_hidden[k - 1](previous), self.norm_embed[k - 1](embed(tokens))], dim=-1
                )
                hidden = layer(block, self.proj[k - 1](mixed))
                previous = hidden
            # A mean over no target is NaN, and so would be its gradients: checked here (one small sync). Such
            # a head adds zero, through its weights all the same, so that every parameter takes part in each
            # step (DistributedDataParallel expects a gradient for each), and it calls no output layer.
            if bool((shifted != ignore_index).any()):
                out.append(output_loss(hidden, shifted))
            else:
                out.append(hidden.sum() * 0.0)
        return out
