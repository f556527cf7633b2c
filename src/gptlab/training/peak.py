"""The peak FLOP/s of one device, the denominator of model FLOPs utilisation (MFU), from a source that a busy
machine cannot lower.

- CUDA GPUs: the chip's published dense figure for the compute dtype (``DATASHEET``, looked up by the name
  torch reports). bf16/fp16 on the tensor cores; fp32 matmuls run as TF32 where torch allows it
  (``torch.get_float32_matmul_precision() != "highest"`` on Ampere and later), else at the fp32 rate. A chip
  not in the table is measured, and the source says so.
- CPUs: no datasheet figure applies (it depends on the cores, their clocks and the threads torch uses), so the
  best fp32 matrix-product rate ever measured on this machine, for this CPU model, core count, torch thread
  count and torch version, kept in a calibration file (``$GPTLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/gptlab``,
  else ``~/.cache/gptlab``; ``peak_flops.json``). Each process measures once (best of several products) and
  the file keeps the highest figure: a figure measured while other jobs share the cores (it read 28-58
  GFLOP/s against 326 on a quiet machine) never replaces a higher one, so later runs do not report an MFU
  above 100% against it.

Without Lightning: ``scripts/benchmark.py`` and the training callback (gptlab.training.metrics) share it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.runs.jsonfile import dumps, figure_as_json

log = logging.getLogger(__name__)

TERA = 1e12


@dataclass(frozen=True)
class ChipPeak:
    """A GPU's published dense peak, FLOP/s, per compute dtype (None: the chip has no such unit)."""

    name: str
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float


# NVIDIA's datasheets, dense (without 2:4 sparsity, which doubles the tensor-core figures printed beside
# them), per GPU. Matched in order on the words of torch's device name: the first row whose words all occur.
DATASHEET: tuple[tuple[tuple[str, ...], ChipPeak], ...] = (
    (("h200", "nvl"), ChipPeak("H200 NVL", 835 * TERA, 835 * TERA, 418 * TERA, 60 * TERA)),
    (("h200",), ChipPeak("H200 SXM", 989.4 * TERA, 989.4 * TERA, 494.7 * TERA, 66.9 * TERA)),
    (("gh200",), ChipPeak("GH200", 989.4 * TERA, 989.4 * TERA, 494.7 * TERA, 66.9 * TERA)),
    (("h100", "nvl"), ChipPeak("H100 NVL", 835 * TERA, 835 * TERA, 418 * TERA, 60 * TERA)),
    (("h100", "pcie"), ChipPeak("H100 PCIe", 756.5 * TERA, 756.5 * TERA, 378 * TERA, 51.2 * TERA)),
    (("h100",), ChipPeak("H100 SXM", 989.4 * TERA, 989.4 * TERA, 494.7 * TERA, 66.9 * TERA)),
    (("a100",), ChipPeak("A100", 312 * TERA, 312 * TERA, 156 * TERA, 19.5 * TERA)),
    (("l40s",), ChipPeak("L40S", 362 * TERA, 362 * TERA, 183 * TERA, 91.6 * TERA)),
    (("l40",), ChipPeak("L40", 181 * TERA, 181 * TERA, 90.5 * TERA, 90.5 * TERA)),
    (("l4",), ChipPeak("L4", 121 * TERA, 121 * TERA, 60 * TERA, 30.3 * TERA)),
    (("a10",), ChipPeak("A10", 125 * TERA, 125 * TERA, 62.5 * TERA, 31.2 * TERA)),
    (("v100", "pcie"), ChipPeak("V100 PCIe", None, 112 * TERA, None, 14 * TERA)),
    (("v100",), ChipPeak("V100 SXM2", None, 125 * TERA, None, 15.7 * TERA)),
    (("t4",), ChipPeak("T4", None, 65 * TERA, None, 8.1 * TERA)),
)


def chip_peak(device_name: str) -> ChipPeak | None:
    """The datasheet row of a CUDA device by the name torch reports ("NVIDIA H100 80GB HBM3", "NVIDIA
    A100-SXM4-80GB", "Tesla T4"), or None when the chip is not in the table."""
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    for needed, peak in DATASHEET:
        if all(word in words for word in needed):
            return peak
    return None


