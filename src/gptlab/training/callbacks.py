"""Callbacks: sample generations and the progress bar (throughput and MFU: training/metrics.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import lightning as L
import torch
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

from gptlab.errors import ConfigError
from gptlab.parallel.transforms import uncompiled_blocks

if TYPE_CHECKING:
    from gptlab.training.module import GPTLitModule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decoding:
    """One way to continue the prompt: greedy (``temperature`` 0) or sampled."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def describe(self) -> str:
        """``greedy``, or ``sampled`` with its settings: ``sampled (temperature 0.8, top-k 40)``."""
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        if self.top_p is not None and 0 < self.top_p < 1:
            parts.append(f"top-p {self.top_p:g}")
        return f"sampled ({', '.join(parts)})"


class SampleGeneration(L.Callback):
    """At every validation (the run's last step included), continues ``prompt`` twice: greedily, and sampled
    (``temperature``, restricted to the ``top_k`` most likely tokens and/or the ``top_p`` nucleus). A greedy
    continuation of a barely trained model is often a run of spaces or newlines, the most likely tokens of an
    indented corpus; the sampled one shows the words it has learnt. Its generator is seeded with ``seed`` at
    every validation: a rerun prints the same text, and two validations differ by the model alone.

    Each continuation is one log line (written above the progress bars, not glued to them) and one row of a
    growing table (W&B), of ``samples.tsv`` beside ``metrics.csv`` (CSV) and of the TensorBoard text.
    ``temperature`` 0 leaves the sampled continuation out."""

    def __init__(
        self,
        prompt: str = "In this case, the",  # mid-sentence (conf/callbacks/default.yaml says why)
        max_new_tokens: int = 48,
        temperature: float = 1.0,
        top_k: int | None = 40,
        top_p: float | None = None,
        seed: int = 0,
    ) -> None:
        if temperature < 0:
            raise ConfigError(
                f"callbacks.sample_generation.temperature={temperature} is negative: use 0 for the greedy "
                "continuation alone, or a positive temperature (e.g. 1.0) to sample one as well."
            )
        # the sampler reads a negative top_k as no cap and a top_p outside (0, 1] as no nucleus: refused, so
        # that the line's "sampled (...)" never names a restriction that was not applied
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise ConfigError(
                f"callbacks.sample_generation.top_k={top_k!r} must be a positive number of tokens (e.g. 40), or "
                "null (or 0) to sample from the whole vocabulary."
            )
        if top_p is not None and not 0 < top_p <= 1:
            raise ConfigError(
                f"callbacks.sample_generation.top_p={top_p!r} must be above 0 and at most 1 (e.g. 0.95: the "
                "likeliest tokens that hold 95% of the probability), or null for no nucleus."
            )
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.decodings = [Decoding()]
        if temperature > 0:
            self.decodings.append(Decoding(temperature, top_k, top_p))
        self.seed = seed
        self.rows: list[list[Any]] = []

    def continuations(self, pl_module: L.LightningModule) -> list[tuple[Decoding, str]] | None:
        """(decoding, continuation) for each decoding; None without a tokenizer or tokens to generate."""
        tokenizer = getattr(pl_module, "tokenizer", None)
        if tokenizer is None or self.max_new_tokens <= 0:
            return None
        ids = tokenizer.encode(self.prompt) or [tokenizer.eot_id]
        idx = torch.tensor([ids], device=pl_module.device)
        model = cast("GPTLitModule", pl_module).model
        out = []
        for decoding in self.decodings:
            generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
            # compile=true: decoding token by token with a KV cache is a new shape at every step, each a
            # compile of every block; the plain blocks run it
            with uncompiled_blocks(model):
                tokens = model.generate(
                    idx,
                    self.max_new_tokens,
                    temperature=decoding.temperature,
                    top_k=decoding.top_k,
                    top_p=decoding.top_p,
                    generator=generator,
                )
            out.append((decoding, tokenizer.decode(tokens[0, len(ids) :].tolist())))
        return out

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        # Every rank generates (the model may be sharded across them); rank 0 alone logs.
        continued = self.continuations(pl_module)
        if continued is None or trainer.global_rank != 0:
            return
        step = trainer.global_step
        lines = []
        for decoding, completion in continued:
            self.rows.append([step, decoding.describe(), self.prompt, completion])
            lines.append(f"step {step} {decoding.describe()}: {self.prompt!r} -> {completion!r}")
        log_above_progress_bars(lines)
        from gptlab.tracking.loggers import log_text_samples

        log_text_samples(trainer, ["step", "decoding", "prompt", "completion"], self.rows, len(continued))


