"""Every RNG state training draws from, saved in each checkpoint so a resumed run draws the same numbers
as one never stopped (Lightning's checkpoints hold none)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def collect_rng_states() -> dict[str, Any]:
    """Every RNG state training draws from, as tensors and plain Python values (numpy's state object would
    make the checkpoint unreadable with ``torch.load(weights_only=True)``)."""
    version, mt_state, gauss = random.getstate()
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # the legacy (default) form
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(mt_state), gauss],
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    version, mt_state, gauss = states["python"]
    random.setstate((version, tuple(mt_state), gauss))
    n = states["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
