"""``python train.py`` (``task=gpt``): train one language model as configured.

Four steps, each its own function: **build** (the typed config parsed and checked whole, the run directory
claimed, the data read and windowed, the model made; all before any logger or trainer starts, so a bad
corpus or option costs seconds), **resume** (which checkpoint this run continues, checked against the model),
**fit** (Lightning trains, or only validates a run that has already reached ``trainer.max_steps``) and
**report** (the final line, ``result.json``, the W&B summary and the length study). The run skeleton around
them (loggers, saved config, the result of a run that raised, closing W&B) is :mod:`gptlab.tasks.skeleton`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from gptlab.config import GPTRunConfig, parse_gpt
from gptlab.data.corpus import PreparedCorpus
from gptlab.data.datamodule import GPTDataModule
from gptlab.planning.fit import check_memory
from gptlab.resume import ResumePlan, plan_resume
from gptlab.tasks.skeleton import RunSession, record_run_dir, route_lightning_logs
from gptlab.training.module import GPTLitModule

log = logging.getLogger("gptlab")


@dataclass
class Parts:
    """What ``build`` made: the data, its corpus and the module to train, and the Lightning strategy."""

    datamodule: GPTDataModule
    corpus: PreparedCorpus
    module: GPTLitModule
    strategy: Any


def run(cfg: DictConfig) -> dict[str, float]:
    """Train one model as configured; returns the final metrics (``val/loss``, ``val/ppl``, ...)."""
    t0 = time.perf_counter()
    route_lightning_logs()
    record_run_dir(cfg)  # before the config is parsed: the trainer's default_root_dir interpolates it
    settings = parse_gpt(cfg)
    # before the run directory, the data or any weight: a run that cannot fit its device is refused
    check_memory(settings)
    session = RunSession.start(
        cfg, settings.run, seed=lambda s: L.seed_everything(s, workers=True, verbose=False)
    )
    parts = build(settings)
    resume = plan_resume(settings.run.resume, session.run_dir, parts.module.model_config)
    load_initial_weights(parts.module, settings.init_from)  # after the resume check: it names the model
    log.info("Data ready after %.1f s", time.perf_counter() - t0)
    loggers = session.open_loggers(resume.wandb_run_id if resume else None)
    trainer: L.Trainer | None = None
    with session.closing(loggers, step=lambda: trainer.global_step if trainer else 0):
        trainer = make_trainer(cfg, settings, parts, loggers)
        session.is_global_zero = trainer.is_global_zero
        if trainer.is_global_zero:
            log.info("Run directory: %s", session.run_dir)
            log.info("\n%s", model_summary(parts.module, trainer, settings))
        session.save_config(loggers)
        stopped, step = fit(trainer, parts, resume, settings.trainer["max_steps"])
        metrics = collect_metrics(trainer, parts, time.perf_counter() - t0)
        if trainer.is_global_zero:
            report(session, settings, parts, trainer, loggers, metrics, step, stopped)
        return metrics
    raise AssertionError("unreachable: closing() re-raises")  # pragma: no cover


# ---- build --------------------------------------------------------------------------------------------
def build(settings: GPTRunConfig) -> Parts:
    """The strategy checked against the hardware and the launch, the data prepared and windowed (the
    tokenizer is a product of it: a fitted vocabulary comes from the training split), the module made."""
    from gptlab.parallel import build_strategy, warn_if_cpu_oversubscribed

    # Subnormal floats (a softmax over strongly biased scores: ALiBi at T=1024) are many times slower on x86
    # CPUs; flushing them to zero changes nothing above 1.2e-38. ALiBi's step on one thread: 1.93x -> 1.34x
    # the fused causal one (scripts/bench_attention.py). Threads started later inherit the setting.
    torch.set_flush_denormal(True)
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    strategy = build_strategy(settings.strategy_node, settings.trainer, multirun=multirun)
    warn_if_cpu_oversubscribed(settings.trainer)
    loader = settings.loader
    datamodule = GPTDataModule(
        spec=settings.data,
        tokenizer=settings.tokenizer,
        block_size=settings.block_size,
        batch_size=loader.batch_size,
        stride=loader.stride,
        val_stride=loader.val_stride,
        num_workers=loader.num_workers,
        seed=settings.run.seed,
    )
    datamodule.prepare_data()
    datamodule.setup("fit")
    corpus = datamodule.corpus
    assert corpus is not None  # setup("fit") prepared it
    if settings.vocab_from_tokenizer:  # the check again, with the vocabulary now known
        check_memory(settings, corpus.tokenizer.vocab_size)
    module = GPTLitModule(
        model=settings.with_vocabulary(corpus.tokenizer),
        optim=settings.optim,
        loss=settings.loss,
        parallel=settings.parallel,
        tokenizer=corpus.tokenizer,
        plugins=settings.run.plugins,
    )
    return Parts(datamodule, corpus, module, strategy)


def load_initial_weights(module: GPTLitModule, source: str | None) -> None:
    """``model.init_from``: a Hugging Face GPT-2 or Llama directory's weights, checked against the config."""
    if source:
        from gptlab.model.hf import load_pretrained

        load_pretrained(module.model, source)


