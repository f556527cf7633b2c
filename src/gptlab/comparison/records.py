"""One run's choices and figures, read from its directory (or from the W&B API).

What each run chose comes from ``.hydra/overrides.yaml``; its metrics from ``csv/metrics.csv`` when there is
one, else from the W&B run file (``wandb/*/run-*.wandb``, read by :mod:`gptlab.tracking.wandb_runs`); and
the figures of its evaluation outputs (``eval_length/length.json``, ...) from the readers declared in
:data:`OUTPUTS`: a new evaluation adds its columns to every comparison by adding one reader there.

Every record says which run it read (``run.json``'s id), whether that run finished (``result.json``), and
at which step it is; where a directory holds traces of more than one run (W&B files of two runs, a metrics
file whose steps start over), the record reads one of them and says so in ``notes``. A non-finite value is
kept (a final ``val/loss`` of inf reads inf, never an earlier step's value), and a run whose final validation
loss is non-finite or that says it diverged (:func:`is_diverged`) is marked ``diverged``. ``metrics.csv`` is checked
before it is read (its header, every field a number, steps that only go back where training starts again):
a garbled one (two processes writing one file) is refused with :class:`MetricsUnreadable`, never read as
zeros.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptlab.errors import DataError
from gptlab.evaluation import long_context
from gptlab.runs.environment import ENVIRONMENT_KEY, recorded_environment
from gptlab.runs.jsonfile import read_figure
from gptlab.runs.layout import Run
from gptlab.runs.naming import split_override
from gptlab.tracking.wandb_runs import find_runs, read_run

SOURCES = ("auto", "csv", "wandb")
UNREADABLE = "metrics unreadable"
FINISHED, STOPPED, FAILED, RUNNING, KILLED = "finished", "stopped", "failed", "running", "killed"


@dataclass(frozen=True)
class OutputColumns:
    """Table columns read from a run's evaluation outputs: ``read(run)`` gives ``{header: value}``, a value
    of None where the run's output says it cannot be measured (shown as ``unavailable``), and no key where
    the run has no such output. ``order`` sorts the headers. ``geometric(header)``: the seeds' figures of that
    column are averaged by their geometric mean (a perplexity: the perplexity of the seeds' mean loss), else
    by their mean."""

    name: str
    read: Callable[[Run], dict[str, float | None]]
    fmt: str = "{:.2f}"
    unavailable: str = "n/a"
    order: Callable[[str], Any] = str
    geometric: Callable[[str], bool] = lambda header: False


def length_perplexities(run: Run) -> dict[str, float | None]:
    """``ppl@1x``, ``ppl@2x``, ... of the scheme as trained, from ``eval_length/length.json``."""
    return long_context.read_length_study(run.path)


def passkey_accuracy(run: Run) -> dict[str, float | None]:
    """``passkey@1x``, ... (retrieval accuracy over depths) from ``eval_length/passkey.json``."""
    return long_context.read_passkey(run.path)


def downstream_metrics(run: Run) -> dict[str, float | None]:
    """``eval/<task>/<metric>`` of the last harness evaluation during training, from ``result.json``."""
    from gptlab.evaluation.downstream import final_values

    return final_values(run)


# The evaluation outputs that become columns, in this order.
OUTPUTS: list[OutputColumns] = [
    OutputColumns("length", length_perplexities, order=long_context.factor_of, geometric=lambda header: True),
    OutputColumns("passkey", passkey_accuracy, order=long_context.factor_of),
    # the harness's word_perplexity, byte_perplexity, perplexity: exp of a loss, as val/ppl
    OutputColumns(
        "eval_harness",
        downstream_metrics,
        fmt="{:.4g}",
        geometric=lambda header: header.endswith("perplexity"),
    ),
]


@dataclass
class RunRecord:
    """One run's choices and figures."""

    path: Path
    overrides: dict[str, str]
    val_loss: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) at each validation
    val_bpb: list[tuple[int, float]] = field(default_factory=list)  # (step, bits per byte) at each validation
    val_ppl: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    # the highest MFU a window of the run logged above 100% (train/mfu_above_peak, never logged as train/mfu):
    # the one peak all its windows are measured against is too low, so none of its MFU figures is a utilisation
    mfu_above_peak: float | None = None
    parameters: float | None = None  # parameters/total: every weight of the model, all of an MoE's experts
    # parameters/active: the weights one token passes through (mlp=moe: the router's, the shared experts' and
    # top_k experts'); a dense model's total (see active_parameters_of)
    active_parameters: float | None = None
    outputs: dict[str, dict[str, float | None]] = field(
        default_factory=dict
    )  # output name -> header -> value
    source: str = ""
    commit: str | None = None
    run_id: str | None = None
    status: str = FINISHED  # finished, stopped, failed, running, killed (see RunRecord.describe_status)
    step: int | None = None  # optimizer steps done: result.json's, else the last logged step's
    max_steps: int | None = None
    notes: list[str] = field(default_factory=list)  # what the reader found and chose (more than one run, ...)
    unigram_entropy: float | None = (
        None  # of the run's validation split (result.json), the bar a trained model is below
    )
    diverged: bool = False  # final val/loss non-finite or above unigram_entropy (see mark_divergence)
    stopped_during: str | None = None  # a stopped run's part (result.json): training, eval_length, ...
    # what its numbers depend on beyond its settings (gptlab.runs.environment: threads, device, versions...);
    # None for a run from before the record
    environment: dict[str, Any] | None = None

    @property
    def final_val_loss(self) -> float | None:
        return self.val_loss[-1][1] if self.val_loss else None

    def final(self, metric: str) -> float | None:
        """The last validation's ``val/loss`` (nats per token) or ``val/bpb`` (bits per byte)."""
        series = self.val_bpb if metric == "val/bpb" else self.val_loss
        return series[-1][1] if series else None

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def describe_status(self) -> str:
        """``finished``, or what stopped it and where: ``killed at step 40 of 320``, ``running (step
        40 of 320)``..."""
        where = f"step {self.step}" + (f" of {self.max_steps}" if self.max_steps else "")
        return {
            FINISHED: FINISHED,
            STOPPED: f"stopped by a signal at {where}"
            if self.stopped_during in (None, "training")
            else f"stopped by a signal during the study after training ({self.stopped_during}), at {where}",
            FAILED: f"failed at {where}",
            RUNNING: f"running ({where})",
            KILLED: f"killed at {where} (no result.json)",
        }.get(self.status, f"{self.status} at {where}")


