"""Load a trained model back from a run directory or a Lightning checkpoint, without the run's config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gptlab.data import tokenizers
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT


def find_checkpoint(path: str | Path, which: str = "best") -> Path:
    """``path`` itself when it is a file; in a run directory, the best checkpoint by val/loss (``which="best"``)
    or ``last.ckpt`` (``which="last"``)."""
    path = Path(path)
    if path.is_file():
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not folder.is_dir():
        raise FileNotFoundError(f"{path} is neither a checkpoint file nor a run directory with checkpoints/.")
    best = sorted(folder.glob("best-*.ckpt"))
    last = folder / "last.ckpt"
    if which == "best" and best:
        return best[-1]
    if last.is_file():
        return last
    if best:
        return best[-1]
    raise FileNotFoundError(f"No checkpoint in {folder} (looked for best-*.ckpt and last.ckpt).")


def load_model(
    path: str | Path, which: str = "best", map_location: str | torch.device = "cpu"
) -> tuple[GPT, tokenizers.Tokenizer | None, dict[str, Any]]:
    """The model (in eval mode), its tokenizer, and the checkpoint's other entries (step, hyper-parameters)."""
    ckpt_path = find_checkpoint(path, which)
    ckpt = torch.load(ckpt_path, map_location=map_location, weights_only=False)
    try:
        config = GPTConfig.from_dict(dict(ckpt["hyper_parameters"]["model"]))
        state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    except KeyError as e:
        raise ValueError(f"{ckpt_path} is not a gptlab checkpoint: it has no {e} entry.") from None
    model = GPT(config)
    model.load_state_dict(state)
    model.eval()
    tok = tokenizers.from_spec(ckpt["tokenizer"]) if "tokenizer" in ckpt else None
    info = {
        "path": str(ckpt_path),
        "global_step": ckpt.get("global_step"),
        "hyper_parameters": ckpt.get("hyper_parameters", {}),
    }
    return model, tok, info
