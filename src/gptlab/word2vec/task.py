"""``python train.py task=word2vec``: train word vectors on the configured corpus, write them in the word2vec
text format (``<run dir>/embeddings.txt``) and evaluate them. Checkpoints resume (``resume=auto`` or a path)."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, OmegaConf

from gptlab.builders import data_spec
from gptlab.errors import CheckpointError, ConfigError
from gptlab.lit.checkpointing import (
    AtomicCheckpointIO,
    PeriodicLastCheckpoint,
    fault_tolerance_callbacks,
    fit,
)
from gptlab.resume import ResumePlan, checkpoint_to_resume
from gptlab.runs.checkpoints import load_checkpoint
from gptlab.tracking.loggers import finish_wandb
from gptlab.word2vec import evaluation
from gptlab.word2vec.config import Word2VecOptions
from gptlab.word2vec.datamodule import Word2VecDataModule
from gptlab.word2vec.module import Word2VecLitModule

log = logging.getLogger("gptlab")


def check_resume(path: Path, options: Word2VecOptions, words: list[str]) -> ResumePlan:
    """The checkpoint must be a word2vec checkpoint of the same shape, trained on the same vocabulary."""
    checkpoint = load_checkpoint(path)
    saved = (checkpoint.get("hyper_parameters") or {}).get("word2vec")
    vocab = checkpoint.get("word2vec_vocab")
    if saved is None or vocab is None:
        raise CheckpointError(
            f"Checkpoint {path} is not a word2vec checkpoint: resume a run of task=word2vec, or drop resume=."
        )
    for key in ("mode", "dim"):
        if saved.get(key) != getattr(options, key):
            raise CheckpointError(
                f"Checkpoint {path} was trained with word2vec.{key}={saved.get(key)!r}, not "
                f"{getattr(options, key)!r}: resume with word2vec.{key}={saved.get(key)}, or start a new run."
            )
    if list(vocab["words"]) != list(words):
        raise CheckpointError(
            f"Checkpoint {path} has another vocabulary ({len(vocab['words'])} words, now {len(words)}): the "
            "corpus, word2vec.min_count, word2vec.lowercase or word2vec.keep_punctuation differ from its run."
        )
    run_id = checkpoint.get("wandb_run_id")
    return ResumePlan(path, int(checkpoint.get("global_step", 0)), str(run_id) if run_id else None)


def trainer_options(cfg: DictConfig, options: Word2VecOptions, run_dir: Path) -> dict[str, Any]:
    """One device, fp32, no validation and no gradient clipping (word2vec's update is plain per-pair SGD)."""
    trainer = cfg.get("trainer") or {}
    return {
        "accelerator": trainer.get("accelerator", "auto"),
        "devices": 1,
        "precision": "32-true",
        "max_epochs": -1 if options.max_steps else options.epochs,
        "max_steps": options.max_steps or -1,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": int(trainer.get("log_every_n_steps", 10)),
        "enable_model_summary": False,
        "default_root_dir": str(run_dir),
    }


def run(cfg: DictConfig) -> dict[str, float]:
    """Train word2vec as configured; returns the final metrics (loss, words/s, benchmark scores)."""
    from gptlab.train import build_loggers, start_run

    t0 = time.perf_counter()
    run_dir = start_run(cfg)
    options = Word2VecOptions.from_dict(
        cast(dict[str, Any], OmegaConf.to_container(cfg.word2vec, resolve=True))
    )
    if options.threads:
        torch.set_num_threads(options.threads)
    datamodule = Word2VecDataModule(data_spec(cfg), options, seed=int(cfg.seed))
    datamodule.setup("fit")
    vocab = datamodule.vocab
    assert vocab is not None  # setup("fit") builds it
    ckpt = checkpoint_to_resume(cfg.get("resume"), run_dir)
    resume = check_resume(ckpt, options, vocab.words) if ckpt else None
    module = Word2VecLitModule(options.to_dict(), len(vocab))
    module.vocab_words, module.vocab_counts = vocab.words, [int(c) for c in vocab.counts]
    log.info("Data ready after %.1f s", time.perf_counter() - t0)

    loggers = build_loggers(cfg, resume)
    failed = True
    try:
        callbacks = [
            PeriodicLastCheckpoint(str(run_dir / "checkpoints"), options.checkpoint_every),
            *fault_tolerance_callbacks(),
        ]
        trainer = L.Trainer(
            **trainer_options(cfg, options, run_dir),
            logger=loggers or False,
            callbacks=callbacks,
            plugins=[AtomicCheckpointIO()],  # one device, one file: written beside it, then renamed
        )
        resolved = OmegaConf.to_container(cfg, resolve=True)
        for lg in loggers:
            lg.log_hyperparams(resolved)
        OmegaConf.save(cfg, run_dir / "config_resolved.yaml", resolve=True)
        log.info("Run directory: %s", run_dir)
        if resume:
            log.info("Resuming from %s (step %d)", resume.ckpt_path, resume.global_step)
        t_fit = time.perf_counter()
        start_step = resume.global_step if resume else 0
        stopped = fit(trainer, module, datamodule, resume.ckpt_path if resume else None)
        seconds = time.perf_counter() - t_fit
        words_done = words_trained(datamodule, start_step, trainer.global_step)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        metrics["train/words_per_second"] = words_done / seconds if seconds > 0 and words_done else math.nan
        metrics["train/steps"] = trainer.global_step
        vectors = module.model.vectors.detach().cpu().numpy()
        path = evaluation.write_embeddings(run_dir / evaluation.EMBEDDINGS_FILE, vocab.words, vectors)
        if stopped:
            log.info(
                "Stopped by a signal at step %d (checkpoint saved); continue with the same command and "
                "resume=auto or resume=%s",
                trainer.global_step,
                run_dir,
            )
        elif options.evaluate:
            metrics.update(evaluate_run(path, run_dir, options, loggers, trainer.global_step))
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
        print(
            f"Trained {trainer.global_step} steps, {words_done:,.0f} words in {seconds:.1f} s "
            f"({metrics['train/words_per_second']:,.0f} words/s)\nEmbeddings: {path}",
            flush=True,
        )
        failed = False
        return metrics
    finally:
        finish_wandb(loggers, failed)


def words_trained(datamodule: Word2VecDataModule, start_step: int, end_step: int) -> float:
    """Corpus words (before subsampling) that the steps start_step..end_step covered."""
    if end_step <= start_step:
        return 0.0
    (e0, i0), (e1, i1) = datamodule.locate(start_step), datamodule.locate(end_step)
    words = datamodule.corpus_words
    share = lambda e, i: e + i / datamodule.batches_in_epoch(e)  # noqa: E731
    return (share(e1, i1) - share(e0, i0)) * words


def evaluate_run(
    path: Path, run_dir: Path, options: Word2VecOptions, loggers: list, step: int
) -> dict[str, float]:
    """Score the written vectors, print the report, draw the PCA plot and log the scores."""
    kv = evaluation.load_embeddings(path)
    result = evaluation.evaluate(kv, options.neighbour_words)
    print(evaluation.format_report(result, f"({options.mode}, {run_dir})"), flush=True)
    plot = evaluation.pca_plot(kv, run_dir / "pca.png", options.plot_words, title=options.mode)
    (run_dir / "evaluation.json").write_text(json.dumps(result, indent=1))
    scores = {f"eval/{k}": float(v) for k, v in result["metrics"].items()}
    finite = {k: v for k, v in scores.items() if not (isinstance(v, float) and math.isnan(v))}
    for lg in loggers:
        lg.log_metrics(finite, step=step)
        if isinstance(lg, WandbLogger):
            lg.experiment.summary.update(finite)
            if plot is not None:
                import wandb

                lg.experiment.log({"eval/pca": wandb.Image(str(plot))}, step=step)
    return scores


def check_task(cfg: DictConfig) -> str:
    task = cfg.get("task") or "gpt"
    if task not in ("gpt", "word2vec"):
        raise ConfigError(f"task={task!r} is not one of ['gpt', 'word2vec'] (task=gpt trains the GPT).")
    return task


__all__ = ["run", "check_task", "words_trained"]