def make_trainer(cfg: DictConfig, settings: GPTRunConfig, parts: Parts, loggers: list) -> L.Trainer:
    from gptlab.parallel.slurm import slurm_plugins
    from gptlab.training.callbacks import ValidateAtLastStep, instantiate_callbacks
    from gptlab.training.checkpointing import fault_tolerance_callbacks

    callbacks = instantiate_callbacks(cfg.get("callbacks") or {})
    return L.Trainer(
        **settings.trainer,
        strategy=parts.strategy,
        logger=loggers or False,
        callbacks=callbacks + fault_tolerance_callbacks() + [ValidateAtLastStep()],
        plugins=[*slurm_plugins(), *settings.strategy.plugins()] or None,
    )


def model_summary(module: GPTLitModule, trainer: L.Trainer | None, settings: GPTRunConfig | None) -> str:
    """The short model card (gptlab.planning.card): parameters, FLOPs per token, memory per device, and a
    warning when the run will not fit its device."""
    from lightning.pytorch.accelerators import CPUAccelerator

    from gptlab.planning import card

    plan = card.TrainingPlan(
        strategy=settings.strategy_node if settings else "auto",
        n_devices=trainer.world_size if trainer else 1,
        precision=str(trainer.precision) if trainer else "32-true",
        micro_batch=settings.loader.batch_size if settings else 1,
        context=settings.loader.block_size if settings else None,
        activation_checkpointing=settings.parallel.activation_checkpointing if settings else False,
    )
    on_cpu = trainer is None or isinstance(trainer.accelerator, CPUAccelerator)
    return card.startup_card(module.model_config, plan, on_cpu=on_cpu, loss=module.head_loss)


# ---- fit ----------------------------------------------------------------------------------------------
def fit(trainer: L.Trainer, parts: Parts, resume: ResumePlan | None, max_steps: int) -> tuple[bool, int]:
    """Train to ``max_steps`` (continuing ``resume``); a run already there is only validated, its curves
    untouched. Returns whether a stop signal ended training early, and the run's last step."""
    from gptlab.training.checkpointing import fit as fit_with_signals

    if resume is not None and resume.global_step >= max_steps:
        log.info(
            "The checkpoint is at step %d: trainer.max_steps is reached, nothing is left to train.",
            resume.global_step,
        )
        loggers, trainer.loggers = trainer.loggers, []  # its curves already end with this validation
        trainer.validate(
            parts.module, datamodule=parts.datamodule, ckpt_path=str(resume.ckpt_path), verbose=False
        )
        trainer.loggers = loggers
        return False, resume.global_step
    stopped = fit_with_signals(trainer, parts.module, parts.datamodule, resume.ckpt_path if resume else None)
    if stopped and trainer.is_global_zero:
        log.info(
            "Stopped by a signal at step %d; continue with the same command and resume=auto",
            trainer.global_step,
        )
    return stopped, trainer.global_step


