"""A trained model, its tokenizer and its validation tokens, rebuilt from a run directory or a checkpoint.

A checkpoint holds the model's config (``hyper_parameters["model"]``), the modules of the user's variants it
needs (``hyper_parameters["plugins"]``), its weights and the tokenizer's spec;
the run directory holds ``config_resolved.yaml``, whose ``data`` node names the corpus and split.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab.data import corpus, tokenizers
from gptlab.errors import CheckpointError
from gptlab.model.config import GPTConfig
from gptlab.model.gpt import GPT
from gptlab.registry import import_plugins
from gptlab.runs.checkpoints import load_checkpoint, model_config_dict, model_weights
from gptlab.runs.layout import (
    BEST_GLOB,
    CLAIM_FILE,
    CONFIG_FILE,
    LAST_CHECKPOINT_PATH,
    RESULT_FILE,
    Run,
    checkpoint_kind,
    run_of_path,
)

log = logging.getLogger(__name__)


@dataclass
class TrainedRun:
    model: GPT
    tokenizer: tokenizers.Tokenizer
    checkpoint: Path
    run: Run | None
    config: dict[str, Any]  # the run's resolved config ({} when the checkpoint has no run directory)

    @property
    def run_dir(self) -> Path | None:
        return self.run.path if self.run else None

    @property
    def train_context(self) -> int:
        """The window length the model was trained on (data.block_size, else model.block_size)."""
        data = self.config.get("data") or {}
        return int(data.get("block_size") or self.model.config.block_size)


def find_checkpoint(path: str | Path, which: str = "last") -> tuple[Path, Run | None]:
    """(checkpoint, its run or None) for a run directory or a checkpoint (file or sharded directory). In a
    run directory ``which="last"`` takes the last checkpoint and ``which="best"`` the best by
    val/loss, each falling back to the other."""
    path = Path(path)
    if checkpoint_kind(path):
        run = run_of_path(path)
        return path, run if run and run.path != path else None
    if path.is_dir():
        run = Run(path)
        found = run.checkpoint(which)
        if found is None:
            state = run_state(path) if Run.is_run_dir(path) else None
            if state is not None:  # a run's directory: why it has none yet
                raise CheckpointError(f"{path} holds no checkpoint yet ({LAST_CHECKPOINT_PATH}): {state}.")
            raise CheckpointError(
                f"{path} holds no checkpoint ({LAST_CHECKPOINT_PATH} or {BEST_GLOB}): pass a run directory written "
                "by `python train.py` (outputs/runs/<date>/<time>) or a checkpoint."
            )
        return found, run if Run.is_run_dir(path) else None
    raise CheckpointError(f"{path} does not exist: pass a run directory or a checkpoint.")


def run_state(run_dir: str | Path) -> str | None:
    """What the run in ``run_dir`` is, where it did not finish (None where it did): still training (which
    process holds it), stopped by a signal, failed, or ended without a ``result.json`` (killed); each with
    the step it reached."""
    from gptlab.runs.identity import running_claim

    run_dir = Path(run_dir)
    claim = running_claim(run_dir)
    if claim is not None:
        return (
            f"the run is still training ({claim.describe()} holds {run_dir / CLAIM_FILE}); its result.json is "
            "written when it ends"
        )
    run = Run(run_dir)
    result = run.result()
    if result is None:
        again = (
            "resume=auto continues it from its last checkpoint"
            if run.checkpoint("last") is not None
            else "it left no checkpoint; resume=auto in this directory starts it again"
        )
        return (
            f"the run ended without a {RESULT_FILE} (killed, or its process stopped before training): {again}"
        )
    step = result.get("global_step")
    if result.get("failed"):
        return f"the run failed at step {step} ({result['failed']})"
    if result.get("stopped_by_signal"):
        return f"the run was stopped by {result.get('stop_signal') or 'a signal'} at step {step}: resume=auto continues it"
    if not result.get("finished"):
        return f"the run ended at step {step}, before its trainer.max_steps"
    return None


def load_run(path: str | Path, device: str | torch.device = "cpu", which: str = "last") -> TrainedRun:
    """The model (in eval mode), its tokenizer and the run's config from a run directory or a checkpoint."""
    checkpoint_path, run = find_checkpoint(path, which)
    checkpoint = load_checkpoint(checkpoint_path)
    # A variant or tokenizer defined outside gptlab: its module, as the run's plugins= named it.
    import_plugins((checkpoint.get("hyper_parameters") or {}).get("plugins"), f"{checkpoint_path}: plugins")
    model = GPT(GPTConfig.from_dict(model_config_dict(checkpoint, checkpoint_path)))
    model.load_state_dict(model_weights(checkpoint, checkpoint_path))
    # loss.final_softcap caps the logits the model was trained on: generation and evaluation see them too
    model.final_softcap = ((checkpoint.get("hyper_parameters") or {}).get("loss") or {}).get("final_softcap")
    model.to(device).eval()
    if "tokenizer" not in checkpoint:
        raise CheckpointError(f"{checkpoint_path} holds no tokenizer spec; cannot rebuild its tokenizer.")
    tokenizer = tokenizers.from_spec(checkpoint["tokenizer"])
    return TrainedRun(model, tokenizer, checkpoint_path, run, run.config() if run else {})


def held_out_tokens(trained: TrainedRun) -> np.ndarray:
    """The run's validation split as a flat array of token ids: from its token cache (rebuilt if missing), its
    token folder (nanoGPT's or llm.c's files) or its stream's held-out documents."""

    from gptlab.data.sources import parse_data

    data = trained.config.get("data")
    if not data:
        raise CheckpointError(
            f"{trained.checkpoint} has no {CONFIG_FILE} in a run directory around it, so its corpus is unknown: "
            "pass the run directory that `python train.py` wrote."
        )
    spec, _ = parse_data(data)
    tokens, tokenizer = corpus.validation_tokens(spec, trained.tokenizer.name)
    if tokenizer.spec() != trained.tokenizer.spec():
        raise CheckpointError(
            f"The corpus {spec.describe()} now tokenizes differently from when {trained.checkpoint} was trained "
            "(another vocabulary): evaluate on the corpus the model was trained on."
        )
    return tokens
