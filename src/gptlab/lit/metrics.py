"""Training diagnostics: the gradient norm before clipping, and model FLOPs utilisation (MFU).

MFU is the share of the hardware's peak that the model's own arithmetic uses (PaLM, Chowdhery et al. 2022,
appendix B): tokens per second x FLOPs per token / peak FLOPs per second. The peak is a GPU's datasheet
dense figure for the precision in use, or on CPU a measured fp32 matrix-multiply rate.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import lightning as L
import torch

log = logging.getLogger(__name__)

# Datasheet dense (no sparsity) peak TFLOP/s per GPU: (bf16/fp16 tensor cores, tf32 tensor cores, fp32).
# Matched by substring of torch.cuda.get_device_name(), most specific first.
GPU_PEAK_TFLOPS: list[tuple[str, tuple[float, float, float]]] = [
    ("H200", (989.4, 494.7, 67.0)),
    ("H100 NVL", (835.5, 417.5, 60.0)),
    ("H100 PCIe", (756.0, 378.0, 51.0)),
    ("H100", (989.4, 494.7, 67.0)),  # SXM5
    ("A100", (312.0, 156.0, 19.5)),
    ("L40S", (362.0, 183.0, 91.6)),
    ("L4", (121.0, 60.0, 30.3)),
    ("A10", (125.0, 62.5, 31.2)),
    ("V100", (125.0, 15.7, 15.7)),  # fp16 tensor cores; no bf16 or tf32
    ("T4", (65.0, 8.1, 8.1)),  # fp16 tensor cores; no bf16 or tf32
]

_measured_peak: dict[tuple[str, str], float] = {}


def tf32_enabled() -> bool:
    """Whether fp32 matrix products may run on TF32 tensor cores."""
    return torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)


def gpu_peak_flops(device_name: str, precision: str, tf32: bool | None = None) -> float | None:
    """The datasheet peak of a known GPU for a Lightning precision string, in FLOP/s; None when unknown.
    ``tf32``: whether fp32 products use TF32 (None: as torch is set now)."""
    half = any(p in str(precision) for p in ("bf16", "16-mixed", "16-true"))
    tf32 = tf32_enabled() if tf32 is None else tf32
    for key, (half_tflops, tf32_tflops, fp32_tflops) in GPU_PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return 1e12 * (half_tflops if half else tf32_tflops if tf32 else fp32_tflops)
    return None


def measure_matmul_peak(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """The best of a few square matrix products on ``device``, in FLOP/s; measured once per process and
    device, then cached (about 0.2 s on two CPU cores)."""
    device = torch.device(device)
    key = (str(device), str(dtype))
    if key in _measured_peak:
        return _measured_peak[key]
    n = 1024 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    _measured_peak[key] = 2.0 * n**3 / best
    return _measured_peak[key]


def device_peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, precision)
        if peak is not None:
            return peak, f"datasheet {name}"
        dtype = torch.bfloat16 if "bf16" in str(precision) else torch.float32
        return measure_matmul_peak(device, dtype), f"measured {name} ({dtype})"
    return measure_matmul_peak(
        "cpu", torch.float32
    ), f"measured CPU fp32 matmul, {torch.get_num_threads()} threads"


class GradientNorm(L.Callback):
    """Logs ``train/grad_norm``: the global L2 norm of all gradients before clipping (Lightning calls
    ``on_before_optimizer_step`` after unscaling mixed-precision gradients and before clipping).

    Under DeepSpeed ZeRO-2/3 the gradients live in the engine's partitioned buffers and ``p.grad`` is empty:
    the norm is then the one the strategy reports after the step (``gradient_norm_after_step``)."""

    def __init__(self) -> None:
        self._from_strategy = False

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if not grads:
            self._from_strategy = hasattr(trainer.strategy, "gradient_norm_after_step")
            return
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if hasattr(norm, "full_tensor"):  # sharded (FSDP2) gradients give a DTensor: reduce it across ranks
            norm = norm.full_tensor()
        pl_module.log("train/grad_norm", norm, on_step=True, on_epoch=False)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._from_strategy:
            return
        self._from_strategy = False
        norm = trainer.strategy.gradient_norm_after_step()
        if norm is not None:
            pl_module.log("train/grad_norm", float(norm), on_step=True, on_epoch=False)


class ModelFlopsUtilization(L.Callback):
    """Logs ``train/mfu`` (a fraction of the peak of all devices together) and ``train/flops_per_second``
    over the last ``window`` steps, and at the start the model's ``parameters/total`` and
    ``model/flops_per_token`` to every logger (so CSV runs carry the size too).

    ``peak_flops``: the peak of one device in FLOP/s; null looks it up (GPU datasheet) or measures it (CPU).
    """

    def __init__(self, window: int = 20, peak_flops: float | None = None) -> None:
        self.window = window
        self.peak_flops = peak_flops
        self.flops_per_token = 0.0
        self._times: deque[float] = deque(maxlen=window + 1)
        self._tokens: deque[int] = deque(maxlen=window + 1)
        self._seen = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from gptlab.model.counting import flops_per_token

        # 6N + 12 L T d at the context the run trains on (PaLM appendix B), from gptlab.model.counting.
        context = getattr(trainer.datamodule, "block_size", None) if trainer.datamodule is not None else None
        self.flops_per_token = flops_per_token(pl_module.model.config, context)["training"]
        source = "configured"
        if self.peak_flops is None:
            self.peak_flops, source = device_peak_flops(pl_module.device, str(trainer.precision))
        if trainer.is_global_zero:
            peak = self.peak_flops
            rate = f"{peak / 1e12:.1f} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:.1f} GFLOP/s"
            log.info(
                "MFU against %s per device (%s); %.3g FLOPs per token", rate, source, self.flops_per_token
            )
        facts = {
            "parameters/total": float(pl_module.model.parameter_counts()["total"]),
            "model/flops_per_token": self.flops_per_token,
            "model/peak_flops_per_device": float(self.peak_flops),
        }
        for logger in trainer.loggers:
            logger.log_metrics(facts, step=trainer.global_step)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._seen += batch[0].numel() * trainer.world_size
        self._times.append(time.perf_counter())
        self._tokens.append(self._seen)
        if len(self._times) < 2 or not self.peak_flops:
            return
        rate = (self._tokens[-1] - self._tokens[0]) / max(self._times[-1] - self._times[0], 1e-9)
        achieved = rate * self.flops_per_token
        pl_module.log("train/flops_per_second", achieved, on_step=True, on_epoch=False)
        pl_module.log(
            "train/mfu", achieved / (self.peak_flops * trainer.world_size), on_step=True, on_epoch=False
        )

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._times.clear()
        self._tokens.clear()