def collect_metrics(trainer: L.Trainer, parts: Parts, wall_seconds: float) -> dict[str, float]:
    from gptlab.training.metrics import run_rates

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    metrics["unigram_entropy"] = parts.corpus.unigram_entropy
    metrics["wall_seconds"] = wall_seconds
    metrics.update(run_rates(trainer, wall_seconds))
    return metrics


# ---- report -------------------------------------------------------------------------------------------
def report(
    session: RunSession,
    settings: GPTRunConfig,
    parts: Parts,
    trainer: L.Trainer,
    loggers: list,
    metrics: dict[str, float],
    step: int,
    stopped: bool,
) -> None:
    """The W&B summary, the closing lines, the length study (``eval_length.enabled``) and ``result.json``."""
    from gptlab.tracking.loggers import update_wandb_summary

    entropy = parts.corpus.unigram_entropy
    update_wandb_summary(
        loggers,
        {
            "unigram_entropy": entropy,
            "parameters/total": parts.module.model.parameter_counts()["total"],
            # the final validation, also when a finished run is resumed and logs nothing
            **{k: metrics[k] for k in ("val/loss", "val/ppl", "val/bpb") if k in metrics},
        },
    )
    print("\n".join(closing_lines(metrics, entropy, session.run_dir, trainer, loggers, step)), flush=True)
    if settings.length_study is not None:
        if stopped:  # the weights are half-trained and the time before the machine goes is short
            log.info(
                "Stopped by a signal: the length study (eval_length) is skipped; it runs when the resumed run "
                "finishes."
            )
        else:
            from gptlab.evaluation.length import after_training, summary_metrics

            result = after_training(
                parts.module.model,
                parts.corpus,
                parts.datamodule.block_size,
                settings.length_study,
                settings.passkey,
                session.run_dir,
                loggers,
            )
            metrics.update(summary_metrics(result))
    max_steps = settings.trainer["max_steps"]
    session.write_result(metrics, step, finished=step >= max_steps > 0, stopped=stopped)


def closing_lines(
    metrics: dict[str, float], entropy: float, run_dir: Path, trainer: L.Trainer, loggers: list, step: int
) -> list[str]:
    """The final validation against the corpus's unigram entropy, the rates, and where everything is."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from gptlab.tracking.loggers import logger_lines

    val = metrics.get("val/loss")
    if val is None:
        first = "No validation (it is off: trainer.limit_val_batches=0)"
    else:
        bpb = f", {metrics['val/bpb']:.4f} bits per byte" if "val/bpb" in metrics else ""
        first = (
            f"Final validation loss {val:.4f} nats (perplexity {math.exp(val):.1f}){bpb}; unigram entropy of "
            f"the corpus {entropy:.4f} nats ({abs(entropy - val):.3f} {'below' if val < entropy else 'above'} it)"
        )
    rates = (
        f": {metrics['tokens_per_second_wall']:,.0f} tokens/s of wall time (start-up, data, validation and "
        f"checkpoints included); training rate {metrics['tokens_per_second_training']:,.0f} tokens/s "
        "(validation excluded)"
        if "tokens_per_second_wall" in metrics
        else ""
    )
    lines = [first, f"Trained {step} steps in {metrics['wall_seconds']:.0f} s{rates}", f"Outputs: {run_dir}"]
    ckpt = trainer.checkpoint_callback
    if isinstance(ckpt, ModelCheckpoint) and ckpt.dirpath:
        lines.append(
            f"  checkpoints: {ckpt.dirpath} (last.ckpt, best by val/loss: {Path(ckpt.best_model_path).name})"
        )
    return lines + logger_lines(loggers)
