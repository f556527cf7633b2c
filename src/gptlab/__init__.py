"""gptlab: controlled experiments on GPT-style decoder-only transformers."""

from pathlib import Path

from gptlab.builders import build_datamodule, build_model, build_model_config, build_tokenizer
from gptlab.errors import ConfigError, DataError
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT

__version__ = "0.1.0"

#: The Hydra config folder of a source checkout (an editable install).
CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf"

__all__ = [
    "CONFIG_DIR",
    "GPT",
    "ConfigError",
    "DataError",
    "GPTConfig",
    "build_datamodule",
    "build_model",
    "build_model_config",
    "build_tokenizer",
]
