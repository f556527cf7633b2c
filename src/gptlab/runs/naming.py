"""Names, groups and tags of a run, derived from the Hydra overrides that made it.

A sweep becomes one W&B group with no hand work: the group is the experiment's name (``experiment=...``) or,
for a plain multirun, the sweep directory; each run is named by the overrides that vary in the sweep
(``pos=rope seed=1``) and tagged with every override that chose something (``pos=rope``, ``seed=1``).
Everything here reads plain values, so it works in a Hydra run, in a multirun job, and from ``compose``
(pass the overrides explicitly).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

# Overrides that say where or how a run is recorded, not what is trained: left out of names and tags.
# Keys that change only how progress is shown: neither what is trained nor where the run is filed.
DISPLAY_PREFIXES = ("callbacks.progress_bar",)
SILENT_PREFIXES = (
    "hydra.",
    "hydra/",
    "paths.",
    "logger",
    "resume",
    "+resume",
    "overwrite",
    "+overwrite",
    *DISPLAY_PREFIXES,
)
# Hydra's sweep functions; the other sweep syntax is a comma outside brackets and quotes (`pos=rope,alibi`).
_SWEEP_FUNCTION = re.compile(r"^\s*(range|choice|interval|glob|tag)\(")
# W&B refuses tags longer than 64 characters.
MAX_TAG_LENGTH = 64


@dataclass
class RunLabels:
    """What a tracker needs to file a run: its display name, group, job type and tags."""

    name: str | None = None
    group: str | None = None
    job_type: str = "train"
    tags: list[str] = field(default_factory=list)
    group_key: str = ""  # the swept overrides other than the seed: runs that differ only by seed share it
    overrides: list[str] = field(default_factory=list)
    job_num: int | None = None
    sweep_dir: str | None = None

    def as_config(self) -> dict[str, Any]:
        """The identity as a flat config section, so the W&B UI can group by ``run.group_key``."""
        return {
            "group_key": self.group_key,
            "overrides": list(self.overrides),
            "job_num": self.job_num,
            "sweep_dir": self.sweep_dir,
        }


def split_override(override: str) -> tuple[str, str]:
    """``'pos=rope'`` -> ``('pos', 'rope')``; ``'+trainer.x=1'`` -> ``('trainer.x', '1')``."""
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def is_silent(key: str) -> bool:
    return key.startswith(SILENT_PREFIXES)


def is_display_only(key: str) -> bool:
    """True for a key that changes only how progress is shown (``callbacks.progress_bar.style=lines``)."""
    return key.lstrip("+~").startswith(DISPLAY_PREFIXES)


def is_sweep_value(value: str) -> bool:
    """True when an override's value sweeps (``a,b``, ``range(...)``, ``choice(...)``, ``interval(...)``...);
    a list (``[0.9,0.95]``) or a quoted string with a comma does not."""
    value = str(value)
    if _SWEEP_FUNCTION.match(value):
        return True
    depth, quote, escaped = 0, "", False
    for ch in value:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            return True
    return False


def swept_keys_of(sweep_overrides: list[str], sweeper_params: dict[str, Any] | None = None) -> list[str]:
    """The keys a sweep varies, from its command-line overrides and ``hydra.sweeper.params``."""
    keys = [split_override(o)[0] for o in sweep_overrides if is_sweep_value(split_override(o)[1])]
    for key, value in (sweeper_params or {}).items():
        if is_sweep_value(str(value)) and key not in keys:
            keys.append(key)
    return [k for k in keys if not is_silent(k)]


def sweep_overrides_from_dir(sweep_dir: str | Path) -> list[str]:
    """The command-line overrides of a sweep, from the ``multirun.yaml`` Hydra's basic sweeper leaves in the
    sweep directory (empty when there is none)."""
    path = Path(sweep_dir) / "multirun.yaml"
    if not path.is_file():
        return []
    cfg = OmegaConf.load(path)
    return list(OmegaConf.select(cfg, "hydra.overrides.task", default=[]) or [])


def _short_value(value: str) -> str:
    """Floats to 3 significant digits (an Optuna trial's lr=0.0012345678 reads as 0.00123)."""
    try:
        number = float(value)
    except ValueError:
        return value
    if re.fullmatch(r"[+-]?\d+", value.strip()):
        return value
    return f"{number:.3g}"


def identity(
    overrides: list[str],
    *,
    multirun: bool = False,
    sweep_dir: str | None = None,
    job_num: int | None = None,
    experiment: str | None = None,
    swept_keys: list[str] | None = None,
    searching: bool = False,
) -> RunLabels:
    """Derive a run's identity from its overrides.

    ``swept_keys``: the keys the sweep varies (None: unknown, then every override that is not silent counts).
    ``searching``: the sweep is a search (Optuna), which sets the job type.
    """
    chosen = [(k, v) for k, v in map(split_override, overrides) if not is_silent(k)]
    if swept_keys is not None and multirun:
        varying = [(k, v) for k, v in chosen if k in swept_keys]
    else:
        varying = [(k, v) for k, v in chosen if k != "experiment"]
    name = " ".join(f"{k.rsplit('.', 1)[-1]}={_short_value(v)}" for k, v in varying) or None
    group_key = " ".join(f"{k}={v}" for k, v in varying if k != "seed")
    tags = [f"{k}={v}"[:MAX_TAG_LENGTH] for k, v in chosen]
    if multirun:
        group = experiment or sweep_dir
        job_type = "search" if searching else "sweep"
    else:
        group = experiment
        job_type = "train"
    return RunLabels(
        name=name,
        group=group,
        job_type=job_type,
        tags=tags,
        group_key=group_key,
        overrides=list(overrides),
        job_num=job_num,
        sweep_dir=sweep_dir,
    )


def _display_dir(path: str) -> str:
    """A sweep directory as a group name: relative to the working directory when below it."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def is_multirun(hc: Any = None) -> bool:
    """Whether a Hydra job is one job of a sweep (``python train.py -m``): the current job's by default, or
    the one of a ``hydra`` config node passed in. False outside Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if hc is None:
        if not HydraConfig.initialized():
            return False
        hc = HydraConfig.get()
    # a node of compose(..., return_hydra_config=True) holds the mode's name, a running job's the enum
    return str(hc.get("mode")) in (str(RunMode.MULTIRUN), RunMode.MULTIRUN.name)


def is_sweep_in_this_process() -> bool:
    """Whether this job is one of a sweep whose jobs run one after another in this process (Hydra's basic
    launcher), rather than each in its own (SLURM, joblib): a signal to this process is then the whole sweep's."""
    from hydra.core.hydra_config import HydraConfig

    if not is_multirun():
        return False
    target = str(HydraConfig.get().launcher.get("_target_", ""))
    return target.endswith(".BasicLauncher")


def labels_from_hydra(hc: Any = None) -> RunLabels:
    """The identity of a Hydra job from its ``hydra`` config node: the current job's by default, or one
    passed in (``compose(..., return_hydra_config=True).hydra``). Empty outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    if hc is None:
        if not HydraConfig.initialized():
            return RunLabels()
        hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    choices = dict(hc.runtime.choices)
    experiment = choices.get("experiment")
    if not is_multirun(hc):
        return identity(overrides, experiment=experiment)
    sweep_dir = str(hc.sweep.dir)
    raw = OmegaConf.to_container(hc.sweeper.params, resolve=False) if hc.sweeper.get("params") else {}
    params: dict[str, Any] = {str(k): v for k, v in raw.items()} if isinstance(raw, dict) else {}
    sweep_overrides = sweep_overrides_from_dir(sweep_dir)
    swept = swept_keys_of(sweep_overrides, params)
    # Any sweeper but Hydra's grid sweeper searches (Optuna, Nevergrad, Ax): it writes no multirun.yaml and
    # its searched parameters are in hydra.sweeper.params.
    searching = not str(hc.sweeper.get("_target_", "")).endswith("BasicSweeper")
    return identity(
        overrides,
        multirun=True,
        sweep_dir=_display_dir(sweep_dir),
        job_num=int(hc.job.num),
        experiment=experiment,
        swept_keys=swept or None,
        searching=searching,
    )
