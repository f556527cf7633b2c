"""Figures, drawn to files only: matplotlib on its file-only backend, one way to save a figure, and the
log-spaced binning that the per-position curves share. Every study's plots use these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, dpi: float | str = "figure") -> Path:
    """Lay ``fig`` out, write it to ``path`` (making its folder) and close it; returns the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def binned(values: np.ndarray, bins: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Average ``values`` (T,) over log-spaced position bins: readable curves at any T. Returns the bins'
    mean positions (1-based) and mean values."""
    edges = np.unique(np.geomspace(1, len(values) + 1, bins + 1).astype(int))
    x = [(lo + hi - 1) / 2 for lo, hi in zip(edges[:-1], edges[1:])]
    y = [values[lo - 1 : hi - 1].mean() for lo, hi in zip(edges[:-1], edges[1:])]
    return np.asarray(x), np.asarray(y)
