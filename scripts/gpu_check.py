"""Every GPU path of gptlab, run and measured on one CUDA GPU, in one command of under 8 minutes.

    bash scripts/make_gpu_wheels.sh                   # where the package index is reachable: .gpu_wheels/
    python3 scripts/gpu_check.py --wheels .gpu_wheels --out /tmp/gpu_check --summary results/   # GPU machine
    python3 scripts/gpu_check.py --cpu-smoke --out /tmp/smoke         # each section at toy size, on the CPU

The GPU machine has torch (a CUDA build, 2.11 or newer) and no package index: ``--wheels`` installs the folder of
wheels (``pip install --no-index --no-deps --target``) into a directory of its own and runs the check again with
that directory and ``src/`` on ``PYTHONPATH``. Each section then runs in a child process of its own, with its own
time limit, so that a crash, a hang or an out-of-memory error costs that section and nothing else. The limits add
up to 463 s (``SECTIONS``); a section may also use what the sections before it left unused, never what the later
ones are owed (:func:`section_budget`). The whole command, the wheels' install (``install_s``, about 10 s)
included, ends within ``WHOLE_RUN_S`` = 478 s, under 8 minutes, whatever hangs:

- ``environment``: the GPU, torch, CUDA, which wheels installed, ``pip check``, the torch features gptlab uses,
  and one bf16 matrix product (the measured ceiling beside the chip's published dense bf16 peak);
- ``gpu_tests``: ``pytest -m gpu``, every ``gpu``-marked test (``--continue-on-collection-errors``: a test file
  whose imports are missing there is reported, not fatal; each test stopped after ``TEST_TIMEOUT_S`` where
  pytest-timeout is installed, as on the GPU image, so that one hung test fails alone);
- ``gpt2``: GPT-2 small (124M) at context 1024 in bf16 mixed precision, eager and with ``torch.compile`` on every
  block (``compile=true``): tokens/s, MFU against the chip's bf16 dense peak (6N + 12LhT FLOPs per token), peak
  memory; compiled also with ``loss.impl=cce`` beside ``auto`` (``chunked``), and a profile of each compiled step (its
  kernels by their own time: where the step goes, for the MFU). The training step is gptlab's model, head and
  optimizer, outside Lightning;
- ``loss``: every ``loss.impl`` (plain, chunked, torch, liger, cce) at B*T = 8,192, D = 768, V = 50,257 under bf16
  autocast, forward and backward: time, peak memory, and the loss and gradients against an fp32 reference;
  ``chunked`` twice, its elementwise pass fused (one compiled kernel per chunk, compiled once) and eager, each at
  its default chunk (sized by the chunk's dtype: bf16 logits in the fused pass, twice the rows of the eager
  pass's fp32 ones), the fused pass also at the eager one's rows, and beside each chunked row the memory
  ``planning.HeadPlan`` counts for it; then ``plain`` and both chunked passes again with the output layer as the
  model stores it, padded to 50,304 rows (``model.vocab_multiple=64``): the same numbers, the padding's gradient
  0, and the time the aligned products save;
- ``head_accuracy``: each ``loss.impl``'s gradients through a 2-layer model under bf16 autocast against the fp32
  plain head's, Cut Cross-Entropy's kernel beside its arithmetic followed in torch
  (``scripts/head_gradient_accuracy.py``): the largest relative error and where;
- ``attention``: alibi, relative and fire through FlexAttention and through SDPA (the same weights and batch):
  tokens/s of a training step, the same loss, and FlexAttention's compiles (one, for every layer and step);
- ``strategies``: ``strategy=ddp`` and ``strategy=fsdp`` on one GPU over NCCL, with deterministic algorithms: a
  run, and the same run resumed from its middle checkpoint, end with the same losses (the two strategies side by
  side: tiny runs that leave the GPU idle);
- ``checkpoint_copy``: what a background checkpoint save makes the step wait for, the copy of GPT-2 small's
  weights and AdamW moments (about 1.5 GB) to host memory, into pageable buffers and into pinned ones (the
  default for CUDA tensors): the first save (which allocates them) and the median of the later ones;
- ``word2vec``: ``task=word2vec`` on CUDA against the CPU at three batch sizes (256, the default, 1,024 and
  4,096): words/s, the final loss, and CUDA's rate over the CPU's at each, for ``word2vec.device=auto``'s rule;
- ``main_command``: ``python train.py model=small pos=sinusoidal trainer.devices=1`` with every default, as
  whole processes at 100 and 300 steps: the wall time of a step with start-up cancelled, and the final loss; with
  ``--foreground-save``, also at 300 steps with ``callbacks.last_checkpoint.background=false``: what a
  checkpoint written before the next step costs against one written by the background thread.

Everything goes to ``--out``: ``gpu_check.json`` (every figure, each section's status, seconds and error) and
``gpu_check.md`` (the table, also printed last), rewritten after each section; ``--summary DIR`` also puts those two
and the tests' log in DIR, alone. ``--only SECTION ...`` reruns some sections. The exit status is 0 when every
section that ran is ok.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SITE = Path("/tmp/gptlab-gpu-site")
# Dense bf16 peak FLOP/s from the vendors' datasheets (SXM parts), for MFU; matched on the device name.
SMOKE_SLOWDOWN = 4  # --cpu-smoke: each section's time limit times this
TEST_TIMEOUT_S = (
    100  # gpu_tests: one test's limit (the longest, two train.py runs over NCCL, takes well under it)
)
INSTALL_TIMEOUT_S = 120  # --wheels: pip's install of the folder (about 10 s)
WHOLE_RUN_S = 478  # the whole command, the wheels' install included: the sections get what the install leaves
BF16_PEAKS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12}


@dataclass
class Context:
    """What every section reads: the device, toy sizes or real ones, where to write."""

    smoke: bool
    out: Path
    with_compile: bool = True  # gpt2's compiled variant (tens of seconds of compilation on a CPU)
    # main_command's third process, checkpoints written before the next step (--foreground-save): its cost
    # was measured on an H200 (1,162 and 1,477 ms a save more than in the background); off, the check fits
    foreground_save: bool = False

    def sizes(self, real: Any, toy: Any) -> Any:
        return toy if self.smoke else real


@dataclass
class Section:
    name: str
    budget_s: float
    run: Callable[[Context], dict[str, Any]]
    result: dict[str, Any] = field(default_factory=dict)


# ---- helpers, run inside a section's process --------------------------------------------------------------
def _torch_device(ctx: Context) -> Any:
    import torch

    if ctx.smoke:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible: run with --cpu-smoke on a machine without a GPU")
    return torch.device("cuda")


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device: Any) -> int:
    import torch

    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak_gib(device: Any, baseline: int = 0) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated() - baseline) / 2**30


def _profile(fn: Callable[[], Any], device: Any, calls: int = 2, top: int = 12) -> list[dict[str, Any]]:
    """torch.profiler over ``calls`` calls of ``fn``: the ``top`` operations and kernels by their own time on
    the device (on a CPU, by their own CPU time), each per call and as a share of all, for where a step's
    time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    names = ("self_device_time_total", "self_cuda_time_total") if device.type == "cuda" else ()

    def own_us(event: Any) -> float:
        for name in names:
            if hasattr(event, name):
                return float(getattr(event, name))
        return float(event.self_cpu_time_total)

    events = [e for e in prof.key_averages() if own_us(e) > 0]
    total = sum(own_us(e) for e in events) or 1.0
    return [
        {
            "kernel": e.key[:100].replace("|", "/"),
            "ms_per_step": round(own_us(e) / 1e3 / calls, 2),
            "percent": round(100 * own_us(e) / total, 1),
            "calls_per_step": e.count // calls,
        }
        for e in sorted(events, key=own_us, reverse=True)[:top]
    ]


