"""Time gptlab's Lightning training step against a plain PyTorch loop, in one process, interleaved; or time
`python train.py` per step, or its start-up phase by phase, from whole processes.

    python scripts/benchmark.py                                  # the default model and data
    python scripts/benchmark.py model=small pos=rope compile=true --rounds 6 --steps 5
    python scripts/benchmark.py --head --rows 8192               # the output layer + loss alone
    python scripts/benchmark.py --per-step                       # `python train.py`, seconds per step
    python scripts/benchmark.py --per-step --against 17a87d9     # ... against an older build (a git ref)
    python scripts/benchmark.py --startup --against c5c2628      # where the time to the first step goes
    python scripts/benchmark.py --startup --max-steps 20 task=word2vec

Per step (``--per-step``): the whole ``python train.py <overrides>`` process is timed from outside at two step
counts, ``--short`` and ``--long`` (``trainer.max_steps``), everything else equal, with one validation at the
end of each (``trainer.val_check_interval`` = the run's steps): start-up, data preparation, the final
validation and the final checkpoint are in both and cancel out, so ``(wall_long - wall_short) / (long -
short)`` is the wall time of one training step as the user's run takes it (its callbacks, logging and periodic
checkpoints included), and tokens per second is the tokens of a step over that. With ``--against REF`` the
same is timed for that commit, exported with ``git archive`` into a temporary folder and run there with its
own ``src/`` (its own config: tokens per step are read from each build's composed config). The processes are
interleaved, all short runs then all long runs, in an order that rotates each round, so that the programs
share the machine's load; an untimed run of each program first fills the token cache and the file cache.
Prints every process's wall time, the per-round figures, the medians with their range and the ratio of each
program's rate to the first's, one JSON object, and last a Markdown table to paste.

Start-up (``--startup``): each round runs ``python train.py <overrides> trainer.max_steps=<--max-steps>
hydra.run.dir=<a new folder>`` in the checkout (so its token cache under ``outputs/cache`` is the one the user's
runs share), as a whole process, with a thin wrapper in front of ``train.py`` that notes the time at which the process reaches a few of gptlab's own
functions (the wrapper changes nothing the run does: it wraps them, and a torch optimizer-step hook notes the
first step). The phases are the spans between consecutive marks, from the moment the process is started to the
moment it has exited:

- *interpreter and imports*: Python starts, ``train.py`` imports Hydra and gptlab's entry point;
- *Hydra composes the config*: Hydra parses the command line and composes the config (the run directory
  chosen, its callbacks run), up to the task;
- *config parsed*: the typed config (``gptlab.config``; its imports, torch among them);
- *memory check, Lightning, run directory* (``task=gpt``): the memory estimate, Lightning's import, the run
  directory claimed and the seed set;
- *data ready*: the token cache opened (or made), the tokenizer, the windows;
- *model built*: the module and its weights;
- *loggers, trainer, W&B open*: the loggers, the Trainer, the model card and the config logged (which opens
  the W&B run);
- *first step*: Lightning's fit up to the end of the first optimizer step;
- *the other steps, validation, checkpoints*: the rest of Lightning's fit;
- *closing lines, result.json, W&B closed*: the task's report (for word2vec its evaluation too);
- *Hydra's job end*, *exit handlers* (W&B's, logging's) and *interpreter exit*: the process ends.

``task=word2vec`` has its own marks (config, corpus read, trainer made, fit; W&B opens in the background). A
mark that a build does not reach (an older commit without that function) is left out, and its span joins the
next one. Each mark has the wall seconds since the process was started and the process's CPU seconds by then
(its threads together: the steadier figure on a shared machine). The builds (``--against REF``, run with the
same token cache) are interleaved as above. Prints every process's marks, one JSON object, and last a Markdown
table: per phase each build's wall and CPU seconds, median (range), the time to the first step and the whole
process, and each build's against the first's, round by round.

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
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


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
    from gptlab.preflight import training_device_type
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
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    # compile=auto (the default) as a run takes it: on where it trains on CUDA
    parallel = ParallelOptions.from_config({"compile": cfg.compile}).resolved(
        training_device_type(trainer_cfg)
    )
    module = GPTLitModule(
        model=model_config, optim=optim, loss=loss_cfg, parallel=parallel, tokenizer=tokenizer
    )
    plain_model = copy.deepcopy(module.model)  # the same weights
    if parallel.compiled:
        from gptlab.parallel import parallelize

        parallelize(plain_model, parallel)

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
        "compile": parallel.compiled,
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


# ---- per step, from whole processes ---------------------------------------------------------------------


@dataclass
class Program:
    """A training program timed as whole processes: ``argv(steps, out)`` is its command line for a run of
    ``steps`` optimizer steps that writes into the folder ``out``, run in ``cwd`` with ``env`` added to this
    process's environment."""

    name: str
    argv: Callable[[int, Path], list[str]]
    cwd: Path
    tokens_per_step: int
    env: dict[str, str] = field(default_factory=dict)

    def run(self, steps: int, out: Path) -> float:
        """Wall seconds of one whole run of ``steps`` steps. Its folder is removed afterwards (each run
        writes checkpoints)."""
        argv = self.argv(steps, out)
        t0 = time.perf_counter()
        proc = subprocess.run(
            argv, cwd=self.cwd, env={**os.environ, **self.env}, capture_output=True, text=True
        )
        wall = time.perf_counter() - t0
        shutil.rmtree(out, ignore_errors=True)
        if proc.returncode:
            raise SystemExit(
                f"{self.name}: `{shlex.join(argv)}` (in {self.cwd}) exited with {proc.returncode}:\n"
                f"{(proc.stdout + proc.stderr)[-3000:]}"
            )
        return wall


