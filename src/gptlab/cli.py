"""The command-line task behind `python train.py`: clear errors for bad input, the metric a sweeper reads."""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, OmegaConf

from gptlab.errors import (
    ConfigError,
    DataError,
    DiskFullError,
    NonFiniteLossError,
    PreparationStopped,
    RankLostError,
    RunRequeued,
    SweepStopped,
    signal_name,
)
from gptlab.runs.layout import CLAIM_FILE, HYDRA_DIR, RUN_FILE
from gptlab.runs.naming import is_multirun


class ArgumentParser(argparse.ArgumentParser):
    """The scripts' argument parser: argparse's, whose refusal of an option it does not know names the
    closest one it does (``--basline``: "Did you mean --baseline?"), as ``train.py`` does for a mistyped
    choice or key. Its usage line is the command that runs the script (``usage: python
    scripts/compare.py ...``, as scripts/generate.py's), and its refusals begin as the scripts' own do
    (``compare: error: ...``, status 2)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
        if (
            "prog" not in kwargs
            and script is not None
            and script.suffix == ".py"
            and script.parent.name == "scripts"
        ):
            kwargs["prog"] = f"python scripts/{script.name}"
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:
        self.print_usage(sys.stderr)
        self.exit(2, f"{Path(self.prog.split()[-1]).stem}: error: {message}\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = self.parse_known_args(args, namespace)
        self.refuse_unknown(extras)
        return parsed

    def parse_intermixed_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = self.parse_known_intermixed_args(args, namespace)
        self.refuse_unknown(extras)
        return parsed

    def refuse_unknown(self, extras: list[str]) -> None:
        """Refuse the arguments ``extras`` that the parser does not take (none: nothing to do), each
        mistyped flag with the closest one it does take (a script that passes the rest on, as Hydra
        overrides, calls it with the flags left over)."""
        if not extras:
            return
        flags = [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]
        close = {}  # each mistyped flag: the closest flag the script takes
        for extra in extras:
            name = extra.split("=", 1)[0]
            match = difflib.get_close_matches(name, flags, n=1) if name.startswith("-") else []
            if match:
                close[name] = match[0]
        hint = ""
        if len(close) == 1:
            hint = f" Did you mean {next(iter(close.values()))}?"
        elif close:
            hint = " Did you mean " + ", ".join(f"{flag} for {name}" for name, flag in close.items()) + "?"
        self.error(f"unrecognized arguments: {' '.join(extras)}.{hint}")


def group_choices(group: str) -> str:
    """The choices of a config group on Hydra's search path (e.g. ``hydra/launcher``), comma-separated: the
    help page lists Hydra's own groups through it, read when the page is shown."""
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        return ""
    return ", ".join(sorted(GlobalHydra.instance().config_loader().get_group_options(group)))


#: What each config group of conf/ swaps, a line each on ``python train.py --help`` (tests/test_entry_point.py
#: checks that every group has one); docs/configuration.md has the table and the keys.
GROUP_SUMMARIES = {
    "model": "depth, width, heads and context (tiny ~ 6.8M parameters ... gpt3 175B, meta device only)",
    "pos": "the positional encoding",
    "activation": "the feed-forward network's non-linearity (swiglu, geglu, reglu: gated)",
    "norm": "Add & Norm: LayerNorm or RMSNorm (norm.placement below)",
    "attention": "QK-norm, sliding windows, logit softcap, output gate, value residual, differential",
    "mlp": "the feed-forward layer: the dense MLP, or a Mixture of Experts (mlp=moe)",
    "mtp": "multi-token prediction: extra heads trained to predict further tokens (mtp.depth; 0: off)",
    "tokenizer": "tokenization: GPT-2's byte-pair encoding, a word vocabulary, characters",
    "data": "the corpus, its windows and document masking (data.path / data.name below)",
    "optim": "the optimizer and its learning-rate schedule (optim.schedule below)",
    "loss": "how the output layer and its cross-entropy are computed (loss.impl below), z-loss, softcap",
    "trainer": "steps, devices, precision, validation: every trainer.* key goes to lightning.Trainer",
    "strategy": "the parallel strategy, for trainer.devices > 1 or several nodes",
    "logger": "experiment tracking (W&B offline unless logged in); several at once: 'logger=[wandb,csv]'",
    "callbacks": "checkpoints, the progress line, samples at each validation, the spike detector",
    "paths": "where run directories and token caches go",
    "debug": "a 10-step run of a very small model: does the command work?",
    "experiment": "a sweep preset, run with -m",
    "hparams_search": "an Optuna search over the learning rate and the warmup, run with -m",
    "word2vec": "the options of task=word2vec",
}


