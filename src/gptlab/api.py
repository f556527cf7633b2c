"""The Python API: compose a config, train it, load a run, compare runs, from a notebook or a script.

Each call goes through what ``python train.py`` and ``scripts/compare.py`` go through, so that a run made here
is a run like any other: Hydra composes ``conf/train.yaml`` with the same defaults and overrides, the typed
parse (:mod:`gptlab.config`) refuses a bad value with the same message, and :func:`train` runs Hydra's job and
the task's run skeleton (:mod:`gptlab.tasks.skeleton`): the run directory claimed, ``.hydra/``, ``run.json``,
the loggers, ``config_resolved.yaml`` and ``result.json``. ``scripts/compare.py`` and ``resume=auto`` find it.

    import gptlab
    cfg = gptlab.compose("debug=fast", "pos=rope", "tokenizer=char", "logger=csv")
    result = gptlab.train(cfg)                  # a new directory under outputs/runs, as train.py makes
    result.metrics["val/loss"], result.run_dir
    run = gptlab.load_run(result.run_dir)       # the model on the CPU, its tokenizer and config
    run.generate("The")
    gptlab.compare("outputs/multirun/<date>/<time>").to_frame()

The parts of a run, built from a composed config by the parse and the steps ``python train.py`` takes, so that
a part built here is the part it trains:

    tokenizer = gptlab.build_tokenizer(cfg)
    model = gptlab.build_model(cfg, tokenizer)   # gptlab.build_model_config(cfg, tokenizer): its GPTConfig
    datamodule = gptlab.build_datamodule(cfg)
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import os
import random
import re
import signal
import sys
import tempfile
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from gptlab.errors import ConfigError, DataError, RunRequeued

if TYPE_CHECKING:
    import torch
    from hydra._internal.hydra import Hydra

    from gptlab.comparison.records import RunRecord
    from gptlab.comparison.table import Row
    from gptlab.data.datamodule import GPTDataModule
    from gptlab.data.sources import DataSpec
    from gptlab.data.tokenizers import Tokenizer
    from gptlab.model.config import GPTConfig
    from gptlab.model.gpt import GPT
    from gptlab.runs.trained import TrainedRun

log = logging.getLogger("gptlab")

#: The root config ``python train.py`` composes (conf/train.yaml).
CONFIG_NAME = "train"
#: Hydra's job name: the job's log file is ``<run dir>/train.log``, as for ``python train.py``.
JOB_NAME = "train"

# compose()'s overrides, by the id of the config it returned: train(cfg) records them as the run's overrides
# (.hydra/overrides.yaml), as the command line's are. An entry goes with its config.
_OVERRIDES: dict[int, tuple[str, ...]] = {}


# ---- compose ------------------------------------------------------------------------------------------


def _override_list(items: Sequence[Any]) -> list[str]:
    """Overrides given as strings, lists of strings, or both."""
    out: list[str] = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, (list, tuple)) and all(isinstance(x, str) for x in item):
            out.extend(item)
        else:
            raise TypeError(
                f"an override is a string such as 'pos=rope' (or a list of them), not {type(item).__name__}: "
                f"{item!r}"
            )
    return out


@contextmanager
def _hydra() -> Iterator[Hydra]:
    """Hydra initialised on gptlab's config folder, as ``python train.py`` initialises it; a Hydra the caller
    had initialised (their own ``initialize_config_dir``) is put back afterwards."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import JobRuntime
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    from gptlab.cli import prefer_launcher_yamls, register_help_resolver, restore_launcher_entries
    from gptlab.registry import CONFIG_DIR
    from gptlab.runs.resume import register_resolvers

    register_resolvers()  # conf/hydra chooses the run directory through them, as train.py registers them
    register_help_resolver()
    from hydra.core.hydra_config import HydraConfig

    backup, job = get_gh_backup(), copy.deepcopy(JobRuntime.instance().conf)  # the job's name lives there
    job_config = HydraConfig.instance().cfg  # a job's config (ours, when refused, lacks its output_dir)
    GlobalHydra.instance().clear()
    # conf/hydra/launcher/joblib.yaml loaded without Hydra's warning of the plugin's same-named schema, as
    # train.py loads it; the schema is put back for the caller's own Hydra apps
    dropped = prefer_launcher_yamls()
    try:
        with initialize_config_dir(str(CONFIG_DIR), job_name=JOB_NAME, version_base="1.3"):
            hydra = GlobalHydra.instance().hydra
            assert hydra is not None
            yield hydra
    finally:
        restore_launcher_entries(dropped)
        restore_gh_from_backup(backup)
        JobRuntime.instance().conf = job
        HydraConfig.instance().cfg = job_config


