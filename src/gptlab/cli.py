"""The command-line task behind `python train.py`: clear errors for bad input, the metric a sweeper reads."""

from __future__ import annotations

import sys

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from gptlab.errors import ConfigError, DataError, DiskFullError, NonFiniteLossError


def run_task(cfg: DictConfig) -> float | None:
    from gptlab.tasks import task_runner

    try:
        metrics = task_runner(cfg)(cfg)
    except (ConfigError, DataError) as e:
        multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
        if multirun:
            raise
        print(f"\ngptlab: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except (NonFiniteLossError, DiskFullError) as e:
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            raise
        print(f"\ngptlab: training failed: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    metric = cfg.get("optimized_metric")
    return metrics.get(metric) if metric else None
