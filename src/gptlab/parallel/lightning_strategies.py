"""Lightning strategies with the two things this project adds: sharded checkpoint directories written
beside their target and renamed into place (a kill mid-save keeps the previous checkpoint whole), and, for
DeepSpeed, the gradient norm that ZeRO keeps out of ``p.grad``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

from gptlab.parallel.checkpoint_io import AtomicCheckpointIO, save_directory_atomically, step_of
from gptlab.runs import digests


class FullyShardedStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy with every rank in the data-parallel dimension (no tensor
    parallelism), carrying the FSDP options that `gptlab.parallel.transforms.parallelize` reads in
    `configure_model`."""

    def __init__(self, reshard_after_forward: bool, hybrid: bool, cpu_offload: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reshard_after_forward = reshard_after_forward
        self.hybrid = hybrid
        self.cpu_offload = cpu_offload
        if self._checkpoint_io is None:
            self._checkpoint_io = (
                AtomicCheckpointIO()
            )  # rank 0's single file (save_distributed_checkpoint=false)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        target = Path(self.broadcast(filepath))
        save_directory_atomically(
            self,
            target,
            lambda staging: super(FullyShardedStrategy, self).save_checkpoint(checkpoint, staging),
            step_of(checkpoint),
        )


class AtomicDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy whose checkpoint directories are written atomically, and which
    reports the global gradient norm the DeepSpeed engine computed in its last step."""

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        target = Path(self.broadcast(filepath))
        save_directory_atomically(
            self,
            target,
            lambda staging: super(AtomicDeepSpeedStrategy, self).save_checkpoint(
                checkpoint, staging, storage_options
            ),
            step_of(checkpoint),
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            digests.remove_digest(Path(filepath))
        super().remove_checkpoint(filepath)

    def gradient_norm_after_step(self) -> float | None:
        """The L2 norm of all gradients of the last optimizer step, before clipping, over every rank's
        partition (ZeRO-2/3 keep gradients in flat partitioned buffers, so ``p.grad`` is None and the
        usual per-parameter norm sees nothing). None when the engine skipped the step (fp16 overflow)."""
        engine = getattr(self, "deepspeed_engine", None)
        if engine is None:
            return None
        norm = engine.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if hasattr(norm, "item") else norm)
