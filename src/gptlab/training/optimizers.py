"""The optimizer family (``optim=adamw|muon``): one class per optimizer, registered by name, each with its typed
``Options``, and the learning-rate schedules they share. Every option is checked before any weight exists.

- ``optim=adamw``: AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization",
  https://arxiv.org/abs/1711.05101) on every parameter, weight decay on matrices only.
- ``optim=muon``: Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks",
  https://kellerjordan.github.io/posts/muon/; Liu et al. 2025, "Muon is Scalable for LLM Training",
  https://arxiv.org/abs/2502.16982) through ``torch.optim.Muon`` on the hidden 2-D matrices of the transformer
  blocks, and AdamW on the rest (token and position embeddings, the output head, norm gains, biases), the
  split both papers use: orthogonalising an embedding's or the head's update has no meaning for a lookup
  table or a readout over the vocabulary. Its options extend AdamW's, which configure that AdamW part.

Schedules (``optim.schedule``, :class:`ScheduleOptions`), each after ``warmup_steps`` of linear warmup:

- ``cosine``: cosine decay to ``min_lr_ratio * lr`` at ``trainer.max_steps`` (Loshchilov & Hutter 2017).
- ``wsd``: warmup-stable-decay. The peak rate is held, then decays over the last ``decay_fraction`` of the
  steps to ``min_lr_ratio * lr``, linearly or as 1 - sqrt (``decay_shape``). Hu et al. 2024, "MiniCPM:
  Unveiling the Potential of Small Language Models with Scalable Training Strategies"
  (https://arxiv.org/abs/2404.06395); Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond
  Fixed Training Durations" (https://arxiv.org/abs/2405.18392), who found the 1 - sqrt cooldown over about
  20% of the steps to match or beat cosine.

The defaults are the dataclasses' own (those of every documented run: lr 4e-3, 30 warmup steps, cosine to
0.1 lr). ``conf/optim/<name>.yaml`` lists the same keys and values, so that Hydra takes ``optim.<key>=...``
without ``+`` and a reader sees them; ``tests/test_optimizers.py`` holds the two equal. ``parse_optim`` is the
one check of the ``optim`` node, at config time; the LightningModule receives its typed result. A new optimizer
is one class registered by name (its ``Options`` extending :class:`AdamWOptions` or :class:`ScheduleOptions`,
``param_groups`` and ``build``) plus ``conf/optim/<name>.yaml``.

With ``model.param=mup`` the AdamW learning rate of the hidden matrices is scaled by base width / width
(Yang et al. 2022, "Tensor Programs V", https://arxiv.org/abs/2203.03466, table 3): see ``param_groups``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from gptlab import torch_features
from gptlab.errors import ConfigError
from gptlab.registry import Choice, Registry, check_keys, check_type

REGISTRY: Registry[type[Optimizer]] = Registry("optimizer", "optim")
register = REGISTRY.register
get = REGISTRY.get
names = REGISTRY.names

DEFAULT = "adamw"  # the choice of a node without a name (checkpoints written before optim=muon existed)


def _example(options: Any, key: str) -> str:
    """The default of field ``key`` as a command-line override writes it: the fix a message suggests."""
    value = next(f.default for f in dataclasses.fields(options) if f.name == key)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


@dataclass(frozen=True)
class ScheduleOptions:
    """The learning-rate schedule every optimizer follows: ``warmup_steps`` of linear warmup, then ``cosine``
    decay to ``min_lr_ratio * lr`` at ``trainer.max_steps``, or ``wsd`` (held at the peak, then a
    ``decay_shape`` decay over the last ``decay_fraction`` of the steps)."""

    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # the schedule ends at min_lr_ratio * lr
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_fraction: float = 0.2  # wsd: the share of trainer.max_steps spent decaying
    decay_shape: Literal["linear", "1-sqrt"] = "1-sqrt"  # wsd

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be >= 0.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1].")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(
                f"optim.decay_fraction={self.decay_fraction} must be in (0, 1]: the share of trainer.max_steps "
                f"over which optim.schedule=wsd decays (e.g. optim.decay_fraction={_example(self, 'decay_fraction')})."
            )

    def check_fits(self, max_steps: int) -> None:
        """The warmup and the WSD decay fit in a run of ``max_steps`` optimizer steps."""
        if self.schedule != "wsd":
            return
        decay = decay_steps(max_steps, self.decay_fraction)
        if self.warmup_steps + decay > max_steps:
            raise ConfigError(
                f"optim.warmup_steps={self.warmup_steps} plus the WSD decay ({decay} steps: "
                f"optim.decay_fraction={self.decay_fraction} of trainer.max_steps={max_steps}) exceed "
                "the run: shorten the warmup, lower optim.decay_fraction or raise trainer.max_steps."
            )

    def warmup_outlasts(self, max_steps: int) -> str | None:
        """What a warmup no shorter than the run does to its learning rate, with the fix; None where the
        warmup ends before the last step. Not refused: a smoke run of a few steps may mean it, but its loss
        then says little about the recipe, and a newcomer reads it as the model's."""
        if max_steps < 1 or self.warmup_steps < max_steps:
            return None
        peak = self.factor(max_steps)(max_steps - 1)  # the last step's multiplier: the highest it reaches
        lr = getattr(self, "lr", None)
        of_lr = f"optim.lr={lr:g} ({lr * peak:.3g})" if isinstance(lr, float) else "optim.lr"
        return (
            f"optim.warmup_steps={self.warmup_steps} is not shorter than trainer.max_steps={max_steps}: the "
            f"learning rate rises for the whole run, to {peak:.0%} of {of_lr} at its last step, and never "
            f"decays. Use optim.warmup_steps below {max_steps} (e.g. optim.warmup_steps={max(1, max_steps // 10)}), "
            "or more steps."
        )

    def factor(self, max_steps: int) -> Callable[[int], float]:
        """The multiplier of the peak rate at each optimizer step of a run of ``max_steps`` steps."""

        def factor(step: int) -> float:
            return lr_factor(
                step,
                self.warmup_steps,
                max_steps,
                self.min_lr_ratio,
                self.schedule,
                self.decay_fraction,
                self.decay_shape,
            )

        return factor


