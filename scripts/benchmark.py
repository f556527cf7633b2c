"""Time gptlab's Lightning training step against a plain PyTorch loop, in one process, interleaved.

    python scripts/benchmark.py                                  # the default model and data
    python scripts/benchmark.py model=small pos=rope compile=true --rounds 6 --steps 5
    python scripts/benchmark.py --head --rows 8192               # the output layer + loss alone

Training: one Lightning ``Trainer.fit`` (the run's own callbacks and a CSV logger; no validation or
checkpoints) and a plain loop (forward, backward, gradient clipping, AdamW step with the same schedule) over
a copy of the same model, from the same weights. After every ``--steps`` Lightning steps the plain loop
trains the same number of steps on the same batches, so that both see the same machine load; the first
``--warmup`` rounds are not counted. ``tokens_per_second`` is the training rate as ``train/tokens_per_second``
defines it (tokens per second of training wall time, Lightning's own steps and callbacks included), the median
of the timed rounds; the run's logged ``train/tokens_per_second`` is not used here, since the plain loop runs
inside the same fit. Prints per-round figures, medians, and as its last line one JSON object
(``tokens_per_second``, ``plain_tokens_per_second``, ``ratio_to_plain``, ``mfu``, ``peak_memory_bytes``, ...).

Peak memory is ``torch.cuda.max_memory_allocated`` on a GPU; on a CPU the process's peak resident memory
(VmHWM, reset before each segment). Kernel (sys) time and minor page faults per step come from
``getrusage``: a high share of kernel time means the allocator is returning memory to the system and faulting
it back in every step.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import resource
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch


def compose_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    import gptlab

    with initialize_config_dir(str(gptlab.CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=overrides)


class PeakMemory:
    """Peak memory of a segment: CUDA's allocator peak, or on a CPU the process's peak resident set (VmHWM;
    writing 5 to /proc/self/clear_refs resets it, Linux only)."""

    @staticmethod
    def source(device: torch.device) -> str:
        return "torch.cuda.max_memory_allocated" if device.type == "cuda" else "process peak RSS (VmHWM)"

    def reset(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass

    def peak(self, device: torch.device) -> int:
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device)
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tensor_peak_bytes(fn) -> int:
    """Peak bytes of CPU tensors alive at once while ``fn()`` runs, beyond those alive before, from the
    profiler's memory timeline (every allocation and free of a tensor, including temporaries)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfileTimeline

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as p:
        fn()
    live = peak = 0
    for _, action, (key, _), size in MemoryProfileTimeline(p._memory_profile()).timeline:
        if key.device.type != "cpu":
            continue
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


