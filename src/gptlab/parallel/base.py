"""What every `strategy=` choice declares: its typed options, what each device holds (`Placement`), how its
checkpoints are laid out, the hardware it needs, and how it builds. The choices are in
`gptlab.parallel.strategies`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from gptlab.registry import NoOptions, Registry, build_options

STRATEGIES: Registry[type[StrategyChoice]] = Registry("strategy", "strategy")
STRATEGY_CONFIGS = Path(__file__).resolve().parents[3] / "conf" / "strategy"


@dataclass(frozen=True)
class Placement:
    """What each of N data-parallel devices holds of the training state (weights, gradients, AdamW state),
    in the terms of ZeRO (Rajbhandari et al. 2020, https://arxiv.org/abs/1910.02054): a part is either
    replicated on every device or sharded (1/N on each), and may be offloaded to host memory."""

    shards_optimizer: bool = False
    shards_gradients: bool = False
    shards_weights: bool = False
    offload_optimizer: bool = False
    offload_gradients: bool = False
    offload_weights: bool = False
    # DeepSpeed's mixed precision keeps 16-bit weights and gradients and an fp32 master copy in the optimizer.
    sixteen_bit_master: bool = False
    gradient_buckets: bool = False  # DDP's communication buckets: one more copy of the gradients
    # Needs a package beyond torch and Lightning (DeepSpeed): the planner suggests others first.
    extra_package: bool = False

    @property
    def distributed(self) -> bool:
        return self.gradient_buckets or self.shards_optimizer

    def cost_rank(self) -> tuple[int, int, int]:
        """Ordering from least to most communication and host traffic: the planner suggests the first
        placement that fits."""
        offloads = self.offload_optimizer + self.offload_gradients + self.offload_weights
        shards = self.shards_optimizer + self.shards_gradients + self.shards_weights
        return offloads, shards, int(self.extra_package)


SINGLE_DEVICE = Placement()
REPLICATED = Placement(gradient_buckets=True)


class StrategyChoice:
    """A `strategy=` choice: its options (the YAML's keys beside `name`), checked and typed."""

    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    # Lightning starts the ranks by re-running the command line (a Hydra multirun cannot survive that).
    relaunches_command: ClassVar[bool] = False
    # Lightning picks the strategy by the device count: the planner names the explicit choice instead.
    lightning_decides: ClassVar[bool] = False

    def __init__(self, options: Any = None, label: str | None = None) -> None:
        self.options = options if options is not None else self.Options()
        self.label = label or self.name  # the YAML's file name, for messages

    @classmethod
    def from_config(cls, strategy_cfg: dict[str, Any]) -> StrategyChoice:
        values = dict(strategy_cfg)
        values.pop("name", None)
        label = values.pop("choice", None) or cls.name
        return cls(build_options(cls.Options, values, f"strategy={label}", "strategy"), label)

    def placement(self, n_devices: int) -> Placement:
        """What each of ``n_devices`` devices holds."""
        return SINGLE_DEVICE

    def writes_directory(self) -> bool:
        """Checkpoints are directories (one shard per rank), not one file written by rank 0."""
        return False

    def check(self, trainer_cfg: dict[str, Any]) -> None:
        """Raise a ConfigError when this strategy cannot run on the configured hardware."""

    def build(self, trainer_cfg: dict[str, Any]) -> Any:
        raise NotImplementedError

    def plugins(self) -> list[Any]:
        """Trainer plugins this strategy's checkpoints need: an atomic single-file writer where rank 0
        writes one file; none for checkpoint directories, which the built strategy writes atomically itself
        (`gptlab.parallel.lightning_strategies`)."""
        from gptlab.parallel.checkpoint_io import AtomicCheckpointIO

        return [] if self.writes_directory() else [AtomicCheckpointIO()]
