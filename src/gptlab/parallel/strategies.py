"""The `strategy=` choices: one class per choice, with its typed options, what each device holds, how its
checkpoints are laid out, the hardware it needs, and the Lightning strategy it builds.

This is the one strategy vocabulary of the project: the trainer builds from it, the memory planner
(`gptlab.planning`) sizes a run from each choice's `placement`, and checkpoint writing follows
`writes_directory`. What every choice declares is `StrategyChoice`, with what each device holds as a
`Placement`; the choices follow it. Adding a strategy is a class here (registered by name) and a YAML in
conf/strategy/.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Literal

import torch

from gptlab.errors import ConfigError
from gptlab.parallel.hardware import launched_externally, world_size
from gptlab.registry import CONFIG_DIR, NoOptions, Registry, build_options

STRATEGIES: Registry[type[StrategyChoice]] = Registry("strategy", "strategy")
STRATEGY_CONFIGS = CONFIG_DIR / "strategy"


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
        (`gptlab.parallel.checkpoint_io`)."""
        from gptlab.parallel.checkpoint_io import AtomicCheckpointIO

        return [] if self.writes_directory() else [AtomicCheckpointIO()]


# How long a rank waits in a collective for the others (torch's process-group timeout), by default: NCCL's own
# default and Megatron-LM's. Lightning passes 30 minutes, which a stuck rank holds every GPU idle for. A lost
# rank on this node is noticed within seconds without it (gptlab.parallel.ranks); the timeout bounds the wait
# for a rank that is alive but stuck, or on another node. A rank's longest legitimate wait is for rank 0
# writing a single-file checkpoint (ddp), or for the slowest rank to start and join.
DEFAULT_TIMEOUT_S = 600.0


def check_timeout(label: str, timeout_s: float) -> None:
    if not timeout_s > 0:
        raise ConfigError(
            f"strategy.timeout_s={timeout_s!r}: the seconds a rank waits in a collective for the others must be "
            f"positive (strategy={label}). The default is {DEFAULT_TIMEOUT_S:g}; raise it when a checkpoint "
            "takes longer than that to write."
        )


def process_group_timeout(timeout_s: float) -> timedelta:
    return timedelta(seconds=timeout_s)


# The choices.


@STRATEGIES.register("auto")
class AutoStrategy(StrategyChoice):
    """Lightning's choice: one device, or DDP when several are configured."""

    name = "auto"
    lightning_decides = True
    relaunches_command = True  # with several devices Lightning picks DDP, started by re-running the command

    def placement(self, n_devices: int) -> Placement:
        return REPLICATED if n_devices > 1 else SINGLE_DEVICE

    def build(self, trainer_cfg: dict[str, Any]) -> Any:
        return "auto"


@dataclass(frozen=True)
class DDPOptions:
    find_unused_parameters: bool = False
    process_group_backend: str | None = None  # None: nccl on GPUs, gloo on CPUs
    timeout_s: float = DEFAULT_TIMEOUT_S  # how long a rank waits in a collective for the others


@STRATEGIES.register("ddp")
class DDP(StrategyChoice):
    """Distributed data parallel: a full replica per device, gradients averaged by all-reduce in buckets
    during the backward pass (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
    Parallel Training", https://arxiv.org/abs/2006.15704). Ranks > 0 are started by re-running the command
    line (or by srun / torchrun)."""

    name = "ddp"
    Options = DDPOptions
    relaunches_command = True
    start_method: ClassVar[Literal["popen", "spawn", "fork", "forkserver"]] = "popen"

    def placement(self, n_devices: int) -> Placement:
        return REPLICATED

    def check(self, trainer_cfg: dict[str, Any]) -> None:
        check_timeout(self.label, self.options.timeout_s)

    def build(self, trainer_cfg: dict[str, Any]) -> Any:
        from gptlab.parallel.ranks import WatchedDDPStrategy

        return WatchedDDPStrategy(
            start_method=self.start_method,
            find_unused_parameters=self.options.find_unused_parameters,
            process_group_backend=self.options.process_group_backend,
            timeout=process_group_timeout(self.options.timeout_s),
        )


@STRATEGIES.register("ddp_spawn")
class DDPSpawn(DDP):
    """DDP (Li et al. 2020, https://arxiv.org/abs/2006.15704) whose ranks are started with
    `multiprocessing.spawn` inside the running Python process: it works inside a Hydra multirun and in
    notebooks, at the cost of pickling the module and data into each rank."""

    name = "ddp_spawn"
    relaunches_command = False
    start_method = "spawn"


@dataclass(frozen=True)
class FSDPOptions:
    reshard_after_forward: bool = True
    hybrid: bool = False
    cpu_offload: bool = False
    save_distributed_checkpoint: bool = True
    process_group_backend: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S