class MetricsUnreadable(DataError):
    """A metrics file that cannot be read as one run's metrics (garbled, cut, steps out of order)."""


def _number(value: Any) -> float | None:
    """``value`` as a float, inf and nan included (``"inf"``: how result.json and the CSV write them)."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _float(value: Any) -> float | None:
    out = _number(value)
    return out if out is not None and math.isfinite(out) else None


def result_metric(result: dict[str, Any], key: str) -> float | None:
    """One of result.json's final metrics as a float: a non-finite value, written as the string ``"inf"``,
    ``"-inf"`` or ``"nan"`` (JSON has no such numbers), reads as that float; a missing one (``null``, or no
    such key) as None (:func:`gptlab.runs.jsonfile.read_figure`)."""
    return read_figure((result.get("metrics") or {}).get(key))


# How far above the loss of a uniform guess a run must end to count as diverged: a fresh model starts within a
# fraction of a nat of it (one step of the tiny test model: 10.79 nats against ln 50257 = 10.82), so a smoke
# test of a few steps ends there without having diverged.
DIVERGENCE_MARGIN = 1.0


def is_diverged(final_val_loss: float, unigram_entropy: float, uniform_loss: float) -> bool:
    """Whether a run diverged: its final validation loss is non-finite, or above the validation split's unigram
    entropy (the best a model predicting each token by its frequency alone reaches) and more than
    :data:`DIVERGENCE_MARGIN` nats above the loss of a uniform guess, ln(vocabulary size), where training
    starts. Above the unigram entropy alone a run may simply be short (the suite's 7-step runs end at 4.5
    nats on a corpus of unigram entropy 3.25); well above the uniform guess, training made the model worse
    than it began (``optim.lr=10``: 259 nats)."""
    if not math.isfinite(final_val_loss):
        return True
    return final_val_loss > unigram_entropy and final_val_loss > uniform_loss + DIVERGENCE_MARGIN


def mark_divergence(record: RunRecord) -> None:
    """``diverged`` when the run's result.json says so (:func:`is_diverged`), or its final validation loss
    is non-finite (a run without a result, or an older one)."""
    final = record.final_val_loss
    if final is not None and not math.isfinite(final):
        record.diverged = True


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# Logged once when training starts (training/metrics.py), at the step it starts from: 0 for a new run, the
# checkpoint's step for a resumed one.
START_MARKER = "model/flops_per_token"
# The model's size, logged once when training starts (training/metrics.py): every weight, and those one token
# passes through (they differ under mlp=moe, which came with the second key).
PARAMETER_KEYS = ("parameters/total", "parameters/active")


def config_parameter_counts(cfg: Mapping[str, Any]) -> dict[str, int]:
    """``gptlab.model.counting.parameter_counts`` of the model a run's resolved config describes (its
    ``config_resolved.yaml``, or the config a W&B run holds): the model, pos, activation, norm, attention and
    mlp nodes read as the trainer reads them (``gptlab.config.parse_model``), without the training stack. A
    vocabulary the config leaves to the tokenizer (``null``) is counted as 1 row: the counts that do not
    include the token table (``non_embedding``, and the total less the active) do not depend on it."""
    from gptlab.model.config import GPTConfig
    from gptlab.model.counting import parameter_counts

    values = {k: v for k, v in dict(cfg["model"]).items() if k != "init_from"}
    if values.get("vocab_size") is None:
        values["vocab_size"] = 1
    values["pos"], values["activation"] = dict(cfg["pos"]), dict(cfg["activation"])
    norm = dict(cfg["norm"])
    values["norm"] = norm.pop("name")
    values.update({f"norm_{key}": value for key, value in norm.items()})
    if cfg.get("attention"):  # QK-norm's gains are parameters too; runs from before the node have none
        values["attention"] = dict(cfg["attention"])
    if cfg.get("mlp"):  # a Mixture of Experts' router and experts; runs from before the node are dense
        values["mlp"] = dict(cfg["mlp"])
    return parameter_counts(GPTConfig.from_dict(values))


def is_mixture_of_experts(cfg: Mapping[str, Any]) -> bool:
    """Whether a run's config says ``mlp=moe`` (a run from before the ``mlp`` node has a dense MLP)."""
    mlp = cfg.get("mlp")
    return isinstance(mlp, Mapping) and mlp.get("name") == "moe"


