"""``python train.py`` (``task=gpt``): train one language model as configured.

Four steps, each its own function: **build** (the typed config parsed and checked whole, the run directory
claimed, the data read and windowed, the model made; all before any logger or trainer starts, so a bad
corpus or option costs seconds), **resume** (which checkpoint this run continues, checked against the
command before the data is prepared, and against the prepared tokens and vocabulary after),
**fit** (Lightning trains, or only validates a run that has already reached ``trainer.max_steps``) and
**report** (the final line, ``result.json``, the W&B summary and the length study). The run skeleton around
them (loggers, saved config, the result of a run that raised, closing W&B) is :mod:`gptlab.tasks.skeleton`.
"""

from __future__ import annotations

import logging
import math
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from gptlab.config import GPTRunConfig, parse_gpt
from gptlab.planning import check_memory
from gptlab.runs.identity import launched_rank
from gptlab.runs.layout import LAST_CHECKPOINT
from gptlab.runs.naming import is_multirun
from gptlab.runs.resume import ResumePlan, confirm_resume, plan_resume
from gptlab.runs.signals import StopSignals
from gptlab.tasks.skeleton import (
    RunSession,
    end_sweep_if_signalled,
    matmul_advice_for,
    quiet_launched_ranks,
    record_run_dir,
    route_lightning_logs,
)

if TYPE_CHECKING:  # Lightning and the data are imported once the config is checked: a refusal comes first
    import lightning as L

    from gptlab.data.corpus import PreparedCorpus
    from gptlab.data.datamodule import GPTDataModule
    from gptlab.evaluation.length import StudyStopped
    from gptlab.parallel.ranks import LostRank
    from gptlab.training.checkpointing import SignalStop
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
    quiet_launched_ranks()
    run_dir = record_run_dir(cfg)  # before the parse: the trainer's default_root_dir interpolates it
    settings = parse_gpt(cfg)  # before Lightning is imported (seconds): a refusal comes at once
    warmup = settings.optim.options.warmup_outlasts(settings.trainer["max_steps"])
    if warmup is not None and not launched_rank():  # one warning for the run, from rank 0
        log.warning(warmup)
    from gptlab.model.head_loss import CAVEATS

    caveat = CAVEATS.get(settings.loss.impl)
    if caveat is not None and not launched_rank():
        log.warning(caveat)
    # before the run directory, the data or any weight: a run that cannot fit its device is refused
    check_memory(settings)
    import lightning as L

    route_lightning_logs()
    session = RunSession.start(
        cfg, settings.run, run_dir, seed=lambda s: L.seed_everything(s, workers=True, verbose=False)
    )
    strategy = make_strategy(settings)
    # Every check of the checkpoint that the command alone answers, before the data is prepared (minutes to
    # hours of tokenizing on a research corpus); the training tokens and a fitted vocabulary once it is.
    planned = plan_resume(
        session.resume_from,
        settings.model,
        resume_check(settings, strategy),
        ranks_check_shards(strategy, settings),
        vocab_known=not settings.vocab_from_tokenizer,
    )
    parts = build(settings, strategy)
    resume = confirm_resume(planned, parts.module.model_config, data_check(parts))
    if resume is not None:  # a distributed sampler's position is carried to another number of processes
        parts.datamodule.resumed_world_size = saved_world_size(resume)
    recorded = finished_result(session.run_dir, resume, settings.trainer["max_steps"])
    if recorded is not None:
        return report_already_finished(session.run_dir, recorded)
    load_initial_weights(parts.module, settings.init_from)  # after the resume check: it names the model
    log.info("Data ready after %.1f s", time.perf_counter() - t0)
    session.start_step = resume.global_step if resume else 0
    session.part_changes = resume.changes if resume else {}
    loggers = session.open_loggers(
        resume.wandb_run_id if resume else None, resume.global_step if resume else None
    )
    trainer: L.Trainer | None = None
    # after training (Lightning's own handlers put back): SIGTERM / Ctrl-C ends the length study at once, and
    # waits for the files being written; the run then ends as stopped, result.json written (a sweep stops)
    signals = StopSignals()

    def metrics_so_far() -> dict[str, float]:  # for result.json when the run fails
        wall = time.perf_counter() - t0
        return collect_metrics(trainer, parts, wall) if trainer is not None else {"wall_seconds": wall}

    with (
        session.closing(
            loggers,
            step=lambda: trainer.global_step if trainer else session.start_step,
            metrics=metrics_so_far,
        ),
        matmul_advice_for(settings.trainer["precision"]),  # Lightning's check runs at the fit's device setup
    ):
        trainer = make_trainer(cfg, settings, parts, loggers)
        session.is_global_zero = trainer.is_global_zero
        # the device and precision the trainer resolved (accelerator=auto, precision=null), for the run's record
        session.device_type = trainer.strategy.root_device.type
        session.precision = str(trainer.precision)
        if trainer.is_global_zero:
            log.info("Run directory: %s", session.run_dir)
            log.info("\n%s", model_summary(parts.module, trainer, settings))
            log.info("Compile: %s", settings.parallel.compile_choice.describe())
        session.save_config(loggers)
        watch_lost_ranks(session, trainer, lambda: trainer.global_step, metrics_so_far)
        stop, step = fit(trainer, parts, resume, settings.trainer["max_steps"])
        with signals:
            metrics = collect_metrics(trainer, parts, time.perf_counter() - t0)
            if trainer.is_global_zero:
                report(session, settings, parts, trainer, loggers, metrics, step, stop, signals)
    end_sweep_if_signalled(stop.signum if stop is not None else signals.received, session.run_dir)
    return metrics


