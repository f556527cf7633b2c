"""The model: a GPT in plain PyTorch (no Lightning, Hydra or W&B), its config and its variant families.

``from gptlab.model import GPT, GPTConfig`` imports torch and this package only; names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gptlab.model.config import GPTConfig
    from gptlab.model.gpt import GPT, KVCache

_EXPORTS = {"GPT": "gptlab.model.gpt", "KVCache": "gptlab.model.gpt", "GPTConfig": "gptlab.model.config"}

__all__ = ["GPT", "GPTConfig", "KVCache"]


def __getattr__(name: str) -> Any:  # PEP 562: import on first use
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
