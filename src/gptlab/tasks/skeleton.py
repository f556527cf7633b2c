"""What every task does around its own work, in one place: the run directory claimed for this run and
``run.json`` written, the seed set, the loggers opened (a resumed run continues its W&B run), the resolved
config saved, ``result.json`` written (also when the task raises), and the W&B run closed.

    run_dir = record_run_dir(cfg)   # first: the nodes that interpolate paths.output_dir are read later
    settings = ...                  # the task's typed config
    session = RunSession.start(cfg, settings, run_dir)
    session.start_step = ...     # a resumed run: the step it continues from
    loggers = session.open_loggers(wandb_run_id=None, resumed_at=None)
    with session.closing(loggers, step=..., metrics=...):
        ...                      # the task's own work
        session.save_config(loggers)
        session.write_result(metrics, step=..., finished=..., stopped=...)

``result.json`` describes the whole run, over all its parts (the first start and each resume): the metrics
are the latest value of each (a part that failed keeps the values logged before it failed), except the
figures that describe the weights at the last step alone (:attr:`RunSession.final_state_figures`: word2vec's
scores of its vectors), which an earlier part's result gives only where the run still ends at that part's
step; ``wall_seconds`` is the sum of the parts' wall times, and ``parts`` lists each part's steps, status
and wall time. It is strict JSON (:mod:`gptlab.runs.jsonfile`): a non-finite figure is written as
``"inf"``, ``"-inf"`` or ``"nan"``, a missing one as ``null``.
"""

from __future__ import annotations

import logging
import math
import random
import signal
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from gptlab.config import RunSettings
from gptlab.errors import SweepStopped
from gptlab.runs.identity import release_run_dir
from gptlab.runs.jsonfile import figures_as_json
from gptlab.runs.layout import Run, read_run_info, result_file
from gptlab.runs.resume import check_writable, enter_run
from gptlab.tasks.collector import startup_over

log = logging.getLogger("gptlab")


def run_dir_of(cfg: DictConfig) -> Path:
    """The run directory: Hydra's output directory for this job, else ``paths.output_dir``."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.paths.get("output_dir") or "outputs/runs/interactive")


def record_run_dir(cfg: DictConfig) -> Path:
    """The run directory, recorded as ``paths.output_dir`` before any node that interpolates it (the
    trainer's ``default_root_dir``, the loggers' ``save_dir``) is read. A task calls it first, once, and hands
    the directory to :meth:`RunSession.start`."""
    run_dir = run_dir_of(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)
    return run_dir


class DropLightningTips(logging.Filter):
    """Lightning's advertisement on every Trainer ("Tip: ... try installing litlogger"), and its lines on every
    Trainer of a machine without a TPU ("TPU available: False, using: 0 TPU cores") or a GPU ("GPU available:
    False, used: False"): the model card names the device the run trains on, and no setting turns them off.
    And its line at the end of every run that trained its steps ("`Trainer.fit` stopped: `max_steps=320`
    reached."), just above gptlab's own ("Trained 320 steps in ..."). Its other lines pass: a TPU that is
    there, a GPU that is there, used or not, and a fit that stopped for another reason (``max_time``)."""

    DROPPED = (
        "Tip: For seamless cloud logging",
        "TPU available: False, using: 0 TPU cores",
        "GPU available: False, used: False",
        "`Trainer.fit` stopped: `max_steps=",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(line in message for line in self.DROPPED)


def route_lightning_logs() -> None:
    """Lightning prints through its own console handler; Hydra already logs the root logger to the console
    and to the run's log file. Keep one copy of each line, in both places, without Lightning's litlogger tip,
    without the deprecation warning Lightning's own code draws from torch 2.13 (``LeafSpec``) on every run,
    and without its warning that an epoch has fewer batches than ``trainer.log_every_n_steps``: Lightning
    counts that interval in optimizer steps across epochs (``_batches_that_stepped``), so a short epoch (a
    small corpus, many ranks) still logs every ``log_every_n_steps`` steps, and gptlab trains in steps; and
    without its warning that the checkpoint directory is not empty, which every resume drew: a fresh run is
    refused a used run directory (``overwrite=true`` moves the old run aside), so the checkpoints there are
    the resumed run's own. Each is that one message from that one module, nothing else."""
    import warnings

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True
    tips = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, DropLightningTips) for f in tips.filters):
        tips.addFilter(DropLightningTips())
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    warnings.filterwarnings(
        "ignore",
        message=r"The number of training batches \(\d+\) is smaller than the logging interval",
        module=r"lightning\.pytorch\.loops\.fit_loop",
    )
    warnings.filterwarnings(
        "ignore",
        message=r"Checkpoint directory .* exists and is not empty",
        module=r"lightning\.pytorch\.callbacks\.model_checkpoint",
    )
    quiet_launched_ranks()  # again: importing Lightning set its loggers' level to INFO