#: result.json's key for the sentence after the final validation (:func:`validation_coverage`)
COVERAGE_KEY = "val_coverage"
#: result.json's key for what the settings that choose by the hardware took (:func:`resolved_settings`)
RESOLVED_KEY = "resolved"


def resolved_settings(settings: GPTRunConfig, parts: Parts) -> dict[str, Any]:
    """What this part of the run took where its config let the hardware choose: ``compile`` (``auto``:
    on CUDA), ``loss.impl`` (``auto``) and ``trainer.precision`` (null), each under its config key; the
    config files keep what was asked."""
    from gptlab.model.head_loss import precision_dtype

    module = parts.module
    precision = settings.trainer["precision"]
    # set when the fit started; a run that only validated (resumed at its last step) resolves it here alike
    impl = module.loss_impl or module.head_loss.resolve(module.device, dtype=precision_dtype(str(precision)))
    return {"compile": settings.parallel.compiled, "loss.impl": impl, "trainer.precision": precision}


def finished_result(run_dir: Path, resume: ResumePlan | None, max_steps: int) -> dict[str, Any] | None:
    """The ``result.json`` of a run that ``resume`` continues and that already finished at the checkpoint's
    step (so nothing is left to train, and its record stays as it is); None otherwise. A checkpoint at
    ``max_steps`` without such a result (a run killed after its last save) is validated and reported."""
    from gptlab.runs.layout import Run

    if resume is None or resume.global_step < max_steps:
        return None
    result = Run(run_dir).result()
    if not result or not result.get("finished") or result.get("global_step") != resume.global_step:
        return None
    return result


def report_already_finished(run_dir: Path, result: dict[str, Any]) -> dict[str, float]:
    """The closing lines of a finished run continued with nothing to train: its recorded validation, and
    that nothing was done; returns its recorded metrics. Nothing is trained, validated, logged or written."""
    from gptlab.runs.layout import RESULT_FILE

    metrics = {k: float(v) for k, v in (result.get("metrics") or {}).items() if isinstance(v, (int, float))}
    step = int(result["global_step"])
    # the sentence on which validation tokens were scored, as the run printed it (result.json keeps it: the
    # windows it counts are not built here)
    coverage = result.get(COVERAGE_KEY) or ""
    lines = [
        f"The run already finished at step {step}; nothing to do ({run_dir / RESULT_FILE} is left as it is).",
        validation_line(
            metrics.get("val/loss"), metrics.get("unigram_entropy"), metrics.get("val/bpb"), coverage
        ),
        f"Outputs: {run_dir}",
        *next_steps_lines(run_dir, finished=True),
    ]
    print("\n".join(lines), flush=True)
    return metrics


# ---- build --------------------------------------------------------------------------------------------
def make_strategy(settings: GPTRunConfig) -> Any:
    """The Lightning strategy, checked against the hardware and the launch (before any data is read)."""
    from gptlab.parallel import build_strategy, warn_if_cpu_oversubscribed

    strategy = build_strategy(settings.strategy_node, settings.trainer, multirun=is_multirun())
    if not launched_rank():  # one warning for the run, from rank 0, not one from each process
        warn_if_cpu_oversubscribed(settings.trainer)
    return strategy


def build(settings: GPTRunConfig, strategy: Any) -> Parts:
    """The data prepared and windowed (the tokenizer is a product of it: a fitted vocabulary comes from the
    training split), the module made; ``strategy``: :func:`make_strategy`'s."""
    import torch

    from gptlab.training.module import GPTLitModule

    # Subnormal floats (a softmax over strongly biased scores: ALiBi at T=1024) are many times slower on x86
    # CPUs; flushing them to zero changes nothing above 1.2e-38. ALiBi's step on one thread: 1.93x -> 1.34x
    # the fused causal one (scripts/bench_attention.py). Threads started later inherit the setting.
    torch.set_flush_denormal(True)
    datamodule = make_datamodule(settings)
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


