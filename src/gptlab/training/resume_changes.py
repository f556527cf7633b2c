"""A resumed run under changed settings: what it may change from its checkpoint, what it may not, and how each
change is told.

Each checkpoint records the conditions it was trained under besides the model (:class:`TrainingConditions`:
the processes and whether they share a distributed sampler, the per-process batch, the accumulation, the
schedule's length, the windows' stride, the seed and the identity of the training tokens). A resume compares
them, and the loss and optimizer the checkpoint holds, with the command's, before any weight is read and
before the corpus is prepared (:func:`check_resume`: all of it, the tokenizer included, is known from the
command alone, and a research corpus takes minutes to hours to tokenize); only the training tokens
themselves are compared once the corpus is prepared (:func:`check_training_data`):

- **Refused**, naming each key with the checkpoint's value and the command's, and the fix: a distributed
  strategy where there was none, or none where there was one (``strategy``, ``trainer.devices``: a distributed
  sampler draws each epoch's order of the windows from the seed and the epoch, a single process from a random
  stream that runs on, so a position in one order means nothing in the other), another number of processes
  from a sharded checkpoint (it holds each rank's share of the state) or over a stream (each process reads
  its own share of it), another ``tokenizer`` (each id would stand for other text), another
  ``trainer.accumulate_grad_batches`` (Lightning counts the micro-batches of a step from
  the epoch's start, so the first steps after the change would accumulate the wrong number of them), other
  training tokens or another ``data.stride`` (the saved position would point into other windows), another
  optimizer (its state is another optimizer's), another ``data.num_workers`` (the loader's position is
  saved per worker), another ``seed`` (the saved random states and order of the
  windows go on; a distributed sampler would draw a new order from it each epoch), and a loss term that
  changes what is trained (``loss.z_loss``, ``loss.final_softcap``).
- **Applied and recorded**: ``data.batch_size`` (the windows continue where they stopped; each remaining step
  trains the new global batch), another number of processes under a distributed strategy (the ranks of the
  checkpoint had trained the first windows of the epoch's order, as many as their steps times the global
  batch; each new rank takes its share of the rest from there: see
  :class:`gptlab.data.datamodule.ResumableDistributedSampler`; the global batch changes with the processes,
  and the warning names the ``data.batch_size`` that keeps it), ``trainer.max_steps`` (the schedule is recomputed for the new length), and the
  optimizer's options (``optim.lr``, ``optim.weight_decay``, ``optim.schedule``, ...: the new values replace
  those restored with the optimizer's state). Each is logged as a warning with what it does at the resumed step
  (the learning rate before and after), and listed in the part of ``result.json`` that made it.

Under another global batch, Lightning's count of the epoch's batches is put in the new batches on load
(:class:`CarryBatchCount`), so that the epoch still ends where its order of the windows does.

Checkpoints written before the conditions were recorded resume without the checks that need them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from gptlab.errors import CheckpointError

log = logging.getLogger(__name__)

CONDITIONS_KEY = "training_conditions"

# Loss options that change what is trained; the others (loss.impl, loss.chunk_rows) give the same numbers.
LOSS_KEYS_THAT_TRAIN = ("z_loss", "final_softcap")


@dataclass(frozen=True)
class TrainingConditions:
    """What a run trains under besides its model, as a checkpoint records it."""

    world_size: int  # training processes (trainer.devices x trainer.num_nodes)
    distributed: bool  # a distributed strategy: each rank takes every world_size-th shuffled window
    batch_size: int  # data.batch_size: windows per process per micro-batch
    accumulate: int  # trainer.accumulate_grad_batches
    max_steps: int  # trainer.max_steps: where the schedule ends
    stride: int  # data.stride: where the training windows start
    num_workers: int  # data.num_workers: the loader's saved state is one per worker
    seed: int  # the run's seed: a distributed sampler's order of the windows in each epoch
    data: dict[str, Any]  # the training tokens' identity (training_data_identity)

    @property
    def global_batch(self) -> int:
        """Windows per optimizer step over all processes."""
        return self.batch_size * self.world_size * self.accumulate

    def describe_batch(self) -> str:
        return (
            f"{self.global_batch} windows (data.batch_size {self.batch_size} x {self.world_size} process(es) x "
            f"trainer.accumulate_grad_batches {self.accumulate})"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Any) -> TrainingConditions | None:
        """The conditions a checkpoint recorded; None for one written before they were recorded."""
        if not isinstance(values, dict):
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        if not names <= set(values):
            return None
        return cls(**{k: values[k] for k in names})


def training_data_identity(corpus: Any) -> dict[str, Any]:
    """What identifies a prepared corpus's training tokens: where they come from, how many, and, for gptlab's
    token cache, the CRC-32 of each shard that its ``index.json`` keeps (no token is read again)."""
    train = corpus.train
    identity: dict[str, Any] = {
        "source": f"{corpus.meta.get('source', '')} with tokenizer={corpus.tokenizer.name}",
        "tokenizer": corpus.tokenizer.name,
        "tokens": len(train),
    }
    if train.shards:
        index = Path(train.shards[0].path).parent / "index.json"
        try:
            entries = json.loads(index.read_text())["splits"]["train"]
            identity["crc32"] = [int(e["crc32"]) for e in entries]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # token files used as they are (nanoGPT's, llm.c's) have no index: source and count
    return identity


def same_data(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether two identities name the same training tokens: by their digests where both have them (the same
    text moved to another folder is the same data), else by source and count."""
    if saved.get("tokens") != now.get("tokens"):
        return False
    if "crc32" in saved and "crc32" in now:
        return bool(saved["crc32"] == now["crc32"])
    return bool(saved.get("source") == now.get("source"))