@dataclass
class PerStepTiming:
    """Wall seconds per training step of each program, from whole processes at ``short`` and ``long`` steps:
    what both runs share (start-up, data, the final validation and checkpoint) cancels in the difference.
    Each round runs every program's short run, then every long run, the programs' order rotating by one
    each round."""

    programs: list[Program]
    short: int
    long: int
    rounds: int
    out: Path
    warmup: bool = True

    def run(self) -> dict:
        if not 0 < self.short < self.long:
            raise SystemExit(f"--short {self.short} --long {self.long}: need 0 < --short < --long")
        if self.rounds < 1:
            raise SystemExit(f"--rounds {self.rounds}: need at least one round")
        load_before = os.getloadavg()[0]
        if self.warmup:  # fills the token cache and the file cache; not counted
            for program in self.programs:
                wall = program.run(self.short, self.out / "warmup")
                print(f"warm-up: {program.name}, {self.short} steps: {wall:.1f} s (not counted)", flush=True)
        walls: dict[str, dict[int, list[float]]] = {
            p.name: {self.short: [], self.long: []} for p in self.programs
        }
        for r in range(self.rounds):
            k = r % len(self.programs)
            for steps in (self.short, self.long):
                for i, program in enumerate(self.programs[k:] + self.programs[:k]):
                    wall = program.run(steps, self.out / f"round{r}-{steps}-{i}")
                    walls[program.name][steps].append(wall)
                    print(
                        f"round {r + 1}/{self.rounds}: {program.name}, {steps} steps: {wall:.1f} s",
                        flush=True,
                    )
        result = per_step_summary(self.programs, walls, self.short, self.long)
        result["load_average"] = [load_before, os.getloadavg()[0]]
        return result


def per_step_summary(
    programs: list[Program], walls: dict[str, dict[int, list[float]]], short: int, long: int
) -> dict:
    """Seconds per step and tokens per second of each program in each round, their medians and ranges, and
    each program's rate against the first program's in the same round. A round whose long run took no longer
    than its short run (the machine's load changed between them) has no rate (inf) and is left out of the
    medians, and so is its ratio."""
    first = programs[0].name
    figures: dict[str, dict] = {}
    for program in programs:
        w = walls[program.name]
        seconds = [(b - a) / (long - short) for a, b in zip(w[short], w[long])]
        rates = [program.tokens_per_step / s if s > 0 else math.inf for s in seconds]
        figures[program.name] = {
            "tokens_per_step": program.tokens_per_step,
            "wall_seconds_short": w[short],
            "wall_seconds_long": w[long],
            "seconds_per_step": seconds,
            "tokens_per_second": rates,
            "seconds_per_step_median": _median([s for s in seconds if s > 0]),
            "tokens_per_second_median": _median([r for r in rates if math.isfinite(r)]),
        }
    for program in programs:
        f = figures[program.name]
        # how many times this program's rate the first one's is, round by round (1 for the first itself)
        f["first_over_this"] = [
            a / b if math.isfinite(a) and math.isfinite(b) else math.nan
            for a, b in zip(figures[first]["tokens_per_second"], f["tokens_per_second"])
        ]
        f["first_over_this_median"] = _median([r for r in f["first_over_this"] if math.isfinite(r)])
    return {
        "mode": "per_step",
        "short_steps": short,
        "long_steps": long,
        "rounds": len(walls[first][short]),
        "programs": figures,
    }


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _range(values: list[float], fmt: str) -> str:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "none"
    return (
        f"{fmt.format(min(values))}-{fmt.format(max(values))}" if len(values) > 1 else fmt.format(values[0])
    )


