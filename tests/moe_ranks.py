"""`python -m torch.distributed.run --nproc_per_node=2 tests/moe_ranks.py <out>`: the runs of tests/test_moe.py's
two-process test, in one launch of two CPU processes (gloo), each through the run path (``gptlab.tasks.gpt.run``):

- ``ddp``: ``strategy=ddp``, ``mlp.balance_scope=global``, 6 steps;
- ``fsdp``: ``strategy=fsdp`` (the default scope), 6 steps, a checkpoint at step 3;
- ``resumed``: the same command resumed from that checkpoint.

A tiny model with 16 experts and 8 tokens a rank (16 token-expert assignments) leaves some expert without a
token on one rank and not the other in its first steps. :class:`RankRecord` (a callback added by the command line) writes what
the test compares into ``<out>/<run>-rank<r>.pt``: each training pass's assignments per expert on this rank,
the first optimizer step's micro-batches, weights, gradients (reduced over the ranks) and the counts the
load-balancing loss took at its end, and the final weights. tests/test_moe.py adds it to runs in its own
process too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from gptlab.model.feedforward import MoE

CONF = Path(__file__).resolve().parents[1] / "conf"

COMMON = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=8",
    "tokenizer=char",
    "mlp=moe",
    "mlp.experts=16",
    "data.batch_size=1",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "optim.lr=3e-2",
    "optim.warmup_steps=1",
    "optim.min_lr_ratio=1.0",
    "logger=csv",
    "callbacks.sample_generation=null",
    "callbacks.model_checkpoint.save_top_k=-1",
    "callbacks.gradient_norm=null",
    "callbacks.spike_detector=null",
]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient whole on every rank: a sharded one (FSDP's DTensor) gathered."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


class RankRecord(L.Callback):
    """What this rank saw, written to ``path`` at the end of the fit."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.record: dict = {"counts": []}

    def on_train_start(self, trainer, pl_module) -> None:
        self.record["initial"] = {n: full(p) for n, p in pl_module.model.named_parameters()}
        experts = pl_module.model_config.mlp.options.experts
        top_k = pl_module.model_config.mlp.options.top_k

        def count(
            module, inputs, logits
        ) -> None:  # this rank's assignments per expert, in each training pass
            if module.training:
                chosen = logits.topk(top_k, dim=-1).indices.flatten()
                self.record["counts"].append(torch.bincount(chosen, minlength=experts))

        for layer in pl_module.model.modules():
            if isinstance(layer, MoE):
                layer.router.register_forward_hook(count)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if "grads" not in self.record:  # the first optimizer step's micro-batches: (inputs, targets) each
            self.record.setdefault("batches", []).append([t.detach().clone() for t in batch[:2]])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Callbacks' hooks run before the module's: its step counts are still those the step's loss took.
        if "global_counts" not in self.record and pl_module._step_counts is not None:
            self.record["global_counts"] = pl_module._step_counts.clone()
        self.record.setdefault(
            "grads", {n: full(p.grad) for n, p in pl_module.model.named_parameters() if p.grad is not None}
        )

    def on_train_end(self, trainer, pl_module) -> None:
        self.record["final"] = {n: full(p) for n, p in pl_module.model.named_parameters()}
        torch.save(self.record, self.path)


def train(out: Path, name: str, *overrides: str) -> None:
    from gptlab.tasks.gpt import run

    rank = int(os.environ["RANK"])
    record = ["+callbacks.rank_record._target_=moe_ranks.RankRecord"]
    record.append(f"+callbacks.rank_record.path={out / f'{name}-rank{rank}.pt'}")
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"paths.root_dir={out}",
                f"paths.output_dir={out / name}",
                *COMMON,
                *record,
                *overrides,
            ],
        )
    run(cfg)


def main(out: Path) -> None:
    train(out, "ddp", "strategy=ddp", "mlp.balance_scope=global")
    train(out, "fsdp", "strategy=fsdp")
    middle = next((out / "fsdp" / "checkpoints").glob("best-step000003-*.ckpt"))
    train(out, "resumed", "strategy=fsdp", f"resume={middle}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
