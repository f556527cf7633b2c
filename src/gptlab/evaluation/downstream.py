"""Downstream evaluation during training: the ``eval_harness`` config node, its check, the names its metrics
are logged under, and the comparison table's reader of their final values.

The callback that runs the harness is :mod:`gptlab.training.downstream_eval`; this module imports neither
Lightning nor the harness, so the config tree and the comparison read it cheaply. The harness (``lm-eval``)
is imported only when the node is enabled.

Metrics are named ``eval/<task>/<metric>`` (``eval/gptlab_python_mc/acc``): in ``metrics.csv`` and W&B at
each evaluation's step, and the last evaluation's values in ``result.json``'s ``metrics``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptlab.errors import ConfigError
from gptlab.registry import build_options

if TYPE_CHECKING:
    from gptlab.runs.layout import Run

#: The harness tasks shipped with gptlab (YAMLs and their data), always searched.
SHIPPED_TASKS = Path(__file__).resolve().parent / "tasks"
PREFIX = "eval/"
NODE = "eval_harness"


@dataclass(frozen=True)
class DownstreamEvalOptions:
    """The ``eval_harness`` node (``enabled`` aside): which harness tasks, how often, on how many examples."""

    tasks: Sequence[str] = ("gptlab_python_mc", "gptlab_python_text")
    every_n_steps: int = 80
    limit: int | None = 32  # examples per task; None: all of them
    include_path: Sequence[str] = field(
        default_factory=tuple
    )  # folders of task YAMLs beside the shipped ones
    num_fewshot: int | None = None  # None: the task's own
    batch_size: int = 8
    seed: int = 1234

    def __post_init__(self) -> None:
        tasks = [self.tasks] if isinstance(self.tasks, str) else list(self.tasks or [])
        if not tasks or not all(isinstance(t, str) and t for t in tasks):
            raise ConfigError(
                f"{NODE}.tasks={self.tasks!r} must be a non-empty list of task names, e.g. "
                f"{NODE}.tasks=[gptlab_python_mc]."
            )
        object.__setattr__(self, "tasks", tuple(tasks))
        for key in ("every_n_steps", "batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{NODE}.{key}={value!r} must be a positive integer.")
        if self.limit is not None and (
            not isinstance(self.limit, int) or isinstance(self.limit, bool) or self.limit < 1
        ):
            raise ConfigError(
                f"{NODE}.limit={self.limit!r} must be a positive integer (examples per task) or null for all."
            )
        if self.num_fewshot is not None and (not isinstance(self.num_fewshot, int) or self.num_fewshot < 0):
            raise ConfigError(f"{NODE}.num_fewshot={self.num_fewshot!r} must be an integer >= 0 or null.")
        paths = [self.include_path] if isinstance(self.include_path, str) else list(self.include_path or [])
        missing = [p for p in paths if not Path(p).is_dir()]
        if missing:
            raise ConfigError(
                f"{NODE}.include_path has {missing}, which is not a folder: name folders of task YAMLs "
                f"(a relative path is taken from the directory train.py runs in; the shipped tasks in "
                f"{SHIPPED_TASKS} are always searched)."
            )
        object.__setattr__(self, "include_path", tuple(str(Path(p).resolve()) for p in paths))

    @property
    def folders(self) -> list[str]:
        """The task folders searched: the shipped tasks, then ``include_path``."""
        return [str(SHIPPED_TASKS), *self.include_path]


def parse_downstream(node: Any) -> DownstreamEvalOptions | None:
    """The ``eval_harness`` node as options, None when it is off. Its keys are checked also when off (a typo
    fails now); the task names only when on, since that imports the harness and indexes its tasks."""
    values = dict(node or {})
    enabled = values.pop("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{NODE}.enabled={enabled!r} must be true or false.")
    options = build_options(DownstreamEvalOptions, values, NODE, NODE)
    if not enabled:
        return None
    check_tasks(options)
    return options


def task_manager(options: DownstreamEvalOptions, include_defaults: bool = False) -> Any:
    """The harness's task index over the shipped tasks and ``include_path`` (and lm-eval's own thousands of
    tasks with ``include_defaults``: seconds to index)."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError(
            f"{NODE}.enabled=true runs EleutherAI's lm-evaluation-harness, which is not installed: "
            'pip install -e ".[eval]" (or leave eval_harness.enabled=false).'
        ) from None
    return TaskManager(include_path=options.folders, include_defaults=include_defaults)


def check_tasks(options: DownstreamEvalOptions) -> Any:
    """The harness's task index for ``options.tasks``: the local folders' alone when they hold every task,
    else with lm-eval's own tasks (``hellaswag``: its data then comes from the hub). A name it does not know
    is refused, with the local ones listed."""
    local = task_manager(options)
    if all(t in local.all_tasks for t in options.tasks):
        return local
    manager = task_manager(options, include_defaults=True)
    unknown = [t for t in options.tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"{NODE}.tasks has {unknown}, which the harness does not know. Local tasks: "
            f"{', '.join(sorted(local.all_tasks))} (from {', '.join(options.folders)}); lm-eval's own are "
            f"listed by `lm-eval ls tasks`. Add a folder of task YAMLs with {NODE}.include_path=[DIR]."
        )
    return manager


def metric_names(results: dict[str, Any]) -> dict[str, float]:
    """``eval/<task>/<metric>`` from the harness's results (``"acc,none"`` -> ``acc``; another filter kept:
    ``exact_match/strict-match``); standard errors and non-numbers left out."""
    out = {}
    for key, value in flat_metrics(results).items():
        name = PREFIX + key.split("/", 1)[1]
        if not name.split("/")[2].endswith("_stderr"):
            out[name] = value
    return out


def final_values(run: Run) -> dict[str, float | None]:
    """The comparison table's columns: each ``eval/<task>/<metric>`` of ``result.json`` (the last
    evaluation during training); a figure the run could not give (``null``, ``"nan"``) as None, which the
    table shows as unavailable, never as 0."""
    from gptlab.runs.jsonfile import read_figure

    metrics = (run.result() or {}).get("metrics") or {}
    out: dict[str, float | None] = {}
    for key, value in metrics.items():
        # three parts: word2vec's scores are eval/<name>
        if key.startswith(PREFIX) and key.count("/") >= 2:
            figure = read_figure(value)
            out[key] = None if figure is None or math.isnan(figure) else figure
    return out


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """``harness/<task>/<metric>`` from the harness's ``results`` (``"acc,none"`` -> ``acc``; a filter other
    than ``none`` is kept: ``exact_match/strict-match``)."""
    out: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric}/{filt}"
            out[f"harness/{task}/{name}"] = float(value)
    return out