def _time(fn: Callable[[], Any], device: Any, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after ``warmup``, synchronised with the device."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _autocast(device: Any) -> Any:
    import torch

    # bf16 mixed precision on the GPU, as trainer.precision=auto chooses there; fp32 on the CPU (smoke)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def bf16_peak(device_name: str) -> float | None:
    """The published dense bf16 FLOP/s of a device, by its name (None when unknown)."""
    for key in sorted(BF16_PEAKS, key=len, reverse=True):
        if key in device_name:
            return BF16_PEAKS[key]
    return None


def _compose(*overrides: str) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


# ---- the sections ---------------------------------------------------------------------------------------------
def section_environment(ctx: Context) -> dict[str, Any]:
    import torch

    from gptlab import torch_features

    device = _torch_device(ctx)
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "commit": _commit(),
        "features": {name: f.available() for name, f in torch_features.FEATURES.items()},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            bf16_peak_tflops=(bf16_peak(props.name) or 0) / 1e12 or None,
        )
    else:
        info["device"] = "cpu (smoke)"
    # the measured ceiling: one large bf16 matrix product (fp32 on the CPU)
    n = ctx.sizes(8192, 256)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    seconds = _time(lambda: a @ b, device, warmup=3, repeats=10)
    info["matmul_tflops"] = float(f"{2 * n**3 / seconds / 1e12:.3g}")
    pip = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=20)
    info["pip_check"] = (pip.stdout + pip.stderr).strip().splitlines()[:20]
    installed = SITE / "installed.txt"
    info["wheels"] = installed.read_text().split() if installed.exists() else []
    if os.environ.get("GPTLAB_GPU_CHECK_INSTALL_S"):  # --wheels: the seconds pip took, before every section
        info["install_s"] = float(os.environ["GPTLAB_GPU_CHECK_INSTALL_S"])
    rows = [
        {"what": key, "value": value} for key, value in info.items() if key not in ("pip_check", "wheels")
    ]
    return {"ok": True, "info": info, "rows": rows}


