"""The one loader of gptlab checkpoints, for every kind a strategy writes, reading tensors and plain values only.

``torch.load(weights_only=False)`` unpickles arbitrary objects, so a checkpoint from elsewhere could run code.
Everything here reads with ``weights_only=True``. A distributed checkpoint keeps its index (``.metadata``) as a
plain pickle, which ``torch.distributed.checkpoint``'s reader unpickles unrestricted; it is read here through
a reader whose unpickler admits only the checkpoint format's own classes.

Before anything is read, the checkpoint is compared with the SHA-256 digest written beside it when it was saved
(:mod:`gptlab.runs.digests`): one whose bytes changed since is refused, naming what differs and the intact
checkpoints beside it. One without a digest (written before gptlab wrote them) loads, with a warning.

The result is always shaped like a single-file Lightning checkpoint: ``global_step``, ``hyper_parameters``,
``tokenizer``, ``wandb_run_id``, ... and, when the weights are asked for, ``state_dict`` with the
LightningModule's parameter names (``model.transformer.h.0...``).
"""

from __future__ import annotations

import io
import logging
import pickle
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gptlab.errors import CheckpointError
from gptlab.runs import digests
from gptlab.runs.layout import (
    BEST_PREFIX,
    DCP,
    FILE,
    LAST_CHECKPOINT_PATH,
    SHARDED_META_FILE,
    checkpoint_kind,
    run_of_path,
)

log = logging.getLogger(__name__)

# What a refusal tells the user to do with the intact checkpoints it lists ({path}: the first of them).
RESUME_INSTEAD = "Continue from one: the same command with resume=<its path>, e.g. resume={path}"
LOAD_INSTEAD = "Pass one of them in its place, e.g. {path}"

# Prefixes a strategy's wrapper adds to the LightningModule's parameter names.
_WRAPPER_PREFIXES = ("_forward_module.", "module.")


def _first_line(e: BaseException) -> str:
    blocked = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
    if blocked:  # torch's message is a page long; the class it refused is what matters
        return f"it holds a {blocked.group(1)}"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


#: How the files ``torch.save`` writes begin: a zip archive (torch >= 1.6), or a pickle (the legacy format).
CHECKPOINT_STARTS = (b"PK\x03\x04", b"\x80")


def not_a_checkpoint(path: Path) -> str | None:
    """Why the file ``path`` is no checkpoint at all (a figure, a log, a config passed where a checkpoint
    goes), from its first bytes, before its digest is looked for or torch reads it; None where it may be one
    (an empty or truncated checkpoint still begins as one: :func:`_torch_load` says what is wrong with it)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return None  # torch.load's own error names the reason
    if not head or head.startswith(CHECKPOINT_STARTS):
        return None
    return (
        f"Checkpoint {path} cannot be read: it is not a PyTorch checkpoint (it begins {head!r}; torch.save's "
        "files begin with a zip archive's b'PK'). Pass a run directory written by `python train.py` "
        f"(outputs/runs/<date>/<time>) or one of its checkpoints ({LAST_CHECKPOINT_PATH}, {BEST_PREFIX}*.ckpt)."
    )


def _torch_load(path: Path, allowed: Sequence[Any] = ()) -> dict[str, Any]:
    """``torch.load`` with tensors and plain values only, plus the classes ``allowed`` (plain data holders)."""
    import torch

    try:
        with torch.serialization.safe_globals(list(allowed)):
            data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        size = path.stat().st_size if path.exists() else 0
        raise CheckpointError(
            f"Checkpoint {path} cannot be read ({_first_line(e)}; {size:,} bytes): it is truncated, corrupt, "
            "not a PyTorch checkpoint, or holds Python objects beyond tensors and plain values (refused: "
            "loading them could run code). Use another checkpoint, or delete it and start again."
        ) from e
    if not isinstance(data, dict):
        raise CheckpointError(f"Checkpoint {path} holds a {type(data).__name__}, not a checkpoint dict.")
    return data


# ---- distributed checkpoint directories (strategy=fsdp) -------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the classes a DCP ``.metadata`` file is made of (torch.distributed.checkpoint's dataclasses,
    torch dtypes, sizes and memory formats, standard containers), nothing else."""

    _PATHS = {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}
    _BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "slice"}

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module.startswith("torch.distributed.checkpoint.") or (
            module == "collections" and name == "OrderedDict"
        ):
            return super().find_class(module, name)
        if module == "builtins" and name in self._BUILTINS:
            return super().find_class(module, name)
        if module == "builtins" and name == "getattr":
            return _enum_member  # an enum member by name (how Python 3.11.0-3.11.3 pickle enums)
        # the checkpoint's own path (StorageMeta.checkpoint_id), and the lookup of a tensor layout by name
        if (module == "pathlib" and name in self._PATHS) or (module, name) == (
            "torch.serialization",
            "_get_layout",
        ):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(value, (torch.dtype, torch.memory_format)):
                return value
        raise CheckpointError(
            f"The distributed checkpoint's .metadata refers to {module}.{name}, which a checkpoint index "
            "never holds: refused (unpickling it could run code)."
        )