@dataclass(frozen=True)
class AdamWOptions(ScheduleOptions):
    """``optim=adamw``: AdamW's peak rate, decoupled weight decay (on matrices only), betas and epsilon, and
    the schedule."""

    lr: float = 4e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.lr > 0:
            raise ConfigError(f"optim.lr={self.lr} must be positive (e.g. optim.lr={_example(self, 'lr')}).")
        if self.weight_decay < 0:
            raise ConfigError(
                f"optim.weight_decay={self.weight_decay} must be >= 0 "
                f"(e.g. optim.weight_decay={_example(self, 'weight_decay')})."
            )
        if not self.eps > 0:
            raise ConfigError(
                f"optim.eps={self.eps} must be positive (e.g. optim.eps={_example(self, 'eps')})."
            )
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ConfigError(
                f"optim.betas={list(betas)} must be two numbers in [0, 1) "
                f"(e.g. optim.betas={_example(self, 'betas')})."
            )
        object.__setattr__(self, "betas", betas)  # a YAML list, kept as the tuple torch takes

    def adamw_kwargs(self, fused: bool = False) -> dict[str, Any]:
        """``torch.optim.AdamW``'s arguments (the rates and weight decay are set per param group);
        ``fused``: its fused kernel."""
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, **({"fused": True} if fused else {})}