class HeadBenchmark:
    """The output layer + loss alone, forward and backward, at ``rows`` rows of B*T with the configured
    model's width and vocabulary: time (median of interleaved rounds) and peak memory per implementation."""

    def __init__(self, rows: int, impls: list[str], rounds: int, overrides: list[str]) -> None:
        self.rows, self.impls, self.rounds, self.overrides = rows, impls, rounds, overrides

    def run(self) -> dict:
        import gptlab
        from gptlab.model.head_loss import HeadLoss

        cfg = compose_config(self.overrides)
        config = gptlab.build_model_config(cfg)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        g = torch.Generator(device=device).manual_seed(0)
        C, V = config.n_embd, config.vocab_size
        hidden = torch.randn(self.rows, C, device=device, generator=g).requires_grad_()
        weight = (0.02 * torch.randn(V, C, device=device, generator=g)).requires_grad_()
        targets = torch.randint(0, V, (self.rows,), device=device, generator=g)

        def step(impl: str) -> float:
            loss = HeadLoss(impl, chunk_rows=cfg.loss.get("chunk_rows"))(hidden, weight, targets)
            loss.backward()
            hidden.grad = weight.grad = None
            return float(loss.detach())

        losses = {impl: step(impl) for impl in self.impls}  # also the warm-up
        times: dict[str, list[float]] = {impl: [] for impl in self.impls}
        for _ in range(self.rounds):
            for impl in self.impls:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(impl)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[impl].append(time.perf_counter() - t0)
        peaks = {}
        for impl in self.impls:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step(impl)
                peaks[impl] = torch.cuda.max_memory_allocated() - base
            else:
                peaks[impl] = tensor_peak_bytes(lambda impl=impl: step(impl))
        print(
            f"\nOutput layer + loss, forward and backward: {self.rows} rows x {C} -> {V} classes on {device}"
        )
        print(f"{'impl':>8} {'ms (median)':>12} {'peak MiB':>10} {'loss':>10}")
        for impl in self.impls:
            ms = 1e3 * statistics.median(times[impl])
            print(f"{impl:>8} {ms:>12,.0f} {peaks[impl] / 2**20:>10,.1f} {losses[impl]:>10.5f}")
        result = {"rows": self.rows, "n_embd": C, "vocab_size": V, "device": str(device)}
        result["peak_memory_source"] = (
            "torch.cuda.max_memory_allocated" if device.type == "cuda" else "profiler tensor timeline"
        )
        for impl in self.impls:
            result[f"{impl}_ms"] = 1e3 * statistics.median(times[impl])
            result[f"{impl}_peak_memory_bytes"] = peaks[impl]
            result[f"{impl}_loss"] = losses[impl]
        if "plain" in self.impls:
            for impl in self.impls:
                if impl != "plain":
                    result[f"{impl}_memory_ratio"] = peaks[impl] / peaks["plain"]
                    result[f"{impl}_speedup"] = result["plain_ms"] / result[f"{impl}_ms"]
        return result


def build_plain_optimizer(model: torch.nn.Module, optim, max_steps: int, mixed_precision: bool):
    """The optimizer and schedule of GPTLitModule.configure_optimizers, written out as a plain loop would."""
    from gptlab.training.module import use_fused_adamw

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": optim.options.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = use_fused_adamw(model) and not mixed_precision
    opt = torch.optim.AdamW(groups, **optim.options.adamw_kwargs(), fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, optim.options.factor(max_steps))
    return opt, sched


def cpu_times() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def make_pairing_callback(args, plain_model, head_loss, optim, clip, autocast, max_steps):
    import lightning as L

    class PairedTiming(L.Callback):
        """Times Lightning's steps in segments of ``args.steps`` and, between segments, runs the plain loop on
        the same batches."""

        def __init__(self) -> None:
            self.batches: list = []
            self.lightning_losses: list[float] = []
            self.plain_losses: list[float] = []
            self.rounds: list[dict] = []
            self.memory = PeakMemory()

        def _sync(self, device):
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def _start(self, device):
            self._sync(device)
            self.memory.reset(device)
            self._cpu0 = cpu_times()
            self._t0 = time.perf_counter()

        def _stop(self, device) -> dict:
            self._sync(device)
            dt = time.perf_counter() - self._t0
            u, s, f = (b - a for a, b in zip(self._cpu0, cpu_times()))
            return {"seconds": dt, "user": u, "sys": s, "faults": f, "peak": self.memory.peak(device)}

        def on_train_start(self, trainer, pl_module):
            self.device = pl_module.device
            plain_model.to(self.device)
            mixed = "mixed" in str(trainer.precision)
            self.opt, self.sched = build_plain_optimizer(plain_model, optim, max_steps, mixed)
            self._start(self.device)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.batches.append(batch)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.lightning_losses.append(float(outputs["loss"]))
            if len(self.batches) < args.steps:
                return
            lightning = self._stop(self.device)
            self._start(self.device)
            for x, y in self.batches:
                with autocast():
                    _, loss = plain_model(x, y, head_loss=head_loss)
                loss.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(plain_model.parameters(), clip)
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad(set_to_none=True)
                self.plain_losses.append(float(loss.detach()))
            plain = self._stop(self.device)
            tokens = sum(x.numel() for x, _ in self.batches)
            self.rounds.append({"tokens": tokens, "lightning": lightning, "plain": plain})
            self.batches = []
            self._start(self.device)

    return PairedTiming()