#: The precision whose matrix products run in fp32, the one that Lightning's advice to allow TF32 concerns.
FP32_PRODUCTS_PRECISION = "32-true"


class DropMatmulPrecisionAdvice(logging.Filter):
    """Lightning's advice, on a CUDA GPU with tensor cores, to call ``torch.set_float32_matmul_precision``
    ("You are using a CUDA device ... that has Tensor Cores. To properly utilize them, ..."), in a run whose
    matrix products do not run in fp32: under ``bf16-mixed`` / ``16-mixed`` (gptlab's choice on GPUs) autocast
    runs them in bf16/fp16, under the ``*-true`` half and fp64 precisions and Transformer Engine the weights
    are not fp32, so that setting changes none of them. Its other lines pass."""

    ADVICE = (
        "that has Tensor Cores. To properly utilize them, you should set `torch.set_float32_matmul_precision"
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return self.ADVICE not in record.getMessage()


@contextmanager
def matmul_advice_for(precision: Any) -> Iterator[None]:
    """For one run's Trainer, at its resolved ``trainer.precision`` (:func:`gptlab.config.parse_trainer`):
    Lightning's advice on fp32 matrix products (``_check_cuda_matmul_precision``, at the CUDA accelerator's
    setup) dropped unless the run trains in ``32-true``, where it is true: its products run in full fp32
    precision, and no gptlab key sets TF32, so Lightning's line stays. The filter lives only while the run
    does, so the next run of a sweep in this process decides for itself; and Lightning's once-a-process
    cache of its check is cleared at the start, so that a 32-true run after a bf16 one (whose line was
    dropped) still shows it, in its own log file."""
    from lightning.fabric.accelerators import cuda

    # a Lightning without the cached check (another version) has nothing to clear
    clear = getattr(getattr(cuda, "_check_cuda_matmul_precision", None), "cache_clear", None)
    if clear is not None:
        clear()
    if precision == FP32_PRODUCTS_PRECISION:
        yield
        return
    advice = DropMatmulPrecisionAdvice()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addFilter(advice)
    try:
        yield
    finally:
        logger.removeFilter(advice)


def quiet_launched_ranks() -> None:
    """In a process a launcher started for a rank other than 0 (DDP's copies of the command), gptlab's
    information lines (the data prepared, the windows, the run's progress) repeat rank 0's, and Lightning's
    say each rank joined ("Initializing distributed: GLOBAL_RANK: 5, MEMBER: 6/8"), where rank 0's "All
    distributed processes registered. Starting with 8 processes" already says they all did: rank 0 alone
    shows them. Warnings and errors still come from every rank: they may be that rank's own."""
    from gptlab.runs.identity import launched_rank

    if launched_rank():
        for name in ("gptlab", "lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.WARNING)


class RunSession:
    """One task's run: its directory, its loggers and its result."""

    def __init__(self, cfg: DictConfig, settings: RunSettings, run_dir: Path) -> None:
        from gptlab.runs.identity import launched_rank

        self.cfg, self.settings, self.run_dir = cfg, settings, run_dir
        self.is_global_zero = not launched_rank()  # a task on many ranks sets it from its trainer
        self.loggers: list = []  # open_loggers' loggers
        self.start_step = 0  # the step this part of the run starts from (a resumed run's checkpoint step)
        self.resume_from: Path | None = None  # the checkpoint that resume= chose (RunEntry.checkpoint)
        # what this part changed from its checkpoint's settings ({"trainer.max_steps": [300, 600]}): its part
        # of result.json says so
        self.part_changes: dict[str, Any] = {}
        # Prefixes of the metrics that describe the weights at the run's last step alone (word2vec's eval/
        # scores of its vectors): an earlier part's value is carried into result.json only where this part
        # ends at the step that part's result recorded, else it scored other weights and is left out.
        self.final_state_figures: tuple[str, ...] = ()
        # What the task computes on, for the run's environment record (gptlab.runs.environment): the device
        # type (cpu, cuda) and the trainer's precision; None where the task has no such setting.
        self.device_type: str | None = None
        self.precision: str | None = None

    @classmethod
    def start(
        cls, cfg: DictConfig, settings: RunSettings, run_dir: Path, seed: Callable[[int], Any] | None = None
    ) -> RunSession:
        """The run directory (``record_run_dir``, which the task called first) checked writable and claimed
        for this run alone (a
        directory holding another run is refused, or moved aside with ``overwrite=true``; ``run.json`` names
        the run and this part of it); the seed set everywhere (by ``seed``, e.g. Lightning's
        seed_everything, which also seeds loader workers; by default Python's, NumPy's and torch's
        generators)."""
        from gptlab.runs.identity import launched_rank, record_start

        check_writable(run_dir)
        # The run's one entry (Hydra's callback entered first, without choosing a checkpoint). Inside a Hydra
        # job .hydra/ is this run's own: Hydra wrote it after CheckRunDirectory had checked.
        entry = enter_run(
            run_dir,
            settings.resume,
            settings.overwrite,
            include_hydra=not HydraConfig.initialized(),
            log=log,
        )
        if not launched_rank():
            overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
            record_start(run_dir, entry.continued, [str(o) for o in overrides], settings.task)
        (seed or seed_generators)(settings.seed)
        session = cls(cfg, settings, run_dir)
        session.resume_from = entry.checkpoint
        return session

    def open_loggers(
        self, wandb_run_id: str | None = None, resumed_at: int | None = None, lightning: bool = True
    ) -> list:
        """The configured loggers (``logger`` node); with ``wandb_run_id`` the W&B logger continues that run;
        with ``resumed_at`` (the checkpoint's step) the CSV logger drops the rows logged after that step by the
        part that was stopped or killed, which this part logs again. ``lightning=False``: a task whose loop is
        not Lightning's gets gptlab's loggers written without it (:mod:`gptlab.tracking.plain_loggers`), and
        no Lightning is imported. No logger configured: nothing imported."""
        nodes = self.cfg.get("logger") or {}
        if not any(node is not None and "_target_" in node for node in nodes.values()):
            return []
        from gptlab.tracking.plain_loggers import instantiate_loggers

        self.loggers = instantiate_loggers(nodes, wandb_run_id, resumed_at, lightning=lightning)
        return self.loggers

    def wandb_run_id(self) -> str | None:
        """The id of this run's W&B run; None when it logs to none."""
        if not self.loggers:
            return None
        from gptlab.tracking.plain_loggers import wandb_run_id

        return wandb_run_id(self.loggers)

    def environment(self) -> dict[str, Any]:
        """What this run's numbers depend on beyond its config (:func:`gptlab.runs.environment.run_environment`):
        thread counts, device, precision, versions, commit."""
        from gptlab.runs.environment import run_environment

        return run_environment(self.device_type, self.precision)

    def save_config(self, loggers: list) -> None:
        """The resolved config into every logger, with the run's environment beside it (a W&B run's config
        holds it for a comparison through the W&B API), and into ``<run dir>/config_resolved.yaml``."""
        from gptlab.runs.environment import ENVIRONMENT_KEY

        resolved = OmegaConf.to_container(self.cfg, resolve=True)
        if loggers:
            logged = {**resolved, ENVIRONMENT_KEY: self.environment()}  # type: ignore[dict-item]
            for lg in loggers:
                lg.log_hyperparams(logged)
        if self.is_global_zero:
            OmegaConf.save(self.cfg, self.run_dir / "config_resolved.yaml", resolve=True)
        startup_over()  # the task's loop comes next: nothing more is frozen (gptlab.tasks.collector)

    def write_result(
        self,
        metrics: Mapping[str, float | None],
        step: int,
        finished: bool,
        stopped: bool,
        failed: str | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """``<run dir>/result.json``: what the run reported, its last step, whether it finished (or why not),
        which run it is (``run.json``'s id, and its W&B run's), the commit it ran at, the environment it ran
        in (``environment``: :mod:`gptlab.runs.environment`), and ``extra`` (the
        task's own keys, e.g. ``diverged``, or the names of the figures it could not measure). A resumed
        run's result is merged with the earlier parts' (module doc). Strict JSON
        (:mod:`gptlab.runs.jsonfile`): a non-finite metric is written as the string ``"inf"``, ``"-inf"`` or
        ``"nan"`` (``float()`` reads it back), never left out; a metric given as None (not measured) as
        ``null``, which ``extra`` names with its reason."""
        if not self.is_global_zero:
            return
        info = read_run_info(self.run_dir)
        run_id = info.run_id if info else None
        finite = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}
        status = (
            "failed" if failed is not None else "stopped" if stopped else "finished" if finished else "ended"
        )
        part: dict[str, Any] = {"from_step": self.start_step, "to_step": step, "status": status}
        part.update({k: finite[k] for k in PART_FIGURES if k in finite})
        if self.part_changes:
            part["changed"] = {k: list(v) for k, v in self.part_changes.items()}
        earlier = Run(self.run_dir).result()
        if earlier is None or run_id is None or earlier.get("run_id") != run_id:
            earlier = None  # the first part, or a directory's result from before run ids: not merged
        latest = {k: None if v is None else float(v) for k, v in metrics.items()}
        environment = self.environment()
        if moved := environment_changes((earlier or {}).get("environment"), environment):
            part["environment_changed"] = moved  # this part ran elsewhere than the part before it
        Run(self.run_dir).write_result(
            {
                "metrics": figures_as_json(
                    merged_metrics(
                        without_other_weights(earlier, step, self.final_state_figures), latest, part
                    )
                ),
                "parts": [*earlier_parts(earlier), part],
                "global_step": step,
                "finished": failed is None and finished,
                "stopped_by_signal": bool(stopped),
                **({"failed": failed} if failed is not None else {}),
                "run_id": run_id,
                "wandb_run_id": self.wandb_run_id(),
                "git_commit": environment["commit"],
                "environment": environment,
                **(extra or {}),
            }
        )

    @contextmanager
    def closing(
        self,
        loggers: list,
        step: Callable[[], int] | None = None,
        metrics: Callable[[], Mapping[str, float]] | None = None,
    ) -> Iterator[None]:
        """Around the task's work: a raised error is written to ``result.json`` (the comparison lists the run
        as failed, not killed) at ``step()``'s step, with ``metrics()`` (the values logged so far), and the
        W&B run is closed either way (what a plain logger holds is written)."""
        failed = True
        try:
            yield
            failed = False
        except Exception as e:
            self.write_failure(e, step, metrics)
            raise
        finally:
            if loggers:
                from gptlab.tracking.plain_loggers import finish_loggers

                finish_loggers(loggers, failed)
            release_run_dir(self.run_dir)

    def write_failure(
        self,
        error: Exception,
        step: Callable[[], int] | None,
        metrics: Callable[[], Mapping[str, float]] | None,
    ) -> None:
        """``result.json`` for a run that raised ``error`` (or, for a lost rank, whose watcher reports it where
        the main thread waits on: :mod:`gptlab.parallel.ranks`); nothing here may hide that error."""
        from gptlab.errors import DiskFullError, RankLostError

        # gptlab's own messages whole (they name the fix); anything else as its repr, cut short
        whole = isinstance(error, (DiskFullError, RankLostError))
        reason = f"{type(error).__name__}: {error}" if whole else repr(error)[:300]
        try:
            known = dict(metrics()) if metrics else {}
        except Exception as e:  # the state the metrics come from may be what broke
            log.warning("The metrics logged before the failure could not be collected: %r", e)
            known = {}
        try:
            self.write_result(known, int(step()) if step else 0, False, False, reason)
        except (OSError, ValueError) as e:
            # a full disk may refuse result.json too, or a NaN outside the metrics (strict JSON): neither may
            # hide the error the run failed with
            log.warning("%s could not be written: %s", result_file(self.run_dir), e)


# A part's own figures, kept per part in result.json (wall time and rates); the run's are combined from them.
PART_FIGURES = ("wall_seconds", "tokens_per_second_wall", "tokens_per_second_training")


def end_sweep_if_signalled(signum: int | None, run_dir: Path) -> None:
    """After a job that the stop signal ``signum`` ended (its checkpoint and ``result.json`` written): when
    the job is one of a sweep run in this process, the sweep stops here (:class:`~gptlab.errors.SweepStopped`)
    instead of starting its next job. Ctrl-C stops any sweep (the terminal sends it to every process of the
    command); where each job has a process of its own (SLURM, joblib), another signal was that job's alone."""
    from gptlab.runs.naming import is_multirun, is_sweep_in_this_process

    if signum is None or not is_multirun():
        return
    if signum == signal.SIGINT or is_sweep_in_this_process():
        raise SweepStopped(signum, run_dir)


def environment_changes(before: Any, now: Mapping[str, Any]) -> dict[str, list[Any]]:
    """The fields of a run's environment record that this part changed, ``{field: [before, now]}`` (a
    resumed run continued with another thread count, torch, device...); empty for a first part, or where the
    earlier part recorded none."""
    if not isinstance(before, Mapping):
        return {}
    return {k: [before.get(k), v] for k, v in now.items() if k in before and before.get(k) != v}


def earlier_parts(earlier: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The parts an earlier ``result.json`` of the same run describes (one part for a result written before
    parts were recorded)."""
    if earlier is None:
        return []
    parts = earlier.get("parts")
    if isinstance(parts, list):
        return [dict(p) for p in parts if isinstance(p, dict)]
    old = earlier.get("metrics") or {}
    return [{"to_step": earlier.get("global_step"), **{k: old[k] for k in PART_FIGURES if k in old}}]


def without_other_weights(
    earlier: Mapping[str, Any] | None, step: int, final_state_figures: tuple[str, ...]
) -> Mapping[str, Any] | None:
    """An earlier ``result.json`` less the figures under ``final_state_figures`` (prefixes) that describe
    other weights than the ones at ``step``: all of them unless that result recorded this very step (a part
    that trained no step since, and no part killed between), and a missing one (``null``) in any case: its
    reason belonged to that part's record."""
    if earlier is None or not final_state_figures:
        return earlier
    same_weights = earlier.get("global_step") == step
    metrics = {
        k: v
        for k, v in (earlier.get("metrics") or {}).items()
        if not k.startswith(final_state_figures) or (same_weights and v is not None)
    }
    return {**earlier, "metrics": metrics}


def merged_metrics(
    earlier: Mapping[str, Any] | None, latest: Mapping[str, float | None], part: Mapping[str, Any]
) -> dict[str, Any]:
    """The run's metrics over its parts: the latest value of each, ``wall_seconds`` summed over the parts,
    and the rates over the whole run (the tokens of all parts over their summed wall / training time)."""
    merged = {**dict((earlier or {}).get("metrics") or {}), **latest}
    parts = [*earlier_parts(earlier), dict(part)]
    walls = [p.get("wall_seconds") for p in parts]
    if len(parts) > 1 and all(isinstance(w, (int, float)) for w in walls):
        total = float(sum(walls))  # type: ignore[arg-type]
        merged["wall_seconds"] = total
        rates = [
            (p.get("tokens_per_second_wall"), p.get("tokens_per_second_training"), p["wall_seconds"])
            for p in parts
        ]
        if total > 0 and all(
            isinstance(w, (int, float)) and isinstance(t, (int, float)) and t > 0 for w, t, _ in rates
        ):
            tokens = [w * seconds for w, _, seconds in rates]
            merged["tokens_per_second_wall"] = sum(tokens) / total
            merged["tokens_per_second_training"] = sum(tokens) / sum(
                n / t for n, (_, t, _) in zip(tokens, rates)
            )
    return merged


def seed_generators(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
