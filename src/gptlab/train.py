"""The training task: everything is built and checked from the config before any expensive work, then
Lightning fits, and the W&B run is always closed, also on error."""

from __future__ import annotations

import inspect
import logging
import math
import time
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from omegaconf import DictConfig, OmegaConf, open_dict

from gptlab.builders import build_datamodule, build_model_config, load_initial_weights
from gptlab.errors import ConfigError
from gptlab.parallel import (
    ParallelOptions,
    build_strategy,
    check_rank_zero_evaluation,
    choose_precision,
    strategy_choice,
    warn_if_cpu_oversubscribed,
)
from gptlab.parallel.slurm import slurm_plugins
from gptlab.preflight import check_accelerator, check_loss, check_seed, check_trainer_values
from gptlab.registry import check_keys
from gptlab.resume import ResumePlan, check_writable, plan_resume
from gptlab.tracking.loggers import finish_wandb
from gptlab.training.checkpointing import fault_tolerance_callbacks, fit, restore_interrupted_saves
from gptlab.training.metrics import run_rates
from gptlab.training.module import GPTLitModule, check_optim
from gptlab.training.optimizers import check_optimizer_strategy

log = logging.getLogger("gptlab")


def _route_lightning_logs() -> None:
    """Lightning prints through its own console handler; Hydra already logs the root logger to the console
    and to the run's log file. Keep one copy of each line, in both places."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True


def run_dir_of(cfg: DictConfig) -> Path:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.paths.get("output_dir") or "outputs/runs/interactive")


def check_trainer_options(trainer_cfg: dict[str, Any]) -> None:
    allowed = sorted(set(inspect.signature(L.Trainer.__init__).parameters) - {"self"})
    fix = "Use Lightning Trainer arguments: https://lightning.ai/docs/pytorch/stable/common/trainer.html#trainer-flags."
    check_keys(trainer_cfg, allowed, "trainer", "trainer", fix)


def build_loggers(cfg: DictConfig, resume: ResumePlan | None = None) -> list:
    loggers = []
    for _, node in (cfg.get("logger") or {}).items():
        if node is not None and "_target_" in node:
            if resume and resume.wandb_run_id and node["_target_"].endswith("wandb_logger"):
                # the resumed run continues the same W&B run
                loggers.append(instantiate(node, id=resume.wandb_run_id, resume="allow"))
            else:
                loggers.append(instantiate(node))
    return loggers


def build_callbacks(cfg: DictConfig) -> list[L.Callback]:
    from hydra.errors import InstantiationException

    callbacks = []
    for _, node in (cfg.get("callbacks") or {}).items():
        if node and "_target_" in node:
            try:
                callbacks.append(instantiate(node))
            except InstantiationException as e:
                if isinstance(e.__cause__, ConfigError):  # a callback's own check: its message, not Hydra's
                    raise e.__cause__ from None
                raise
    return callbacks


def model_summary(
    module: GPTLitModule, trainer: L.Trainer | None = None, cfg: DictConfig | None = None
) -> str:
    """The short model card (gptlab.planning.card): parameters, FLOPs per token, memory per device, and a
    warning when the run will not fit its device."""
    from gptlab.planning import card

    strategy = cast(dict[str, Any], OmegaConf.to_container(cfg.strategy, resolve=True)) if cfg else "auto"
    data = cfg.data if cfg else {}
    return card.startup_card(
        module.model_config,
        strategy=strategy,
        n_devices=trainer.world_size if trainer else 1,
        precision=str(trainer.precision) if trainer else "32-true",
        micro_batch=int(data.get("batch_size") or 1),
        context=data.get("block_size"),
        on_cpu=trainer is None or isinstance(trainer.accelerator, CPUAccelerator),
        activation_checkpointing=bool(cfg.get("activation_checkpointing")) if cfg else False,
    )


def start_run(cfg: DictConfig) -> Path:
    """What every task does first: the run directory (checked writable, recorded as ``paths.output_dir``,
    claimed for this run alone: a directory holding another run is refused, or moved aside with
    ``overwrite=true``; ``run.json`` names the run and this part of it), the seed checked and set
    everywhere. Returns the run directory."""
    from gptlab.runs.identity import claim_run_dir, continues_a_run, launched_rank, record_start

    run_dir = run_dir_of(cfg)
    check_writable(run_dir)
    check_seed(cfg.seed)
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)
    restore_interrupted_saves(run_dir / "checkpoints")  # a kill mid-swap of a sharded checkpoint
    resume, overwrite = cfg.get("resume"), bool(cfg.get("overwrite"))
    if not launched_rank():
        continued = continues_a_run(resume, run_dir)
        if not continued:
            # Inside a Hydra job .hydra/ is this run's own: Hydra wrote it after CheckRunDirectory had checked.
            claim_run_dir(run_dir, resume, overwrite, include_hydra=not HydraConfig.initialized(), log=log)
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        record_start(run_dir, continued, [str(o) for o in overrides], str(cfg.get("task", "gpt")))
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    return run_dir


def run(cfg: DictConfig) -> dict[str, float]:
    """Train one model as configured; returns the final metrics (``val/loss``, ``val/ppl``, ...)."""
    t0 = time.perf_counter()
    _route_lightning_logs()
    run_dir = start_run(cfg)
    # Subnormal floats (a softmax over strongly biased scores: ALiBi at T=1024) are many times slower on x86
    # CPUs; flushing them to zero changes nothing above 1.2e-38. ALiBi's step on one thread: 1.93x -> 1.34x
    # the fused causal one (scripts/bench_attention.py). Threads started later inherit the setting.
    torch.set_flush_denormal(True)

    # ---- build and check everything before any expensive work --------------------------------
    trainer_cfg = cast(dict[str, Any], OmegaConf.to_container(cfg.trainer, resolve=True))
    check_trainer_options(trainer_cfg)
    check_trainer_values(trainer_cfg)
    check_accelerator(trainer_cfg)
    check_loss(cfg.get("loss"), trainer_cfg)
    optim_cfg = cast(dict[str, Any], OmegaConf.to_container(cfg.optim, resolve=True))
    check_optim(optim_cfg, trainer_cfg.get("max_steps"))
    check_optimizer_strategy(optim_cfg, str((cfg.get("strategy") or {}).get("name", "auto")))
    parallel = ParallelOptions.from_config(
        {k: cfg[k] for k in ("compile", "activation_checkpointing") if cfg.get(k) is not None}
    )
    trainer_cfg["precision"] = choose_precision(trainer_cfg.get("precision"), trainer_cfg.get("accelerator"))
    warn_if_cpu_oversubscribed(trainer_cfg)
    strategy_cfg = cast(dict[str, Any], OmegaConf.to_container(cfg.strategy, resolve=True))
    strategy = build_strategy(
        strategy_cfg,
        trainer_cfg,
        multirun=HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN,
    )
    if (cfg.get("eval_length") or {}).get("enabled"):
        check_rank_zero_evaluation(strategy_choice(strategy_cfg), trainer_cfg, "eval_length.enabled=true")
    datamodule = build_datamodule(cfg)
    # The data is read and windowed before any logger or trainer starts, so a bad corpus costs seconds. The
    # tokenizer is a product of the corpus's preparation (a fitted vocabulary comes from its training split).
    datamodule.prepare_data()
    datamodule.setup("fit")
    corpus = datamodule.corpus
    assert corpus is not None  # setup("fit") prepared it
    tokenizer = corpus.tokenizer
    model_config = build_model_config(cfg, tokenizer)
    module = GPTLitModule(
        model=model_config.to_dict(),
        optim=cast(dict[str, Any], OmegaConf.to_container(cfg.optim, resolve=True)),
        loss=cast(dict[str, Any], OmegaConf.to_container(cfg.loss, resolve=True))
        if cfg.get("loss")
        else None,
    )
    module.tokenizer = tokenizer
    resume = plan_resume(cfg.get("resume"), run_dir, model_config)
    if resume and resume.global_step >= trainer_cfg["max_steps"]:
        log.info(
            "The checkpoint is at step %d: trainer.max_steps is reached, nothing is left to train.",
            resume.global_step,
        )
    load_initial_weights(cfg, module.model)  # model.init_from: pretrained weights, checked against the config
    module.parallel = parallel
    log.info("Data ready after %.1f s", time.perf_counter() - t0)
    loggers = build_loggers(cfg, resume)
    callbacks = build_callbacks(cfg) + fault_tolerance_callbacks() + [ValidateAtLastStep()]

    failed = True
    trainer: L.Trainer | None = None
    try:
        trainer = L.Trainer(
            **trainer_cfg,
            strategy=strategy,
            logger=loggers or False,
            callbacks=callbacks,
            plugins=[*slurm_plugins(), *strategy_choice(strategy_cfg).plugins()] or None,
        )
        if trainer.is_global_zero:
            log.info("Run directory: %s", run_dir)
            log.info("\n%s", model_summary(module, trainer, cfg))
        resolved = OmegaConf.to_container(cfg, resolve=True)
        for lg in loggers:
            lg.log_hyperparams(resolved)
        if trainer.is_global_zero:
            OmegaConf.save(cfg, run_dir / "config_resolved.yaml", resolve=True)

        finished = resume is not None and resume.global_step >= trainer_cfg["max_steps"]
        if (
            resume is not None and finished
        ):  # nothing left to train: report the finished run's validation loss
            # Not logged: the run's curves already end with this validation at its last step.
            trainer.loggers = []
            trainer.validate(module, datamodule=datamodule, ckpt_path=str(resume.ckpt_path), verbose=False)
            trainer.loggers = loggers
            stopped = False
        else:
            stopped = fit(trainer, module, datamodule, resume.ckpt_path if resume else None)
        if stopped and trainer.is_global_zero:
            log.info(
                "Stopped by a signal at step %d; continue with the same command and resume=auto",
                trainer.global_step,
            )
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        metrics["unigram_entropy"] = corpus.unigram_entropy
        metrics["wall_seconds"] = time.perf_counter() - t0
        metrics.update(run_rates(trainer, metrics["wall_seconds"]))
        if trainer.is_global_zero:
            for lg in loggers:
                if isinstance(lg, WandbLogger):
                    summary: dict[str, float] = {
                        "unigram_entropy": corpus.unigram_entropy,
                        "parameters/total": module.model.parameter_counts()["total"],
                        # the final validation, also when a finished run is resumed and logs nothing
                        **{k: metrics[k] for k in ("val/loss", "val/ppl") if k in metrics},
                    }
                    lg.experiment.summary.update(summary)
            step = resume.global_step if resume is not None and finished else trainer.global_step
            _report(metrics, corpus.unigram_entropy, run_dir, trainer, loggers, step)
            if (cfg.get("eval_length") or {}).get("enabled"):
                if stopped:  # the weights are half-trained and the time before the machine goes is short
                    log.info(
                        "Stopped by a signal: the length study (eval_length) is skipped; it runs when the "
                        "resumed run finishes."
                    )
                else:
                    from gptlab.evaluation.length import after_training, summary_metrics

                    result = after_training(
                        module.model, corpus, datamodule.block_size, cfg.eval_length, run_dir, loggers
                    )
                    metrics.update(summary_metrics(result))
            _write_result(run_dir, metrics, step, trainer_cfg["max_steps"], stopped)
        failed = False
        return metrics
    except Exception as e:
        # A run that raised says so in result.json (the comparison lists it as failed, not killed).
        if trainer is not None and trainer.is_global_zero:
            _write_result(run_dir, {}, trainer.global_step, trainer_cfg["max_steps"], False, repr(e)[:300])
        raise
    finally:
        finish_wandb(loggers, failed)


class ValidateAtLastStep(L.Callback):
    """Ends training with a validation at its last step, also when ``trainer.max_steps`` is not a multiple
    of ``trainer.val_check_interval``: the final line, the logged metrics and the returned ``val/loss`` then
    describe the weights that are saved. Lightning validates in the step where ``trainer.should_stop`` is
    set (as for early stopping); a run whose last step is a validation step validates once."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True