def _hydra_refusal(error: Exception) -> ConfigError:
    """Hydra's refusal of an override (a choice or key that does not exist, bad syntax) as a ConfigError
    whose message is what ``python train.py`` prints for it."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    from gptlab.cli import unknown_choice, unknown_key

    if isinstance(error, MissingConfigException):  # a mistyped choice: its group's choices, the closest one
        choices = unknown_choice(error)
        if choices is not None:
            return ConfigError(choices)
    keys = unknown_key(error)  # a mistyped key: its node's keys, the closest one
    if keys is not None:
        return ConfigError(keys)
    message = str(error)
    cause = error.__cause__
    if isinstance(cause, OmegaConfBaseException):  # Hydra's report prints the cause under its own line
        message += "\n" + str(cause)
    return ConfigError(message)


def check(cfg: DictConfig) -> None:
    """The checks ``python train.py`` makes of a composed config before anything runs: the task exists, its
    ``plugins`` import, and its typed config parses (:func:`gptlab.config.parse_gpt` for ``task=gpt``).
    Raises :class:`~gptlab.errors.ConfigError` with the message the command line prints."""
    from gptlab.tasks import task_runner

    task_runner(cfg)  # an unknown task is refused here; the user's plugins are imported
    task = cfg.get("task") or "gpt"
    if task == "gpt":
        from gptlab.config import parse_gpt

        parse_gpt(cfg)
    elif task == "word2vec":
        from gptlab.tasks.word2vec import Word2VecRunConfig

        Word2VecRunConfig.parse(cfg)


def compose(*overrides: str | Sequence[str], check_config: bool = True) -> DictConfig:
    """The config ``python train.py <overrides>`` would run, composed by Hydra from gptlab's ``conf/``
    (:data:`gptlab.CONFIG_DIR`) with the same defaults, and checked as ``train.py`` checks it
    (``check_config=False``: composed only).

        cfg = gptlab.compose("model=tiny", "pos=rope", "trainer.max_steps=20")
        cfg = gptlab.compose(["model=tiny", "pos=rope"])

    Raises :class:`~gptlab.errors.ConfigError` for an override that ``train.py`` refuses (a choice or key
    that does not exist, a value of the wrong type), with the message ``train.py`` prints."""
    from hydra import compose as hydra_compose
    from hydra.errors import HydraException

    items = _override_list(overrides)
    with _hydra():
        try:
            cfg = hydra_compose(CONFIG_NAME, overrides=items)
        except HydraException as e:
            raise _hydra_refusal(e) from e
    if check_config:
        check(cfg)
    _OVERRIDES[id(cfg)] = tuple(items)
    weakref.finalize(cfg, _OVERRIDES.pop, id(cfg), None)
    return cfg


# ---- the parts of a run ---------------------------------------------------------------------------------


def _data_spec(data: Any) -> DataSpec:
    """The corpus of the ``data`` node (the whole config is accepted too)."""
    from gptlab.data.sources import parse_data

    if isinstance(data, DictConfig) and "data" in data and "model" in data:
        data = data.data
    return parse_data(data)[0]


def build_tokenizer(node: Any, data: Any = None) -> Tokenizer:
    """The tokenizer of the ``tokenizer`` node (or of the whole config). One with a fixed vocabulary is
    built at once; one that learns its vocabulary (``fitted``) is a product of preparing the corpus of the
    ``data`` node, taken from the token cache. A training run takes it from its datamodule instead."""
    from gptlab.config import parse_tokenizer
    from gptlab.data import corpus, tokenizers

    if isinstance(node, DictConfig) and "tokenizer" in node:
        node, data = node.tokenizer, node.get("data") if data is None else data
    values = parse_tokenizer(node)
    cls = tokenizers.TOKENIZERS.get(values["name"])
    if not cls.fitted:
        return cls.create(tokenizers.options_of(values["name"], values))
    if data is None:
        raise ConfigError(
            f"tokenizer={values['name']} learns its vocabulary from a corpus: pass the data node."
        )
    return corpus.prepare(_data_spec(data), values).tokenizer


def build_model_config(cfg: DictConfig, tokenizer: Tokenizer | None = None) -> GPTConfig:
    """The GPTConfig of a composed config; ``model.vocab_size: null`` takes the tokenizer's size (built here
    when not given), a fixed size is checked against ``tokenizer`` when given."""
    from gptlab.config import parse_model, with_vocabulary

    config, from_tokenizer, _ = parse_model(cfg)
    if from_tokenizer:
        tokenizer = tokenizer or build_tokenizer(cfg)
    return with_vocabulary(config, from_tokenizer, tokenizer) if tokenizer is not None else config


def build_model(cfg: DictConfig, tokenizer: Tokenizer | None = None) -> GPT:
    """The model of a composed config, with ``model.init_from``'s weights when set, capping its logits where
    ``loss.final_softcap`` says so."""
    from gptlab.config import plain
    from gptlab.model.gpt import GPT
    from gptlab.model.head_loss import HeadLoss

    model = GPT(build_model_config(cfg, tokenizer))
    model.final_softcap = HeadLoss.from_node(plain(cfg.get("loss"))).final_softcap
    source = plain(cfg.model).get("init_from")
    if source:
        from gptlab.model.hf import load_pretrained

        load_pretrained(model, source)
    return model


def build_datamodule(cfg: DictConfig) -> GPTDataModule:
    """The datamodule ``python train.py`` would train on: the config parsed whole, as the run parses it
    (:func:`gptlab.config.parse_gpt`), then its data made by the task's own step."""
    from gptlab.config import parse_gpt
    from gptlab.tasks.gpt import make_datamodule

    return make_datamodule(parse_gpt(cfg))