class RecordTrainingConditions(L.Callback):
    """Writes the run's :class:`TrainingConditions` into every checkpoint it saves (``training_conditions``)."""

    def __init__(self, data: dict[str, Any], stride: int, seed: int) -> None:
        self.data, self.stride, self.seed = data, stride, seed

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[CONDITIONS_KEY] = conditions_of_trainer(
            trainer, self.data, self.stride, self.seed
        ).to_dict()


class CarryBatchCount(L.Callback):
    """Lightning counts an epoch's batches and ends the epoch when the count reaches the loader's length. A
    checkpoint restores the count in its own batches; resumed under another global batch (``data.batch_size``,
    the processes), the count would run on in the new ones, and with a larger batch end the epoch before its
    order of the windows does, leaving its last windows untrained (up to half the epoch's at twice the batch).
    On load, the count is put in the new batches: the windows the run has trained in this epoch (the loader's
    saved position) over the new batch, in whole steps; the loader then ends the epoch where its order ends."""

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        saved = TrainingConditions.from_dict(checkpoint.get(CONDITIONS_KEY))
        datamodule = getattr(trainer, "datamodule", None)
        batch = int(getattr(datamodule, "batch_size", 0) or 0)
        if saved is None or not batch or saved.batch_size * saved.world_size == batch * trainer.world_size:
            return
        fit_loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
        position = windows_trained_in_epoch(fit_loop, saved)
        progress = (fit_loop.get("epoch_loop.batch_progress") or {}).get("current")
        if position is None or not isinstance(progress, dict) or "ready" not in progress:
            return
        accumulate = int(trainer.accumulate_grad_batches)
        carried = accumulate * (position // (accumulate * batch * trainer.world_size))
        shift = int(progress["ready"]) - carried
        for key in ("ready", "started", "processed", "completed"):
            if key in progress:
                progress[key] = int(progress[key]) - shift


def windows_trained_in_epoch(fit_loop: dict[str, Any], saved: TrainingConditions) -> int | None:
    """How many windows of its epoch's order a run had trained, all processes together, by the training
    loader's state in a checkpoint's fit loop (torchdata's; with workers, its main process's snapshot); None
    where it does not say."""
    states = (fit_loop.get("state_dict") or {}).get("combined_loader") or []
    if len(states) != 1 or not isinstance(states[0], dict):
        return None
    loader = (states[0].get("_snapshot") or {}).get("_main_snapshot") or states[0]
    batches = loader.get("_sampler_iter_state") or {}
    sampler = batches.get("sampler_state") or {}
    if saved.distributed:  # gptlab.data.datamodule.ResumableDistributedSampler's position
        from gptlab.data.datamodule import ResumableDistributedSampler

        if ResumableDistributedSampler._YIELDED not in sampler:
            return None
        return ResumableDistributedSampler.position(sampler, saved.world_size)
    return int(batches["samples_yielded"]) if "samples_yielded" in batches else None


def conditions_of_trainer(
    trainer: L.Trainer, data: dict[str, Any], stride: int, seed: int
) -> TrainingConditions:
    from lightning.pytorch.strategies import ParallelStrategy

    datamodule = getattr(trainer, "datamodule", None)
    return TrainingConditions(
        world_size=int(trainer.world_size),
        distributed=isinstance(trainer.strategy, ParallelStrategy),
        batch_size=int(getattr(datamodule, "batch_size", 0) or 0),
        num_workers=int(getattr(datamodule, "num_workers", 0) or 0),
        accumulate=int(trainer.accumulate_grad_batches),
        max_steps=int(trainer.max_steps),
        stride=stride,
        seed=seed,
        data=data,
    )


def planned_conditions(
    settings: Any, strategy: Any, data: dict[str, Any] | None = None, stride: int | None = None
) -> TrainingConditions:
    """The conditions the command will train under, known before any trainer exists: the processes from
    ``trainer.devices`` x ``trainer.num_nodes``, distributed when the strategy is (``strategy=auto`` is on more
    than one process). Before the data is prepared, ``data`` is empty (the training tokens are compared once
    they are) and the stride is ``data.stride``, or ``model.block_size`` when null (as the windows take it)."""
    from lightning.pytorch.strategies import ParallelStrategy

    from gptlab.parallel.hardware import world_size

    processes = world_size(settings.trainer)
    return TrainingConditions(
        world_size=processes,
        distributed=isinstance(strategy, ParallelStrategy) or processes > 1,
        batch_size=settings.loader.batch_size,
        num_workers=int(settings.loader.num_workers),
        accumulate=int(settings.trainer.get("accumulate_grad_batches") or 1),
        max_steps=int(settings.trainer["max_steps"]),
        stride=stride or settings.loader.stride or settings.block_size,
        seed=int(settings.run.seed),
        data=data or {},
    )


def _show(value: Any) -> str:
    """A value as a command-line override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return str(value)


def _processes(c: TrainingConditions) -> str:
    how = "a distributed strategy" if c.distributed else "no distributed strategy"
    return f"{c.world_size} process(es) with {how}"


def lr_at(optim_node: dict[str, Any], max_steps: int, step: int) -> float:
    """``optim.lr`` as scheduled at optimizer step ``step`` of a run of ``max_steps`` steps."""
    from gptlab.training.optimizers import parse_optim

    choice = parse_optim(optim_node)
    return float(choice.options.lr) * choice.options.factor(max_steps)(step)


def tokenizer_of(identity: dict[str, Any]) -> str | None:
    """The tokenizer a data identity names: its own key, or (a checkpoint from before it had one) the end of
    its source, ``... with tokenizer=NAME``."""
    if identity.get("tokenizer"):
        return str(identity["tokenizer"])
    source = str(identity.get("source", ""))
    marker = " with tokenizer="
    if marker not in source:
        return None
    return source.rsplit(marker, 1)[1] or None


@dataclass
class ResumeChanges:
    """What a resume changes from its checkpoint and applies (``{"data.batch_size": [4, 8]}``: the
    checkpoint's value, then the command's), and the warning that tells each, logged once the resume is
    confirmed (:meth:`tell`): after the checks that need the prepared data, so a refused resume tells none."""

    applied: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)

    def tell(self) -> None:
        for line in self.warnings:
            log.warning("%s", line)


def check_resume(
    checkpoint: dict[str, Any],
    path: Path,
    now: TrainingConditions,
    optim_node: dict[str, Any],
    loss_options: dict[str, Any],
    tokenizer: str | None = None,
    streaming: bool = False,
) -> ResumeChanges:
    """Compare the checkpoint at ``path`` with the command's conditions, optimizer node and loss options,
    before any data is prepared (``now.data`` may be empty: the training tokens are compared by
    :func:`check_training_data` once they are; ``tokenizer``, the command's, is compared here, as it is known
    before any text is read). Raises a CheckpointError listing every change a resume cannot make, with the
    fix; returns the changes it makes, each with the warning that tells its effect. ``streaming``: the
    command reads its training text as a stream (``data.streaming=true``)."""
    from gptlab.runs.layout import checkpoint_kind

    sharded = checkpoint_kind(Path(path)) not in (None, "file")
    step = int(checkpoint.get("global_step", 0))
    saved = TrainingConditions.from_dict(checkpoint.get(CONDITIONS_KEY))
    hparams = checkpoint.get("hyper_parameters") or {}
    refused: list[str] = []
    fixes: list[str] = []
    changes: dict[str, list[Any]] = {}
    warnings: list[str] = []

    saved_tokenizer = tokenizer_of(saved.data) if saved is not None else None
    if saved_tokenizer is not None and tokenizer is not None and saved_tokenizer != tokenizer:
        refused.append(
            f"tokenizer: {saved_tokenizer} in the checkpoint, {tokenizer} now: the training tokens would be "
            "others, and each id would stand for other text"
        )
        fixes.append(f"tokenizer={saved_tokenizer}")
    if saved is not None and now.data and not same_data(saved.data, now.data):
        refused.append(data_refusal(saved.data, now.data, step))
        fixes.append("the training text and tokenizer as they were")
    if saved is not None and saved.stride != now.stride:
        refused.append(
            f"data.stride: {saved.stride} in the checkpoint, {now.stride} now: the windows start elsewhere"
        )
        fixes.append(f"data.stride={saved.stride}")
    if saved is not None and saved.num_workers != now.num_workers:
        refused.append(
            f"data.num_workers: {saved.num_workers} in the checkpoint, {now.num_workers} now: the loader's "
            "position is saved per worker (a stream's too: each worker reads its own share of it), and "
            "torchdata's loader stops at the first batch on another number"
        )
        fixes.append(f"data.num_workers={saved.num_workers}")
    if saved is not None and saved.seed != now.seed:
        refused.append(
            f"seed: {saved.seed} in the checkpoint, {now.seed} now: the run continues the random states and the "
            "order of the windows it saved, which a distributed sampler draws anew from the seed each epoch"
        )
        fixes.append(f"seed={saved.seed}")
    if saved is not None and saved.distributed != now.distributed:
        refused.append(
            f"the processes: {_processes(saved)} in the checkpoint, {_processes(now)} now (trainer.devices x "
            "trainer.num_nodes, strategy): a distributed sampler draws each epoch's order of the windows from the "
            "seed and the epoch, a single process without one from a random stream that runs on across epochs, "
            "so the position reached in one order means nothing in the other"
        )
        fixes.append(
            "a distributed strategy again, on any number of processes (e.g. strategy=ddp "
            f"trainer.devices={saved.world_size}; trainer.devices=1 strategy=ddp continues it on one process)"
            if saved.distributed
            else "no distributed strategy (trainer.devices=1 strategy=auto)"
        )
    elif saved is not None and saved.world_size != now.world_size and (streaming or sharded):
        why = (
            "a stream is read in one share per process, each at its own place in it"
            if streaming
            else "a sharded checkpoint holds each rank's share of the weights and optimizer state, for that "
            "many ranks"
        )
        refused.append(
            f"the processes: {saved.world_size} in the checkpoint, {now.world_size} now (trainer.devices x "
            f"trainer.num_nodes): {why}"
        )
        fixes.append(f"{saved.world_size} process(es) again (e.g. trainer.devices={saved.world_size})")
    if saved is not None and saved.accumulate != now.accumulate:
        refused.append(
            f"trainer.accumulate_grad_batches: {saved.accumulate} in the checkpoint, {now.accumulate} now: "
            "Lightning counts a step's micro-batches from the epoch's start, so the steps after the change "
            "would accumulate the wrong number of them"
        )
        fixes.append(
            f"trainer.accumulate_grad_batches={saved.accumulate} (change the global batch with data.batch_size)"
        )
    saved_optim = hparams.get("optim") or {}
    saved_name, now_name = saved_optim.get("name", "adamw"), optim_node.get("name", "adamw")
    if saved_optim and saved_name != now_name:
        refused.append(
            f"optim: {saved_name} in the checkpoint, {now_name} now: its optimizer state is {saved_name}'s"
        )
        fixes.append(f"optim={saved_name}")
    saved_loss = _full_loss(hparams.get("loss"))
    for key in LOSS_KEYS_THAT_TRAIN:
        if saved_loss and saved_loss.get(key) != loss_options.get(key):
            refused.append(
                f"loss.{key}: {_show(saved_loss.get(key))} in the checkpoint, {_show(loss_options.get(key))} "
                "now: the loss trained would change"
            )
            fixes.append(f"loss.{key}={_show(saved_loss.get(key))}")
    if refused:
        raise CheckpointError(
            f"Checkpoint {path} (step {step}) cannot be continued as this command asks: {'; '.join(refused)}. "
            f"Resume with {'; '.join(fixes)}. {NEW_RUN}"
        )

    if saved is not None and saved.batch_size != now.batch_size:
        changes["data.batch_size"] = [saved.batch_size, now.batch_size]
    if saved is not None and saved.world_size != now.world_size:
        changes["processes"] = [saved.world_size, now.world_size]
    if saved is not None and saved.global_batch != now.global_batch:
        changes["global_batch"] = [saved.global_batch, now.global_batch]
    if "processes" in changes and saved is not None and step < now.max_steps:
        warnings.append(processes_warning(saved, now, step))
    elif "data.batch_size" in changes and saved is not None and step < now.max_steps:
        warnings.append(
            f"data.batch_size: {saved.batch_size} in the checkpoint, {now.batch_size} now: the shuffled windows "
            f"continue where step {step} left them, and each step from step {step + 1} trains "
            f"{now.describe_batch()} where it trained {saved.global_batch}: trainer.max_steps and the schedule "
            "count steps, so the tokens a step means change here (result.json's parts record it)."
        )
    if saved is not None and saved.max_steps != now.max_steps:
        changes["trainer.max_steps"] = [saved.max_steps, now.max_steps]
    if saved_optim:
        now_full = _full_node(optim_node)
        was_full = _full_node(saved_optim)
        for key in sorted(set(now_full) | set(was_full)):
            if key != "name" and _show(was_full.get(key)) != _show(now_full.get(key)):
                changes[f"optim.{key}"] = [was_full.get(key), now_full.get(key)]
    schedule_keys = [k for k in changes if k == "trainer.max_steps" or k.startswith("optim.")]
    if schedule_keys and saved_optim and step < now.max_steps:  # else nothing is left to train
        was_steps = saved.max_steps if saved is not None else now.max_steps
        before = lr_at(saved_optim, was_steps, step)
        after = lr_at(optim_node, now.max_steps, step)
        told = "; ".join(
            f"{k}: {_show(a)} in the checkpoint, {_show(b)} now"
            for k, (a, b) in changes.items()
            if k in schedule_keys
        )
        # after `step` scheduler steps the rate is lr * factor(step): the rate of step + 1
        effect = f"the learning rate of step {step + 1}, the first this part trains, is {after:.4g}" + (
            ", as it was scheduled"
            if math.isclose(before, after, rel_tol=1e-9, abs_tol=0.0)
            else f" ({before:.4g} by the schedule it was trained with)"
        )
        extended = ""
        if "trainer.max_steps" in changes and now.max_steps > changes["trainer.max_steps"][0]:
            extended = (
                f" The run is extended from {changes['trainer.max_steps'][0]} to {now.max_steps} steps: the "
                "schedule is recomputed for the new length (a cosine decay is stretched, so a run past its "
                "decay rises again; a WSD decay moves to the new end, so a run resumed in its stable phase "
                "continues as the longer run would)."
            )
        warnings.append(
            f"{told}. Applied from step {step + 1}: {effect}.{extended} result.json's parts record it."
        )
    return ResumeChanges(changes, warnings)


def processes_warning(saved: TrainingConditions, now: TrainingConditions, step: int) -> str:
    """What a resume on another number of processes does: the windows, and the global batch before and after
    (how to keep it, when it changes)."""
    line = (
        f"the processes: {saved.world_size} in the checkpoint, {now.world_size} now (trainer.devices x "
        f"trainer.num_nodes): the shuffled windows continue where the {saved.world_size} left them at step "
        f"{step}, "
        + (
            "the one process taking the rest of the epoch's order"
            if now.world_size == 1
            else f"each of the {now.world_size} processes taking one in {now.world_size} of the rest of the epoch's order"
        )
        + f" (none twice, none skipped), and each step from step "
        f"{step + 1} trains {now.describe_batch()}"
    )
    if now.global_batch == saved.global_batch:
        return f"{line}, the global batch it trained before."
    per_process = now.world_size * now.accumulate
    keep = (
        f"to keep {saved.global_batch} windows a step, resume with data.batch_size="
        f"{saved.global_batch // per_process}"
        if saved.global_batch % per_process == 0
        else f"no data.batch_size keeps {saved.global_batch} windows a step on {now.world_size} process(es) "
        f"({saved.global_batch} is not a multiple of {now.world_size} x trainer.accumulate_grad_batches "
        f"{now.accumulate})"
    )
    return (
        f"{line} where it trained {saved.describe_batch()}: trainer.max_steps and the schedule count steps, so "
        f"the tokens a step means change here (result.json's parts record it); {keep}."
    )


def data_refusal(saved: dict[str, Any], now: dict[str, Any], step: int) -> str:
    """What a refusal says of training tokens that differ from the checkpoint's."""
    return (
        f"the training data differ: {saved.get('source')} ({saved.get('tokens'):,} training tokens) "
        f"in the checkpoint, {now.get('source')} ({now.get('tokens'):,} tokens"
        + (", other token digests" if saved.get("tokens") == now.get("tokens") else "")
        + f") now: the position it continues from ({step} steps into the shuffled windows) would point "
        "into other windows"
    )


def check_training_data(checkpoint: dict[str, Any], path: Path, data: dict[str, Any]) -> None:
    """Refuse to continue the checkpoint at ``path`` on other training tokens than its own (``data``: the
    prepared corpus's :func:`training_data_identity`), naming both and the fix. The one comparison of a resume
    that needs the prepared data; :func:`check_resume` made the others before."""
    saved = TrainingConditions.from_dict(checkpoint.get(CONDITIONS_KEY))
    if saved is None or same_data(saved.data, data):
        return
    raise CheckpointError(
        f"Checkpoint {path} (step {int(checkpoint.get('global_step', 0))}) cannot be continued as this command "
        f"asks: {data_refusal(saved.data, data, int(checkpoint.get('global_step', 0)))}. Resume with the training "
        f"text and tokenizer as they were. {NEW_RUN}"
    )


NEW_RUN = (
    "Or start a new run: the same command without resume= (with overwrite=true to start it in this run's "
    "directory, the old run's files moved aside)."
)


def _full_loss(node: Any) -> dict[str, Any]:
    """A checkpoint's loss options with every option filled in: one from before an option existed trained
    with its default (no z-loss, no softcap). Empty for a checkpoint without any."""
    from gptlab.model.head_loss import HeadLoss

    if not isinstance(node, dict) or not node:
        return {}
    try:
        return HeadLoss.from_node(node).options()
    except Exception:  # an option this version no longer has: compared as written
        return dict(node)


def _full_node(node: dict[str, Any]) -> dict[str, Any]:
    """An optimizer node with every option filled in (a checkpoint's node from an older gptlab may lack the
    newer options, at their defaults)."""
    from gptlab.training.optimizers import parse_optim

    try:
        return parse_optim(node).node()
    except Exception:  # an option this version no longer has: compared as written
        return dict(node)