@STRATEGIES.register("fsdp")
class FSDP(StrategyChoice):
    """Fully sharded data parallel, FSDP2 (`torch.distributed.fsdp.fully_shard`; Zhao et al. 2023, "PyTorch
    FSDP: Experiences on Scaling Fully Sharded Data Parallel", https://arxiv.org/abs/2304.11277): weights,
    gradients and optimizer states are split across ranks, one transformer block being the unit that is
    gathered for its forward and backward. ``reshard_after_forward: false`` keeps gathered weights from the
    forward to the backward (ZeRO-2-like: more memory, less communication); ``hybrid: true`` shards within a
    node and replicates across nodes (HSDP); ``cpu_offload: true`` keeps the sharded weights, gradients
    and optimizer states in CPU memory. Runs on CPU (gloo) and GPU (NCCL); checkpoints are directories in
    PyTorch's distributed checkpoint format, one shard file per rank."""

    name = "fsdp"
    Options = FSDPOptions
    relaunches_command = True

    def placement(self, n_devices: int) -> Placement:
        offload = self.options.cpu_offload
        return Placement(
            shards_optimizer=True,
            shards_gradients=True,
            shards_weights=True,
            offload_optimizer=offload,
            offload_gradients=offload,
            offload_weights=offload,
        )

    def writes_directory(self) -> bool:
        return self.options.save_distributed_checkpoint

    def check(self, trainer_cfg: dict[str, Any]) -> None:
        check_timeout(self.label, self.options.timeout_s)
        if self.options.cpu_offload and (
            trainer_cfg.get("accelerator") == "cpu" or not torch.cuda.is_available()
        ):
            raise ConfigError(
                "strategy.cpu_offload=true moves the shards between CPU memory and the GPUs, but this run has no "
                "GPU (on CPUs the shards are in CPU memory already). Set strategy.cpu_offload=false."
            )
        if self.options.hybrid and int(trainer_cfg.get("num_nodes", 1) or 1) < 2:
            raise ConfigError(
                "strategy.hybrid=true shards within a node and replicates across nodes, but trainer.num_nodes="
                f"{trainer_cfg.get('num_nodes', 1)}. Set trainer.num_nodes to 2 or more, or strategy.hybrid=false."
            )

    def build(self, trainer_cfg: dict[str, Any]) -> Any:
        from gptlab.parallel.checkpoint_io import FullyShardedStrategy

        o = self.options
        return FullyShardedStrategy(
            reshard_after_forward=o.reshard_after_forward,
            hybrid=o.hybrid,
            cpu_offload=o.cpu_offload,
            save_distributed_checkpoint=o.save_distributed_checkpoint,
            process_group_backend=o.process_group_backend,
            timeout=process_group_timeout(o.timeout_s),
        )


@dataclass(frozen=True)
class DeepSpeedOptions:
    stage: int = 2
    offload_optimizer: bool = False
    offload_parameters: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S


@STRATEGIES.register("deepspeed")
class DeepSpeed(StrategyChoice):
    """DeepSpeed ZeRO through Lightning (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
    Trillion Parameter Models", https://arxiv.org/abs/1910.02054): stage 1 shards the optimizer states,
    stage 2 also the gradients, stage 3 also the weights; the offload variants keep optimizer states
    (and in stage 3 weights) in CPU memory (Ren et al. 2021, "ZeRO-Offload", https://arxiv.org/abs/2101.06840).
    Lightning runs DeepSpeed on CUDA GPUs only. Checkpoints are directories written by the DeepSpeed engine."""

    name = "deepspeed"
    Options = DeepSpeedOptions
    relaunches_command = True

    @classmethod
    def from_config(cls, strategy_cfg: dict[str, Any]) -> StrategyChoice:
        choice = super().from_config(strategy_cfg)
        if "choice" not in strategy_cfg:
            o = choice.options
            offload = "_offload" if o.offload_optimizer or o.offload_parameters else ""
            choice.label = f"deepspeed_stage_{o.stage}{offload}"
        return choice

    def placement(self, n_devices: int) -> Placement:
        stage = self.options.stage
        return Placement(
            shards_optimizer=stage >= 1,
            shards_gradients=stage >= 2,
            shards_weights=stage >= 3,
            offload_optimizer=self.options.offload_optimizer,
            offload_weights=self.options.offload_parameters,
            sixteen_bit_master=True,
            extra_package=True,
        )

    def writes_directory(self) -> bool:
        return True

    def check(self, trainer_cfg: dict[str, Any]) -> None:
        check_timeout(self.label, self.options.timeout_s)
        stage = self.options.stage
        if stage not in (1, 2, 3):
            raise ConfigError(f"strategy.stage={stage!r}: DeepSpeed ZeRO stages are 1, 2 and 3.")
        if self.options.offload_parameters and stage != 3:
            raise ConfigError(
                f"strategy.offload_parameters=true needs ZeRO stage 3 (strategy.stage={stage}): only stage 3 "
                "shards the weights. Use strategy=deepspeed_stage_3_offload."
            )
        if trainer_cfg.get("accelerator") == "cpu" or not torch.cuda.is_available():
            why = (
                "trainer.accelerator=cpu"
                if trainer_cfg.get("accelerator") == "cpu"
                else "no CUDA GPU is visible on this machine"
            )
            raise ConfigError(
                f"strategy={self.label} needs CUDA GPUs (Lightning runs DeepSpeed only on CUDA), but {why}. "
                "On CPUs use strategy=fsdp (sharded weights, gradients and optimizer states, as ZeRO-3) or "
                "strategy=ddp."
            )
        try:
            import deepspeed  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                f"strategy={self.label} needs the deepspeed package: pip install -e '.[deepspeed]' ({e})."
            ) from None

    def build(self, trainer_cfg: dict[str, Any]) -> Any:
        from gptlab.parallel.checkpoint_io import AtomicDeepSpeedStrategy

        o = self.options
        return AtomicDeepSpeedStrategy(
            stage=o.stage,
            offload_optimizer=o.offload_optimizer,
            offload_parameters=o.offload_parameters,
            timeout=process_group_timeout(o.timeout_s),
        )