def resume_check(settings: GPTRunConfig, strategy: Any) -> Any:
    """The comparison of a checkpoint with this command's processes, batch, stride, seed, tokenizer, loss and
    optimizer (:func:`gptlab.training.resume_changes.check_resume`), for
    :func:`gptlab.runs.resume.plan_resume`: all known before the data is prepared."""
    from gptlab.training.resume_changes import check_resume, planned_conditions

    def check(checkpoint: dict[str, Any], path: Path) -> Any:
        now = planned_conditions(settings, strategy)
        return check_resume(
            checkpoint,
            path,
            now,
            settings.optim.node(),
            settings.loss.options(),
            settings.tokenizer["name"],
            streaming=settings.data.streaming,
        )

    return check


def saved_world_size(resume: ResumePlan) -> int | None:
    """The processes that trained the checkpoint ``resume`` continues (None where it did not record them)."""
    from gptlab.training.resume_changes import CONDITIONS_KEY, TrainingConditions

    saved = TrainingConditions.from_dict(resume.checkpoint.get(CONDITIONS_KEY))
    return saved.world_size if saved is not None else None


def data_check(parts: Parts) -> Any:
    """The comparison of a checkpoint's training tokens with the prepared corpus's
    (:func:`gptlab.training.resume_changes.check_training_data`), for :func:`gptlab.runs.resume.confirm_resume`."""
    from gptlab.training.resume_changes import check_training_data, training_data_identity

    def check(checkpoint: dict[str, Any], path: Path) -> None:
        check_training_data(checkpoint, path, training_data_identity(parts.corpus))

    return check


def ranks_check_shards(strategy: Any, settings: GPTRunConfig) -> bool:
    """Whether the run's ranks hash a sharded checkpoint between them when its strategy loads it
    (:func:`gptlab.parallel.checkpoint_io.verify_sharded_load`), leaving the planning of a resume the sizes."""
    from gptlab.parallel.checkpoint_io import AtomicDeepSpeedStrategy, FullyShardedStrategy
    from gptlab.parallel.hardware import world_size

    sharded = isinstance(strategy, (FullyShardedStrategy, AtomicDeepSpeedStrategy))
    return sharded and world_size(settings.trainer) > 1


def make_datamodule(settings: GPTRunConfig) -> GPTDataModule:
    """The run's data: ``settings``' corpus and tokenizer, windowed and batched as its loader keys say."""
    from gptlab.data.datamodule import GPTDataModule

    loader = settings.loader
    return GPTDataModule(
        spec=settings.data,
        tokenizer=settings.tokenizer,
        block_size=settings.block_size,
        batch_size=loader.batch_size,
        stride=loader.stride,
        val_stride=loader.val_stride,
        num_workers=loader.num_workers,
        document_mask=loader.document_mask,
        seed=settings.run.seed,
    )


def load_initial_weights(module: GPTLitModule, source: str | None) -> None:
    """``model.init_from``: a Hugging Face GPT-2 or Llama directory's weights, checked against the config."""
    if source:
        from gptlab.model.hf import load_pretrained

        load_pretrained(module.model, source)


def make_trainer(cfg: DictConfig, settings: GPTRunConfig, parts: Parts, loggers: list) -> L.Trainer:
    import lightning as L

    from gptlab.parallel.hardware import slurm_plugins
    from gptlab.training.callbacks import LogAtGlobalStep, ValidateAtLastStep, instantiate_callbacks
    from gptlab.training.checkpointing import fault_tolerance_callbacks
    from gptlab.training.downstream_eval import downstream_callbacks
    from gptlab.training.resume_changes import (
        CarryBatchCount,
        RecordTrainingConditions,
        training_data_identity,
    )

    callbacks = instantiate_callbacks(cfg.get("callbacks") or {}) + downstream_callbacks(
        settings.downstream_eval, settings.block_size
    )
    # what a resume compares with its command (gptlab.training.resume_changes), in every checkpoint
    conditions = RecordTrainingConditions(
        training_data_identity(parts.corpus), parts.datamodule.stride, settings.run.seed
    )
    return L.Trainer(
        **settings.trainer,
        strategy=parts.strategy,
        logger=loggers or False,
        callbacks=callbacks
        + fault_tolerance_callbacks()
        + [ValidateAtLastStep(), LogAtGlobalStep(), conditions, CarryBatchCount()],
        plugins=[*slurm_plugins(), *settings.strategy.plugins()] or None,
    )


