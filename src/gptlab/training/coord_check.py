"""The coordinate check of muP (Yang et al. 2022, "Tensor Programs V", https://arxiv.org/abs/2203.03466,
section 8 and figure 5): train models of growing width for a few steps and record the typical size of each
layer's output, mean |x| over its coordinates. Under muP the curves against width stay flat; in the standard
parametrisation with Adam they grow with width after a few steps (the logits first), which is why a
learning rate tuned on a narrow model does not carry over.

The models are the project's GPT on the embedded corpus with the character tokenizer, trained with the
project's optimizer groups (so muP's per-layer learning rates are the ones ``train.py`` uses).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from gptlab.model.config import GPTConfig, hidden_lr_scale
from gptlab.model.gpt import GPT, Block
from gptlab.registry import Choice
from gptlab.training.optimizers import AdamWOptions, build_optimizer


@dataclass
class CoordCheck:
    """``scales[param][layer][width]``: mean |x| of the layer's output after each training step (a list)."""

    widths: list[int]
    params: list[str]
    steps: int
    layers: list[str]
    scales: dict[str, dict[str, dict[int, list[float]]]] = field(default_factory=dict)
    setup: dict[str, Any] = field(default_factory=dict)

    def final(self, param: str, layer: str) -> list[float]:
        """The layer's mean |x| after the last step, at each width."""
        return [self.scales[param][layer][w][-1] for w in self.widths]

    def slope(self, param: str, layer: str) -> float:
        """The log-log slope of mean |x| against width after the last step: 0 is flat, 1 grows as width."""
        x = np.log(np.asarray(self.widths, dtype=float))
        y = np.log(np.asarray(self.final(param, layer)))
        return float(np.polyfit(x, y, 1)[0])

    def to_dict(self) -> dict[str, Any]:
        return {
            "widths": self.widths,
            "params": self.params,
            "steps": self.steps,
            "layers": self.layers,
            "setup": self.setup,
            "mean_abs_activation": {
                p: {layer: {str(w): v for w, v in by_w.items()} for layer, by_w in by_layer.items()}
                for p, by_layer in self.scales.items()
            },
            "slope_vs_width_after_last_step": {
                p: {layer: self.slope(p, layer) for layer in self.layers} for p in self.params
            },
        }


def layers_to_watch(model: GPT) -> dict[str, nn.Module]:
    """The modules whose outputs are measured: the token embedding, each block's attention and MLP and the
    block itself, and the output layer (the logits)."""
    watched: dict[str, nn.Module] = {"embedding": model.transformer.wte}
    blocks = cast("list[Block]", list(model.transformer.h))
    for i, block in enumerate(blocks):
        watched[f"block{i}.attn"] = block.attn
        watched[f"block{i}.mlp"] = block.mlp
        watched[f"block{i}"] = block
    watched["logits"] = model.lm_head
    return watched


def _activation_scales(model: GPT, x: torch.Tensor) -> dict[str, float]:
    out: dict[str, float] = {}
    handles = []
    for name, module in layers_to_watch(model).items():

        def hook(_m: nn.Module, _inp: Any, output: Any, name: str = name) -> None:
            if isinstance(output, tuple):  # a block or its attention: (output, the values it hands on)
                output = output[0]
            if name == "logits":  # the vocabulary's columns: the padding rows' (model.vocab_multiple) are 0
                output = output[..., : model.config.vocab_size]
            out[name] = float(output.detach().abs().mean())

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return out


def char_batches(
    batch_size: int, context: int, n_batches: int, seed: int = 0
) -> tuple[list[torch.Tensor], int]:
    """``n_batches`` (x, y) windows of the embedded corpus with the character tokenizer, and the vocabulary
    size."""
    from gptlab.data import corpus
    from gptlab.data.sources import DataSpec

    prepared = corpus.prepare(DataSpec(), {"name": "char"})
    tokens = prepared.train
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - context - 1, size=(n_batches, batch_size))
    batches = []
    for row in starts:
        windows = np.stack([tokens.read(int(s), int(s) + context + 1).astype(np.int64) for s in row])
        batches.append(torch.from_numpy(windows))
    return batches, prepared.tokenizer.vocab_size