# ---- a config edited after compose, as overrides --------------------------------------------------------


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}`` of a plain config tree; a list is a value."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def _override_value(value: Any) -> str:
    """A value in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return (
            repr(value)
            if math.isfinite(value)
            else ("nan" if value != value else f"{'-' if value < 0 else ''}inf")
        )
    if isinstance(value, list):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if text.startswith("${") and text.endswith("}"):  # an interpolation, kept as one
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _edits(composed: DictConfig, edited: DictConfig) -> list[str]:
    """The overrides that turn ``composed`` into ``edited`` (a config changed in Python after compose)."""
    before = _leaves(OmegaConf.to_container(composed, resolve=False))
    after = _leaves(OmegaConf.to_container(edited, resolve=False))
    removed = sorted(k for k in before if k not in after and not any(a.startswith(k + ".") for a in after))
    if removed:
        raise ConfigError(
            f"the config lacks {', '.join(removed)} that compose() gave it: a key cannot be removed from the "
            "config of a run. Compose it again with the overrides you need."
        )
    edits = []
    for key, value in after.items():
        if key not in before:
            edits.append(f"++{key}={_override_value(value)}")
        elif before[key] != value or type(before[key]) is not type(value):
            edits.append(f"{key}={_override_value(value)}")
    return edits


def _key_of(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _overrides_of(cfg: DictConfig) -> list[str]:
    """The overrides that compose ``cfg``: compose()'s, then the changes made to it in Python, checked by
    composing them again (a run records how its config was made)."""
    composed_with = _OVERRIDES.get(id(cfg))
    if composed_with is None:
        raise ConfigError(
            "this config was not made by gptlab.compose(), so its overrides are unknown and the run could "
            "not record them: pass gptlab.compose(...)'s config, or the overrides themselves, e.g. "
            "gptlab.train('model=tiny', 'pos=rope')."
        )
    overrides = list(composed_with)
    composed = compose(*overrides, check_config=False)
    edits = _edits(composed, cfg)
    if not edits:
        return overrides
    for edit in edits:  # in place of an override of the same key, which it replaces; else after them
        key = _key_of(edit)
        same = [k for k, o in enumerate(overrides) if _key_of(o) == key]
        if same:
            prefix = overrides[same[-1]][: len(overrides[same[-1]]) - len(overrides[same[-1]].lstrip("+~"))]
            overrides[same[-1]] = prefix + edit.lstrip("+")
        else:
            overrides.append(edit)
    again = compose(*overrides, check_config=False)
    if OmegaConf.to_container(again, resolve=False) != OmegaConf.to_container(cfg, resolve=False):
        raise ConfigError(
            f"the changes made to the config after compose() cannot be written as overrides ({' '.join(edits)} "
            "does not give the same config): pass them to gptlab.compose() instead."
        )
    return overrides


# ---- train ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainResult:
    """What a run reported when it ended: its ``result.json``, read back."""

    run_dir: Path
    metrics: dict[str, float]  # val/loss, val/ppl, tokens_per_second_wall, ... (a non-finite one as inf/nan)
    step: int  # the optimizer steps done
    finished: bool  # reached trainer.max_steps
    stopped: bool  # stopped by a signal (resume it with resume=auto)
    failed: str | None = None  # the error it ended with
    diverged: bool = False  # its final validation loss is no result (non-finite, or above chance)
    run_id: str | None = None  # run.json's id
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # result.json as written
    # the metrics result.json holds as missing (null: not measured, e.g. the scores of word vectors whose
    # evaluation a stop signal ended; raw names why), left out of metrics
    missing: tuple[str, ...] = ()

    @property
    def val_loss(self) -> float | None:
        """The final validation loss (nats per token); None when validation was off."""
        return self.metrics.get("val/loss")

    @classmethod
    def read(cls, run_dir: str | Path) -> TrainResult:
        """The result of the run in ``run_dir`` (its ``result.json``)."""
        from gptlab.runs.layout import RESULT_FILE, Run

        run_dir = Path(run_dir)
        result = Run(run_dir).result()
        if result is None:
            if Run.is_run_dir(run_dir):  # a run's directory: whether it still trains, or ended without one
                from gptlab.runs.trained import run_state

                raise DataError(f"{run_dir}: {run_state(run_dir)}.")
            raise DataError(
                f"{run_dir} has no {RESULT_FILE}: the run is still running, was killed, or the directory is "
                "not a run's (outputs/runs/<date>/<time>)."
            )
        from gptlab.runs.jsonfile import read_figure

        metrics, missing = {}, []
        for key, value in (result.get("metrics") or {}).items():
            figure = read_figure(value)  # "inf" and "nan" too
            if figure is not None:
                metrics[key] = figure
            elif value is None:
                missing.append(key)
        return cls(
            run_dir=run_dir,
            metrics=metrics,
            step=int(result.get("global_step") or 0),
            finished=bool(result.get("finished")),
            stopped=bool(result.get("stopped_by_signal")),
            failed=result.get("failed"),
            diverged=bool(result.get("diverged")),
            run_id=result.get("run_id"),
            raw=result,
            missing=tuple(missing),
        )


class _Tail:
    """Standard error, passed through, keeping its last characters: a Hydra callback refuses a run by
    printing ``gptlab: error: ...`` and exiting (the command line's way), which train() turns into an
    exception that carries the message."""

    def __init__(self, stream: Any, keep: int = 20_000) -> None:
        self.stream, self.keep, self.text = stream, keep, ""

    def write(self, text: str) -> int:
        self.text = (self.text + text)[-self.keep :]
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def _refusals_as_errors() -> Iterator[None]:
    tail = _Tail(sys.stderr)
    try:
        with redirect_stderr(tail):
            yield
    except SystemExit as e:
        _, said, message = tail.text.rpartition("gptlab: error: ")
        if e.code in (0, None) or not said:
            raise
        raise ConfigError(message.strip()) from None


@contextmanager
def _logging_restored() -> Iterator[None]:
    """Hydra configures logging for the job (the console, and ``<run dir>/train.log``); in a notebook the
    next cell must not log into the finished run's file: the handlers are put back as they were."""
    names = ["", "hydra", "gptlab"]
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level) for n in names}
    try:
        yield
    finally:
        for name, (handlers, level) in saved.items():
            logger = logging.getLogger(name)
            for handler in logger.handlers:
                if handler not in handlers:
                    handler.close()
            logger.handlers[:] = handlers
            logger.setLevel(level)