@dataclass(frozen=True)
class KeyChoices:
    """A choice made by a key rather than a group (``loss.impl=chunked``), for the help page. ``values`` are
    the accepted ones, in the order the code lists them (tests check them against it); empty for a key whose
    value is free (a path), which ``shown`` then describes."""

    key: str
    values: tuple[str, ...]
    summary: str
    shown: str = ""


#: The help page's choices made by a key: the values each takes and what it chooses.
KEY_CHOICES = (
    KeyChoices(
        "task", ("gpt", "word2vec"), "what to train: the language model, or word vectors (word2vec.*)"
    ),
    KeyChoices(
        "loss.impl",
        ("auto", "chunked", "torch", "plain", "liger", "cce"),
        "how the output layer and its loss are computed, same loss (auto: chunked); liger and cce: CUDA kernels",
    ),
    KeyChoices(
        "data.path",
        (),
        "txt/jsonl/json/parquet/csv files, a glob or a folder; or nanoGPT's / llm.c's token files",
        "data.path=<files>",
    ),
    KeyChoices(
        "data.name",
        (),
        "a Hugging Face hub dataset (network; data.config_name, data.split); with neither: the embedded corpus",
        "data.name=<dataset>",
    ),
    KeyChoices("norm.placement", ("pre", "post", "sandwich"), "where the norms sit around each sublayer"),
    KeyChoices("optim.schedule", ("cosine", "wsd"), "after the warmup: cosine decay, or warmup-stable-decay"),
    KeyChoices(
        "compile",
        ("auto", "true", "false"),
        "torch.compile per block (auto: on CUDA, off on a CPU, as the run says)",
    ),
)

HELP_INDENT = "    "
HELP_WIDTH = 110


def _chosen(values: list[str], current: Any) -> str:
    """``values`` comma-separated, the one this command takes marked with a ``*``."""
    return ", ".join(f"{value}*" if value == str(current) else value for value in values)


def _wrapped(text: str) -> str:
    import textwrap

    return textwrap.fill(
        text, HELP_WIDTH, initial_indent=HELP_INDENT, subsequent_indent=HELP_INDENT, break_on_hyphens=False
    )


def help_groups(*, _root_: DictConfig) -> str:
    """The help page's config groups: each group of conf/ (the same list as Hydra's own page), what it swaps
    (:data:`GROUP_SUMMARIES`), and its choices with the one this command takes marked (``pos=rope --help``
    marks rope). Read when the page is shown, so it lists the YAML files that are there."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    if not GlobalHydra.instance().is_initialized():
        return ""
    loader = GlobalHydra.instance().config_loader()
    taken = OmegaConf.select(_root_, "hydra.runtime.choices", default=None) or {}
    lines = []
    for group in sorted(loader.list_groups("")):
        options = sorted(loader.get_group_options(group, ObjectType.CONFIG))
        if group == "hydra" or not options:
            continue
        lines.append(f"{group}: {GROUP_SUMMARIES.get(group, '')}".rstrip())
        lines.append(_wrapped(_chosen(options, taken.get(group))))
    return "\n".join(lines)


def help_keys(*, _root_: DictConfig) -> str:
    """The help page's choices made by a key (:data:`KEY_CHOICES`), the value this command takes marked."""
    lines = []
    for choice in KEY_CHOICES:
        current = OmegaConf.select(_root_, choice.key, default=None)
        if isinstance(current, bool):
            current = str(current).lower()
        shown = choice.shown or f"{choice.key}: {_chosen(list(choice.values), current)}"
        lines.append(shown)
        lines.append(_wrapped(choice.summary))
    return "\n".join(lines)