def coordinate_check(
    widths: Sequence[int] = (64, 128, 256, 512, 1024),
    params: Sequence[str] = ("standard", "mup"),
    steps: int = 5,
    lr: float = 1e-2,
    base_width: int | None = None,
    n_layer: int = 2,
    n_head: int = 4,
    context: int = 32,
    batch_size: int = 8,
    seed: int = 0,
) -> CoordCheck:
    """muP's coordinate check (Yang et al. 2022, https://arxiv.org/abs/2203.03466, section 8): train each
    (parametrisation, width) for ``steps`` AdamW steps at a constant ``lr`` (no warmup, no
    clipping) on the same batches, measuring every watched layer's mean |x| on a fixed held batch after each
    step. ``base_width``: muP's base width (default: the smallest width)."""
    widths = sorted(widths)
    base = base_width or widths[0]
    batches, vocab = char_batches(batch_size, context, steps + 1, seed)
    probe = batches[-1][:, :-1]
    optim = Choice("adamw", AdamWOptions(lr=lr, warmup_steps=0))
    result = CoordCheck(
        widths=list(widths),
        params=list(params),
        steps=steps,
        layers=[],
        setup=_setup_record(lr, base, n_layer, n_head, context, batch_size, vocab, seed),
    )
    for param in params:
        result.scales[param] = {}
        for width in widths:
            torch.manual_seed(seed)
            config = GPTConfig(
                vocab_size=vocab,
                block_size=context,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=width,
                param=param,
                mup_base_width=base,
            )
            scales, loss = _train_and_probe(config, optim, batches, probe, steps)
            for layer, values in scales.items():
                result.scales[param].setdefault(layer, {}).setdefault(width, []).extend(values)
            if loss is not None and not math.isfinite(float(loss.detach())):
                raise FloatingPointError(f"param={param} width={width}: the loss diverged at lr={lr}")
    result.layers = list(next(iter(result.scales.values())).keys())
    return result


def _setup_record(
    lr: float,
    base: int,
    n_layer: int,
    n_head: int,
    context: int,
    batch_size: int,
    vocab: int,
    seed: int,
) -> dict[str, Any]:
    """The check's settings as recorded in its result: learning rate, optimizer, model and batch shape."""
    return {
        "lr": lr,
        "optimizer": "AdamW (betas 0.9, 0.95; weight decay 0.1 on matrices), constant rate",
        "mup_base_width": base,
        "n_layer": n_layer,
        "n_head": n_head,
        "context": context,
        "batch_size": batch_size,
        "vocab_size": vocab,
        "seed": seed,
    }


def _train_and_probe(
    config: GPTConfig,
    optim: Choice,
    batches: list[torch.Tensor],
    probe: torch.Tensor,
    steps: int,
) -> tuple[dict[str, list[float]], torch.Tensor | None]:
    """Train a model of ``config`` for ``steps`` steps; (each watched layer's mean |x| on ``probe`` after
    every step, the last loss)."""
    model = GPT(config)
    optimizer = build_optimizer(model, optim, hidden_lr_scale(config))
    scales: dict[str, list[float]] = {}
    loss: torch.Tensor | None = None
    for step in range(steps):
        x, y = batches[step][:, :-1], batches[step][:, 1:]
        _, loss = model(x, y)
        assert loss is not None
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        for layer, value in _activation_scales(model, probe).items():
            scales.setdefault(layer, []).append(value)
    return scales, loss


def plot_coord_check(result: CoordCheck, path: Any) -> Any:
    """One panel per parametrisation: mean |x| after the last step against width (log-log), a line per
    layer."""
    from gptlab.figures import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(
        1, len(result.params), figsize=(5.5 * len(result.params), 4.2), dpi=120, sharey=True
    )
    axes = np.atleast_1d(axes)
    for ax, param in zip(axes, result.params):
        for layer in result.layers:
            ax.plot(result.widths, result.final(param, layer), marker="o", markersize=3, label=layer)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width (n_embd)")
        ax.set_title(f"model.param={param}: after {result.steps} steps")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("mean |activation|")
    axes[-1].legend(fontsize=7, loc="best")
    return save_figure(fig, path)
