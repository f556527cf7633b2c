"""Parallel strategies, precision, compilation and activation checkpointing, applied from outside the model.

One small class per `strategy=` choice, registered by name; each checks its options against the hardware at
config time (before any data or model work) and builds the Lightning strategy. The model code knows none of
this: `parallelize` shards, checkpoints and compiles the transformer blocks of a built `GPT` in place, called
from `GPTLitModule.configure_model` once the processes exist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import lightning as L
import torch
from torch import nn

from gptlab.errors import ConfigError
from gptlab.registry import Registry

STRATEGIES: Registry[type[StrategyChoice]] = Registry("strategy", "strategy")


# ---- hardware and process layout ------------------------------------------------------------------
def choose_precision(requested: Any, accelerator: str | None = "auto") -> Any:
    """fp32 on CPU (bf16 matrix products run far slower than fp32 on CPUs); bf16 mixed precision on GPUs
    that have it, fp16 mixed on older ones."""
    if requested not in (None, "auto"):
        return requested
    if accelerator != "cpu" and torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


def uses_gpus(trainer_cfg: dict[str, Any]) -> bool:
    accelerator = trainer_cfg.get("accelerator", "auto")
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def devices_per_node(trainer_cfg: dict[str, Any]) -> int:
    """How many processes Lightning starts on each node for `trainer.devices` (an int, a list of ids, a
    comma-separated string, -1 or "auto")."""
    devices = trainer_cfg.get("devices", "auto")
    gpus = uses_gpus(trainer_cfg)
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return torch.cuda.device_count() if gpus else 1
        if "," in text:
            return len([d for d in text.split(",") if d.strip()])
        devices = int(text)
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if devices == -1:
        return torch.cuda.device_count() if gpus else (os.cpu_count() or 1)
    return int(devices)


def world_size(trainer_cfg: dict[str, Any]) -> int:
    return devices_per_node(trainer_cfg) * int(trainer_cfg.get("num_nodes", 1) or 1)


def launched_externally() -> bool:
    """True when SLURM (srun), torchrun or MPI started this process as one rank of many: Lightning then
    starts no processes of its own."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    return (
        TorchElasticEnvironment.detect()
        or SLURMEnvironment.detect()
        or LSFEnvironment.detect()
        or MPIEnvironment.detect()
    )


# ---- one class per strategy choice ------------------------------------------------------------------
@dataclass
class StrategyChoice:
    """A `strategy=` choice: its options (the YAML's keys beside `name`) and how it builds."""

    name: ClassVar[str]
    defaults: ClassVar[dict[str, Any]] = {}
    # Lightning starts the ranks by re-running the command line (a Hydra multirun cannot survive that).
    relaunches_command: ClassVar[bool] = False

    options: dict[str, Any]

    @classmethod
    def from_config(cls, strategy_cfg: dict[str, Any]) -> StrategyChoice:
        values = dict(strategy_cfg)
        values.pop("name", None)
        unknown = sorted(set(values) - set(cls.defaults))
        if unknown:
            label = values.get("choice") or cls.name
            raise ConfigError(
                f"Unknown option(s) {unknown} for strategy={label}. Known: {sorted(cls.defaults) or 'none'}."
            )
        return cls({**cls.defaults, **values})

    def check(self, trainer_cfg: dict[str, Any]) -> None:
        """Raise a ConfigError when this strategy cannot run on the configured hardware."""

    def build(self, trainer_cfg: dict[str, Any]) -> Any:
        raise NotImplementedError


@STRATEGIES.register("auto")
class AutoStrategy(StrategyChoice):
    """Lightning's choice: one device, or DDP when several are configured."""

    name = "auto"
    relaunches_command = True  # with several devices Lightning picks DDP, started by re-running the command

    def build(self, trainer_cfg: dict[str, Any]) -> Any:
        return "auto"


@STRATEGIES.register("ddp")
class DDP(StrategyChoice):
    """Distributed data parallel: a full replica per device, gradients averaged by all-reduce in buckets
    during the backward pass (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
    Parallel Training", https://arxiv.org/abs/2006.15704). Ranks > 0 are started by re-running the command
    line (or by srun / torchrun)."""

    name = "ddp"
    relaunches_command = True
    defaults: ClassVar[dict[str, Any]] = {"find_unused_parameters": False, "process_group_backend": None}
    start_method: ClassVar[str] = "popen"

    def build(self, trainer_cfg: dict[str, Any]) -> Any:
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(
            start_method=self.start_method,
            find_unused_parameters=self.options["find_unused_parameters"],
            process_group_backend=self.options["process_group_backend"],
        )


@STRATEGIES.register("ddp_spawn")
class DDPSpawn(DDP):
    """DDP (Li et al. 2020, https://arxiv.org/abs/2006.15704) whose ranks are started with
    `multiprocessing.spawn` inside the running Python process: it works inside a Hydra multirun and in
    notebooks, at the cost of pickling the module and data into each rank."""

    name = "ddp_spawn"
    relaunches_command = False
    start_method = "spawn"


