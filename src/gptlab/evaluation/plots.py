"""The length study's and the passkey study's figures (matplotlib, drawn to files only)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.figures import binned, pyplot, save_figure


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
