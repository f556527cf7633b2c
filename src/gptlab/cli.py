"""The command-line task behind `python train.py`: clear errors for bad input, the metric a sweeper reads."""

from __future__ import annotations

import sys

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from gptlab.errors import ConfigError, DataError, NonFiniteLossError


def group_choices(group: str) -> str:
    """The choices of a config group on Hydra's search path (e.g. ``hydra/launcher``), comma-separated: the
    help page lists Hydra's own groups through it, read when the page is shown."""
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        return ""
    return ", ".join(sorted(GlobalHydra.instance().config_loader().get_group_options(group)))


def register_help_resolver() -> None:
    """``${gptlab_choices:GROUP}`` for conf/hydra/help/gptlab.yaml."""
    if not OmegaConf.has_resolver("gptlab_choices"):
        OmegaConf.register_new_resolver("gptlab_choices", group_choices)


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
    except NonFiniteLossError as e:
        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            raise
        print(f"\ngptlab: training failed: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    metric = cfg.get("optimized_metric")
    return metrics.get(metric) if metric else None