def per_step_report(result: dict, command: str) -> str:
    """The per-round lines, and the Markdown table with the command and the machine under it."""
    programs = result["programs"]
    first = next(iter(programs))
    lines = [f"\n{'round':>5} {'program':<28} {'short s':>8} {'long s':>8} {'s/step':>8} {'tokens/s':>9}"]
    for r in range(result["rounds"]):
        for name, f in programs.items():
            lines.append(
                f"{r + 1:>5} {name:<28} {f['wall_seconds_short'][r]:>8.1f} {f['wall_seconds_long'][r]:>8.1f} "
                f"{f['seconds_per_step'][r]:>8.3f} {f['tokens_per_second'][r]:>9,.0f}"
            )
    lines += [
        "",
        f"| program | tokens/s, median (range) | s/step, median | {first} is (range) |",
        "|---|---:|---:|---:|",
    ]
    for name, f in programs.items():
        ratio = (
            "-"
            if name == first
            else f"{f['first_over_this_median']:.2f}x ({_range(f['first_over_this'], '{:.2f}')})"
        )
        lines.append(
            f"| {name} | {f['tokens_per_second_median']:,.0f} ({_range(f['tokens_per_second'], '{:,.0f}')}) "
            f"| {f['seconds_per_step_median']:.3f} | {ratio} |"
        )
    for name, f in programs.items():
        for r, seconds in enumerate(f["seconds_per_step"]):
            if seconds <= 0:
                lines.append(
                    f"\nRound {r + 1}: {name}'s long run took no longer than its short run: the machine's load "
                    "changed between them, and the round has no rate. Run more rounds, or at a quieter moment."
                )
    load = result.get("load_average")
    lines.append(
        f"\nWall time per step of whole processes, ({result['long_steps']} - {result['short_steps']} steps), "
        f"{result['rounds']} interleaved rounds; {result['machine']}"
        + (f"; load average {load[0]:.1f} before, {load[1]:.1f} after" if load else "")
        + f". Command: `{command}`"
    )
    return "\n".join(lines)


