"""The LightningModule: the training step, validation loss and perplexity, the optimizer and its schedule.

It receives only its own parts (the model's config, the optimizer's config), never the global config.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch import Tensor

from gptlab.data import tokenizers
from gptlab.data.tokenizers import TokenBytes, bits_per_byte
from gptlab.errors import ConfigError
from gptlab.model.config import GPTConfig, hidden_lr_scale
from gptlab.model.gpt import GPT
from gptlab.model.head_loss import HeadLoss, RecordingHeadLoss, precision_dtype
from gptlab.registry import Choice, import_plugins
from gptlab.training.checkpointing import check_finite_loss, collect_rng_states, restore_rng_states
from gptlab.training.optimizers import build_optimizer, lr_factor, parse_optim, schedule_of

log = logging.getLogger(__name__)

__all__ = ["GPTLitModule", "lr_factor", "use_fused_adamw"]


def use_fused_adamw(model: torch.nn.Module, precision_plugin: Any = None) -> bool:
    """Whether to take AdamW's fused kernel: on CPU, for plain (unsharded) fp32 parameters and no
    mixed-precision plugin. There it is about 5x faster than the per-tensor loop (0.13 against 0.71 s per
    step for the default model's 6.8M parameters on 2 shared cores) and equal to it within 1e-7. On GPUs
    Lightning refuses gradient clipping with a fused optimizer under mixed precision, so the default stays."""
    from lightning.pytorch.plugins import MixedPrecision

    if isinstance(precision_plugin, MixedPrecision):
        return False
    return all(
        type(p.data) is torch.Tensor and p.device.type == "cpu" and p.dtype == torch.float32
        for p in model.parameters()
    )


class GPTLitModule(L.LightningModule):
    """Trains a :class:`~gptlab.model.gpt.GPT` of config ``model`` (a GPTConfig, or its ``to_dict`` as a
    checkpoint holds it) with the optimizer and schedule ``optim`` (the Choice that config.py's parse made, or
    the plain node a checkpoint holds); ``loss``: how the output layer and loss are computed; ``parallel``:
    what is applied to every block in each rank; ``tokenizer``: saved with each checkpoint; ``plugins``: the
    user's modules that define its variants, saved so that a checkpoint is read with them imported."""

    def __init__(
        self,
        model: GPTConfig | dict[str, Any],
        optim: Choice | dict[str, Any] | None = None,
        loss: HeadLoss | dict[str, Any] | None = None,
        parallel: Any = None,
        tokenizer: tokenizers.Tokenizer | None = None,
        plugins: Sequence[str] = (),
    ) -> None:
        super().__init__()
        import_plugins(plugins)
        self.model_config = model if isinstance(model, GPTConfig) else GPTConfig.from_dict(dict(model))
        # checked once, when the run's config was parsed; a plain node (a checkpoint's) is parsed here
        self.optim = optim if isinstance(optim, Choice) else parse_optim(optim)
        # How the output layer and loss are computed (model/head_loss.py); the same loss whichever is used.
        self.head_loss = loss if isinstance(loss, HeadLoss) else HeadLoss.from_node(loss)
        # Plain values only, so a checkpoint rebuilds the module without this project's config system.
        self.save_hyperparameters(
            {
                "model": self.model_config.to_dict(),
                "optim": self.optim.node(),
                "loss": self.head_loss.options(),
                "plugins": list(plugins),
            },
            logger=False,
        )
        self.model = GPT(self.model_config)
        # final-logit softcapping is part of the model wherever it produces logits (generation, evaluation)
        self.model.final_softcap = self.head_loss.final_softcap
        self.tokenizer = tokenizer  # saved in checkpoints
        self.parallel: Any = parallel  # gptlab.parallel.ParallelOptions (None: its defaults)
        self._val_loss_sum = torch.zeros(())
        self._val_count = torch.zeros(())
        self._val_bytes = torch.zeros(())
        self._val_windows = torch.zeros(())
        self.val_tokens: int | None = None  # the targets the last validation scored, all ranks together
        self.val_windows: int | None = None  # the windows it scored a target of, all ranks together
        self._token_bytes: TokenBytes | None = None  # the tokenizer's per-id byte counts, on this device
        self._batch_shape: tuple[int, ...] | None = None  # (B, T) of the last batch, for flops_per_batch
        self.last_train_loss: Tensor | None = None
        self.loss_impl: str | None = None  # the output layer and loss the fit takes (on_fit_start)
        # what the run's model card said the fit takes (tasks.gpt.model_summary): the fit's own line is then
        # logged only where it takes another (None: no card was printed, as from a bare Trainer)
        self.announced_loss_impl: str | None = None
        # (cross-entropy, weighted z-loss or None) of each micro-batch of the optimizer step under way
        self._step_terms: list[tuple[Tensor, Tensor | None]] = []
        self._step_losses: list[Tensor] = []  # the loss (with any z-loss) of each of them
        # the MoE layers' routing (mlp=moe) of each of them: detached losses and load, logged per step
        self._step_routing: list[dict[str, Tensor]] = []
        # (layers, experts) token-expert assignments of the step's micro-batches so far: this rank's, or every
        # rank's under mlp.balance_scope=global (where the load-balancing loss counts its shares over them)
        self._step_counts: Tensor | None = None
        # under multi-token prediction, per micro-batch: the extra heads' cross-entropies, their weighted z-loss
        # terms (None without loss.z_loss), the objective
        self._step_mtp: list[tuple[list[Tensor], list[Tensor | None], Tensor]] = []

    def forward(self, idx: Tensor, targets: Tensor | None = None):
        return self.model(idx, targets)

    # ---- FLOPs (Lightning's ThroughputMonitor reads flops_per_batch) -------------------------------
    def flops_per_token(self, context: int | None = None) -> float:
        """Training FLOPs per token at ``context`` (default: the last batch's, else the model's block size),
        by the model's count in model/counting.py (6N + 12 L T d)."""
        from gptlab.model.counting import flops_per_token

        context = context or (self._batch_shape[1] if self._batch_shape else None)
        return flops_per_token(self.model_config, context)["training"]

    @property
    def flops_per_batch(self) -> int:
        """FLOPs of the last batch on this device: training (forward + backward), or a third of that (the
        forward alone) in evaluation."""
        if self._batch_shape is None:
            return 0
        B, T = self._batch_shape
        if self.training:
            return int(self.flops_per_token(T) * B * T)
        from gptlab.model.counting import flops_per_token

        # evaluation runs the next-token model alone: not multi-token prediction's extra heads
        counts = flops_per_token(self.model_config, T)
        return int((counts["training"] - counts["mtp"]) * B * T / 3)

    def on_fit_start(self) -> None:
        # train.py refuses a CUDA kernel that cannot run at config time (preflight.check_loss); from Python,
        # it fails here, before the first step
        impl = self.head_loss.resolve(self.device, dtype=precision_dtype(str(self.trainer.precision)))
        self.loss_impl = impl  # what loss.impl=auto took, for result.json
        if self.trainer.is_global_zero and impl != self.announced_loss_impl:
            log.info("Output layer and loss: %s (loss.impl=%s)", impl, self.head_loss.impl)

    def configure_model(self) -> None:
        # Sharding, activation checkpointing and compilation are applied from outside the model, per block.
        from gptlab.parallel import ParallelOptions, parallelize

        parallel = self.parallel or ParallelOptions()
        if parallel.device_type is None:  # train.py resolves it with the config; from Python, for this device
            parallel = parallel.resolved(self.trainer.strategy.root_device.type)
        parallelize(self.model, parallel, self.trainer.strategy, self.trainer.precision)

    # ---- training -------------------------------------------------------------------------------
    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        x, y, *doc_ids = batch  # doc_ids: [(B, T) document ids] under data.document_mask=true, else []
        self._batch_shape = tuple(x.shape)
        head = RecordingHeadLoss.of(self.head_loss)
        _, loss = self.model(x, y, head_loss=head, doc_ids=doc_ids[0] if doc_ids else None, mtp=True)
        check_finite_loss(loss, step=self.global_step + 1, strategy=self.trainer.strategy)
        loss = self._add_routing_losses(loss)
        # train/loss is the cross-entropy alone, comparable across runs; the z-loss is logged apart. Both are
        # logged once per optimizer step, over all of its micro-batches (on_before_optimizer_step). Under
        # multi-token prediction the next-token call comes first, then one per extra head (model/mtp.py).
        terms, *extra = head.calls
        if self.model.mtp is not None:
            z = self.head_loss.z_loss
            self._step_mtp.append(
                (
                    [t.cross_entropy.detach() for t in extra],
                    [None if t.lse_square is None else (z * t.lse_square).detach() for t in extra],
                    loss.detach(),
                )
            )
        self._step_terms.append(
            (
                terms.cross_entropy.detach(),
                None if terms.lse_square is None else (self.head_loss.z_loss * terms.lse_square).detach(),
            )
        )
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list)  # configure_optimizers returns one optimizer
        # lr: optim.lr as scheduled (the rate of every group but muP's and Muon's hidden matrices);
        # lr/muon: Muon's rate, under optim=muon.
        groups = optimizer.param_groups
        base = next((g for g in groups if g.get("group") not in ("hidden", "hidden_muon")), groups[0])
        self.log("lr", base["lr"], on_step=True, on_epoch=False)
        for group in groups:
            if group.get("group") == "hidden_muon":
                self.log("lr/muon", group["lr"], on_step=True, on_epoch=False)
        # read by the spike detector before the optimizer step: the loss of the step so far, the mean over its
        # micro-batches (the whole step's at the last one: callbacks' on_before_optimizer_step run before this
        # module's, which starts the next step's lists). Under multi-token prediction, the next-token loss: the
        # detector reports it as train/loss, and the objective adds the extra heads' losses to it.
        self._step_losses.append(terms.loss.detach() if self.model.mtp is not None else loss.detach())
        self.last_train_loss = torch.stack(self._step_losses).mean()
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The step's loss is the mean over its micro-batches, the quantity whose gradient the step takes
        # (Lightning divides each micro-batch's loss by trainer.accumulate_grad_batches), and over the ranks,
        # which train on equal batches. Logged from the last micro-batch's training_step, it would be that
        # micro-batch's alone, and rank 0's alone.
        terms, self._step_terms, self._step_losses = self._step_terms, [], []
        mtp, self._step_mtp = self._step_mtp, []
        if not terms:
            return
        distributed = self.trainer.world_size > 1
        if mtp:
            self._log_mtp(mtp, distributed)
        cross_entropy = torch.stack([ce for ce, _ in terms]).mean()
        self.log(
            "train/loss", cross_entropy, prog_bar=True, on_step=True, on_epoch=False, sync_dist=distributed
        )
        z_terms = [z for _, z in terms if z is not None]
        if z_terms:
            z_loss = torch.stack(z_terms).mean()
            self.log("train/z_loss", z_loss, on_step=True, on_epoch=False, sync_dist=distributed)
        routing, self._step_routing = self._step_routing, []
        for key in routing[0] if routing else ():
            values = torch.stack([r[key] for r in routing])
            value = values.max() if key == "train/moe_load_max" else values.mean()
            reduce = "max" if key == "train/moe_load_max" else "mean"
            self.log(key, value, on_step=True, on_epoch=False, sync_dist=distributed, reduce_fx=reduce)
        counts, self._step_counts = self._step_counts, None
        if counts is not None:
            self._log_global_load(counts, distributed)

    def _add_routing_losses(self, loss: Tensor) -> Tensor:
        """``loss`` plus the MoE layers' auxiliary losses (mlp=moe: load balance and router z-loss, each
        times its coefficient), which the step optimizes; train/loss and val/loss stay the cross-entropy.
        Each weighted term and the experts' load are logged apart (on_before_optimizer_step)."""
        options = self.model_config.mlp.options
        global_scope = getattr(options, "balance_scope", None) == "global"
        routing = self.model.routing_losses(balance_counts=self._global_counts if global_scope else None)
        if routing is None:
            return loss
        if not global_scope:
            counts = routing.counts
            self._step_counts = counts if self._step_counts is None else self._step_counts + counts
        self._step_routing.append(
            {
                "train/moe_balance_loss": (options.balance_coef * routing.balance).detach(),
                "train/moe_z_loss": (options.z_loss_coef * routing.z).detach(),
                "train/moe_load_max": routing.load_max.detach(),
                "train/moe_load_cv": routing.load_cv.detach(),
            }
        )
        return loss + routing.objective

    def _global_counts(self, counts: Tensor) -> Tensor:
        """Under ``mlp.balance_scope=global`` (Qiu et al. 2025, "Demons in the Details: On Implementing Load
        Balancing Loss for Training Specialized Mixture-of-Expert Models"), the (layers, experts) assignment
        counts the load-balancing loss takes each expert's share f_i over: this micro-batch's summed over the
        data-parallel ranks (one all-reduce of layers x experts integers, no gradient), plus those of the
        optimizer step's earlier micro-batches (the paper's buffer: under gradient accumulation the later
        micro-batches are not run yet, so each counts over the step's batch so far). Every rank then takes the
        same f_i, and the ranks' mean loss, the one whose gradient the strategy averages, is the loss of the
        whole batch in one process. One process, one micro-batch a step: this micro-batch's own counts."""
        counts = counts.clone()
        if self.trainer.world_size > 1:  # every rank is a data-parallel one under each strategy here
            torch.distributed.all_reduce(counts)
        self._step_counts = counts if self._step_counts is None else self._step_counts + counts
        return self._step_counts

    def _log_global_load(self, counts: Tensor, distributed: bool) -> None:
        """train/moe_global_load_max and train/moe_global_load_cv: the experts' load over the optimizer step's
        whole batch (every micro-batch of every rank), as train/moe_load_max and train/moe_load_cv give it per
        micro-batch and rank: the balance that mlp.balance_scope=global asks for. ``counts``: the step's
        (layers, experts) assignments, this rank's alone unless the global scope summed them already."""
        if distributed and self.model_config.mlp.options.balance_scope != "global":
            counts = counts.clone()
            torch.distributed.all_reduce(counts)
        load = counts.float()
        share = load / load.sum(dim=-1, keepdim=True).clamp_min(1)
        cv = load.std(dim=-1, unbiased=False) / load.mean(dim=-1).clamp_min(1e-9)
        # the same numbers on every rank: no further reduction
        self.log("train/moe_global_load_max", share.max(), on_step=True, on_epoch=False)
        self.log("train/moe_global_load_cv", cv.mean(), on_step=True, on_epoch=False)

    def _log_mtp(
        self, micro_batches: list[tuple[list[Tensor], list[Tensor | None], Tensor]], distributed: bool
    ) -> None:
        """train/objective (what the step differentiates: the next-token loss and its z-loss plus mtp.weight
        times the extra heads' losses and z-losses), train/mtp_loss_<k>, the cross-entropy of the head
        predicting the token k after the next one, and with loss.z_loss set train/mtp_z_loss_<k>, that head's
        weighted z-loss term, each the mean over the step's micro-batches: the objective is train/loss +
        train/z_loss + mtp.weight * sum_k (train/mtp_loss_<k> + train/mtp_z_loss_<k>). A head whose targets
        were all ignored in a micro-batch (model/mtp.py) is averaged over the others; in none of them, it is
        NaN."""
        objective = torch.stack([o for _, _, o in micro_batches]).mean()
        self.log("train/objective", objective, on_step=True, on_epoch=False, sync_dist=distributed)

        def log_mean(key: str, values: list[Tensor]) -> None:
            # every key on every rank (a distributed log is a collective); NaN where no target was scored
            value = torch.stack(values).mean() if values else torch.full((), float("nan"), device=self.device)
            self.log(key, value, on_step=True, on_epoch=False, sync_dist=distributed)

        for k in range(1, self.model_config.mtp.depth + 1):
            log_mean(f"train/mtp_loss_{k}", [ce[k - 1] for ce, _, _ in micro_batches if len(ce) >= k])
            if self.head_loss.z_loss:
                terms = [z[k - 1] for _, z, _ in micro_batches if len(z) >= k]
                log_mean(f"train/mtp_z_loss_{k}", [t for t in terms if t is not None])

    # ---- validation -----------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self._val_count = torch.zeros((), device=self.device, dtype=torch.float64)
        self._val_bytes = torch.zeros((), device=self.device, dtype=torch.float64)
        self._val_windows = torch.zeros((), device=self.device, dtype=torch.float64)
        if self.tokenizer is not None and (
            self._token_bytes is None or self._token_bytes.lengths.device != self.device
        ):
            self._token_bytes = TokenBytes.of(self.tokenizer, self.device)

    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        x, y, *doc_ids = batch
        self._batch_shape = tuple(x.shape)
        windows = self._validation_windows(batch_idx, x.size(0))
        if windows < x.size(0):  # the rest are copies a distributed sampler added: run (FSDP), not scored
            y = y.clone()
            y[windows:] = self.head_loss.ignore_index
        head = RecordingHeadLoss.of(self.head_loss)
        self.model(x, y, head_loss=head, doc_ids=doc_ids[0] if doc_ids else None)
        loss = head.calls[0].cross_entropy  # nats per scored token, without the z-loss
        n = (y != self.head_loss.ignore_index).sum()  # a tensor: no wait for the device at each batch
        # a batch of copies alone has a NaN mean over no token: it adds nothing
        self._val_loss_sum += torch.where(n > 0, loss.double() * n, 0.0)
        self._val_count += n
        # counted where they are scored, not inferred from the targets (val/tokens // block_size), so that the
        # closing line's count of windows holds also where targets inside a window are ignored
        self._val_windows += (y != self.head_loss.ignore_index).any(dim=-1).sum()
        if self._token_bytes is not None:
            self._val_bytes += self._token_bytes.count(x, y, self.head_loss.ignore_index).double()
        return loss

    def _validation_windows(self, batch_idx: int, rows: int) -> int:
        """How many of the first rows of validation batch ``batch_idx`` are this rank's own windows. Under a
        distributed strategy Lightning's ``DistributedSampler`` gives every rank the same number of windows,
        padding the last ranks with copies of the first windows (torch's layout: rank r takes positions r,
        r + W, ... of the windows followed by the copies); counted, a window would be scored twice."""
        from torch.utils.data import DataLoader, DistributedSampler

        loader = self.trainer.val_dataloaders if self._trainer is not None else None
        if not isinstance(loader, DataLoader) or not loader.batch_size:
            return rows
        sampler = loader.sampler
        if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
            return rows
        own = len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas))  # type: ignore[arg-type]  # map-style
        return max(0, min(rows, own - batch_idx * loader.batch_size))

    def on_validation_epoch_end(self) -> None:
        # Mean over every validation token on every rank, so the figure does not depend on the batching.
        total = self.trainer.strategy.reduce(self._val_loss_sum, reduce_op="sum")
        count = self.trainer.strategy.reduce(self._val_count, reduce_op="sum")
        val_loss = (total / count.clamp_min(1)).float()
        self.val_tokens = int(count)  # scored targets, every rank's, each window once
        self.val_windows = int(self.trainer.strategy.reduce(self._val_windows, reduce_op="sum"))
        # The same number on every rank already: Lightning's sync (max, exact, where a mean may round) agrees.
        self.log("val/loss", val_loss, prog_bar=True, sync_dist=True, reduce_fx="max")
        self.log("val/ppl", torch.exp(val_loss), sync_dist=True, reduce_fx="max")
        if self._token_bytes is not None:
            # bits per byte from the summed nats and bytes of every scored token: comparable across tokenizers
            n_bytes = self.trainer.strategy.reduce(self._val_bytes, reduce_op="sum")
            bpb = bits_per_byte(float(total), float(n_bytes))
            bpb_tensor = torch.tensor(bpb, dtype=torch.float32, device=self.device)
            self.log("val/bpb", bpb_tensor, sync_dist=True, reduce_fx="max")

    # ---- optimizer ------------------------------------------------------------------------------
    def configure_optimizers(self):
        # optim=adamw: AdamW everywhere; optim=muon: Muon on the blocks' hidden matrices, AdamW on the rest
        # (training/optimizers.py). Weight decay on matrices, none on biases and norm gains; under model.param=mup
        # the hidden matrices' AdamW rate is scaled by base width / width.
        o = self.optim
        fused = use_fused_adamw(self.model, self.trainer.precision_plugin)
        optimizer = build_optimizer(self.model, o, hidden_lr_scale(self.model_config), fused=fused)
        max_steps = self.trainer.max_steps
        if max_steps is None or max_steps <= 0:
            raise ConfigError(
                f"trainer.max_steps={max_steps}: training is counted in optimizer steps; set trainer.max_steps "
                "to a positive number (the learning-rate schedule ends there)."
            )
        # this command's options per group, before the scheduler sets a step's rate: a resumed run applies
        # them again over those its checkpoint restores (on_train_start)
        self._configured_groups = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_of(o, max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_start(self) -> None:
        if self.trainer.ckpt_path:
            self.fit_optimizer_vocab_rows()
            self.apply_configured_optimizer()

    def fit_optimizer_vocab_rows(self) -> None:
        """After a resume: the optimizer's state of the token table (and an untied head) given the rows the
        model stores them with. A checkpoint saved before the padding (``model.vocab_multiple``) holds
        moments of ``vocab_size`` rows; the weights were padded as they loaded (``GPT``), and the padding
        rows' moments are zero, as they would have been had they been there all along (no gradient)."""
        from gptlab.model.gpt import fit_vocab_rows

        vocab_rows = set(self.model.vocab_rows)
        for optimizer in self.trainer.optimizers:
            for name, p in self.model.named_parameters():
                if name not in vocab_rows or p not in optimizer.state:
                    continue
                state = optimizer.state[p]
                for key, value in list(state.items()):
                    if (
                        isinstance(value, Tensor)
                        and value.dim() == p.dim()
                        and value.shape[1:] == p.shape[1:]
                        and value.size(0) != p.size(0)
                    ):
                        state[key] = fit_vocab_rows(
                            value, self.model.config, f"optimizer state {key} of {name}"
                        )

    def apply_configured_optimizer(self) -> None:
        """After a resume: the optimizer's options and peak rates as this command configured them, in place of
        those its checkpoint restored with the optimizer's state (Lightning restores the param groups whole, and
        the scheduler's base rates), and this step's rate from them. Unchanged options write the same values.
        What changed is told and recorded before training (gptlab.training.resume_changes)."""
        configured = getattr(self, "_configured_groups", None)
        if not configured:
            return
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list)  # configure_optimizers returns one optimizer
        groups = optimizer.param_groups
        config = self.trainer.lr_scheduler_configs[0] if self.trainer.lr_scheduler_configs else None
        scheduler = config.scheduler if config is not None else None
        if len(groups) != len(configured):  # the model's groups are fixed by its architecture, checked before
            raise RuntimeError(f"{len(groups)} optimizer groups restored, {len(configured)} configured")
        for i, (group, options) in enumerate(zip(groups, configured)):
            group.update(options)
            group["initial_lr"] = options["lr"]
            if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                scheduler.base_lrs[i] = options["lr"]
                group["lr"] = options["lr"] * scheduler.lr_lambdas[i](scheduler.last_epoch)
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            scheduler._last_lr = [g["lr"] for g in groups]  # what get_last_lr() reports

    # ---- checkpoints ----------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.tokenizer is not None:
            checkpoint["tokenizer"] = self.tokenizer.spec()
        checkpoint["rng_states"] = collect_rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "tokenizer" in checkpoint:
            self.tokenizer = tokenizers.from_spec(checkpoint["tokenizer"])
            self._token_bytes = None  # rebuilt for this tokenizer at the next validation
        if "rng_states" in checkpoint:
            restore_rng_states(checkpoint["rng_states"])