def _enum_member(cls: Any, name: str) -> Any:
    """``getattr`` as a DCP ``.metadata`` may hold it: a member of one of torch.distributed.checkpoint's enums
    (``_MEM_FORMAT_ENCODING``), looked up by name; anything else is refused."""
    import enum

    if (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and cls.__module__.startswith("torch.distributed.checkpoint.")
        and isinstance(name, str)
        and name in cls.__members__
    ):
        return cls[name]
    raise CheckpointError(
        f"The distributed checkpoint's .metadata looks up {name!r} on {cls!r}, which a checkpoint index never "
        "does: refused (unpickling it could run code)."
    )


def _dcp_reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            raw = (Path(self.path) / ".metadata").read_bytes()
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


def dcp_tensor_sizes(path: Path) -> dict[str, Any]:
    """{name: torch.Size} of every tensor in the distributed checkpoint ``path``, from its index alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = _dcp_reader(path).read_metadata()
    return {
        key: item.size
        for key, item in index.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def _load_dcp(path: Path, weights: bool) -> dict[str, Any]:
    meta_file = path / SHARDED_META_FILE
    checkpoint = _torch_load(meta_file) if meta_file.is_file() else {}
    if not weights:
        return checkpoint
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _dcp_reader(path)
    try:
        index = reader.read_metadata()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"Distributed checkpoint {path} has an unreadable .metadata ({_first_line(e)})."
        ) from e
    prefix = "state_dict."
    # Only the model's tensors: the optimizer's shards ("optimizer_0.*") are never read.
    state = {
        key[len(prefix) :]: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in index.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    if not state:
        raise CheckpointError(
            f"Distributed checkpoint {path} holds no state_dict tensors: not written by gptlab."
        )
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load({"state_dict": state}, storage_reader=reader, no_dist=True)
    except Exception as e:
        raise CheckpointError(f"Distributed checkpoint {path} cannot be read ({_first_line(e)}).") from e
    checkpoint["state_dict"] = state
    return checkpoint


# ---- DeepSpeed checkpoint directories -------------------------------------------------------------------


def _deepspeed_state_classes() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    classes: list[Any] = [LossScaler, DynamicLossScaler]
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        classes += [ZeroStageEnum, fragment_address]
    except ImportError:  # pragma: no cover - older DeepSpeed
        pass
    return classes


def _load_deepspeed(path: Path, weights: bool) -> dict[str, Any]:
    tag_file = path / "latest"
    tag = tag_file.read_text().strip() if tag_file.is_file() else None
    folder = path / tag if tag else next(p.parent for p in path.glob("*/*mp_rank_*_model_states.pt"))
    # ZeRO-3 names the model states per data-parallel rank (zero_pp_rank_0_mp_rank_00_...): rank 0's first
    states = sorted(
        folder.glob("*mp_rank_*_model_states.pt"),
        key=lambda p: (not p.name.startswith(("mp_", "zero_pp_rank_0_")), p.name),
    )
    if not states:
        raise CheckpointError(f"DeepSpeed checkpoint {path} has no {folder.name}/*mp_rank_*_model_states.pt.")
    # Lightning keeps its own part of the checkpoint (step, hyperparameters, ...) as DeepSpeed's client state.
    checkpoint = _torch_load(states[0])
    if not weights:
        return checkpoint
    import contextlib
    import sys

    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout, from its import on
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as e:
        raise CheckpointError(
            f"{path} is a DeepSpeed checkpoint; reading it needs the deepspeed package: "
            "pip install -e '.[deepspeed]'."
        ) from e
    # DeepSpeed's consolidation unpickles without restriction: every file is first read with weights_only,
    # admitting DeepSpeed's own plain state classes (its loss scalers, the ZeRO stage enum, the addresses of
    # parameter fragments in the flat partitions).
    allowed = _deepspeed_state_classes()
    for file in sorted(folder.glob("*.pt")):
        _torch_load(file, allowed)
    with contextlib.redirect_stdout(sys.stderr):
        checkpoint["state_dict"] = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=tag)
    return checkpoint


# ---- the loader -----------------------------------------------------------------------------------------


def load_checkpoint(
    path: str | Path, weights: bool = True, use_instead: str = LOAD_INSTEAD, hash_shards: bool = True
) -> dict[str, Any]:
    """Read a checkpoint of any kind on the CPU: a single file, a distributed checkpoint directory, or a
    DeepSpeed directory, after checking it against its digest. ``weights=False`` skips the model's tensors of
    a sharded checkpoint (what resuming checks needs only the step and the hyperparameters).
    ``use_instead``: what a refusal says to do with the intact checkpoints it names. ``hash_shards=False``:
    the files of a sharded checkpoint are compared by size only (the ranks that load it hash them, sharing
    the work: :func:`gptlab.parallel.checkpoint_io.verify_sharded_load`)."""
    path = Path(path)
    kind = checkpoint_kind(path)
    if kind == FILE and not_a_checkpoint(path):
        raise CheckpointError(f"{not_a_checkpoint(path)}{intact_alternatives(path, use_instead)}")
    if kind is not None:
        verify_checkpoint(
            path, use_instead, verdict=None if hash_shards else digests.check(path, hash_files=kind == FILE)
        )
        try:
            if kind == FILE:
                checkpoint = _torch_load(path)
            elif kind == DCP:
                checkpoint = _load_dcp(path, weights)
            else:  # DeepSpeed's directory
                checkpoint = _load_deepspeed(path, weights)
        except CheckpointError as e:  # unreadable (e.g. truncated, with no digest): name the intact ones
            raise CheckpointError(f"{e}{intact_alternatives(path, use_instead)}") from e.__cause__
    elif path.is_dir():
        raise CheckpointError(
            f"{path} is a directory but not a checkpoint (no .metadata of a distributed checkpoint, no DeepSpeed "
            "'latest'): it may be a save that was interrupted. Use another checkpoint."
        )
    else:
        raise CheckpointError(f"Checkpoint {path} does not exist.")
    if "state_dict" in checkpoint:
        checkpoint["state_dict"] = {_strip_wrappers(k): v for k, v in checkpoint["state_dict"].items()}
    return checkpoint


# ---- verifying against the digest ------------------------------------------------------------------------


def verify_checkpoint(
    path: Path, use_instead: str = LOAD_INSTEAD, verdict: digests.Verdict | None = None
) -> digests.Verdict:
    """Compare ``path`` with the digest written beside it when it was saved. A difference is refused (a
    CheckpointError naming what differs and the intact checkpoints beside it); a checkpoint without a digest
    passes, with one warning that it was not verified.

    Every process that loads a checkpoint checks it itself, each rank of a distributed run included: a rank
    reads the bytes it will train from (on a node's own disk they may be another copy), the check needs no
    process group (resuming is planned before one exists), and on a shared file system every rank reaches
    the same verdict, so all of them stop together rather than one waiting for the others in a collective.
    The ranks of a run that share the hashing of a sharded checkpoint compare sizes here, and pass the
    ``verdict`` they reached together (:func:`gptlab.runs.digests.check_shared`) once their process group is up."""
    if verdict is None:
        verdict = digests.check(path)
    written = f" at step {verdict.step}" if verdict.step is not None else ""
    if verdict.problems:
        raise CheckpointError(
            f"Checkpoint {path} is damaged: its bytes differ from those written{written} (recorded in "
            f"{digests.digest_path(path).name}): {'; '.join(verdict.problems)}. Not loaded (its weights "
            f"would be silently wrong).{intact_alternatives(path, use_instead)}"
        )
    if not verdict.has_digest:
        log.warning(
            "Checkpoint %s has no digest (%s): loaded without verifying its bytes (written by a gptlab that "
            "wrote no digests, or by a save stopped before its digest).",
            path,
            digests.digest_path(path).name,
        )
    return verdict


def sibling_checkpoints(path: Path) -> list[Path]:
    """The other checkpoints of the run ``path`` belongs to (its ``checkpoints/`` and SLURM's preemption
    checkpoints) and those in the same folder."""
    path = Path(path)
    found = [p for p in path.parent.glob("*.ckpt") if checkpoint_kind(p)]
    run = run_of_path(path)
    if run is not None:
        found += [p for p in run.checkpoint_dir.glob("*.ckpt") if checkpoint_kind(p)]
        found += run.preemption_checkpoints()
    unique = {p.resolve(): p for p in found}
    unique.pop(path.resolve(), None)
    return list(unique.values())


def _same_file(a: Path, b: Path) -> bool:
    try:
        return Path(a).samefile(b)
    except OSError:
        return False


def intact_alternatives(path: Path, use_instead: str = LOAD_INSTEAD) -> str:
    """A sentence for a refusal of ``path``: the checkpoints beside it that match their digests (each one
    checked now; the highest step first) and how to use them, then those that have no digest to check.
    Empty when there is no other checkpoint."""
    verdicts = [digests.check(p) for p in sibling_checkpoints(path)]
    if not verdicts:
        return ""
    intact = sorted(
        (v for v in verdicts if v.verified),
        key=lambda v: (-(v.step if v.step is not None else -1), -v.checkpoint.stat().st_mtime),
    )
    unchecked = sorted(v.checkpoint for v in verdicts if not v.has_digest)
    parts: list[str] = []
    if intact:
        listed = ", ".join(
            f"{v.checkpoint}" + (f" (step {v.step})" if v.step is not None else "") for v in intact
        )
        parts.append(
            f"Intact checkpoints beside it (each just verified against its digest): {listed}. "
            + use_instead.format(path=intact[0].checkpoint)
            + "."
        )
    if unchecked:
        parts.append(f"Without a digest, so not verified: {', '.join(str(p) for p in unchecked)}.")
    if not parts:
        linked = [str(v.checkpoint) for v in verdicts if _same_file(v.checkpoint, path)]
        parts.append(
            "No checkpoint beside it is intact ("
            + ", ".join(str(v.checkpoint) for v in verdicts)
            + " differ from their digests"
            + (
                f"; {', '.join(linked)} is the same file as {Path(path).name}: a best checkpoint of the same "
                "step is a link to it, not a copy"
                if linked
                else ""
            )
            + "). Train again: the same command with overwrite=true moves the damaged run aside."
        )
    return " " + " ".join(parts)


def _strip_wrappers(key: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        key = key.removeprefix(prefix)
    return key


def model_weights(checkpoint: dict[str, Any], path: Path | str = "") -> dict[str, Any]:
    """The GPT's own weights (``transformer.wte.weight``, ...) from a loaded checkpoint."""
    state = checkpoint.get("state_dict")
    if not state:
        raise CheckpointError(
            f"Checkpoint {path} holds no state_dict: it was not written by gptlab's training."
        )
    return {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}


def model_config_dict(checkpoint: dict[str, Any], path: Path | str = "") -> dict[str, Any]:
    """The model's config as saved with the checkpoint (``hyper_parameters["model"]``)."""
    hparams = checkpoint.get("hyper_parameters") or {}
    if "model" not in hparams:
        raise CheckpointError(
            f"Checkpoint {path} has no hyper_parameters['model'] (keys: {sorted(checkpoint)[:8]}): it was not "
            "written by gptlab's training. Use a checkpoint that train.py wrote."
        )
    return dict(hparams["model"])
