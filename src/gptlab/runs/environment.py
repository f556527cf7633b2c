"""What a run's numbers depend on beyond its config: the environment it ran in.

Two runs of one config can end at different losses: torch's intra-op thread count changes the order of
floating-point sums, and torch.optim.Muon's bf16 Newton-Schulz iterations magnify such last-bit differences
(docs/studies.md); so do another torch version, another device, another precision, another commit. A run
records them once, in ``result.json`` (``environment``) and in its W&B run's config (``environment``), so
that a comparison can say where the runs it compares differ in them (:mod:`gptlab.comparison.environment`).

Each value is a plain JSON value (a string, a number, a bool, or null where it does not apply or is unknown).
Runs from before this record have none: a reader takes a missing ``environment`` as "not recorded". Nothing
here imports Lightning (a task that does not use it, word2vec, records its version as installed).
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

#: The key of the record in result.json and in the W&B run's config.
ENVIRONMENT_KEY = "environment"

#: The record's fields, in the order a comparison names them, with the words it names them by.
FIELDS: dict[str, str] = {
    "torch_threads": "torch threads",
    "omp_num_threads": "OMP_NUM_THREADS",
    "device": "device",
    "precision": "precision",
    "deterministic": "deterministic algorithms",
    "torch": "torch",
    "lightning": "lightning",
    "gptlab": "gptlab",
    "commit": "commit",
}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s, else the platform's), or ``cpu`` when neither says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Hardware", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device_type: str | None) -> str:
    """The device a run computes on, named as a reader tells two apart: the GPU's name for ``cuda``, the
    CPU's model for ``cpu`` (the default)."""
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        try:
            return torch.cuda.get_device_name()
        except RuntimeError as e:  # a device that stopped answering: the record must not hide the run's error
            return f"cuda (its name unreadable: {e})"[:200]
    if device_type not in (None, "cpu"):
        return device_type
    return cpu_model()


def run_environment(device_type: str | None = None, precision: str | None = None) -> dict[str, Any]:
    """This process's environment as a run records it: torch's intra-op thread count now, OMP_NUM_THREADS as
    set (null when unset), the device (``device_type``: cpu, cuda...), the ``precision`` the trainer uses
    (null for a task without one), whether torch's deterministic algorithms are on, the versions of torch,
    Lightning and gptlab, and the commit of gptlab's checkout (``+dirty`` with uncommitted changes)."""
    import torch

    from gptlab.runs.layout import git_commit

    return {
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "device": device_name(device_type),
        "precision": None if precision is None else str(precision),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "torch": str(torch.__version__),  # a TorchVersion, a str that OmegaConf (plain loggers) refuses
        "lightning": _version("lightning"),
        # the package this module is in, imported before it: read, not imported (the package's face imports
        # gptlab.api, which reaches this module through the comparison)
        "gptlab": sys.modules[(__package__ or "gptlab").split(".")[0]].__version__,
        "commit": git_commit(),
    }


def recorded_environment(data: Any) -> dict[str, Any] | None:
    """The environment a run recorded (result.json's or its W&B config's ``environment``), its known fields
    only; None where it recorded none (a run from before the record, or a value that is not a record)."""
    if not isinstance(data, dict):
        return None
    return {key: data.get(key) for key in FIELDS}


def value_text(field: str, value: Any) -> str:
    """One recorded value as a reader reads it: ``unset`` for an OMP_NUM_THREADS not set, ``on``/``off``,
    a commit by its first 12 characters (``+dirty`` kept)."""
    if value is None:
        return "unset" if field == "omp_num_threads" else "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if field == "commit" and isinstance(value, str) and len(value) > 12:
        head, plus, dirty = value.partition("+")
        return head[:12] + plus + dirty
    return str(value)