def model_summary(module: GPTLitModule, trainer: L.Trainer | None, settings: GPTRunConfig | None) -> str:
    """The short model card (gptlab.planning): parameters, FLOPs per token, memory per device, and a
    warning when the run will not fit its device."""
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

    from gptlab import planning

    precision = str(trainer.precision) if trainer else "32-true"
    on_cpu = trainer is None or isinstance(trainer.accelerator, CPUAccelerator)
    on_cuda = trainer is not None and isinstance(trainer.accelerator, CUDAAccelerator)
    device_type = "cpu" if on_cpu else "cuda" if on_cuda else "mps"
    plan = planning.TrainingPlan(
        strategy=settings.strategy_node if settings else "auto",
        n_devices=trainer.world_size if trainer else 1,
        precision=precision,
        micro_batch=settings.loader.batch_size if settings else 1,
        context=settings.loader.block_size if settings else None,
        activation_checkpointing=settings.parallel.activation_checkpointing if settings else False,
        head=planning.HeadPlan.of(module.head_loss, device_type, precision),
    )
    summary = planning.startup_card(module.model_config, plan, on_cpu=on_cpu, loss=module.head_loss)
    module.announced_loss_impl = (
        plan.head.impl
    )  # the card's memory line says it: the module says it only if other
    if settings and settings.loader.document_mask:
        summary += f"\n{DOCUMENT_MASK_LINE}"
    return summary


DOCUMENT_MASK_LINE = (
    "Documents: masked (data.document_mask=true): attention stays inside each document of a window, "
    "positions restart at each end-of-text token, which starts the document after it"
)


# ---- fit ----------------------------------------------------------------------------------------------
def fit(
    trainer: L.Trainer, parts: Parts, resume: ResumePlan | None, max_steps: int
) -> tuple[SignalStop | None, int]:
    """Train to ``max_steps`` (continuing ``resume``); a run already there (whose ``result.json`` is missing:
    it was killed after its last save) is only validated, its curves untouched. Returns how a stop signal
    ended training early (None when it did not), and the run's last step."""
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
        return None, resume.global_step
    from gptlab.errors import RankLostError
    from gptlab.parallel import ranks

    try:
        stop = fit_with_signals(trainer, parts.module, parts.datamodule, resume.ckpt_path if resume else None)
    except Exception as e:
        lost = ranks.lost_during(e) or ranks.spawned_rank_lost(e, trainer.world_size)
        if lost is not None:
            raise RankLostError(lost_rank_message(trainer, lost)) from e
        if trainer.world_size > 1 and ranks.timed_out(e):
            raise RankLostError(timeout_message(trainer, e)) from e
        if trainer.world_size > 1 and ranks.external_launcher() is not None and ranks.peer_lost(e):
            raise RankLostError(unwatched_rank_lost_message(trainer, e)) from e
        raise
    finally:  # also for a SystemExit (Lightning's, after a KeyboardInterrupt): this thread reports from here
        ranks.training_over()
    if stop is not None and trainer.is_global_zero:
        log.warning("%s", stop_line(stop, trainer.global_step))
    return stop, trainer.global_step


def watch_lost_ranks(
    session: RunSession, trainer: L.Trainer, step: Callable[[], int], metrics: Callable[[], dict[str, float]]
) -> None:
    """What a watcher of the ranks (:mod:`gptlab.parallel.ranks`) says and records about a lost rank where
    this process's main thread waits on in a collective and cannot."""
    from gptlab.parallel import ranks
    from gptlab.runs.identity import release_run_dir

    def record(error: Exception) -> None:  # what closing() does for a run that raised
        session.write_failure(error, step, metrics)
        release_run_dir(session.run_dir)

    def stand_in() -> None:  # rank 0 is lost: the lowest rank left beside it writes result.json
        session.is_global_zero = True

    ranks.set_reporter(lambda lost: lost_rank_message(trainer, lost), record, stand_in)


def lost_rank_message(trainer: L.Trainer, lost: LostRank) -> str:
    """A lost rank, by name and how it ended; the step reached; the last checkpoint written whole (or none);
    and the command that continues the run."""
    who = "the run" if trainer.is_global_zero else f"rank {trainer.global_rank}"
    # ddp_spawn's launching process trains no step itself: its trainer's step stays 0
    at = f" at step {trainer.global_step}" if trainer.global_step else ""
    return (
        f"{lost.summary()}{at}: {who} cannot go on without it, and stopped.{lost.hint()} "
        f"{continue_line(trainer)}"
    )


