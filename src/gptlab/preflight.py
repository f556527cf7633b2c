"""Checks of the ``trainer`` node that Lightning would only make after the run has started (or make with a
type error): unknown arguments, the hardware asked for, and values of the wrong type."""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import re
from pathlib import Path
from typing import Any, TypeGuard

import torch

from gptlab.errors import ConfigError
from gptlab.registry import check_keys

_CUDA_NAMES = ("gpu", "cuda")


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


#: the seeds numpy (and so Lightning's seed_everything) takes: 0 to 2**32 - 1
MAX_SEED = 2**32 - 1


def check_seed(seed: Any) -> None:
    if not _is_int(seed):
        raise ConfigError(f"seed={seed!r} must be an integer (e.g. seed=1337).")
    if not 0 <= seed <= MAX_SEED:  # else a traceback from numpy's seeding, after the run folder is made
        raise ConfigError(f"seed={seed} must be from 0 to {MAX_SEED} (numpy's range; e.g. seed=1337).")


@functools.cache
def trainer_arguments() -> tuple[str, ...]:
    """The argument names of Lightning's ``Trainer``, sorted. Read from the installed source of
    ``lightning/pytorch/trainer/trainer.py`` rather than by importing Lightning, which takes seconds (7 s of a
    refusal's 8 here): a config is checked before any heavy import. Imported only where the source cannot be
    read that way."""
    spec = importlib.util.find_spec("lightning")
    if spec is not None and spec.origin is not None:
        source = Path(spec.origin).parent / "pytorch" / "trainer" / "trainer.py"
        try:
            tree = ast.parse(source.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            tree = None
        for node in tree.body if tree is not None else ():
            if isinstance(node, ast.ClassDef) and node.name == "Trainer":
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        args = item.args
                        names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                        return tuple(sorted(set(names) - {"self"}))
    import inspect

    import lightning as L

    return tuple(sorted(set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}))


def check_trainer_options(trainer_cfg: dict[str, Any]) -> None:
    """Every key must be an argument of Lightning's Trainer."""
    allowed = list(trainer_arguments())
    fix = "Use Lightning Trainer arguments: https://lightning.ai/docs/pytorch/stable/common/trainer.html#trainer-flags."
    check_keys(trainer_cfg, allowed, "trainer", "trainer", fix)


def check_trainer_values(trainer_cfg: dict[str, Any]) -> None:
    """``max_steps`` a positive integer; ``val_check_interval`` a positive integer (steps), or a fraction of
    an epoch in (0, 1] only where validation is counted in epochs (``check_val_every_n_epoch`` set)."""
    max_steps = trainer_cfg.get("max_steps")
    if not _is_int(max_steps) or max_steps <= 0:
        raise ConfigError(
            f"trainer.max_steps={max_steps!r}: set a positive integer number of optimizer steps, e.g. "
            "trainer.max_steps=320 (the learning-rate schedule is defined over them)."
        )
    interval = trainer_cfg.get("val_check_interval")
    if interval is None:
        return
    if isinstance(interval, (bool, str)) or not isinstance(interval, (int, float)) or not interval > 0:
        raise ConfigError(
            f"trainer.val_check_interval={interval!r} must be a positive integer (validate every that many "
            "steps, e.g. trainer.val_check_interval=80)."
        )
    if _is_int(interval):
        return
    # A float: Lightning reads it as a fraction of an epoch, and refuses it, after the run has started, while
    # validation is counted in steps across epochs (check_val_every_n_epoch=null, gptlab's default).
    every_epochs = trainer_cfg.get("check_val_every_n_epoch")
    as_steps = (
        f"e.g. trainer.val_check_interval={max(1, round(interval * max_steps))} ({interval:g} x "
        f"trainer.max_steps={max_steps})"
        if interval <= 1
        else f"e.g. trainer.val_check_interval={round(interval)}"
    )
    if every_epochs is None:
        raise ConfigError(
            f"trainer.val_check_interval={interval!r} is not a whole number of steps, and this run counts "
            "validation in optimizer steps (trainer.check_val_every_n_epoch=null), where Lightning refuses a "
            f"fraction of an epoch: give a whole number of steps, {as_steps}."
        )
    if interval > 1:
        raise ConfigError(
            f"trainer.val_check_interval={interval!r}: with trainer.check_val_every_n_epoch={every_epochs} a float "
            f"is a fraction of an epoch and must be in (0, 1]; give a whole number of steps instead, {as_steps}."
        )