def _fsdp2_strategy_class() -> type:
    from lightning.pytorch.strategies import ModelParallelStrategy

    class FullyShardedStrategy(ModelParallelStrategy):
        """Lightning's ModelParallelStrategy with every rank in the data-parallel dimension (no tensor
        parallelism), carrying the FSDP options that `parallelize` reads in `configure_model`."""

        def __init__(
            self, reshard_after_forward: bool, hybrid: bool, cpu_offload: bool, **kwargs: Any
        ) -> None:
            super().__init__(**kwargs)
            self.reshard_after_forward = reshard_after_forward
            self.hybrid = hybrid
            self.cpu_offload = cpu_offload

        def setup_environment(self) -> None:
            self._data_parallel_size = self.num_nodes * self.num_processes
            self._tensor_parallel_size = 1
            super().setup_environment()

    return FullyShardedStrategy


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
    relaunches_command = True
    defaults: ClassVar[dict[str, Any]] = {
        "reshard_after_forward": True,
        "hybrid": False,
        "cpu_offload": False,
        "save_distributed_checkpoint": True,
        "process_group_backend": None,
    }

    def check(self, trainer_cfg: dict[str, Any]) -> None:
        if self.options["cpu_offload"] and (
            trainer_cfg.get("accelerator") == "cpu" or not torch.cuda.is_available()
        ):
            raise ConfigError(
                "strategy.cpu_offload=true moves the shards between CPU memory and the GPUs, but this run has no "
                "GPU (on CPUs the shards are in CPU memory already). Set strategy.cpu_offload=false."
            )
        if self.options["hybrid"] and int(trainer_cfg.get("num_nodes", 1) or 1) < 2:
            raise ConfigError(
                "strategy.hybrid=true shards within a node and replicates across nodes, but trainer.num_nodes="
                f"{trainer_cfg.get('num_nodes', 1)}. Set trainer.num_nodes to 2 or more, or strategy.hybrid=false."
            )

    def build(self, trainer_cfg: dict[str, Any]) -> Any:
        o = self.options
        return _fsdp2_strategy_class()(
            reshard_after_forward=o["reshard_after_forward"],
            hybrid=o["hybrid"],
            cpu_offload=o["cpu_offload"],
            save_distributed_checkpoint=o["save_distributed_checkpoint"],
            process_group_backend=o["process_group_backend"],
        )


@STRATEGIES.register("deepspeed")
class DeepSpeed(StrategyChoice):
    """DeepSpeed ZeRO through Lightning (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
    Trillion Parameter Models", https://arxiv.org/abs/1910.02054): stage 1 shards the optimizer states,
    stage 2 also the gradients, stage 3 also the weights; the offload variants keep optimizer states
    (and in stage 3 weights) in CPU memory (Ren et al. 2021, "ZeRO-Offload", https://arxiv.org/abs/2101.06840).
    Lightning runs DeepSpeed on CUDA GPUs only."""

    name = "deepspeed"
    relaunches_command = True
    defaults: ClassVar[dict[str, Any]] = {
        "stage": 2,
        "offload_optimizer": False,
        "offload_parameters": False,
        "choice": None,  # the YAML's name, for messages
    }

    def label(self) -> str:
        return self.options["choice"] or f"deepspeed_stage_{self.options['stage']}"

    def check(self, trainer_cfg: dict[str, Any]) -> None:
        stage = self.options["stage"]
        if stage not in (1, 2, 3):
            raise ConfigError(f"strategy.stage={stage!r}: DeepSpeed ZeRO stages are 1, 2 and 3.")
        if self.options["offload_parameters"] and stage != 3:
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
                f"strategy={self.label()} needs CUDA GPUs (Lightning runs DeepSpeed only on CUDA), but {why}. "
                "On CPUs use strategy=fsdp (sharded weights, gradients and optimizer states, as ZeRO-3) or "
                "strategy=ddp."
            )
        try:
            import deepspeed  # noqa: F401
        except ImportError as e:
            raise ConfigError(
                f"strategy={self.label()} needs the deepspeed package: pip install -e '.[deepspeed]' ({e})."
            ) from None

    def build(self, trainer_cfg: dict[str, Any]) -> Any:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        o = self.options
        return DeepSpeedStrategy(
            stage=o["stage"],
            offload_optimizer=o["offload_optimizer"],
            offload_parameters=o["offload_parameters"],
        )


def strategy_choice(strategy_cfg: dict[str, Any]) -> StrategyChoice:
    name = strategy_cfg.get("name", "auto")
    return STRATEGIES.get(name).from_config(strategy_cfg)


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
        f"strategy={choice.options.get('choice') or choice.name} with {world_size(trainer_cfg)} processes starts its ranks by re-running the "
        "command line, so inside a multirun (-m) every rank would run a sweep of its own. For a sweep on one "
        "machine use strategy=ddp_spawn; on a cluster use hydra/launcher=slurm (SLURM starts the ranks); "
        "or run the jobs one by one without -m."
    )