def _commit() -> str:
    if os.environ.get("GPTLAB_COMMIT"):
        return os.environ["GPTLAB_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


# A test file that imports conftest's CPU_AND_CUDA (on one line, or within parentheses)
CUDA_CASES = re.compile(r"conftest import (\([^)]*|[^\n]*)\bCPU_AND_CUDA\b")


def gpu_test_files() -> list[str]:
    """The test files that hold gpu tests, and only those (a file whose imports the GPU image lacks, lm-eval's
    or mkdocs', and that has no gpu test is not collected at all): those that mark tests ``gpu``, and those
    parametrized over conftest's ``CPU_AND_CUDA`` (a CPU case and a gpu-marked CUDA one, as test_moe.py,
    test_mtp.py and test_flex_compile.py are, without ``mark.gpu`` in their text)."""
    return sorted(
        str(f.relative_to(ROOT))
        for f in (ROOT / "tests").glob("test_*.py")
        if "mark.gpu" in (source := f.read_text()) or CUDA_CASES.search(source)
    )


def section_gpu_tests(ctx: Context) -> dict[str, Any]:
    import xml.etree.ElementTree as ET

    report = ctx.out / "gpu_tests.xml"
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", *files, "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfEs"]
    cmd += ["--durations=15"]  # the log names the slowest: what the section's limit is made of
    cmd += ["--continue-on-collection-errors", f"--junitxml={report}"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += [f"--timeout={TEST_TIMEOUT_S}"]
    if ctx.smoke:
        cmd += ["-n", "0", "--collect-only"]  # the CPU cannot run them: check that they are all found
    else:
        # 16 cores, one GPU: the tests that start train.py overlap. worksteal hands out tests, not files (the
        # suite's default keeps a file on one worker, and most gpu tests, the longest among them, are one file's)
        cmd += ["-n", "6", "--dist", "worksteal"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_child_env())
    (ctx.out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    if ctx.smoke:
        collected = [line for line in proc.stdout.splitlines() if "::" in line]
        return {
            "ok": proc.returncode == 0 and bool(collected),
            "rows": [{"collected": len(collected)}],
            "log": tail,
        }
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    skipped: list[str] = []
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            error, skip = case.find("error"), case.find("skipped")
            if case.find("failure") is not None:
                counts["failed"] += 1
                failed.append(name)
            elif error is not None:  # an error in a fixture, or a file that could not be collected
                counts["errors"] += 1
                failed.append(f"{name} ({(error.get('message') or '')[:200]})")
            elif skip is not None:
                counts["skipped"] += 1
                skipped.append(f"{case.get('name')}: {(skip.get('message') or '')[:120]}")
            else:
                counts["passed"] += 1
    ok = proc.returncode == 0 and counts["passed"] > 0
    row = {**counts, "failed_tests": "; ".join(failed) or "-", "skipped_tests": "; ".join(skipped) or "-"}
    return {"ok": ok, "rows": [row], "files": files, "log": tail}


def section_gpt2(ctx: Context) -> dict[str, Any]:
    import torch

    from gptlab.model.config import GPTConfig
    from gptlab.model.counting import flops_per_token

    device = _torch_device(ctx)
    config = ctx.sizes(
        GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
        GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64),
    )
    batch = int(os.environ.get("GPT2_BATCH", ctx.sizes(32, 2)))
    peak = bf16_peak(torch.cuda.get_device_name(0)) if device.type == "cuda" else None
    flops = flops_per_token(config)["training"]
    rows = []
    # loss.impl=auto (chunked: each chunk's softmax one fused kernel on CUDA), and compiled also with Cut
    # Cross-Entropy, the fastest kernel in the loss section but not auto's (its gradients: head_accuracy).
    from gptlab.model.head_loss import available

    variants = [(False, "auto"), (True, "auto"), (True, "cce")] if ctx.with_compile else [(False, "auto")]
    # cce where it can run (CUDA, its package): --cpu-smoke and a machine without it time the others
    variants = [(c, i) for c, i in variants if i == "auto" or available(i, device, dtype=torch.bfloat16)]
    profiles = {}
    for compiled, impl in variants:
        row = _gpt2_rate(ctx, device, config, batch, compiled, impl)
        if "profile" in row:  # where a compiled step's time goes, by kernel: beside the table, not in it
            profiles[f"{row['variant']}, loss.impl={impl} ({row['loss_impl']})"] = row.pop("profile")
        tokens_per_s = row["tokens_per_s"]
        row["mfu_percent"] = round(100 * tokens_per_s * flops / peak, 1) if peak else None
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ok = all(math.isfinite(r["final_loss"]) for r in rows)
    return {"ok": ok, "rows": rows, "flops_per_token": flops, "bf16_peak": peak, "profiles": profiles}


def _gpt2_rate(
    ctx: Context, device: Any, config: Any, batch: int, compiled: bool, impl: str = "auto"
) -> dict[str, Any]:
    """Training steps of gptlab's model, head (``loss.impl``) and AdamW on random tokens: their rate."""
    import torch

    from gptlab.model.gpt import GPT
    from gptlab.model.head_loss import HeadLoss
    from gptlab.parallel.transforms import ParallelOptions, parallelize
    from gptlab.registry import Choice
    from gptlab.training.optimizers import AdamWOptions, build_optimizer

    torch.manual_seed(0)
    model = GPT(config).to(device)
    if compiled:
        parallelize(model, ParallelOptions(compile=True))  # compile=true: every block
    # lr 3e-4: the rate this check has always measured with (no schedule: the rate does not change a step's time)
    optimizer = build_optimizer(model, Choice("adamw", AdamWOptions(lr=3e-4)), fused=device.type == "cuda")
    head = HeadLoss(impl)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, config.vocab_size, (batch, config.block_size), device=device, generator=g)
    y = torch.randint(0, config.vocab_size, (batch, config.block_size), device=device, generator=g)
    losses: list[Any] = []

    def step() -> None:
        with _autocast(device):
            _, loss = model(x, y, head_loss=head)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    t0 = time.perf_counter()
    step()  # the first step: compilation, when compiled
    _sync(device)
    first_step_s = time.perf_counter() - t0
    _reset_peak(device)
    steps, warmup = ctx.sizes((10, 3), (2, 1))
    seconds = _time(step, device, warmup=warmup, repeats=steps)
    peak_gib = _peak_gib(device)
    final_loss = float(losses[-1])  # after the same steps in every variant: before the profiled ones
    profiled = {"profile": _profile(step, device)} if compiled else {}
    return {
        **profiled,
        "variant": "compile" if compiled else "eager",
        "batch": f"{batch} x {config.block_size}",
        "loss_impl": head.resolve(device, dtype=torch.bfloat16 if device.type == "cuda" else None),
        "step_ms": round(seconds * 1e3, 1),
        "tokens_per_s": round(batch * config.block_size / seconds),
        "peak_memory_gib": _round(peak_gib),
        "first_step_s": round(first_step_s, 1),
        "final_loss": round(final_loss, 4),
    }


def _round(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def section_loss(ctx: Context) -> dict[str, Any]:
    import torch

    from gptlab.model.config import VOCAB_MULTIPLE
    from gptlab.model.head_loss import (
        IMPLEMENTATIONS,
        HeadLoss,
        chunk_logits_dtype,
        default_chunk_rows,
        fused_by_default,
        plain_linear_cross_entropy,
        unavailable_reason,
    )
    from gptlab.planning import HeadPlan

    device = _torch_device(ctx)
    n, d, v = ctx.sizes((8192, 768, 50257), (256, 32, 1000))
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, d, device=device, generator=g)
    weight = torch.randn(v, d, device=device, generator=g) * 0.02
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    # the reference: the whole logits in fp32, outside autocast
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    reference = plain_linear_cross_entropy(h_ref, w_ref, targets)
    reference.backward()
    ref = (float(reference.detach()), h_ref.grad, w_ref.grad)
    rows, ok = [], True
    # the products' dtype under the autocast the rows run in: bf16 on the GPU, fp32 on the CPU (smoke)
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    # the chunk's default rows in each pass: as many as the device's budget holds of its logits, bf16 ones in
    # the fused pass on the GPU (4,168 rows at this vocabulary), fp32 ones in the eager pass (2,080)
    fused_rows, eager_rows = (
        default_chunk_rows(v, device.type, chunk_logits_dtype(autocast_dtype, fused))
        for fused in (True, False)
    )
    heads: list[tuple[str, Any]] = []
    for impl in ("plain", *(i for i in IMPLEMENTATIONS if i not in ("auto", "plain"))):
        if impl == "chunked":
            # its two elementwise passes, each forced: the fused one (compiled once in this process; the
            # compile falls in the call before the timing) and the eager one
            heads += [("chunked-fused", ChunkedPass(fused=True)), ("chunked-eager", ChunkedPass(fused=False))]
        else:
            heads.append((impl, HeadLoss(impl)))
    # the fused pass also at the eager pass's chunk, the bytes of fp32 logits in bf16 ones: half its default rows
    # (which were the default before the chunk was sized by its dtype), for the next choice of default
    other = ctx.sizes(eager_rows, 64)
    heads.append((f"chunked-fused ({other} rows)", ChunkedPass(fused=True, chunk_rows=other)))
    # and the whole batch as one chunk (on the GPU: 8,192 rows, 1.6 GB of fp32 logits)
    for impl in ("chunked", "torch"):
        head = HeadLoss(impl, chunk_rows=ctx.sizes(8192, 64))
        heads.append((f"{impl} ({head.chunk_rows} rows)", head))
    # The output layer as the model stores it (model.vocab_multiple=64): 50,304 rows, the last 47 zero. The
    # products take every row (aligned kernels: the unpadded layer's 50,257 ran in cutlass align1 kernels on an
    # H200), the logits their first V columns: beside the rows above, the gain of the padding.
    padded_rows = -(-v // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    padded_weight = torch.cat([weight, weight.new_zeros(padded_rows - v, d)])
    for label, inner in (
        ("plain", HeadLoss("plain")),
        ("chunked-fused", ChunkedPass(fused=True)),
        ("chunked-eager", ChunkedPass(fused=False)),
    ):
        heads.append((f"{label} (padded to {padded_rows})", PaddedHead(inner, v)))
    for label, head in heads:
        reason = unavailable_reason(head.impl, device.type)
        if label.startswith("chunked-fused") and not ctx.with_compile:
            reason = "--no-compile (it compiles its kernel)"
        if reason is not None:
            rows.append({"impl": label, "status": f"not run: {reason}"})
            continue
        padded = isinstance(head, PaddedHead)
        row = _loss_row(ctx, device, head, hidden, padded_weight if padded else weight, targets, ref)
        row["impl"] = label
        inner = head.head if padded else head
        if head.impl == "chunked":
            # the chunk it took, and what the memory plan (planning.HeadPlan) counts for it, beside the peak
            fused = (
                inner.fused
                if isinstance(inner, ChunkedPass)
                else fused_by_default(device.type, autocast_dtype)
            )
            chunk = inner.chunk_rows or (fused_rows if fused else eager_rows)
            plan = HeadPlan(
                "chunked", chunk, device.type, half_products=autocast_dtype is not None, fused=fused
            )
            row["chunk_rows"] = min(chunk, n)
            # less the inputs' fp32 gradients, (n, d) and (V, d): the peak column is above the previous call's,
            # which this call frees as it makes its own, so it leaves them out
            planned = plan.bytes(_head_config(v, d), n) - (n * d + v * d) * 4
            row["planned_gib"] = round(planned / 2**30, 3)
        ok &= row["status"] == "equal"
        rows.append(row)
    timed = [r for r in rows if "ms_fwd_bwd" in r]
    fastest = min(timed, key=lambda r: r["ms_fwd_bwd"])["impl"] if timed else None
    chosen = HeadLoss("auto").resolve(device)
    # which pass loss.impl=chunked takes here under the autocast the rows ran in (head_loss.fused_by_default)
    chunked_pass = "fused" if fused_by_default(device.type, autocast_dtype) else "eager"
    return {
        "ok": ok,
        "rows": rows,
        "reference_loss": ref[0],
        "fastest": fastest,
        "auto_chooses": chosen,
        "chunked_takes": chunked_pass,
    }


def _head_config(vocab_size: int, width: int) -> Any:
    """A model config with the output layer of the loss section's problem (what planning.HeadPlan reads)."""
    from gptlab.model.config import GPTConfig

    return GPTConfig(vocab_size=vocab_size, block_size=8, n_layer=1, n_head=1, n_embd=width)


@dataclass(frozen=True)
class ChunkedPass:
    """``loss.impl=chunked`` with its elementwise pass forced (``chunked_loss_terms(fused=...)``): the fused one,
    each chunk's softmax, loss and gradient one compiled kernel, or torch's eager operations; ``chunk_rows``
    rows a chunk (None: the default for the pass, sized by its chunk's dtype)."""

    fused: bool
    chunk_rows: int | None = None
    impl: str = "chunked"

    def __call__(self, hidden: Any, weight: Any, targets: Any, vocab_size: int | None = None) -> Any:
        from gptlab.model.head_loss import chunked_loss_terms

        return chunked_loss_terms(
            hidden, weight, targets, chunk_rows=self.chunk_rows, fused=self.fused, vocab_size=vocab_size
        ).loss


@dataclass(frozen=True)
class PaddedHead:
    """``head`` given an output layer padded with zero rows (``model.vocab_multiple``), the vocabulary its first
    ``vocab_size``: as the model calls it (``GPT.forward``)."""

    head: Any
    vocab_size: int

    @property
    def impl(self) -> str:
        return str(self.head.impl)

    def __call__(self, hidden: Any, weight: Any, targets: Any) -> Any:
        return self.head(hidden, weight, targets, vocab_size=self.vocab_size)


def _loss_row(ctx: Context, device: Any, head: Any, hidden: Any, weight: Any, targets: Any, ref: Any) -> dict:
    """One loss.impl forward and backward under autocast: time, memory, and its distance from the reference."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out: dict[str, Any] = {}

    def call() -> None:
        h.grad = w.grad = None
        with _autocast(device):
            loss = head(h, w, targets)
        loss.backward()
        out["loss"] = float(loss.detach())

    call()
    baseline = _reset_peak(device)
    seconds = _time(call, device, warmup=1, repeats=ctx.sizes(5, 2))
    peak = _peak_gib(device, baseline)
    ref_loss, ref_h, ref_w = ref
    assert h.grad is not None and w.grad is not None
    # a padded weight (PaddedHead): its first rows are the reference's, the padding's gradient must be 0
    padding_grad = float(w.grad[ref_w.size(0) :].abs().max()) if w.size(0) > ref_w.size(0) else 0.0
    grad_error = max(
        float((h.grad.float() - ref_h).norm() / ref_h.norm()),
        float((w.grad[: ref_w.size(0)].float() - ref_w).norm() / ref_w.norm()),
    )
    loss_error = abs(out["loss"] - ref_loss)
    # bf16 operands: about 1e-2 relative
    equal = loss_error < 2e-2 and grad_error < 3e-2 and padding_grad == 0.0
    return {
        "impl": head.impl,
        "status": "equal" if equal else "DIFFERS",
        "ms_fwd_bwd": round(seconds * 1e3, 2),
        "peak_memory_gib": _round(peak, 3),
        "loss": round(out["loss"], 5),
        "loss_error": f"{loss_error:.1e}",
        "grad_rel_error": f"{grad_error:.1e}",
        **({"padding_grad_max": padding_grad} if w.size(0) > ref_w.size(0) else {}),
    }


def section_attention(ctx: Context) -> dict[str, Any]:
    from gptlab.model.config import GPTConfig

    device = _torch_device(ctx)
    base = ctx.sizes(
        dict(vocab_size=50257, block_size=1024, n_layer=4, n_head=12, n_embd=768),
        dict(vocab_size=512, block_size=64, n_layer=1, n_head=2, n_embd=32),
    )
    batch = ctx.sizes(8, 2)
    rows, ok = [], True
    for pos in ("alibi", "relative", "fire"):
        config = GPTConfig(**base, pos=pos)
        # SDPA first: its row compiles what the step compiles besides FlexAttention (on CUDA the chunked head's
        # fused kernel, once per process), so that the FlexAttention row counts FlexAttention's compiles alone
        sdpa, flex = (_attention_row(ctx, device, config, batch, route) for route in ("sdpa", "flex"))
        sdpa["flex_compiles"] = None
        equal = abs(flex["loss"] - sdpa["loss"]) < 2e-2
        flex["same_loss"] = sdpa["same_loss"] = equal
        flex["speed_vs_sdpa"] = round(flex["tokens_per_s"] / sdpa["tokens_per_s"], 2)
        ok &= equal and flex["flex_compiles"] <= (1 if flex["ran"] == "flex" else 0)
        rows += [flex, sdpa]
    return {"ok": ok, "rows": rows}


def _attention_row(ctx: Context, device: Any, config: Any, batch: int, route: str) -> dict[str, Any]:
    """A training step's forward and backward (no optimizer step) through ``route``: FlexAttention where it is
    available, or SDPA with the bias as a dense mask (FlexAttention switched off); same weights, same batch."""
    import torch
    from torch._dynamo.utils import counters

    from gptlab.model import attention
    from gptlab.model.gpt import GPT
    from gptlab.model.head_loss import HeadLoss

    torch.manual_seed(0)
    model = GPT(config).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, config.vocab_size, (batch, config.block_size), device=device, generator=g)
    head = HeadLoss("auto")
    out: dict[str, Any] = {}

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with _autocast(device):
            _, loss = model(x, x, head_loss=head)
        loss.backward()
        out["loss"] = float(loss.detach())

    original = attention.flex_attention_available
    if route == "sdpa":
        attention.flex_attention_available = lambda *args, **kwargs: False
    graphs = counters["stats"]["unique_graphs"]  # FlexAttention's, once the SDPA row has compiled the head's
    try:
        ran = "flex" if attention.flex_attention_available(device, config.head_dim) else "sdpa"
        step()  # FlexAttention's kernel compiles on the first call
        seconds = _time(step, device, warmup=1, repeats=ctx.sizes(5, 2))
    finally:
        attention.flex_attention_available = original
    return {
        "pos": config.pos.name,
        "route": route,
        "ran": ran,
        "tokens_per_s": round(batch * config.block_size / seconds),
        "loss": round(out["loss"], 5),
        # FlexAttention's compiles over the row's steps: at most 1 (one length, one mask kind, one grad mode),
        # however many layers and steps; 0 where an earlier row's kernel fits (fire's score_mod is relative's
        # code, reading a bias tensor of the same shape). scripts/flex_recompiles.py counts a whole run's.
        "flex_compiles": counters["stats"]["unique_graphs"] - graphs,
    }


def _child_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    return env


def _csv_column(run_dir: Path, key: str) -> dict[int, float]:
    import csv

    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}


def section_strategies(ctx: Context) -> dict[str, Any]:
    work = ctx.out / "strategies"
    steps, middle = ctx.sizes((20, 10), (6, 3))
    device = ["trainer.accelerator=cpu"] if ctx.smoke else ["trainer.accelerator=gpu"]
    common = [
        *device,
        "trainer.devices=1",
        "tokenizer=char",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=64",
        "model.block_size=64",
        "data.batch_size=8",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={middle}",
        "trainer.limit_val_batches=4",
        "trainer.log_every_n_steps=1",
        "trainer.deterministic=true",
        "loss.impl=plain",
        "compile=false",  # the resume is checked here, not the compiler (compile=auto: on CUDA, every block)
        "callbacks.sample_generation.max_new_tokens=0",
        "callbacks.model_checkpoint.save_top_k=-1",
        "logger=csv",
    ]
    # Side by side: each run is a tiny model that leaves the GPU (and the CPU's cores) mostly idle, and the two
    # strategies' runs share nothing but the device (each its own root, so its own data cache, and process group)
    with ThreadPoolExecutor(max_workers=2) as pool:
        rows = list(pool.map(lambda s: _resume_row(s, common, work, steps, middle), ("ddp", "fsdp")))
    return {"ok": all(r.get("same_loss") is True for r in rows), "rows": rows}


def _resume_row(strategy: str, common: list[str], work: Path, steps: int, middle: int) -> dict[str, Any]:
    """One strategy's run and the same run resumed from its middle checkpoint: their losses side by side (never
    raises: one strategy's failure leaves the other's row)."""
    row: dict[str, Any] = {"strategy": strategy}
    try:
        t0 = time.perf_counter()
        root = work / strategy
        full, resumed = root / "full", root / "resumed"
        args = [*common, f"strategy={strategy}", f"paths.root_dir={root}"]
        _train([*args, f"hydra.run.dir={full}"], root)
        checkpoint = next((full / "checkpoints").glob(f"best-step{middle:06d}-*.ckpt"))
        _train([*args, f"resume={checkpoint}", f"hydra.run.dir={resumed}"], root)
        want, got = _csv_column(full, "train/loss"), _csv_column(resumed, "train/loss")
        val_want, val_got = _csv_column(full, "val/loss"), _csv_column(resumed, "val/loss")
        # Rows are numbered by optimizer steps done: the resumed run logs steps middle+1 .. steps.
        last = steps
        worst = max(abs(got[s] - want[s]) for s in range(middle + 1, steps + 1))
        equal = worst <= 1e-4 and abs(val_got[last] - val_want[last]) <= 1e-4
        row.update(
            checkpoint="directory (sharded)" if checkpoint.is_dir() else "file",
            val_loss_uninterrupted=round(val_want[last], 5),
            val_loss_resumed=round(val_got[last], 5),
            max_train_loss_difference=f"{worst:.1e}",
            same_loss=equal,
            seconds=round(time.perf_counter() - t0, 1),
        )
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
    return row


def _train(args: list[str], cwd: Path) -> str:
    """One train.py process with these overrides: its output (an error with its tail if it fails)."""
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=_child_env(),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"train.py exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    return proc.stdout + proc.stderr


#: The main command as a user types it on one device (README), timed as whole processes at two step counts.
MAIN_COMMAND = ["model=small", "pos=sinusoidal", "trainer.devices=1"]


def section_main_command(ctx: Context) -> dict[str, Any]:
    """``python train.py model=small pos=sinusoidal trainer.devices=1`` with every default (bf16-mixed, W&B
    offline, validation every 80 steps, checkpoints), at two step counts, each in a fresh process with its own
    root (so each tokenizes the corpus): the difference of their wall times over the difference of their steps
    is a training step with start-up and data preparation cancelled (validations and checkpoints counted)."""
    import re

    first, second = ctx.sizes((100, 300), (4, 12))
    toy = [
        "trainer.accelerator=cpu",
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=32",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=1",
        "callbacks.sample_generation.max_new_tokens=0",
        "callbacks.last_checkpoint.every_n_train_steps=4",
    ]
    overrides = MAIN_COMMAND + (toy if ctx.smoke else [])
    config = _compose(*overrides)
    tokens_per_step = int(config.data.batch_size) * int(config.model.block_size)
    rows = []
    # With --foreground-save, a third process: the longer run with each checkpoint written before the next
    # step, as before callbacks.last_checkpoint.background (its difference from the second is what the thread
    # saves).
    foreground = "callbacks.last_checkpoint.background=false"
    runs = [(first, []), (second, [])] + ([(second, [foreground])] if ctx.foreground_save else [])
    for steps, extra in runs:
        work = ctx.out / "main_command" / f"steps{steps}{'-foreground' if extra else ''}"
        args = [
            *overrides,
            *extra,
            f"trainer.max_steps={steps}",
            f"paths.root_dir={work}",
            f"hydra.run.dir={work / 'run'}",
        ]
        t0 = time.perf_counter()
        out = _train(args, work)
        wall = time.perf_counter() - t0
        loss = re.search(r"Final validation loss ([0-9.]+) nats", out)
        rate = re.search(r"training rate ([0-9,]+) tokens/s", out)
        # what the fit took: said apart only where it is not what the model card counted
        # ("(loss.impl=auto: chunked, ... rows per chunk)")
        head = re.search(r"Output layer and loss: (\w+)", out) or re.search(
            r"\(loss\.impl=(?:\w+: )?(\w+)", out
        )
        compiled = re.search(r"Compile: (on|off)", out)  # compile=auto: on CUDA, on
        rows.append(
            {
                "command": "python train.py "
                + " ".join([*MAIN_COMMAND, *extra, f"trainer.max_steps={steps}"]),
                "wall_s": round(wall, 2),
                "final_val_loss": float(loss.group(1)) if loss else None,
                "logged_training_rate": int(rate.group(1).replace(",", "")) if rate else None,
                "loss_impl": head.group(1) if head else None,
                "compile": compiled.group(1) if compiled else None,
            }
        )
    step_s = (rows[1]["wall_s"] - rows[0]["wall_s"]) / (second - first)
    saves = second // int(config.callbacks.last_checkpoint.every_n_train_steps)
    per_step = {
        "command": f"per step ({second} - {first} steps)",
        "step_ms": round(step_s * 1e3, 1),
        "tokens_per_s": round(tokens_per_step / step_s) if step_s > 0 else None,
    }
    per_save = [
        {
            "command": f"per checkpoint written before the next step, against in the background ({saves} saves)",
            "save_ms": round((rows[2]["wall_s"] - rows[1]["wall_s"]) / saves * 1e3, 1) if saves else None,
        }
    ][: len(rows) - 2]
    # At toy size (--cpu-smoke) the 8 steps between the two runs take less than their start-ups vary on a busy
    # machine: the difference may come out negative there, and only the GPU's figure is held to be a time.
    ok = (step_s > 0 or ctx.smoke) and all(r["final_val_loss"] is not None for r in rows)
    return {"ok": ok, "rows": [*rows, per_step, *per_save], "tokens_per_step": tokens_per_step}


def section_checkpoint_copy(ctx: Context) -> dict[str, Any]:
    """What a background checkpoint save makes the training step wait for: the copy of GPT-2 small's checkpoint
    (its weights and AdamW's two moments, on the GPU, about 1.5 GB) into host memory
    (``checkpoint_io.HostSnapshot``), into pageable buffers and into pinned ones (the default for CUDA tensors:
    the copies queued without waiting, then one synchronize). The first save allocates its buffers; the later
    ones reuse them: their median is a save's wait in a run."""
    import torch

    from gptlab.model.config import GPTConfig
    from gptlab.model.gpt import GPT
    from gptlab.parallel.checkpoint_io import HostSnapshot, tensor_bytes

    device = _torch_device(ctx)
    config = ctx.sizes(
        GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768),
        GPTConfig(vocab_size=512, block_size=64, n_layer=1, n_head=2, n_embd=32),
    )
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, config.vocab_size, (1, 64), device=device)
    model(x, x)[1].backward()
    optimizer.step()  # the moments exist, as in a checkpoint saved during training
    checkpoint = {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "global_step": 1,
    }
    size = tensor_bytes(checkpoint)
    rows = []
    for label, pin in (("pageable", False), ("pinned", None)):
        snapshot = HostSnapshot(pin=pin)
        t0 = time.perf_counter()
        first = snapshot.take(checkpoint)
        first_s = time.perf_counter() - t0
        waits = []
        for _ in range(ctx.sizes(5, 1)):
            t0 = time.perf_counter()
            snapshot.take(checkpoint)  # returns once every byte is on the host
            waits.append(time.perf_counter() - t0)
        wait = statistics.median(waits)
        same = all(torch.equal(first["state_dict"][k], v.cpu()) for k, v in checkpoint["state_dict"].items())
        rows.append(
            {
                "buffers": label,
                "checkpoint_mb": round(size / 1e6, 1),
                "pinned_mb": round(snapshot.pinned_bytes() / 1e6, 1),
                "first_save_ms": round(first_s * 1e3, 1),
                "wait_per_save_ms": round(wait * 1e3, 2),
                "gb_per_s": round(size / wait / 1e9, 1) if wait > 0 else None,
                "same_bytes": same,
            }
        )
        del snapshot, first
    ok = all(r["same_bytes"] for r in rows)
    return {"ok": ok, "rows": rows}