def unwatched_rank_lost_message(trainer: L.Trainer, error: Exception) -> str:
    """A collective whose connection to a rank this process does not watch broke (a rank on another node,
    under torchrun or SLURM): which ranks are alive here, the last checkpoint and the command that continues
    the run."""
    from gptlab.parallel import ranks

    launcher = ranks.external_launcher()
    name = launcher.name if launcher is not None else "the launcher"
    alive = ", ".join(str(r) for r in ranks.ranks_alive_here()) or str(trainer.global_rank)
    # gloo's words without its source location and advice: "Connection closed by peer [10.0.0.2]:4242"
    said = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip()).split(". ")[0].splitlines()[:1]
    return (
        f"A rank of the run on another node is lost at step {trainer.global_step}: rank "
        f"{trainer.global_rank} of {trainer.world_size}'s collective with it failed ({type(error).__name__}: "
        f"{''.join(said)[:200]}). The ranks on this node ({alive}) are alive; {name} on the node that lost one "
        f"names it and says how it ended. The run cannot go on without it, and stopped. {continue_line(trainer)}"
    )


def timeout_message(trainer: L.Trainer, error: Exception) -> str:
    """A collective that waited out ``strategy.timeout_s``: the ranks that are stuck where this process can
    see them, the last checkpoint and the command that continues the run."""
    from gptlab.parallel.ranks import stuck_ranks, who_ends_the_others

    timeout = getattr(trainer.strategy, "_timeout", None)
    seconds = f"={timeout.total_seconds():g}" if timeout is not None else ""
    stuck = stuck_ranks()  # those this process started or watches beside it
    why = (
        "; ".join(stuck)
        if stuck
        else "a rank is alive but not answering (stuck in its own code: a data loader, a file system), or one "
        "on another node is unreachable"
    )
    return (
        f"Rank {trainer.global_rank} of {trainer.world_size} waited strategy.timeout_s{seconds} s in a "
        f"collective for the other ranks at step {trainer.global_step}, in vain ({type(error).__name__}: "
        f"{error}): {why}. The run stopped, and {who_ends_the_others()}. {continue_line(trainer)} "
        "(Where a rank legitimately takes longer, e.g. writing a large checkpoint to a slow disk, raise "
        "strategy.timeout_s.)"
    )


def last_intact_checkpoint(trainer: L.Trainer) -> tuple[Path | None, int | None]:
    """The last checkpoint written whole and its step, or (None, None)."""
    from gptlab.runs import digests
    from gptlab.training.checkpointing import last_checkpoint_callback

    last = last_checkpoint_callback(trainer)
    path, step = last.saved() if last is not None else (None, None)
    # written by ranks spawned from this process, or by the part before a run that only validated
    if path is None and last is not None and last.dirpath:
        on_disk = Path(last.dirpath) / LAST_CHECKPOINT
        verdict = digests.check(on_disk) if on_disk.exists() else None
        if verdict is not None and verdict.verified:
            path, step = on_disk, verdict.step
    return path, step


def continue_line(trainer: L.Trainer) -> str:
    """The last checkpoint written whole (or that there is none) and the command that continues the run."""
    from gptlab.parallel.ranks import continue_command

    path, step = last_intact_checkpoint(trainer)
    if path is not None:
        kept = f"The last intact checkpoint is {path} (step {step}); continue from it with"
    else:
        kept = "No checkpoint was written before it; start the run again with"
    return f"{kept}: {continue_command()}"


def stop_line(stop: SignalStop, step: int) -> str:
    """What a stop signal did, and how to continue."""
    again = "resume with the same command and resume=auto"
    if not stop.quit_at_once:
        return f"Stopped by {stop.signal} at step {step}: {stop.checkpoint} holds it; {again}."
    if stop.checkpoint is None:
        return f"Quit by a second Ctrl-C at step {step}, without saving: no checkpoint was written to continue from."
    return (
        f"Quit by a second Ctrl-C at step {step}, without saving it: {stop.checkpoint} holds step "
        f"{stop.checkpoint_step}; {again} (it continues from step {stop.checkpoint_step})."
    )


