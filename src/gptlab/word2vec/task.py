"""The word2vec task's training: the loop, its checkpoints and its limits, and the evaluation of the written
vectors. The task itself (``python train.py task=word2vec``, on the run skeleton) is
:mod:`gptlab.tasks.word2vec`. Checkpoints resume (``resume=auto`` or a path).

Training is a plain loop around the fast update (``gptlab.word2vec.fast``), not a Lightning Trainer:
importing Lightning alone takes longer (about 8 s here) than a whole training run on a corpus of a few hundred
thousand words, and the update needs no autograd, optimizer or loader. The run directory is the one every
task writes (``gptlab.runs.layout``): the last checkpoint (a Lightning-style dict: ``state_dict``,
``hyper_parameters``, ``global_step``), ``config_resolved.yaml``, ``result.json``, ``metrics.json`` and the
configured loggers' files, in the same places and formats as the GPT task's (gptlab's loggers written
without Lightning: :mod:`gptlab.tracking.plain_loggers`).
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import sys
import time
from collections import deque
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from gptlab.errors import CheckpointError, ConfigError
from gptlab.runs import digests, layout
from gptlab.runs.checkpoints import RESUME_INSTEAD, load_checkpoint
from gptlab.runs.jsonfile import figure_as_json, figures_as_json, write_json
from gptlab.runs.resume import ResumePlan
from gptlab.runs.signals import StopSignals
from gptlab.word2vec import evaluation
from gptlab.word2vec.config import Word2VecOptions
from gptlab.word2vec.corpus import WordCorpus
from gptlab.word2vec.divergence import DivergenceWatch
from gptlab.word2vec.fast import Tables, WindowBatch, sgd_step
from gptlab.word2vec.objectives import NegativeSampling
from gptlab.word2vec.schedule import Runner, Schedule, make_runner

log = logging.getLogger("gptlab")


def check_resume(path: Path, options: Word2VecOptions, words: list[str]) -> ResumePlan:
    """The checkpoint must be a word2vec checkpoint of the same shape, trained on the same vocabulary."""
    checkpoint = load_checkpoint(path, use_instead=RESUME_INSTEAD)
    saved = (checkpoint.get("hyper_parameters") or {}).get("word2vec")
    vocab = checkpoint.get("word2vec_vocab")
    if saved is None or vocab is None:
        raise CheckpointError(
            f"Checkpoint {path} is not a word2vec checkpoint: resume a run of task=word2vec, or drop resume=."
        )
    for key in ("mode", "dim", "objective", "optimizer"):
        if saved.get(key, Word2VecOptions.__dataclass_fields__[key].default) != getattr(options, key):
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


def explicit_overrides(cfg: DictConfig) -> list[str]:
    """The overrides of this job's command line (Hydra's task overrides), as typed."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return [str(o) for o in HydraConfig.get().overrides.task]
    hydra = cfg.get("hydra")
    return [str(o) for o in hydra.overrides.task] if hydra is not None and "overrides" in hydra else []


def parse_max_time(value: Any) -> float | None:
    """Lightning's ``max_time`` ("DD:HH:MM:SS" or a dict of days/hours/minutes/seconds) in seconds."""
    if value is None:
        return None
    if isinstance(value, str):
        parts = value.split(":")
        if len(parts) == 4 and all(p.strip().isdigit() for p in parts):
            d, h, m, s = (int(p) for p in parts)
            return float(((d * 24 + h) * 60 + m) * 60 + s)
    elif isinstance(value, dict) and set(value) <= {"days", "hours", "minutes", "seconds"}:
        return float(
            value.get("days", 0) * 86400
            + value.get("hours", 0) * 3600
            + value.get("minutes", 0) * 60
            + value.get("seconds", 0)
        )
    raise ConfigError(f"trainer.max_time={value!r}: give DD:HH:MM:SS (e.g. trainer.max_time=00:01:00:00).")


