"""What every task does around its own work, in one place: the run directory claimed for this run and
``run.json`` written, the seed set, the loggers opened (a resumed run continues its W&B run), the resolved
config saved, ``result.json`` written (also when the task raises), and the W&B run closed.

    session = RunSession.start(cfg, settings)
    loggers = session.open_loggers(wandb_run_id=None)
    with session.closing(loggers):
        ...                      # the task's own work
        session.save_config(loggers)
        session.write_result(metrics, step=..., finished=..., stopped=...)
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from gptlab.config import RunSettings
from gptlab.resume import check_writable
from gptlab.runs.layout import Run, git_commit, read_run_info

log = logging.getLogger("gptlab")


def run_dir_of(cfg: DictConfig) -> Path:
    """The run directory: Hydra's output directory for this job, else ``paths.output_dir``."""
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.paths.get("output_dir") or "outputs/runs/interactive")


def record_run_dir(cfg: DictConfig) -> Path:
    """The run directory, recorded as ``paths.output_dir`` before any node that interpolates it (the
    trainer's ``default_root_dir``, the loggers' ``save_dir``) is read. A task calls it first."""
    run_dir = run_dir_of(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)
    return run_dir


def route_lightning_logs() -> None:
    """Lightning prints through its own console handler; Hydra already logs the root logger to the console
    and to the run's log file. Keep one copy of each line, in both places."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True


class RunSession:
    """One task's run: its directory, its loggers and its result."""

    def __init__(self, cfg: DictConfig, settings: RunSettings, run_dir: Path) -> None:
        from gptlab.runs.identity import launched_rank

        self.cfg, self.settings, self.run_dir = cfg, settings, run_dir
        self.is_global_zero = not launched_rank()  # a task on many ranks sets it from its trainer
        self.loggers: list = []  # open_loggers' loggers

    @classmethod
    def start(
        cls, cfg: DictConfig, settings: RunSettings, seed: Callable[[int], Any] | None = None
    ) -> RunSession:
        """The run directory (``record_run_dir``) checked writable and claimed for this run alone (a
        directory holding another run is refused, or moved aside with ``overwrite=true``; ``run.json`` names
        the run and this part of it); the seed set everywhere (by ``seed``, e.g. Lightning's
        seed_everything, which also seeds loader workers; by default Python's, NumPy's and torch's
        generators)."""
        from gptlab.runs.identity import claim_run_dir, continues_a_run, launched_rank, record_start

        run_dir = record_run_dir(cfg)
        check_writable(run_dir)
        if (run_dir / "checkpoints").is_dir():  # a kill mid-swap of a sharded checkpoint: swapped back first
            from gptlab.parallel.checkpoint_io import restore_interrupted_saves

            restore_interrupted_saves(run_dir / "checkpoints")
        if not launched_rank():
            continued = continues_a_run(settings.resume, run_dir)
            if not continued:
                # Inside a Hydra job .hydra/ is this run's own: Hydra wrote it after CheckRunDirectory had checked.
                claim_run_dir(
                    run_dir,
                    settings.resume,
                    settings.overwrite,
                    include_hydra=not HydraConfig.initialized(),
                    log=log,
                )
            overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
            record_start(run_dir, continued, [str(o) for o in overrides], settings.task)
        (seed or seed_generators)(settings.seed)
        return cls(cfg, settings, run_dir)

    def open_loggers(self, wandb_run_id: str | None = None) -> list:
        """The configured loggers (``logger`` node); with ``wandb_run_id`` the W&B logger continues that run.
        No logger configured: nothing imported (the loggers are Lightning's classes)."""
        nodes = self.cfg.get("logger") or {}
        if not any(node is not None and "_target_" in node for node in nodes.values()):
            return []
        from gptlab.tracking.loggers import instantiate_loggers

        self.loggers = instantiate_loggers(nodes, wandb_run_id)
        return self.loggers

    def wandb_run_id(self) -> str | None:
        """The id of this run's W&B run; None when it logs to none."""
        if not self.loggers:
            return None
        from gptlab.tracking.loggers import wandb_run_id

        return wandb_run_id(self.loggers)

    def save_config(self, loggers: list) -> None:
        """The resolved config into every logger and into ``<run dir>/config_resolved.yaml``."""
        resolved = OmegaConf.to_container(self.cfg, resolve=True)
        for lg in loggers:
            lg.log_hyperparams(resolved)
        if self.is_global_zero:
            OmegaConf.save(self.cfg, self.run_dir / "config_resolved.yaml", resolve=True)

    def write_result(
        self,
        metrics: dict[str, float],
        step: int,
        finished: bool,
        stopped: bool,
        failed: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """``<run dir>/result.json``: what the run reported, its last step, whether it finished (or why not),
        which run it is (``run.json``'s id, and its W&B run's) and the commit it ran at; ``extra``: the task's
        own keys (``diverged``). JSON has no inf or nan: a non-finite metric is written as the string
        ``"inf"``, ``"-inf"`` or ``"nan"`` (``float()`` reads it back), never left out."""
        if not self.is_global_zero:
            return
        info = read_run_info(self.run_dir)
        Run(self.run_dir).write_result(
            {
                "metrics": {k: v if math.isfinite(v) else str(v) for k, v in metrics.items()},
                "global_step": step,
                "finished": failed is None and finished,
                "stopped_by_signal": bool(stopped),
                **({"failed": failed} if failed is not None else {}),
                "run_id": info.run_id if info else None,
                "wandb_run_id": self.wandb_run_id(),
                "git_commit": git_commit(),
                **(extra or {}),
            }
        )

    @contextmanager
    def closing(self, loggers: list, step: Any = None) -> Iterator[None]:
        """Around the task's work: a raised error is written to ``result.json`` (the comparison lists the run
        as failed, not killed) at ``step()``'s step, and the W&B run is closed either way."""
        failed = True
        try:
            yield
            failed = False
        except Exception as e:
            self.write_result({}, int(step()) if step else 0, False, False, repr(e)[:300])
            raise
        finally:
            if loggers:
                from gptlab.tracking.loggers import finish_wandb

                finish_wandb(loggers, failed)


def seed_generators(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
