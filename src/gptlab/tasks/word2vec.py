"""``python train.py task=word2vec``: word vectors trained on the configured corpus (Mikolov et al. 2013,
"Efficient Estimation of Word Representations in Vector Space"), written in the word2vec text format
(``<run dir>/embeddings.txt``) and evaluated, on the same run skeleton as the language model
(:mod:`gptlab.tasks.skeleton`): one run per directory, ``run.json``, the loggers, ``config_resolved.yaml``,
``result.json``. The training loop is :mod:`gptlab.word2vec.task`; no Lightning is imported, with or without
loggers (:mod:`gptlab.tracking.plain_loggers`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from gptlab.config import RunSettings
from gptlab.errors import ConfigError, EvaluationStopped, signal_name
from gptlab.runs import layout
from gptlab.runs.jsonfile import figures_as_json, write_json
from gptlab.runs.resume import ResumePlan
from gptlab.tasks.skeleton import RunSession, end_sweep_if_signalled, record_run_dir
from gptlab.word2vec import objectives
from gptlab.word2vec.config import Word2VecOptions
from gptlab.word2vec.corpus import WordCorpus, data_spec, peak_rss_mib, read_corpus
from gptlab.word2vec.schedule import Schedule
from gptlab.word2vec.task import (
    StopSignals,
    Trainer,
    check_resume,
    evaluate_run,
    explicit_overrides,
    pick_device,
    trainer_limits,
)

log = logging.getLogger("gptlab")


@dataclass(frozen=True)
class Word2VecRunConfig:
    """The typed tree of a ``task=word2vec`` run: the top level, the ``word2vec`` node, the corpus, and the
    trainer limits it honours (``trainer.max_steps`` / ``trainer.max_time`` when given)."""

    run: RunSettings
    options: Word2VecOptions
    data: Any  # DataSpec
    step_cap: int | None
    max_seconds: float | None
    log_every: int

    @classmethod
    def parse(cls, cfg: DictConfig) -> Word2VecRunConfig:
        options = Word2VecOptions.from_dict(
            cast(dict[str, Any], OmegaConf.to_container(cfg.word2vec, resolve=True))
        )
        step_cap, max_seconds = trainer_limits(cfg)
        settings = cls(
            run=RunSettings.parse(cfg),
            options=options,
            data=data_spec(cfg.data),
            step_cap=step_cap,
            max_seconds=max_seconds,
            log_every=int((cfg.get("trainer") or {}).get("log_every_n_steps", 10)),
        )
        require_gensim_for_evaluation(options)  # after the config's own checks: a typo is named first
        return settings


#: the nodes a word2vec run never reads: the language model, its training loop and its studies
GPT_ONLY_NODES = (
    "model",
    "pos",
    "activation",
    "norm",
    "attention",
    "mlp",
    "optim",
    "loss",
    "strategy",
    "tokenizer",
    "callbacks",
    "compile",
    "activation_checkpointing",
    "allow_over_memory",
    "eval_length",
    "eval_harness",
)
#: the trainer's keys a word2vec run honours (:func:`gptlab.word2vec.task.trainer_limits`, the log interval)
TRAINER_KEYS_READ = ("max_steps", "max_time", "log_every_n_steps")
#: a language-model setting a newcomer reaches for, and word2vec's own
WORD2VEC_EQUIVALENT = {
    "optim.lr": "word2vec.lr",
    "model.n_embd": "word2vec.dim",
    "data.batch_size": "word2vec.batch_size",
    "trainer.accelerator": "word2vec.device",
    "trainer.devices": "word2vec.threads",
}


def unread_overrides(overrides: list[str]) -> list[str]:
    """The command line's overrides that a word2vec run does not read (``model=small``, ``optim.lr=0.05``,
    ``trainer.precision=bf16``, ``data.batch_size=64``): the language model's nodes, the trainer's keys other
    than its limits, the data loader's keys beside the corpus's. A preset (``debug=fast``) is not one."""
    from gptlab.data.sources import DataSpec

    corpus_keys = {f.name for f in dataclasses.fields(DataSpec)}
    unread = []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        node, _, rest = key.partition(".")
        sub = rest.split(".", 1)[0]
        if (
            node in GPT_ONLY_NODES
            or (node == "trainer" and sub and sub not in TRAINER_KEYS_READ)
            or (node == "data" and sub and sub not in corpus_keys)
        ):
            unread.append(override)
    return unread


def warn_unread_overrides(overrides: list[str]) -> None:
    """Say, once and before any work, which overrides change nothing in this run, and word2vec's own option
    where one does what was meant: a run that ignored ``optim.lr=0.05`` silently would train at word2vec.lr."""
    unread = unread_overrides(overrides)
    if not unread:
        return
    fixes = []
    for override in unread:
        key, _, value = override.lstrip("+~").partition("=")
        if key in WORD2VEC_EQUIVALENT:
            fixes.append(f"{WORD2VEC_EQUIVALENT[key]}={value} for {override}")
    log.warning(
        "task=word2vec does not read %s: %s nothing in this run. %sword2vec's options are under word2vec.* "
        "(python train.py task=word2vec --cfg job lists them).",
        ", ".join(unread),
        "it changes" if len(unread) == 1 else "they change",
        f"Set {', '.join(fixes)}; " if fixes else "",
    )


def require_gensim_for_evaluation(options: Word2VecOptions) -> None:
    """Refuse, before any training, ``word2vec.evaluate=true`` where gensim is not installed: the evaluation reads
    the vectors and scores them on the benchmark files gensim ships, after the whole run (a GPU image given only
    the wheels gptlab's GPU paths need has no gensim)."""
    if options.evaluate and importlib.util.find_spec("gensim") is None:
        raise ConfigError(
            "word2vec.evaluate=true needs gensim (it reads the vectors and holds the word-similarity and analogy "
            "benchmarks), and gensim is not installed here. Install it (pip install 'gensim>=4.4,<4.5', one of "
            "gptlab's dependencies), or add word2vec.evaluate=false: the run still writes embeddings.txt."
        )


def run(cfg: DictConfig) -> dict[str, float]:
    """Train word2vec as configured; returns the final metrics (loss, words/s, benchmark scores)."""
    t0 = time.perf_counter()
    run_dir = record_run_dir(cfg)  # before the config is parsed: nodes interpolate paths.output_dir
    settings = Word2VecRunConfig.parse(cfg)
    warn_unread_overrides(explicit_overrides(cfg))
    options = settings.options
    if large_batch := options.large_batch_warning():  # said before any work, once
        log.warning(large_batch)
    device = pick_device(options)
    session = RunSession.start(cfg, settings.run, run_dir)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # Parallel over batches (worker threads), each operation on one core: word2vec's operations are
        # small, and intra-op threads waiting on a busy core cost more than they give.
        torch.set_num_threads(1)
    try:
        return train(cfg, settings, session, device, t0)
    finally:
        torch.set_num_threads(threads)  # a run inside a longer process leaves its thread count as it was


def train(
    cfg: DictConfig, settings: Word2VecRunConfig, session: RunSession, device: torch.device, t0: float
) -> dict[str, float]:
    """Read the corpus, build the objective and its schedule, train, report."""
    options = settings.options
    corpus = read_corpus(settings.data, options)
    objective = objectives.build(
        options.objective, corpus.vocab.counts, options.negatives, options.noise_power
    )
    schedule = Schedule(corpus, options, objective, settings.run.seed, options.max_steps)
    ckpt = session.resume_from
    resume = check_resume(ckpt, options, corpus.vocab.words) if ckpt else None
    log.info(
        "Data ready after %.1f s (peak memory %.0f MiB): %d words, vocabulary %d, objective %s",
        time.perf_counter() - t0,
        peak_rss_mib(),
        corpus.words,
        len(corpus.vocab),
        options.objective,
    )
    session.start_step = resume.global_step if resume else 0
    # the scores describe the vectors of one step: result.json carries an earlier part's only where no step
    # was trained since (a part with word2vec.evaluate=false that trains on drops them)
    session.final_state_figures = ("eval/",)
    session.device_type = device.type  # for the run's environment record (fp32 throughout: no precision)
    # gptlab's loggers written without Lightning: its import would cost more than training on a small corpus
    loggers = session.open_loggers(
        resume.wandb_run_id if resume else None, resume.global_step if resume else None, lightning=False
    )
    for lg in loggers:
        # W&B's import, service and wandb.init (one to two seconds) overlap the training
        if hasattr(lg, "open_in_background"):
            lg.open_in_background()
    trainer: Trainer | None = None
    # SIGTERM / Ctrl-C from here to the loggers closed: training stops at its next checkpoint, the evaluation
    # at once, and the run's files are written whole; the run then ends as stopped (a sweep stops with it).
    signals = StopSignals()
    with signals, session.closing(loggers, step=lambda: trainer.global_step if trainer else 0):
        trainer = Trainer(
            schedule, options, device, session.run_dir, loggers, settings.run.seed, settings.log_every
        )
        session.save_config(loggers)  # opens the W&B run: its id is known from here on
        # saved in checkpoints: a resumed run continues the same W&B run
        trainer.wandb_run_id = session.wandb_run_id()
        log.info("Run directory: %s", session.run_dir)
        metrics, stopped = fit(trainer, settings, resume, signals)
        metrics = report(session, settings, trainer, schedule, corpus, loggers, metrics, stopped, signals)
    end_sweep_if_signalled(signals.received, session.run_dir)
    return metrics


def fit(
    trainer: Trainer, settings: Word2VecRunConfig, resume: ResumePlan | None, signals: StopSignals
) -> tuple[dict[str, float], bool]:
    """Train (continuing ``resume``) to the end of the schedule or a trainer limit; returns the training
    figures and whether a stop signal ended it early (its checkpoint saved). A part that trained no step (a
    finished run resumed, to evaluate it) reports no loss, speed or words: result.json keeps the figures of the
    part that trained."""
    start_step = 0
    if resume:
        trainer.restore(resume.ckpt_path)
        start_step = trainer.global_step
        log.info("Resuming from %s (step %d)", resume.ckpt_path, start_step)
    t_fit = time.perf_counter()
    stopped = trainer.fit(
        start_step, settings.options.checkpoint_every, settings.max_seconds, settings.step_cap, signals
    )
    seconds = time.perf_counter() - t_fit
    metrics: dict[str, float] = {
        "train/loss": trainer.last_loss,
        "train/words_per_second": trainer.words_done / seconds
        if seconds > 0 and trainer.words_done
        else math.nan,
        "train/steps": trainer.global_step,
        "train/words": trainer.words_done,
        "train/seconds": seconds,
        "peak_rss_mib": peak_rss_mib(),
    }
    if trainer.global_step == start_step:
        for key in ("train/loss", "train/words_per_second", "train/words", "train/seconds"):
            del metrics[key]
    return metrics, stopped


def report(
    session: RunSession,
    settings: Word2VecRunConfig,
    trainer: Trainer,
    schedule: Schedule,
    corpus: WordCorpus,
    loggers: list,
    metrics: dict[str, float],
    stopped: bool,
    signals: StopSignals,
) -> dict[str, float]:
    """The vectors written and evaluated, ``metrics.json`` and ``result.json``, and the closing lines. A stop
    signal during training skips the evaluation; one after it (while the vectors are written, or during the
    evaluation) ends the evaluation, and the run is recorded as stopped, its scores named as missing."""
    from gptlab.word2vec import evaluation

    options, run_dir, step = settings.options, session.run_dir, trainer.global_step
    vectors = trainer.tables.input.detach().cpu().numpy()
    path = evaluation.write_embeddings(run_dir / evaluation.EMBEDDINGS_FILE, corpus.vocab.words, vectors)
    stopped_during = "training" if stopped else None
    if stopped:
        log.info(
            "Stopped by %s at step %d (checkpoint saved); continue with the same command and "
            "resume=auto or resume=%s",
            signal_name(signals.received),
            step,
            run_dir,
        )
    elif options.evaluate:
        try:
            metrics.update(evaluate_run(path, run_dir, options, corpus, loggers, step, signals))
        except EvaluationStopped:
            stopped_during = "evaluation"
    finished = stopped_during is None and (
        (settings.step_cap is not None and step >= settings.step_cap)
        or (step >= options.max_steps if options.max_steps else False)
        or (not options.max_steps and schedule.locate(step)[0] >= options.epochs)
    )
    write_json(run_dir / "metrics.json", figures_as_json(metrics))  # this part's figures, strict JSON
    recorded: dict[str, float | None] = dict(metrics)  # result.json's: a score not measured is None (null)
    extra: dict[str, Any] = {}
    if stopped_during is not None:
        # as the language model's result says it: the signal, and the step the last checkpoint holds
        extra = {
            "stop_signal": signal_name(signals.received),
            "checkpoint_step": step,
            "stopped_during": stopped_during,
        }
        if options.evaluate:
            # not measured on these vectors: null in result.json, and named (an earlier part's scores, of
            # other vectors, are not carried over); NaN in the metrics returned
            missing = [f"eval/{name}" for name in evaluation.METRICS]
            recorded.update(dict.fromkeys(missing))
            metrics.update(dict.fromkeys(missing, math.nan))
            extra["evaluation_missing"] = missing
    if "train/loss" in metrics:  # a part that trained: whether its loss diverged
        extra.update(trainer.divergence.record())
    session.write_result(recorded, step, finished=finished, stopped=stopped_during is not None, extra=extra)
    for lg in loggers:
        lg.finalize("success")
    trained = (
        f"Trained {step} steps, {trainer.words_done:,.0f} words in {metrics['train/seconds']:.1f} s "
        f"({metrics['train/words_per_second']:,.0f} words/s, {trainer.threads} thread(s), "
        f"{trainer.tables.device.type}); final loss {trainer.last_loss:.4g} per pair"
        f"{start_of(trainer)}"
        if "train/seconds" in metrics
        else f"Nothing left to train at step {step}"
    )
    print(f"{trained}\nEmbeddings: {path}", flush=True)
    if "train/loss" in metrics and trainer.divergence.diverged:
        log.warning(trainer.divergence.line(trainer.last_loss))
    if stopped_during == "evaluation":
        log.info(evaluation_stopped_line(signals.received, step, path, run_dir))
    return metrics


def start_of(trainer: Trainer) -> str:
    """The closing line's loss at the start, beside the final one: how far training lowered it."""
    start = trainer.divergence.start_loss
    return "" if start is None else f" ({start:.4g} at the start)"


def evaluation_stopped_line(signum: int | None, step: int, vectors: Path, run_dir: Path) -> str:
    """What a run stopped after training says: what was kept, what is missing, and how to get it (in a sweep,
    the command that continues the sweep follows)."""
    from gptlab.runs.naming import is_multirun

    rerun = (
        "continue the sweep with the command below"
        if is_multirun()
        else f"rerun the same command with resume=auto or resume={run_dir}"
    )
    return (
        f"Stopped by {signal_name(signum)} during the evaluation, after training to step {step}: the vectors are "
        f"kept ({vectors} and {layout.last_checkpoint(run_dir)}); result.json records the run as stopped, its "
        "scores as missing (evaluation_missing). Evaluate them with: python scripts/eval_embeddings.py "
        f"{shlex.quote(str(run_dir))} (prints the scores), or {rerun} (no step is trained again; the scores "
        "go into result.json and the loggers)."
    )