def trainer_limits(cfg: DictConfig) -> tuple[int | None, float | None]:
    """(step cap, seconds cap): trainer.max_steps and trainer.max_time when they were given (on the command
    line or by a debug= preset). As in Lightning, they stop the run early; the learning rate still decays over
    word2vec.epochs (or word2vec.max_steps)."""
    overrides = explicit_overrides(cfg)

    def given(key: str) -> bool:
        return any(o.lstrip("+").startswith(f"trainer.{key}=") or o.startswith("debug=") for o in overrides)

    trainer = cfg.get("trainer") or {}
    max_steps = None
    if given("max_steps"):
        value = trainer.get("max_steps")
        if not isinstance(value, int) or isinstance(value, bool) or value == 0 or value < -1:
            raise ConfigError(
                f"trainer.max_steps={value!r}: give a positive number of steps (or -1 for word2vec.epochs)."
            )
        if value > 0:
            max_steps = value
    max_seconds = parse_max_time(trainer.get("max_time")) if given("max_time") else None
    return max_steps, max_seconds


#: ``word2vec.device=auto`` takes a CUDA GPU from this batch size (``word2vec.batch_size``, centre words per step)
#: up, and the CPU below it. On an H200 (scripts/gpu_check.py's word2vec section: the embedded corpus, skip-gram,
#: dim 100, two epochs; the CPU's worker processes on every core of that machine) CUDA trained 0.69x the CPU's
#: words/s at a batch of 256 (the default), 2.19x at 1,024 and 5.83x at 4,096 (docs/performance.md, "Measured
#: on an H200"): a small batch's step is a few small operations, too little to keep a GPU busy.
CUDA_FROM_BATCH = 1024


def choose_device(setting: str, cuda_available: bool, batch_size: int) -> tuple[str, str]:
    """The device (``"cuda"`` or ``"cpu"``) that ``word2vec.device=setting`` takes where a CUDA GPU is
    ``cuda_available`` or not, at ``word2vec.batch_size=batch_size``, and why (the run's log says both).
    ``cuda`` without a GPU is refused."""
    if setting == "cuda":
        if not cuda_available:
            raise ConfigError(
                "word2vec.device=cuda, but torch sees no CUDA GPU: use word2vec.device=auto or cpu."
            )
        return "cuda", "word2vec.device=cuda"
    if setting != "auto":
        return setting, f"word2vec.device={setting}"
    if not cuda_available:
        return "cpu", "word2vec.device=auto: no CUDA GPU"
    if batch_size < CUDA_FROM_BATCH:
        return "cpu", (
            f"word2vec.device=auto: batch {batch_size:,} is below {CUDA_FROM_BATCH:,}, where a CUDA GPU "
            f"trained slower than the CPU (0.69x at 256 on an H200); word2vec.device=cuda takes the GPU"
        )
    return "cuda", (
        f"word2vec.device=auto: a CUDA GPU at batch {batch_size:,}: from {CUDA_FROM_BATCH:,} it trained faster "
        "than the CPU (2.19x at 1,024, 5.83x at 4,096 on an H200)"
    )


def pick_device(options: Word2VecOptions) -> torch.device:
    """The run's device (:func:`choose_device`), said in the log with why."""
    device, why = choose_device(options.device, torch.cuda.is_available(), options.batch_size)
    log.info("word2vec: training on the %s (%s)", "CUDA GPU" if device == "cuda" else device.upper(), why)
    return torch.device(device)