def machine_description() -> str:
    """The CPU (model, cores, torch threads) and the GPU if there is one: the card the figures came from."""
    cpu = "CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name(0)}"
    return text


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def export_build(ref: str, into: Path) -> tuple[Path, str]:
    """The commit ``ref`` names, exported (``git archive``: its tracked files, no git metadata) into a new
    folder under ``into``; returns the folder and the short commit."""
    try:
        commit = git("rev-parse", "--short", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--against {ref}: not a commit of {ROOT}: {e.stderr.strip()}") from None
    folder = into / f"build-{commit}"
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder, commit


def gptlab_program(name: str, root: Path, overrides: list[str]) -> Program:
    """``python train.py <overrides>`` of the checkout ``root`` with its own ``src/``, validating once, at its
    last step, and writing its run into the folder it is given."""
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(root / "src"), os.environ.get("PYTHONPATH")) if p),
        "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
    }
    proc = subprocess.run(
        [sys.executable, "train.py", *overrides, "--cfg", "job", "--resolve"],
        cwd=root,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(f"{name}: the overrides {overrides} do not compose:\n{proc.stderr[-3000:]}")
    import yaml

    cfg = yaml.safe_load(proc.stdout)
    data, trainer = cfg["data"], cfg["trainer"]
    devices = trainer.get("devices", 1)
    if not isinstance(devices, int):
        raise SystemExit(f"--per-step: trainer.devices={devices!r}: give the number of devices")
    tokens = (
        int(data["batch_size"])
        * int(data.get("block_size") or cfg["model"]["block_size"])
        * int(trainer.get("accumulate_grad_batches") or 1)
        * devices
        * int(trainer.get("num_nodes") or 1)
    )

    def argv(steps: int, out: Path) -> list[str]:
        return [
            sys.executable,
            "train.py",
            *overrides,
            f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={steps}",
            f"hydra.run.dir={out}",
        ]

    return Program(name, argv, root, tokens, env)


def per_step_benchmark(args, overrides: list[str]) -> tuple[dict, str]:
    taken = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in PER_STEP_KEYS]
    if taken:
        raise SystemExit(f"--per-step sets {', '.join(PER_STEP_KEYS)} itself: leave out {taken}")
    here = git("rev-parse", "--short", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        here += " + changes"
    with tempfile.TemporaryDirectory(prefix="gptlab-per-step-") as tmp:
        programs = [gptlab_program(f"gptlab {here}", ROOT, overrides)]
        for ref in args.against:
            folder, commit = export_build(ref, Path(tmp))
            programs.append(gptlab_program(f"gptlab {commit}", folder, overrides))
        result = PerStepTiming(
            programs, args.short, args.long, args.rounds or 2, Path(tmp) / "runs", warmup=not args.no_warmup
        ).run()
    result["machine"] = machine_description()
    result["overrides"] = overrides
    command = shlex.join(["python", "scripts/benchmark.py", *sys.argv[1:]])
    return result, per_step_report(result, command)


PER_STEP_KEYS = ("trainer.max_steps", "trainer.val_check_interval", "hydra.run.dir")


# ---- start-up, phase by phase, from whole processes (--startup) ------------------------------------------

# the marks: (label, module, attribute path, "enter" | "exit"), in the order a run reaches them ---------

STARTUP_GPT_MARKS = [
    ("Hydra starts", "hydra.main", "_run_hydra", "enter"),
    ("task starts", "gptlab.cli", "run_task", "enter"),
    ("config parsed", "gptlab.tasks.gpt", "parse_gpt", "exit"),
    ("run directory claimed", "gptlab.tasks.gpt", "build", "enter"),
    ("data ready", "gptlab.data.datamodule", "GPTDataModule.setup", "exit"),
    ("model built", "gptlab.tasks.gpt", "build", "exit"),
    ("loggers and W&B open", "gptlab.tasks.skeleton", "RunSession.save_config", "exit"),
    ("first step", "torch.optim.optimizer", "", "step"),
    ("fit done", "gptlab.tasks.gpt", "fit", "exit"),
    ("task returned", "gptlab.cli", "run_task", "exit"),
]
STARTUP_WORD2VEC_MARKS = [
    ("Hydra starts", "hydra.main", "_run_hydra", "enter"),
    ("task starts", "gptlab.cli", "run_task", "enter"),
    ("config parsed", "gptlab.tasks.word2vec", "Word2VecRunConfig.parse", "exit"),
    ("data ready", "gptlab.tasks.word2vec", "read_corpus", "exit"),
    ("trainer made", "gptlab.word2vec.task", "Trainer.__init__", "exit"),
    ("fit starts", "gptlab.word2vec.task", "Trainer.fit", "enter"),
    ("fit ends", "gptlab.word2vec.task", "Trainer.fit", "exit"),
    ("task returned", "gptlab.cli", "run_task", "exit"),
]
# the span that ends at each mark, as the report names it
STARTUP_PHASES = {
    "Hydra starts": "interpreter and imports",
    "task starts": "Hydra composes the config",
    "config parsed": "config parsed",
    "run directory claimed": "memory check, Lightning, run directory",
    "data ready": "data ready",
    "model built": "model built",
    "loggers and W&B open": "loggers, trainer, W&B open",
    "first step": "first step",
    "trainer made": "trainer made",
    "fit starts": "loggers, W&B open",
    "fit done": "the other steps, validation, checkpoints",
    "fit ends": "fit (every step)",
    "task returned": "closing lines, result.json, W&B closed",
    "exit handlers start": "Hydra's job end, threads joined",
    "exit handlers done": "exit handlers (atexit)",
    "exited": "interpreter exit",
}


def startup_marks(overrides: list[str]) -> list[tuple[str, str, str, str]]:
    task = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == "task"), "gpt")
    marks = STARTUP_WORD2VEC_MARKS if task == "word2vec" else STARTUP_GPT_MARKS
    return [*marks, *STARTUP_EXIT_MARKS]


