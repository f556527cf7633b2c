"""Loss and gradient-norm spikes: detected as they happen, counted in the logs, optionally not applied.

A value is a spike when it lies more than ``sigma`` standard deviations above the mean of the last ``window``
non-spike values of the same series (the rule behind the spike-skipping of PaLM, Chowdhery et al. 2022,
https://arxiv.org/abs/2204.02311, section 5.1, which restarted before spikes and skipped their batches, and
of OLMo 2's spike analysis, OLMo et al. 2024, https://arxiv.org/abs/2501.00656). Spikes do not enter the
window, so that one spike does not hide the next.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

import lightning as L
import torch

from gptlab.errors import ConfigError

log = logging.getLogger(__name__)

MONITORS = ("loss", "grad_norm")


class SpikeWindow:
    """The last ``window`` accepted values of one series and the spike test against them."""

    def __init__(self, window: int, sigma: float, min_history: int) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.sigma = sigma
        self.min_history = min_history

    def stats(self) -> tuple[float, float]:
        n = len(self.values)
        mean = sum(self.values) / n
        var = sum((v - mean) ** 2 for v in self.values) / max(1, n - 1)
        return mean, math.sqrt(var)

    def is_spike(self, value: float) -> bool:
        """Whether ``value`` is a spike; a non-spike (and a non-finite value: never a statistic) is added
        to the window."""
        if not math.isfinite(value):
            return True
        spike = False
        if len(self.values) >= self.min_history:
            mean, std = self.stats()
            spike = value > mean + self.sigma * std
        if not spike:
            self.values.append(value)
        return spike


class SpikeDetector(L.Callback):
    """Watches the training loss and/or the global gradient norm (``monitor``) at every optimizer step,
    after the backward pass and before the update (the spike rule of PaLM, Chowdhery et al. 2022, section 5.1:
    see the module's docstring). A spike is logged as a warning and counted:
    ``train/spike`` (spikes since the previous logged row, so none is lost between rows) and
    ``train/spike_count`` (since the start, kept in checkpoints) reach every logger (W&B, CSV, ...).
    With ``skip_step: true`` a spiking step's gradients are dropped before the update: the optimizer then
    changes neither the weights nor its moments (the learning-rate schedule still advances one step);
    ``train/skipped_steps`` counts them.

    Under DDP the loss is averaged over ranks and the gradients are already all-reduced, so every rank takes
    the same decision."""

    def __init__(
        self,
        monitor: list[str] | tuple[str, ...] | str = ("loss", "grad_norm"),
        sigma: float = 6.0,
        window: int = 128,
        min_history: int = 32,
        skip_step: bool = False,
    ) -> None:
        monitors = [monitor] if isinstance(monitor, str) else list(monitor)
        bad = [m for m in monitors if m not in MONITORS]
        if bad or not monitors:
            raise ConfigError(
                f"callbacks.spike_detector.monitor={monitors!r}: choose from {list(MONITORS)} "
                "(e.g. callbacks.spike_detector.monitor=[loss,grad_norm])."
            )
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or sigma <= 0:
            raise ConfigError(f"callbacks.spike_detector.sigma={sigma!r} must be a positive number (e.g. 6).")
        for key, value in (("window", window), ("min_history", min_history)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ConfigError(f"callbacks.spike_detector.{key}={value!r} must be an integer >= 2.")
        if min_history > window:
            raise ConfigError(
                f"callbacks.spike_detector.min_history={min_history} exceeds window={window}: the window "
                "never holds that many values. Lower min_history or raise window."
            )
        self.monitors = monitors
        self.skip_step = bool(skip_step)
        self.windows = {m: SpikeWindow(window, float(sigma), min_history) for m in monitors}
        self.spike_count = 0
        self.skipped_steps = 0
        self._since_logged = 0

    # ---- measuring ------------------------------------------------------------------------------------
    def _loss(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float | None:
        loss = getattr(pl_module, "last_train_loss", None)
        if loss is None:
            return None
        loss = trainer.strategy.reduce(loss.detach().float(), reduce_op="mean")
        return float(loss)

    def _grad_norm(self, pl_module: L.LightningModule) -> float | None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if not grads:
            return None
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor, reduced across ranks
            norm = norm.full_tensor()
        return float(norm)

    def check(self, values: dict[str, float | None], step: int) -> bool:
        """Test each monitored value; True when any spikes (each spike is logged)."""
        spiked = False
        for name, value in values.items():
            if value is None:
                continue
            window = self.windows[name]
            if window.is_spike(value):
                spiked = True
                mean, std = window.stats() if window.values else (float("nan"), float("nan"))
                log.warning(
                    "Spike at step %d: train/%s = %.4g, mean %.4g + %.3g x std %.3g over the last %d steps%s",
                    step,
                    name,
                    value,
                    mean,
                    window.sigma,
                    std,
                    len(window.values),
                    " (update skipped)" if self.skip_step else "",
                )
        if spiked:
            self.spike_count += 1
            self._since_logged += 1
        return spiked

    # ---- Lightning hooks ------------------------------------------------------------------------------
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        values: dict[str, float | None] = {}
        if "loss" in self.monitors:
            values["loss"] = self._loss(trainer, pl_module)
        if "grad_norm" in self.monitors:
            values["grad_norm"] = self._grad_norm(pl_module)
        if self.check(values, trainer.global_step + 1) and self.skip_step:
            for p in pl_module.parameters():
                p.grad = None  # torch's optimizers skip parameters without a gradient
            self.skipped_steps += 1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not trainer._logger_connector.should_update_logs:
            return
        metrics = {"train/spike": float(self._since_logged), "train/spike_count": float(self.spike_count)}
        if self.skip_step:
            metrics["train/skipped_steps"] = float(self.skipped_steps)
        self._since_logged = 0
        # Lightning's own path to every logger, at the step of the row its metrics go to.
        trainer._logger_connector.log_metrics(metrics, step=trainer.global_step)  # type: ignore[arg-type]  # typed for tensors; numbers are logged as they are

    # ---- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "windows": {name: list(w.values) for name, w in self.windows.items()},
            "spike_count": self.spike_count,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, values in state_dict.get("windows", {}).items():
            if name in self.windows:
                self.windows[name].values.extend(values)
        self.spike_count = int(state_dict.get("spike_count", 0))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