class Trainer:
    """The loop: batches of the schedule, the linearly decaying learning rate, SGD steps (in several
    threads on shared tables, Hogwild, when ``threads > 1`` on a CPU), checkpoints, logging and a clean stop
    on SIGTERM / SIGINT (:class:`StopSignals`)."""

    def __init__(
        self,
        schedule: Schedule,
        options: Word2VecOptions,
        device: torch.device,
        run_dir: Path,
        loggers: list,
        seed: int,
        log_every: int = 10,
    ) -> None:
        self.schedule = schedule
        self.options = options
        self.run_dir = run_dir
        self.loggers = loggers
        self.log_every = max(log_every, 1)
        vocab = schedule.corpus.vocab
        self.softmax = options.objective == "softmax"
        output_rows = schedule.objective.output_rows
        self.tables = Tables(len(vocab), output_rows, options.dim, seed, device)
        self.model: Any = None
        self.optimizer: Any = None
        if options.optimizer == "sparse_adam":
            from gptlab.word2vec.model import Word2Vec

            self.model = Word2Vec(len(vocab), options.dim, options.mode, output_rows).to(device)
            with torch.no_grad():
                self.model.input.weight.copy_(self.tables.input)
            self.tables.input, self.tables.output = self.model.input.weight, self.model.output.weight
            self.optimizer = torch.optim.SparseAdam(self.model.parameters(), lr=options.lr)
        self.threads = (
            1 if device.type != "cpu" or self.model is not None else options.threads or os.cpu_count() or 1
        )
        # CBOW's SGD step in C on a CPU (gptlab.word2vec.native), loaded here: forked workers inherit it
        self.native: Any = None
        self.native_steps: Any = None
        if options.native and options.mode == "cbow" and not self.softmax:
            if device.type == "cpu" and self.model is None:
                from gptlab.word2vec import native

                lib = native.library()
                workers = self.threads  # for the per-row bound (gptlab.word2vec.fast.row_scales)
                self.native = (
                    None if lib is None else functools.partial(native.cbow_step, lib, workers=workers)
                )
                # negative sampling's outputs are as wide in every batch: a block's steps go in one call
                if lib is not None and isinstance(schedule.objective, NegativeSampling):
                    self.native_steps = functools.partial(native.cbow_steps, lib, workers=workers)
        self.global_step = 0
        self.wandb_run_id: str | None = None
        self.signals = StopSignals()
        self.last_loss = math.nan
        self.divergence = DivergenceWatch()
        self.words_done = 0.0

    @property
    def received(self) -> int | None:
        """The stop signal received (SIGTERM, SIGINT), if any."""
        return self.signals.received

    # ---- one step --------------------------------------------------------------------------------------

    def learning_rate(self, progress: float) -> float:
        """word2vec's schedule: linear from lr at the start to lr_min at the end of training."""
        o = self.options
        return o.lr - (o.lr - o.lr_min) * min(max(progress, 0.0), 1.0)

    def train_step(self, batch: WindowBatch, with_loss: bool) -> float | None:
        lr = self.learning_rate(batch.progress)
        if len(batch.target) == 0:
            return 0.0 if with_loss else None
        if self.native is not None:
            return self.native(self.tables, batch, lr, with_loss)
        if self.model is None:
            return sgd_step(
                self.tables, batch, lr, self.options.mode, self.softmax, with_loss, workers=self.threads
            )
        device = self.tables.device
        t = batch.outputs
        to = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        loss = self.model(
            to(batch.inputs), to(t.rows), to(t.labels), to(t.mask), to(batch.target), self.softmax
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    # ---- the loop --------------------------------------------------------------------------------------

    def fit(
        self,
        start_step: int,
        checkpoint_every: int,
        max_seconds: float | None,
        step_cap: int | None = None,
        signals: StopSignals | None = None,
    ) -> bool:
        """Train from ``start_step`` to the end of the schedule, or to ``step_cap`` steps or ``max_seconds``
        (trainer limits); True when stopped by a signal (a checkpoint was saved). Steps run in rounds (up to
        the next checkpoint); between rounds the loop logs, saves checkpoints and checks the limits. The stop
        signals are caught by ``signals``, which the caller installed for longer (a run's writing and
        evaluation after training), else here, up to the last checkpoint written."""
        self.global_step = start_step
        if signals is not None:
            self.signals = signals
        with nullcontext() if signals is not None else self.signals:
            return self._fit(checkpoint_every, max_seconds, step_cap)

    def _fit(self, checkpoint_every: int, max_seconds: float | None, step_cap: int | None) -> bool:
        # Start-up's objects (modules, config, corpus) are moved out of the garbage collector's reach: it
        # does not walk them during training or at exit, nor does a forked worker copy the pages it would
        # touch (the gc module's advice for fork without exec). Handed back after training unless frozen before
        # (a run's start-up, gptlab.tasks.collector, hands back its own at the run's end): a notebook or a test
        # process calling this keeps collecting its garbage afterwards.
        frozen_before = gc.get_freeze_count()
        gc.freeze()
        t0 = time.perf_counter()
        times: deque[tuple[float, float]] = deque(maxlen=20)
        times.append((t0, self.words_done))
        runner = self._runner(self.global_step)
        stopped = False
        try:
            while True:
                stop = (self.global_step // checkpoint_every + 1) * checkpoint_every
                stop = min(stop, self.global_step + runner.round_steps)
                if step_cap is not None:
                    stop = min(stop, step_cap)
                if stop <= self.global_step:
                    break
                reached, words, logged = runner.run(self.global_step, stop)
                now = time.perf_counter()
                times.append((now, self.words_done + words))
                rate = (times[-1][1] - times[0][1]) / max(times[-1][0] - times[0][0], 1e-9)
                self._log_round(logged, rate)
                self.global_step, self.words_done = reached, self.words_done + words
                if reached < stop:  # the schedule ended
                    break
                if self.global_step % checkpoint_every == 0:
                    self.save_checkpoint()
                if self.received is not None:
                    stopped = True
                    break
                if max_seconds is not None and now - t0 >= max_seconds:
                    log.info("trainer.max_time reached after step %d", self.global_step)
                    break
        finally:
            runner.close()
            if frozen_before == 0:
                gc.unfreeze()
        self.save_checkpoint()  # a signal meanwhile is noted: the checkpoint is written whole
        return stopped

    def _log_round(self, logged: list[tuple[int, float, float]], rate: float) -> None:
        """The steps a round logged (step, loss, progress), in order, with the round's training rate."""
        for step, loss, progress in sorted(logged):
            self.global_step = step + 1
            self.last_loss = loss
            if self.divergence.observe(step, loss):
                log.warning(self.divergence.line())
            self.log_metrics(
                {
                    "train/loss": loss,
                    "train/lr": self.learning_rate(progress),
                    "train/words_per_second": rate,
                    "train/progress": progress,
                }
            )

    def _runner(self, start_step: int) -> Runner:
        parallel = self.options.parallel if sys.platform.startswith("linux") else "threads"
        return make_runner(self, start_step, self.threads, parallel)

    def work(self, item: tuple[int, int, int, int]) -> tuple[int, float | None, float, float]:
        """One optimizer step: (step, its loss per pair when it is logged, the corpus words it covered, the
        share of training done before it)."""
        batch = self.schedule.batch(*item)
        return self.run_batch(item[0], batch)

    def work_steps(
        self, items: list[tuple[int, int, int, int]]
    ) -> list[tuple[int, float | None, float, float]]:
        """Consecutive steps of one block (``Schedule.block_key``): :meth:`work` for each, or, where CBOW's C
        step takes them, all in one call (the same steps, bit for bit, without Python between them)."""
        if self.native_steps is None or len(items) < 2:
            return [self.work(item) for item in items]
        steps = self.schedule.batches(items)
        lrs = np.array([self.learning_rate(p) for p in steps.progress], dtype=np.float32)
        logged = np.array([item[0] % self.log_every == 0 for item in items])
        losses = self.native_steps(self.tables, steps, lrs, logged)
        windows = np.diff(steps.bounds)
        return [
            (item[0], float(losses[i]) / max(float(windows[i]), 1.0) if logged[i] else None, words, progress)
            for i, (item, words, progress) in enumerate(zip(items, steps.words, steps.progress))
        ]

    def run_batch(self, step: int, batch: WindowBatch) -> tuple[int, float | None, float, float]:
        loss = self.train_step(batch, step % self.log_every == 0)
        if loss is not None:
            pairs = (
                float(len(batch.target)) if self.options.mode == "cbow" else float((batch.inputs >= 0).sum())
            )
            loss /= max(pairs, 1.0)
        return step, loss, batch.words, batch.progress

    # ---- outputs ---------------------------------------------------------------------------------------

    def log_metrics(self, metrics: dict[str, float]) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, step=self.global_step)

    def checkpoint(self) -> dict[str, Any]:
        vocab = self.schedule.corpus.vocab
        checkpoint: dict[str, Any] = {
            "state_dict": {
                "model.input.weight": self.tables.input.detach().cpu(),
                "model.output.weight": self.tables.output.detach().cpu(),
            },
            "hyper_parameters": {"word2vec": self.options.to_dict(), "vocab_size": len(vocab)},
            "global_step": self.global_step,
            "word2vec_vocab": {"words": list(vocab.words), "counts": [int(c) for c in vocab.counts]},
        }
        if self.optimizer is not None:
            checkpoint["optimizer_states"] = [self.optimizer.state_dict()]
        if self.wandb_run_id:
            checkpoint["wandb_run_id"] = self.wandb_run_id
        if self.divergence.start_loss is not None:  # a resumed run is judged against its own start
            checkpoint["word2vec_start_loss"] = self.divergence.start_loss
        return checkpoint

    def save_checkpoint(self) -> Path:
        """The run's last checkpoint, written beside it and renamed: whole or not at all; its digest after it."""
        path = layout.last_checkpoint(self.run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        torch.save(self.checkpoint(), tmp)
        files = digests.compute(tmp, name=path.name)
        digests.remove_digest(path)
        os.replace(tmp, path)
        digests.write_digest(path, files, self.global_step)
        for lg in self.loggers:
            lg.save()
        return path

    def restore(self, path: Path) -> None:
        checkpoint = load_checkpoint(path)
        state = checkpoint["state_dict"]
        with torch.no_grad():
            self.tables.input.copy_(state["model.input.weight"])
            self.tables.output.copy_(state["model.output.weight"])
        if self.optimizer is not None and checkpoint.get("optimizer_states"):
            self.optimizer.load_state_dict(checkpoint["optimizer_states"][0])
        self.global_step = int(checkpoint.get("global_step", 0))
        self.divergence.start_loss = checkpoint.get("word2vec_start_loss")


def evaluate_run(
    path: Path,
    run_dir: Path,
    options: Word2VecOptions,
    corpus: WordCorpus,
    loggers: list,
    step: int,
    signals: StopSignals | None = None,
) -> dict[str, float]:
    """Score the written vectors, print the report, draw the PCA plot and log the scores. The vectors of a
    token-folder run are scored on its whole-word tokens (``Ġking`` -> ``king``). A stop signal caught by
    ``signals`` ends the scoring at once (:class:`EvaluationStopped`: nothing is written or logged); once
    the scores are known, they are all recorded."""
    with signals.interrupting() if signals is not None else nullcontext():
        kv = evaluation.load_embeddings(path)
        if corpus.kind == "tokens":
            kv = evaluation.whole_word_vectors(kv)
        result = evaluation.evaluate(kv, options.neighbour_words)
    print(evaluation.format_report(result, f"({options.mode}, {options.objective}, {run_dir})"), flush=True)
    plot = evaluation.pca_plot(kv, run_dir / "pca.png", options.plot_words, title=options.mode)
    # strict JSON (gptlab.runs.jsonfile): a score of a benchmark the vocabulary misses (NaN) as "nan", and
    # so a similarity of vectors that diverged
    neighbours = {
        word: [(other, figure_as_json(similarity)) for other, similarity in near]
        for word, near in result["neighbours"].items()
    }
    write_json(
        run_dir / "evaluation.json",
        {**result, "metrics": figures_as_json(result["metrics"]), "neighbours": neighbours},
    )
    scores = {f"eval/{k}": float(v) for k, v in result["metrics"].items()}
    finite = {k: v for k, v in scores.items() if not (isinstance(v, float) and math.isnan(v))}
    for lg in loggers:
        lg.log_metrics(finite, step=step)
    if loggers:
        from gptlab.tracking.studies import log_scores_and_figure

        log_scores_and_figure(loggers, finite, {"eval/pca": plot} if plot is not None else {}, step)
    return scores


__all__ = [
    "CUDA_FROM_BATCH",
    "StopSignals",
    "Trainer",
    "check_resume",
    "choose_device",
    "evaluate_run",
    "pick_device",
    "trainer_limits",
]