# ---- from a config, a name or a YAML choice ----------------------------------------------------------


def strategy_choices() -> list[str]:
    """Every `strategy=` choice a user can type (the YAML files of conf/strategy)."""
    return sorted(p.stem for p in STRATEGY_CONFIGS.glob("*.yaml"))


def strategy_choice(strategy: dict[str, Any] | str | StrategyChoice | None) -> StrategyChoice:
    """The choice for a ``strategy`` config node (``{"name": "fsdp", ...}``), a `strategy=` YAML name
    (``deepspeed_stage_3_offload``) or a registered name (``ddp``)."""
    if isinstance(strategy, StrategyChoice):
        return strategy
    if strategy is None:
        strategy = "auto"
    if isinstance(strategy, str):
        yaml_file = STRATEGY_CONFIGS / f"{strategy}.yaml"
        if yaml_file.is_file():
            from omegaconf import OmegaConf

            node = OmegaConf.to_container(OmegaConf.load(yaml_file), resolve=True)
            strategy = {"choice": strategy, **node}  # type: ignore[dict-item]
        elif strategy in STRATEGIES:
            strategy = {"name": strategy}
        else:
            import difflib

            close = difflib.get_close_matches(strategy, strategy_choices(), n=1)
            raise ConfigError(
                f"Unknown strategy {strategy!r}. Choose one of: {', '.join(strategy_choices())}."
                + (f" Did you mean strategy={close[0]}?" if close else "")
            )
    name = strategy.get("name", "auto")
    return STRATEGIES.get(name).from_config(strategy)


def build_strategy(strategy_cfg: dict[str, Any], trainer_cfg: dict[str, Any], multirun: bool = False) -> Any:
    """Check the strategy against the hardware and the launch, then build it (a Lightning strategy object
    or the string "auto"). Raises ConfigError before any work when the combination cannot run."""
    choice = strategy_choice(strategy_cfg)
    choice.check(trainer_cfg)
    check_launch(choice, trainer_cfg, multirun)
    return choice.build(trainer_cfg)


def check_launch(choice: StrategyChoice, trainer_cfg: dict[str, Any], multirun: bool) -> None:
    """Refuse a Hydra multirun whose jobs would start their ranks by re-running the command line: each
    child would receive `-m ...` and run a sweep of its own."""
    if not multirun or not choice.relaunches_command or launched_externally():
        return
    if world_size(trainer_cfg) <= 1:
        return
    raise ConfigError(
        f"strategy={choice.label} with {world_size(trainer_cfg)} processes starts its ranks by re-running the "
        "command line, so inside a multirun (-m) every rank would run a sweep of its own. For a sweep on one "
        "machine use strategy=ddp_spawn; on a cluster use hydra/launcher=slurm (SLURM starts the ranks); "
        "or run the jobs one by one without -m."
    )


def check_rank_zero_evaluation(choice: StrategyChoice, trainer_cfg: dict[str, Any], what: str) -> None:
    """Refuse an evaluation that runs a forward pass on rank 0 alone when the weights are sharded: the
    other ranks hold the rest of each layer, and rank 0 would wait for them forever."""
    n = world_size(trainer_cfg)
    if n > 1 and choice.placement(n).shards_weights:
        raise ConfigError(
            f"{what} evaluates the trained model on rank 0 alone after training, but strategy={choice.label} "
            f"shards the weights over the {n} processes. Train with {what.split('=')[0]}=false, then run "
            "scripts/eval_length.py on the run directory (one process reads the whole checkpoint); or train "
            "with strategy=ddp."
        )