#: word2vec's batch sizes (windows a step) timed on each device: its default and two larger ones, which give a
#: GPU fewer and larger kernels (the embedded corpus is small: 67,881 words an epoch)
WORD2VEC_BATCHES = (256, 1024, 4096)


def section_head_accuracy(ctx: Context) -> dict[str, Any]:
    """Each loss.impl's gradients through a 2-layer model under bf16 autocast against the fp32 plain head's
    (scripts/head_gradient_accuracy.py), with Cut Cross-Entropy's arithmetic followed in torch beside its kernel:
    per implementation the largest relative error over the parameters, and where it was."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location(
        "head_gradient_accuracy", ROOT / "scripts" / "head_gradient_accuracy.py"
    )
    assert spec is not None and spec.loader is not None
    accuracy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(accuracy)
    device = _torch_device(ctx)
    vocab, width = ctx.sizes((50257, 256), (4096, 64))
    # the arithmetic in one tile order on the GPU (its second order is the CPU script's: a few seconds more)
    errors = accuracy.gradient_errors(device, seeds=ctx.sizes(1, 2), vocab_size=vocab, width=width)
    rows = []
    for impl, per_parameter in errors.items():
        where = max(per_parameter, key=lambda p: per_parameter[p])
        rows.append(
            {
                "impl": impl,
                "largest_error": f"{per_parameter[where]:.2e}",
                "at": where,
                "ln_f.weight": f"{per_parameter['transformer.ln_f.weight']:.2e}",
                "median": f"{sorted(per_parameter.values())[len(per_parameter) // 2]:.2e}",
            }
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ok = all(math.isfinite(max(e.values())) for e in errors.values())
    return {"ok": ok, "rows": rows}


def section_word2vec(ctx: Context) -> dict[str, Any]:
    """``task=word2vec`` on the embedded corpus, two epochs, at each of ``WORD2VEC_BATCHES`` on CUDA and on the
    CPU (its worker processes on every core): words/s and the final loss of each, and for each batch size
    CUDA's rate over the CPU's, against the rule ``word2vec.device=auto`` follows (CUDA from batch 1,024: an
    H200 measured 0.69x the CPU at 256, 2.19x at 1,024, 5.83x at 4,096)."""
    from gptlab.tasks.word2vec import run as run_word2vec
    from gptlab.word2vec.task import CUDA_FROM_BATCH

    device = _torch_device(ctx)
    if device.type == "cuda":  # the CUDA context and cuBLAS made before the first row's clock, not inside it
        import torch

        a = torch.randn(256, 100, device=device)
        a.index_add_(0, torch.arange(256, device=device), a @ a.t() @ a)
        _sync(device)
    rows = []
    devices = ("cpu",) if ctx.smoke else ("cuda", "cpu")
    batches = ctx.sizes(WORD2VEC_BATCHES, WORD2VEC_BATCHES[:2])
    for batch in batches:
        rates: dict[str, float] = {}
        for device in devices:
            out = ctx.out / f"word2vec-{device}-batch{batch}"
            cfg = _compose(
                "task=word2vec",
                f"word2vec.device={device}",
                f"word2vec.batch_size={batch}",
                "word2vec.evaluate=false",
                "word2vec.epochs=2",
                f"word2vec.dim={ctx.sizes(100, 16)}",
                "logger=none",
                f"paths.root_dir={ctx.out / 'word2vec-cache'}",
                f"paths.output_dir={out}",
            )
            metrics = run_word2vec(cfg)
            rates[device] = metrics["train/words_per_second"]
            rows.append(
                {
                    "device": device,
                    "batch_size": batch,
                    "words_per_s": round(rates[device]),
                    "words": int(metrics["train/words"]),
                    "seconds": round(metrics["train/seconds"], 2),
                    # a batch too large for the learning rate diverges: its rate is no reason to choose it
                    "final_loss": round(metrics["train/loss"], 4),
                }
            )
        if len(rates) == 2:
            rows[-2]["cuda_over_cpu"] = round(rates["cuda"] / rates["cpu"], 2)
    ok = all(r["words_per_s"] > 0 for r in rows)
    return {
        "ok": ok,
        "rows": rows,
        "auto_chooses": f"cuda from batch {CUDA_FROM_BATCH:,} where it is available (word2vec/task.py)",
    }


# Each section's time limit on the GPU (--cpu-smoke: times SMOKE_SLOWDOWN). Together 463 s: with the wheels'
# install and the start, within WHOLE_RUN_S, under the 8 minutes a GPU session gives the check.
# On an H200 at a1bd19e the sections took 9.1, 167.6, 38.6, 25.6 s (environment to loss) and 11.8 s (word2vec)
# in one run; head_accuracy, attention, strategies, checkpoint_copy and main_command (three processes then)
# ran past their limits there (25, 39, 39, 15, 83 s, leftovers included) and took 23.4, 23.9, 45.6, 19.9 and
# 121.5 s in a second run on the same machine, torch's compile caches warm. Since then main_command runs two
# processes (73.6 s of the 121.5; the third, --foreground-save, on request), head_accuracy follows Cut
# Cross-Entropy's arithmetic in one tile order (the CPU script gives the second), and attention's FlexAttention
# rows follow the SDPA rows that compile the head's kernel. The last section's limit is below what it takes: it
# also gets every second the sections before it leave (section_budget), and is the one that loses it where
# another hangs.
SECTIONS = [
    Section("environment", 12, section_environment),
    Section("gpu_tests", 172, section_gpu_tests),
    Section("gpt2", 42, section_gpt2),
    Section("loss", 28, section_loss),
    Section("head_accuracy", 20, section_head_accuracy),
    Section("attention", 42, section_attention),
    Section("strategies", 50, section_strategies),
    Section("checkpoint_copy", 22, section_checkpoint_copy),
    Section("word2vec", 14, section_word2vec),
    Section("main_command", 61, section_main_command),
]


def section_budget(limits: list[float], left: float) -> float:
    """The seconds the first of the sections still to run may take, given their time ``limits`` in order and
    ``left`` seconds for them all: everything but what the later sections are owed, so its own limit plus what
    earlier sections left unused. A section that hangs to the end of its budget then costs only that: every later
    section keeps its whole limit. When ``left`` cannot hold every limit, each gets its proportional share."""
    own, later = limits[0], sum(limits[1:])
    if left >= own + later:
        return left - later
    return max(0.0, left) * own / (own + later)


# ---- running the sections -----------------------------------------------------------------------------------
def run_section(name: str, ctx: Context) -> dict[str, Any]:
    """One section in this process: its result, or its error (never raises)."""
    section = next(s for s in SECTIONS if s.name == name)
    t0 = time.perf_counter()
    try:
        result = section.run(ctx)
        result["status"] = "ok" if result.get("ok") else "FAILED"
    except Exception as e:
        result = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return result


def run_in_child(section: Section, ctx: Context, budget_s: float) -> dict[str, Any]:
    """One section in a child process, stopped after ``budget_s``: a crash or hang costs this section only."""
    result_file = ctx.out / f"section-{section.name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", section.name, "--out", str(ctx.out)]
    cmd += ["--cpu-smoke"] if ctx.smoke else []
    cmd += [] if ctx.with_compile else ["--no-compile"]
    cmd += ["--foreground-save"] if ctx.foreground_save else []
    t0 = time.perf_counter()
    log = ctx.out / f"section-{section.name}.log"
    with open(log, "w") as f:
        # a session of its own: at the time limit the section goes with every process it started (train.py)
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True
        )
        try:
            proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"status": "timeout", "error": f"stopped after its {budget_s:g} s", "seconds": budget_s}
    if result_file.exists():
        from gptlab.runs.jsonfile import figures_from_json

        return figures_from_json(json.loads(result_file.read_text()))  # "nan" back to NaN for the table
    tail = log.read_text()[-2000:]
    return {
        "status": "error",
        "error": f"exited {proc.returncode}: {tail}",
        "seconds": time.perf_counter() - t0,
    }


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """One table per section (its rows' keys as columns), under a line with its status and seconds."""
    lines = ["# gptlab GPU check", ""]
    env = results.get("environment", {}).get("info", {})
    if env:
        lines += [
            f"{env.get('device')}, torch {env.get('torch')} (CUDA {env.get('cuda')}), commit {env.get('commit')}",
            "",
        ]
    for name, result in results.items():
        lines.append(f"## {name}: {result.get('status')} ({result.get('seconds')} s)")
        lines.append("")
        if result.get("error"):
            lines += ["```text", str(result["error"])[-1500:], "```", ""]
        rows = [r for r in result.get("rows", []) if isinstance(r, dict)]
        if rows:
            columns = list(dict.fromkeys(k for r in rows for k in r))
            lines.append("| " + " | ".join(columns) + " |")
            lines.append("|" + "---|" * len(columns))
            for r in rows:
                lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
            lines.append("")
        for key in ("fastest", "auto_chooses"):
            if key in result:
                lines += [f"{key}: {result[key]}", ""]
        for title, profile in result.get("profiles", {}).items():
            lines += [f"Profile of a step, {title}: its operations by their own time", ""]
            if profile:
                columns = list(profile[0])
                lines.append("| " + " | ".join(columns) + " |")
                lines.append("|" + "---|" * len(columns))
                lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in profile]
            lines.append("")
    return "\n".join(lines)


