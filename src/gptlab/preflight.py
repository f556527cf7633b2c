"""Checks of the ``trainer`` node that Lightning would only make after the run has started (or make with a
type error): unknown arguments, the hardware asked for, and values of the wrong type."""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any, TypeGuard

import torch

from gptlab.errors import ConfigError
from gptlab.registry import check_keys

_CUDA_NAMES = ("gpu", "cuda")


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_seed(seed: Any) -> None:
    if not _is_int(seed):
        raise ConfigError(f"seed={seed!r} must be an integer (e.g. seed=1337).")


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


def available_devices(accelerator: str) -> int:
    if accelerator in _CUDA_NAMES:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if accelerator == "auto" and torch.cuda.is_available():  # auto picks the GPUs
        return torch.cuda.device_count()
    if accelerator == "mps":
        return int(torch.backends.mps.is_available())
    return -1  # cpu, auto, tpu...: left to Lightning


def check_accelerator(trainer_cfg: dict[str, Any]) -> None:
    """Refuse an accelerator this machine does not have, or more GPUs than it has."""
    accelerator = str(trainer_cfg.get("accelerator") or "auto").lower()
    count = available_devices(accelerator)
    if count == 0:
        found = "no CUDA GPU" if accelerator in _CUDA_NAMES else "no Apple MPS device"
        raise ConfigError(
            f"trainer.accelerator={accelerator} but this machine has {found} (torch {torch.__version__}). "
            "Use trainer.accelerator=auto (or cpu) here, or run on a machine with that device and a torch "
            "build for it."
        )
    devices = trainer_cfg.get("devices")
    if count > 0 and _is_int(devices) and devices > count:
        raise ConfigError(
            f"trainer.devices={devices} but this machine has {count} "
            f"{'GPU' if accelerator in (*_CUDA_NAMES, 'auto') else accelerator.upper()} device(s). "
            f"Use trainer.devices={count} (or -1 for all of them), or trainer.num_nodes to add machines."
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