# ---- applied to the model inside each rank ------------------------------------------------------------
@dataclass
class ParallelOptions:
    """Options applied to the built model in `configure_model`: per-block `torch.compile` and activation
    checkpointing (recompute each block's activations in the backward pass instead of storing them; Chen et
    al. 2016, "Training Deep Nets with Sublinear Memory Cost", https://arxiv.org/abs/1604.06174)."""

    compile: bool = False
    activation_checkpointing: bool = False

    @classmethod
    def from_config(cls, values: dict[str, Any] | None) -> ParallelOptions:
        values = dict(values or {})
        for key, value in values.items():
            if key not in cls.__dataclass_fields__:
                raise ConfigError(f"Unknown option {key!r}. Known: compile, activation_checkpointing.")
            if not isinstance(value, bool):
                raise ConfigError(f"{key}={value!r} must be true or false.")
        return cls(**values)


def parallelize(
    model: nn.Module, options: ParallelOptions, strategy: Any = None, precision: Any = None
) -> None:
    """Apply, in place and in this order, activation checkpointing, `torch.compile` and FSDP2 sharding to
    every transformer block of ``model`` (``model.transformer.h``), then shard the rest of the model.
    Parameter names stay those of the plain model, so checkpoints load into an unwrapped GPT."""
    if getattr(model, "_gptlab_parallelized", False):  # configure_model runs again for validate/test
        return
    blocks = list(model.transformer.h)
    if options.activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for block in blocks:
            checkpoint(block, use_reentrant=False)
    if options.compile:
        for block in blocks:
            block.compile()
    if strategy is not None and hasattr(strategy, "reshard_after_forward"):
        shard(model, strategy, precision)
    model._gptlab_parallelized = True


def shard(model: nn.Module, strategy: Any, precision: Any = None) -> None:
    """FSDP2 over the data-parallel ranks of ``strategy`` (a `FullyShardedStrategy`): each block is one
    unit; the root unit holds the embedding, the final norm and the (tied) head."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = strategy.device_mesh["data_parallel"]
    if strategy.hybrid:
        # Replicate across nodes, shard within a node: (num_nodes, devices per node).
        mesh = init_device_mesh(
            strategy.root_device.type,
            (strategy.num_nodes, strategy.num_processes),
            mesh_dim_names=("replicate", "shard"),
        )
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy() if strategy.cpu_offload else OffloadPolicy(),
    }
    if str(precision).startswith("bf16"):
        # Gather and compute in bf16, reduce gradients in fp32 (the master weights stay fp32).
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=strategy.reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=strategy.reshard_after_forward, **kwargs)


# ---- SLURM preemption -------------------------------------------------------------------------------
def slurm_job_id() -> str | None:
    """The id `scontrol requeue` takes: <array job>_<task> for an array task (a Hydra sweep), else the job."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def slurm_requeue_parts() -> tuple[list[Any], list[Any]]:
    """(Trainer plugins, callbacks) that make a SLURM job survive preemption and time limits, or two empty
    lists outside SLURM. Lightning's own SIGUSR1 handler saves from inside the signal handler, in the middle
    of a step (a resumed run then trains one step less), and in each rank at its own moment; here the signal
    only sets a flag, and every rank saves together at the next step boundary."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return [], []
    return [SLURMEnvironment(auto_requeue=False)], [SlurmRequeue()]


class SlurmRequeue(L.Callback):
    """On SLURM's warning signal (`#SBATCH --signal=USR1@<seconds>`), save `<default_root_dir>/hpc_ckpt_<n>.ckpt`
    at the next step boundary on every rank, requeue the job from rank 0 (`scontrol requeue`) and exit. The
    requeued job runs the same command in the same run directory, and Lightning, finding `hpc_ckpt_*.ckpt`
    there under SLURM, resumes from the newest one."""

    def __init__(self, signum: int | None = None) -> None:
        import signal

        self.signum = signum if signum is not None else signal.SIGUSR1
        self.received = False

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        import signal

        signal.signal(self.signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received = True

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Ranks may get the signal a step apart: agree (any rank) before a collective save.
        if not trainer.strategy.reduce_boolean_decision(self.received, all=False):
            return
        import logging
        import subprocess

        log = logging.getLogger("gptlab")
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            job = slurm_job_id()
            log.info("SLURM signal: saved %s at step %d; requeueing job %s", path, trainer.global_step, job)
            result = subprocess.call(["scontrol", "requeue", str(job)])
            if result != 0:
                log.warning("scontrol requeue %s failed with exit code %d", job, result)
        # Stop here, as SLURM is about to: no end-of-run validation or checkpoint that the requeued job would
        # find beside its own.
        raise SystemExit(0)
