"""The ``optim=`` choices and their learning-rate schedules, checked before any weight exists.

- ``optim=adamw``: AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization",
  https://arxiv.org/abs/1711.05101) on every parameter, weight decay on matrices only.
- ``optim=muon``: Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks",
  https://kellerjordan.github.io/posts/muon/; Liu et al. 2025, "Muon is Scalable for LLM Training",
  https://arxiv.org/abs/2502.16982) through ``torch.optim.Muon`` on the hidden 2-D matrices of the transformer
  blocks, and AdamW on the rest (token and position embeddings, the output head, norm gains, biases), the
  split both papers use: orthogonalising an embedding's or the head's update has no meaning for a lookup
  table or a readout over the vocabulary.

Schedules (``optim.schedule``), each after ``warmup_steps`` of linear warmup:

- ``cosine``: cosine decay to ``min_lr_ratio * lr`` at ``trainer.max_steps`` (Loshchilov & Hutter 2017).
- ``wsd``: warmup-stable-decay. The peak rate is held, then decays over the last ``decay_fraction`` of the
  steps to ``min_lr_ratio * lr``, linearly or as 1 - sqrt (``decay_shape``). Hu et al. 2024, "MiniCPM:
  Unveiling the Potential of Small Language Models with Scalable Training Strategies"
  (https://arxiv.org/abs/2404.06395); Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond
  Fixed Training Durations" (https://arxiv.org/abs/2405.18392), who found the 1 - sqrt cooldown over about
  20% of the steps to match or beat cosine.

With ``model.param=mup`` the AdamW learning rate of the hidden matrices is scaled by base width / width
(Yang et al. 2022, "Tensor Programs V", https://arxiv.org/abs/2203.03466, table 3): see ``param_groups``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from gptlab import torch_features
from gptlab.errors import ConfigError
from gptlab.registry import check_keys

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
DECAY_SHAPES = ("linear", "1-sqrt")
ADJUST_LR = ("original", "match_rms_adamw")

OPTIM_DEFAULTS: dict[str, Any] = {
    "name": "adamw",
    "lr": 3e-4,
    "weight_decay": 0.1,
    "betas": (0.9, 0.95),
    "eps": 1e-8,
    "warmup_steps": 100,
    "min_lr_ratio": 0.1,  # the schedule ends at min_lr_ratio * lr
    "schedule": "cosine",
    "decay_fraction": 0.2,  # wsd: the share of trainer.max_steps spent decaying
    "decay_shape": "1-sqrt",  # wsd: linear or 1-sqrt
}
# optim=muon only: Muon's own options (the keys above configure the AdamW part and the schedule).
MUON_DEFAULTS: dict[str, Any] = {
    "muon_lr": 0.02,
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 5,
    "adjust_lr_fn": "original",
}

_NUMBERS = ("lr", "weight_decay", "eps", "warmup_steps", "min_lr_ratio", "decay_fraction")


def _choice(key: str, value: Any, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ConfigError(
            f"optim.{key}={value!r} is not one of {', '.join(allowed)}: {what} "
            f"(for example optim.{key}={allowed[0]})."
        )


def check_optim(optim: dict[str, Any], max_steps: int | None = None) -> dict[str, Any]:
    """The ``optim`` node merged over the defaults, or a ConfigError naming the bad value and the fix.
    ``max_steps`` (when known) also checks that warmup and the WSD decay fit in the run."""
    name = optim.get("name", OPTIM_DEFAULTS["name"])
    _choice("name", name, OPTIMIZERS, "choose the optimizer with optim=adamw or optim=muon")
    known = [*OPTIM_DEFAULTS, *(MUON_DEFAULTS if name == "muon" else ())]
    muon_only = set(optim) & set(MUON_DEFAULTS) - set(known)
    fix = "Choose optim=muon for Muon's options." if muon_only else ""
    check_keys(optim, known, f"optim={name}", "optim", fix)
    merged = {**OPTIM_DEFAULTS, **(MUON_DEFAULTS if name == "muon" else {}), **optim}
    numbers = _NUMBERS + (("muon_lr", "momentum", "ns_steps") if name == "muon" else ())
    for key in numbers:
        value = merged[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            default = {**OPTIM_DEFAULTS, **MUON_DEFAULTS}[key]
            raise ConfigError(f"optim.{key}={value!r} must be a number (e.g. optim.{key}={default}).")
    if not merged["lr"] > 0:
        raise ConfigError(f"optim.lr={merged['lr']} must be positive (e.g. optim.lr=3e-4).")
    if merged["warmup_steps"] < 0:
        raise ConfigError(f"optim.warmup_steps={merged['warmup_steps']} must be >= 0.")
    if not 0 <= merged["min_lr_ratio"] <= 1:
        raise ConfigError(f"optim.min_lr_ratio={merged['min_lr_ratio']} must be in [0, 1].")
    _choice("schedule", merged["schedule"], SCHEDULES, "the learning-rate schedule after warmup")
    _choice("decay_shape", merged["decay_shape"], DECAY_SHAPES, "the shape of the WSD decay")
    if not 0 < merged["decay_fraction"] <= 1:
        raise ConfigError(
            f"optim.decay_fraction={merged['decay_fraction']} must be in (0, 1]: the share of trainer.max_steps "
            "over which optim.schedule=wsd decays (e.g. optim.decay_fraction=0.2)."
        )
    if max_steps and merged["schedule"] == "wsd":
        decay = decay_steps(max_steps, merged["decay_fraction"])
        if merged["warmup_steps"] + decay > max_steps:
            raise ConfigError(
                f"optim.warmup_steps={merged['warmup_steps']} plus the WSD decay ({decay} steps: "
                f"optim.decay_fraction={merged['decay_fraction']} of trainer.max_steps={max_steps}) exceed "
                "the run: shorten the warmup, lower optim.decay_fraction or raise trainer.max_steps."
            )
    if name == "muon":
        # torch.optim.Muon is in torch >= 2.9: an older one is refused here, not at the first step
        torch_features.require("muon", "optim=muon", "optim=adamw")
        if not merged["muon_lr"] > 0:
            raise ConfigError(
                f"optim.muon_lr={merged['muon_lr']} must be positive (e.g. optim.muon_lr=0.02)."
            )
        if not 0 <= merged["momentum"] < 1:
            raise ConfigError(f"optim.momentum={merged['momentum']} must be in [0, 1) (e.g. 0.95).")
        if not isinstance(merged["ns_steps"], int) or not 1 <= merged["ns_steps"] < 100:
            raise ConfigError(
                f"optim.ns_steps={merged['ns_steps']!r} must be an integer in [1, 99] (e.g. 5)."
            )
        if not isinstance(merged["nesterov"], bool):
            raise ConfigError(f"optim.nesterov={merged['nesterov']!r} must be true or false.")
        _choice("adjust_lr_fn", merged["adjust_lr_fn"], ADJUST_LR, "how Muon scales its rate by matrix shape")
    merged["betas"] = tuple(merged["betas"])
    return merged


def check_optimizer_strategy(optim: dict[str, Any], strategy: str) -> None:
    """optim=muon under a strategy that flattens the parameters is refused, with the reason. DeepSpeed's ZeRO
    partitions each rank's parameters as slices of one flat 1-D buffer and steps the optimizer on those
    slices: a Newton-Schulz iteration needs the whole 2-D matrix. (FSDP2 keeps each parameter a 2-D DTensor
    sharded by rows; torch's Muon multiplies those, and the products gather the shards: it runs, each rank
    orthogonalising whole matrices.)"""
    if optim.get("name") == "muon" and strategy.startswith("deepspeed"):
        raise ConfigError(
            f"optim=muon cannot run under strategy={strategy}: DeepSpeed ZeRO hands the optimizer flat 1-D slices "
            "of the parameters, and Muon orthogonalises whole 2-D matrices. Use strategy=fsdp (sharded) or "
            "strategy=ddp with optim=muon, or optim=adamw under DeepSpeed."
        )


# ---- schedules ----------------------------------------------------------------------------------------
def decay_steps(max_steps: int, decay_fraction: float) -> int:
    """The length of the WSD decay: the last ``decay_fraction`` of ``max_steps``, at least one step."""
    return max(1, round(decay_fraction * max_steps))


def lr_factor(
    step: int,
    warmup_steps: int,
    max_steps: int,
    min_lr_ratio: float,
    schedule: str = "cosine",
    decay_fraction: float = 0.2,
    decay_shape: str = "1-sqrt",
) -> float:
    """The multiplier of the peak learning rate at optimizer step ``step`` (0-based): linear warmup from
    lr/warmup_steps to lr, then cosine decay to ``min_lr_ratio`` at ``max_steps``, or (``schedule="wsd"``) a
    plateau at 1 and a decay to ``min_lr_ratio`` over the last ``decay_fraction`` of the steps, linear or
    1 - sqrt (Hägele et al. 2024, https://arxiv.org/abs/2405.18392, section 3)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "wsd":
        decay = decay_steps(max_steps, decay_fraction)
        start = max(warmup_steps, max_steps - decay)
        if step < start:
            return 1.0
        progress = min(1.0, (step - start) / max(1, max_steps - start))
        remaining = 1 - progress if decay_shape == "linear" else 1 - math.sqrt(progress)
        return min_lr_ratio + (1 - min_lr_ratio) * remaining
    if max_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_of(optim: dict[str, Any], max_steps: int) -> Callable[[int], float]:
    """``lr_factor`` bound to a checked ``optim`` node and the run's length."""

    def factor(step: int) -> float:
        return lr_factor(
            step,
            optim["warmup_steps"],
            max_steps,
            optim["min_lr_ratio"],
            optim["schedule"],
            optim["decay_fraction"],
            optim["decay_shape"],
        )

    return factor


# ---- parameter groups ---------------------------------------------------------------------------------
def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """A 2-D weight inside a transformer block (attention Q/K/V and output projections, the MLP's two
    matrices): Muon's parameters, and the ones muP's Adam rule rescales. Embeddings, the head and any
    positional scheme's own weights sit outside the blocks."""
    return name.startswith("transformer.h.") and p.dim() == 2


def param_groups(
    model: nn.Module, optim: dict[str, Any], hidden_lr_scale: float = 1.0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(AdamW groups, Muon groups) for ``model``. Weight decay on matrices, none on biases and gains.

    - optim=adamw, standard parametrisation: two groups, every matrix and every vector (the layout of
      checkpoints written before optim=muon and muP existed, so that they resume);
    - optim=adamw under muP: the hidden matrices in a group of their own at ``lr * hidden_lr_scale``;
    - optim=muon: the hidden matrices form the Muon group at ``muon_lr``; AdamW keeps the rest."""
    hidden, other_matrices, vectors = [], [], []
    for name, p in model.named_parameters():  # a tied head is listed once, as the embedding
        if not p.requires_grad:
            continue
        if is_hidden_matrix(name, p):
            hidden.append(p)
        elif p.dim() >= 2:
            other_matrices.append(p)
        else:
            vectors.append(p)
    lr, wd = optim["lr"], optim["weight_decay"]
    gains = {"params": vectors, "lr": lr, "weight_decay": 0.0, "group": "gains_biases"}
    if optim["name"] == "muon":
        adamw = [{"params": other_matrices, "lr": lr, "weight_decay": wd, "group": "embeddings_head"}, gains]
        muon = [{"params": hidden, "lr": optim["muon_lr"], "weight_decay": wd, "group": "hidden_muon"}]
        return [g for g in adamw if g["params"]], [g for g in muon if g["params"]]
    if hidden_lr_scale == 1.0:
        ids = {id(p) for p in hidden + other_matrices}
        matrices = [p for p in model.parameters() if id(p) in ids]  # in the model's order
        return [
            g
            for g in ({"params": matrices, "lr": lr, "weight_decay": wd, "group": "matrices"}, gains)
            if g["params"]
        ], []
    adamw = [
        {"params": hidden, "lr": lr * hidden_lr_scale, "weight_decay": wd, "group": "hidden"},
        {"params": other_matrices, "lr": lr, "weight_decay": wd, "group": "embeddings_head"},
        gains,
    ]
    return [g for g in adamw if g["params"]], []


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer for Lightning's automatic optimization: ``torch.optim.Muon`` (Jordan et al. 2024,
    https://kellerjordan.github.io/posts/muon/) on the hidden matrices and ``torch.optim.AdamW`` (Loshchilov &
    Hutter 2019) on everything else, stepped together, the split of Liu et al. 2025 (https://arxiv.org/abs/
    2502.16982). The param groups (AdamW's first) and the
    state are the inner optimizers' own objects, so a scheduler, gradient clipping, ``state_dict`` and
    distributed checkpointing see one ordinary optimizer."""

    def __init__(
        self,
        adamw_groups: list[dict[str, Any]],
        muon_groups: list[dict[str, Any]],
        adamw: dict[str, Any],
        muon: dict[str, Any],
    ) -> None:
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw)
        self.muon = torch.optim.Muon(muon_groups, **muon)
        self._n_adamw = len(self.adamw.param_groups)
        # The same group dicts: Optimizer.add_param_group keeps the dict it is given.
        super().__init__([*self.adamw.param_groups, *self.muon.param_groups], defaults={})
        self._share_state()

    def _share_state(self) -> None:
        # One state dict keyed by parameter serves both: their parameters are disjoint.
        self.adamw.state = self.muon.state = self.state
        self.adamw.param_groups = self.param_groups[: self._n_adamw]
        self.muon.param_groups = self.param_groups[self._n_adamw :]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # replaces self.state and the group dicts
        self._share_state()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.adamw.step()
        self.muon.step()
        return loss


def build_optimizer(
    model: nn.Module, optim: dict[str, Any], hidden_lr_scale: float = 1.0, fused: bool = False
) -> torch.optim.Optimizer:
    """AdamW, or Muon with AdamW, over ``param_groups(model, optim, hidden_lr_scale)``."""
    adamw_groups, muon_groups = param_groups(model, optim, hidden_lr_scale)
    adamw_kwargs: dict[str, Any] = {"lr": optim["lr"], "betas": optim["betas"], "eps": optim["eps"]}
    if fused:
        adamw_kwargs["fused"] = True
    if optim["name"] != "muon" or not muon_groups:
        return torch.optim.AdamW(adamw_groups, **adamw_kwargs)
    muon_kwargs = {
        "lr": optim["muon_lr"],
        "momentum": optim["momentum"],
        "nesterov": optim["nesterov"],
        "ns_steps": optim["ns_steps"],
        "adjust_lr_fn": optim["adjust_lr_fn"],
    }
    return MuonWithAdamW(adamw_groups, muon_groups, adamw_kwargs, muon_kwargs)


def group_lrs(optimizer: torch.optim.Optimizer) -> Iterable[tuple[str, float]]:
    """(group name, current learning rate) of each param group."""
    for i, group in enumerate(optimizer.param_groups):
        yield str(group.get("group", i)), float(group["lr"])