def register_help_resolver() -> None:
    """``${gptlab_choices:GROUP}``, ``${gptlab_groups:}`` and ``${gptlab_keys:}`` for
    conf/hydra/help/gptlab.yaml."""
    for name, resolver in (
        ("gptlab_choices", group_choices),
        ("gptlab_groups", help_groups),
        ("gptlab_keys", help_keys),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


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


#: A node's key -> how other nodes (or other tools) spell the same setting: a key typed under the wrong node
#: (word2vec.every_n_steps=100) far from any of that node's own spellings (difflib finds none) is answered with
#: the node's key for it (word2vec.checkpoint_every). One way only: ``every_n_steps`` is also the evaluation's
#: and the progress bar's interval, which no other spelling here means.
SAME_SETTING_ELSEWHERE: dict[str, tuple[str, ...]] = {
    # how often a checkpoint is written: word2vec's, and callbacks.last_checkpoint's (Lightning's name)
    "checkpoint_every": ("every_n_steps", "every_n_train_steps", "save_every"),
    "every_n_train_steps": ("checkpoint_every", "save_every"),
    # the embedding width: word2vec's, the model's (nanoGPT's name), and the common others
    "dim": ("n_embd", "d_model", "hidden_size", "embedding_dim"),
    "n_embd": ("dim", "d_model", "hidden_size", "embedding_dim"),
    # state in CPU memory: strategy=fsdp's switch, and the DeepSpeed strategies' two
    "cpu_offload": ("offload", "offload_optimizer", "offload_parameters"),
    "offload_optimizer": ("offload", "cpu_offload"),
    "offload_parameters": ("offload", "cpu_offload"),
    # the learning rate: optim's and word2vec's, as Hugging Face spells it
    "lr": ("learning_rate",),
}


def same_setting(key: str, keys: list[str]) -> list[str]:
    """The keys among ``keys`` (one node's) that spell the setting ``key`` names elsewhere
    (:data:`SAME_SETTING_ELSEWHERE`)."""
    return [k for k in keys if key in SAME_SETTING_ELSEWHERE.get(k, ())]


def unknown_key(error: Exception) -> str | None:
    """gptlab's message for Hydra's refusal to override a key that does not exist (``optim.lrr=1e-3``,
    ``modle=small``): the node's keys and the closest one, with the value typed, instead of Hydra's advice to
    add the key with ``+`` (which a mistyped key only turns into a second refusal). A key close to one of
    Lightning's Trainer arguments that conf/trainer leaves out is suggested with its ``+``. None for any other
    composition error: Hydra's message stands."""
    from omegaconf import DictConfig
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = error.__cause__
    message = str(error)
    if not isinstance(cause, (ConfigAttributeError, ConfigKeyError)) or not message.startswith(
        "Could not override"
    ):
        return None
    node, key, full_key = cause.parent_node, cause.key, cause.full_key
    if not isinstance(node, DictConfig) or not isinstance(key, str) or not full_key:
        return None
    typed = message.rsplit("use +", 1)[-1].strip() if "use +" in message else str(full_key)
    # a sweep's job has one value of the override (optim.lrr=0.001); the command line has what was typed
    # (optim.lrr=1e-3,1e-2), which the suggestion keeps
    typed = next((arg for arg in sys.argv[1:] if arg.split("=", 1)[0] == str(full_key)), typed)
    value = typed.split("=", 1)[1] if "=" in typed else None
    owner = str(full_key).rsplit(".", 1)[0] if "." in str(full_key) else ""
    keys = [str(k) for k in node.keys() if not (owner == "" and k == "hydra")]
    if not keys:  # a key under a value (trainer.devices.x=1): Hydra's message names it well enough
        return None
    added: list[str] = []  # keys a node takes beyond those its YAML lists: Lightning's Trainer arguments
    if owner == "trainer":
        from gptlab.preflight import trainer_arguments

        added = [name for name in trainer_arguments() if name not in keys]

    def dotted(name: str) -> str:
        return f"{owner}.{name}" if owner else name

    close = difflib.get_close_matches(key, keys + added, n=1)
    synonyms = same_setting(key, keys) if owner else []
    if close:
        fix = "+" + dotted(close[0]) if close[0] in added else dotted(close[0])
        hint = f" Did you mean {fix}{'=' + value if value is not None else ''}?"
        if close[0] in added:
            hint += f" ({dotted(close[0])} is a Lightning Trainer argument that conf/trainer leaves out.)"
    elif not owner:
        # a key of a node typed at the top (max_steps=100): the nested key of that name, never the + that
        # would add a top-level key no part of gptlab reads (refused: config.check_top_level)
        from gptlab.config import dotted_keys

        nested = sorted(p for p in dotted_keys(node, skip={"hydra"}) if p.rsplit(".", 1)[-1] == key)
        suffix = "=" + value if value is not None else ""
        hint = f" Did you mean {' or '.join(p + suffix for p in nested)}?" if nested else ""
    elif synonyms:  # the setting as another node spells it (word2vec.n_embd): this node's spelling
        suffix = "=" + value if value is not None else ""
        hint = f" Did you mean {' or '.join(dotted(k) + suffix for k in synonyms)}? ({owner}'s name for that setting.)"
    else:
        hint = f" A key the config leaves out is added with a leading +: +{typed}."
    where = f"{owner} has no key {key!r}" if owner else f"The config has no key or group {key!r}"
    listed = ", ".join(dotted(k) for k in keys)
    return f"{where} ({typed}). Its keys: {listed}.{hint}"


def version_line() -> str:
    """gptlab's version, and those of the packages a bug report needs beside it, on one line. The versions
    are read from the installed packages' metadata: answering ``--version`` imports neither torch nor
    Lightning."""
    from importlib import metadata

    # the package this module is in, imported before it: read, not imported (the package's lazy exports
    # import gptlab.api, which imports this module)
    version = sys.modules[__package__ or "gptlab"].__version__

    def installed(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    others = ", ".join(f"{name} {installed(name)}" for name in ("torch", "lightning", "hydra-core"))
    return f"gptlab {version} ({others}, Python {sys.version.split()[0]})"


def state_gptlab_version() -> None:
    """``python train.py --version`` answers with :func:`version_line` (status 0), and ``--help`` lists the
    flag as that. Hydra's parser owns the flag and would name Hydra's version alone; ``hydra.main`` builds
    the parser through its module's ``get_args_parser``, which this wraps (as :func:`suggest_choices` wraps
    Hydra's report). Where a Hydra release lacks the function or the flag, Hydra's answer stands."""
    import importlib

    hydra_main: Any = importlib.import_module(
        "hydra.main"
    )  # the module: ``hydra.main`` is also the decorator
    original = getattr(hydra_main, "get_args_parser", None)
    if original is None or getattr(original, "states_gptlab_version", False):
        return

    def get_args_parser() -> argparse.ArgumentParser:
        parser = original()
        parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the line unwrapped at 80 columns
        for action in parser._actions:
            if "--version" in action.option_strings and hasattr(action, "version"):
                action.version = version_line()
                action.help = "Show gptlab's version (and torch's, Lightning's, Hydra's, Python's) and exit"
        return parser

    get_args_parser.states_gptlab_version = True  # type: ignore[attr-defined]
    hydra_main.get_args_parser = get_args_parser


#: conf/hydra/launcher's YAMLs whose name is also an installed launcher plugin's ConfigStore entry (the joblib
#: plugin stores its schema as hydra/launcher/joblib): each YAML carries every field the plugin reads.
LAUNCHER_YAMLS_NAMED_AS_THEIR_PLUGIN = ("joblib",)


def prefer_launcher_yamls() -> dict[str, Any]:
    """A launcher YAML of conf/ named as its plugin's ConfigStore entry (``joblib``) is the one config
    ``hydra/launcher=joblib`` loads. Hydra finds the plugin's entry of that name and validates the YAML against
    it by name, a matching it deprecated since 1.1, with a warning from every process of the sweep (the command's
    composition and each joblib worker's). The plugins' registration runs when Hydra scans them, once a process
    (``Plugins.instance()``, which re-imports their modules), so the same-named entry is dropped after that scan;
    the workers receive the ConfigStore as it stands then. Returns the entries dropped, for
    :func:`restore_launcher_entries` (``gptlab.compose()`` drops them for its composition only)."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()
    launchers = ConfigStore.instance().repo.get("hydra", {}).get("launcher", {})
    dropped = {}
    for name in LAUNCHER_YAMLS_NAMED_AS_THEIR_PLUGIN:
        entry = launchers.pop(f"{name}.yaml", None)
        if entry is not None:
            dropped[f"{name}.yaml"] = entry
    return dropped


def restore_launcher_entries(dropped: dict[str, Any]) -> None:
    """Put back the ConfigStore entries :func:`prefer_launcher_yamls` dropped: a process that composes its own
    Hydra app after ``gptlab.compose()`` finds the plugins' schemas as Hydra registered them."""
    from hydra.core.config_store import ConfigStore

    repo = ConfigStore.instance().repo
    repo.setdefault("hydra", {}).setdefault("launcher", {}).update(dropped)


def suggest_choices() -> None:
    """A mistyped choice or key refused as gptlab refuses bad input: ``gptlab: error: ... Did you mean
    pos=sinusoidal?`` (or ``optim.lr=1e-3?``), status 2, without Hydra's config search path.

    Hydra composes the config, and reports a failure to compose, inside ``hydra._internal.utils.
    run_and_report``, before any code of the task runs; its public API has no hook there (callbacks start
    after composition). This wraps that function so that a MissingConfigException of a known group, or an
    override of a key that does not exist, is reported here, and everything else exactly as Hydra does.
    Where a Hydra release lacks the function, or ``HYDRA_FULL_ERROR=1`` asks for the stack trace, Hydra's
    report stands."""
    from hydra._internal import utils as hydra_utils

    original = getattr(hydra_utils, "run_and_report", None)
    if original is None or getattr(original, "suggests_choices", False):
        return

    def run_and_report(func: Callable[[], Any]) -> Any:
        def composed_or_refused() -> Any:
            from hydra.errors import ConfigCompositionException, MissingConfigException

            global _sweep
            _new_dirs.clear()  # what this command makes is noted anew (a process may run several: the docs' tests)
            _sweep = None  # a sweep a stop signal ended never reached its closing lines
            _failed_jobs.clear()
            try:
                return func()
            except (MissingConfigException, ConfigCompositionException) as e:
                explain = unknown_choice if isinstance(e, MissingConfigException) else unknown_key
                message = None if os.environ.get("HYDRA_FULL_ERROR") == "1" else explain(e)
                if message is None:
                    raise
                _remove_refused_sweep_dir()
                print(f"gptlab: error: {message}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
            except Exception as e:
                if _sweep is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                end_failed_sweep(e)  # a job of a sweep failed: Hydra raises its error after the last job
                raise

        return original(composed_or_refused)

    run_and_report.suggests_choices = True  # type: ignore[attr-defined]
    hydra_utils.run_and_report = run_and_report


# ---- a refused run leaves no folder ----------------------------------------------------------------------

#: The folders this command is about to create: the run (or sweep) directory and those of its parents that do
#: not exist yet, noted before Hydra makes them (NoteNewDirectories); a refused run removes only these.
_new_dirs: set[Path] = set()


#: The environment variable that hands ``_new_dirs`` to the processes a launcher runs a sweep's jobs in
#: (joblib's): ``<pid of the command>`` then the folders, os.pathsep-separated. Those processes start from
#: the command's environment but none of its state, and a job refused there removes its folder only if the
#: command made it.
NEW_DIRS_ENV = "GPTLAB_NEW_DIRS"


def _noted_new_dirs() -> set[Path]:
    """The folders this command made: noted in this process, or, in a process a launcher started for a job
    (whose hooks noted nothing), handed down by the command in :data:`NEW_DIRS_ENV`."""
    if _new_dirs:
        return _new_dirs
    pid, *folders = os.environ.get(NEW_DIRS_ENV, "").split(os.pathsep)
    if pid and pid != str(os.getpid()):
        return {Path(f) for f in folders if f}
    return _new_dirs


def _absolute(path: Any) -> Path:
    return Path(os.path.abspath(str(path)))  # as Hydra makes runtime.output_dir


class NoteNewDirectories(HydraCallback):
    """A Hydra callback, first of conf/hydra/default.yaml's: notes which of the run directory (a sweep's
    directory, with ``-m``) and its parents do not exist yet, before anything creates them, so that a refused
    command removes what it made and never a folder that was there before (an explicit ``hydra.run.dir`` of an
    earlier run, ``resume=``)."""

    def _note(self, path: Any) -> None:
        from gptlab.runs.identity import made_by_this_process

        _new_dirs.clear()
        folder = _absolute(path)
        made = made_by_this_process()  # a default run directory is created when its name is resolved
        for candidate in (folder, *folder.parents):
            if candidate.exists() and candidate not in made:
                break
            _new_dirs.add(candidate)
        os.environ[NEW_DIRS_ENV] = os.pathsep.join([str(os.getpid()), *map(str, sorted(_new_dirs))])

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._note(config.hydra.run.dir)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._note(config.hydra.sweep.dir)


class SweepSummary(HydraCallback):
    """A Hydra callback: after the last job of a sweep, where its runs are, how they ended, and the command
    that compares them, after the last job's own lines (which say nothing of the sweep). Where a job failed,
    Hydra skips this hook (its sweeper raises the job's error after the last job): ``end_failed_sweep`` then
    says the same, and which jobs failed, each once with gptlab's message: the job's failure reaches the
    sweeper as a :class:`ReportedJobReturn`, which raises it without Hydra's own line for it."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        global _sweep
        _sweep = (Path(str(config.hydra.sweep.dir)), config.get("task"))
        _failed_jobs.clear()

    def on_job_end(self, config: Any, job_return: JobReturn, **kwargs: Any) -> None:
        # in the job's process (a launcher's worker too), before the sweeper reads the job's return
        if job_return.status == JobStatus.FAILED and hasattr(job_return._return_value, FAILED_JOB_ATTR):
            job_return.__class__ = ReportedJobReturn

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        global _sweep
        _sweep = None
        print(
            "\n".join(sweep_closing_lines(Path(str(config.hydra.sweep.dir)), config.get("task"))), flush=True
        )


#: The sweep under way in this process (its directory and task), from its start to its closing lines.
_sweep: tuple[Path, str | None] | None = None


class ReportedJobReturn(JobReturn):
    """The return of a job whose failure gptlab has reported (:func:`note_failed_job`): the sweeper that reads
    it gets the job's error raised, as from Hydra's :class:`JobReturn`, without the line Hydra writes before
    raising it (``Error executing job with overrides: [...]``, the job's whole command line), which would
    only repeat, less clearly, what gptlab says of the job. A search (Optuna) still sees the trial fail."""

    @property
    def return_value(self) -> Any:
        assert self.status != JobStatus.UNKNOWN, "return_value not yet available"
        if self.status == JobStatus.COMPLETED:
            return self._return_value
        raise self._return_value

    @return_value.setter
    def return_value(self, value: Any) -> None:
        self._return_value = value


@dataclass(frozen=True)
class FailedJob:
    """A job of a sweep that was refused (bad input) or failed in training."""

    num: int
    label: str  # what the job varies ("lr=0.01 seed=1"), as its W&B run is named
    refused: bool  # refused before training (bad input): it left no run directory
    error: Exception = field(compare=False)
    # a crash (an error that is not gptlab's: a bug): the job's log file that holds its traceback, or ""
    # where it could not be written there (then the traceback went to the console, when it happened)
    traceback_log: str | None = None

    @property
    def crashed(self) -> bool:
        return self.traceback_log is not None

    @property
    def message(self) -> str:
        if not self.crashed:
            return str(self.error)
        where = f"in {self.traceback_log}" if self.traceback_log else "above, where the job crashed"
        return f"{type(self.error).__name__}: {self.error} (its traceback is {where})"

    @property
    def ended(self) -> str:
        return "was refused" if self.refused else "crashed" if self.crashed else "failed"

    def describe(self) -> str:
        return f"job #{self.num} ({self.label}) {self.ended}: {self.message}"


#: The failed jobs of the sweep under way, in the order they ran (Hydra's basic launcher runs them in this
#: process; a launcher that runs them elsewhere reports only the first failure's error, in ``end_failed_sweep``).
_failed_jobs: list[FailedJob] = []
#: The attribute of a failed job's error that holds its (number, label, refused, traceback log, the stderr its
#: worker printed its message to), set by note_failed_job.
FAILED_JOB_ATTR = "gptlab_sweep_job"


def note_failed_job(error: Exception, refused: bool, crashed: bool = False) -> None:
    """Say at once that this job of a sweep failed (a grid sweep goes on to its next job, whose lines follow;
    a search such as Optuna's stops at a failed trial unless told to bear some), and keep it for the sweep's
    closing lines, which give its message: here one line names the job, so that the message is said once.
    A job run in another process (a joblib worker, whose sweep's closing lines know only the first failed
    job) says its message here. ``crashed``: an error that is not gptlab's (a bug): its traceback goes to the
    job's log file, which the message names."""
    from gptlab.runs.naming import labels_from_hydra

    hydra = HydraConfig.get()
    labels = labels_from_hydra(hydra)
    log = _write_traceback(error, hydra) if crashed else None
    job = FailedJob(int(hydra.job.num), labels.name or " ".join(labels.overrides), refused, error, log)
    _failed_jobs.append(job)
    # A launcher that runs the job in another process (joblib) hands the sweep this error pickled, without
    # _failed_jobs: the job's number and label travel with it (an exception's attributes are pickled), and
    # where its message was printed, so that the sweep's last line does not say it again on the same console.
    printed_to = _stderr_identity() if _sweep is None else None
    setattr(error, FAILED_JOB_ATTR, (job.num, job.label, job.refused, job.traceback_log, printed_to))
    if _sweep is None:  # a launcher's worker: the sweep's process does not hold this job
        print(f"\ngptlab: {job.describe()}", file=sys.stderr, flush=True)
    else:
        print(
            f"\ngptlab: job #{job.num} ({job.label}) {job.ended}; the sweep's closing lines say why",
            file=sys.stderr,
            flush=True,
        )


def _stderr_identity() -> tuple[int, int] | None:
    """The file this process's stderr writes to (its device and inode: a terminal, a pipe, a log file), or
    None where it has none: a launcher's worker that inherited the command's stderr gives the command's."""
    try:
        stat = os.fstat(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # no stderr, or one without a file descriptor
        return None
    return (stat.st_dev, stat.st_ino)


def _write_traceback(error: Exception, hydra: Any) -> str:
    """Append ``error``'s traceback to the job's log file (Hydra's ``<run dir>/<job name>.log``, which its
    other log lines are in) and return the file's path; where it cannot be written, print the traceback to
    the console and return ""."""
    import logging
    import traceback

    path = Path(str(hydra.runtime.output_dir)) / f"{hydra.job.name}.log"
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    for handler in logging.getLogger().handlers:  # the job's own log lines first, in order
        handler.flush()
    try:
        with path.open("a") as f:
            f.write(f"job #{hydra.job.num} crashed:\n{text}")
    except OSError:
        print(text, file=sys.stderr, flush=True)
        return ""
    return str(path)


def end_failed_sweep(error: Exception) -> None:
    """The end of a sweep whose job failed (Hydra raises the first failed job's error once the last job has
    run): the sweep's closing lines, then every failed job with its message, exit status 2 where every one
    was refused (bad input), else 1. An error that is not gptlab's (a bug) returns, for Hydra's traceback."""
    global _sweep
    assert _sweep is not None
    sweep_dir, task = _sweep
    _sweep = None
    print("\n".join(sweep_closing_lines(sweep_dir, task)), flush=True)
    ours = (ConfigError, DataError, NonFiniteLossError, DiskFullError, RankLostError)
    # the error Hydra raises is the first failed job's own, where the jobs ran in this process
    failed = list(_failed_jobs) if any(job.error is error for job in _failed_jobs) else []
    _failed_jobs.clear()
    if not failed:  # the jobs ran in other processes (joblib, SLURM): their first error is all there is
        noted = getattr(error, FAILED_JOB_ATTR, None)
        if noted is None and not isinstance(error, ours):
            return
        refused = isinstance(error, (ConfigError, DataError))
        if noted is not None:  # each job's own line was printed where it ran
            num, label, _, log, printed_to = noted
            first = FailedJob(int(num), str(label), refused, error, log)
            # joblib's workers write to this command's stderr: their line, above, gave the message; a worker
            # whose stderr is elsewhere (a SLURM job's log file) said it where the user may not look
            said = printed_to is not None and printed_to == _stderr_identity()
            named = f"job #{first.num} ({first.label}) {first.ended} (its message is above)"
            what = named if said else first.describe()
            print(
                f"\ngptlab: error: the first job of the sweep that did not run to the end: {what}",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(f"\ngptlab: error: a job of the sweep failed: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2 if refused else 1) from None
    jobs = f"{len(failed)} job{'s' if len(failed) != 1 else ''}"
    lines = [f"gptlab: error: {jobs} of the sweep did not run to the end:"]
    lines += [f"  {job.describe()}" for job in failed]
    print("\n" + "\n".join(lines), file=sys.stderr, flush=True)
    raise SystemExit(2 if all(job.refused for job in failed) else 1) from None


def sweep_closing_lines(sweep_dir: Path, task: str | None = None) -> list[str]:
    """The closing lines of a sweep: its runs (how many finished, stopped or failed) and where they are, and
    for language models the command that compares them."""
    from collections import Counter

    from gptlab.runs.layout import Run, find_run_dirs

    runs = find_run_dirs(sweep_dir)
    ended: Counter[str] = Counter()
    for run_dir in runs:
        result = Run(run_dir).result() or {}
        ended[
            "failed"
            if "failed" in result
            else "stopped"
            if result.get("stopped_by_signal")
            else "finished"
            if result.get("finished")
            else "without a result"
        ] += 1
    how = ", ".join(f"{n} {status}" for status, n in ended.items())
    lines = [
        f"Sweep: {len(runs)} run{'s' if len(runs) != 1 else ''} in {sweep_dir}" + (f" ({how})" if how else "")
    ]
    if (task or "gpt") == "gpt" and runs:
        where = shlex.quote(str(sweep_dir))
        lines.append(f"Compare them: python scripts/compare.py {where}")
    return lines


def sweep_stopped_lines(stop: SweepStopped, hydra: Any, argv: list[str] | None = None) -> list[str]:
    """What a sweep that a stop signal ended says: the job it stopped in, the sweep's runs so far, and the
    command that continues it (``resume=auto`` in the same sweep directory: each job continues its own
    ``<sweep dir>/<job number>``; a finished one says so and does nothing)."""
    sweep_dir = str(hydra.sweep.dir)
    args = list(sys.argv if argv is None else argv)
    rest = [a for a in args[1:] if a.lstrip("+").split("=", 1)[0] != "resume"]
    if not any(a.lstrip("+").startswith("hydra.sweep.dir=") for a in rest):
        rest.append(f"hydra.sweep.dir={sweep_dir}")
    overrides = " ".join(str(o) for o in hydra.overrides.task)
    return [
        f"{signal_name(stop.signum)} stopped the sweep in job #{hydra.job.num} ({overrides}), after saving its "
        "checkpoint; the jobs after it did not start.",
        sweep_closing_lines(Path(sweep_dir))[0],
        "Continue the sweep (finished jobs stay as they are, a stopped one continues from its checkpoint, the "
        f"others start): {shlex.join(['python', args[0], *rest, 'resume=auto'])}",
    ]


def stopped_before_training_lines(signum: int = signal.SIGINT) -> str:
    """What a Ctrl-C (or a SIGTERM while a token cache is prepared) before the first training step says:
    nothing was trained or kept half-made, and the command that starts again (in a sweep, the one that
    continues it: its finished jobs stay as they are)."""
    message = (
        f"{signal_name(signum)} stopped the run before its first training step: nothing was trained, and nothing was left "
        "half-written (a token cache is written whole or not at all; the checkpoints of a resumed run are as "
        "they were)."
    )
    if not is_multirun():
        return f"{message} The same command starts again."
    hydra = HydraConfig.get()
    stop = SweepStopped(signum, Path(str(hydra.runtime.output_dir)))
    lines = sweep_stopped_lines(stop, hydra)
    return "\n".join([message, *lines[1:]])


def remove_refused_run_dir(run_dir: Path, job_log: str) -> bool:
    """Remove ``run_dir`` after a refusal when this command created it (it, or a folder above it, did not
    exist when the command started) and it holds only what a refused run writes: Hydra's ``.hydra/`` and
    job log (``job_log``), and ``run.json``. Then the emptied parents this command created. Returns whether
    the run directory was removed."""
    return _remove_new_folder(_absolute(run_dir), {HYDRA_DIR, job_log, RUN_FILE, CLAIM_FILE})


def _remove_new_folder(folder: Path, leftovers: set[str]) -> bool:
    made = _noted_new_dirs()
    if not made & {folder, *folder.parents}:
        return False
    try:
        found = {entry.name for entry in folder.iterdir()}
    except OSError:
        return False
    if not found <= leftovers:
        return False
    _close_logs_in(folder)
    shutil.rmtree(folder, ignore_errors=True)
    for parent in folder.parents:
        if parent not in made:
            break
        try:
            parent.rmdir()  # only an empty one: a sweep's other jobs, or a run started beside, stay
        except OSError:
            break
    return not folder.exists()


def _close_logs_in(folder: Path) -> None:
    """Detach and close the log files (Hydra's ``train.log``) that point into ``folder`` before it goes: a
    process that goes on (a notebook, a test running train.py in-process) would otherwise log into a file
    whose folder no longer exists."""
    import logging

    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for logger in loggers:
        for handler in list(logger.handlers):
            name = getattr(handler, "baseFilename", None)
            if name and folder in Path(name).parents:
                logger.removeHandler(handler)
                handler.close()


def _remove_refused_sweep_dir() -> None:
    """A sweep refused before its first job (a mistyped choice among its values): the sweep directory it
    made holds only Hydra's ``multirun.yaml``."""
    if _new_dirs:
        _remove_new_folder(max(_new_dirs, key=lambda p: len(p.parts)), {"multirun.yaml"})


def _remove_refused_run_dir() -> None:
    if HydraConfig.initialized():
        hydra = HydraConfig.get()
        remove_refused_run_dir(Path(hydra.runtime.output_dir), f"{hydra.job.name}.log")


def run_task(cfg: DictConfig) -> float | None:
    from gptlab.tasks import task_runner
    from gptlab.tasks.collector import freezing_while_starting

    try:
        with freezing_while_starting():  # start-up's garbage collections walk its imports once
            metrics = task_runner(cfg)(cfg)
    except (ConfigError, DataError) as e:
        _remove_refused_run_dir()  # nothing ran: a folder holding no metrics would only be in the way
        if is_multirun():
            note_failed_job(e, refused=True)
            raise  # the sweep goes on; Hydra marks the job failed (an Optuna trial too)
        print(f"\ngptlab: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except (NonFiniteLossError, DiskFullError, RankLostError) as e:
        if is_multirun():
            note_failed_job(e, refused=False)
            raise
        print(f"\ngptlab: training failed: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except SweepStopped as stop:
        print("\n".join(sweep_stopped_lines(stop, HydraConfig.get())), flush=True)
        raise SystemExit(stop.exit_status) from None
    except RunRequeued:
        # SLURM requeued the job (its log has said so): status 0, a plain SystemExit as SLURM and a launcher's
        # job runner have always seen it
        raise SystemExit(0) from None
    except KeyboardInterrupt as stop:
        # Ctrl-C before training's own handler took the signal over (preparing the data, building the model,
        # starting the loggers), or a SIGTERM while a token cache is prepared (a scheduler preempting the
        # job); from the first step on, training saves and stops, and the studies after it end cleanly.
        # Nothing of the run was made yet: a folder this command made for it goes, as a refused run's does,
        # and a token cache under way removed its unfinished files on the way out. The exit status is 128 +
        # the signal's number, as a shell reports a process that signal ended (143 for SIGTERM: what SLURM
        # and Kubernetes take for a terminated job, not a failed one).
        signum = stop.signum if isinstance(stop, PreparationStopped) else signal.SIGINT
        _remove_refused_run_dir()
        print(f"\ngptlab: {stopped_before_training_lines(signum)}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None
    except Exception as e:
        # A crash (a bug, not bad input): a single run's traceback is Hydra's to print; in a sweep it goes to
        # the job's log file, and the sweep's closing lines name the job, its error and that file.
        if is_multirun() and os.environ.get("HYDRA_FULL_ERROR") != "1":
            note_failed_job(e, refused=False, crashed=True)
        raise
    metric = cfg.get("optimized_metric")
    return metrics.get(metric) if metric else None
