"""Resuming a distributed checkpoint whose token table has another number of rows than the model stores.

Since ``model.vocab_multiple`` the token table and the output layer are stored padded (to a multiple of 64 rows
by default); a checkpoint saved before holds them with the vocabulary's rows. A single file is fitted as it
loads (the GPT's load hook and the module's optimizer fitting). A distributed checkpoint cannot be: torch's
reader fills the sharded tensors the model holds, in place, and refuses one of another size. So when the
checkpoint's rows differ, those tensors (the weights and their optimizer moments) are read whole on every rank,
fitted (``gptlab.model.gpt.fit_vocab_rows``: zero rows appended, or zero rows cut) and sharded as the model's
are; every other tensor loads in place as Lightning loads it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptlab.errors import CheckpointError

log = logging.getLogger(__name__)

MODEL_KEY = "state_dict"  # Lightning's key for the module in a distributed checkpoint


@dataclass
class Refit:
    """One tensor of the state to load whose saved rows differ from the model's: where it goes back."""

    container: dict[Any, Any] | list[Any]
    key: Any
    flat_key: str  # its name in the checkpoint's index
    target: torch.Tensor  # the model's tensor (a DTensor when sharded): the shape and placement to give it
    config: Any  # the GPTConfig whose padded vocabulary it is fitted to


def vocab_row_names(module: nn.Module) -> dict[str, Any]:
    """{parameter name in ``module``: its GPT's config} for every GPT token table and head inside ``module``."""
    from gptlab.model.gpt import GPT

    names: dict[str, Any] = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, GPT):
            for name in sub.vocab_rows:
                names[f"{prefix}.{name}" if prefix else name] = sub.config
    return names


def rows_differ(module: nn.Module, saved: dict[str, torch.Size]) -> bool:
    """Whether the checkpoint (its tensor sizes, ``saved``) holds a token table of other rows than ``module``."""
    for name in vocab_row_names(module):
        size = saved.get(f"{MODEL_KEY}.{name}")
        if size is not None and size[0] != module.get_parameter(name).shape[0]:
            return True
    return False


def _tensors(tree: Any, prefix: str) -> Iterator[tuple[dict[Any, Any] | list[Any], Any, str, torch.Tensor]]:
    """(container, key, flattened name, tensor) for each tensor of a nested state, named as the checkpoint's
    index names it (keys joined by dots)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        name = f"{prefix}.{key}"
        if isinstance(value, torch.Tensor):
            yield tree, key, name, value
        else:
            yield from _tensors(value, name)


def _swap_for_saved_sizes(
    state: dict[str, Any], saved: dict[str, torch.Size], names: dict[str, Any], top: str
) -> list[Refit]:
    """Put a plain tensor of the saved size in place of each token-table tensor of ``state`` whose rows
    differ from the saved ones (the reader fills it whole); return where each goes back."""
    refits = []
    for container, key, flat_key, tensor in _tensors(state[top], top):
        size = saved.get(flat_key)
        if size is None or size == tensor.shape or size[1:] != tensor.shape[1:]:
            continue
        # a weight ("state_dict.<name>") or one of its optimizer states ("optimizer_0.state.<name>.exp_avg")
        owner = next((n for n in names if flat_key == f"{MODEL_KEY}.{n}" or f".state.{n}." in flat_key), None)
        if owner is None:
            continue
        refits.append(Refit(container, key, flat_key, tensor, names[owner]))
        container[key] = torch.empty(size, dtype=tensor.dtype)
    return refits


def _put_back(refits: list[Refit]) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    from gptlab.model.gpt import fit_vocab_rows

    for r in refits:
        loaded = r.container[r.key]
        fitted = fit_vocab_rows(loaded, r.config, r.flat_key)
        if fitted.shape != r.target.shape:
            raise CheckpointError(
                f"{r.flat_key}: {tuple(loaded.shape)} in the checkpoint, {tuple(r.target.shape)} in the model "
                f"(a vocabulary of {r.config.vocab_size}): the checkpoint was trained with another vocabulary."
            )
        if isinstance(r.target, DTensor):
            fitted = distribute_tensor(
                fitted.to(r.target.device), r.target.device_mesh, list(r.target.placements)
            )
        else:
            fitted = fitted.to(r.target.device)
        r.container[r.key] = fitted


def load_fitting_vocab_rows(
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    path: Path,
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any] | None:
    """Load the distributed checkpoint ``path`` into the sharded ``module`` and its ``optimizers`` as
    Lightning's ModelParallelStrategy does, the token table's tensors fitted to the rows the model stores;
    returns the checkpoint's other contents (Lightning's ``meta.pt``). None, loading nothing, where the rows
    are the model's (Lightning's own load then does it all)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from gptlab.runs.checkpoints import _dcp_reader, _torch_load, dcp_tensor_sizes
    from gptlab.runs.layout import SHARDED_META_FILE

    saved = dcp_tensor_sizes(path)
    if not rows_differ(module, saved):
        return None
    names = vocab_row_names(module)
    model_state = {MODEL_KEY: get_model_state_dict(module)}
    refits = _swap_for_saved_sizes(model_state, saved, names, MODEL_KEY)
    dcp.load(model_state, storage_reader=_dcp_reader(path))
    _put_back(refits)
    module.load_state_dict(model_state[MODEL_KEY], strict=strict)
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        refits = _swap_for_saved_sizes(optimizer_state, saved, names, key)
        dcp.load(optimizer_state, storage_reader=_dcp_reader(path))
        _put_back(refits)
        set_optimizer_state_dict(
            module,
            optimizer,
            optim_state_dict=optimizer_state[key],
            options=StateDictOptions(cpu_offload=True),
        )
    return _torch_load(path / SHARDED_META_FILE)