def datasheet_flops(device_name: str, dtype: torch.dtype, tf32: bool) -> tuple[float, str] | None:
    """(FLOP/s, the unit it names) of ``device_name`` for matmuls in ``dtype``; ``tf32``: fp32 matmuls run
    as TF32. None when the chip or its unit for ``dtype`` is not in the table."""
    chip = chip_peak(device_name)
    if chip is None:
        return None
    if dtype == torch.bfloat16:
        figure, unit = chip.bf16, "bf16"
    elif dtype == torch.float16:
        figure, unit = chip.fp16, "fp16"
    elif dtype == torch.float32 and tf32 and chip.tf32:
        figure, unit = chip.tf32, "tf32"
    elif dtype == torch.float32:
        figure, unit = chip.fp32, "fp32"
    else:
        return None
    return (figure, f"{chip.name} {unit}") if figure else None


_measured: dict[tuple[str, str, int], float] = {}


def measure_matmul_peak(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """The best of several square matrix products on ``device``, in FLOP/s; measured once per process,
    device and thread count (about 0.2 s on two quiet CPU cores)."""
    device = torch.device(device)
    key = (str(device), str(dtype), torch.get_num_threads())
    if key in _measured:
        return _measured[key]
    n = 1024 if device.type == "cpu" else 8192
    # a generator of its own: timing a product must not move the run's random stream (the model's
    # initialisation, dropout and sampling would then depend on whether and when a peak was measured)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    best = float("inf")
    for _ in range(8):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    _measured[key] = 2.0 * n**3 / best
    return _measured[key]


def cache_dir() -> Path:
    """Where gptlab keeps what it measured about this machine."""
    if os.environ.get("GPTLAB_CACHE_DIR"):
        return Path(os.environ["GPTLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gptlab"


def calibration_path() -> Path:
    return cache_dir() / "peak_flops.json"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover - not Linux
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


DTYPE_LABELS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def cpu_calibration_key(threads: int | None = None, dtype: torch.dtype = torch.float32) -> str:
    """What a CPU figure depends on: the CPU model, its logical cores, torch's threads, torch's version and
    the products' dtype (a CPU with bf16 units, AMX for one, multiplies bf16 several times faster than fp32)."""
    threads = threads or torch.get_num_threads()
    label = DTYPE_LABELS.get(dtype, str(dtype))
    return f"{cpu_model()} | {os.cpu_count()} cores | {threads} threads | torch {torch.__version__} | {label}"


def record_calibration(path: Path, key: str, measured: float) -> float:
    """Keep ``measured`` under ``key`` in the calibration file at ``path`` if it beats the figure there;
    returns the best figure (the file's or ``measured``). Processes that calibrate at once take turns (a
    lock), and the file is replaced whole, so it is never read half-written. A file that cannot be written
    costs the cache, not the run."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            table = read_calibrations(path)
            entry = table.get(key)
            if isinstance(entry, dict) and float(entry.get("flops", 0)) >= measured:
                return float(entry["flops"])
            # strict JSON (gptlab.runs.jsonfile): a figure that is not finite as "inf"/"nan", which float() reads
            flops = figure_as_json(measured)
            table[key] = {"flops": flops, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(dumps(table, sort_keys=True))
            os.replace(tmp, path)
            return measured
    except OSError as e:
        log.warning(
            "The peak FLOP/s calibration cannot be kept in %s (%s): this run's own figure is used", path, e
        )
        return measured


def read_calibrations(path: Path) -> dict[str, dict]:
    """The calibration file's entries; an unreadable or damaged file counts as empty (it is rewritten)."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def cpu_peak_flops(dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """(FLOP/s, its source) of this CPU for matmuls in ``dtype`` (the run's compute dtype: bf16 in a
    ``bf16-mixed`` run) at torch's current thread count: the best figure measured on this machine so far,
    this process's measurement included."""
    measured = measure_matmul_peak("cpu", dtype)
    path = calibration_path()
    best = record_calibration(path, cpu_calibration_key(dtype=dtype), measured)
    threads = torch.get_num_threads()
    label = DTYPE_LABELS.get(dtype, str(dtype))
    return best, f"best {label} matmul measured on this CPU at {threads} thread(s), kept in {path}"


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from): the datasheet for known CUDA GPUs, a
    measurement for other GPUs (said in the source), the calibrated best for CPUs."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = torch.get_float32_matmul_precision() != "highest"
        found = datasheet_flops(name, dtype, tf32)
        if found:
            return found[0], f"datasheet {found[1]}, dense"
        return measure_matmul_peak(device, dtype), (
            f"measured {name} {dtype} matmul: no datasheet figure for this GPU, so MFU may read high"
        )
    return cpu_peak_flops(dtype)


__all__ = [
    "DATASHEET",
    "DTYPE_LABELS",
    "ChipPeak",
    "chip_peak",
    "cpu_calibration_key",
    "cpu_peak_flops",
    "datasheet_flops",
    "device_peak_flops",
    "measure_matmul_peak",
    "record_calibration",
]