def write_report(results: dict[str, dict[str, Any]], out: Path, summary: Path | None = None) -> None:
    """gpu_check.json and gpu_check.md in ``out``; also, with gpu_tests.log, in ``summary`` (a folder that
    should receive a few files only, like the device machine's $OUT)."""
    from gptlab.runs.jsonfile import all_figures_as_json, write_json

    for folder in (out, summary) if summary else (out,):
        folder.mkdir(parents=True, exist_ok=True)
        # strict JSON (gptlab.runs.jsonfile), whole: a figure a section could not measure finitely as "nan"
        write_json(folder / "gpu_check.json", all_figures_as_json(results, default=str))
        (folder / "gpu_check.md").write_text(markdown(results) + "\n")
        log = out / "gpu_tests.log"
        if folder != out and log.exists():
            (folder / "gpu_tests.log").write_text(log.read_text())


def install_wheels(folder: Path) -> None:
    """Install the wheels into SITE (no index, no dependencies) and record their names. SITE is emptied first:
    what an earlier folder of wheels put there (another Python's build, a package since dropped) never stays."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(
            f"gpu_check: no wheels in {folder}: run scripts/make_gpu_wheels.sh where the index is"
        )
    shutil.rmtree(SITE, ignore_errors=True)
    SITE.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
    ]
    cmd += ["--disable-pip-version-check", "--upgrade", "--target", str(SITE), *map(str, wheels)]
    try:
        subprocess.run(cmd, check=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.CalledProcessError as e:
        raise SystemExit(
            f"gpu_check: pip could not install the wheels in {folder} (exit {e.returncode})"
        ) from None
    except subprocess.TimeoutExpired:
        raise SystemExit(
            f"gpu_check: installing the wheels in {folder} took over {INSTALL_TIMEOUT_S} s"
        ) from None
    (SITE / "installed.txt").write_text("\n".join(w.name for w in wheels))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu_check", help="every file")
    parser.add_argument("--summary", type=Path, help="also write the JSON, the table and the test log here")
    parser.add_argument(
        "--wheels", type=Path, help="a folder of wheels to install first (make_gpu_wheels.sh)"
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="every section at toy size on the CPU")
    parser.add_argument("--only", nargs="+", choices=[s.name for s in SECTIONS], help="run these sections")
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds for all sections together (default: their limits' sum, 463 s, or less where the wheels' "
        "install leaves less of the whole command's 478 s)",
    )
    parser.add_argument("--no-compile", action="store_true", help="gpt2 without its torch.compile variant")
    parser.add_argument(
        "--foreground-save",
        action="store_true",
        help="main_command also with checkpoints written before the next step (a third train.py, ~45 s)",
    )
    parser.add_argument("--section", help=argparse.SUPPRESS)  # a child: run one section, write its JSON
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(
        smoke=args.cpu_smoke,
        out=args.out.resolve(),
        with_compile=not args.no_compile,
        foreground_save=args.foreground_save,
    )

    if args.section:
        result = run_section(args.section, ctx)
        from gptlab.runs.jsonfile import all_figures_as_json, write_json

        write_json(ctx.out / f"section-{args.section}.json", all_figures_as_json(result, default=str))
        return 0

    # the command's start, kept across the exec below: the install's time comes out of the sections' budget
    started = float(os.environ.get("GPTLAB_GPU_CHECK_STARTED", time.time()))
    if args.wheels and os.environ.get("GPTLAB_GPU_CHECK_SITE") != str(SITE):
        t0 = time.perf_counter()
        install_wheels(args.wheels)
        paths = [str(ROOT / "src"), str(SITE), os.environ.get("PYTHONPATH", "")]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            "GPTLAB_GPU_CHECK_SITE": str(SITE),
            "GPTLAB_GPU_CHECK_INSTALL_S": f"{time.perf_counter() - t0:.1f}",
            "GPTLAB_GPU_CHECK_STARTED": repr(started),
        }
        rest = [a for a in (argv if argv is not None else sys.argv[1:])]
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *rest], env)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p
    )

    selected = [s for s in SECTIONS if not args.only or s.name in args.only]
    # a CPU (smoke) is many times slower at the same toy work: compilation, process start-up
    slowdown = SMOKE_SLOWDOWN if ctx.smoke else 1
    limits = [s.budget_s * slowdown for s in selected]
    total_budget = args.budget or min(sum(limits), WHOLE_RUN_S * slowdown - (time.time() - started))
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for i, section in enumerate(selected):
        budget = section_budget(limits[i:], total_budget - (time.perf_counter() - start))
        if budget < 10:
            results[section.name] = {"status": "skipped", "error": "out of time", "seconds": 0}
            continue
        print(f"gpu_check: {section.name} (up to {budget:.0f} s)", flush=True)
        results[section.name] = run_in_child(section, ctx, budget)
        print(f"gpu_check: {section.name}: {results[section.name]['status']}", flush=True)
        write_report(results, ctx.out, args.summary)  # after each section: a kill keeps what was measured
    print(markdown(results))
    return 0 if all(r.get("status") == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
