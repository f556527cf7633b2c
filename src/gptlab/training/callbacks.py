"""Callbacks: sample generations and the progress bar (throughput and MFU: training/metrics.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from gptlab.errors import ConfigError

if TYPE_CHECKING:
    from gptlab.training.module import GPTLitModule

log = logging.getLogger(__name__)


class SampleGeneration(L.Callback):
    """At every validation, continues a fixed prompt and logs it as text (a growing table in W&B, a
    ``samples.txt`` beside CSV logs, and the console log)."""

    def __init__(
        self,
        prompt: str = "The",
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
    ) -> None:
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.rows: list[list[Any]] = []

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tokenizer = getattr(pl_module, "tokenizer", None)
        if trainer.sanity_checking or tokenizer is None or self.max_new_tokens <= 0:
            return
        ids = tokenizer.encode(self.prompt) or [tokenizer.eot_id]
        idx = torch.tensor([ids], device=pl_module.device)
        generator = torch.Generator(device=pl_module.device).manual_seed(trainer.global_step)
        out = cast("GPTLitModule", pl_module).model.generate(
            idx,
            self.max_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            generator=generator,
        )
        completion = tokenizer.decode(out[0, len(ids) :].tolist())
        if trainer.global_rank != 0:
            return
        self.rows.append([trainer.global_step, self.prompt, completion])
        log.info("step %d sample: %r -> %r", trainer.global_step, self.prompt, completion)
        from gptlab.tracking.loggers import log_text_samples

        log_text_samples(trainer, ["step", "prompt", "completion"], self.rows)


class StepProgressBar(TQDMProgressBar):
    """A progress bar over optimizer steps (``global_step / max_steps``), not epochs, showing the loss, the
    training rate as last logged (``tok/s``: ``train/tokens_per_second``, training/metrics.py) and the last
    validation loss."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.train_progress_bar.reset(total=trainer.max_steps)
        self.train_progress_bar.initial = trainer.global_step
        self.train_progress_bar.n = trainer.global_step
        self.train_progress_bar.set_description("Training")

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        pass  # one bar for the whole run

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx
    ) -> None:
        bar = self.train_progress_bar
        if bar is not None and self._should_update(trainer.global_step, bar.total):
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
            bar.refresh()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pass

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        from gptlab.training.metrics import TrainingThroughput

        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        short = {"train/loss": "loss", "val/loss": "val_loss"}
        out = {short.get(key, key): value for key, value in items.items()}
        for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
            if isinstance(callback, TrainingThroughput) and callback.tokens_per_second is not None:
                out["tok/s"] = f"{callback.tokens_per_second:,.0f}"
        return out


class ValidateAtLastStep(L.Callback):
    """Ends training with a validation at its last step, also when ``trainer.max_steps`` is not a multiple
    of ``trainer.val_check_interval``: the final line, the logged metrics and the returned ``val/loss`` then
    describe the weights that are saved. Lightning validates in the step where ``trainer.should_stop`` is
    set (as for early stopping); a run whose last step is a validation step validates once."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True


def instantiate_callbacks(nodes: Any) -> list[L.Callback]:
    """The callbacks of the ``callbacks`` node (each a ``_target_`` node). A callback that refuses its
    options raises its own ConfigError, not Hydra's wrapper around it."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    callbacks = []
    for _, node in nodes.items():
        if node and "_target_" in node:
            try:
                callbacks.append(instantiate(node))
            except InstantiationException as e:
                if isinstance(e.__cause__, ConfigError):
                    raise e.__cause__ from None
                raise
    return callbacks
