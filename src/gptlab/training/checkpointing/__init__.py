"""Checkpoints that survive kills.

- `guard`: a non-finite loss on any rank stops every rank at the same step; no non-finite state is saved.
- atomic writes (``gptlab.parallel.checkpoint_io``, the strategies' checkpoint I/O): files and sharded
  directories written beside their target, then renamed into place; re-exported here.
- `periodic`: ``checkpoints/last.ckpt`` every N steps and at the end; the best checkpoint, a link to it at its step.
- `signals`: SIGTERM, Ctrl-C (SIGINT) and SLURM's SIGUSR1 handled the same way, at a step boundary on every
  rank.
- `rng`: the RNG states saved with each checkpoint.
- `fit`: the callbacks every run carries, and ``fit`` around them.
"""

from gptlab.errors import NonFiniteLossError
from gptlab.parallel.checkpoint_io import AtomicCheckpointIO, restore_interrupted_saves
from gptlab.training.checkpointing.fit import SignalStop, fault_tolerance_callbacks, fit
from gptlab.training.checkpointing.guard import check_finite_loss, state_is_finite
from gptlab.training.checkpointing.periodic import BestCheckpoint, PeriodicLastCheckpoint
from gptlab.training.checkpointing.rng import collect_rng_states, restore_rng_states
from gptlab.training.checkpointing.signals import StopOnSignal

__all__ = [
    "AtomicCheckpointIO",
    "BestCheckpoint",
    "NonFiniteLossError",
    "PeriodicLastCheckpoint",
    "SignalStop",
    "StopOnSignal",
    "check_finite_loss",
    "collect_rng_states",
    "fault_tolerance_callbacks",
    "fit",
    "restore_interrupted_saves",
    "restore_rng_states",
    "state_is_finite",
]