# noted by the child itself: its first exit handler (registered when the task returns: they run last one
# first) and its last one (registered at its start)
STARTUP_EXIT_MARKS = [("exit handlers start", "", "", "atexit"), ("exit handlers done", "", "", "atexit")]


# The wrapper in front of train.py, run as `python -c STARTUP_CHILD train.py <overrides>`: it must import
# nothing heavy before train.py does (this script imports torch), so that each import's cost stays in the
# phase that pays it. Its marks come in GPTLAB_STARTUP_MARKS, and it writes them to GPTLAB_STARTUP_MARKS_FILE.
STARTUP_CHILD = r"""
import atexit
import importlib.abc
import json
import os
import runpy
import sys
import time
from typing import Any


class _MarkOnImport(importlib.abc.MetaPathFinder):
    '''Wraps the marked functions of each module as it is imported (importing nothing early, so that each
    import's cost stays in the phase that pays it), and notes when each is first reached.'''

    def __init__(self, marks: list[tuple[str, str, str, str]], out: Any) -> None:
        self.pending: dict[str, list[tuple[str, str, str]]] = {}
        for label, module, attr, when in marks:
            if when == "atexit":
                continue
            self.pending.setdefault(module, []).append((label, attr, when))
        self.out = out
        self.seen: set[str] = set()

    def note(self, label: str) -> None:
        if label not in self.seen:
            self.seen.add(label)
            self.out.write(
                json.dumps({"mark": label, "t": time.monotonic(), "cpu": time.process_time()}) + "\n"
            )
            self.out.flush()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            for label, attr, when in self.pending.pop(name, []):
                self.wrap(module, label, attr, when)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def wrap(self, module: Any, label: str, attr: str, when: str) -> None:
        if when == "step":  # torch's global hook after every optimizer step: the first one is the mark
            module.register_optimizer_step_post_hook(lambda *args, **kwargs: self.note(label))
            return
        *owners, name = attr.split(".")
        owner = module
        for part in owners:
            owner = getattr(owner, part, None)
        function = getattr(owner, name, None) if owner is not None else None
        if function is None:
            return  # not in this build: its span joins the next mark's

        def marked(*args: Any, **kwargs: Any) -> Any:
            if when == "enter":
                self.note(label)
            try:
                return function(*args, **kwargs)
            finally:
                if when == "exit":
                    self.note(label)
                if label == "task returned":
                    atexit.register(self.note, "exit handlers start")

        setattr(owner, name, marked)


script, *rest = sys.argv[1:]
out = open(os.environ["GPTLAB_STARTUP_MARKS_FILE"], "a")  # open for the process's life
finder = _MarkOnImport(json.loads(os.environ["GPTLAB_STARTUP_MARKS"]), out)
atexit.register(finder.note, "exit handlers done")
sys.meta_path.insert(0, finder)
sys.argv = [script, *rest]
sys.path[0] = os.path.dirname(os.path.abspath(script))
runpy.run_path(script, run_name="__main__")
"""