def train_benchmark(args, overrides: list[str]) -> dict:
    import lightning as L
    from omegaconf import OmegaConf

    import gptlab
    from gptlab.parallel import ParallelOptions, choose_precision
    from gptlab.tracking.loggers import csv_logger
    from gptlab.training.callbacks import instantiate_callbacks
    from gptlab.training.metrics import device_peak_flops
    from gptlab.training.module import GPTLitModule
    from gptlab.training.optimizers import parse_optim

    cfg = compose_config(overrides)
    L.seed_everything(cfg.seed, verbose=False)
    tokenizer = gptlab.build_tokenizer(cfg)
    model_config = gptlab.build_model_config(cfg, tokenizer)
    datamodule = gptlab.build_datamodule(cfg)
    optim = parse_optim(OmegaConf.to_container(cfg.optim, resolve=True))
    loss_cfg = OmegaConf.to_container(cfg.loss, resolve=True)
    parallel = ParallelOptions.from_config({"compile": cfg.compile})
    module = GPTLitModule(
        model=model_config, optim=optim, loss=loss_cfg, parallel=parallel, tokenizer=tokenizer
    )
    plain_model = copy.deepcopy(module.model)  # the same weights
    if parallel.compile:
        from gptlab.parallel import parallelize

        parallelize(plain_model, parallel)

    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    precision = choose_precision(trainer_cfg.get("precision"), trainer_cfg.get("accelerator"))
    max_steps = (args.warmup + args.rounds) * args.steps
    autocast = nullcontext
    if "bf16" in str(precision) or "16-mixed" in str(precision):
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if "bf16" in str(precision) else torch.float16

        def autocast():
            return torch.autocast(device_type, dtype=dtype)

    pairing = make_pairing_callback(
        args,
        plain_model,
        module.head_loss,
        optim,
        trainer_cfg.get("gradient_clip_val"),
        autocast,
        max_steps,
    )
    from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar

    from gptlab.training.checkpointing import PeriodicLastCheckpoint

    skip = (ModelCheckpoint, PeriodicLastCheckpoint) + (() if args.progress_bar else (ProgressBar,))
    callbacks = [c for c in instantiate_callbacks(cfg.get("callbacks") or {}) if not isinstance(c, skip)]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            accelerator=trainer_cfg.get("accelerator", "auto"),
            devices=1,
            precision=precision,
            max_steps=max_steps,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            log_every_n_steps=trainer_cfg.get("log_every_n_steps", 10),
            gradient_clip_val=trainer_cfg.get("gradient_clip_val"),
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=args.progress_bar,
            logger=csv_logger(tmp),
            callbacks=[*callbacks, pairing],
            default_root_dir=tmp,
        )
        trainer.fit(module, datamodule=datamodule)

    rounds = pairing.rounds[args.warmup :]
    if not rounds:
        raise SystemExit("no timed rounds: raise --rounds")
    device = pairing.device
    dtype = torch.bfloat16 if "bf16" in str(precision) else torch.float32
    peak_flops, peak_source = device_peak_flops(device, dtype)
    T = rounds[0]["tokens"] // (args.steps * int(cfg.data.batch_size))
    flops_per_token = module.flops_per_token(T)

    print(
        f"\n{'round':>5} {'lightning tok/s':>16} {'plain tok/s':>12} {'ratio':>6} {'sys share':>10} {'faults/step':>12}"
    )
    for i, r in enumerate(rounds):
        lt = r["tokens"] / r["lightning"]["seconds"]
        pt = r["tokens"] / r["plain"]["seconds"]
        cpu = r["lightning"]["user"] + r["lightning"]["sys"]
        print(
            f"{i:>5} {lt:>16,.0f} {pt:>12,.0f} {lt / pt:>6.3f} {r['lightning']['sys'] / max(cpu, 1e-9):>10.1%}"
            f" {r['lightning']['faults'] / args.steps:>12,.0f}"
        )

    def median(key, loop):
        return statistics.median(r[key] if loop is None else r[loop][key] for r in rounds)

    lightning_tps = statistics.median(r["tokens"] / r["lightning"]["seconds"] for r in rounds)
    plain_tps = statistics.median(r["tokens"] / r["plain"]["seconds"] for r in rounds)
    ratio = statistics.median(r["plain"]["seconds"] / r["lightning"]["seconds"] for r in rounds)
    # CPU seconds (user + sys) are less disturbed than wall time by other jobs on a shared machine
    cpu_ratio = statistics.median(
        (r["plain"]["user"] + r["plain"]["sys"]) / max(r["lightning"]["user"] + r["lightning"]["sys"], 1e-9)
        for r in rounds
    )
    user = sum(r["lightning"]["user"] for r in rounds)
    sys_time = sum(r["lightning"]["sys"] for r in rounds)
    n = min(len(pairing.lightning_losses), len(pairing.plain_losses))
    loss_diff = max(abs(a - b) for a, b in zip(pairing.lightning_losses[:n], pairing.plain_losses[:n]))
    result = {
        "tokens_per_second": lightning_tps,
        "plain_tokens_per_second": plain_tps,
        "ratio_to_plain": ratio,
        "cpu_time_ratio_to_plain": cpu_ratio,
        "mfu": lightning_tps * flops_per_token / peak_flops,
        "plain_mfu": plain_tps * flops_per_token / peak_flops,
        "peak_memory_bytes": int(max(r["lightning"]["peak"] for r in rounds)),
        "plain_peak_memory_bytes": int(max(r["plain"]["peak"] for r in rounds)),
        "peak_memory_source": PeakMemory.source(device),
        "kernel_time_share": sys_time / max(user + sys_time, 1e-9),
        "minor_faults_per_step": statistics.median(r["lightning"]["faults"] for r in rounds) / args.steps,
        "max_loss_difference": loss_diff,
        "flops_per_token": flops_per_token,
        "peak_flops": peak_flops,
        "peak_flops_source": peak_source,
        # above 1 only against a peak set too low: not an MFU to report
        "mfu_above_peak": lightning_tps * flops_per_token > peak_flops,
        "loss_impl": module.head_loss.resolve(device),
        "compile": bool(cfg.compile),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "rounds": len(rounds),
        "steps_per_round": args.steps,
        "tokens_per_step": rounds[0]["tokens"] // args.steps,
        "overrides": overrides,
    }
    above = " (above 100%: the peak is too low)" if result["mfu_above_peak"] else ""
    print(
        f"\nLightning {lightning_tps:,.0f} tok/s, plain loop {plain_tps:,.0f} tok/s, ratio {ratio:.3f} "
        f"(median of {len(rounds)} paired rounds of {args.steps} steps; CPU time {cpu_ratio:.3f}); MFU {result['mfu']:.1%}{above} of "
        f"{peak_flops / 1e9:,.1f} GFLOP/s ({peak_source}); peak memory {result['peak_memory_bytes'] / 2**20:,.0f} "
        f"MiB; kernel time {result['kernel_time_share']:.1%} of CPU time; largest loss difference {loss_diff:.2e}"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (each: Lightning, then plain)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per loop per round")
    parser.add_argument("--warmup", type=int, default=1, help="rounds not counted (start-up, compilation)")
    parser.add_argument("--progress-bar", action="store_true", help="show Lightning's progress bar")
    parser.add_argument("--head", action="store_true", help="time the output layer + loss alone")
    parser.add_argument("--rows", type=int, default=8192, help="--head: rows of B*T")
    parser.add_argument("--impls", default="plain,chunked", help="--head: implementations to compare")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        parser.error(f"unknown option(s) {bad}; Hydra overrides are written key=value")
    if args.head:
        result = HeadBenchmark(args.rows, args.impls.split(","), args.rounds, overrides).run()
    else:
        result = train_benchmark(args, overrides)
    print(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
