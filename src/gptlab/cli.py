"""The command-line task behind `python train.py`: clear errors for bad input, the metric a sweeper reads."""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable
from typing import Any

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


def unknown_choice(error: Exception) -> str | None:
    """gptlab's message for Hydra's MissingConfigException of a mistyped choice (``pos=sinusiodal``): the
    group's choices and the closest one. None where the group itself is unknown (or the primary config is
    missing): Hydra's own message, with its config search path, is the useful one there."""
    missing = getattr(error, "missing_cfg_file", None) or ""
    options = sorted(getattr(error, "options", None) or ())
    if "/" not in missing or not options:
        return None
    group, choice = missing.rsplit("/", 1)
    close = difflib.get_close_matches(choice, options, n=1)
    return (
        f"Could not find '{missing}': {group} has no choice {choice!r}. Choose {group} from: "
        f"{', '.join(options)}." + (f" Did you mean {group}={close[0]}?" if close else "")
    )


def suggest_choices() -> None:
    """A mistyped choice refused as gptlab refuses bad input: ``gptlab: error: ... Did you mean
    pos=sinusoidal?``, status 2, without Hydra's config search path.

    Hydra composes the config, and reports a failure to compose, inside ``hydra._internal.utils.
    run_and_report``, before any code of the task runs; its public API has no hook there (callbacks start
    after composition). This wraps that function so that a MissingConfigException of a known group is
    reported here, and everything else exactly as Hydra does. Where a Hydra release lacks the function, or
    ``HYDRA_FULL_ERROR=1`` asks for the stack trace, Hydra's report stands."""
    from hydra._internal import utils as hydra_utils

    original = getattr(hydra_utils, "run_and_report", None)
    if original is None or getattr(original, "suggests_choices", False):
        return

    def run_and_report(func: Callable[[], Any]) -> Any:
        def composed_or_refused() -> Any:
            from hydra.errors import MissingConfigException

            try:
                return func()
            except MissingConfigException as e:
                message = None if os.environ.get("HYDRA_FULL_ERROR") == "1" else unknown_choice(e)
                if message is None:
                    raise
                print(f"gptlab: error: {message}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None

        return original(composed_or_refused)

    run_and_report.suggests_choices = True  # type: ignore[attr-defined]
    hydra_utils.run_and_report = run_and_report


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