@dataclass
class StartupBuild:
    """A checkout whose ``train.py`` is timed: this one, or an exported commit with its own ``src/``."""

    name: str
    root: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, overrides: list[str], out: Path) -> dict[str, dict[str, float]]:
        """One whole process: each mark's wall seconds after the process was started (``wall``) and the
        process's CPU seconds by then (``cpu``, its threads together), ``exited`` last."""
        marks_file = out.with_suffix(".marks")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(self.root / "src"), os.environ.get("PYTHONPATH")) if p
            ),
            "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
            "GPTLAB_STARTUP_MARKS": json.dumps(startup_marks(overrides)),
            "GPTLAB_STARTUP_MARKS_FILE": str(marks_file),
            **self.env,
        }
        argv = [sys.executable, "-c", STARTUP_CHILD, "train.py", *overrides]
        argv.append(f"hydra.run.dir={out}")
        log_file = out.with_suffix(".log")
        # into a file, not a pipe: the end is when the process exits, as a shell sees it, not when the last
        # process holding the pipe (W&B's service) closes it
        with open(log_file, "w") as log:
            t0 = time.monotonic()
            proc = subprocess.Popen(argv, cwd=self.root, env=env, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
            exited = time.monotonic() - t0
            returncode = os.waitstatus_to_exitcode(status)
            proc.returncode = returncode
        if returncode:
            raise SystemExit(
                f"{self.name}: `{shlex.join(argv)}` exited with {returncode}:\n{log_file.read_text()[-3000:]}"
            )
        log_file.unlink()
        marks = {}
        for line in marks_file.read_text().splitlines():
            item = json.loads(line)
            marks[item["mark"]] = {"wall": item["t"] - t0, "cpu": item["cpu"]}
        marks["exited"] = {"wall": exited, "cpu": usage.ru_utime + usage.ru_stime}
        shutil.rmtree(out, ignore_errors=True)
        marks_file.unlink()
        return marks


Marks = dict[str, dict[str, float]]  # mark -> {"wall": s after the start, "cpu": the process's CPU s by then}


def startup_phases(marks: Marks, order: list[str], clock: str) -> dict[str, float]:
    """Each reached mark's span on ``clock`` (wall or cpu): the seconds since the mark reached before it (the
    process's start first)."""
    spans, before = {}, 0.0
    for label in order:
        if label in marks:
            spans[label] = marks[label][clock] - before
            before = marks[label][clock]
    return spans


def first_step_mark(order: list[str]) -> str:
    return "first step" if "first step" in order else "fit starts"


def _median_range(values: list[float]) -> str:
    if not values:
        return "-"
    median = statistics.median(values)
    return f"{median:.2f} ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else f"{median:.2f}"


def startup_report(builds: list[str], results: dict[str, list[Marks]], order: list[str]) -> str:
    """A Markdown table: per phase, each build's wall and CPU seconds, median (range) over the rounds; then
    the time to the first step and the whole process; with several builds, each one's against the first's,
    round by round (ratios of the same round)."""
    step = first_step_mark(order)
    header = " | ".join(f"{name}: wall s | CPU s" for name in builds)
    lines = [f"| phase (ends at) | {header} |", "|---|" + "---:|---:|" * len(builds)]
    for label in order:
        cells = []
        for name in builds:
            for clock in ("wall", "cpu"):
                spans = [startup_phases(m, order, clock).get(label) for m in results[name]]
                cells.append(_median_range([s for s in spans if s is not None]))
        if any(c != "-" for c in cells):
            lines.append(f"| {STARTUP_PHASES.get(label, label)} | " + " | ".join(cells) + " |")
    totals = (
        ("to the first step" if step == "first step" else "to the fit", step),
        ("whole process", "exited"),
    )
    for title, label in totals:
        cells = [
            _median_range([m[label][clock] for m in results[name] if label in m])
            for name in builds
            for clock in ("wall", "cpu")
        ]
        lines.append(f"| **{title}** | " + " | ".join(cells) + " |")
    first = builds[0]
    for name in builds[1:]:
        for title, label in totals:
            for clock in ("wall", "cpu"):
                ratios = [
                    a[label][clock] / b[label][clock]
                    for a, b in zip(results[first], results[name])
                    if label in a and label in b and b[label][clock] > 0
                ]
                if ratios:
                    lines.append(
                        f"{first} / {name}, {title}, {clock}: {statistics.median(ratios):.2f} "
                        f"({min(ratios):.2f}-{max(ratios):.2f}) over {len(ratios)} rounds"
                    )
    return "\n".join(lines)


def startup_benchmark(args, overrides: list[str]) -> tuple[dict, str]:
    """``--startup``: rounds of whole ``python train.py`` processes of this checkout and of each ``--against``
    commit, interleaved in an order that rotates each round, after an untimed run of each."""
    if any(o.split("=", 1)[0] in ("trainer.max_steps", "hydra.run.dir") for o in overrides):
        raise SystemExit(
            "--startup sets trainer.max_steps (--max-steps) and hydra.run.dir itself: leave them out"
        )
    overrides = [*overrides, f"trainer.max_steps={args.max_steps}"]
    order = [label for label, *_ in startup_marks(overrides)] + ["exited"]
    here = git("rev-parse", "--short", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        here += " + changes"
    rounds = args.rounds or 3
    with tempfile.TemporaryDirectory(prefix="gptlab-startup-") as tmp:
        builds = [StartupBuild(f"gptlab {here}", ROOT)]
        for ref in args.against:
            folder, commit = export_build(ref, Path(tmp))
            # the same token cache as this checkout's: both builds open the same warm cache
            builds.append(StartupBuild(f"gptlab {commit}", folder, {"GPTLAB_ROOT": str(ROOT)}))
        load_before = os.getloadavg()[0]
        if not args.no_warmup:
            for i, build in enumerate(builds):
                marks = build.run(overrides, Path(tmp) / f"warmup-{i}")
                print(f"warm-up: {build.name}: {marks['exited']['wall']:.1f} s (not counted)", flush=True)
        results: dict[str, list[Marks]] = {b.name: [] for b in builds}
        for r in range(rounds):
            k = r % len(builds)
            for i, build in enumerate(builds[k:] + builds[:k]):
                marks = build.run(overrides, Path(tmp) / f"round{r}-{i}")
                results[build.name].append(marks)
                shown = ", ".join(f"{label} {marks[label]['wall']:.2f}" for label in order if label in marks)
                print(f"round {r + 1}/{rounds}: {build.name}: {shown}", flush=True)
        load_after = os.getloadavg()[0]
    result = {
        "mode": "startup",
        "overrides": overrides,
        "results": results,
        "load_average": [load_before, load_after],
    }
    command = shlex.join(["python", "scripts/benchmark.py", *sys.argv[1:]])
    table = startup_report([b.name for b in builds], results, order)
    table += (
        f"\n\n{rounds} interleaved rounds, seconds after the process was started; {machine_description()}; "
        f"load average {load_before:.1f} before, {load_after:.1f} after. Command: `{command}`"
    )
    return result, table


def main(argv: list[str] | None = None) -> int:
    from gptlab.cli import ArgumentParser  # its usage line is the command (python scripts/benchmark.py)

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds (default 5; --per-step: 2; --startup: 3)"
    )
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per loop per round")
    parser.add_argument("--warmup", type=int, default=1, help="rounds not counted (start-up, compilation)")
    parser.add_argument("--progress-bar", action="store_true", help="show Lightning's progress bar")
    parser.add_argument("--head", action="store_true", help="time the output layer + loss alone")
    parser.add_argument("--rows", type=int, default=8192, help="--head: rows of B*T")
    parser.add_argument("--impls", default="plain,chunked", help="--head: implementations to compare")
    parser.add_argument(
        "--per-step", action="store_true", help="time `python train.py` per step from whole processes"
    )
    parser.add_argument("--short", type=int, default=30, help="--per-step: steps of the short runs")
    parser.add_argument("--long", type=int, default=130, help="--per-step: steps of the long runs")
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="REF",
        help="--per-step, --startup: also time this commit",
    )
    parser.add_argument(
        "--no-warmup", action="store_true", help="--per-step, --startup: no untimed run of each program first"
    )
    parser.add_argument(
        "--startup",
        action="store_true",
        help="time `python train.py`'s phases up to its first step and its exit",
    )
    parser.add_argument("--max-steps", type=int, default=1, help="--startup: trainer.max_steps of each run")
    args, overrides = parser.parse_known_args(argv)
    parser.refuse_unknown([o for o in overrides if o.startswith("-")])  # Hydra overrides are key=value
    report = None
    if args.startup:
        result, report = startup_benchmark(args, overrides)
    elif args.per_step:
        result, report = per_step_benchmark(args, overrides)
    elif args.head:
        result = HeadBenchmark(args.rows, args.impls.split(","), args.rounds or 5, overrides).run()
    else:
        args.rounds = args.rounds or 5
        result = train_benchmark(args, overrides)
    print(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in result.items()}))
    if report is not None:
        print(report)  # last: the table to paste
    return 0


if __name__ == "__main__":
    sys.exit(main())
