"""Downstream evaluation during training (``eval_harness.enabled=true``): the chosen lm-evaluation-harness
tasks every ``every_n_steps`` optimizer steps and at the last step, through gptlab's harness backend
(:class:`gptlab.evaluation.harness.GptlabLM`) on the model being trained.

The evaluation runs on rank 0 alone, on the plain model inside the LightningModule (never the module a
parallel strategy wrapped: a forward through DDP's wrapper would wait for the other ranks, which are not
evaluating), in eval mode and without gradients; training mode and every random number generator are put
back as they were, so a run trains the same steps with the evaluation on or off. The other ranks go on to
the next step and wait at its gradient all-reduce until rank 0 joins them. Strategies that shard the
weights are refused at config time (:func:`gptlab.config.parse_gpt`).

Each evaluation logs ``eval/<task>/<metric>`` to every logger (metrics.csv, W&B) at its step, the step that
``val/loss`` of the same weights is logged at, and leaves them in ``trainer.callback_metrics``, from which the
run's ``result.json`` takes the last values.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import lightning as L
import numpy as np
import torch

from gptlab.evaluation.downstream import DownstreamEvalOptions, check_tasks, metric_names
from gptlab.parallel.transforms import uncompiled_blocks

if TYPE_CHECKING:
    from gptlab.model.gpt import GPT

log = logging.getLogger(__name__)


def downstream_callbacks(options: DownstreamEvalOptions | None, train_context: int) -> list[L.Callback]:
    """The callback of the ``eval_harness`` node when it is enabled (none otherwise), for a model trained
    at ``train_context`` tokens."""
    if options is None:
        return []
    return [DownstreamEvaluation(options, train_context)]


@dataclass
class _LiveRun:
    """What :class:`GptlabLM` reads of a run, for the model being trained."""

    model: torch.nn.Module
    tokenizer: Any
    train_context: int


class DownstreamEvaluation(L.Callback):
    """Runs the harness tasks of ``options`` every ``options.every_n_steps`` steps and at the last step."""

    def __init__(self, options: DownstreamEvalOptions, train_context: int) -> None:
        self.options = options
        self.train_context = train_context
        self.last_step: int | None = None  # the step last evaluated (once per step under accumulation)
        self.seconds: list[float] = []  # how long each evaluation took
        self._manager: Any = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        due = step % self.options.every_n_steps == 0 or 0 < trainer.max_steps <= step
        if not due or step == self.last_step or step == 0:
            return
        self.last_step = step
        if not trainer.is_global_zero:
            return
        t0 = time.perf_counter()
        metrics = self.evaluate(pl_module)
        self.seconds.append(time.perf_counter() - t0)
        from gptlab.training.metrics import TrainingThroughput

        for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
            if isinstance(callback, TrainingThroughput):  # the training rate leaves the evaluation out
                callback.exclude_time(self.seconds[-1])
        log.info(
            "step %d downstream evaluation (%.1f s): %s",
            step,
            self.seconds[-1],
            ", ".join(f"{k[len('eval/') :]} {v:.4g}" for k, v in metrics.items()),
        )
        # Lightning's own path to every logger, at this step (the optimizer steps done: the step val/loss of the
        # same weights is logged at when a validation falls on it).
        trainer._logger_connector.log_metrics(metrics, step=step)  # type: ignore[arg-type]  # typed for tensors; numbers are logged as they are
        # callback_metrics returns the dict it keeps: the values stay there for the run's result.json.
        trainer.callback_metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()})

    def evaluate(self, pl_module: L.LightningModule) -> dict[str, float]:
        """``eval/<task>/<metric>`` of the model now; its training mode and the random generators unchanged."""
        model = cast(torch.nn.Module, pl_module.model)  # the plain GPT, never a strategy's wrapper
        modes = [(m, m.training) for m in model.modules()]  # each module's own: the harness sets eval mode
        states = _rng_states()
        try:
            # compile=true: the harness's requests come at lengths of their own, each a compile of every
            # block; the plain blocks run them
            with torch.no_grad(), _quiet_harness(), uncompiled_blocks(cast("GPT", model)):
                return metric_names(self._run_harness(model, pl_module))
        finally:
            _restore_rng_states(states)
            for module, training in modes:
                module.training = training

    def _run_harness(self, model: torch.nn.Module, pl_module: L.LightningModule) -> dict[str, Any]:
        from gptlab.evaluation.harness import GptlabLM, _simple_evaluate

        if self._manager is None:  # indexed once: the folders do not change during the run
            self._manager = check_tasks(self.options)
        live = _LiveRun(model, getattr(pl_module, "tokenizer", None), self.train_context)
        lm = GptlabLM(run=live, batch_size=self.options.batch_size, device=str(pl_module.device))
        return _simple_evaluate(
            lm,
            self._manager,
            self.options.tasks,
            self.options.num_fewshot,
            self.options.limit,
            log_samples=False,
            seed=self.options.seed,
            bootstrap_iters=0,  # standard errors are not logged: no bootstrap
        )


class _DropCustomDatasetNotice(logging.Filter):
    """The harness warns at every load of a task whose data a function gives (the shipped tasks' way to
    find their files): a notice about its command line, not about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


@contextmanager
def _quiet_harness() -> Iterator[None]:
    """The harness's per-task INFO lines off during an evaluation (the callback logs one line of results);
    its warnings stay."""
    logger, task_logger = logging.getLogger("lm_eval"), logging.getLogger("lm_eval.api.task")
    level, notice = logger.level, _DropCustomDatasetNotice()
    logger.setLevel(max(level, logging.WARNING))
    task_logger.addFilter(notice)  # a logger's filter sees the records logged through it
    try:
        yield
    finally:
        logger.setLevel(level)
        task_logger.removeFilter(notice)


def _rng_states() -> dict[str, Any]:
    """Every generator the harness seeds (Python's, numpy's, torch's and each CUDA device's)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state_all(states["cuda"])