def log_above_progress_bars(lines: list[str], level: int = logging.INFO) -> None:
    """Log ``lines`` each on a line of its own: the console handlers write through tqdm meanwhile, which
    clears the progress bars, writes the line and draws the bars again below it."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=[logging.getLogger()]):
        for line in lines:
            log.log(level, "%s", line)


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
        return _progress_metrics(super().get_metrics(trainer, pl_module), trainer)


def _progress_metrics(items: dict[str, Any], trainer: L.Trainer) -> dict[str, Any]:
    """What the progress display shows of Lightning's progress-bar metrics: the loss, the last validation loss
    and the training rate as last logged (``tok/s``: ``train/tokens_per_second``, training/metrics.py)."""
    from gptlab.training.metrics import TrainingThroughput

    items.pop("v_num", None)
    short = {"train/loss": "loss", "val/loss": "val_loss"}
    out = {short.get(key, key): value for key, value in items.items()}
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
        if isinstance(callback, TrainingThroughput) and callback.tokens_per_second is not None:
            out["tok/s"] = f"{callback.tokens_per_second:,.0f}"
    return out


class StepLines(ProgressBar):
    """Progress as log lines, for output that is not a terminal (a SLURM log, a file, a pipe): a bar redrawn
    with carriage returns and cursor movements becomes one endless line of escape codes there. Every
    ``every_n_steps`` optimizer steps (and the last), one line: the step of ``max_steps``, the loss, the
    training rate as last logged and the last validation loss, the same figures the bar shows; after each
    validation, its loss. Rank 0 alone prints (Lightning disables the others)."""

    def __init__(self, every_n_steps: int = 10) -> None:
        super().__init__()
        self.every_n_steps = every_n_steps
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx
    ) -> None:
        step = trainer.global_step
        if not self._enabled or trainer.sanity_checking:
            return
        if step % self.every_n_steps and step != trainer.max_steps:
            return
        if step == getattr(self, "_printed_step", None):
            return  # the last micro-batches of an accumulated step end at the same step
        self._printed_step = step
        metrics = _progress_metrics(self.get_metrics(trainer, pl_module), trainer)
        shown = ", ".join(f"{key} {_shown(value)}" for key, value in metrics.items())
        of = f"/{trainer.max_steps}" if trainer.max_steps > 0 else ""  # -1: counted in epochs
        log.info("step %d%s: %s", step, of, shown)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._enabled or trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get("val/loss")
        if value is not None:
            log.info("step %d validation: val_loss %s", trainer.global_step, _shown(value))


def _shown(value: Any) -> str:
    """A metric as the bar shows it: a tensor or a float to 4 decimals, a string as it is."""
    if hasattr(value, "item"):
        value = value.item()
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def progress_bar(style: str = "auto", refresh_rate: int = 1, every_n_steps: int = 10) -> ProgressBar:
    """The run's progress display. ``style``: ``bar``, a progress bar over optimizer steps
    (:class:`StepProgressBar`, redrawn every ``refresh_rate`` steps); ``lines``, a log line every
    ``every_n_steps`` steps (:class:`StepLines`); ``auto`` (the default), the bar where the console is a
    terminal and lines where it is not (a SLURM log, a file, a pipe), where a redrawn bar is escape codes."""
    import sys

    if style not in ("auto", "bar", "lines"):
        raise ConfigError(f"callbacks.progress_bar.style={style!r} is not one of auto, bar, lines.")
    for name, value, least in (("refresh_rate", refresh_rate, 0), ("every_n_steps", every_n_steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(
                f"callbacks.progress_bar.{name}={value!r} must be a whole number of steps, {least} or more"
                + (" (0: no bar)." if least == 0 else ".")
            )
    if style == "auto":
        style = "bar" if sys.stdout.isatty() else "lines"  # where Lightning's bars write
    return StepProgressBar(refresh_rate=refresh_rate) if style == "bar" else StepLines(every_n_steps)


class ValidateAtLastStep(L.Callback):
    """Ends training with a validation at its last step, also when ``trainer.max_steps`` is not a multiple
    of ``trainer.val_check_interval``: the final line, the logged metrics and the returned ``val/loss`` then
    describe the weights that are saved. Lightning validates in the step where ``trainer.should_stop`` is
    set (as for early stopping); a run whose last step is a validation step validates once."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True


class LogAtGlobalStep(L.Callback):
    """Every logged row at ``trainer.global_step``, the optimizer steps done: the training row and the
    validation after the 80th step are both step 80, as in the log lines and the checkpoint names. Lightning's
    own x value for the module's logs lags one behind within a step (its ``_batches_that_stepped`` counts the
    step only once it is over, so the 80th step's rows say 79); a logged ``step`` value is its documented way
    to set the x value (``LoggerConnector.log_metrics``), and ModelCheckpoint reads it as the step too."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        pl_module.log("step", float(trainer.global_step), on_step=True, on_epoch=False)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the same number on every rank: nothing to combine (max keeps it exact, as a mean might not be)
        pl_module.log("step", float(trainer.global_step), sync_dist=True, reduce_fx="max")


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