def _write_result(
    run_dir: Path,
    metrics: dict[str, float],
    step: int,
    max_steps: int,
    stopped: bool,
    failed: str | None = None,
) -> None:
    """``<run dir>/result.json``: what the run reported, its last step, whether it finished (or why not),
    which run it is (``run.json``'s id, and its W&B run's) and the commit it ran at."""
    import wandb

    from gptlab.runs.layout import Run, git_commit, read_run_info

    info = read_run_info(run_dir)
    Run(run_dir).write_result(
        {
            "metrics": {k: v for k, v in metrics.items() if math.isfinite(v)},
            "global_step": step,
            "finished": failed is None and step >= max_steps > 0,
            "stopped_by_signal": bool(stopped),
            **({"failed": failed} if failed is not None else {}),
            "run_id": info.run_id if info else None,
            "wandb_run_id": wandb.run.id if wandb.run is not None else None,
            "git_commit": git_commit(),
        }
    )


def _report(
    metrics: dict[str, float], entropy: float, run_dir: Path, trainer: L.Trainer, loggers: list, step: int
) -> None:
    val = metrics.get("val/loss")
    if val is None:
        first = "No validation (it is off: trainer.limit_val_batches=0)"
    else:
        first = (
            f"Final validation loss {val:.4f} nats (perplexity {math.exp(val):.1f}); unigram entropy of the "
            f"corpus {entropy:.4f} nats ({abs(entropy - val):.3f} {'below' if val < entropy else 'above'} it)"
        )
    lines = [
        first,
        f"Trained {step} steps in {metrics['wall_seconds']:.0f} s"
        + (
            f": {metrics['tokens_per_second_wall']:,.0f} tokens/s of wall time (start-up, data, validation and "
            f"checkpoints included); training rate {metrics['tokens_per_second_training']:,.0f} tokens/s "
            "(validation excluded)"
            if "tokens_per_second_wall" in metrics
            else ""
        ),
        f"Outputs: {run_dir}",
    ]
    ckpt = trainer.checkpoint_callback
    if isinstance(ckpt, ModelCheckpoint) and ckpt.dirpath:
        lines.append(
            f"  checkpoints: {ckpt.dirpath} (last.ckpt, best by val/loss: {Path(ckpt.best_model_path).name})"
        )

    for lg in loggers:
        if isinstance(lg, WandbLogger):
            folder = Path(lg.experiment.dir).parent
            if lg.experiment.settings._offline:
                lines.append(f"  W&B offline run: {folder}  (upload: wandb sync {folder})")
            else:
                lines.append(f"  W&B run: {lg.experiment.url}")
        elif isinstance(lg, CSVLogger):
            lines.append(f"  metrics: {Path(lg.log_dir) / 'metrics.csv'}")
    print("\n".join(lines), flush=True)