def fill_active_parameters(record: RunRecord, cfg: Mapping[str, Any], mlp_choice: str | None = None) -> None:
    """The active parameters of a run that logged its total but no ``parameters/active``. A dense run's are
    its total (every run from before gptlab logged the count is dense: ``mlp=moe`` came with it). An MoE run's
    (a W&B file damaged where the count was, a summary without it) are its total less the experts a token is
    not routed to, counted from its config, with a note; where its config cannot be counted they stay unknown
    (shown as ``-``), with a note, never its total. ``mlp_choice``: what the run chose for ``mlp`` (its
    override, Hydra's choice), for a run whose config is missing."""
    if record.active_parameters is not None or record.parameters is None:
        return
    if not is_mixture_of_experts(cfg) and mlp_choice != "moe":
        record.active_parameters = record.parameters
        return
    try:
        counts = config_parameter_counts(cfg)
    except (ValueError, KeyError, TypeError) as e:  # a config of another gptlab, or cut short
        record.notes.append(
            f"an mlp=moe run that logged no parameters/active, and its config cannot be counted ({e}): its "
            "active parameters are unknown"
        )
        return
    record.active_parameters = record.parameters - (counts["total"] - counts["active"])
    record.notes.append(
        "an mlp=moe run that logged no parameters/active: its active parameters are counted from its config "
        f"({record.active_parameters:,.0f} of {record.parameters:,.0f})"
    )


def _one_run_of(rows: list[tuple[int, dict[str, float]]], where: Path, notes: list[str]) -> list:
    """The rows of the last run in a metrics file that holds several: each start of training logs
    :data:`START_MARKER` at the step it starts from, so a start at step 0 after the first begins a second
    run (written into the same directory by an older gptlab), while a resumed run starts later."""
    starts = [i for i, (step, values) in enumerate(rows) if START_MARKER in values and step == 0]
    if len(starts) > 1:
        notes.append(
            f"{where} holds {len(starts)} runs (training started at step 0 {len(starts)} times); read the last"
        )
        return rows[starts[-1] :]
    return rows