#: The environment variables a run sets for itself (Lightning's seed for its workers, the W&B mode it resolved,
#: the folders the command made): the caller's values are put back when train() returns. Variables a library
#: sets for the rest of the process (W&B's service address, torch's caches) stay.
RUN_ENVIRONMENT = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "WANDB_MODE", "WANDB_SILENT", "GPTLAB_NEW_DIRS")
#: The signals a run handles (gptlab.runs.signals, gptlab.training.checkpointing): their handlers are put back.
RUN_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, name)
)


def _flushing_denormals() -> bool:
    """Whether torch flushes subnormal floats to zero (``torch.set_flush_denormal``, which has no getter):
    a subnormal times one is zero then."""
    import torch

    return bool((torch.tensor([1e-40], dtype=torch.float32) * 1.0).item() == 0.0)


def _codes_with_compiled_entries() -> dict[Any, int]:
    """Every code object Dynamo has compiled in this process that holds compiled code now (its cache
    entries), with their number."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    if convert_frame is None:  # nothing compiled yet, and no need to import Dynamo to say so
        return {}
    from torch._C._dynamo import eval_frame

    # Dynamo's own bookkeeping (torch 2.11 to 2.13 have it): a torch without it keeps the compiled code
    if not (
        hasattr(getattr(convert_frame, "input_codes", None), "seen")
        and hasattr(eval_frame, "_debug_get_cache_entry_list")
        and hasattr(eval_frame, "reset_code")
    ):
        return {}
    out = {}
    for ref in list(convert_frame.input_codes.seen):
        code = ref()
        if code is not None:
            entries = len(eval_frame._debug_get_cache_entry_list(code))
            if entries:
                out[code] = entries
    return out


def _drop_compiled_code_of_the_run(before: dict[Any, int]) -> list[Any]:
    """Drop the compiled code that this run's ``torch.compile`` left (``compile=true``: every block's forward;
    FlexAttention's kernels) in the code objects that held none before it; returns those code objects.

    Dynamo keeps compiled code per code object, shared by every model of that class in the process, and at
    ``torch._dynamo.config.recompile_limit`` (8) entries it stops compiling that code and runs it
    uncompiled, silently: kept, the entries of earlier runs of other shapes (two per width) left the fifth
    such run in a notebook training uncompiled (scripts/repeated_compiled_runs.py). Dropped, each run compiles
    as in a fresh process. A code object that held compiled code before the run (the caller's own
    ``torch.compile`` of the same function) is left as it is, the run's entries with the caller's: nothing
    the caller compiled is taken. Not ``torch._dynamo.reset()``, which drops every compiled function of the
    process, the caller's among them."""
    dropped = [code for code in _codes_with_compiled_entries() if code not in before]
    if not dropped:
        return []
    import torch._dynamo.convert_frame as convert_frame
    from torch._C._dynamo import eval_frame

    with getattr(convert_frame, "compile_lock", contextlib.nullcontext()):
        for code in dropped:
            eval_frame.reset_code(code)
    return dropped


