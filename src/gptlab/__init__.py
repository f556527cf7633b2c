"""gptlab: controlled experiments on GPT-style decoder-only transformers.

The names below load on first use (PEP 562), so that ``import gptlab.model`` stays free of Lightning,
Hydra and W&B: only the Python API (:mod:`gptlab.api`: ``compose``, ``train``, ``load_run``, ``compare`` and
the builders of a run's parts) needs the config system.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gptlab.errors import ConfigError, DataError, RunRequeued
from gptlab.registry import CONFIG_DIR

if TYPE_CHECKING:
    from gptlab.api import (
        LoadedRun,
        SweepRows,
        TrainResult,
        build_datamodule,
        build_model,
        build_model_config,
        build_tokenizer,
        compare,
        compose,
        load_run,
        train,
    )
    from gptlab.model.config import GPTConfig
    from gptlab.model.gpt import GPT

__version__ = "0.1.0"

_EXPORTS = {
    "LoadedRun": "gptlab.api",
    "SweepRows": "gptlab.api",
    "TrainResult": "gptlab.api",
    "compare": "gptlab.api",
    "compose": "gptlab.api",
    "load_run": "gptlab.api",
    "train": "gptlab.api",
    "GPT": "gptlab.model.gpt",
    "GPTConfig": "gptlab.model.config",
    "build_datamodule": "gptlab.api",
    "build_model": "gptlab.api",
    "build_model_config": "gptlab.api",
    "build_tokenizer": "gptlab.api",
}

__all__ = [
    "CONFIG_DIR",
    "GPT",
    "ConfigError",
    "DataError",
    "GPTConfig",
    "LoadedRun",
    "RunRequeued",
    "SweepRows",
    "TrainResult",
    "build_datamodule",
    "build_model",
    "build_model_config",
    "build_tokenizer",
    "compare",
    "compose",
    "load_run",
    "train",
]


def __getattr__(name: str) -> Any:  # PEP 562: import on first use
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
