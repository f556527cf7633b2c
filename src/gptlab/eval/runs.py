"""Rebuild a trained model and its validation tokens from a run directory or a checkpoint.

A checkpoint holds the model's config (``hyper_parameters["model"]``), its weights and the tokenizer's spec;
the run directory beside it holds ``config_resolved.yaml``, whose ``data`` node names the corpus and split.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab.data import corpus, tokenizers
from gptlab.errors import ConfigError
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT

log = logging.getLogger(__name__)

CONFIG_FILE = "config_resolved.yaml"


@dataclass
class TrainedRun:
    model: GPT
    tokenizer: tokenizers.Tokenizer
    checkpoint: Path
    run_dir: Path | None
    config: dict[str, Any]  # the run's resolved config ({} when the checkpoint has no run directory)

    @property
    def train_context(self) -> int:
        """The window length the model was trained on (data.block_size, else model.block_size)."""
        data = self.config.get("data") or {}
        return int(data.get("block_size") or self.model.config.block_size)


def find_checkpoint(path: str | Path, which: str = "last") -> tuple[Path, Path | None]:
    """(checkpoint, run directory or None) for a run directory or a ``.ckpt`` file. In a run directory,
    ``which="last"`` takes ``checkpoints/last.ckpt`` and ``which="best"`` the best by val/loss (each falls
    back to the other)."""
    path = Path(path)
    if path.is_file():
        for folder in (path.parent, path.parent.parent):
            if (folder / CONFIG_FILE).is_file():
                return path, folder
        return path, None
    if path.is_dir():
        folder = path / "checkpoints"
        last, best = [folder / "last.ckpt"], sorted(folder.glob("best-*.ckpt"))[::-1]
        for candidate in [*(best + last if which == "best" else last + best), *sorted(folder.glob("*.ckpt"))]:
            if candidate.is_file():
                return candidate, path if (path / CONFIG_FILE).is_file() else None
        raise ConfigError(
            f"{path} holds no checkpoints/last.ckpt: pass a run directory written by `python train.py` "
            "(outputs/runs/<date>/<time>) or the path of a .ckpt file."
        )
    raise ConfigError(f"{path} does not exist: pass a run directory or a .ckpt file.")


def load_run(path: str | Path, device: str | torch.device = "cpu", which: str = "last") -> TrainedRun:
    """The model (in eval mode), its tokenizer and the run's config from a run directory or a checkpoint."""
    checkpoint_path, run_dir = find_checkpoint(path, which)
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    hparams = checkpoint.get("hyper_parameters") or {}
    if "model" not in hparams:
        raise ConfigError(
            f"{checkpoint_path} has no hyper_parameters['model']: it was not written by gptlab."
        )
    model = GPT(GPTConfig.from_dict(dict(hparams["model"])))
    state = {
        k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")
    }
    model.load_state_dict(state)
    model.to(device).eval()
    if "tokenizer" not in checkpoint:
        raise ConfigError(f"{checkpoint_path} holds no tokenizer spec; cannot rebuild the validation data.")
    tokenizer = tokenizers.from_spec(checkpoint["tokenizer"])
    config: dict[str, Any] = {}
    if run_dir is not None:
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(OmegaConf.load(run_dir / CONFIG_FILE), resolve=True)
    return TrainedRun(model, tokenizer, checkpoint_path, run_dir, config)


def validation_tokens(run: TrainedRun) -> np.ndarray:
    """The run's validation split as a flat array of token ids (from the token cache, rebuilt if missing)."""
    from gptlab.builders import _LOADER_KEYS, _SPEC_KEYS

    data = run.config.get("data")
    if not data:
        raise ConfigError(
            f"{run.checkpoint} has no {CONFIG_FILE} beside it, so its corpus is unknown: pass the run directory "
            "that `python train.py` wrote."
        )
    unknown = sorted(set(data) - _SPEC_KEYS - _LOADER_KEYS)
    if unknown:
        raise ConfigError(f"{run.run_dir / CONFIG_FILE}: unknown data option(s) {unknown}.")
    spec = corpus.DataSpec(**{k: v for k, v in data.items() if k in _SPEC_KEYS})
    prepared = corpus.prepare(spec, run.tokenizer.name)
    if prepared.tokenizer.spec() != run.tokenizer.spec():
        raise ConfigError(
            f"The corpus {spec.describe()} now tokenizes differently from when {run.checkpoint} was trained "
            "(another vocabulary): evaluate on the corpus the model was trained on."
        )
    return np.asarray(np.memmap(prepared.val_path, dtype=prepared.dtype, mode="r"))