@contextmanager
def _process_left_as_it_was() -> Iterator[None]:
    """What a run changes in the process for itself, put back as the caller had it when train() returns,
    however it ends: a notebook's next cell, or the next train(), starts from the caller's state.

    - the random generators (Python's, NumPy's, torch's): the run seeds them with its ``seed``; without this
      a caller's own draws after a run (a random search's next learning rate) would repeat after each run;
    - the environment variables of :data:`RUN_ENVIRONMENT`;
    - the warnings filters the run adds (Lightning's messages it drops);
    - torch's flushing of subnormal floats (the task turns it on for speed; it changes the caller's numbers);
    - the handlers of :data:`RUN_SIGNALS` (main thread);
    - the compiled code the run's ``torch.compile`` left in code objects that held none before it
      (:func:`_drop_compiled_code_of_the_run`), the caller's own compiled functions untouched;
    - the run's objects held for the watch of lost ranks (:mod:`gptlab.parallel.ranks`: its trainer, model,
      optimizer state and data), which would keep their memory, on a GPU too, until the next run; and the
      run's objects themselves, collected at once."""
    import numpy as np
    import torch

    generators = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    environment = {name: os.environ.get(name) for name in RUN_ENVIRONMENT}
    flushing = _flushing_denormals()
    main = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in RUN_SIGNALS} if main else {}
    compiled = _codes_with_compiled_entries()
    try:
        with warnings.catch_warnings():
            yield
    finally:
        from gptlab.parallel import ranks

        ranks.clear_reporter()  # the closures the task registered name its trainer: its memory goes with them
        _drop_compiled_code_of_the_run(compiled)
        # The run's trainer, model and data hold one another in cycles, which only the cyclic collector frees,
        # whenever it next runs: collected now, their memory (the token files' maps, a GPU's tensors) is
        # free for the caller's next cell.
        gc.collect()
        for s, handler in handlers.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        torch.set_flush_denormal(flushing)
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        random.setstate(generators[0])
        np.random.set_state(generators[1])
        torch.set_rng_state(generators[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _interrupted(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C behind ``error``: a KeyboardInterrupt, or the SystemExit Lightning raises after one (it
    ends the process, the command line's way, where a notebook's kernel must go on)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return seen
        if not isinstance(seen, SystemExit):
            return None
        seen = seen.__context__
    return None


def _run_task(cfg: DictConfig) -> dict[str, float]:
    """Hydra's job: the task ``cfg.task`` names, as ``python train.py`` runs it (:func:`gptlab.cli.run_task`),
    its errors raised where the command line prints them and exits. Ctrl-C (a notebook's "interrupt the
    kernel") before training took the signal over raises KeyboardInterrupt, the folder of a run that trained
    nothing removed as ``train.py`` removes it; during training it stops the run with a checkpoint, and the
    run's result says so."""
    from hydra.core.hydra_config import HydraConfig

    from gptlab.cli import remove_refused_run_dir, stopped_before_training_lines
    from gptlab.errors import PreparationStopped
    from gptlab.runs.identity import release_run_dir
    from gptlab.tasks import task_runner

    hydra = HydraConfig.get()
    run_dir = Path(hydra.runtime.output_dir)
    try:
        return task_runner(cfg)(cfg)
    except (ConfigError, DataError):
        # nothing ran: the folder this call made goes, as train.py removes it
        remove_refused_run_dir(run_dir, f"{hydra.job.name}.log")
        raise
    except (KeyboardInterrupt, SystemExit) as e:
        stop = _interrupted(e)
        if stop is None:
            raise
        removed = remove_refused_run_dir(run_dir, f"{hydra.job.name}.log")
        signum = stop.signum if isinstance(stop, PreparationStopped) else signal.SIGINT
        again = (
            "The same call starts again."
            if removed or not run_dir.exists()
            else f"{run_dir} keeps what the run wrote before it (no checkpoint): the same call with resume=auto "
            "starts it again there."
        )
        said = stopped_before_training_lines(signum).replace("The same command starts again.", again)
        log.warning("%s", said)
        raise stop from None
    finally:
        # the claim on the directory (run.lock), which the run skeleton gives up once the task's work began:
        # a run stopped or refused before that must not keep it while the process goes on
        release_run_dir(run_dir)


def _quoted_path(path: str | Path) -> str:
    text = str(path)
    return text if re.fullmatch(r"[\w./~+-]+", text) else _override_value(text)


def _check_one_process(cfg: DictConfig) -> None:
    """A run on several devices or nodes starts a process per device, each running the command again
    (``python train.py``'s argv): from Python there is no command to run again."""
    trainer = cfg.get("trainer") or {}
    for key in ("devices", "num_nodes"):
        value = trainer.get(key, 1)
        if str(value) != "1":
            raise ConfigError(
                f"trainer.{key}={value}: gptlab.train() trains in this process, on one device; a run on "
                f"several devices or nodes starts one process per device: run it with python train.py "
                f"trainer.{key}={value} (the same overrides), then read it with gptlab.load_run()."
            )


def train(*config: DictConfig | str | Sequence[str], run_dir: str | Path | None = None) -> TrainResult:
    """Train as ``python train.py <overrides>`` does, in this process, and return the run's result.

        result = gptlab.train(gptlab.compose("model=tiny", "pos=rope"))
        result = gptlab.train("model=tiny", "pos=rope", run_dir="outputs/runs/rope")

    ``config``: :func:`compose`'s config (changes made to it in Python are recorded as overrides), or the
    overrides themselves. ``run_dir``: the run directory (``hydra.run.dir``); by default a new one under
    ``outputs/runs/<date>/<time>`` of the working directory, as ``train.py`` makes (``resume=auto``: the
    directory of the run it continues). The run goes through Hydra's job and the task's run skeleton, so it is
    a run like any other: ``scripts/compare.py``, :func:`load_run` and ``resume=auto`` read it.

    Raises :class:`~gptlab.errors.ConfigError` for a config or run directory ``train.py`` refuses (with its
    message), and the task's own errors (:class:`~gptlab.errors.DataError`, ...). One process: a strategy
    that launches more (``trainer.devices=2``) is for ``python train.py``. Under SLURM, a run its warning
    signal stopped (SIGUSR1 before preemption) raises :class:`~gptlab.errors.RunRequeued` once its checkpoint
    is saved and the job requeued: a SystemExit of status 0 that names the checkpoint (``.checkpoint``,
    ``.step``), as the job is about to end."""
    from hydra.errors import HydraException

    if len(config) == 1 and isinstance(config[0], DictConfig):
        cfg = config[0]
        check(cfg)  # refused here, before Hydra makes any directory
        overrides = _overrides_of(cfg)
    elif any(isinstance(c, DictConfig) for c in config):
        raise TypeError("train() takes one config from gptlab.compose(), or overrides: not both")
    else:
        overrides = _override_list(config)
        cfg = compose(*overrides)  # refused here, before Hydra makes any directory
    _check_one_process(cfg)
    if run_dir is not None:
        overrides = [o for o in overrides if _key_of(o) != "hydra.run.dir"]
        overrides.append(f"hydra.run.dir={_quoted_path(run_dir)}")
    if not _TRAINING.acquire(blocking=False):
        raise ConfigError(
            f"gptlab.train() is already training in this process (in thread {_training_in!r}): a run's job "
            "(Hydra's run directory, logging, the random generators) is one per process. Wait for it to return, "
            "or train the other config in a process of its own (python train.py <overrides>)."
        )
    requeued: RunRequeued | None = None
    try:
        _set_training_in(threading.current_thread().name)
        with (
            _process_left_as_it_was(),
            _hydra() as hydra,
            _logging_restored(),
            _refusals_as_errors(),
        ):
            try:
                job = hydra.run(CONFIG_NAME, task_function=_run_task, overrides=overrides)
            except HydraException as e:
                raise _hydra_refusal(e) from e
            except RunRequeued as stop:
                # raised to the caller without the frames it came through: they hold the run's trainer and
                # model, which a notebook keeps alive with its last exception (sys.last_value)
                requeued = stop.with_traceback(None)
                requeued.__context__ = None
    finally:
        _TRAINING.release()
    if requeued is not None:
        raise requeued
    assert job.hydra_cfg is not None  # run_job sets it
    return TrainResult.read(job.hydra_cfg.hydra.runtime.output_dir)


# One train() at a time in a process: Hydra's job state, the logging it configures and the random generators
# are the process's. The thread training now, for the refusal of a second call.
_TRAINING = threading.Lock()
_training_in = ""


def _set_training_in(name: str) -> None:
    global _training_in
    _training_in = name


# ---- load a run -----------------------------------------------------------------------------------------


@dataclass
class LoadedRun:
    """A trained run: its model (in eval mode), tokenizer, config and result."""

    trained: TrainedRun
    result: TrainResult | None  # None: no result.json (a checkpoint outside a run, a killed or running run)
    # where the run did not finish: what it is (still training in another process, stopped, failed, killed),
    # as load_run warned; None for a finished run or a checkpoint outside a run
    state: str | None = None

    @property
    def model(self) -> GPT:
        return self.trained.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self.trained.tokenizer

    @property
    def config(self) -> dict[str, Any]:
        """The run's resolved config (``config_resolved.yaml``; {} for a checkpoint outside a run)."""
        return self.trained.config

    @property
    def checkpoint(self) -> Path:
        return self.trained.checkpoint

    @property
    def run_dir(self) -> Path | None:
        return self.trained.run_dir

    @property
    def metrics(self) -> dict[str, float]:
        """The run's final metrics (``result.json``); {} when it has none."""
        return self.result.metrics if self.result else {}

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
    ) -> str:
        """The prompt continued, as ``scripts/generate.py`` continues it: greedy at ``temperature=0``, else
        sampled (from the ``top_k`` most likely, the ``top_p`` nucleus); it stops at the end-of-text token."""
        import torch

        tok, model = self.tokenizer, self.model
        ids = tok.encode(prompt) or [tok.eot_id]
        device = next(model.parameters()).device
        out = model.generate(
            torch.tensor([ids], device=device),
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eot_id=tok.eot_id,
            generator=torch.Generator(device=device).manual_seed(seed),
        )
        continuation = out[0].tolist()[len(ids) :]
        if tok.eot_id in continuation:
            continuation = continuation[: continuation.index(tok.eot_id)]
        return prompt + tok.decode(continuation)


def load_run(path: str | Path, device: str | torch.device = "cpu", which: str = "last") -> LoadedRun:
    """A run directory (or a checkpoint) loaded as :mod:`gptlab.runs.trained` loads it for
    ``scripts/generate.py`` and ``scripts/eval_length.py``: the model on ``device`` in eval mode, from the
    ``last`` checkpoint (or the ``best`` by val/loss), its tokenizer, config and result."""
    from gptlab.runs.trained import load_run as load_trained
    from gptlab.runs.trained import run_state

    trained = load_trained(path, device=device, which=which)
    result, state = None, None
    if trained.run_dir is not None:
        state = run_state(trained.run_dir)  # before its result: a run may end between the two looks
        try:
            result = TrainResult.read(trained.run_dir)
        except DataError:
            result = None
    if state is not None:
        log.warning("%s: %s. Loaded its checkpoint %s.", trained.run_dir, state, trained.checkpoint)
    return LoadedRun(trained, result, state)


# ---- compare --------------------------------------------------------------------------------------------


@dataclass
class SweepRows:
    """The comparison of a sweep, one row per condition, best first (:class:`gptlab.comparison.table.Row`):
    what ``scripts/compare.py`` tabulates. Iterate it for the rows; :meth:`to_frame` for a DataFrame."""

    rows: list[Row]
    keys: list[str]  # the keys that define a condition (pos, activation, ...)
    table: str  # the markdown table compare.py writes
    unfinished: list[RunRecord]  # runs that did not finish (ranked only with include_unfinished=True)
    skipped: list[tuple[Path, str]]  # directories that could not be read, with the reason
    report: Path | None = None  # comparison.md, when out_dir was given
    # the notes under the table: what its marks mean, and where its runs' environments (thread counts, torch,
    # device, precision, commit) differ, so that a difference between rows is not only their settings'
    notes: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return self.rows[index]

    def records(self) -> list[dict[str, Any]]:
        """One flat dict per condition: its keys' values, the number of runs and of seeds (a seed run twice
        counts once), the mean final validation loss (``val_loss``; ``val_bpb`` where the table ranks runs of
        several tokenizers by bits per byte) and its spread over seeds, perplexity, throughput, MFU, parameters
        (every weight) and ``active_parameters`` (those one token passes through: fewer under mlp=moe, the
        same for a dense model), the verdict against the reference row, and each evaluation output (``length/ppl@2x``, ...)."""
        out = []
        for row in self.rows:
            record: dict[str, Any] = {
                **row.choice,
                "condition": row.label,
                "runs": len(row.runs),
                "seeds": row.seeds,
            }
            # What the table ranks by: val/loss, or (where a row says so) val/bpb for runs of several
            # tokenizers; the column is named after it.
            ranked_by = str(getattr(row, "metric", "val/loss")).replace("/", "_")
            record |= {
                ranked_by: row.val_loss_mean,
                f"{ranked_by}_std": row.val_loss_std,
                "val_ppl": row.val_ppl,
                "tokens_per_second": row.tokens_per_second,
                "mfu": row.mfu,
                "parameters": row.parameters,
                "active_parameters": row.active_parameters,
                "significance": row.significance,
            }
            for name, values in row.outputs.items():
                record |= {f"{name}/{header}": value for header, value in values.items()}
            out.append(record)
        return out

    def to_frame(self) -> Any:
        """The rows as a ``pandas.DataFrame`` (:meth:`records`' columns)."""
        try:
            import pandas  # type: ignore[import-untyped]  # optional: not a dependency of gptlab
        except ImportError:
            raise ImportError(
                "gptlab.compare(...).to_frame() needs pandas, which is not installed: pip install pandas "
                "(or iterate the rows, or call .records())."
            ) from None
        return pandas.DataFrame(self.records())


def compare(
    sweep_dir: str | Path,
    baseline: str | None = None,
    ignore: Sequence[str] = (),
    include_unfinished: bool = False,
    source: str = "auto",
    alpha: float | None = None,
    out_dir: str | Path | None = None,
) -> SweepRows:
    """The runs below ``sweep_dir`` (a sweep, ``outputs/multirun/<date>/<time>``, or any folder of runs)
    compared by the code of ``scripts/compare.py``: one row per condition, best first, each against the best
    row or the ``baseline`` condition (``"pos=learned"``), tested at ``alpha`` (the script's default when
    None). ``ignore``: keys left out of the condition; ``include_unfinished``: rank unfinished runs at the
    step they reached; ``source``: where metrics are read (csv, wandb, auto). ``out_dir``: where
    ``comparison.md`` and its figures go, as the script writes them; by default they are not kept."""
    from gptlab.comparison import report

    options: dict[str, Any] = {"source": source, "baseline": baseline, "ignore": tuple(ignore)}
    options["include_unfinished"] = include_unfinished
    if alpha is not None:
        options["alpha"] = alpha
    if out_dir is not None:
        written = report.compare(sweep_dir, out_dir, **options)
        kept: Path | None = written.markdown_path
    else:  # the script's own steps, its files written where they are thrown away
        with tempfile.TemporaryDirectory(prefix="gptlab-compare-") as scratch:
            written = report.compare(sweep_dir, scratch, **options)
        kept = None
    # compare.py prints these below its table; here they are said as warnings, and kept in the result
    for run in written.unfinished:
        log.warning(
            "%s: %s: %s",
            run.path,
            run.describe_status(),
            "ranked at the step it reached"
            if include_unfinished
            else "not ranked (include_unfinished=True ranks it at the step it reached)",
        )
    for path, reason in written.skipped:
        log.warning("skipped %s: %s", path, reason)
    from gptlab.comparison.environment import ENVIRONMENT_HEADER

    for note in written.table_notes:
        if note.startswith(ENVIRONMENT_HEADER):  # the rows' differences are not only their settings'
            log.warning("%s", note)
    return SweepRows(
        written.rows,
        written.keys,
        written.table,
        list(written.unfinished),
        list(written.skipped),
        kept,
        list(written.table_notes),
    )
