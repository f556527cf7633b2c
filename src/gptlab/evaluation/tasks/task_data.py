"""Loads the data of gptlab's shipped harness tasks from the JSON-lines files beside this module.

A task YAML's ``dataset_kwargs.data_files`` is read relative to the working directory, so a task shipped
inside the package names its data through ``custom_dataset: !function task_data.<task>`` instead, which
finds the file wherever gptlab is installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _rows(name: str) -> Any:
    import datasets

    lines = (HERE / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(x) for x in lines if x])})


def python_mc(**_: Any) -> Any:
    """``gptlab_python_mc``: one-word answers about Python, four choices each."""
    return _rows("gptlab_python_mc")


def python_text(**_: Any) -> Any:
    """``gptlab_python_text``: short passages of Python prose, scored as whole documents."""
    return _rows("gptlab_python_text")
