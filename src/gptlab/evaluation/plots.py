"""The evaluations' figures (matplotlib, drawn to files only): the length study's and the passkey study's, and
pictures of what a positional scheme adds (`plot_scheme`): the position table as a heatmap, the
position-to-position similarity it induces, and the attention bias per head.

Each picture of a scheme asks the scheme what it does, not which scheme it is:

- a scheme that adds position vectors (learned, sinusoidal): the table (positions x dimensions) and the cosine
  similarity of its rows;
- a rotary scheme (rope, xpos): the similarity of one fixed vector rotated to each position;
- a scheme with an attention bias (alibi, relative, fire): the bias on the score of query i on key j, per head.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gptlab.figures import binned, pyplot, save_figure
from gptlab.model.gpt import GPT


def plot_length_result(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """loss_vs_length.png (loss against the context, one line per variant) and loss_by_position.png (loss at
    each position of the longest context each variant ran at, averaged in bins)."""
    plt = pyplot()
    train_context = result["train_context"]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, entries in result["variants"].items():
        points = sorted((e["context"], e["loss"]) for e in entries.values() if "loss" in e)
        if name != result["pos"] and str(1) in result["variants"][result["pos"]]:
            first = result["variants"][result["pos"]]["1"]
            if "loss" in first:
                points = [(first["context"], first["loss"]), *points]
        if points:
            ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.axvline(train_context, color="grey", linestyle=":", label="training context")
    ax.set_xlabel("evaluation context (tokens)")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title(f"pos={result['pos']}: loss against context length")
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out_dir / "loss_vs_length.png", dpi=100))

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, entries in result["variants"].items():
        runs = [e for e in entries.values() if "loss_by_position" in e]
        if not runs:
            continue
        longest = max(runs, key=lambda e: e["context"])
        x, y = binned(np.asarray(longest["loss_by_position"]))
        ax.plot(x, y, label=f"{name} ({longest['context']} tokens)")
    ax.axvline(train_context, color="grey", linestyle=":", label="training context")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token position")
    ax.set_ylabel("validation loss (nats)")
    ax.set_title(f"pos={result['pos']}: loss by token position")
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out_dir / "loss_by_position.png", dpi=100))
    return paths


def plot_passkey_heatmap(
    result: dict[str, Any], path: Path, cell_text: Callable[[dict[str, Any]], str]
) -> Path:
    """Passkey accuracy per (length, depth bin) of one run's study; cells that could not run are grey and
    say why in short (``cell_text``: the study's own cell format)."""
    import matplotlib

    plt = pyplot()

    bins, factors = result["depth_bins"], result["factors"]
    grid = np.full((len(factors), len(bins)), np.nan)
    for i, f in enumerate(factors):
        for j, b in enumerate(bins):
            cell = result.get("cells", {}).get(str(f), {}).get(b, {})
            grid[i, j] = cell.get("accuracy", np.nan)
    fig, ax = plt.subplots(figsize=(1.2 * len(bins) + 2.5, 0.6 * len(factors) + 1.8))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for i, f in enumerate(factors):
        for j, b in enumerate(bins):
            cell = result.get("cells", {}).get(str(f), {}).get(b, {})
            text = cell_text(cell) if cell else "-"
            ax.text(
                j,
                i,
                text,
                ha="center",
                va="center",
                fontsize=8,
                color="black" if math.isnan(grid[i, j]) or grid[i, j] > 0.5 else "white",
            )
    ax.set_xticks(range(len(bins)), [f"{b}" for b in bins])
    ax.set_yticks(range(len(factors)), [f"{f}x ({f * result['train_context']})" for f in factors])
    ax.set_xlabel("depth of the key in the filler")
    ax.set_ylabel("prompt length (tokens)")
    ax.set_title(f"pos={result['pos']}: passkey accuracy" + (" (not run)" if "error" in result else ""))
    fig.colorbar(image, ax=ax, label="accuracy")
    return save_figure(fig, path, dpi=100)


# What a positional scheme adds.


@torch.no_grad()
def position_table(model: GPT, n: int) -> Tensor | None:
    """The (n, n_embd) vectors added to the token embeddings at positions 0..n-1, or None."""
    table = model.transformer.pos.position_vectors(n)
    return None if table is None else table.detach().float().cpu()


@torch.no_grad()
def position_similarity(model: GPT, n: int) -> Tensor | None:
    """(n, n) cosine similarity between positions: of the table rows, or for rotary schemes of one all-ones
    query rotated to each position (per head dimension), or None for schemes without either."""
    table = position_table(model, n)
    if table is None and model.transformer.pos.is_rotary:
        ones = torch.ones(1, 1, n, model.config.head_dim)
        table, _ = model.transformer.pos.rotate(ones, ones, torch.arange(n))
        table = table[0, 0].float().cpu()  # (n, head_dim)
    if table is None:
        return None
    unit = table / table.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return unit @ unit.T


@torch.no_grad()
def attention_bias(model: GPT, n: int) -> Tensor | None:
    """(n_head, n, n) bias on the score of query i (rows) on key j (columns); the future is NaN."""
    positions = torch.arange(n, device=next(model.parameters()).device)
    bias = model.transformer.pos.bias(positions, positions)
    if bias is None:
        return None
    bias = bias.detach().float().cpu()
    future = positions[None, :].cpu() > positions[:, None].cpu()
    return bias.masked_fill(future, float("nan"))


def _heatmap(
    values: Any, path: Path, figsize: tuple[float, float], labels: tuple[str, str], title: str, **imshow: Any
) -> Path:
    """One matrix drawn as an image with its colour bar (x label, y label), saved to ``path``."""
    fig, ax = pyplot().subplots(figsize=figsize)
    image = ax.imshow(values, interpolation="nearest", **imshow)
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(title)
    fig.colorbar(image, ax=ax)
    return save_figure(fig, path, dpi=72)


def plot_scheme(
    model: GPT, out_dir: str | Path, n: int | None = None, label: str | None = None
) -> list[Path]:
    """Every picture that applies to the model's scheme, as ``<label>_{table,similarity,bias}.png``."""
    plt = pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = n or model.config.block_size
    label = label or model.config.pos.name
    written = []

    table = position_table(model, n)
    if table is not None:
        written.append(
            _heatmap(
                table.T,
                out_dir / f"{label}_table.png",
                (6, 4),
                ("position", "embedding dimension"),
                f"pos={model.config.pos.name}: position vectors",
                aspect="auto",
                cmap="RdBu_r",
            )
        )

    similarity = position_similarity(model, n)
    if similarity is not None:
        written.append(
            _heatmap(
                similarity,
                out_dir / f"{label}_similarity.png",
                (5, 4.2),
                ("position j", "position i"),
                f"pos={model.config.pos.name}: cosine similarity of positions",
                cmap="viridis",
                vmin=-1,
                vmax=1,
            )
        )

    bias = attention_bias(model, n)
    if bias is not None:
        heads = bias.size(0)
        cols = min(4, heads)
        rows = math.ceil(heads / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 2.8 * rows), squeeze=False)
        for h, ax in enumerate(axes.flat):
            if h >= heads:
                ax.axis("off")
                continue
            image = ax.imshow(bias[h], cmap="magma", interpolation="nearest")
            ax.set_title(f"head {h}", fontsize=9)
            ax.set_xlabel("key j", fontsize=8)
            ax.set_ylabel("query i", fontsize=8)
            fig.colorbar(image, ax=ax, fraction=0.046)
        fig.suptitle(f"pos={model.config.pos.name}: attention bias per head")
        written.append(save_figure(fig, out_dir / f"{label}_bias.png", dpi=72))
    return written