#: ``trainer.accelerator``: Lightning's names (``gpu`` is CUDA here).
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
#: ``trainer.precision``: what Lightning's Trainer accepts (lightning.fabric.plugins.precision.precision;
#: tests/test_entry_point.py checks the list against it), the full names first.
PRECISIONS: tuple[str | int, ...] = (
    "32-true",
    "bf16-mixed",
    "16-mixed",
    "bf16-true",
    "16-true",
    "64-true",
    "transformer-engine",
    "transformer-engine-float16",
    "32",
    "bf16",
    "16",
    "64",
    32,
    16,
    64,
)
_FP16_MIXED = ("16-mixed", "16", 16)
#: Lightning's short forms of ``trainer.precision`` and the full names it reads them as (its
#: ``_PRECISION_INPUT_STR_ALIAS_CONVERSION``, with a warning that the short forms are discouraged): gptlab
#: passes, and suggests, the full name.
FULL_PRECISION: dict[str | int, str] = {
    "64": "64-true",
    "32": "32-true",
    "16": "16-mixed",
    "bf16": "bf16-mixed",
    64: "64-true",
    32: "32-true",
    16: "16-mixed",
}


def full_precision(precision: Any) -> Any:
    """``precision`` by its full name where it is one of Lightning's short forms (``bf16``: ``bf16-mixed``)."""
    if isinstance(precision, bool) or not isinstance(precision, (str, int)):
        return precision
    return FULL_PRECISION.get(precision, precision)


def available_devices(accelerator: str) -> int:
    if accelerator in _CUDA_NAMES:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if accelerator == "auto" and torch.cuda.is_available():  # auto picks the GPUs
        return torch.cuda.device_count()
    if accelerator == "mps":
        return int(torch.backends.mps.is_available())
    return -1  # cpu, auto, tpu...: left to Lightning


def check_accelerator(trainer_cfg: dict[str, Any]) -> None:
    """``trainer.accelerator`` one of Lightning's names and present on this machine; ``trainer.devices`` a
    number of devices (or GPU indices) that this accelerator takes and this machine has; ``trainer.num_nodes``
    a positive integer. Lightning makes these checks only when its Trainer is built, after the data."""
    accelerator = str(trainer_cfg.get("accelerator") or "auto").lower()
    if accelerator not in ACCELERATORS:
        close = difflib.get_close_matches(accelerator, ACCELERATORS, n=1)
        raise ConfigError(
            f"trainer.accelerator={trainer_cfg.get('accelerator')!r} is not one of {', '.join(ACCELERATORS)} "
            "(auto: the GPUs where there are any, else the CPU)."
            + (f" Did you mean trainer.accelerator={close[0]}?" if close else "")
        )
    if accelerator == "tpu" and importlib.util.find_spec("torch_xla") is None:
        raise ConfigError(
            "trainer.accelerator=tpu but this machine has no torch_xla (the TPU backend of torch), so no TPU "
            "can be used. Use trainer.accelerator=auto (or cpu) here, or run on a TPU machine with torch_xla."
        )
    count = available_devices(accelerator)
    if count == 0:
        found = "no CUDA GPU" if accelerator in _CUDA_NAMES else "no Apple MPS device"
        raise ConfigError(
            f"trainer.accelerator={accelerator} but this machine has {found} (torch {torch.__version__}). "
            "Use trainer.accelerator=auto (or cpu) here, or run on a machine with that device and a torch "
            "build for it."
        )
    check_devices(trainer_cfg.get("devices", "auto"), accelerator, count)
    num_nodes = trainer_cfg.get("num_nodes", 1)
    if not _is_int(num_nodes) or num_nodes < 1:
        raise ConfigError(
            f"trainer.num_nodes={num_nodes!r} must be a positive integer: the number of machines the run "
            "spans, each running trainer.devices processes (trainer.num_nodes=1: this machine alone)."
        )


def device_request(devices: Any) -> int | list[int] | str:
    """``trainer.devices`` as Lightning reads it: a count (-1: all), ``"auto"``, or a list of GPU indices (a
    list, or a string such as ``"0,2"``); refused when it is none of these."""
    value = devices
    if isinstance(value, str):
        text = value.strip()
        if text == "auto":
            return "auto"
        if "," in text:
            value = [part.strip() for part in text.split(",") if part.strip()]
        elif re.fullmatch(r"-?\d+", text):
            value = int(text)
    if isinstance(value, (list, tuple)):
        indices = [int(v) if isinstance(v, str) and v.isdigit() else v for v in value]
        if indices and all(_is_int(i) and i >= 0 for i in indices) and len(set(indices)) == len(indices):
            return indices
    elif _is_int(value) and (value >= 1 or value == -1):
        return value
    raise ConfigError(
        f"trainer.devices={devices!r} is not a number of devices. Use a positive integer (trainer.devices=2: "
        "two GPUs, or two training processes on the CPU), -1 or auto for every GPU of the machine, or a list "
        "of distinct GPU indices (trainer.devices=[0,2])."
    )