def _series(rows: list[tuple[int, dict[str, float]]]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for step, values in rows:
        for key, value in values.items():
            series.setdefault(key, []).append((step, value))
    return series


def _series_from_csv(path: Path, notes: list[str]) -> dict[str, list[tuple[int, float]]]:
    return _series(_one_run_of(read_metrics_csv(path, notes), path, notes))


def read_metrics_csv(path: Path, notes: list[str]) -> list[tuple[int, dict[str, float]]]:
    """The rows of a ``metrics.csv`` as (step, {column: value}), checked: a header of names with ``step``
    among them, as many fields on every line as the header has, every field empty or a number (inf and nan
    kept), whole non-negative steps that go back only where training starts again (:data:`START_MARKER`: a
    resumed run, or a second run of an older gptlab). Anything else raises :class:`MetricsUnreadable` naming
    the line: two processes appending to one file interleave their lines, and a reader that skipped what it
    could not parse would report what is left (once, a row of zeros) as the run's metrics. A last line cut
    short (the writer killed mid-line) is left out, with a note."""
    text = path.read_text(errors="replace")
    lines = list(csv.reader(io.StringIO(text)))
    if not lines or not lines[0]:
        raise MetricsUnreadable(f"{path} is empty")
    header = lines[0]
    if "step" not in header or any(not name or _number(name) is not None for name in header):
        raise MetricsUnreadable(f"{path}: its first line is not a header with a step column: {header[:6]}")
    if len(set(header)) != len(header):
        raise MetricsUnreadable(f"{path}: its header names a column twice")
    step_at, marker_at = header.index("step"), header.index(START_MARKER) if START_MARKER in header else None
    last = len(lines) - 1
    if last > 0 and len(lines[last]) != len(header) and not text.endswith("\n"):
        notes.append(f"{path}: its last line is cut short (the writer stopped mid-line); left out")
        lines = lines[:last]
    rows: list[tuple[int, dict[str, float]]] = []
    for number, fields in enumerate(lines[1:], start=2):
        if not fields:
            continue  # a blank line
        if len(fields) != len(header):
            raise MetricsUnreadable(
                f"{path} line {number} has {len(fields)} fields, its header {len(header)}: lines of two "
                "writers interleaved (two runs in one directory?)"
            )
        values: dict[str, float] = {}
        for name, field_text in zip(header, fields):
            if field_text == "":
                continue
            value = _number(field_text)
            if value is None:
                raise MetricsUnreadable(f"{path} line {number}: {name} is {field_text[:40]!r}, not a number")
            values[name] = value
        step = values.pop("step", None)
        if step is None or not math.isfinite(step) or step < 0 or step != int(step):
            raise MetricsUnreadable(
                f"{path} line {number}: the step is {fields[step_at]!r}, not a step number"
            )
        starts = marker_at is not None and fields[marker_at] != ""
        if rows and step < rows[-1][0] and not starts:
            raise MetricsUnreadable(
                f"{path} line {number}: the step goes back from {rows[-1][0]} to {int(step)} where no training "
                "starts: lines of two runs interleaved (two runs in one directory?)"
            )
        values.pop("epoch", None)
        rows.append((int(step), values))
    return rows


def _series_from_wandb(
    files: list[Path], notes: list[str], wanted_id: str | None = None, config: dict[str, Any] | None = None
) -> dict[str, list[tuple[int, float]]]:
    """The series of one W&B run: the one ``wanted_id`` names, else the newest. A resumed run continues its
    W&B run, so several files of one id are one curve, in the order they were written. ``config``, when
    given, receives the run's config (its latest file's values last)."""
    runs = sorted((read_run(f) for f in files), key=lambda r: r.path.stat().st_mtime)
    for damaged in (r for r in runs if r.damage):
        notes.append(
            f"its W&B run file {damaged.path} is damaged ({'; '.join(damaged.damage)}): what those bytes held "
            "is missing from its curves"
        )
    ids = list(dict.fromkeys(r.run_id for r in runs))
    chosen = wanted_id if wanted_id in ids else ids[-1]
    if len(ids) > 1:
        notes.append(f"{len(ids)} W&B runs ({', '.join(ids)}) in one run directory; read {chosen}")
    rows: list[tuple[int, dict[str, float]]] = []
    summary: dict[str, Any] = {}
    for run in (r for r in runs if r.run_id == chosen):
        for row in run.history:
            step = int(row.get("trainer/global_step", row.get("_step", 0)))
            values = {
                k: _number(v) for k, v in row.items() if not k.startswith("_") and k != "trainer/global_step"
            }
            rows.append((step, {k: v for k, v in values.items() if v is not None}))
        summary.update(run.summary)
        if config is not None:
            config.update(run.config)
    series = _series(rows)
    for key in PARAMETER_KEYS:
        if key in summary and key not in series and (value := _number(summary[key])) is not None:
            series[key] = [(0, value)]
    return series


def _fill(record: RunRecord, series: dict[str, list[tuple[int, float]]]) -> RunRecord:
    # One value per step: a validation logged twice at one step (a resumed run) keeps the later one.
    record.val_loss = sorted(dict(series.get("val/loss", [])).items())
    record.val_bpb = sorted(dict(series.get("val/bpb", [])).items())
    ppl = sorted(dict(series.get("val/ppl", [])).items())
    record.val_ppl = ppl[-1][1] if ppl else None
    record.tokens_per_second = _median(
        [v for _, v in series.get("train/tokens_per_second", []) if math.isfinite(v)]
    )
    record.mfu = _median([v for _, v in series.get("train/mfu", []) if math.isfinite(v)])
    above = [v for _, v in series.get("train/mfu_above_peak", []) if math.isfinite(v)]
    record.mfu_above_peak = max(above) if above else None
    params, active = series.get("parameters/total"), series.get("parameters/active")
    record.parameters = params[-1][1] if params else None
    record.active_parameters = active[-1][1] if active else None
    return record


def _status(run: Run, record: RunRecord, series: dict[str, list[tuple[int, float]]]) -> None:
    """Whether the run finished, and its step: from ``result.json`` when it wrote one (also for a run
    stopped by a signal or failed), else from its claim (``run.lock``: still held?) and its last
    logged step."""
    from gptlab.runs.layout import read_run_info

    info = read_run_info(run.path)
    result = run.result() or {}
    record.run_id = info.run_id if info else None
    record.commit = result.get("git_commit")
    max_steps = run.setting("trainer.max_steps")
    record.max_steps = int(max_steps) if max_steps and max_steps.isdigit() else None
    if result and info and result.get("run_id") not in (None, info.run_id):
        record.notes.append(
            f"result.json is of run {result.get('run_id')}, run.json of {info.run_id}: the result is not read"
        )
        result = {}
    if result:
        record.environment = recorded_environment(result.get(ENVIRONMENT_KEY)) or record.environment
        _note_environment_changes(record, result)
        _final_from_result(record, result)
        record.diverged = bool(result.get("diverged"))
        record.step = int(result.get("global_step") or 0)
        record.stopped_during = result.get("stopped_during")
        if result.get("finished"):
            record.status = FINISHED
        elif result.get("failed"):
            record.status = FAILED
        else:
            record.status = STOPPED
        return
    logged = [s for values in series.values() for s, _ in values]
    record.step = max(logged) if logged else 0  # rows are logged at the optimizer steps done
    # running while its process holds the directory's claim (run.lock): a run started in a process that goes
    # on (a notebook's gptlab.train()) and ended without result.json is not running because that process is
    from gptlab.runs.identity import running_claim

    record.status = RUNNING if running_claim(run.path) is not None else KILLED


def _note_environment_changes(record: RunRecord, result: dict[str, Any]) -> None:
    """A note for each resumed part of the run that ran in another environment than the part before it
    (result.json's ``environment_changed``): its seeds' spread then holds more than seed noise."""
    from gptlab.runs.environment import FIELDS, value_text

    for part in result.get("parts") or []:
        changed = part.get("environment_changed") if isinstance(part, dict) else None
        if not isinstance(changed, dict) or not changed:
            continue
        what = ", ".join(
            f"{FIELDS.get(k, k)} {value_text(k, v[0])} -> {value_text(k, v[1])}"
            for k, v in changed.items()
            if isinstance(v, list) and len(v) == 2
        )
        record.notes.append(
            f"its part from step {part.get('from_step')} ran in another environment than the part before it "
            f"({what}): its final figures are not those of one environment"
        )


def _final_from_result(record: RunRecord, result: dict[str, Any]) -> None:
    """The run's own final validation (result.json) where the metrics it logged end before it: a metrics
    file whose last lines were lost (a writer killed mid-line) would otherwise show an earlier validation as
    the final one. Read at the run's last step, with a note; a logged final that
    differs from result.json's is kept, with a note."""
    final = result_metric(result, "val/loss")
    if final is None or not record.val_loss:
        return
    step, logged = record.val_loss[-1]
    if math.isclose(logged, final, rel_tol=1e-6) or (math.isnan(logged) and math.isnan(final)):
        return
    at = int(result.get("global_step") or 0)
    if step >= at:
        record.notes.append(
            f"result.json's final val/loss ({final:.4f}) is not the one logged ({logged:.4f})"
        )
        return
    record.val_loss = [*record.val_loss, (at, final)]
    record.val_ppl = result_metric(result, "val/ppl")
    record.notes.append(
        f"its metrics end at step {step} ({logged:.4f}) before its final validation: result.json's ({final:.4f}, "
        f"step {at}) is read"
    )


def read_run_dir(run_dir: str | Path, source: str = "auto") -> RunRecord:
    """Read one run directory; raises DataError when it holds no metrics.

    ``source``: ``csv`` (``csv/metrics.csv``), ``wandb`` (the W&B run file), or ``auto`` (CSV when present).
    The record says whether the run finished (``status``, ``step``) and what the reader had to choose."""
    if source not in SOURCES:
        raise DataError(f"source={source!r} is not one of {SOURCES}: use --source csv, wandb or auto.")
    run = Run(Path(run_dir))
    csv_files = sorted(run.path.glob("csv/**/metrics.csv")) if source in ("auto", "csv") else []
    wandb_files = find_runs(run.path) if source in ("auto", "wandb") else []
    notes: list[str] = []
    series: dict[str, list[tuple[int, float]]] | None = None
    wandb_config: dict[str, Any] = {}
    if csv_files:
        try:
            series, source = _series_from_csv(csv_files[0], notes), "csv"
        except MetricsUnreadable as e:
            if not wandb_files:
                raise MetricsUnreadable(f"{UNREADABLE}: {e}") from None
            notes.append(f"{UNREADABLE}: {e}; read the W&B run file instead")
    if series is None and wandb_files:
        wanted = (run.result() or {}).get("wandb_run_id")
        series, source = _series_from_wandb(wandb_files, notes, wanted, wandb_config), "wandb"
    elif series is None:
        wanted = {"auto": "neither csv/metrics.csv nor a W&B run file", "csv": "no csv/metrics.csv"}
        raise DataError(f"{run.path} holds no metrics ({wanted.get(source, 'no W&B run file')})")
    record = _fill(RunRecord(path=run.path, overrides=run.choices(), source=source, notes=notes), series)
    # a run without result.json (killed) recorded its environment in its W&B run's config, when it has one
    record.environment = recorded_environment(wandb_config.get(ENVIRONMENT_KEY))
    fill_active_parameters(record, run.config(), run.setting("mlp"))
    for output in OUTPUTS:
        record.outputs[output.name] = output.read(run)
    _status(run, record, series)
    mark_divergence(record)
    if not record.val_loss:
        if run.config().get("task") == "word2vec":  # word vectors: no language-model loss to rank
            raise DataError(
                f"{run.path} is a task=word2vec run: its word vectors have no val/loss to compare (python "
                f"scripts/eval_embeddings.py {run.path} scores them)"
            )
        raise DataError(
            f"{run.path} logged no val/loss ({record.describe_status()}: did it stop before its first "
            "validation?)"
        )
    return record


HISTORY_KEYS = ("val/loss", "val/ppl", "train/tokens_per_second", "train/mfu", "train/mfu_above_peak")


def record_from_api_run(run: Any) -> RunRecord:
    """A run of the W&B public API (one of ``gptlab.tracking.wandb_runs.group_runs``) as a RunRecord: its
    overrides from the ``sweep`` config section that gptlab logs, its metrics from the run's history."""
    overrides = (run.config.get("sweep") or {}).get("overrides") or []
    series: dict[str, list[tuple[int, float]]] = {}
    for key in HISTORY_KEYS:
        for row in run.scan_history(keys=["trainer/global_step", key]):
            value = _number(row.get(key))
            if value is not None:
                series.setdefault(key, []).append((int(row["trainer/global_step"]), value))
    record = RunRecord(
        path=Path(str(run.path if isinstance(run.path, str) else "/".join(run.path))),
        overrides=dict(split_override(str(o)) for o in overrides),
        source="wandb-api",
    )
    _fill(record, series)
    record.environment = recorded_environment(run.config.get(ENVIRONMENT_KEY))
    record.parameters = _float(run.summary.get("parameters/total"))
    record.active_parameters = _float(run.summary.get("parameters/active"))
    fill_active_parameters(record, run.config, record.overrides.get("mlp"))
    # W&B's own state of the run: finished, running, crashed (killed or lost), failed (exit code != 0)
    state = str(getattr(run, "state", FINISHED))
    record.status = {"finished": FINISHED, "running": RUNNING, "crashed": KILLED, "failed": FAILED}.get(
        state, state
    )
    logged = [step for values in series.values() for step, _ in values]
    record.step = max(logged) if logged else None
    mark_divergence(record)
    max_steps = (run.config.get("trainer") or {}).get("max_steps")
    record.max_steps = int(max_steps) if isinstance(max_steps, int) else None
    return record
