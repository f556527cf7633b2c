"""Training diagnostics: throughput and model FLOPs utilisation (MFU), and the gradient norm before clipping.

Throughput and MFU are Lightning's (``ThroughputMonitor``): MFU is the share of the
hardware's peak that the model's own arithmetic uses (PaLM, Chowdhery et al. 2022, appendix B), tokens per
second x FLOPs per token / peak FLOP/s. What Lightning lacks is added here: a peak that a busy machine
cannot lower (gptlab.training.peak: dense datasheet figures for GPUs, the best calibrated matmul rate in the run's
compute dtype for CPUs), an MFU above 100% never logged as one (it shows that the peak is wrong, not the run fast), the
project's metric names (``train/tokens_per_second``, ``train/mfu``) and a token count that survives resume.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, cast

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from gptlab.model.counting import human
from gptlab.training.peak import device_peak_flops

if TYPE_CHECKING:
    from gptlab.training.module import GPTLitModule

log = logging.getLogger(__name__)


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"


def _batch_rows(batch: Any) -> int:
    return int(batch[0].size(0))


def _batch_tokens(batch: Any) -> int:
    return int(batch[0].numel())


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
        # Only on steps whose metrics reach the loggers: the norm is a full pass over the gradients (about 2%
        # of a CPU step of the default model) beside the one Lightning's clipping makes.
        if not trainer._logger_connector.should_update_logs:
            return
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
        norm = getattr(trainer.strategy, "gradient_norm_after_step")()  # noqa: B009 - checked with hasattr above
        if norm is not None:
            pl_module.log("train/grad_norm", float(norm), on_step=True, on_epoch=False)


class TrainingThroughput(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` counting tokens as its items, with its metrics (``train/device/
    items_per_sec``, ``train/device/mfu``, ...) and under this project's names ``train/tokens_per_second``
    (all ranks together), ``train/mfu`` and ``train/tokens`` (trained on so far, kept across a resume);
    once at the start ``parameters/total``, ``parameters/active``, ``model/flops_per_token`` and ``model/peak_flops_per_device``.

    The training rate (``train/tokens_per_second``, the progress bar's ``tok/s``) is tokens trained per
    second of training time: the wall time of the fit less validation. Validation is timed from its start to
    the next training step, so its sample generation and the best-checkpoint save are left out with it;
    everything else between two steps counts (loading data, logging, the periodic last checkpoint). Each
    logged rate covers the steps since the previous logged one (``window`` steps), so the rates tile the
    training time without a gap: ``train/time`` (training seconds so far) and ``train/lengths`` (tokens so
    far on this device) give the rate over any stretch. ``training_seconds`` and ``run_tokens`` are this
    process's totals, for the rate over the whole run.

    ``window``: steps per rate; null: ``trainer.log_every_n_steps``. ``peak_flops``: FLOP/s of one device;
    null: the GPU's dense datasheet figure for the compute dtype, or on a CPU the best matrix-multiply rate
    calibrated on this machine (gptlab.training.peak). A window whose MFU exceeds 1 logs it as
    ``train/mfu_above_peak``, not as ``train/mfu`` or ``train/device/mfu``. The FLOPs of a batch come from the module's ``flops_per_batch``
    (model/counting.py). Validation throughput itself is not logged.
    """

    def __init__(self, window: int | None = None, peak_flops: float | None = None) -> None:
        super().__init__(batch_size_fn=_batch_rows, length_fn=_batch_tokens)
        self.window = window
        self.peak_flops = peak_flops
        self.tokens_seen = 0
        self.tokens_per_second: float | None = None  # the last logged rate, for the progress bar
        self.run_tokens = 0  # tokens trained by this process (all ranks)
        self._validation_t0: float | None = None
        self._warned_above_peak = False
        # (training seconds, tokens) at the end of this process's first optimizer step: its warm-up (first
        # kernels, allocations, a compile) is in the whole run's rate, and the closing line says how much
        self.first_step: tuple[float, int] | None = None

    @property
    def training_seconds(self) -> float:
        """Training time of this process so far (validation excluded), as rank 0 measures it."""
        times = (
            self._throughputs[RunningStage.TRAINING]._time
            if RunningStage.TRAINING in self._throughputs
            else []
        )
        return float(times[-1]) if times else 0.0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # ``window`` steps of ``accumulate_grad_batches`` batches each between the first and the last of the
        # window's time points: consecutive rates cover consecutive stretches
        steps = max(1, self.window or trainer.log_every_n_steps)  # type: ignore[attr-defined]  # set by Lightning's logger connector, undeclared
        self.kwargs["window_size"] = steps * trainer.accumulate_grad_batches + 1
        super().setup(trainer, pl_module, stage)
        dtype = _plugin_to_compute_dtype(trainer.precision_plugin)
        if self.peak_flops:
            peak, source = float(self.peak_flops), "configured"
        else:
            peak, source = device_peak_flops(trainer.strategy.root_device, dtype)
        self.available_flops = peak  # type: ignore[assignment]  # Lightning declares int | None; a FLOP rate is a float
        for throughput in self._throughputs.values():
            throughput.available_flops = peak
        self._source = source

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.run_tokens = 0
        self._validation_t0 = None
        if not trainer.is_global_zero:  # Lightning's monitor times rank 0 alone
            return
        # the start of training as the window's first time point: the first rate covers the first steps
        self._throughputs[RunningStage.TRAINING].update(time=0.0, batches=0, samples=0, lengths=0, flops=0)
        peak = self.available_flops
        assert peak is not None  # set in setup
        rate = _rate(peak)
        datamodule = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector, undeclared
        module = cast("GPTLitModule", pl_module)
        flops_per_token = module.flops_per_token(getattr(datamodule, "block_size", None))
        bound = time_at_peak(trainer, datamodule, flops_per_token, peak)
        # the FLOPs per token themselves are the model card's line (Training FLOPs per token at context T)
        log.info(
            "MFU against %s per device (%s)%s",
            rate,
            self._source,
            f"{bound} (a lower bound: a run reaches a fraction of the peak)" if bound else "",
        )
        counts = module.model.parameter_counts()
        facts = {
            "parameters/total": float(counts["total"]),
            "parameters/active": float(counts["active"]),  # a token's (mlp=moe: its top_k experts')
            "model/flops_per_token": flops_per_token,
            "model/peak_flops_per_device": float(peak),
        }
        for logger in trainer.loggers:
            logger.log_metrics(facts, step=trainer.global_step)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._validation_t0 is not None:  # a validation ran since the last step: not training time
            self._t0s[RunningStage.TRAINING] += time.perf_counter() - self._validation_t0
            self._validation_t0 = None

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` just spent between two steps outside the training time (an evaluation that
        another callback ran: eval_harness), as a validation is."""
        if RunningStage.TRAINING in self._t0s:
            self._t0s[RunningStage.TRAINING] += seconds

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, *args):
        tokens = _batch_tokens(batch) * trainer.world_size
        self.tokens_seen += tokens
        self.run_tokens += tokens
        super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)
        if self.first_step is None and not trainer.fit_loop._should_accumulate():
            self.first_step = (self.training_seconds, self.run_tokens)

    def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING:
            self._validation_t0 = time.perf_counter()

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        pass  # validation throughput is not logged (Lightning would log it at the validation batch index)

    def on_validation_end(self, *args: Any) -> None:
        pass  # the training clock is moved past the validation at the next training step

    def _compute(self, trainer: L.Trainer, iter_num: int | None = None) -> None:
        # Lightning's _compute, with the project's names added to the same logged row.
        stage = trainer.state.stage
        if stage != RunningStage.TRAINING or not trainer._logger_connector.should_update_logs:
            return
        throughput = self._throughputs[stage]
        metrics = throughput.compute()
        logged = {f"{stage.value}{throughput.separator}{k}": v for k, v in metrics.items()}
        logged["train/tokens"] = float(self.tokens_seen)
        if "device/items_per_sec" in metrics:
            self.tokens_per_second = metrics["device/items_per_sec"] * trainer.world_size
            logged["train/tokens_per_second"] = self.tokens_per_second
        mfu = metrics.get("device/mfu")
        if mfu is not None and mfu > 1.0:
            # More than the peak is impossible: the peak is too low (a CPU calibrated under load, a GPU whose
            # measured figure fell short). Logged apart, under a name no table reads as MFU.
            for key in [k for k in logged if k.endswith("mfu")]:
                del logged[key]
            logged["train/mfu_above_peak"] = mfu
            if not self._warned_above_peak:
                self._warned_above_peak = True
                log.warning(
                    "MFU %.0f%% is above 100%% against the peak of %s (%s): the peak is too low, so train/mfu "
                    "is not logged while it is; the ratio goes to train/mfu_above_peak instead",
                    100 * mfu,
                    _rate(self.available_flops or 0.0),
                    self._source,
                )
        elif mfu is not None:  # the mean over devices equals any one device's share of its own peak
            logged["train/mfu"] = mfu
        trainer._logger_connector.log_metrics(logged, step=trainer.global_step)  # type: ignore[arg-type]  # typed for tensors; numbers are logged as they are

    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tokens_seen = int(state_dict.get("tokens_seen", 0))


def duration(seconds: float) -> str:
    """``seconds`` for a reader: 0.03 s, 48 s, 12 min, 3 h 05 min, 2.4 days."""
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        hours, minutes = divmod(round(seconds / 60), 60)
        return f"{hours} h {minutes:02d} min"
    return f"{seconds / 86400:.1f} days"


def time_at_peak(trainer: L.Trainer, datamodule: Any, flops_per_token: float, peak: float) -> str:
    """``: the 320 steps to train are 13.53T FLOPs, 32 s at that peak`` (counted as the card counts): the least time the steps left to
    train can take on these devices, so that a model too large for the machine (GPT-2 small on two CPU cores:
    hours) says so before its first step, not after it. "" where the steps or the batch are unknown."""
    max_steps = trainer.max_steps
    batch, block = getattr(datamodule, "batch_size", None), getattr(datamodule, "block_size", None)
    if not (isinstance(batch, int) and isinstance(block, int) and max_steps > 0 and peak > 0):
        return ""
    steps = max_steps - trainer.global_step
    if steps <= 0:
        return ""
    tokens = steps * batch * block * trainer.accumulate_grad_batches * trainer.world_size
    flops = tokens * flops_per_token
    return (
        f": the {steps:,} steps to train are {human(flops)} FLOPs, "
        f"{duration(flops / (peak * trainer.world_size))} at that peak"
    )


def after_first_step(trainer: L.Trainer) -> tuple[float, float] | None:
    """(seconds of this process's first optimizer step, the training rate of the steps after it): the first
    step carries the warm-up (a compile with compile=true: tens of seconds), which the whole run's training
    rate includes. None without a second step, or off rank 0 (whose clock the rates are)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
        if isinstance(callback, TrainingThroughput) and callback.first_step is not None:
            seconds, tokens = callback.first_step
            later = callback.training_seconds - seconds
            if seconds > 0 and later > 0 and callback.run_tokens > tokens:
                return seconds, (callback.run_tokens - tokens) / later
    return None


def run_rates(trainer: L.Trainer, wall_seconds: float) -> dict[str, float]:
    """This process's two rates over the whole run, from its ``TrainingThroughput``:
    ``tokens_per_second_training`` (tokens / training time, validation excluded: the quantity of
    ``train/tokens_per_second``, over the whole run) and ``tokens_per_second_wall`` (tokens / ``wall_seconds``,
    the wall time of the whole run: data, start-up, validation and checkpoints included)."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector, undeclared
        if isinstance(callback, TrainingThroughput) and callback.run_tokens and callback.training_seconds > 0:
            return {
                "tokens_per_second_training": callback.run_tokens / callback.training_seconds,
                "tokens_per_second_wall": callback.run_tokens / wall_seconds,
            }
    return {}