def collect_metrics(trainer: L.Trainer, parts: Parts, wall_seconds: float) -> dict[str, float]:
    from gptlab.training.metrics import run_rates

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1 and k != "step"}
    metrics["unigram_entropy"] = parts.corpus.unigram_entropy
    if parts.module.val_tokens is not None:  # the targets the final validation scored (validation_coverage)
        metrics["val/tokens"] = float(parts.module.val_tokens)
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
    stop: SignalStop | None,
    signals: StopSignals,
) -> None:
    """The W&B summary, the closing lines, the length study (``eval_length.enabled``) and ``result.json``.
    A stop signal during the study (caught by ``signals``) ends it at once: ``result.json`` keeps training's
    figures and the study's finished ones, and names the part stopped and the figures missing."""
    from gptlab.errors import signal_name
    from gptlab.tracking.loggers import update_wandb_summary

    entropy = parts.corpus.unigram_entropy
    update_wandb_summary(
        loggers,
        {
            "unigram_entropy": entropy,
            **{
                f"parameters/{k}": v
                for k, v in parts.module.model.parameter_counts().items()
                if k in ("total", "active")  # active: those a token goes through (mlp=moe's top_k experts)
            },
            # the final validation, also when a finished run is resumed and logs nothing
            **{k: metrics[k] for k in ("val/loss", "val/ppl", "val/bpb") if k in metrics},
        },
    )
    coverage = validation_coverage(
        metrics.get("val/tokens"), parts.module.val_windows, parts.datamodule, trainer.limit_val_batches
    )
    lines = closing_lines(
        metrics, entropy, session.run_dir, trainer, loggers, step, session.start_step, coverage
    )
    lines.insert(0, overrides_line(settings.run.seed))
    if stop is None:  # a stopped run's own lines say how to continue it
        lines += next_steps_lines(session.run_dir, finished=step >= settings.trainer["max_steps"] > 0)
    print("\n".join(lines), flush=True)
    study_stop: StudyStopped | None = None
    if settings.length_study is not None:
        if stop is not None:  # the weights are half-trained and the time before the machine goes is short
            log.info(
                "Stopped by a signal: the length study (eval_length) is skipped; it runs when the resumed run "
                "finishes."
            )
        else:
            from gptlab.evaluation.length import StudyStopped, after_training, summary_metrics
            from gptlab.parallel.transforms import uncompiled_blocks

            try:
                # compile=true: the studies' many lengths, KV caches and decoding steps would each compile
                # every block anew, up to torch's limit; they run the plain blocks (FlexAttention compiled)
                with uncompiled_blocks(parts.module.model):
                    result = after_training(
                        parts.module.model,
                        parts.corpus,
                        parts.datamodule.block_size,
                        settings.length_study,
                        settings.passkey,
                        session.run_dir,
                        loggers,
                        signals.interrupting,
                    )
                metrics.update(summary_metrics(result))
            except StudyStopped as e:
                study_stop = e
                metrics.update(summary_metrics(e.result))
                # not measured on these weights: NaN in the metrics returned, null (missing) in result.json
                # below, and named in eval_length_missing (an earlier part's figures, of other weights, are
                # not carried over)
                metrics.update(dict.fromkeys(e.missing, math.nan))
    max_steps = settings.trainer["max_steps"]
    extra: dict[str, Any] = {}
    checkpoint: Path | None = None
    if stop is not None:
        extra = {
            "stop_signal": stop.signal,
            "checkpoint_step": stop.checkpoint_step,
            "stopped_during": "training",
        }
    elif study_stop is not None:
        checkpoint, checkpoint_step = last_intact_checkpoint(trainer)
        extra = {
            "stop_signal": signal_name(study_stop.signum),
            "checkpoint_step": checkpoint_step,
            "stopped_during": study_stop.during,
            "eval_length_missing": study_stop.missing,
        }
    uniform = math.log(parts.corpus.tokenizer.vocab_size)
    divergence = divergence_of(metrics.get("val/loss"), entropy, uniform)
    recorded: dict[str, float | None] = dict(metrics)
    if study_stop is not None:
        recorded.update(dict.fromkeys(study_stop.missing))  # null: missing (gptlab.runs.jsonfile)
    session.write_result(
        recorded,
        step,
        # a study stopped is not finished: resume=auto runs it (finished_result)
        finished=step >= max_steps > 0 and study_stop is None,
        stopped=stop is not None or study_stop is not None,
        extra={
            **extra,
            **divergence,
            **({COVERAGE_KEY: coverage} if coverage else {}),
            RESOLVED_KEY: resolved_settings(settings, parts),
        },
    )
    if divergence.get("diverged"):
        log.warning(diverged_line(metrics["val/loss"], entropy, uniform))
    if study_stop is not None:
        log.warning(study_stopped_line(study_stop, step, checkpoint, session.run_dir, settings))