@dataclass(frozen=True)
class MuonOptions(AdamWOptions):
    """``optim=muon``: AdamW's options (for the embeddings, the head, gains and biases, and the schedule) and
    Muon's own, for the blocks' hidden matrices."""

    muon_lr: float = 0.02  # Keller Jordan's default with adjust_lr_fn=original
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = "original"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.muon_lr > 0:
            raise ConfigError(
                f"optim.muon_lr={self.muon_lr} must be positive (e.g. optim.muon_lr={_example(self, 'muon_lr')})."
            )
        if not 0 <= self.momentum < 1:
            raise ConfigError(
                f"optim.momentum={self.momentum} must be in [0, 1) (e.g. {_example(self, 'momentum')})."
            )
        if not 1 <= self.ns_steps < 100:
            raise ConfigError(
                f"optim.ns_steps={self.ns_steps!r} must be an integer in [1, 99] (e.g. {_example(self, 'ns_steps')})."
            )

    def muon_kwargs(self) -> dict[str, Any]:
        """``torch.optim.Muon``'s arguments."""
        return {
            "lr": self.muon_lr,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "ns_steps": self.ns_steps,
            "adjust_lr_fn": self.adjust_lr_fn,
        }


class Optimizer:
    """Base of the family: an optimizer builds a torch optimizer over a model's parameters from its
    ``Options``, and says which runs it cannot serve (``check_run``)."""

    #: The optimizer's options (besides ``name``): a dataclass with defaults, extending ScheduleOptions.
    Options: ClassVar[type] = ScheduleOptions
    #: The name the ``optim`` node chooses it by (set by the registry).
    choice_name: ClassVar[str] = ""

    @classmethod
    def check_run(cls, options: Any, max_steps: int | None = None, strategy: str | None = None) -> None:
        """Checks that need the run as well as the options: the schedule fits in ``trainer.max_steps``."""
        if max_steps:
            options.check_fits(max_steps)

    @classmethod
    def param_groups(
        cls, model: nn.Module, options: Any, hidden_lr_scale: float = 1.0
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(AdamW groups, Muon groups) of ``model``."""
        raise NotImplementedError

    @classmethod
    def build(
        cls, model: nn.Module, options: Any, hidden_lr_scale: float = 1.0, fused: bool = False
    ) -> torch.optim.Optimizer:
        raise NotImplementedError


@register("adamw")
class AdamW(Optimizer):
    """AdamW on every parameter (Loshchilov & Hutter 2019, https://arxiv.org/abs/1711.05101); weight decay
    on matrices, none on biases and gains.

    - standard parametrisation: two groups, every matrix and every vector (the layout of checkpoints written
      before optim=muon and muP existed, so that they resume);
    - under muP: the hidden matrices in a group of their own at ``lr * hidden_lr_scale``."""

    Options = AdamWOptions

    @classmethod
    def param_groups(
        cls, model: nn.Module, options: Any, hidden_lr_scale: float = 1.0
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        hidden, other_matrices, vectors = split_parameters(model)
        lr, wd = options.lr, options.weight_decay
        gains = {"params": vectors, "lr": lr, "weight_decay": 0.0, "group": "gains_biases"}
        if hidden_lr_scale == 1.0:
            ids = {id(p) for p in hidden + other_matrices}
            matrices = [p for p in model.parameters() if id(p) in ids]  # in the model's order
            groups = [{"params": matrices, "lr": lr, "weight_decay": wd, "group": "matrices"}, gains]
        else:
            groups = [
                {"params": hidden, "lr": lr * hidden_lr_scale, "weight_decay": wd, "group": "hidden"},
                {"params": other_matrices, "lr": lr, "weight_decay": wd, "group": "embeddings_head"},
                gains,
            ]
        return [g for g in groups if g["params"]], []

    @classmethod
    def build(
        cls, model: nn.Module, options: Any, hidden_lr_scale: float = 1.0, fused: bool = False
    ) -> torch.optim.Optimizer:
        adamw_groups, _ = cls.param_groups(model, options, hidden_lr_scale)
        return torch.optim.AdamW(adamw_groups, **options.adamw_kwargs(fused))


@register("muon")
class Muon(AdamW):
    """``torch.optim.Muon`` (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) on the blocks'
    hidden matrices at ``muon_lr``, AdamW (its options inherited) on the rest, stepped as one optimizer
    (:class:`MuonWithAdamW`): the split of Liu et al. 2025 (https://arxiv.org/abs/2502.16982)."""

    Options = MuonOptions

    @classmethod
    def check_run(cls, options: Any, max_steps: int | None = None, strategy: str | None = None) -> None:
        super().check_run(options, max_steps, strategy)
        # torch.optim.Muon is in torch >= 2.9: an older one is refused here, not at the first step
        torch_features.require("muon", "optim=muon", "optim=adamw")
        # DeepSpeed's ZeRO partitions each rank's parameters as slices of one flat 1-D buffer and steps the
        # optimizer on those slices: a Newton-Schulz iteration needs the whole 2-D matrix. (FSDP2 keeps each
        # parameter a 2-D DTensor sharded by rows; torch's Muon multiplies those, and the products gather the
        # shards: it runs, each rank orthogonalising whole matrices.)
        if strategy and strategy.startswith("deepspeed"):
            raise ConfigError(
                f"optim=muon cannot run under strategy={strategy}: DeepSpeed ZeRO hands the optimizer flat 1-D "
                "slices of the parameters, and Muon orthogonalises whole 2-D matrices. Use strategy=fsdp "
                "(sharded) or strategy=ddp with optim=muon, or optim=adamw under DeepSpeed."
            )

    @classmethod
    def param_groups(
        cls, model: nn.Module, options: Any, hidden_lr_scale: float = 1.0
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        hidden, other_matrices, vectors = split_parameters(model)
        lr, wd = options.lr, options.weight_decay
        adamw = [
            {"params": other_matrices, "lr": lr, "weight_decay": wd, "group": "embeddings_head"},
            {"params": vectors, "lr": lr, "weight_decay": 0.0, "group": "gains_biases"},
        ]
        muon = [{"params": hidden, "lr": options.muon_lr, "weight_decay": wd, "group": "hidden_muon"}]
        return [g for g in adamw if g["params"]], [g for g in muon if g["params"]]

    @classmethod
    def build(
        cls, model: nn.Module, options: Any, hidden_lr_scale: float = 1.0, fused: bool = False
    ) -> torch.optim.Optimizer:
        adamw_groups, muon_groups = cls.param_groups(model, options, hidden_lr_scale)
        adamw_kwargs = options.adamw_kwargs(fused)
        if not muon_groups:  # a model without hidden matrices
            return torch.optim.AdamW(adamw_groups, **adamw_kwargs)
        return MuonWithAdamW(adamw_groups, muon_groups, adamw_kwargs, options.muon_kwargs())


def parse_optim(
    node: Mapping[str, Any] | None = None, max_steps: int | None = None, strategy: str | None = None
) -> Choice:
    """The ``optim`` node as the chosen optimizer with its typed options, or a ConfigError naming the bad key
    or value and the fix: the one check of the optimizer, at config time. ``max_steps`` and ``strategy`` (when
    known) also check that the schedule fits in the run and that the strategy can step the optimizer."""
    values = dict(node or {})
    name = values.pop("name", DEFAULT)
    cls = get(name)  # an unknown name: the registry's message, with the closest name
    options_type = cls.Options
    fields = _field_names(options_type)
    # a key of another optimizer (optim.muon_lr under optim=adamw): the fix names that optimizer
    unknown = set(values) - set(fields)
    owners = [n for n in names() if unknown and unknown <= set(_field_names(get(n).Options))]
    fix = f"Choose optim={owners[0]} for {get(owners[0]).__name__}'s options." if owners else ""
    check_keys(values, fields, f"optim={name}", "optim", fix)
    hints = typing.get_type_hints(options_type)
    typed = {key: _typed(value, hints[key], key, options_type) for key, value in values.items()}
    options = options_type(**typed)
    cls.check_run(options, max_steps, strategy)
    return Choice(name, options)


def _field_names(options_type: type) -> list[str]:
    """The options' keys, in the order the dataclass declares them (the schedule's first)."""
    return [f.name for f in dataclasses.fields(options_type)]


def _typed(value: Any, hint: Any, key: str, options_type: type) -> Any:
    """``value`` as field ``key`` of ``options_type`` takes it (an int where a float is wanted becomes a
    float, a list of betas a tuple), or a ConfigError with the default as the example."""
    label = f"optim.{key}"
    try:
        if typing.get_origin(hint) is tuple:  # betas: given as a YAML or command-line list
            items = typing.get_args(hint)
            if not isinstance(value, (list, tuple)) or len(value) != len(items):
                raise ConfigError(label)
            return tuple(check_type(v, t, label) for v, t in zip(value, items))
        return check_type(value, hint, label)
    except ConfigError:
        close: list[str] = []
        if typing.get_origin(hint) is tuple:
            what = f"a list of {len(typing.get_args(hint))} numbers"
        elif typing.get_origin(hint) is Literal:
            choices = [str(a) for a in typing.get_args(hint)]
            what = "one of " + ", ".join(choices)
            close = difflib.get_close_matches(str(value), choices, n=1)  # cosin: cosine
        else:
            what = _DESCRIPTIONS.get(hint, str(hint))
        raise ConfigError(
            f"{label}={value!r} must be {what} (e.g. {label}={_example(options_type, key)})."
            + (f" Did you mean {label}={close[0]}?" if close else "")
        ) from None


_DESCRIPTIONS: dict[Any, str] = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}


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


def schedule_of(optim: Choice, max_steps: int) -> Callable[[int], float]:
    """The schedule of a parsed ``optim`` choice over a run of ``max_steps`` steps."""
    return optim.options.factor(max_steps)


# ---- parameter groups ---------------------------------------------------------------------------------
def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """A 2-D weight inside a transformer block (attention Q/K/V and output projections, the MLP's two
    matrices, each MoE expert's two, one matrix per expert): Muon's parameters, and the ones muP's Adam rule
    rescales. Embeddings, the head and any positional scheme's own weights sit outside the blocks. Multi-token
    prediction's extra heads are blocks too (model.param=mup refuses them). An MoE router (``mlp.router``) is
    not one: like the head it is a readout, a token's logits over a few classes (the experts) whose scale the
    softmax and the z-loss read, and an orthogonalised update would give each of its few rows the same step
    whatever its gradient; it takes AdamW, with the embeddings and the head."""
    return (
        name.startswith(("transformer.h.", "mtp.blocks."))
        and p.dim() == 2
        and not name.endswith(".mlp.router.weight")
    )


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(hidden matrices, other matrices, vectors) of ``model``'s trainable parameters; a tied head is listed
    once, as the embedding."""
    hidden, other_matrices, vectors = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_hidden_matrix(name, p):
            hidden.append(p)
        elif p.dim() >= 2:
            other_matrices.append(p)
        else:
            vectors.append(p)
    return hidden, other_matrices, vectors


def param_groups(
    model: nn.Module, optim: Choice, hidden_lr_scale: float = 1.0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(AdamW groups, Muon groups) of ``model`` under the parsed ``optim`` choice. Weight decay on matrices,
    none on biases and gains (see :class:`AdamW` and :class:`Muon`)."""
    return get(optim.name).param_groups(model, optim.options, hidden_lr_scale)


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
    model: nn.Module, optim: Choice, hidden_lr_scale: float = 1.0, fused: bool = False
) -> torch.optim.Optimizer:
    """The torch optimizer of the parsed ``optim`` choice over ``model``'s parameters: AdamW, or Muon with
    AdamW. ``hidden_lr_scale``: muP's factor on the hidden matrices' AdamW rate; ``fused``: AdamW's fused
    kernel."""
    return get(optim.name).build(model, optim.options, hidden_lr_scale, fused)
