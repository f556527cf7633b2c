"""How weights are initialised and scaled with width: the standard parametrisation, or muP.

muP, the maximal update parametrisation (Yang et al. 2022, "Tensor Programs V: Tuning Large Neural Networks
via Zero-Shot Hyperparameter Transfer", https://arxiv.org/abs/2203.03466, table 3 for Adam), makes each
layer's activations and their updates keep their scale as the width grows, so that hyperparameters tuned on
a narrow model carry over to a wide one. With width multiplier m = n_embd / mup_base_width:

- hidden matrices (the blocks' attention and MLP weights): initial std ``init_std / sqrt(m)`` (variance
  proportional to 1 / fan_in) and Adam learning rate ``lr / m``;
- input weights (token and position embeddings), biases and norm gains: unchanged init and learning rate;
- the output logits are multiplied by ``1 / m`` (the readout multiplier; with a tied head the shared matrix
  keeps the embedding's init and rate, as in the ``mup`` package's shared readout);
- attention scores are scaled by ``1 / head_dim`` instead of ``1 / sqrt(head_dim)``: written
  ``sqrt(base_head_dim) / head_dim`` so that at the base width the model is the standard one.

At m = 1 every rule is the identity: a muP model at its base width is the standard model.
"""

from __future__ import annotations

import math

from gptlab.model.config import PARAMETRIZATIONS, GPTConfig

__all__ = [
    "PARAMETRIZATIONS",
    "attention_scale",
    "hidden_init_std",
    "hidden_lr_scale",
    "is_mup",
    "output_multiplier",
    "width_multiplier",
]


def is_mup(config: GPTConfig) -> bool:
    return config.param == "mup"


def width_multiplier(config: GPTConfig) -> float:
    """m = n_embd / mup_base_width under muP, 1 in the standard parametrisation."""
    return config.n_embd / config.mup_base_width if is_mup(config) else 1.0


def hidden_init_std(config: GPTConfig) -> float:
    """The initial std of a hidden matrix: ``init_std`` standard, ``init_std / sqrt(m)`` under muP."""
    return config.init_std / math.sqrt(width_multiplier(config))


def hidden_lr_scale(config: GPTConfig) -> float:
    """The factor on Adam's learning rate for hidden matrices: 1 standard, ``1 / m`` under muP."""
    return 1.0 / width_multiplier(config)


def output_multiplier(config: GPTConfig) -> float:
    """The factor on the logits: 1 standard, ``1 / m`` under muP."""
    return 1.0 / width_multiplier(config)


def attention_scale(config: GPTConfig) -> float | None:
    """The factor on q.k: None (SDPA's 1/sqrt(head_dim)) standard; ``sqrt(base_head_dim) / head_dim`` under
    muP, which is 1/sqrt(head_dim) at the base width and falls as 1/head_dim with width."""
    if not is_mup(config):
        return None
    base_head_dim = config.mup_base_width / config.n_head
    return math.sqrt(base_head_dim) / config.head_dim
