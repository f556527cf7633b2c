"""Running one model on many devices, applied from outside the model.

- `hardware`: precision by device, processes per node, the CPU-core check, and SLURM (the job to requeue
  after its warning signal).
- `strategies`: the `strategy=` choices (typed options, what each device holds, checkpoint layout, hardware
  checks) and building Lightning's strategy from one.
- `checkpoint_io`: checkpoints that a kill leaves whole, and the Lightning strategy subclasses the choices
  build (atomic sharded checkpoints, DeepSpeed's gradient norm).
- `ranks`: a rank that is lost: rank 0 watches the ranks it started and each watches rank 0, so a process
  that dies stops the run with its name; the process group's timeout bounds the wait for one that hangs.
- `transforms`: activation checkpointing, `torch.compile` and FSDP2 sharding of each block, in each rank;
  `uncompiled_blocks` for the evaluations outside the training step.
- memory per device and the model card, from the same choices, are `gptlab.planning`.
"""

from gptlab.parallel.hardware import (
    choose_precision,
    devices_per_node,
    warn_if_cpu_oversubscribed,
    world_size,
)
from gptlab.parallel.strategies import (
    STRATEGIES,
    Placement,
    StrategyChoice,
    build_strategy,
    check_launch,
    check_rank_zero_evaluation,
    strategy_choice,
    strategy_choices,
)
from gptlab.parallel.transforms import ParallelOptions, parallelize, uncompiled_blocks

__all__ = [
    "STRATEGIES",
    "ParallelOptions",
    "Placement",
    "StrategyChoice",
    "build_strategy",
    "check_launch",
    "check_rank_zero_evaluation",
    "choose_precision",
    "devices_per_node",
    "parallelize",
    "strategy_choice",
    "strategy_choices",
    "uncompiled_blocks",
    "warn_if_cpu_oversubscribed",
    "world_size",
]