def study_stopped_line(
    stop: StudyStopped, step: int, checkpoint: Path | None, run_dir: Path, settings: GPTRunConfig
) -> str:
    """What a run stopped during the length study says: the part stopped, what was kept, what is missing and
    how to get it (in a sweep, the command that continues the sweep follows)."""
    from gptlab.errors import signal_name
    from gptlab.evaluation.length import PASSKEY_PART, rerun_command
    from gptlab.runs.layout import EVAL_LENGTH_DIR, LENGTH_FILE

    options = settings.length_study
    assert options is not None  # the study ran
    part = "the passkey study" if stop.during == PASSKEY_PART else "the length study"
    kept = (
        f"the trained model is kept ({checkpoint})"
        if checkpoint is not None
        else "no checkpoint was written (callbacks.last_checkpoint is off): the trained model is lost"
    )
    if stop.during == PASSKEY_PART:
        kept += (
            f", and the length study's figures ({run_dir / EVAL_LENGTH_DIR / LENGTH_FILE} and result.json)"
        )
    missing = "figure is" if len(stop.missing) == 1 else "figures are"
    line = (
        f"Stopped by {signal_name(stop.signum)} during {part} ({stop.during}), after training to step {step}: "
        f"{kept}; result.json records the run as stopped, and which {len(stop.missing)} of the study's "
        f"{missing} missing (eval_length_missing)."
    )
    if checkpoint is None:
        return line
    rerun = (
        "continue the sweep with the command below"
        if is_multirun()
        else f"rerun the same command with resume=auto or resume={run_dir}"
    )
    return (
        f"{line} Get them with: {rerun_command(run_dir, options, settings.passkey)} (writes "
        f"{run_dir / EVAL_LENGTH_DIR} and prints the tables; result.json is left as it is), or {rerun} (no step "
        "is trained again: the checkpoint is validated and the whole study run; its figures go into "
        "result.json and the loggers)."
    )


def overrides_line(seed: int) -> str:
    """The first of a run's closing lines: what the command changed from the defaults, and the seed, so that
    the block pasted into a lab notebook says which run its figures are of (the model card, at the top,
    says what they resolved to)."""
    from hydra.core.hydra_config import HydraConfig

    overrides = [str(o) for o in HydraConfig.get().overrides.task] if HydraConfig.initialized() else []
    seeded = any(o.split("=", 1)[0].lstrip("+~") == "seed" for o in overrides)
    said = " ".join(shlex.quote(o) for o in overrides) if overrides else "none, the defaults"
    return f"Overrides: {said}" + ("" if seeded else f" (seed {seed})")


def next_steps_lines(run_dir: Path, finished: bool) -> list[str]:
    """What a run's last lines suggest next: sampling from it, comparing it with the runs beside it, and for
    a finished run training it further. None in a sweep, whose closing lines name the sweep's comparison."""
    if is_multirun():
        return []
    run = shlex.quote(str(run_dir))
    lines = [
        f"Sample from it: python scripts/generate.py {run}; compare it with the runs beside it: "
        f"python scripts/compare.py {shlex.quote(str(run_dir.parent))}"
    ]
    if finished:
        lines.append(f"Train it further: the same command with resume={run} and a larger trainer.max_steps")
    return lines


def validation_line(
    val: float | None,
    entropy: float | None,
    bpb: float | None = None,
    coverage: str = "",
) -> str:
    """The final validation against the validation split's unigram entropy (:attr:`gptlab.data.corpus.
    PreparedCorpus.unigram_entropy`), and in bits per byte when measured; ``coverage``: over which tokens
    (:func:`validation_coverage`)."""
    if val is None:
        return "No validation (it is off: trainer.limit_val_batches=0)"
    line = f"Final validation loss {val:.4f} nats (perplexity {_perplexity(val)})"
    if bpb is not None:
        line += f", {bpb:.4f} bits per byte"
    if entropy is not None:
        line += (
            f"; unigram entropy of the validation split {entropy:.4f} nats ({abs(entropy - val):.3f} "
            f"{'below' if val < entropy else 'above'} it)"
        )
    return f"{line}. {coverage}" if coverage else line


def validation_coverage(
    scored: float | None, scored_windows: int | None, datamodule: Any, limit_val_batches: Any = None
) -> str:
    """The sentence that follows the final validation: which of the validation split's tokens it scored
    (``scored`` targets in ``scored_windows`` windows, both counted by the validation itself), and which it
    left out and why: the first token (nothing precedes it), the tail shorter than a window, the windows that
    ``trainer.limit_val_batches`` cut, the tokens a ``data.val_stride`` above the block size skips; with a
    smaller stride the windows overlap and a token is scored more than once. Empty without the counts.

    The windows are counted, not inferred as ``scored // block_size``: that holds only while every scored
    window scores all its targets, and a window whose targets are partly ignored would read as windows cut."""
    windows_set = getattr(datamodule, "val_set", None)
    if scored is None or scored_windows is None or windows_set is None or len(windows_set) == 0:
        return ""
    n_tokens, windows = int(windows_set.n_tokens), len(windows_set)
    block, stride = int(windows_set.block_size), int(windows_set.stride)
    left_out = ["the first (nothing precedes it)"]
    if stride > block:
        left_out.append(f"{stride - block:,} after each window (data.val_stride={stride})")
    tail = n_tokens - 1 - ((windows - 1) * stride + block)
    if tail > 0:
        left_out.append(f"the last {tail:,} (short of a window)")
    leaving = ", ".join(left_out[:-1]) + (" and " if len(left_out) > 1 else "") + left_out[-1]
    if scored_windows < windows:
        cut = windows - scored_windows
        leaving += f", and {cut:,} of the {windows:,} windows (trainer.limit_val_batches={limit_val_batches})"
    if (ignored := scored_windows * block - int(scored)) > 0:
        leaving += f", and {ignored:,} targets inside the windows scored, which the loss ignores"
    if stride < block:
        return (
            f"It scored {int(scored):,} predictions in the {n_tokens:,} validation tokens: the windows overlap "
            f"(data.val_stride={stride} < model.block_size={block}), a token is scored up to "
            f"{math.ceil(block / stride)} times; left out: {leaving}"
        )
    return f"It scored {int(scored):,} of the {n_tokens:,} validation tokens, leaving out {leaving}"