def check_devices(devices: Any, accelerator: str, count: int) -> None:
    """``trainer.devices`` for this accelerator (``count``: the devices this machine has of it, -1 where
    any number of processes may run, as on the CPU)."""
    request = device_request(devices)
    if request == "auto":
        return
    device = accelerator.upper() if accelerator in ("mps", "tpu") else "GPU"
    on_cpu = count < 0 and training_device_type({"accelerator": accelerator}) == "cpu"
    if on_cpu and (request == -1 or isinstance(request, list)):
        why = "" if accelerator == "cpu" else f" (trainer.accelerator={accelerator}: this machine has no GPU)"
        raise ConfigError(
            f"trainer.devices={devices!r} selects GPUs, but this run trains on the CPU{why}, where "
            "trainer.devices is the number of training processes: give a positive integer, e.g. "
            "trainer.devices=1 (or 2 for data parallel on two processes), or trainer.devices=auto."
        )
    if count <= 0:
        return  # the CPU (any number of processes; too many cores' worth is warned about) or a TPU
    if isinstance(request, list):
        missing = [i for i in request if i >= count]
        if missing:
            raise ConfigError(
                f"trainer.devices={devices!r} names {device} {missing[0]}, but this machine has {count} "
                f"{device}(s), numbered 0 to {count - 1}. Use indices below {count}, or trainer.devices="
                f"{count} (or -1) for all of them."
            )
    elif isinstance(request, int) and request > count:
        raise ConfigError(
            f"trainer.devices={devices} but this machine has {count} {device} device(s). "
            f"Use trainer.devices={count} (or -1 for all of them), or trainer.num_nodes to add machines."
        )


def check_precision(trainer_cfg: dict[str, Any]) -> None:
    """``trainer.precision`` one of Lightning's (or null/auto: gptlab chooses for the hardware), and one that
    runs on this run's device as asked: on the CPU Lightning would replace fp16 mixed precision with bf16
    without being asked, so it is refused here."""
    precision = trainer_cfg.get("precision")
    if precision in (None, "auto"):
        return
    if isinstance(precision, bool) or precision not in PRECISIONS:
        names = [p for p in PRECISIONS if isinstance(p, str)]
        close = difflib.get_close_matches(str(precision), names, n=1)
        raise ConfigError(
            f"trainer.precision={precision!r} is not one of Lightning's precisions: "
            f"{', '.join(names[:8])} (or the short forms 32, bf16, 16, 64), or null for gptlab's choice "
            "(32-true on the CPU, bf16-mixed on GPUs that have bf16, else 16-mixed)."
            + (f" Did you mean trainer.precision={full_precision(close[0])}?" if close else "")
        )
    device = training_device_type(trainer_cfg)
    if precision in _FP16_MIXED and device == "cpu":
        raise ConfigError(
            f"trainer.precision={precision} (fp16 mixed precision) does not run on the CPU, which this run "
            "trains on: Lightning would train in bf16-mixed instead, unasked. Use trainer.precision=32-true "
            "(the fast one on CPUs) or bf16-mixed, or train on a GPU."
        )
    if str(precision).startswith("transformer-engine") and (
        device != "cuda" or importlib.util.find_spec("transformer_engine") is None
    ):
        raise ConfigError(
            f"trainer.precision={precision} needs NVIDIA's transformer_engine package and a CUDA GPU; this "
            f"run {'has no transformer_engine' if device == 'cuda' else 'trains on ' + device}. Use "
            "trainer.precision=bf16-mixed, or null for gptlab's choice."
        )


def training_device_type(trainer_cfg: dict[str, Any]) -> str:
    """The kind of device the run will train on ("cuda", "cpu", "mps", ...), as Lightning picks it."""
    accelerator = str(trainer_cfg.get("accelerator") or "auto").lower()
    if accelerator in _CUDA_NAMES:
        return "cuda"
    if accelerator == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    return accelerator
