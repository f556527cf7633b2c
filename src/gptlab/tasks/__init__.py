"""The tasks ``python train.py`` runs, chosen by ``task=``: each a module with ``run(cfg) -> metrics``, built
on the same run skeleton (:mod:`gptlab.tasks.skeleton`).

- ``gpt`` (:mod:`gptlab.tasks.gpt`): train a language model.
- ``word2vec`` (:mod:`gptlab.tasks.word2vec`): train word vectors on the same corpus.

A new task is a module here with ``run(cfg)`` and one line in ``TASKS``.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable

from omegaconf import DictConfig

from gptlab.errors import ConfigError
from gptlab.registry import import_plugins

#: task name -> the module that runs it (imported only when chosen: a word2vec run needs no Lightning).
TASKS = {"gpt": "gptlab.tasks.gpt", "word2vec": "gptlab.tasks.word2vec"}


def task_runner(cfg: DictConfig) -> Callable[[DictConfig], dict[str, float]]:
    """The ``run`` of the task ``cfg.task`` names (gpt when unset), its ``plugins`` imported."""
    import_plugins(cfg.get("plugins"))
    name = cfg.get("task") or "gpt"
    if name not in TASKS:
        close = difflib.get_close_matches(str(name), list(TASKS), n=1)
        raise ConfigError(
            f"task={name!r} is not one of {', '.join(sorted(TASKS))}: task=gpt trains the language model, "
            "task=word2vec word vectors." + (f" Did you mean task={close[0]}?" if close else "")
        )
    return importlib.import_module(TASKS[name]).run