def diverged_line(val: float, entropy: float, uniform: float) -> str:
    """The warning that ends a diverged run's log: the numbers that say so, and the usual fix."""
    from gptlab.comparison.records import DIVERGENCE_MARGIN

    why = (
        f", {val:.4g} nats, is above the validation split's unigram entropy, {entropy:.4f} nats (the best that predicting each "
        f"token by its frequency alone reaches), and more than {DIVERGENCE_MARGIN:g} nat above the loss of a uniform "
        f"guess, {uniform:.4f} nats (where training starts)"
        if math.isfinite(val)
        else f" is {val}"
    )
    return (
        f"The run diverged: its final validation loss{why}: its figures are no result. result.json says "
        "diverged: true and scripts/compare.py marks it. Lower the learning rate (optim.lr) or lengthen the "
        "warm-up (optim.warmup_steps)."
    )


def divergence_of(val_loss: float | None, entropy: float, uniform: float) -> dict[str, Any]:
    """result.json's ``diverged`` (:func:`gptlab.comparison.records.is_diverged`) and, when it did, the
    numbers that say so; nothing without a validation."""
    from gptlab.comparison.records import is_diverged

    if val_loss is None:
        return {}
    if not is_diverged(val_loss, entropy, uniform):
        return {"diverged": False}
    shown = val_loss if math.isfinite(val_loss) else str(val_loss)  # JSON has no inf: "inf", as in metrics
    numbers = {"val/loss": shown, "unigram_entropy": entropy, "uniform_loss": uniform}
    return {"diverged": True, "divergence": numbers}


def _perplexity(loss: float) -> str:
    """exp(loss) as the comparison prints perplexities (:func:`~gptlab.evaluation.long_context.
    format_perplexity`): inf where exp overflows, nan for a NaN loss."""
    from gptlab.evaluation.long_context import format_perplexity, perplexity

    return format_perplexity(perplexity(loss))


def closing_lines(
    metrics: dict[str, float],
    entropy: float,
    run_dir: Path,
    trainer: L.Trainer,
    loggers: list,
    step: int,
    start_step: int = 0,
    coverage: str = "",
) -> list[str]:
    """The final validation against the validation split's unigram entropy, the rates, and where everything is. A
    resumed run names the steps this part trained (``start_step`` to ``step``) and this part's time."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from gptlab.tracking.loggers import logger_lines
    from gptlab.training.metrics import after_first_step

    first = after_first_step(trainer)
    rates = (
        f": {metrics['tokens_per_second_wall']:,.0f} tokens/s of wall time (start-up, data, validation and "
        f"checkpoints included); training rate {metrics['tokens_per_second_training']:,.0f} tokens/s "
        + (
            f"(validation excluded; {first[1]:,.0f} after the first step, which took {first[0]:.1f} s)"
            if first is not None
            else "(validation excluded)"
        )
        if "tokens_per_second_wall" in metrics
        else ""
    )
    seconds = metrics["wall_seconds"]
    if start_step == 0:
        trained = f"Trained {step} steps in {seconds:.0f} s{rates}"
    elif step > start_step:
        trained = (
            f"Trained {step} steps; this part, resumed at step {start_step}, trained {step - start_step} in "
            f"{seconds:.0f} s{rates}"
        )
    else:
        trained = f"Nothing left to train at step {step}: validated the checkpoint in {seconds:.0f} s"
    lines = [
        validation_line(metrics.get("val/loss"), entropy, metrics.get("val/bpb"), coverage),
        trained,
        f"Outputs: {run_dir}",
    ]
    ckpt = trainer.checkpoint_callback
    if isinstance(ckpt, ModelCheckpoint) and ckpt.dirpath:
        lines.append(
            f"  checkpoints: {ckpt.dirpath} ({LAST_CHECKPOINT}, best by val/loss: {Path(ckpt.best_model_path).name})"
        )
    return lines + logger_lines(loggers)
